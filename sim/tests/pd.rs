//! Prefill/decode disaggregation: prefill and decode workers run in-process on ephemeral ports
//! and exchange a room's KV through the prefill worker's bootstrap server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sglang_sim::config::Config;
use sglang_sim::pd::Mode;
use sglang_sim::server::{self, App};

async fn call(addr: SocketAddr, method: &str, path: &str, body: &str) -> (StatusCode, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> (StatusCode, String) {
    call(addr, "POST", path, &body.to_string()).await
}

fn cfg(mode: Mode) -> Config {
    Config {
        port: 0,
        model: "m".into(),
        worker_id: format!("w-{}", mode.as_str()),
        time_scale: 0.0,
        disaggregation_mode: mode,
        disaggregation_bootstrap_port: 0,
        disaggregation_timeout_s: 5.0,
        ..Config::default()
    }
}

async fn start(c: Config) -> (SocketAddr, Arc<App>) {
    server::start(c).await.unwrap()
}

/// The body a router sends to both workers.
fn body(prefill: &App, room: u64, stream: bool) -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "user", "content": "a shared system prompt and a question"}],
        "max_tokens": 8,
        "ignore_eos": true,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.cfg.disaggregation_bootstrap_port,
        "bootstrap_room": room,
    })
}

async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, text) = call(addr, "GET", "/metrics", "").await;
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
}

fn usage_of_stream(sse: &str) -> Value {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|v| v.get("usage").is_some())
        .map(|v| v["usage"].clone())
        .unwrap_or_else(|| panic!("no usage chunk in {sse}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_streams_after_prefill_hands_over_the_room() {
    let (pa, p) = start(cfg(Mode::Prefill)).await;
    let (da, _d) = start(cfg(Mode::Decode)).await;
    for (room, want_cached) in [(7u64, false), (8u64, true)] {
        let b = body(&p, room, true);
        let (pre, dec) = tokio::join!(
            post(pa, "/v1/chat/completions", &b),
            post(da, "/v1/chat/completions", &b)
        );
        assert_eq!(pre.0, StatusCode::OK, "{}", pre.1);
        assert_eq!(dec.0, StatusCode::OK, "{}", dec.1);
        // the prefill worker computes the first token only; the decode worker all 8
        assert_eq!(usage_of_stream(&pre.1)["completion_tokens"], 1);
        let u = usage_of_stream(&dec.1);
        assert_eq!(u["completion_tokens"], 8);
        assert!(dec.1.ends_with("data: [DONE]\n\n"));
        // the client sees the prefill worker's cache hit (second request: same prompt)
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(cached > 0, want_cached, "room {room}: {u}");
    }
    assert_eq!(metric(pa, "sglang:kv_transfer_total").await, 2.0);
    assert_eq!(
        metric(pa, "sglang:num_prefill_inflight_queue_reqs").await,
        0.0
    );
    assert_eq!(
        metric(da, "sglang:num_decode_transfer_queue_reqs").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_roundtrip_in_either_order() {
    let (pa, p) = start(cfg(Mode::Prefill)).await;
    let (da, d) = start(cfg(Mode::Decode)).await;
    let g = |room: u64| {
        json!({"text": "hello there", "sampling_params": {"max_new_tokens": 5, "ignore_eos": true},
               "bootstrap_host": "127.0.0.1",
               "bootstrap_port": p.cfg.disaggregation_bootstrap_port, "bootstrap_room": room})
    };
    // decode first: it waits for the room
    let b = g(1);
    let b2 = b.clone();
    let dec = tokio::spawn(async move { post(da, "/generate", &b2).await });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while d
        .disagg
        .transfer_queue
        .load(std::sync::atomic::Ordering::SeqCst)
        == 0
    {
        assert!(std::time::Instant::now() < deadline, "decode never waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, pre) = post(pa, "/generate", &b).await;
    assert_eq!(s, StatusCode::OK, "{pre}");
    let pre: Value = serde_json::from_str(&pre).unwrap();
    assert_eq!(pre["meta_info"]["completion_tokens"], 1);
    let (s, out) = dec.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{out}");
    let out: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out["meta_info"]["completion_tokens"], 5);
    // prefill first: the room waits for the decode worker
    let b = g(2);
    let (s, _) = post(pa, "/generate", &b).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        metric(pa, "sglang:num_prefill_inflight_queue_reqs").await,
        1.0
    );
    let (s, out) = post(da, "/generate", &b).await;
    assert_eq!(s, StatusCode::OK, "{out}");
    assert_eq!(
        metric(pa, "sglang:num_prefill_inflight_queue_reqs").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_times_out_when_the_prefill_worker_is_down() {
    // a port nobody listens on: bind, note, drop
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let (da, d) = start(Config {
        disaggregation_timeout_s: 0.3,
        ..cfg(Mode::Decode)
    })
    .await;
    let b = json!({"prompt": "x", "max_tokens": 2, "bootstrap_host": "127.0.0.1",
                   "bootstrap_port": port, "bootstrap_room": 5});
    let (s, out) = post(da, "/v1/completions", &b).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["object"], "error");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("Decode bootstrap failed"),
        "{v}"
    );
    assert_eq!(
        metric(da, "sglang:num_bootstrap_failed_reqs_total").await,
        1.0
    );
    assert_eq!(d.inflight.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_require_their_bootstrap_fields_and_plain_workers_ignore_them() {
    let (pa, _p) = start(cfg(Mode::Prefill)).await;
    let (da, _d) = start(cfg(Mode::Decode)).await;
    let (na, _n) = start(cfg(Mode::Null)).await;
    let plain = json!({"prompt": "x", "max_tokens": 2});
    let (s, out) = post(pa, "/v1/completions", &plain).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{out}");
    assert!(out.contains("bootstrap_room"), "{out}");
    let room_only = json!({"prompt": "x", "max_tokens": 2, "bootstrap_room": 3});
    let (s, out) = post(da, "/v1/completions", &room_only).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{out}");
    assert!(out.contains("bootstrap_host"), "{out}");
    let (s, out) = post(na, "/v1/completions", &room_only).await;
    assert_eq!(s, StatusCode::OK, "{out}");
    let bad = json!({"prompt": "x", "bootstrap_room": [1, 2]});
    let (s, _) = post(na, "/v1/completions", &bad).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let bad = json!({"prompt": "x", "bootstrap_port": 70000});
    let (s, _) = post(na, "/v1/completions", &bad).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (_, info) = call(pa, "GET", "/get_server_info", "").await;
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["disaggregation_mode"], "prefill");
}

#[test]
fn flags_parse_like_sglang() {
    let c = Config::parse(
        [
            "--disaggregation-mode",
            "decode",
            "--disaggregation-bootstrap-port",
            "9001",
        ]
        .iter()
        .map(|s| s.to_string()),
    )
    .unwrap();
    assert_eq!(c.disaggregation_mode, Mode::Decode);
    assert_eq!(c.disaggregation_bootstrap_port, 9001);
    assert_eq!(Config::default().disaggregation_bootstrap_port, 8998);
    assert!(Config::parse(
        ["--disaggregation-mode", "both"]
            .iter()
            .map(|s| s.to_string())
    )
    .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_whose_client_leaves_fails_its_room_at_once() {
    // a prefill that takes 2 s, and a client (e.g. Envoy's mirror) that leaves after 100 ms
    let (pa, p) = start(Config {
        time_scale: 1.0,
        prefill_overhead_ms: 2000.0,
        ..cfg(Mode::Prefill)
    })
    .await;
    let (da, _d) = start(Config {
        disaggregation_timeout_s: 60.0,
        ..cfg(Mode::Decode)
    })
    .await;
    let b = body(&p, 11, false);
    let pb = b.clone();
    let client = tokio::spawn(async move { post(pa, "/v1/chat/completions", &pb).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.abort();
    // the decode worker learns that the room failed instead of waiting out its 60 s timeout
    let (s, out) = tokio::time::timeout(
        Duration::from_secs(30),
        post(da, "/v1/chat/completions", &b),
    )
    .await
    .expect("the decode worker waited for a room whose prefill was abandoned");
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{out}");
    assert!(out.contains("KV transfer failed"), "{out}");
    assert_eq!(
        metric(da, "sglang:num_transfer_failed_reqs_total").await,
        1.0
    );
}
