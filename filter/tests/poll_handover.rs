//! The poll lease changing hands between two VMs of one Envoy (two roots on one fake Envoy):
//! the VM that takes it over goes on with its last holder's schedule (`poll::Poller::write_pace`,
//! carried in the lease value) instead of asking at once every worker the holder was backing off
//! from.

mod common;
use common::configured;
use prefix_router::glue::Root;
use prefix_router::host::{Call, FakeHost};

const CFG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2"]}}}"#;

fn path_of(c: &Call) -> &str {
    c.headers
        .iter()
        .find(|(k, _)| k == ":path")
        .map_or("", |(_, v)| v.as_str())
}

/// One 50 ms step: the clock, then the timer of each root in `ticking`; every call is answered
/// by its sender at once, w0 with a load answer and Prometheus counters, w1 and w2 with a chat
/// completion (no load endpoint, no counters). Returns `(root, path, worker)` per call.
fn step(h: &FakeHost, roots: &mut [Root], ticking: &[usize]) -> Vec<(usize, String, String)> {
    let load = br#"{"loads":[{"num_running_reqs":1,"num_waiting_reqs":0}]}"#;
    let counters = b"sglang:prompt_tokens_total 10.0\nsglang:cached_tokens_total 5.0\n";
    let chat = br#"{"id":"x","object":"chat.completion","choices":[]}"#;
    h.state.borrow_mut().now_nanos += 50_000_000;
    let mut sent = Vec::new();
    for &r in ticking {
        let seen = h.state.borrow().calls.len();
        roots[r].on_tick(h);
        let calls = h.state.borrow().calls[seen..].to_vec();
        for c in calls {
            let body: &[u8] = match (path_of(&c), c.upstream.as_str()) {
                ("/metrics", "w0") => counters,
                (_, "w0") => load,
                _ => chat,
            };
            {
                let mut s = h.state.borrow_mut();
                s.call_headers = vec![(":status".into(), "200".into())];
                s.call_body = body.to_vec();
            }
            roots[r].on_http_call_response(h, c.token, body.len());
            sent.push((r, path_of(&c).to_string(), c.upstream.clone()));
        }
    }
    sent
}

#[test]
fn a_vm_taking_the_poll_lease_over_keeps_the_last_holders_back_offs() {
    let (h, first) = configured(CFG);
    let mut second = Root::new();
    assert!(second.on_configure(&h, CFG.len()));
    let mut roots = [first, second];
    // Two minutes of both timers: root 0 ticks first and holds the lease; w1 and w2 back off
    // to 30 s (load polls) and 60 s (counter reads), w0 is asked every round.
    let mut before = Vec::new();
    for _ in 0..2400 {
        before.extend(step(&h, &mut roots, &[0, 1]));
    }
    assert!(before.iter().all(|c| c.0 == 0), "one holder");
    let late = &before[before.len().saturating_sub(20)..];
    assert!(late.iter().any(|c| c.2 == "w0"), "w0 is polled");
    // Root 0 stalls (its thread blocked): root 1 takes the lease over after its ttl.
    let mut after = Vec::new();
    for _ in 0..40 {
        after.extend(step(&h, &mut roots, &[1]));
    }
    assert!(after.iter().all(|c| c.0 == 1), "{after:?}");
    assert!(
        after.iter().any(|c| c.2 == "w0" && c.1 == "/v1/loads"),
        "the new holder polls: {after:?}"
    );
    // In its first 2 s it asks neither backed-off worker: their periods (30 s, 60 s) go on.
    let backed_off: Vec<_> = after.iter().filter(|c| c.2 != "w0").collect();
    assert!(backed_off.is_empty(), "{backed_off:?}");
}

/// A schedule is adopted only for the same worker at the same position: a VM whose
/// configuration has another worker there (a config update replaced it) asks that one at once.
#[test]
fn a_handed_over_schedule_is_adopted_only_for_the_same_workers() {
    let (h, first) = configured(CFG);
    let other = r#"{"models":{"llama":{"workers":["w0","w1","w3"]}}}"#;
    h.state.borrow_mut().plugin_config = other.as_bytes().to_vec();
    let mut second = Root::new();
    assert!(second.on_configure(&h, other.len()));
    let mut roots = [first, second];
    for _ in 0..2400 {
        step(&h, &mut roots, &[0, 1]);
    }
    let mut after = Vec::new();
    for _ in 0..40 {
        after.extend(step(&h, &mut roots, &[1]));
    }
    assert!(
        after.iter().any(|c| c.2 == "w3" && c.1 == "/v1/loads"),
        "a worker the last holder never polled is asked at once: {after:?}"
    );
    assert!(after.iter().all(|c| c.2 != "w1"), "{after:?}");
}
