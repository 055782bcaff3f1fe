//! HTTP tests: the server runs in-process on an ephemeral port; one test (at least) per endpoint.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use sglang_sim::config::Config;
use sglang_sim::server;

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
    /// Time until the response head arrived.
    ttfb: Duration,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    ctype: Option<&str>,
    body: &str,
) -> Reply {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    if let Some(ct) = ctype {
        b = b.header("content-type", ct);
    }
    let req = b.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let t0 = Instant::now();
    let resp = send.send_request(req).await.unwrap();
    let ttfb = t0.elapsed();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
        ttfb,
    }
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> Reply {
    call(
        addr,
        "POST",
        path,
        Some("application/json"),
        &body.to_string(),
    )
    .await
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    call(addr, "GET", path, None, "").await
}

/// Polls GET `path` until `done` holds for its JSON (a condition, never a fixed sleep: a loaded
/// machine only makes it slower); panics naming `what` after a generous deadline.
async fn wait_json(a: SocketAddr, path: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = get(a, path).await.json();
        if done(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn fast() -> Config {
    Config {
        port: 0,
        worker_id: "w-test".into(),
        model: "m".into(),
        time_scale: 0.0,
        ..Config::default()
    }
}

async fn start(cfg: Config) -> (SocketAddr, std::sync::Arc<server::App>) {
    server::start(cfg).await.unwrap()
}

fn assert_worker(r: &Reply) {
    assert_eq!(r.headers.get("x-worker-id").unwrap(), "w-test");
}

fn assert_error(r: &Reply, code: u16) {
    assert_eq!(r.status.as_u16(), code, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "error");
    assert_eq!(v["code"], code);
    assert!(v["message"].is_string());
    assert!(v["type"].is_string());
    assert_worker(r);
}

/// `data:` payloads of an SSE body (framing checked: every event is `data: ...\n\n`).
fn sse_events(body: &str) -> Vec<String> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.split("\n\n")
        .filter(|s| !s.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad frame {e:?}"))
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn health_and_info_endpoints() {
    let (a, _) = start(fast()).await;
    let r = get(a, "/health").await;
    assert_eq!(r.status, 200);
    assert_worker(&r);
    let r = get(a, "/health_generate").await;
    assert_eq!(r.status, 200);
    assert_worker(&r);
    let r = get(a, "/get_load").await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v[0]["dp_rank"], 0);
    for k in ["num_reqs", "num_waiting_reqs", "num_tokens"] {
        assert!(v[0][k].is_u64(), "{k}");
    }
    let r = get(a, "/get_model_info").await;
    assert_eq!(r.json()["model_path"], "m");
    assert_worker(&r);
    for p in ["/get_server_info", "/server_info"] {
        let r = get(a, p).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["max_total_num_tokens"], 800_000);
        assert_worker(&r);
    }
    let r = get(a, "/v1/models").await;
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "m");
    assert_worker(&r);
    let r = get(a, "/nope").await;
    assert_eq!(r.status, 404);
    assert_worker(&r);
    let r = get(a, "/v1/chat/completions").await;
    assert_eq!(r.status, 405);
}

#[tokio::test]
async fn older_sglang_mode_answers_get_load_and_capacity_in_server_info_only() {
    let cfg = Config {
        v1_loads: false,
        max_running_requests: 16,
        max_total_tokens: 12_288,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let r = get(a, "/v1/loads").await;
    assert_eq!(r.status, 404, "older SGLang has no /v1/loads");
    let r = get(a, "/get_load").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()[0]["num_reqs"], 0);
    for p in ["/get_server_info", "/server_info"] {
        let v = get(a, p).await.json();
        assert_eq!(v["max_running_requests"], 16, "{v}");
        assert_eq!(v["max_total_num_tokens"], 12_288, "{v}");
    }
    // the newer mode answers both
    let (b, _) = start(fast()).await;
    assert_eq!(get(b, "/v1/loads").await.status, 200);
    assert_eq!(
        get(b, "/get_server_info").await.json()["max_running_requests"],
        256
    );
}

#[tokio::test]
async fn metrics_endpoint_counts() {
    let (a, _) = start(fast()).await;
    let body =
        json!({"prompt": "hello world, this is a prompt", "max_tokens": 4, "ignore_eos": true});
    post(a, "/v1/completions", body.clone()).await;
    post(a, "/v1/completions", body).await;
    let r = get(a, "/metrics").await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    assert_worker(&r);
    let m = r.body;
    let val = |name: &str| metric(&m, name);
    // prompt: BOS + 29 bytes -> 1 + 8 tokens
    assert_eq!(val("sglang:prompt_tokens_total"), 18.0);
    assert_eq!(val("sglang:cached_tokens_total"), 9.0);
    assert_eq!(val("sglang:generation_tokens_total"), 8.0);
    assert_eq!(val("sglang:num_requests_total"), 2.0);
    assert_eq!(val("sglang:max_total_num_tokens"), 800000.0);
    assert_eq!(val("sglang:num_retracted_requests_total"), 0.0);
    for g in [
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "cache_hit_rate",
        "gen_throughput",
        "num_retracted_reqs",
        "new_token_ratio",
    ] {
        val(&format!("sglang:{g}"));
    }
    assert_eq!(val("sglang:time_to_first_token_seconds_count"), 2.0);
    assert_eq!(val("sglang:e2e_request_latency_seconds_count"), 2.0);
    assert_eq!(val("sglang:inter_token_latency_seconds_count"), 6.0);
    assert!(m.contains("# TYPE sglang:time_to_first_token_seconds histogram"));
    assert!(m.contains("sglang:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 2"));
}

#[tokio::test]
async fn chat_completion_non_stream() {
    let (a, _) = start(fast()).await;
    let body = json!({"model": "m", "messages": [{"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
        "max_completion_tokens": 7, "ignore_eos": true});
    let r = post(a, "/v1/chat/completions", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_worker(&r);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len(),
        28
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let v2 = post(a, "/v1/chat/completions", body).await.json();
    assert_eq!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(p)
    );
    // without ignore_eos and a large budget, the answer stops by itself
    let v3 = post(
        a,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "q"}], "max_tokens": 1000}),
    )
    .await
    .json();
    assert_eq!(v3["choices"][0]["finish_reason"], "stop");
    assert_eq!(v3["choices"][0]["matched_stop"], 128009);
}

#[tokio::test]
async fn chat_completion_stream_framing() {
    let (a, _) = start(fast()).await;
    let body = json!({"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 3,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let r = post(a, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200);
    assert_worker(&r);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let ev = sse_events(&r.body);
    // role, 3 deltas, finish, usage, [DONE]
    assert_eq!(ev.len(), 7, "{ev:?}");
    let j: Vec<Value> = ev[..6]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(j[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &j[1..4] {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(
            c["choices"][0]["delta"]["content"].as_str().unwrap().len(),
            4
        );
    }
    assert_eq!(j[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(j[5]["choices"], json!([]));
    assert_eq!(j[5]["usage"]["completion_tokens"], 3);
    assert_eq!(ev[6], "[DONE]");
}

#[tokio::test]
async fn completions_prompt_forms_and_stream() {
    let (a, _) = start(fast()).await;
    for prompt in [
        json!("abc"),
        json!(["abc", "def"]),
        json!([1, 2, 3]),
        json!([[1, 2], [3, 4]]),
    ] {
        let n = if prompt.as_array().is_some_and(|x| !x[0].is_number()) {
            2
        } else {
            1
        };
        let r = post(
            a,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_worker(&r);
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"].as_array().unwrap().len(), n);
        assert_eq!(v["usage"]["completion_tokens"], 2 * n);
    }
    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 2, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let ev = sse_events(&r.body);
    assert_eq!(ev.len(), 4, "{ev:?}"); // 2 text chunks (last with finish), usage, [DONE]
    let last: Value = serde_json::from_str(&ev[1]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let usage: Value = serde_json::from_str(&ev[2]).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
}

#[tokio::test]
async fn generate_post_put_stream() {
    let (a, _) = start(fast()).await;
    let body =
        json!({"text": "native", "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}});
    let v = post(a, "/generate", body.clone()).await.json();
    assert_eq!(v["text"].as_str().unwrap().len(), 12);
    assert_eq!(v["meta_info"]["completion_tokens"], 3);
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");
    let r = call(
        a,
        "PUT",
        "/generate",
        Some("application/json"),
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_worker(&r);
    assert_eq!(r.json()["meta_info"]["cached_tokens"], 3);
    let r = post(
        a,
        "/generate",
        json!({"input_ids": [5, 6, 7], "stream": true,
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}}),
    )
    .await;
    let ev = sse_events(&r.body);
    assert_eq!(ev.len(), 3);
    let last: Value = serde_json::from_str(&ev[1]).unwrap();
    assert_eq!(last["meta_info"]["completion_tokens"], 2);
    assert_eq!(last["text"].as_str().unwrap().len(), 8, "cumulative text");
    let v = post(a, "/generate", json!({"text": ["a", "b"]}))
        .await
        .json();
    assert_eq!(v.as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn errors_are_sglang_shaped() {
    let (a, _) = start(fast()).await;
    let r = call(
        a,
        "POST",
        "/v1/chat/completions",
        Some("application/json"),
        "{not json",
    )
    .await;
    assert_error(&r, 400);
    let r = call(
        a,
        "POST",
        "/v1/completions",
        Some("text/plain"),
        r#"{"prompt":"x"}"#,
    )
    .await;
    assert_error(&r, 400);
    let r = post(a, "/v1/completions", json!({"max_tokens": 3})).await;
    assert_error(&r, 400);
    let r = post(a, "/generate", json!({"sampling_params": {}})).await;
    assert_error(&r, 400);
    let r = post(
        a,
        "/v1/chat/completions",
        json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_error(&r, 404);
    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100000}),
    )
    .await;
    assert_error(&r, 400);
    // a missing content type is parsed as JSON (FastAPI behaviour)
    let r = call(
        a,
        "POST",
        "/v1/completions",
        None,
        r#"{"prompt":"x","max_tokens":1}"#,
    )
    .await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn cached_prompt_has_lower_ttft_and_flush_restores_it() {
    let cfg = Config {
        time_scale: 1.0,
        prefill_tokens_per_sec: 2_000.0,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    // ~4000 tokens: uncached prefill ~2 s, cached ~3 ms. Lower bounds hold however loaded the
    // machine; the cached one is relative, with a second of slack.
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(355);
    let body =
        json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2, "stream": true});
    let cold = post(a, "/v1/chat/completions", body.clone()).await;
    let warm = post(a, "/v1/chat/completions", body.clone()).await;
    assert!(
        cold.ttfb > Duration::from_millis(1500),
        "cold {:?}",
        cold.ttfb
    );
    assert!(
        warm.ttfb < cold.ttfb / 2,
        "warm {:?} cold {:?}",
        warm.ttfb,
        cold.ttfb
    );
    let r = call(a, "POST", "/flush_cache", None, "").await;
    assert_eq!(r.status, 200);
    assert_worker(&r);
    let again = post(a, "/v1/chat/completions", body).await;
    assert!(
        again.ttfb > Duration::from_millis(1500),
        "after flush {:?}",
        again.ttfb
    );
}

#[tokio::test]
async fn flush_cache_refused_while_busy_and_load_reports_queue() {
    let cfg = Config {
        time_scale: 1.0,
        max_running_requests: 1,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let mut hs = Vec::new();
    // 250 tokens at 8 ms: ~2 s busy, long enough to be seen however slow the machine
    for i in 0..2 {
        hs.push(tokio::spawn(post(
            a,
            "/v1/completions",
            json!({"prompt": format!("busy {i}"), "max_tokens": 250, "ignore_eos": true}),
        )));
    }
    let v = wait_json(a, "/get_load", "2 requests in", |v| v[0]["num_reqs"] == 2).await;
    assert_eq!(v[0]["num_waiting_reqs"], 1, "{v}");
    let r = call(a, "POST", "/flush_cache", None, "").await;
    assert_eq!(r.status, 400);
    for h in hs {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(call(a, "POST", "/flush_cache", None, "").await.status, 200);
}

#[tokio::test]
async fn decode_time_grows_with_output_length() {
    let cfg = Config {
        time_scale: 1.0,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let t = Instant::now();
    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 26, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, 200);
    // prefill 3 ms + 25 decode steps of 8 ms = 203 ms (a lower bound: a loaded machine is slower)
    let e = t.elapsed();
    assert!(e >= Duration::from_millis(200), "{e:?}");
}

#[tokio::test]
async fn fail_rate_is_deterministic_and_slow_ms_adds_latency() {
    let cfg = Config {
        fail_rate: 1.0,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let r = post(a, "/v1/completions", json!({"prompt": "x"})).await;
    assert_error(&r, 500);
    assert_eq!(get(a, "/health").await.status, 200);

    let half = Config {
        fail_rate: 0.5,
        seed: 7,
        ..fast()
    };
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (a, _) = start(half.clone()).await;
        let mut codes = Vec::new();
        for _ in 0..40 {
            codes.push(
                post(
                    a,
                    "/v1/completions",
                    json!({"prompt": "x", "max_tokens": 1}),
                )
                .await
                .status
                .as_u16(),
            );
        }
        runs.push(codes);
    }
    assert_eq!(runs[0], runs[1], "same seed, same faults");
    let fails = runs[0].iter().filter(|c| **c == 500).count();
    assert!((8..=32).contains(&fails), "{fails}");

    let (a, _) = start(Config {
        slow_ms: 120,
        ..fast()
    })
    .await;
    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.ttfb >= Duration::from_millis(120));
}

#[tokio::test]
async fn draining_answers_503_and_waits_for_running() {
    let cfg = Config {
        time_scale: 1.0,
        ..fast()
    };
    let (a, app) = start(cfg).await;
    // 250 tokens at 8 ms: ~2 s running while the test drains
    let running = tokio::spawn(post(
        a,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 250, "ignore_eos": true}),
    ));
    wait_json(a, "/get_load", "the request running", |v| {
        v[0]["num_reqs"] == 1
    })
    .await;
    app.draining.store(true, Ordering::SeqCst);
    assert_eq!(get(a, "/health").await.status, 503);
    assert_error(
        &post(
            a,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .await,
        503,
    );
    assert!(!server::wait_drained(&app, Duration::from_millis(10)).await);
    assert_eq!(running.await.unwrap().status, 200);
    assert!(server::wait_drained(&app, Duration::from_secs(30)).await);
}

#[tokio::test]
async fn multi_turn_chat_hits_through_previous_answer() {
    let (a, _) = start(fast()).await;
    let sys = json!({"role": "system", "content": "You are a helpful assistant with a long system prompt."});
    let user = json!({"role": "user", "content": "First question?"});
    let v1 = post(
        a,
        "/v1/chat/completions",
        json!({"messages": [sys, user], "max_tokens": 12, "ignore_eos": true}),
    )
    .await
    .json();
    let answer = v1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap();
    let v2 = post(
        a,
        "/v1/chat/completions",
        json!({"messages": [sys, user,
        {"role": "assistant", "content": answer}, {"role": "user", "content": "Second?"}],
        "max_tokens": 4}),
    )
    .await
    .json();
    // turn 1's prompt and all of its answer but the last token were cached
    assert_eq!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(p1 + 11)
    );
}

const LOAD_CORE_FIELDS: [&str; 12] = [
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
];

/// The single rank of `/v1/loads`, after checking SGLang's envelope.
async fn load_rank(a: SocketAddr) -> Value {
    let r = get(a, "/v1/loads").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_worker(&r);
    let v = r.json();
    let ts = v["timestamp"].as_str().expect("ISO-8601 timestamp");
    assert!(ts.ends_with("+00:00") && ts.len() == 32, "{ts}");
    assert!(v["version"].is_string());
    assert!(v.get("aggregate").is_none(), "no server-side aggregate");
    let loads = v["loads"].as_array().expect("loads");
    assert_eq!(loads.len(), 1, "{v}");
    let l = loads[0].clone();
    for k in LOAD_CORE_FIELDS {
        assert!(l[k].is_number(), "{k}: {l}");
    }
    assert!(l["timestamp"].as_f64().unwrap() > 1.6e9, "{l}");
    l
}

#[tokio::test]
async fn v1_loads_reports_sglang_shape_and_queue() {
    let cfg = Config {
        time_scale: 1.0,
        max_running_requests: 1,
        max_total_tokens: 50_000,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let l = load_rank(a).await;
    assert_eq!(l["dp_rank"], 0);
    assert_eq!(l["num_running_reqs"], 0);
    assert_eq!(l["num_waiting_reqs"], 0);
    assert_eq!(l["num_waiting_uncached_tokens"], 0);
    assert_eq!(l["max_total_num_tokens"], 50_000);
    assert_eq!(l["max_running_requests"], 1);
    assert_eq!(l["queues"]["waiting"], 0);

    // cache prompt A (400 chars = BOS + 100 tokens)
    let a_prompt = "a".repeat(400);
    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": a_prompt, "max_tokens": 2, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, 200);
    // B runs (slow: 400 tokens at 8 ms, ~3 s), then C (uncached) and A (cached) wait behind it
    let b = tokio::spawn(post(
        a,
        "/v1/completions",
        json!({"prompt": "b".repeat(400), "max_tokens": 400, "ignore_eos": true}),
    ));
    wait_json(a, "/v1/loads", "B running", |v| {
        v["loads"][0]["num_running_reqs"] == 1
    })
    .await;
    let mut hs = vec![b];
    for p in ["c".repeat(400), a_prompt.clone()] {
        hs.push(tokio::spawn(post(
            a,
            "/v1/completions",
            json!({"prompt": p, "max_tokens": 2, "ignore_eos": true}),
        )));
    }
    wait_json(a, "/v1/loads", "C and A waiting", |v| {
        v["loads"][0]["num_waiting_reqs"] == 2
    })
    .await;
    let l = load_rank(a).await;
    assert_eq!(l["num_running_reqs"], 1, "{l}");
    assert_eq!(l["num_waiting_reqs"], 2, "{l}");
    assert_eq!(l["queues"]["waiting"], 2, "{l}");
    // C: 100 uncached tokens (BOS is cached); A: fully cached
    assert_eq!(l["num_waiting_uncached_tokens"], 100, "{l}");
    let used = l["num_used_tokens"].as_u64().unwrap();
    assert!(used >= 101, "B's prompt is locked: {l}");
    assert_eq!(
        l["num_total_tokens"].as_u64().unwrap(),
        used + 2 * 101,
        "{l}"
    );
    assert!(l["token_usage"].as_f64().unwrap() > 0.0, "{l}");
    assert!(
        l["utilization"].as_f64().unwrap() >= 1.0,
        "1 of 1 slots: {l}"
    );
    // API-router pollers' variants
    let r = get(a, "/v1/loads?include=core").await;
    let v = r.json();
    assert_eq!(v["loads"][0]["num_waiting_reqs"], 2);
    assert!(v["loads"][0].get("queues").is_none(), "{v}");
    let r = get(a, "/v1/loads?format=prometheus&include=core,queues").await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    assert!(
        r.body.contains(
            "# TYPE sglang_num_waiting_reqs gauge\nsglang_num_waiting_reqs{dp_rank=\"0\"} 2\n"
        ),
        "{}",
        r.body
    );
    assert!(
        r.body.contains("sglang_queues_waiting{dp_rank=\"0\"} 2\n"),
        "{}",
        r.body
    );
    assert!(r
        .body
        .contains("sglang_num_waiting_uncached_tokens{dp_rank=\"0\"} 100\n"));
    for h in hs {
        assert_eq!(h.await.unwrap().status, 200);
    }
    let l = load_rank(a).await;
    assert_eq!(l["num_running_reqs"], 0, "{l}");
    assert_eq!(l["num_waiting_reqs"], 0, "{l}");
    assert_eq!(l["num_waiting_uncached_tokens"], 0, "{l}");
}

#[tokio::test]
async fn v1_loads_query_errors_and_ranks() {
    let (a, _) = start(fast()).await;
    let v = get(a, "/v1/loads?dp_rank=0").await.json();
    assert_eq!(v["loads"].as_array().unwrap().len(), 1);
    let v = get(a, "/v1/loads?dp_rank=3").await.json();
    assert_eq!(v["loads"], json!([]), "out-of-range rank: empty, as SGLang");
    let r = get(a, "/v1/loads?dp_rank=x").await;
    assert_eq!(r.status, 422);
    let r = get(a, "/v1/loads?include=core%2Cbogus").await;
    assert_eq!(r.status, 400);
    let d = r.json()["detail"].as_str().unwrap().to_string();
    assert!(d.starts_with("Invalid include sections: {'bogus'}"), "{d}");
    let r = call(a, "POST", "/v1/loads", None, "").await;
    assert_eq!(r.status, 405);
}

/// A value of `/metrics` (first sample of `name`).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .unwrap_or_else(|| panic!("{name} missing"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn v1_loads_counts_the_chunked_prompt_as_waiting_work() {
    // 1001 tokens in chunks of 100 at 1000 tokens/s: ~1.1 s of prefill batches
    let cfg = Config {
        time_scale: 1.0,
        chunked_prefill_size: 100,
        prefill_tokens_per_sec: 1000.0,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let h = tokio::spawn(post(
        a,
        "/v1/completions",
        json!({"prompt": "x".repeat(4000), "max_tokens": 2, "ignore_eos": true}),
    ));
    // mid-prefill the request is neither running nor waiting, its rest is uncached work
    let v = wait_json(a, "/v1/loads", "a chunk boundary", |v| {
        let l = &v["loads"][0];
        let unc = l["num_waiting_uncached_tokens"].as_u64().unwrap_or(0);
        (200..=801).contains(&unc)
    })
    .await;
    let l = &v["loads"][0];
    assert_eq!(l["num_running_reqs"], 0, "{l}");
    assert_eq!(l["num_waiting_reqs"], 0, "{l}");
    assert_eq!(
        l["num_waiting_uncached_tokens"].as_u64().unwrap() % 100,
        1,
        "{l}"
    );
    assert!(
        l["num_used_tokens"].as_u64().unwrap() >= 100,
        "prefilled part locked: {l}"
    );
    let r = h.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["prompt_tokens"], 1001);
    let l = load_rank(a).await;
    assert_eq!(l["num_waiting_uncached_tokens"], 0, "{l}");
}

#[tokio::test]
async fn decode_out_of_kv_retracts_and_both_answers_complete() {
    // A (101 + 250) and B (101 + 150) cannot both finish in 400 KV tokens; a low
    // new_token_ratio admits B anyway, so decode runs out of KV and retracts B (fewer tokens)
    let cfg = Config {
        time_scale: 1.0,
        max_total_tokens: 400,
        schedule_conservativeness: 0.01,
        ..fast()
    };
    let (a, _) = start(cfg).await;
    let ha = tokio::spawn(post(
        a,
        "/v1/completions",
        json!({"prompt": "a".repeat(400), "max_tokens": 250, "ignore_eos": true}),
    ));
    wait_json(a, "/v1/loads", "A running", |v| {
        v["loads"][0]["num_running_reqs"] == 1
    })
    .await;
    let hb = tokio::spawn(post(
        a,
        "/v1/completions",
        json!({"prompt": "b".repeat(400), "max_tokens": 150, "ignore_eos": true}),
    ));
    let (ra, rb) = (ha.await.unwrap(), hb.await.unwrap());
    assert_eq!(ra.status, 200, "{}", ra.body);
    assert_eq!(rb.status, 200, "{}", rb.body);
    assert_eq!(ra.json()["usage"]["completion_tokens"], 250);
    assert_eq!(rb.json()["usage"]["completion_tokens"], 150);
    let m = get(a, "/metrics").await.body;
    assert!(
        metric(&m, "sglang:num_retracted_requests_total") >= 1.0,
        "{m}"
    );
    assert_eq!(metric(&m, "sglang:generation_tokens_total"), 400.0);
    let info = get(a, "/get_server_info").await.json();
    assert!(
        info["simulator"]["retractions_total"].as_u64().unwrap() >= 1,
        "{info}"
    );
    assert_eq!(info["chunked_prefill_size"], 8192);
}
