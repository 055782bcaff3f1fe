//! HTTP server (hyper 1, HTTP/1.1): shared state, request routing, accept loop, drain.
//!
//! Response shapes live in `openai` (OpenAI/SGLang JSON and SSE framing), the response body
//! and reply helpers in `response`, the inference handlers in `inference`, the load endpoints
//! in `loads` and the informational/admin endpoints in `admin`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::service::service_fn;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::admin;
use crate::api::Kind;
use crate::config::Config;
use crate::inference;
use crate::loads;
use crate::metrics::Stats;
use crate::pd::{self, Disagg, Mode};
use crate::response::{detail, json_resp, respond, Resp};
use crate::sched::{self, Cmd};
use crate::tokenizer;

/// Request bodies larger than this are refused (400).
pub const MAX_BODY: usize = 64 << 20;

/// Shared server state.
pub struct App {
    pub cfg: Config,
    pub stats: Arc<Mutex<Stats>>,
    pub(crate) sched: mpsc::UnboundedSender<Cmd>,
    pub draining: AtomicBool,
    /// Prefill/decode disaggregation state (rooms, transfer counters).
    pub disagg: Disagg,
    /// Inference requests not yet fully answered (bodies included).
    pub inflight: AtomicUsize,
    pub(crate) req_counter: AtomicU64,
    pub(crate) worker_header: HeaderValue,
    started: u64,
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl App {
    /// Creates the state and spawns the scheduler task (call inside a tokio runtime).
    pub fn new(cfg: Config) -> Arc<App> {
        let disagg = Disagg::new(Duration::from_secs_f64(cfg.disaggregation_timeout_s));
        let stats = Arc::new(Mutex::new(Stats::new(cfg.max_total_tokens)));
        let sched = sched::spawn(cfg.clone(), stats.clone());
        let worker_header = HeaderValue::from_str(&cfg.worker_id)
            .unwrap_or_else(|_| HeaderValue::from_static("invalid-worker-id"));
        Arc::new(App {
            cfg,
            stats,
            sched,
            draining: AtomicBool::new(false),
            disagg,
            inflight: AtomicUsize::new(0),
            req_counter: AtomicU64::new(0),
            worker_header,
            started: unix_now(),
        })
    }

    pub(crate) fn next_id(&self) -> String {
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
pub(crate) struct InflightGuard(Arc<App>);

impl InflightGuard {
    pub(crate) fn new(app: &Arc<App>) -> Self {
        app.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard(app.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Routes one request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Resp, Infallible> {
    let path = req.uri().path().to_string();
    let m = req.method().clone();
    let get = m == Method::GET;
    let post = m == Method::POST;
    let r = match path.as_str() {
        "/v1/chat/completions" if post => inference::inference(app, Kind::Chat, req).await,
        "/v1/completions" if post => inference::inference(app, Kind::Completion, req).await,
        "/generate" if post || m == Method::PUT => {
            inference::inference(app, Kind::Generate, req).await
        }
        "/health" if get => {
            if app.draining.load(Ordering::SeqCst) {
                respond(&app, StatusCode::SERVICE_UNAVAILABLE, "text/plain", "")
            } else {
                respond(&app, StatusCode::OK, "text/plain", "")
            }
        }
        "/health_generate" if get => inference::health_generate(app).await,
        "/get_load" if get => loads::get_load(&app),
        // older SGLang (--no-v1-loads) has no such route
        "/v1/loads" if !app.cfg.v1_loads => detail(&app, StatusCode::NOT_FOUND, "Not Found"),
        "/v1/loads" if get => loads::loads(&app, req.uri().query()),
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
            json_resp(&app, StatusCode::OK, &admin::server_info(&app))
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
                Ok(s) => {
                    let mut t = s.render(&app.cfg.model);
                    t.push_str(
                        &app.disagg
                            .render(app.cfg.disaggregation_mode, &app.cfg.model),
                    );
                    t
                }
                Err(_) => String::new(),
            };
            respond(
                &app,
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                text,
            )
        }
        "/flush_cache" if get || post => admin::flush_cache(app).await,
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
    let (listener, bootstrap, cfg) = bind(cfg).await?;
    let addr = listener.local_addr()?;
    let app = App::new(cfg);
    if let Some(b) = bootstrap {
        tokio::spawn(pd::serve_bootstrap(b, app.clone()));
    }
    let a = app.clone();
    tokio::spawn(async move { serve(listener, a, std::future::pending()).await });
    Ok((addr, app))
}

/// Binds the HTTP listener and, on a prefill worker, the bootstrap server's listener
/// (`cfg.host:cfg.disaggregation_bootstrap_port`). Returns the config with the ports actually
/// bound (port 0 = ephemeral), so `App` reports what clients must use.
pub async fn bind(mut cfg: Config) -> std::io::Result<(TcpListener, Option<TcpListener>, Config)> {
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).await?;
    cfg.port = listener.local_addr()?.port();
    let bootstrap = if cfg.disaggregation_mode == Mode::Prefill {
        let b = TcpListener::bind((cfg.host.as_str(), cfg.disaggregation_bootstrap_port)).await?;
        cfg.disaggregation_bootstrap_port = b.local_addr()?.port();
        Some(b)
    } else {
        None
    };
    Ok((listener, bootstrap, cfg))
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
