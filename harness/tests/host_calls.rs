//! Host calls per request of the real `.wasm`: each one crosses the V8 boundary in Envoy (and
//! shared-data calls take Envoy's global shared-data mutex), so their number is the filter's main
//! cost inside Envoy. Counted exactly with wasmtime's call hook; run with `--nocapture` to see the
//! table. The bounds below are regression guards on counts, not timings.

use proxy_wasm_host::{Host, Options, Vm};

const CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}}}"#;

fn chat(system: &str, user: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
    )
    .into_bytes()
}

/// (host calls, host->guest calls) of one full request lifecycle.
fn calls(vm: &mut Vm, path: &str, body: &[u8]) -> (u64, u64) {
    let (h0, g0) = (vm.state().host_calls, vm.state().guest_calls);
    let method = if body.is_empty() { "GET" } else { "POST" };
    vm.roundtrip(method, path, &[], body).expect("roundtrip");
    (vm.state().host_calls - h0, vm.state().guest_calls - g0)
}

#[test]
fn host_calls_per_request() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    let mut vm = h.vm(CONFIG).expect("vm");
    let system = "You are a helpful assistant who answers briefly. ".repeat(80); // ~4 KB
    let mut rows = Vec::new();

    rows.push((
        "new prefix (index miss, records checkpoints)",
        calls(&mut vm, "/v1/chat/completions", &chat(&system, "q0")),
    ));
    let mut hit = (0, 0);
    for i in 1..20 {
        hit = calls(
            &mut vm,
            "/v1/chat/completions",
            &chat(&system, &format!("q{i}")),
        );
    }
    rows.push((
        "shared prefix, new suffix (steady state, quiet thread: release written at once)",
        hit,
    ));
    // 20 decisions since start, then a 50 ms tick: >= 200/s, so the VM parks its releases.
    vm.tick().expect("tick");
    for i in 20..30 {
        hit = calls(
            &mut vm,
            "/v1/chat/completions",
            &chat(&system, &format!("q{i}")),
        );
    }
    rows.push((
        "shared prefix, new suffix (steady state, busy thread: release rides on the next decision)",
        hit,
    ));
    let same = chat(&system, "same");
    calls(&mut vm, "/v1/chat/completions", &same);
    rows.push((
        "identical prompt again",
        calls(&mut vm, "/v1/chat/completions", &same),
    ));
    // Another VM (Envoy thread) with a cold probe cache sees the same prefix through shared data.
    let mut vm2 = h.vm(CONFIG).expect("vm2");
    rows.push((
        "shared prefix on a second VM (cold probe cache)",
        calls(&mut vm2, "/v1/chat/completions", &chat(&system, "other")),
    ));
    rows.push((
        "GET /v1/models (passthrough)",
        calls(&mut vm, "/v1/models", b""),
    ));

    println!("\n| request | host calls | host->guest calls |\n|---|---|---|");
    for (name, (hc, gc)) in &rows {
        println!("| {name} | {hc} | {gc} |");
    }
    // Regression guards (counts, deterministic): the steady-state hit must stay cheap. Its 6:
    // the request header map, the clock, the body, the load vector's get and CAS, the cluster
    // header. Its 8 entries: context create, request headers, body, response headers, delete,
    // and the allocator for the header map, the body and `:status`.
    assert!(hit.0 <= 6, "steady-state hit made {} host calls", hit.0);
    assert!(
        hit.1 <= 8,
        "steady-state hit entered the VM {} times",
        hit.1
    );
    assert!(
        hit.0 < rows[1].1 .0,
        "a busy thread's release should ride on its next decision: {} vs {}",
        hit.0,
        rows[1].1 .0
    );
    // A quiet thread writes its lease once per short request after the decision: the
    // queued-prefill release at the response headers rides on the end's write.
    assert!(
        rows[1].1 .0 <= 8,
        "quiet-thread hit made {} host calls",
        rows[1].1 .0
    );
    assert!(
        rows[5].1 .0 <= 2,
        "passthrough made {} host calls",
        rows[5].1 .0
    );
}
