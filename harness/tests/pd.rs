//! PD disaggregation through the real `.wasm`: the body the workers get carries the bootstrap
//! fields of the chosen prefill worker (never the client's), the cluster header names the decode
//! worker and the prefill header the prefill worker (a client cannot set either), and both
//! charges are released when the stream ends.

use proxy_wasm_host::{Host, Options};
use serde_json::Value;

const CONFIG: &str = r#"{"models":{"m":{
    "prefill":[{"cluster":"p0","bootstrap_host":"10.0.0.1","bootstrap_port":9001},
               {"cluster":"p1","bootstrap_host":"10.0.0.2","bootstrap_port":9002}],
    "decode":["d0","d1","d2"]}}}"#;

fn gauge(h: &Host, name: &str) -> i64 {
    h.stats.get(name).unwrap_or(0)
}

#[test]
fn pd_request_is_rewritten_routed_and_released() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    let mut vm = h.vm(CONFIG).expect("vm");
    let body = br#"{"model":"m","bootstrap_room":1,"bootstrap_host":"evil","messages":[{"role":"user","content":"hello there"}],"stream":true}"#;
    let len = body.len().to_string();
    let mut open = Vec::new();
    let mut rooms = std::collections::HashSet::new();
    for _ in 0..3 {
        let r = vm
            .request(
                "POST",
                "/v1/chat/completions",
                &[
                    ("content-length", len.as_str()),
                    ("x-prefix-router-cluster", "p0"),
                    ("x-prefix-router-prefill-cluster", "d0"),
                ],
                body,
            )
            .expect("request");
        assert!(r.local_response.is_none());
        let decode = r.header("x-prefix-router-cluster").expect("cluster header");
        let prefill = r
            .header("x-prefix-router-prefill-cluster")
            .expect("prefill header");
        assert!(decode.starts_with('d'), "{decode}");
        assert!(prefill.starts_with('p'), "{prefill}");
        // one value each: the client's were removed
        let n = |name: &str| r.request_headers.iter().filter(|e| e.0 == name).count();
        assert_eq!(n("x-prefix-router-cluster"), 1);
        assert_eq!(n("x-prefix-router-prefill-cluster"), 1);
        let sent = vm.state().body.clone();
        assert_eq!(
            r.header("content-length"),
            Some(sent.len().to_string().as_str())
        );
        let v: Value = serde_json::from_slice(&sent).expect("rewritten body is JSON");
        let (host, port) = if prefill == "p0" {
            ("10.0.0.1", 9001)
        } else {
            ("10.0.0.2", 9002)
        };
        assert_eq!(v["bootstrap_host"], host);
        assert_eq!(v["bootstrap_port"], port);
        let room = v["bootstrap_room"].as_u64().expect("room");
        assert!(room < 1 << 63);
        assert!(rooms.insert(room), "rooms differ per request");
        assert_eq!(v["messages"][0]["content"], "hello there");
        assert_eq!(v["stream"], true);
        assert_eq!(v.as_object().unwrap().len(), 6, "{v}");
        open.push((r.context, decode.to_string()));
    }
    // three held requests: one per decode worker (least loaded)
    let mut decodes: Vec<_> = open.iter().map(|o| o.1.clone()).collect();
    decodes.sort();
    assert_eq!(decodes, ["d0", "d1", "d2"]);
    vm.elapse(250).expect("ticks flush the metrics");
    assert_eq!(gauge(&h, "prefix_router.pd.requests"), 3);
    assert_eq!(gauge(&h, "prefix_router.inflight_requests.d1"), 1);
    assert_eq!(gauge(&h, "prefix_router.pd.client_bootstrap_fields"), 6);
    for (ctx, _) in &open {
        vm.finish(*ctx, &[]).expect("finish");
    }
    vm.elapse(250).expect("ticks flush the metrics");
    for c in ["p0", "p1", "d0", "d1", "d2"] {
        assert_eq!(
            gauge(&h, &format!("prefix_router.inflight_requests.{c}")),
            0,
            "{c}"
        );
    }
}

#[test]
fn pd_body_that_is_not_an_object_is_refused_and_counted() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    let mut vm = h.vm(CONFIG).expect("vm");
    for body in [&b"[1,2]"[..], b"{\"model\":\"m\",", b"not json"] {
        let r = vm
            .request("POST", "/v1/completions", &[], body)
            .expect("request");
        let lr = r.local_response.expect("local reply");
        assert_eq!(lr.0, 400);
        vm.abort(r.context).expect("abort");
    }
    vm.elapse(250).expect("tick");
    assert_eq!(gauge(&h, "prefix_router.pd.bad_body"), 3);
    assert_eq!(gauge(&h, "prefix_router.pd.requests"), 0);
    for c in ["p0", "p1"] {
        assert_eq!(
            gauge(&h, &format!("prefix_router.inflight_requests.{c}")),
            0,
            "{c}"
        );
    }
}
