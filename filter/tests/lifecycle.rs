//! The stream lifecycle, natively: `glue` driven over `host::FakeHost` exactly as `abi` drives
//! it from Envoy's callbacks. Metric batching, the load charge released exactly once (asserted
//! on the shared-data load leases, not only on the VM-side gauge), the passthrough choice, the
//! client's routing headers stripped, the debug header, and streams of an unconfigured root.

mod common;
use common::{
    answer, configured, request, request_header, response_header, set_request, shared_load, step,
    ticks,
};
use prefix_router::config::Config;
use prefix_router::glue::{Action, Root, Stream};
use prefix_router::host::FakeHost;
use prefix_router::policy::Reason;
use prefix_router::records::ById;
use prefix_router::store::Store;

const WORKERS: [&str; 3] = ["w0", "w1", "w2"];

fn config(extra: &str) -> String {
    format!(r#"{{"models":{{"llama":{{"workers":["w0","w1","w2"]}}}}{extra}}}"#)
}

/// `n` chat streams decided and left open (users "0", "1", ...).
fn open_chats(h: &FakeHost, root: &Root, n: usize) -> Vec<Stream> {
    (0..n)
        .map(|i| {
            let chat = chat(&i.to_string());
            request(h, root, "POST", "/v1/chat/completions", &[], &chat).0
        })
        .collect()
}

fn chat(user: &str) -> String {
    format!(r#"{{"model":"llama","messages":[{{"role":"user","content":"{user}"}}]}}"#)
}

/// In-flight requests per worker, from the shared-data load leases.
fn loads(h: &FakeHost, cfg: &str) -> Vec<u32> {
    loads_and_tokens(h, cfg).0
}

/// Every worker's `(requests, tokens)` in shared data (all leases).
fn loads_and_tokens(h: &FakeHost, cfg: &str) -> (Vec<u32>, Vec<u32>) {
    shared_load(h, &Config::from_json(cfg.as_bytes()).expect("config"), 0)
}

#[test]
fn the_first_response_headers_end_the_queued_prefill_charge_and_the_stream_end_the_request() {
    let cfg = config("");
    let (h, mut root) = configured(&cfg);
    let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("one"));
    let (reqs, tokens) = loads_and_tokens(&h, &cfg);
    assert_eq!(reqs.iter().sum::<u32>(), 1);
    assert!(
        tokens.iter().sum::<u32>() > 0,
        "the prompt is queued prefill"
    );
    // SGLang sends a streamed answer's headers with its first token: the request decodes now.
    h.state.borrow_mut().response_headers = vec![(":status".into(), "200".into())];
    s.on_response_headers(&h);
    s.on_response_headers(&h); // a second call releases nothing more
    for _ in 0..8 {
        root.on_tick(&h);
    }
    let (reqs, tokens) = loads_and_tokens(&h, &cfg);
    assert_eq!(
        (reqs.iter().sum::<u32>(), tokens.iter().sum::<u32>()),
        (1, 0)
    );
    s.on_done(&h);
    for _ in 0..8 {
        root.on_tick(&h);
    }
    assert_eq!(
        loads_and_tokens(&h, &cfg),
        (vec![0; WORKERS.len()], vec![0; WORKERS.len()])
    );
    for w in WORKERS {
        let g = h.metric(&format!("prefix_router.inflight_tokens.{w}"));
        assert_eq!(g, Some(0), "token gauge of {w}");
    }
}

#[test]
fn a_charge_is_released_exactly_once_whichever_callbacks_end_the_stream() {
    let cfg = config("");
    let (h, mut root) = configured(&cfg);
    let (mut a, act) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("one"));
    assert_eq!(act, Action::Continue);
    let (mut b, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("two"));
    assert_eq!(
        loads(&h, &cfg).iter().sum::<u32>(),
        2,
        "two streams charged"
    );
    // Envoy ends a stream with on_done, then on_delete (abi calls on_done again there when
    // done never came): each stream gives its charge back once, however often it is told.
    a.on_done(&h);
    a.on_done(&h);
    assert_eq!(loads(&h, &cfg).iter().sum::<u32>(), 1, "one released once");
    b.on_done(&h);
    for _ in 0..8 {
        root.on_tick(&h); // flushes parked releases and batched gauges
    }
    assert_eq!(
        loads(&h, &cfg),
        vec![0; WORKERS.len()],
        "no charge left, none below zero"
    );
    for w in WORKERS {
        let g = h.metric(&format!("prefix_router.inflight_requests.{w}"));
        assert_eq!(g, Some(0), "gauge of {w}");
    }
}

/// Decisions counted in Envoy's stats so far, over every reason.
fn decisions(h: &FakeHost) -> i64 {
    Reason::ALL
        .iter()
        .filter_map(|r| h.metric(&format!("prefix_router.requests.{}", r.as_str())))
        .sum()
}

#[test]
fn metrics_are_batched_per_100ms_and_flushed_by_the_tick() {
    let (h, mut root) = configured(&config(""));
    let streams = open_chats(&h, &root, 5);
    let decided = decisions(&h);
    // The first decision flushes (a new 100 ms unit); the next four in the same unit wait.
    assert!(decided < 5, "every decision was sent at once ({decided})");
    let calls_before = h.calls();
    for _ in 0..4 {
        root.on_tick(&h);
    }
    assert!(h.calls() > calls_before, "the tick sends the batch");
    assert_eq!(
        decisions(&h),
        5,
        "all five decisions counted after the flush"
    );
    for mut s in streams {
        s.on_done(&h);
    }
}

/// A host without timers on idle threads (the native build) gets everything a stream's thread
/// batched at that stream's end: the in-flight gauges are back to 0 without any tick or decision.
#[test]
fn an_eager_host_gets_the_batch_at_each_stream_end() {
    for eager in [false, true] {
        let (h, root) = configured(&config(""));
        h.state.borrow_mut().eager_flush = eager;
        let streams = open_chats(&h, &root, 3);
        for mut s in streams {
            s.on_done(&h);
        }
        let inflight: i64 = ["w0", "w1", "w2"]
            .iter()
            .filter_map(|w| h.metric(&format!("prefix_router.inflight_requests.{w}")))
            .sum();
        assert_eq!(decisions(&h), if eager { 3 } else { 1 }, "eager={eager}");
        // Batching: the first decision's +1 went out with it, its -1 waits for the next flush.
        assert_eq!(inflight, if eager { 0 } else { 1 }, "eager={eager}");
    }
}

/// A root that cannot make calls (a native worker thread) never takes the poll lease, so the one
/// that can (the native main thread) polls; neither counts a failure for it.
#[test]
fn a_root_that_cannot_call_leaves_the_polls_to_one_that_can() {
    let (h, mut worker) = configured(&config(""));
    h.state.borrow_mut().cannot_call = true;
    for _ in 0..6 {
        h.state.borrow_mut().now_nanos += 60_000_000;
        worker.on_tick(&h);
    }
    assert!(
        h.state.borrow().calls.is_empty(),
        "a root that cannot call made calls"
    );
    assert_eq!(h.metric("prefix_router.load_poll.failures"), Some(0));
    // Same store (same Envoy), another root that can call: it gets the lease and polls.
    h.state.borrow_mut().cannot_call = false;
    let mut main = Root::new();
    assert!(main.on_configure(&h, config("").len()));
    for _ in 0..3 {
        h.state.borrow_mut().now_nanos += 60_000_000;
        main.on_tick(&h);
    }
    let calls = h.state.borrow().calls.len();
    assert!(
        calls >= 3,
        "the root that can call polls every worker ({calls} calls)"
    );
}

fn path_of(c: &prefix_router::host::Call) -> &str {
    c.headers
        .iter()
        .find(|(k, _)| k == ":path")
        .map_or("", |(_, v)| v.as_str())
}

fn is_load_poll(c: &prefix_router::host::Call) -> bool {
    path_of(c) == "/v1/loads"
}

/// A worker whose reads keep failing is asked less often: its counter reads (a 404: no
/// `--enable-metrics`; a 200 that is no Prometheus page) after 1, 2, 4, ... rounds up to 60 s,
/// its load polls when it answers them with something else up to 30 s; a worker that answers
/// both keeps its periods (1 s and the no-traffic interval here).
#[test]
fn failing_counter_reads_and_answered_wrong_load_polls_back_off_to_their_caps() {
    let cfg = config(r#","load_poll":{"metrics_interval_ms":1000}"#);
    let (h, mut root) = configured(&cfg);
    let counters = b"sglang:prompt_tokens_total 10.0\nsglang:cached_tokens_total 5.0\n";
    let load = br#"{"loads":[{"num_running_reqs":1,"num_waiting_reqs":0}]}"#;
    let chat = br#"{"id":"x","object":"chat.completion","choices":[]}"#;
    let mut sent: Vec<(u64, String, String)> = Vec::new(); // (ms, worker, path)
    for i in 1..=12_000u64 {
        for c in step(&h, &mut root) {
            let (path, w) = (path_of(&c).to_string(), c.upstream.clone());
            let (status, body): (&str, &[u8]) = match (path.as_str(), w.as_str()) {
                ("/metrics", "w0") => ("200", counters),
                ("/metrics", "w1") => ("404", b""),
                ("/metrics", _) => ("200", chat),
                (_, "w2") => ("200", chat),
                _ => ("200", load),
            };
            answer(&h, &mut root, c.token, status, body);
            sent.push((i * 50, w, path));
        }
    }
    let at = |w: &str, path: &str, from: u64| -> Vec<u64> {
        sent.iter()
            .filter(|(t, sw, sp)| sw == w && sp == path && *t >= from)
            .map(|(t, _, _)| *t)
            .collect()
    };
    let gaps = |v: Vec<u64>| v.windows(2).map(|x| x[1] - x[0]).collect::<Vec<_>>();
    assert!(gaps(at("w0", "/metrics", 0)).iter().all(|&g| g == 1000));
    for w in ["w1", "w2"] {
        let g = gaps(at(w, "/metrics", 0));
        assert!(g.windows(2).all(|x| x[1] >= x[0]), "{w}: {g:?}");
        assert_eq!(g.iter().max(), Some(&60_000), "{w}: {g:?}");
        assert!(at(w, "/metrics", 300_000).len() <= 6, "{w}: {g:?}");
    }
    assert!(gaps(at("w0", "/v1/loads", 0)).iter().all(|&g| g == 500));
    let g = gaps(at("w2", "/v1/loads", 0));
    assert_eq!(g.iter().max(), Some(&30_000), "{g:?}");
    assert!(at("w2", "/v1/loads", 300_000).len() <= 11, "{g:?}");
}

/// The index's self-check reads each worker's token counters every `metrics_interval_ms` and
/// publishes them for every VM; a read whose answer never comes does not stop that worker's
/// reads; an interval of 0 reads nothing.
#[test]
fn worker_token_counters_are_read_at_the_metrics_interval_and_published() {
    let cfg = config(r#","load_poll":{"metrics_interval_ms":1000}"#);
    let (h, mut root) = configured(&cfg);
    let metric_calls = |h: &FakeHost| -> Vec<(u32, String)> {
        h.state
            .borrow()
            .calls
            .iter()
            .filter(|c| path_of(c) == "/metrics")
            .map(|c| (c.token, c.upstream.clone()))
            .collect()
    };
    let tick = |root: &mut Root, ms: u64| ticks(&h, root, ms);
    tick(&mut root, 50);
    let first = metric_calls(&h);
    assert_eq!(
        first.iter().map(|c| c.1.as_str()).collect::<Vec<_>>(),
        WORKERS,
        "one read per worker"
    );
    // w0 and w1 answer; w2's answer never comes.
    for (i, (token, _)) in first.iter().take(2).enumerate() {
        let body = format!(
            "# TYPE sglang:prompt_tokens_total counter\nsglang:prompt_tokens_total{{a=\"b\"}} {}.0\nsglang:cached_tokens_total 7.0\n",
            1000 * (i + 1)
        );
        {
            let mut s = h.state.borrow_mut();
            s.call_headers = vec![(":status".into(), "200".into())];
            s.call_body = body.clone().into_bytes();
        }
        root.on_http_call_response(&h, *token, body.len());
    }
    let mut buf = Vec::new();
    h.get("pr/h3/llama", &mut buf);
    let parsed: Config = Config::from_json(cfg.as_bytes()).unwrap();
    let ids = ById::new(parsed.models[0].workers.iter().map(|w| w.id));
    let mut samples = Vec::new();
    prefix_router::hits::decode(&buf, &ids, 3, &mut samples);
    let prompts: Vec<u64> = samples.iter().map(|s| s.counters.prompt).collect();
    assert_eq!(prompts, vec![1000, 2000, 0]);
    assert!(samples[0].at > 0 && samples[0].counters.cached == 7 && samples[2].at == 0);
    // The next round, a second later: w0 and w1 again, w2 not while its call may still answer.
    tick(&mut root, 1000);
    let second: Vec<String> = metric_calls(&h)[3..].iter().map(|c| c.1.clone()).collect();
    assert_eq!(second, vec!["w0", "w1"]);
    // Once the unanswered call is overdue (timeout + 1 s), w2 is read again.
    tick(&mut root, 2000);
    assert!(
        metric_calls(&h)[5..].iter().any(|c| c.1 == "w2"),
        "a lost answer stopped w2's reads"
    );
    // Off: no reads at all.
    let (h, mut root) = configured(&config(r#","load_poll":{"metrics_interval_ms":0}"#));
    ticks(&h, &mut root, 2000);
    assert!(h.state.borrow().calls.iter().all(is_load_poll));
}

/// A counter read still in flight when the configuration changes is forgotten: its answer names
/// a worker position of the old worker list, which may be another worker now.
#[test]
fn a_counter_read_in_flight_at_a_reconfiguration_is_not_filed_under_the_new_workers() {
    let old = config(r#","load_poll":{"metrics_interval_ms":1000}"#);
    let (h, mut root) = configured(&old);
    step(&h, &mut root);
    let (token, upstream) = h
        .state
        .borrow()
        .calls
        .iter()
        .find(|c| path_of(c) == "/metrics")
        .map(|c| (c.token, c.upstream.clone()))
        .expect("a counter read");
    assert_eq!(upstream, "w0");
    // The same model, its workers in another order: position 0 is w2 now.
    let new = r#"{"models":{"llama":{"workers":["w2","w0","w1"]}},"load_poll":{"metrics_interval_ms":1000}}"#;
    h.state.borrow_mut().plugin_config = new.as_bytes().to_vec();
    assert!(root.on_configure(&h, new.len()));
    let body = b"sglang:prompt_tokens_total 1000\nsglang:cached_tokens_total 10\n";
    {
        let mut s = h.state.borrow_mut();
        s.call_headers = vec![(":status".into(), "200".into())];
        s.call_body = body.to_vec();
    }
    root.on_http_call_response(&h, token, body.len());
    let mut buf = Vec::new();
    h.get("pr/h3/llama", &mut buf);
    let parsed = Config::from_json(new.as_bytes()).unwrap();
    let ids = ById::new(parsed.models[0].workers.iter().map(|w| w.id));
    let mut samples = Vec::new();
    prefix_router::hits::decode(&buf, &ids, 3, &mut samples);
    assert!(
        samples.iter().all(|s| s.at == 0),
        "w0's answer was filed under another worker: {samples:?}"
    );
}

/// Load polls follow traffic: every `interval_ms` while a model has requests, every
/// `no_traffic_interval_ms` without; a new request brings the short period back at the next tick.
#[test]
fn a_model_without_traffic_is_polled_at_the_no_traffic_interval_and_traffic_brings_the_interval_back(
) {
    let (h, mut root) = configured(&config(""));
    let rounds_in = |root: &mut Root, ms: u64| {
        let before = h.state.borrow().calls.len();
        for _ in 0..ms / 50 {
            // Each worker answers at once (a call still awaiting its answer is not re-sent).
            let tokens: Vec<u32> = step(&h, root)
                .iter()
                .filter(|c| is_load_poll(c))
                .map(|c| c.token)
                .collect();
            for t in tokens {
                let body = br#"{"loads":[{"num_running_reqs":1,"num_waiting_reqs":0}]}"#;
                {
                    let mut s = h.state.borrow_mut();
                    s.call_headers = vec![(":status".into(), "200".into())];
                    s.call_body = body.to_vec();
                }
                root.on_http_call_response(&h, t, body.len());
            }
        }
        let calls = &h.state.borrow().calls[before..];
        calls.iter().filter(|c| is_load_poll(c)).count() / WORKERS.len()
    };
    rounds_in(&mut root, 1000); // the first round, and the value settles
    assert_eq!(rounds_in(&mut root, 2000), 4, "idle: every 500 ms");
    let (mut st, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("x"));
    assert_eq!(
        rounds_in(&mut root, 1000),
        10,
        "a request in flight: every 100 ms"
    );
    st.on_done(&h);
    let after = rounds_in(&mut root, 2000);
    assert!(
        (4..=5).contains(&after),
        "idle again: {after} rounds in 2 s"
    );
    // Traffic that ends between two rounds still counts (the value's stamp moved).
    request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("y"))
        .0
        .on_done(&h);
    assert!(
        rounds_in(&mut root, 200) >= 1,
        "a round within 200 ms of a finished request"
    );
}

#[test]
fn passthrough_takes_the_configured_cluster_and_the_client_never_picks_one() {
    let cfg = config(r#","passthrough_cluster":"info","debug_header":"x-debug""#);
    let (h, root) = configured(&cfg);
    let spoof = [("x-prefix-router-cluster", "admin"), ("x-debug", "forged")];
    let (mut s, act) = request(&h, &root, "GET", "/v1/models", &spoof, "");
    assert_eq!(act, Action::Continue);
    assert_eq!(
        request_header(&h, "x-prefix-router-cluster").as_deref(),
        Some("info")
    );
    assert_eq!(
        request_header(&h, "x-debug"),
        None,
        "client's debug header stripped"
    );
    assert_eq!(
        loads(&h, &cfg),
        vec![0; WORKERS.len()],
        "passthrough charges nothing"
    );
    s.on_done(&h);

    let (mut s, _) = request(
        &h,
        &root,
        "POST",
        "/v1/completions",
        &spoof,
        r#"{"model":"llama","prompt":"hi"}"#,
    );
    let w = request_header(&h, "x-prefix-router-cluster").expect("routed");
    assert!(WORKERS.contains(&w.as_str()), "routed to a worker, not {w}");
    s.on_done(&h);
}

/// The request headers are one host call: the filter's own header names are removed only when
/// the client sent them (each of them, prefill cluster and debug included), and every other
/// header stays.
#[test]
fn request_headers_are_read_in_one_call_and_spoofed_routing_headers_removed() {
    let (h, root) = configured(&config(r#","debug_header":"x-debug""#));
    let body = chat("one call");
    let mut st = root.new_stream().expect("stream");
    let path = "/v1/chat/completions";
    set_request(&h, "POST", path, &[("x-other", "kept")], body.as_bytes());
    let calls = h.calls();
    assert_eq!(st.on_request_headers(&h, false), Action::Pause);
    assert_eq!(
        h.calls() - calls,
        1,
        "one host call for the request headers"
    );
    st.on_done(&h);

    let spoof = [
        ("x-prefix-router-cluster", "admin"),
        ("x-prefix-router-prefill-cluster", "admin"),
        ("x-debug", "forged"),
        ("x-prefix-router-cluster", "twice"),
        ("x-other", "kept"),
    ];
    let mut st = root.new_stream().expect("stream");
    set_request(&h, "POST", path, &spoof, body.as_bytes());
    let calls = h.calls();
    assert_eq!(st.on_request_headers(&h, false), Action::Pause);
    assert_eq!(
        h.calls() - calls,
        4,
        "the map read and one removal per name"
    );
    for (name, _) in &spoof[..4] {
        assert_eq!(request_header(&h, name), None, "{name} removed");
    }
    assert_eq!(request_header(&h, "x-other").as_deref(), Some("kept"));
    st.on_done(&h);
}

#[test]
fn the_debug_header_says_where_and_why_on_the_response_only_when_configured() {
    let (h, root) = configured(&config(r#","debug_header":"x-debug""#));
    let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("dbg"));
    let worker = request_header(&h, "x-prefix-router-cluster").expect("routed");
    assert_eq!(s.on_response_headers(&h), Action::Continue);
    let v = response_header(&h, "x-debug").expect("debug header on the response");
    assert!(v.starts_with(&format!("worker={worker}; reason=")), "{v}");
    assert!(
        v.contains("; total=") && !v.contains("holder="),
        "nobody held it: {v}"
    );
    s.on_done(&h);
    // A prompt served before: its holder and that holder's load as the decision saw it (the
    // first request is over: nothing in flight, nothing queued; capacity not polled).
    let long = chat(&"debug: a prompt long enough for a few blocks. ".repeat(40));
    let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &long);
    let worker = request_header(&h, "x-prefix-router-cluster").expect("routed");
    h.state.borrow_mut().response_headers = vec![(":status".into(), "200".into())];
    s.on_response_headers(&h);
    s.on_done(&h);
    h.state.borrow_mut().response_headers.clear();
    let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &long);
    s.on_response_headers(&h);
    let v = response_header(&h, "x-debug").expect("debug header on the response");
    // The same prompt again, on its holder: what it holds is what this request matched.
    let matched = v
        .split("; ")
        .find_map(|f| f.strip_prefix("matched="))
        .unwrap_or("?");
    assert!(
        v.ends_with(&format!(
            "; holder={worker}; held={matched}; holder_load=0/0/0; sharers=0"
        )),
        "{v}"
    );
    s.on_done(&h);
    // Asked again: one earlier request reached the same deepest prefix.
    let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &long);
    s.on_response_headers(&h);
    let v = response_header(&h, "x-debug").expect("debug header on the response");
    assert!(v.ends_with("; sharers=1"), "{v}");
    s.on_done(&h);

    let (h, root) = configured(&config(""));
    let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("x"));
    s.on_response_headers(&h);
    assert!(
        h.state.borrow().response_headers.is_empty(),
        "no debug header by default"
    );
    s.on_done(&h);
}

#[test]
fn an_unknown_model_is_answered_locally_and_charges_nothing() {
    let cfg = config(r#","unknown_model":"reject""#);
    let (h, root) = configured(&cfg);
    let body = r#"{"model":"nope","prompt":"hi"}"#;
    let (mut s, act) = request(&h, &root, "POST", "/v1/completions", &[], body);
    assert_eq!(act, Action::Pause, "a local reply stops the chain");
    let replies = h.state.borrow().replies.clone();
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0, 404);
    assert_eq!(request_header(&h, "x-prefix-router-cluster"), None);
    s.on_done(&h);
    assert_eq!(loads(&h, &cfg), vec![0; WORKERS.len()]);
}

#[test]
fn a_root_without_an_accepted_configuration_makes_no_streams() {
    assert!(Root::new().new_stream().is_none());
    let h = FakeHost::new();
    let bad = r#"{"models":{},"nope":1}"#;
    h.state.borrow_mut().plugin_config = bad.as_bytes().to_vec();
    let mut root = Root::new();
    assert!(!root.on_configure(&h, bad.len()));
    assert!(!h.state.borrow().errors.is_empty(), "the refusal is logged");
    assert!(root.new_stream().is_none());
    root.on_tick(&h); // no configuration: nothing to do, no panic
    assert!(root.on_done(&h));
    assert!(h.state.borrow().replies.is_empty());
}

#[test]
fn a_pd_prompt_reuses_its_prefill_worker_after_the_decode_worker_answered_2xx() {
    let cfg = r#"{"models":{"m":{"prefill":[{"cluster":"p0","bootstrap_host":"10.0.0.1","bootstrap_port":9001},{"cluster":"p1","bootstrap_host":"10.0.0.2","bootstrap_port":9001}],"decode":["d0","d1"]}},"debug_header":"x-debug"}"#;
    let (h, root) = configured(cfg);
    let system = "You are a careful assistant. ".repeat(60);
    let body = |q: &str| {
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{q}"}}]}}"#
        )
    };
    let mut seen = Vec::new();
    for q in ["first question", "second question"] {
        let (mut s, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &body(q));
        h.state
            .borrow_mut()
            .response_headers
            .push((":status".into(), "200".into()));
        s.on_response_headers(&h);
        let v = response_header(&h, "x-debug").expect("debug header");
        s.on_done(&h);
        seen.push(v);
    }
    // The second question reuses the system prompt on the first one's prefill worker: one holder
    // of two is not a fleet prefix (policy/cache_aware.rs needs at least two holders).
    assert!(!seen[1].contains("matched=0;"), "{seen:?}");
    assert!(seen[1].contains("reason=prefix_hit"), "{seen:?}");
}

/// A root that cannot make calls (a native worker thread) hands its peer records to the root
/// that can (the native main thread) through shared data, at its ticks and, on an eager host,
/// at each stream end; that root sends them to every peer in its own batch, once.
#[test]
fn a_root_that_cannot_call_hands_its_peer_records_to_one_that_can() {
    use prefix_router::config::PEER_PATH;
    use prefix_router::peers::{HEADER, MAC_LEN, MAGIC, RELAY_KEY};
    let cfg = config(
        r#","peers":{"clusters":["peer0","peer1"],"secret":"0123456789abcdef","flush_ms":100}"#,
    );
    for eager in [false, true] {
        let (h, mut worker) = configured(&cfg);
        {
            let mut s = h.state.borrow_mut();
            s.cannot_call = true;
            s.eager_flush = eager;
        }
        let prompt = "a system prompt long enough for a few blocks. ".repeat(40);
        let (mut s, _) = request(
            &h,
            &worker,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat(&prompt),
        );
        h.state.borrow_mut().response_headers = vec![(":status".into(), "200".into())];
        s.on_response_headers(&h);
        s.on_done(&h);
        let relayed = |h: &FakeHost| {
            let mut v = Vec::new();
            h.get(RELAY_KEY, &mut v);
            v.len()
        };
        if eager {
            assert!(
                relayed(&h) > 0,
                "an eager host hands records off at the stream end"
            );
        }
        for _ in 0..3 {
            h.state.borrow_mut().now_nanos += 60_000_000;
            worker.on_tick(&h);
        }
        let n = relayed(&h);
        assert!(n > 0 && n % 16 == 0, "eager={eager}: {n} relayed bytes");
        assert!(
            h.state.borrow().calls.is_empty(),
            "a root that cannot call made calls"
        );

        h.state.borrow_mut().cannot_call = false;
        let mut main = Root::new();
        assert!(main.on_configure(&h, cfg.len()));
        for _ in 0..4 {
            h.state.borrow_mut().now_nanos += 60_000_000;
            main.on_tick(&h);
        }
        let st = h.state.borrow();
        let sent: Vec<_> = st
            .calls
            .iter()
            .filter(|c| {
                c.headers
                    .iter()
                    .any(|(k, v)| k == ":path" && v == PEER_PATH)
            })
            .collect();
        let mut peers: Vec<&str> = sent.iter().map(|c| c.upstream.as_str()).collect();
        peers.sort();
        assert_eq!(
            peers,
            ["peer0", "peer1"],
            "eager={eager}: one batch per peer"
        );
        for c in &sent {
            let body = c.body.as_deref().unwrap_or_default();
            assert_eq!(body.get(..4), Some(MAGIC.as_slice()));
            assert_eq!(
                body.len() - HEADER - MAC_LEN,
                n,
                "eager={eager}: every relayed record, once"
            );
        }
        drop(st);
        assert_eq!(relayed(&h), 0, "the relay is drained");
    }
}

const PEERS: &str = r#","peers":{"clusters":["peer0"],"secret":"0123456789abcdef","flush_ms":100}"#;

/// What the timer sent in a span: load polls per worker cluster and peer batches, with tokens.
#[derive(Default)]
struct Sent {
    polls: Vec<(String, u32)>,
    batches: Vec<u32>,
}

impl Sent {
    fn polls_to(&self, worker: &str) -> usize {
        self.polls
            .iter()
            .filter(|(u, _)| u.starts_with(worker))
            .count()
    }
}

/// Ticks every 50 ms for `ms`; every call is answered at once (200 for a poll, 204 for a batch)
/// unless `lost` says it never gets an answer (upstream name).
fn tick_for(h: &FakeHost, root: &mut Root, ms: u64, lost: &dyn Fn(&str) -> bool) -> Sent {
    use prefix_router::config::PEER_PATH;
    let mut sent = Sent::default();
    for _ in 0..ms / 50 {
        for c in step(h, root) {
            if path_of(&c) == "/metrics" {
                continue; // the self-check's counter reads (their own test above)
            }
            let peer = c
                .headers
                .iter()
                .any(|(k, v)| k == ":path" && v == PEER_PATH);
            if peer {
                sent.batches.push(c.token);
            } else {
                sent.polls.push((c.upstream.clone(), c.token));
            }
            if lost(&c.upstream) {
                continue;
            }
            let (status, body): (&str, &[u8]) = if peer {
                ("204", b"")
            } else {
                (
                    "200",
                    br#"{"loads":[{"num_running_reqs":1,"num_waiting_reqs":0}]}"#,
                )
            };
            answer(h, root, c.token, status, body);
        }
    }
    sent
}

/// A finished chat with a new prompt long enough for index records (peer batches carry them).
fn finished_chat(h: &FakeHost, root: &Root, user: &str) {
    let prompt = format!("{user}: a prompt long enough for a few blocks. ").repeat(40);
    let (mut s, _) = request(h, root, "POST", "/v1/chat/completions", &[], &chat(&prompt));
    h.state.borrow_mut().response_headers = vec![(":status".into(), "200".into())];
    s.on_response_headers(h);
    s.on_done(h);
}

/// The published polled load of model 0: every worker's answer time (100 ms units).
fn polled_at(h: &FakeHost, cfg: &str) -> Vec<u32> {
    let c = Config::from_json(cfg.as_bytes()).expect("config");
    let m = &c.models[0];
    let mut buf = Vec::new();
    h.get(&m.poll_key, &mut buf);
    let mut out = Vec::new();
    let ids = ById::new(m.workers.iter().map(|w| w.id));
    prefix_router::poll::decode(&buf, &ids, m.workers.len(), &mut out);
    out.iter().map(|p| p.at).collect()
}

/// The timer's schedules (load polls, peer batches) survive wall-clock steps: proxy-wasm has no
/// monotonic clock. A step back must not stop them for the length of the step (loads would go
/// stale, PD would lose its dead-prefill exclusion, the outbox would overflow); a step forward
/// must not make them fire at every tick. Either way the polled view is fresh again at once.
#[test]
fn polls_and_peer_batches_go_on_after_the_clock_steps_back_or_forward() {
    let cfg = config(PEERS);
    let never_lost = |_: &str| false;
    for step_back in [true, false] {
        let (h, mut root) = configured(&cfg);
        finished_chat(&h, &root, "before");
        let s = tick_for(&h, &mut root, 1000, &never_lost);
        assert!(s.polls_to("w0") >= 2 && !s.batches.is_empty());
        {
            let mut st = h.state.borrow_mut();
            if step_back {
                st.now_nanos -= 60_000_000_000;
            } else {
                st.now_nanos += 60_000_000_000;
            }
        }
        for i in 0..3 {
            finished_chat(&h, &root, &format!("after {i}"));
            let s = tick_for(&h, &mut root, 1000, &never_lost);
            let rounds = s.polls_to("w0");
            assert!(
                (1..=11).contains(&rounds),
                "back={step_back}, second {i}: {rounds} rounds"
            );
            assert_eq!(s.batches.len(), 1, "back={step_back}, second {i}");
            let now = (h.state.borrow().now_nanos / 100_000_000) as u32;
            for at in polled_at(&h, &cfg) {
                assert!(
                    at <= now && now - at <= 10,
                    "back={step_back}, second {i}: answer at {at}, now {now}"
                );
            }
        }
    }
}

/// An HTTP call whose answer never arrives (Envoy normally answers a timed-out call itself)
/// holds its token only until its timeout plus a margin: then that worker is polled again and
/// peer batches resume. A late answer for an expired token is ignored: no second count, no
/// publish.
#[test]
fn calls_that_are_never_answered_expire_and_polling_and_replication_resume() {
    let cfg = config(PEERS);
    let (h, mut root) = configured(&cfg);
    // A request in flight throughout: polls every 100 ms.
    let (mut open, _) = request(&h, &root, "POST", "/v1/chat/completions", &[], &chat("o"));
    let lost = |u: &str| u == "peer0" || u.starts_with("w0");
    let mut polls_w0 = Vec::new();
    let mut batches = Vec::new();
    for i in 0..40 {
        finished_chat(&h, &root, &i.to_string());
        let s = tick_for(&h, &mut root, 100, &lost);
        polls_w0.extend(
            s.polls
                .iter()
                .filter(|(u, _)| u.starts_with("w0"))
                .map(|p| p.1),
        );
        batches.extend(s.batches.iter().copied());
        if i < 2 {
            assert_eq!(
                polls_w0.len(),
                1,
                "one call at a time while it may still come back"
            );
            assert!(
                s.polls_to("w1") >= 1,
                "the others answer and are asked again"
            );
        }
    }
    // 4 s: the lost poll expired and w0 was asked again (a few times, each lost again); the
    // batches went on past the in-flight cap (4 per peer).
    assert!(
        (2..=8).contains(&polls_w0.len()),
        "{} polls to the silent worker",
        polls_w0.len()
    );
    assert!(batches.len() > 8, "{} batches", batches.len());
    // Late answers for expired tokens: ignored.
    let flush = |h: &FakeHost, root: &mut Root| {
        for _ in 0..4 {
            root.on_tick(h); // clock unchanged: nothing is due, metrics flush
        }
    };
    flush(&h, &mut root);
    let answers = h.metric("prefix_router.load_poll.answers");
    let failures = h.metric("prefix_router.peers.send_failures");
    let at = polled_at(&h, &cfg);
    let body = br#"{"loads":[{"num_running_reqs":9,"num_waiting_reqs":0}]}"#;
    answer(&h, &mut root, polls_w0[0], "200", body);
    answer(&h, &mut root, batches[0], "500", b"");
    answer(&h, &mut root, batches[0], "500", b"");
    flush(&h, &mut root);
    assert_eq!(h.metric("prefix_router.load_poll.answers"), answers);
    assert_eq!(h.metric("prefix_router.peers.send_failures"), failures);
    assert_eq!(polled_at(&h, &cfg), at, "nothing published");
    open.on_done(&h);
}
