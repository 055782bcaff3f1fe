//! HTTP server (hyper 1, HTTP/1.1): request routing, accept loop, drain. The top of the crate:
//! modules import downwards only (server -> inference / admin / loads / bootstrap -> openai /
//! response -> app -> api / pd / sched -> radix / metrics / tokenizer / config).
//!
//! The shared state is `app`; response shapes live in `openai` (OpenAI/SGLang JSON and SSE framing), the response body
//! and reply helpers in `response`, the inference handlers in `inference`, the load endpoints
//! in `loads` and the informational/admin endpoints in `admin`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use crate::admin;
use crate::api::Kind;
pub use crate::app::{App, MAX_BODY};
use crate::bootstrap;
use crate::config::{Config, Mode};
use crate::inference;
use crate::loads;
use crate::response::{detail, json_resp, respond, Resp};

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
        tokio::spawn(bootstrap::serve_bootstrap(b, app.clone()));
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
