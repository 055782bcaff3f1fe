//! What the FakeHost-driven integration tests share: a root configured on a fresh fake Envoy.

#![allow(dead_code)] // each test crate uses its own part

use prefix_router::config::Config;
use prefix_router::glue::{Action, Root, Stream};
use prefix_router::host::{Call, FakeHost};
use prefix_router::load;
use prefix_router::records::ById;
use prefix_router::store::Store;

/// The fake clock's start (ns since the epoch).
const T0: u64 = 1_700_000_000_000_000_000;

/// A fake Envoy at `T0` and a root that accepted `cfg` (the test fails naming the errors if not).
pub fn configured(cfg: &str) -> (FakeHost, Root) {
    let h = FakeHost::new();
    {
        let mut s = h.state.borrow_mut();
        s.plugin_config = cfg.as_bytes().to_vec();
        s.now_nanos = T0;
    }
    let mut root = Root::new();
    assert!(
        root.on_configure(&h, cfg.len()),
        "{:?}",
        h.state.borrow().errors
    );
    (h, root)
}

/// What Envoy hands the next stream's request callbacks: `method`, `path`, then `headers`, and
/// `body`.
pub fn set_request(h: &FakeHost, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut s = h.state.borrow_mut();
    s.request_headers = vec![
        (":method".into(), method.into()),
        (":path".into(), path.into()),
    ];
    s.request_headers
        .extend(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    s.request_body = body.to_vec();
}

/// The upstream's response headers (`:status` alone) and, where `served` names one, the address
/// of the host that served (`None` leaves the last one).
pub fn respond(h: &FakeHost, status: &str, served: Option<&str>) {
    let mut s = h.state.borrow_mut();
    s.response_headers = vec![(":status".into(), status.into())];
    if let Some(a) = served {
        s.upstream_address = Some(a.into());
    }
}

/// Every worker's `(requests, tokens)` of model `mi` of `cfg` in shared data (all leases).
pub fn shared_load(h: &FakeHost, cfg: &Config, mi: usize) -> (Vec<u32>, Vec<u32>) {
    let m = &cfg.models[mi];
    let mut buf = Vec::new();
    h.get(&m.load_key, &mut buf);
    let (mut reqs, mut tokens) = (Vec::new(), Vec::new());
    let ids = ById::new(m.workers.iter().map(|w| w.id));
    load::decode(&buf, &ids, m.workers.len(), &mut reqs, &mut tokens);
    (reqs, tokens)
}

/// One 50 ms step of the fake clock and the root's timer; returns the calls the timer made.
pub fn step(h: &FakeHost, root: &mut Root) -> Vec<Call> {
    h.state.borrow_mut().now_nanos += 50_000_000;
    let seen = h.state.borrow().calls.len();
    root.on_tick(h);
    let new = h.state.borrow().calls[seen..].to_vec();
    new
}

/// `ms` of timer steps whose calls get no answer.
pub fn ticks(h: &FakeHost, root: &mut Root, ms: u64) {
    for _ in 0..ms / 50 {
        step(h, root);
    }
}

/// Runs a stream's request callbacks as Envoy does; returns the stream and the last action.
pub fn request(
    h: &FakeHost,
    root: &Root,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (Stream, Action) {
    set_request(h, method, path, headers, body.as_bytes());
    h.state.borrow_mut().response_headers.clear();
    let mut st = root.new_stream().expect("a configured root makes streams");
    let a = st.on_request_headers(h, body.is_empty());
    if body.is_empty() {
        return (st, a);
    }
    assert_eq!(a, Action::Pause, "an inference request waits for its body");
    let a = st.on_request_body(h, body.len(), true);
    (st, a)
}

pub fn request_header(h: &FakeHost, name: &str) -> Option<String> {
    let s = h.state.borrow();
    let mut it = s.request_headers.iter().filter(|e| e.0 == name);
    let v = it.next().map(|e| e.1.clone());
    assert!(it.next().is_none(), "{name} appears twice");
    v
}

/// The first response header named `name` the filter added.
pub fn response_header(h: &FakeHost, name: &str) -> Option<String> {
    let s = h.state.borrow();
    s.response_headers
        .iter()
        .find(|e| e.0 == name)
        .map(|e| e.1.clone())
}

pub fn answer(h: &FakeHost, root: &mut Root, token: u32, status: &str, body: &[u8]) {
    {
        let mut s = h.state.borrow_mut();
        s.call_headers = vec![(":status".into(), status.into())];
        s.call_body = body.to_vec();
    }
    root.on_http_call_response(h, token, body.len());
}
