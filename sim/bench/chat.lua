-- wrk script: small non-streaming chat completions; a distinct user message per request
-- (a shared system prompt, so every request is a partial cache hit and the tree keeps growing).
local counter = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  counter = counter + 1
  local body = '{"model":"llama-3-8b","messages":[{"role":"system","content":"You are a helpful assistant. Answer briefly."},{"role":"user","content":"Question number ' .. counter .. ' from thread ' .. tostring(wrk.thread) .. '?"}],"max_tokens":8,"ignore_eos":true}'
  return wrk.format(nil, "/v1/chat/completions", nil, body)
end
