//! Index records and tenants through the real `.wasm`: a decision writes the records its worker
//! is not known to hold, a failed or reset request takes them back, tenants (named by a header Envoy sets) never see
//! each other's prefixes in the debug header, and encoded inference paths are not passthrough.

use proxy_wasm_host::{Host, Options, Vm};

const CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}},
  "debug_header":"x-dbg","tenant_header":"x-tenant","hash_key":"0123456789abcdef-test"}"#;

fn chat(system: &str, user: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
    )
    .into_bytes()
}

/// Sends a chat for `tenant` (no header when empty) and returns its context.
fn send(vm: &mut Vm, path: &str, tenant: &str, body: &[u8]) -> i32 {
    let hdrs: Vec<(&str, &str)> = if tenant.is_empty() {
        vec![]
    } else {
        vec![("x-tenant", tenant)]
    };
    let r = vm.request("POST", path, &hdrs, body).expect("request");
    assert_eq!(
        r.headers_action, 1,
        "{path}: an inference request waits for its body"
    );
    assert!(r.header("x-prefix-router-cluster").is_some());
    r.context
}

/// Finishes a stream with a 200 response and returns its debug header.
fn finish(vm: &mut Vm, ctx: i32) -> String {
    let hdrs = vm.finish(ctx, &[]).expect("finish");
    hdrs.iter()
        .find(|e| e.0 == "x-dbg")
        .map(|e| e.1.clone())
        .expect("debug header")
}

/// Finishes a stream with a response of `status` and returns its debug header.
fn finish_with(vm: &mut Vm, ctx: i32, status: &str) -> String {
    let hdrs = vm.finish(ctx, &[(":status", status)]).expect("finish");
    hdrs.iter()
        .find(|e| e.0 == "x-dbg")
        .map(|e| e.1.clone())
        .expect("debug header")
}

fn matched(dbg: &str) -> u32 {
    dbg.split("; ")
        .find_map(|kv| kv.strip_prefix("matched="))
        .and_then(|v| v.parse().ok())
        .expect("matched=")
}

#[test]
fn failed_requests_take_their_records_back_and_tenants_stay_apart() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    let mut vm = h.vm(CONFIG).expect("vm");
    let system = "Confidential system prompt of acme. ".repeat(30);
    let body = chat(&system, "q");
    let path = "/v1/chat/completions";
    // A prompt nobody holds: a stream reset before any response, and one answered 503, leave
    // nothing, and two streams open at once do not see each other before an answer.
    let ctx = send(&mut vm, path, "acme", &body);
    vm.abort(ctx).expect("abort");
    let ctx = send(&mut vm, path, "acme", &body);
    assert_eq!(matched(&finish_with(&mut vm, ctx, "503")), 0);
    let a = send(&mut vm, path, "acme", &body);
    let b = send(&mut vm, path, "acme", &body);
    assert_eq!(
        matched(&finish(&mut vm, b)),
        0,
        "a new prompt waits for its answer"
    );
    assert_eq!(matched(&finish(&mut vm, a)), 0);
    // Both answered 200: now the prompt is known to acme...
    let ctx = send(&mut vm, path, "acme", &body);
    let dbg = finish(&mut vm, ctx);
    let held = matched(&dbg);
    assert!(held > 0 && dbg.contains("reason=prefix_hit"), "{dbg}");
    // ...and a prompt extending it is seen by a second stream before its answer; reset or
    // failed, it leaves nothing.
    let longer = chat(
        &system,
        &"a longer question on the same document ".repeat(20),
    );
    let mut base = 0; // what the longer prompt matches with none of it recorded
    for end in ["503", "reset", "200"] {
        let a = send(&mut vm, path, "acme", &longer);
        let b = send(&mut vm, path, "acme", &longer);
        let seen = matched(&finish(&mut vm, b));
        match end {
            "503" => base = matched(&finish_with(&mut vm, a, "503")),
            "reset" => vm.abort(a).expect("abort"),
            _ => assert_eq!(matched(&finish(&mut vm, a)), base, "the reset left nothing"),
        }
        assert!(
            seen > base,
            "{end}: written at the decision: {seen} > {base}"
        );
        // (Answered 503 itself, so that it records nothing.)
        let ctx = send(&mut vm, path, "acme", &longer);
        let now = matched(&finish_with(&mut vm, ctx, "503"));
        if end == "200" {
            assert!(now > base, "{end}: kept: {now}");
        } else {
            // b's own answer (200) came before a's end: b matched a's records, wrote nothing
            // of its own, and a took them back.
            assert_eq!(now, base, "{end}: taken back");
        }
    }
    // ...and to nobody else, not even with the same prompt bytes.
    for tenant in ["globex", ""] {
        let ctx = send(&mut vm, path, tenant, &body);
        let dbg = finish(&mut vm, ctx);
        assert_eq!(matched(&dbg), 0, "tenant {tenant:?}: {dbg}");
    }
}

#[test]
fn encoded_inference_paths_are_routed_as_inference() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    let mut vm = h.vm(CONFIG).expect("vm");
    let body = chat("s", "u");
    for path in [
        "/v1/chat/%63ompletions",
        "/v1/chat%2Fcompletions",
        "//v1/chat/completions",
    ] {
        let ctx = send(&mut vm, path, "acme", &body);
        let dbg = finish(&mut vm, ctx);
        assert!(!dbg.contains("passthrough"), "{path}: {dbg}");
    }
    let r = vm
        .request("POST", "//v1/completions", &[], br#"{"prompt":"p"}"#)
        .expect("request");
    assert_eq!(r.headers_action, 1, "paused for the body: inference");
}
