//! Request parsing and validation for the three inference endpoints (never panics on input).

use serde_json::Value;

use crate::config::Config;
use crate::tokenizer::{self, Finish};

/// An error answered as SGLang does: `{"object":"error","message":..,"type":..,"param":null,"code":..}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub code: u16,
    pub typ: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        ApiError {
            code: 400,
            typ: "BadRequestError",
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            code: 404,
            typ: "NotFoundError",
            message: message.into(),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            code: 503,
            typ: "ServiceUnavailableError",
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            code: 500,
            typ: "InternalServerError",
            message: message.into(),
        }
    }

    pub fn body(&self) -> String {
        serde_json::json!({
            "object": "error",
            "message": self.message,
            "type": self.typ,
            "param": null,
            "code": self.code,
        })
        .to_string()
    }
}

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
    Generate,
}

/// One generation job (one prompt).
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub finish: Finish,
    /// The request's output limit (`max_tokens` / `max_new_tokens`, else the default): what
    /// SGLang's scheduler reserves KV for, whatever the planned output length.
    pub max_new: usize,
}

/// A validated inference request.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub kind: Kind,
    pub jobs: Vec<Job>,
    pub stream: bool,
    pub include_usage: bool,
    /// Batch input (list prompt for /generate): answer with an array / indexed chunks.
    pub batch: bool,
    pub model: String,
    /// PD disaggregation fields (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).
    pub bootstrap: Fields,
}

/// Is this content type acceptable? FastAPI parses a body as JSON when the header is absent or
/// `application/json` / `application/*+json`; anything else fails validation (SGLang: 400).
pub fn json_content_type(ct: Option<&str>) -> bool {
    let Some(ct) = ct else {
        return true;
    };
    let main = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    main == "application/json" || (main.starts_with("application/") && main.ends_with("+json"))
}

fn opt_bool(v: &Value, key: &str) -> Result<bool, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(format!("'{key}' must be a boolean"))),
    }
}

fn opt_uint(v: &Value, key: &str) -> Result<Option<usize>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) => Ok(Some(n.min(u32::MAX as u64) as usize)),
            None => Err(ApiError::bad(format!(
                "'{key}' must be a non-negative integer"
            ))),
        },
    }
}

fn token_ids(v: &[Value], what: &str) -> Result<Vec<u32>, ApiError> {
    v.iter()
        .map(|t| {
            t.as_u64()
                .filter(|n| *n <= u32::MAX as u64)
                .map(|n| n as u32)
                .ok_or_else(|| ApiError::bad(format!("{what} must contain token ids (integers)")))
        })
        .collect()
}

/// Text of a chat message's `content` (string, array of parts, or null).
fn content_text(c: Option<&Value>) -> Result<String, ApiError> {
    match c {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for p in parts {
                match p {
                    Value::String(t) => s.push_str(t),
                    Value::Object(o) => {
                        if o.get("type").and_then(Value::as_str) == Some("text") {
                            match o.get("text") {
                                Some(Value::String(t)) => s.push_str(t),
                                _ => return Err(ApiError::bad("text content part needs 'text'")),
                            }
                        }
                    }
                    _ => return Err(ApiError::bad("invalid content part")),
                }
            }
            Ok(s)
        }
        Some(_) => Err(ApiError::bad(
            "'content' must be a string or an array of parts",
        )),
    }
}

fn check_model(v: &Value, cfg: &Config) -> Result<(), ApiError> {
    match v.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if m == &cfg.model || m.is_empty() => Ok(()),
        Some(Value::String(m)) => Err(ApiError::not_found(format!(
            "The model `{m}` does not exist."
        ))),
        Some(_) => Err(ApiError::bad("'model' must be a string")),
    }
}

fn check_len(prompt_len: usize, max_new: usize, cfg: &Config) -> Result<(), ApiError> {
    if prompt_len >= cfg.context_length {
        return Err(ApiError::bad(format!(
            "The input ({prompt_len} tokens) is longer than the model's context length ({} tokens).",
            cfg.context_length
        )));
    }
    if prompt_len + max_new > cfg.context_length {
        return Err(ApiError::bad(format!(
            "Requested token count exceeds the model's maximum context length of {} tokens. \
             You requested a total of {} tokens: {prompt_len} tokens from the input messages and \
             {max_new} tokens for the completion. Please reduce the number of tokens in the input \
             messages or the completion to fit within the limit.",
            cfg.context_length,
            prompt_len + max_new
        )));
    }
    if prompt_len + max_new > cfg.max_total_tokens {
        return Err(ApiError::bad(format!(
            "Request needs {} KV tokens, more than max_total_num_tokens ({}).",
            prompt_len + max_new,
            cfg.max_total_tokens
        )));
    }
    Ok(())
}

fn job(prompt: Vec<u32>, max_new: usize, ignore_eos: bool, cfg: &Config) -> Result<Job, ApiError> {
    check_len(prompt.len(), max_new, cfg)?;
    let (output, finish) = tokenizer::plan_output(&prompt, max_new, ignore_eos);
    Ok(Job {
        prompt,
        output,
        finish,
        max_new,
    })
}

/// Parses and validates an inference request body.
pub fn parse(kind: Kind, body: &[u8], cfg: &Config) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("Invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("Request body must be a JSON object"));
    }
    let stream = opt_bool(&v, "stream")?;
    let bootstrap = fields(&v)?;
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o @ Value::Object(_)) => opt_bool(o, "include_usage")?,
        Some(_) => return Err(ApiError::bad("'stream_options' must be an object")),
    };
    match kind {
        Kind::Chat | Kind::Completion => {
            check_model(&v, cfg)?;
            let max_new = match opt_uint(&v, "max_completion_tokens")? {
                Some(n) => n,
                None => opt_uint(&v, "max_tokens")?.unwrap_or(cfg.default_max_tokens),
            };
            let ignore_eos = opt_bool(&v, "ignore_eos")?;
            let prompts: Vec<Vec<u32>> = if kind == Kind::Chat {
                let Some(Value::Array(msgs)) = v.get("messages") else {
                    return Err(ApiError::bad("'messages' must be a non-empty array"));
                };
                if msgs.is_empty() {
                    return Err(ApiError::bad("'messages' must be a non-empty array"));
                }
                let mut pairs = Vec::with_capacity(msgs.len());
                for m in msgs {
                    let Some(role) = m.get("role").and_then(Value::as_str) else {
                        return Err(ApiError::bad("each message needs a string 'role'"));
                    };
                    pairs.push((role.to_string(), content_text(m.get("content"))?));
                }
                vec![tokenizer::chat_prompt(
                    pairs.iter().map(|(r, c)| (r.as_str(), c.as_str())),
                )]
            } else {
                match v.get("prompt") {
                    Some(Value::String(s)) => vec![tokenizer::text_prompt(s)],
                    Some(Value::Array(a)) if !a.is_empty() => match &a[0] {
                        Value::Number(_) => vec![token_ids(a, "prompt")?],
                        Value::String(_) => a
                            .iter()
                            .map(|p| match p {
                                Value::String(s) => Ok(tokenizer::text_prompt(s)),
                                _ => Err(ApiError::bad("prompt list items must all be strings")),
                            })
                            .collect::<Result<_, _>>()?,
                        Value::Array(_) => a
                            .iter()
                            .map(|p| match p {
                                Value::Array(ids) if !ids.is_empty() => token_ids(ids, "prompt"),
                                _ => Err(ApiError::bad("prompt must be a list of token id lists")),
                            })
                            .collect::<Result<_, _>>()?,
                        _ => return Err(ApiError::bad("invalid 'prompt'")),
                    },
                    Some(Value::Array(_)) => return Err(ApiError::bad("'prompt' is empty")),
                    None | Some(Value::Null) => {
                        return Err(ApiError::bad("'prompt' is required"));
                    }
                    Some(_) => return Err(ApiError::bad("invalid 'prompt'")),
                }
            };
            let jobs = prompts
                .into_iter()
                .map(|p| job(p, max_new, ignore_eos, cfg))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Parsed {
                kind,
                batch: jobs.len() > 1,
                jobs,
                stream,
                include_usage,
                model: cfg.model.clone(),
                bootstrap,
            })
        }
        Kind::Generate => {
            let sp = match v.get("sampling_params") {
                None | Some(Value::Null) => Value::Object(Default::default()),
                Some(o @ Value::Object(_)) => o.clone(),
                Some(_) => return Err(ApiError::bad("'sampling_params' must be an object")),
            };
            let max_new = opt_uint(&sp, "max_new_tokens")?.unwrap_or(cfg.default_max_tokens);
            let ignore_eos = opt_bool(&sp, "ignore_eos")?;
            let (prompts, batch): (Vec<Vec<u32>>, bool) = match (v.get("text"), v.get("input_ids"))
            {
                (Some(Value::String(s)), _) => (vec![tokenizer::text_prompt(s)], false),
                (Some(Value::Array(a)), _) if !a.is_empty() => (
                    a.iter()
                        .map(|p| match p {
                            Value::String(s) => Ok(tokenizer::text_prompt(s)),
                            _ => Err(ApiError::bad("'text' list items must be strings")),
                        })
                        .collect::<Result<_, _>>()?,
                    true,
                ),
                (None | Some(Value::Null), Some(Value::Array(a))) if !a.is_empty() => {
                    if a[0].is_array() {
                        (
                            a.iter()
                                .map(|p| match p {
                                    Value::Array(ids) if !ids.is_empty() => {
                                        token_ids(ids, "input_ids")
                                    }
                                    _ => Err(ApiError::bad("invalid 'input_ids'")),
                                })
                                .collect::<Result<_, _>>()?,
                            true,
                        )
                    } else {
                        (vec![token_ids(a, "input_ids")?], false)
                    }
                }
                (None | Some(Value::Null), None | Some(Value::Null)) => {
                    return Err(ApiError::bad(
                        "Either text or input_ids should be provided.",
                    ))
                }
                _ => return Err(ApiError::bad("invalid 'text' or 'input_ids'")),
            };
            let jobs = prompts
                .into_iter()
                .map(|p| job(p, max_new, ignore_eos, cfg))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Parsed {
                kind,
                jobs,
                stream,
                include_usage,
                batch,
                model: cfg.model.clone(),
                bootstrap,
            })
        }
    }
}

/// The bootstrap fields of one request (all optional at parse time; each mode checks what it
/// needs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fields {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub room: Option<u64>,
}

/// Reads `bootstrap_host`, `bootstrap_port`, `bootstrap_room` from a request body. Lists
/// (SGLang's batched form) are refused: the simulator names one room per HTTP request.
pub fn fields(v: &Value) -> Result<Fields, ApiError> {
    let host = match v.get("bootstrap_host") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::bad("'bootstrap_host' must be a string")),
    };
    let port = match v.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64().and_then(|n| u16::try_from(n).ok()) {
            Some(p) => Some(p),
            None => return Err(ApiError::bad("'bootstrap_port' must be a port number")),
        },
    };
    let room = match v.get("bootstrap_room") {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(r) => Some(r),
            None => {
                return Err(ApiError::bad(
                    "'bootstrap_room' must be a non-negative integer (lists are not supported)",
                ))
            }
        },
    };
    Ok(Fields { host, port, room })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kind: Kind, body: &str) -> Result<Parsed, ApiError> {
        parse(kind, body.as_bytes(), &Config::default())
    }

    #[test]
    fn completion_prompt_forms() {
        assert_eq!(
            p(Kind::Completion, r#"{"prompt":"abc"}"#)
                .unwrap()
                .jobs
                .len(),
            1
        );
        let b = p(Kind::Completion, r#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(b.jobs.len(), 2);
        assert!(b.batch);
        let t = p(Kind::Completion, r#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(t.jobs[0].prompt, vec![1, 2, 3]);
        assert_eq!(
            p(Kind::Completion, r#"{"prompt":[[1],[2,3]]}"#)
                .unwrap()
                .jobs
                .len(),
            2
        );
        for bad in [
            r#"{}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":{"x":1}}"#,
            r#"{"prompt":"a","max_tokens":-1}"#,
            r#"{"prompt":"a","max_tokens":"3"}"#,
            r#"{"prompt":"a","stream":"yes"}"#,
            r#"[1]"#,
            r#"{"prompt":"a""#,
        ] {
            assert_eq!(p(Kind::Completion, bad).unwrap_err().code, 400, "{bad}");
        }
    }

    #[test]
    fn model_checks() {
        assert!(p(
            Kind::Chat,
            r#"{"model":"llama-3-8b","messages":[{"role":"user","content":"x"}]}"#
        )
        .is_ok());
        assert!(p(
            Kind::Chat,
            r#"{"messages":[{"role":"user","content":"x"}]}"#
        )
        .is_ok());
        let e = p(
            Kind::Chat,
            r#"{"model":"gpt","messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.code, 404);
        assert_eq!(p(Kind::Chat, r#"{"messages":[]}"#).unwrap_err().code, 400);
    }

    #[test]
    fn chat_content_parts_equal_string() {
        let a = p(
            Kind::Chat,
            r#"{"messages":[{"role":"user","content":"hello world"}]}"#,
        )
        .unwrap();
        let b = p(
            Kind::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello "},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"world"}]}]}"#,
        )
        .unwrap();
        assert_eq!(a.jobs[0].prompt, b.jobs[0].prompt);
    }

    #[test]
    fn generate_forms_and_limits() {
        let g = p(
            Kind::Generate,
            r#"{"text":"hi","sampling_params":{"max_new_tokens":5,"ignore_eos":true}}"#,
        )
        .unwrap();
        assert_eq!(g.jobs[0].output.len(), 5);
        assert!(p(Kind::Generate, r#"{"input_ids":[1,2]}"#).is_ok());
        assert!(
            p(Kind::Generate, r#"{"input_ids":[[1,2],[3]]}"#)
                .unwrap()
                .batch
        );
        assert_eq!(p(Kind::Generate, r#"{}"#).unwrap_err().code, 400);
        let long = format!(r#"{{"text":"{}"}}"#, "a".repeat(40_000));
        assert_eq!(p(Kind::Generate, &long).unwrap_err().code, 400);
    }

    #[test]
    fn content_types() {
        assert!(json_content_type(None));
        assert!(json_content_type(Some("application/json; charset=utf-8")));
        assert!(json_content_type(Some("application/vnd.api+json")));
        assert!(!json_content_type(Some("text/plain")));
        assert!(!json_content_type(Some(
            "application/x-www-form-urlencoded"
        )));
    }
}
