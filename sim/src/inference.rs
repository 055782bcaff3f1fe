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

use crate::api::{self, ApiError, Kind, Parsed};
use crate::config::Config;
use crate::openai::{full_response, JobState, Meta, SseStream};
use crate::response::{error_resp, json_resp, respond, Resp, SimBody};
use crate::sched::{Cmd, SimRequest};
use crate::server::{unix_now, App, InflightGuard, MAX_BODY};
use crate::tokenizer;

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
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut jobs = Vec::with_capacity(parsed.jobs.len());
    for (index, j) in parsed.jobs.into_iter().enumerate() {
        let r = SimRequest {
            index,
            prompt: j.prompt.clone(),
            output: j.output.clone(),
            tx: tx.clone(),
            arrival: Instant::now(),
        };
        if app.sched.send(Cmd::Submit(r)).is_err() {
            return error_resp(&app, &ApiError::internal("scheduler is not running"));
        }
        jobs.push(JobState::new(j));
    }
    drop(tx);
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
        tx,
        arrival: Instant::now(),
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
