//! What the FakeHost-driven integration tests share: a root configured on a fresh fake Envoy.

#![allow(dead_code)] // each test crate uses its own part

use prefix_router::glue::{Action, Root, Stream};
use prefix_router::host::FakeHost;

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

/// Runs a stream's request callbacks as Envoy does; returns the stream and the last action.
pub fn request(
    h: &FakeHost,
    root: &Root,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (Stream, Action) {
    {
        let mut s = h.state.borrow_mut();
        s.request_headers = vec![
            (":method".into(), method.into()),
            (":path".into(), path.into()),
        ];
        s.request_headers
            .extend(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        s.request_body = body.as_bytes().to_vec();
        s.response_headers.clear();
    }
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
