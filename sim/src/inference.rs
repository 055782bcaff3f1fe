//! Inference handlers: `/v1/chat/completions`, `/v1/completions`, `/generate` and
//! `/health_generate` (requests go through the scheduler; streaming answers send their head
//! with the first token, as SGLang does).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use tokio::sync::mpsc;

use crate::api::Fields;
use crate::api::{self, ApiError, Kind, Parsed};
use crate::app::{unix_now, App, InflightGuard, MAX_BODY};
use crate::config::Config;
use crate::config::Mode;
use crate::openai::{full_response, JobState, Meta, SseStream};
use crate::pd::{self, Kv};
use crate::response::{error_resp, json_resp, respond, Resp, SimBody};
use crate::sched::{Cmd, SimRequest};
use crate::tokenizer::{self, Finish};

/// Deterministic fault injection: is request number `n` one of the failing fraction?
fn injected_failure(cfg: &Config, n: u64) -> bool {
    if cfg.fail_rate <= 0.0 {
        return false;
    }
    let u = (tokenizer::mix(cfg.seed.wrapping_mul(0x9E37_79B9) ^ tokenizer::mix(n)) >> 11) as f64
        / (1u64 << 53) as f64;
    u < cfg.fail_rate
}

pub(crate) async fn inference(app: Arc<App>, kind: Kind, req: Request<Incoming>) -> Resp {
    if app.draining.load(Ordering::SeqCst) {
        return error_resp(&app, &ApiError::unavailable("Server is shutting down"));
    }
    let guard = InflightGuard::new(&app);
    let ctype = req
        .headers()
        .get(CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("invalid"));
    if !api::json_content_type(ctype) {
        return error_resp(
            &app,
            &ApiError::bad(format!(
                "Unsupported content type {:?}; expected application/json",
                ctype.unwrap_or("")
            )),
        );
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_resp(&app, &ApiError::bad(format!("Could not read body: {e}"))),
    };
    let parsed: Parsed = match api::parse(kind, &body, &app.cfg) {
        Ok(p) => p,
        Err(e) => return error_resp(&app, &e),
    };
    if app.cfg.slow_ms > 0 {
        tokio::time::sleep(Duration::from_millis(app.cfg.slow_ms)).await;
    }
    let n = app.req_counter.fetch_add(1, Ordering::Relaxed);
    if injected_failure(&app.cfg, n) {
        return error_resp(
            &app,
            &ApiError::internal("Internal server error (injected fault, --fail-rate)"),
        );
    }
    let meta = Meta {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{}", app.next_id()),
            Kind::Completion => format!("cmpl-{}", app.next_id()),
            Kind::Generate => app.next_id(),
        },
        created: unix_now(),
        model: parsed.model.clone(),
        include_usage: parsed.include_usage,
        batch: parsed.batch,
        start: Instant::now(),
    };
    let mode = app.cfg.disaggregation_mode;
    let room = match pd_role(&app, &parsed.bootstrap) {
        Ok(r) => r,
        Err(e) => return error_resp(&app, &e),
    };
    // decode: the prompt's KV comes from the prefill worker named in the request
    let mut prefilled: Option<Kv> = None;
    if let (Mode::Decode, Some(room)) = (mode, room) {
        let host = parsed.bootstrap.host.as_deref().unwrap_or("");
        let port = parsed.bootstrap.port.unwrap_or(0);
        let timeout = Duration::from_secs_f64(app.cfg.disaggregation_timeout_s);
        match pd::fetch(&app.disagg, host, port, room, timeout).await {
            Ok(kv) => prefilled = Some(kv),
            Err(e) => return error_resp(&app, &pd::fetch_error(&app.disagg, &e, room, timeout)),
        }
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut jobs = Vec::with_capacity(parsed.jobs.len());
    for (index, mut j) in parsed.jobs.into_iter().enumerate() {
        if mode == Mode::Prefill {
            // a prefill worker computes the prompt's KV and the first token only
            j.output.truncate(1);
            j.finish = Finish::Length;
            j.max_new = j.max_new.min(1);
        }
        let r = SimRequest {
            index,
            prompt: j.prompt.clone(),
            output: j.output.clone(),
            max_new: j.max_new,
            tx: tx.clone(),
            arrival: Instant::now(),
            prefilled: prefilled
                .as_ref()
                .map(|kv| kv.cached.get(index).copied().unwrap_or(0)),
        };
        if app.sched.send(Cmd::Submit(r)).is_err() {
            return error_resp(&app, &ApiError::internal("scheduler is not running"));
        }
        jobs.push(JobState::new(j));
    }
    drop(tx);
    if let (Mode::Prefill, Some(room)) = (mode, room) {
        app.disagg.prefilling(room);
        // If this handler is dropped before the KV is ready (the client, e.g. Envoy's mirror,
        // went away), the room fails at once instead of leaving its decode worker waiting for
        // the whole timeout (SGLang aborts a disconnected request the same way).
        let mut pending = pd::Pending::new(&app.disagg, room, &app.cfg.worker_id);
        // wait for the prompt's KV, hand it to the room, then answer from what was recorded
        let mut seen = Vec::with_capacity(jobs.len());
        let mut cached = vec![0usize; jobs.len()];
        let mut left = jobs.len();
        while left > 0 {
            let Some(p) = rx.recv().await else {
                return error_resp(&app, &ApiError::internal("generation aborted"));
            };
            if let Some(c) = cached.get_mut(p.index) {
                *c = p.cached;
            }
            if p.finished {
                left -= 1;
            }
            seen.push(p);
        }
        pending.ready(Kv { cached });
        let (tx2, rx2) = mpsc::unbounded_channel();
        for p in seen {
            let _ = tx2.send(p);
        }
        rx = rx2;
    }
    if parsed.stream {
        // SGLang waits for the first output before sending the response head, so the
        // time to the first byte is the TTFT.
        let Some(first) = rx.recv().await else {
            return error_resp(&app, &ApiError::internal("generation aborted"));
        };
        let mut s = SseStream {
            rx,
            meta,
            jobs,
            pending: VecDeque::new(),
            done: false,
            _guard: guard,
        };
        s.on_progress(first);
        let mut r = Response::new(SimBody::Sse(Box::new(s)));
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert("cache-control", HeaderValue::from_static("no-cache"));
        h.insert("x-worker-id", app.worker_header.clone());
        return r;
    }
    let mut left = jobs.len();
    while left > 0 {
        let Some(p) = rx.recv().await else {
            return error_resp(&app, &ApiError::internal("generation aborted"));
        };
        if let Some(j) = jobs.get_mut(p.index) {
            j.generated = p.generated;
            j.cached = p.cached;
            if p.finished && !j.finished {
                j.finished = true;
                left -= 1;
            }
        }
    }
    let v = full_response(&meta, &jobs);
    drop(guard);
    json_resp(&app, StatusCode::OK, &v)
}

/// Checks the request's bootstrap fields against the worker's disaggregation mode; returns the
/// room a prefill or decode worker serves (`None` when not disaggregated).
fn pd_role(app: &App, f: &Fields) -> Result<Option<u64>, ApiError> {
    match app.cfg.disaggregation_mode {
        Mode::Null => Ok(None),
        Mode::Prefill => match f.room {
            Some(r) => Ok(Some(r)),
            None => Err(ApiError::bad(
                "bootstrap_room is required on a prefill worker (--disaggregation-mode prefill)",
            )),
        },
        Mode::Decode => match (&f.host, f.port, f.room) {
            (Some(_), Some(_), Some(r)) => Ok(Some(r)),
            _ => Err(ApiError::bad(
                "bootstrap_host, bootstrap_port and bootstrap_room are required on a decode \
                 worker (--disaggregation-mode decode)",
            )),
        },
    }
}

pub(crate) async fn health_generate(app: Arc<App>) -> Resp {
    if app.draining.load(Ordering::SeqCst) {
        return respond(&app, StatusCode::SERVICE_UNAVAILABLE, "text/plain", "");
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let prompt = vec![tokenizer::BOS];
    let (output, _) = tokenizer::plan_output(&prompt, 1, true);
    let r = SimRequest {
        index: 0,
        prompt,
        output,
        max_new: 1,
        tx,
        arrival: Instant::now(),
        prefilled: None,
    };
    if app.sched.send(Cmd::Submit(r)).is_err() {
        return respond(&app, StatusCode::SERVICE_UNAVAILABLE, "text/plain", "");
    }
    let wait = async {
        while let Some(p) = rx.recv().await {
            if p.finished {
                return true;
            }
        }
        false
    };
    match tokio::time::timeout(Duration::from_secs(20), wait).await {
        Ok(true) => respond(&app, StatusCode::OK, "text/plain", ""),
        _ => respond(&app, StatusCode::SERVICE_UNAVAILABLE, "text/plain", ""),
    }
}
