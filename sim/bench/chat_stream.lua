-- wrk script: small streaming chat completions (SSE), distinct prompt per request.
local counter = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  counter = counter + 1
  local body = '{"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Stream question ' .. counter .. '"}],"max_tokens":8,"ignore_eos":true,"stream":true}'
  return wrk.format(nil, "/v1/chat/completions", nil, body)
end
