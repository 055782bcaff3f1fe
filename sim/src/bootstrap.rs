//! The prefill worker's bootstrap server (PD disaggregation, see `pd`): `GET /kv/<room>` hands a
//! ready room's KV to the decode worker that asks.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use crate::app::App;
use crate::response::{json_resp, Resp};

/// The bootstrap server's routes: `GET /kv/<room>[?wait_ms=N]`, `GET /health`.
async fn bootstrap_handle(app: Arc<App>, req: Request<Incoming>) -> Result<Resp, Infallible> {
    let path = req.uri().path();
    if req.method() != Method::GET {
        return Ok(json_resp(
            &app,
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"detail": "Method Not Allowed"}),
        ));
    }
    if path == "/health" {
        return Ok(json_resp(&app, StatusCode::OK, &json!({})));
    }
    let Some(room) = path
        .strip_prefix("/kv/")
        .and_then(|r| r.parse::<u64>().ok())
    else {
        return Ok(json_resp(
            &app,
            StatusCode::NOT_FOUND,
            &json!({"detail": "Not Found"}),
        ));
    };
    let wait_ms = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|p| p.strip_prefix("wait_ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        .min(1000);
    let r = match app.disagg.take(room, Duration::from_millis(wait_ms)).await {
        Some(Ok(kv)) => json_resp(
            &app,
            StatusCode::OK,
            &json!({"room": room, "cached_tokens": kv.cached}),
        ),
        Some(Err(())) => json_resp(
            &app,
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"room": room, "detail": "prefill failed"}),
        ),
        None => json_resp(
            &app,
            StatusCode::NOT_FOUND,
            &json!({"room": room, "detail": "room not ready"}),
        ),
    };
    Ok(r)
}

/// Prefill: serves the bootstrap server on `listener` until the task is dropped.
pub async fn serve_bootstrap(listener: TcpListener, app: Arc<App>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| bootstrap_handle(app.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
