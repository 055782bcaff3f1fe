//! The real `prefix_router.wasm` under the wasmtime host: several VMs sharing one shared-data
//! store behave like Envoy worker threads. Needs the filter built for wasm32-wasip1 (built on
//! demand if missing, see `proxy_wasm_host::filter_wasm`).

use proxy_wasm_host::{Host, Options, Vm};

const CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}},
  "debug_header":"x-prefix-router-decision"}"#;

fn host() -> Host {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    h
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
    )
    .into_bytes()
}

fn cluster(vm: &mut Vm, body: &[u8]) -> (i32, String) {
    let r = vm
        .request("POST", "/v1/chat/completions", &[], body)
        .expect("request callbacks");
    assert_eq!(r.headers_action, 1, "headers pause for the body");
    assert_eq!(r.body_action, Some(0), "body continues");
    let c = r
        .header("x-prefix-router-cluster")
        .expect("cluster header set")
        .to_string();
    (r.context, c)
}

fn tick_all(vms: &mut [Vm]) {
    for vm in vms {
        vm.elapse(200).expect("tick");
    }
}

fn inflight(h: &Host) -> i64 {
    (0..4)
        .map(|i| {
            h.stats
                .get(&format!("prefix_router.inflight_requests.w{i}"))
                .unwrap_or(0)
        })
        .sum()
}

#[test]
fn vms_sharing_data_agree_and_release_every_charge() {
    let h = host();
    let mut vms: Vec<Vm> = (0..4).map(|_| h.vm(CONFIG).expect("vm starts")).collect();
    let sys = "You are a helpful assistant. ".repeat(40);
    // The first request indexes the prefix; every VM then sends the same prefix to that worker.
    let (ctx, first) = cluster(&mut vms[0], &chat(&sys, "hello"));
    let hdrs = vms[0].finish(ctx, &[]).unwrap();
    let dbg = hdrs
        .iter()
        .find(|e| e.0 == "x-prefix-router-decision")
        .expect("debug header");
    assert!(dbg.1.contains("reason=hash_affinity"), "{dbg:?}");
    for (i, vm) in vms.iter_mut().enumerate() {
        let (ctx, c) = cluster(vm, &chat(&sys, &format!("q{i}")));
        assert_eq!(c, first, "vm {i} follows the shared index");
        vm.finish(ctx, &[]).unwrap();
    }
    // Metrics are batched per VM and flushed on the tick (as Envoy's timer would).
    tick_all(&mut vms);
    assert_eq!(inflight(&h), 0);
    assert_eq!(h.stats.get("prefix_router.requests.prefix_hit"), Some(4));

    // Interleaved open streams across VMs (like concurrent requests on several threads): the
    // load bound spreads a hot prefix, and every charge is released exactly once.
    let mut open = Vec::new();
    for k in 0..32 {
        let v = k % vms.len();
        let (ctx, c) = cluster(&mut vms[v], &chat(&sys, &format!("u{k}")));
        open.push((v, ctx, c));
    }
    tick_all(&mut vms);
    assert_eq!(inflight(&h), 32);
    let mut per = std::collections::BTreeMap::new();
    for (_, _, c) in &open {
        *per.entry(c.clone()).or_insert(0) += 1;
    }
    assert!(per.len() > 1, "hot prefix spilled: {per:?}");
    for (k, (v, ctx, _)) in open.into_iter().enumerate() {
        if k % 5 == 0 {
            vms[v].abort(ctx).unwrap(); // client reset: no on_log, released on delete
        } else {
            vms[v].finish(ctx, &[]).unwrap();
        }
    }
    tick_all(&mut vms);
    assert_eq!(inflight(&h), 0, "{:?}", h.stats.all());
    for vm in &vms {
        assert!(
            vm.logs().iter().all(|(lvl, _)| *lvl < 4),
            "no errors logged: {:?}",
            vm.logs()
        );
    }
}

#[test]
fn threads_hammering_one_store_keep_counters_consistent() {
    let h = host();
    let sys = "Shared system prompt for every thread. ".repeat(30);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let h = h.clone();
            let sys = sys.clone();
            std::thread::spawn(move || {
                let mut vm = h.vm(CONFIG).unwrap();
                let mut open = Vec::new();
                for i in 0..200 {
                    let (ctx, _) = cluster(&mut vm, &chat(&sys, &format!("t{t} i{i}")));
                    open.push(ctx);
                    if open.len() > 3 {
                        let c = open.remove(0);
                        vm.finish(c, &[]).unwrap();
                    }
                }
                for c in open {
                    vm.finish(c, &[]).unwrap();
                }
                vm.elapse(200).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(inflight(&h), 0, "{:?}", h.stats.all());
    let routed: i64 = ["prefix_hit", "hash_affinity", "load_spill"]
        .iter()
        .map(|r| {
            h.stats
                .get(&format!("prefix_router.requests.{r}"))
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(routed, 800);
    // The load in shared data is back to zero too (no VM holds a lease with load).
    assert_eq!(
        h.shared.load_totals("llama"),
        (0, 0),
        "{:?}",
        h.shared.load_leases("llama")
    );
}

#[test]
fn passthrough_reject_and_spoofed_header() {
    let h = host();
    let cfg = r#"{"models":{"llama":{"workers":["w0","w1"]}},"unknown_model":"reject"}"#;
    let mut vm = h.vm(cfg).unwrap();
    let r = vm
        .roundtrip(
            "GET",
            "/v1/models",
            &[("x-prefix-router-cluster", "evil")],
            b"",
        )
        .unwrap();
    let c = r.header("x-prefix-router-cluster").unwrap();
    assert!(c == "w0" || c == "w1", "{c}");
    let r = vm
        .request(
            "POST",
            "/v1/chat/completions",
            &[],
            br#"{"model":"nope","messages":[]}"#,
        )
        .unwrap();
    let (status, body, _) = r.local_response.expect("404 sent locally");
    assert_eq!(status, 404);
    assert!(String::from_utf8_lossy(&body).contains("nope"));
    vm.abort(r.context).unwrap();
    // An invalid configuration fails VM start, naming the field.
    let err = h
        .vm(r#"{"models":{}}"#)
        .err()
        .expect("invalid config rejected");
    assert!(format!("{err:#}").contains("models"), "{err:#}");
}
