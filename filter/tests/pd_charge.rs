//! A PD request's charges over `host::FakeHost`: the prefill worker's charge belongs to the
//! stream before any host call after it is made, so a panic there (caught by the native build's
//! guard, which then lets the stream end) leaks nothing (issue 36 #9c).

mod common;
use common::{configured, set_request, shared_load};
use prefix_router::config::Config;
use std::panic::{catch_unwind, AssertUnwindSafe};

const PD: &str = r#"{"models":{"m":{"prefill":[{"cluster":"p0","bootstrap_host":"10.0.0.1","bootstrap_port":9001},{"cluster":"p1","bootstrap_host":"10.0.0.2","bootstrap_port":9001}],"decode":["d0","d1"]}},"load_poll":{"interval_ms":0}}"#;

/// In-flight requests per worker of model `mi` in shared data (all leases).
fn requests(h: &prefix_router::host::FakeHost, cfg: &Config, mi: usize) -> Vec<u32> {
    shared_load(h, cfg, mi).0
}

#[test]
fn a_panic_while_the_decode_worker_is_charged_leaks_no_prefill_charge() {
    let (h, root) = configured(PD);
    let cfg = Config::from_json(PD.as_bytes()).unwrap();
    let prefill = cfg.models.iter().position(|m| m.name == "m").unwrap();
    let decode = cfg.models[prefill].pd.as_ref().unwrap().decode_model;
    let body = r#"{"model":"m","prompt":"a prompt for the prefill worker, long enough"}"#;
    set_request(&h, "POST", "/v1/completions", &[], body.as_bytes());
    let mut st = root.new_stream().unwrap();
    st.on_request_headers(&h, false);
    // The decode worker's charge (the load CAS of the decode model) panics.
    h.store.panic_on_set(&cfg.models[decode].load_key);
    let r = catch_unwind(AssertUnwindSafe(|| {
        st.on_request_body(&h, body.len(), true)
    }));
    assert!(r.is_err(), "the injected fault fired");
    assert_eq!(
        requests(&h, &cfg, prefill).iter().sum::<u32>(),
        1,
        "prefill charged"
    );
    // The guard fails the request closed and Envoy ends the stream: its end releases.
    st.on_done(&h);
    assert_eq!(
        requests(&h, &cfg, prefill),
        vec![0; 2],
        "the prefill charge leaked"
    );
}
