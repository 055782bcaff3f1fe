//! HTTP server (hyper 1, HTTP/1.1): routing, response formats, SSE framing, drain.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::api::{self, ApiError, Job, Kind, Parsed};
use crate::config::Config;
use crate::metrics::Stats;
use crate::sched::{self, Cmd, Progress, SimRequest};
use crate::tokenizer::{self, Finish};

/// Request bodies larger than this are refused (400).
pub const MAX_BODY: usize = 64 << 20;

/// Shared server state.
pub struct App {
    pub cfg: Config,
    pub stats: Arc<Mutex<Stats>>,
    sched: mpsc::UnboundedSender<Cmd>,
    pub draining: AtomicBool,
    /// Inference requests not yet fully answered (bodies included).
    pub inflight: AtomicUsize,
    req_counter: AtomicU64,
    worker_header: HeaderValue,
    started: u64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl App {
    /// Creates the state and spawns the scheduler task (call inside a tokio runtime).
    pub fn new(cfg: Config) -> Arc<App> {
        let stats = Arc::new(Mutex::new(Stats::new(cfg.max_total_tokens)));
        let sched = sched::spawn(cfg.clone(), stats.clone());
        let worker_header = HeaderValue::from_str(&cfg.worker_id)
            .unwrap_or_else(|_| HeaderValue::from_static("invalid-worker-id"));
        Arc::new(App {
            cfg,
            stats,
            sched,
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            req_counter: AtomicU64::new(0),
            worker_header,
            started: unix_now(),
        })
    }

    fn next_id(&self) -> String {
        let n = self.req_counter.fetch_add(1, Ordering::Relaxed);
        format!(
            "{:016x}{:016x}",
            tokenizer::mix(self.cfg.seed ^ self.cfg.port as u64),
            tokenizer::mix(n)
        )
    }

    /// Scheduler queue sizes (running, waiting).
    pub fn load(&self) -> (usize, usize, usize) {
        match self.stats.lock() {
            Ok(s) => (s.num_running, s.num_waiting, s.used_tokens),
            Err(_) => (0, 0, 0),
        }
    }
}

/// Decrements `inflight` when dropped (kept by handlers and by streaming bodies).
struct InflightGuard(Arc<App>);

impl InflightGuard {
    fn new(app: &Arc<App>) -> Self {
        app.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard(app.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Response body: a complete buffer or an SSE stream fed by the scheduler.
pub enum SimBody {
    Full(Option<Bytes>),
    Sse(Box<SseStream>),
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Sse(s) => s.poll_next(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Sse(_) => SizeHint::default(),
        }
    }
}

type Resp = Response<SimBody>;

fn respond(app: &App, status: StatusCode, ctype: &'static str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(SimBody::Full(Some(body.into())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(ctype));
    r.headers_mut()
        .insert("x-worker-id", app.worker_header.clone());
    r
}

fn json_resp(app: &App, status: StatusCode, v: &Value) -> Resp {
    respond(app, status, "application/json", v.to_string())
}

fn error_resp(app: &App, e: &ApiError) -> Resp {
    let status = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    respond(app, status, "application/json", e.body())
}

fn detail(app: &App, status: StatusCode, msg: &str) -> Resp {
    json_resp(app, status, &json!({ "detail": msg }))
}

/// Per-job state kept while answering.
struct JobState {
    prompt_tokens: usize,
    output: Vec<u32>,
    finish: Finish,
    cached: usize,
    generated: usize,
    finished: bool,
    role_sent: bool,
}

impl JobState {
    fn new(j: Job) -> Self {
        JobState {
            prompt_tokens: j.prompt.len(),
            output: j.output,
            finish: j.finish,
            cached: 0,
            generated: 0,
            finished: false,
            role_sent: false,
        }
    }

    fn text(&self, from: usize, to: usize) -> String {
        tokenizer::detokenize(&self.output[from.min(self.output.len())..to.min(self.output.len())])
    }

    fn finish_reason(&self) -> &'static str {
        match self.finish {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }

    fn matched_stop(&self) -> Value {
        match self.finish {
            Finish::Stop => json!(tokenizer::EOT),
            Finish::Length => Value::Null,
        }
    }

    fn meta_finish(&self) -> Value {
        meta_finish(self.finish, self.generated)
    }
}

/// `/generate`'s `meta_info.finish_reason`.
fn meta_finish(finish: Finish, generated: usize) -> Value {
    match finish {
        Finish::Stop => json!({"type": "stop", "matched": tokenizer::EOT}),
        Finish::Length => json!({"type": "length", "length": generated}),
    }
}

/// Shared response metadata.
struct Meta {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    batch: bool,
    start: Instant,
}

fn usage(jobs: &[JobState]) -> Value {
    let p: usize = jobs.iter().map(|j| j.prompt_tokens).sum();
    let c: usize = jobs.iter().map(|j| j.generated).sum();
    let cached: usize = jobs.iter().map(|j| j.cached).sum();
    json!({
        "prompt_tokens": p,
        "total_tokens": p + c,
        "completion_tokens": c,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// SSE body: turns scheduler progress into SGLang-framed chunks.
pub struct SseStream {
    rx: mpsc::UnboundedReceiver<Progress>,
    meta: Meta,
    jobs: Vec<JobState>,
    pending: VecDeque<Bytes>,
    done: bool,
    _guard: InflightGuard,
}

impl SseStream {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.meta.kind {
            Kind::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        })
    }

    fn on_progress(&mut self, p: Progress) {
        let Some(j) = self.jobs.get(p.index) else {
            return;
        };
        let prev = j.generated;
        let new_text = j.text(prev, p.generated);
        let i = p.index;
        let mut frames = Vec::new();
        match self.meta.kind {
            Kind::Chat => {
                if !j.role_sent {
                    frames.push(self.chunk(json!([{
                        "index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}])));
                }
                if !new_text.is_empty() {
                    frames.push(self.chunk(json!([{
                        "index": i, "delta": {"content": new_text},
                        "logprobs": null, "finish_reason": null}])));
                }
                if p.finished {
                    frames.push(self.chunk(json!([{
                        "index": i, "delta": {}, "logprobs": null,
                        "finish_reason": j.finish_reason(), "matched_stop": j.matched_stop()}])));
                }
            }
            Kind::Completion => {
                if !new_text.is_empty() || p.finished {
                    let (fr, ms) = if p.finished {
                        (json!(j.finish_reason()), j.matched_stop())
                    } else {
                        (Value::Null, Value::Null)
                    };
                    frames.push(self.chunk(json!([{
                        "index": i, "text": new_text, "logprobs": null,
                        "finish_reason": fr, "matched_stop": ms}])));
                }
            }
            Kind::Generate => {
                let mut v = json!({
                    "text": j.text(0, p.generated),
                    "output_ids": &j.output[..p.generated.min(j.output.len())],
                    "meta_info": {
                        "id": self.meta.id,
                        "finish_reason": Value::Null,
                        "prompt_tokens": j.prompt_tokens,
                        "completion_tokens": p.generated,
                        "cached_tokens": p.cached,
                        "e2e_latency": self.meta.start.elapsed().as_secs_f64(),
                    }
                });
                if p.finished {
                    v["meta_info"]["finish_reason"] = meta_finish(j.finish, p.generated);
                }
                if self.meta.batch {
                    v["index"] = json!(i);
                }
                frames.push(v);
            }
        }
        for f in &frames {
            self.pending.push_back(sse(f));
        }
        if let Some(j) = self.jobs.get_mut(i) {
            j.role_sent = true;
            j.generated = p.generated;
            j.cached = p.cached;
            j.finished = p.finished;
        }
        if self.jobs.iter().all(|j| j.finished) {
            self.finish_stream();
        }
    }

    fn finish_stream(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if self.meta.include_usage && self.meta.kind != Kind::Generate {
            let u = usage(&self.jobs);
            let mut c = self.chunk(json!([]));
            c["usage"] = u;
            self.pending.push_back(sse(&c));
        }
        self.pending
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Poll::Ready(Some(b));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(p)) => self.on_progress(p),
                Poll::Ready(None) => {
                    // scheduler went away mid-stream: report an error frame and end
                    let e = ApiError::internal("generation aborted");
                    self.pending
                        .push_back(Bytes::from(format!("data: {}\n\n", e.body())));
                    self.finish_stream();
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

fn full_response(meta: &Meta, jobs: &[JobState]) -> Value {
    match meta.kind {
        Kind::Chat => {
            let choices: Vec<Value> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| {
                    json!({
                        "index": i,
                        "message": {"role": "assistant", "content": j.text(0, j.generated),
                                    "reasoning_content": null, "tool_calls": null},
                        "logprobs": null,
                        "finish_reason": j.finish_reason(),
                        "matched_stop": j.matched_stop(),
                    })
                })
                .collect();
            json!({"id": meta.id, "object": "chat.completion", "created": meta.created,
                   "model": meta.model, "choices": choices, "usage": usage(jobs)})
        }
        Kind::Completion => {
            let choices: Vec<Value> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| {
                    json!({"index": i, "text": j.text(0, j.generated), "logprobs": null,
                           "finish_reason": j.finish_reason(), "matched_stop": j.matched_stop()})
                })
                .collect();
            json!({"id": meta.id, "object": "text_completion", "created": meta.created,
                   "model": meta.model, "choices": choices, "usage": usage(jobs)})
        }
        Kind::Generate => {
            let e2e = meta.start.elapsed().as_secs_f64();
            let items: Vec<Value> = jobs
                .iter()
                .enumerate()
                .map(|(i, j)| {
                    json!({
                        "text": j.text(0, j.generated),
                        "output_ids": &j.output[..j.generated.min(j.output.len())],
                        "meta_info": {
                            "id": if meta.batch { format!("{}-{i}", meta.id) } else { meta.id.clone() },
                            "finish_reason": j.meta_finish(),
                            "prompt_tokens": j.prompt_tokens,
                            "completion_tokens": j.generated,
                            "cached_tokens": j.cached,
                            "e2e_latency": e2e,
                        }
                    })
                })
                .collect();
            if meta.batch {
                Value::Array(items)
            } else {
                items.into_iter().next().unwrap_or(Value::Null)
            }
        }
    }
}

/// Deterministic fault injection: is request number `n` one of the failing fraction?
fn injected_failure(cfg: &Config, n: u64) -> bool {
    if cfg.fail_rate <= 0.0 {
        return false;
    }
    let u = (tokenizer::mix(cfg.seed.wrapping_mul(0x9E37_79B9) ^ tokenizer::mix(n)) >> 11) as f64
        / (1u64 << 53) as f64;
    u < cfg.fail_rate
}

async fn inference(app: Arc<App>, kind: Kind, req: Request<Incoming>) -> Resp {
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

async fn health_generate(app: Arc<App>) -> Resp {
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

async fn flush_cache(app: Arc<App>) -> Resp {
    let (tx, rx) = oneshot::channel();
    let ok = app.sched.send(Cmd::Flush(tx)).is_ok() && rx.await.unwrap_or(false);
    if ok {
        respond(
            &app,
            StatusCode::OK,
            "text/plain",
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
    } else {
        respond(
            &app,
            StatusCode::BAD_REQUEST,
            "text/plain",
            "Cache not flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
    }
}

fn server_info(app: &App) -> Value {
    let c = &app.cfg;
    let s = app.stats.lock().map(|s| s.clone()).ok();
    json!({
        "model_path": c.model,
        "tokenizer_path": c.model,
        "served_model_name": c.model,
        "host": c.host,
        "port": c.port,
        "worker_id": c.worker_id,
        "max_total_num_tokens": c.max_total_tokens,
        "max_running_requests": c.max_running_requests,
        "max_prefill_tokens": c.max_prefill_tokens,
        "context_length": c.context_length,
        "schedule_policy": "fcfs",
        "enable_metrics": true,
        "enable_cache_report": true,
        "disable_radix_cache": false,
        "dp_size": 1,
        "tp_size": 1,
        "version": concat!("sglang-sim ", env!("CARGO_PKG_VERSION")),
        "simulator": {
            "prefill_tokens_per_sec": c.prefill_tokens_per_sec,
            "prefill_overhead_ms": c.prefill_overhead_ms,
            "decode_base_ms": c.decode_base_ms,
            "decode_batch_factor": c.decode_batch_factor,
            "time_scale": c.time_scale,
            "fail_rate": c.fail_rate,
            "slow_ms": c.slow_ms,
            "seed": c.seed,
            "cache_tokens": s.as_ref().map(|s| s.cache_tokens),
            "evictable_tokens": s.as_ref().map(|s| s.evictable_tokens),
        },
        "internal_states": [{
            "last_gen_throughput": s.as_ref().map(|s| s.gen_throughput).unwrap_or(0.0),
            "load": s.as_ref().map(|s| s.used_tokens).unwrap_or(0),
        }],
    })
}

/// Seconds since the Unix epoch as a float (SGLang's `time.time()`).
fn unix_now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `YYYY-MM-DDTHH:MM:SS.ffffff+00:00`, i.e. Python's `datetime.now(timezone.utc).isoformat()`.
fn iso8601_utc(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // civil_from_days (H. Hinnant): days since 1970-01-01 -> proleptic Gregorian date
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}+00:00",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_micros()
    )
}

fn round_to(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

/// Minimal percent-decoding for query values (`include=core%2Cqueues`).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sections `include=` accepts (SGLang's `LoadSnapshot.VALID_SECTIONS`).
const LOAD_SECTIONS: [&str; 7] = ["all", "core", "disagg", "lora", "memory", "queues", "spec"];

/// `GET /v1/loads[?dp_rank=N][&include=core,queues][&format=prometheus]`, newer SGLang's load
/// endpoint. Matched against SGLang's `python/sglang/srt/entrypoints/v1_loads.py` and
/// `managers/load_snapshot.py` (2026): top level `{"timestamp": ISO-8601 UTC string, "version",
/// "accelerator", "num_accelerators", "loads": [one object per DP rank]}`, no cross-rank
/// aggregate; each rank carries the 12 core fields in SGLang's order (`dp_rank`,
/// `num_running_reqs`, `num_waiting_reqs`, `num_waiting_uncached_tokens`, `num_used_tokens`,
/// `num_total_tokens` = used + prompt tokens of waiting requests, `max_total_num_tokens`,
/// `max_running_requests`, `token_usage` (4 decimals), `gen_throughput` (2), `cache_hit_rate`
/// (4), `utilization` (4)) plus the optional `queues` section (the sim has no memory / spec /
/// lora / disaggregation data: those sections are absent, as SGLang omits `None` sections).
/// Additions: each rank also has `timestamp` (Unix seconds, float: the snapshot time SGLang
/// keeps internally in `LoadSnapshot.timestamp`). An out-of-range `dp_rank` gives an empty
/// `loads`; an unknown section gives 400 `{"detail": ...}`; `format=prometheus` renders every
/// numeric field as a `sglang_<field>{dp_rank="0"}` gauge (`sglang_queues_<field>` for the
/// section), as SGLang's `_format_loads_prometheus`.
fn loads(app: &App, query: Option<&str>) -> Resp {
    let mut dp_rank: Option<String> = None;
    let mut include: Option<String> = None;
    let mut format: Option<String> = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        match k {
            "dp_rank" => dp_rank = Some(v),
            "include" => include = Some(v),
            "format" => format = Some(v),
            _ => {}
        }
    }
    let dp_rank = match dp_rank.as_deref().map(|s| s.trim().parse::<i64>()) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            // FastAPI's answer to a query parameter that is not an int
            return json_resp(
                app,
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({"detail": [{"type": "int_parsing", "loc": ["query", "dp_rank"],
                    "msg": "Input should be a valid integer, unable to parse string as an integer",
                    "input": dp_rank}]}),
            );
        }
    };
    let sections: Option<Vec<String>> = include
        .filter(|s| !s.is_empty())
        .map(|s| s.split(',').map(|p| p.trim().to_string()).collect());
    if let Some(secs) = &sections {
        let bad: Vec<String> = secs
            .iter()
            .filter(|s| !LOAD_SECTIONS.contains(&s.as_str()))
            .map(|s| format!("'{s}'"))
            .collect();
        if !bad.is_empty() {
            let valid: Vec<String> = LOAD_SECTIONS.iter().map(|s| format!("'{s}'")).collect();
            return detail(
                app,
                StatusCode::BAD_REQUEST,
                &format!(
                    "Invalid include sections: {{{}}}. Valid options: [{}]",
                    bad.join(", "),
                    valid.join(", ")
                ),
            );
        }
    }
    let want = |name: &str| {
        sections
            .as_ref()
            .is_none_or(|s| s.iter().any(|x| x == "all" || x == name))
    };
    let now = SystemTime::now();
    let snap = app.stats.lock().map(|s| s.clone()).ok();
    let c = &app.cfg;
    let (run, wait, unc, used, waiting_toks, usage, tput, hit) = match &snap {
        Some(s) => (
            s.num_running,
            s.num_waiting,
            s.waiting_uncached_tokens,
            s.used_tokens,
            s.waiting_tokens,
            s.token_usage(),
            s.gen_throughput,
            s.cache_hit_rate,
        ),
        None => (0, 0, 0, 0, 0, 0.0, 0.0, 0.0),
    };
    // SGLang's intended utilization (its `_calculate_utilization`): the tighter of the request
    // slots and the KV pool (at 90%); SGLang itself currently reports 0 (no SLO limit set).
    let utilization = (run as f64 / c.max_running_requests.max(1) as f64).max(usage / 0.9);
    let core: Vec<(&str, Value)> = vec![
        ("dp_rank", json!(0)),
        ("num_running_reqs", json!(run)),
        ("num_waiting_reqs", json!(wait)),
        ("num_waiting_uncached_tokens", json!(unc)),
        ("num_used_tokens", json!(used)),
        ("num_total_tokens", json!(used + waiting_toks)),
        ("max_total_num_tokens", json!(c.max_total_tokens)),
        ("max_running_requests", json!(c.max_running_requests)),
        ("token_usage", json!(round_to(usage, 4))),
        ("gen_throughput", json!(round_to(tput, 2))),
        ("cache_hit_rate", json!(round_to(hit, 4))),
        ("utilization", json!(round_to(utilization, 4))),
    ];
    let queues: Option<Vec<(&str, Value)>> = want("queues").then(|| {
        vec![
            ("waiting", json!(wait)),
            ("grammar", json!(0)),
            ("paused", json!(0)),
            ("retracted", json!(0)),
        ]
    });
    // one data-parallel rank (0); any other rank asked for: no entries
    let ranks: usize = if dp_rank.is_none_or(|r| r == 0) { 1 } else { 0 };
    if format.as_deref() == Some("prometheus") {
        let mut out = String::new();
        if ranks > 0 {
            for (k, v) in &core[1..] {
                let _ = write!(
                    out,
                    "# TYPE sglang_{k} gauge\nsglang_{k}{{dp_rank=\"0\"}} {v}\n"
                );
            }
            for (k, v) in queues.iter().flatten() {
                let _ = write!(
                    out,
                    "# TYPE sglang_queues_{k} gauge\nsglang_queues_{k}{{dp_rank=\"0\"}} {v}\n"
                );
            }
        }
        if out.is_empty() {
            out.push('\n');
        }
        return respond(
            app,
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            out,
        );
    }
    let mut loads = Vec::with_capacity(ranks);
    if ranks > 0 {
        let mut m = serde_json::Map::new();
        for (k, v) in core {
            m.insert(k.to_string(), v);
        }
        m.insert("timestamp".into(), json!(unix_now_f64()));
        if let Some(q) = queues {
            let q: serde_json::Map<String, Value> =
                q.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            m.insert("queues".into(), Value::Object(q));
        }
        loads.push(Value::Object(m));
    }
    json_resp(
        app,
        StatusCode::OK,
        &json!({
            "timestamp": iso8601_utc(now),
            "version": concat!("sglang-sim ", env!("CARGO_PKG_VERSION")),
            "accelerator": null,
            "num_accelerators": 1,
            "loads": loads,
        }),
    )
}

/// Routes one request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Resp, Infallible> {
    let path = req.uri().path().to_string();
    let m = req.method().clone();
    let get = m == Method::GET;
    let post = m == Method::POST;
    let r = match path.as_str() {
        "/v1/chat/completions" if post => inference(app, Kind::Chat, req).await,
        "/v1/completions" if post => inference(app, Kind::Completion, req).await,
        "/generate" if post || m == Method::PUT => inference(app, Kind::Generate, req).await,
        "/health" if get => {
            if app.draining.load(Ordering::SeqCst) {
                respond(&app, StatusCode::SERVICE_UNAVAILABLE, "text/plain", "")
            } else {
                respond(&app, StatusCode::OK, "text/plain", "")
            }
        }
        "/health_generate" if get => health_generate(app).await,
        "/get_load" if get => {
            let (run, wait, toks) = app.load();
            json_resp(
                &app,
                StatusCode::OK,
                &json!([{"dp_rank": 0, "num_reqs": run + wait, "num_waiting_reqs": wait,
                         "num_tokens": toks}]),
            )
        }
        "/v1/loads" if get => loads(&app, req.uri().query()),
        "/get_model_info" if get => json_resp(
            &app,
            StatusCode::OK,
            &json!({"model_path": app.cfg.model, "tokenizer_path": app.cfg.model,
                    "is_generation": true, "preferred_sampling_params": null,
                    "weight_version": "default", "has_image_understanding": false,
                    "has_audio_understanding": false, "model_type": "llama",
                    "architectures": ["LlamaForCausalLM"]}),
        ),
        "/get_server_info" | "/server_info" if get => {
            json_resp(&app, StatusCode::OK, &server_info(&app))
        }
        "/v1/models" if get => json_resp(
            &app,
            StatusCode::OK,
            &json!({"object": "list", "data": [{"id": app.cfg.model, "object": "model",
                    "created": app.started, "owned_by": "sglang", "root": app.cfg.model,
                    "max_model_len": app.cfg.context_length}]}),
        ),
        "/metrics" if get => {
            let text = match app.stats.lock() {
                Ok(s) => s.render(&app.cfg.model),
                Err(_) => String::new(),
            };
            respond(
                &app,
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                text,
            )
        }
        "/flush_cache" if get || post => flush_cache(app).await,
        "/v1/chat/completions"
        | "/v1/completions"
        | "/generate"
        | "/health"
        | "/health_generate"
        | "/get_load"
        | "/v1/loads"
        | "/get_model_info"
        | "/get_server_info"
        | "/server_info"
        | "/v1/models"
        | "/metrics"
        | "/flush_cache" => detail(&app, StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed"),
        _ => detail(&app, StatusCode::NOT_FOUND, "Not Found"),
    };
    Ok(r)
}

/// Accepts connections until `stop` resolves (the listener is dropped then).
pub async fn serve(listener: TcpListener, app: Arc<App>, stop: impl Future<Output = ()>) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            acc = listener.accept() => {
                let Ok((stream, _)) = acc else { continue };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(app.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        }
    }
}

/// Binds `cfg.host:cfg.port` (port 0 = ephemeral) and serves in the background on the current
/// runtime. Returns the bound address and the shared state.
pub async fn start(cfg: Config) -> std::io::Result<(SocketAddr, Arc<App>)> {
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).await?;
    let addr = listener.local_addr()?;
    let app = App::new(cfg);
    let a = app.clone();
    tokio::spawn(async move { serve(listener, a, std::future::pending()).await });
    Ok((addr, app))
}

/// Waits for a drain to complete: no inference request in flight and an idle scheduler, or
/// `timeout`. Returns true when drained.
pub async fn wait_drained(app: &App, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let (run, wait, _) = app.load();
        if app.inflight.load(Ordering::SeqCst) == 0 && run == 0 && wait == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
