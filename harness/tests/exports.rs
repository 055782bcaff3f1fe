//! The built `.wasm` exports only the proxy-wasm callbacks the filter needs: Envoy enters the
//! VM for every callback a module exports (and skips the others), so an export of
//! `proxy_on_response_body` alone would cost a VM entry per streamed token chunk.

use proxy_wasm_host::{filter_wasm, wasm_exports, Host, Options};

/// Exactly what the filter needs (see `filter/src/abi.rs` for why each one is there).
const EXPECTED: &[&str] = &[
    "memory",
    "proxy_abi_version_0_2_1",
    "proxy_on_configure",
    "proxy_on_context_create",
    "proxy_on_delete",
    "proxy_on_http_call_response",
    "proxy_on_memory_allocate",
    "proxy_on_request_body",
    "proxy_on_request_headers",
    "proxy_on_response_headers",
    "proxy_on_tick",
    "proxy_on_vm_start",
];

#[test]
fn the_wasm_exports_only_the_callbacks_the_filter_needs() {
    let path = filter_wasm().expect("prefix_router.wasm");
    let bytes = std::fs::read(&path).expect("read the .wasm");
    let mut owned = wasm_exports(&bytes).expect("an export section");
    owned.sort_unstable();
    let names: Vec<&str> = owned.iter().map(String::as_str).collect();
    assert_eq!(names, EXPECTED, "exports of {}", path.display());
    // Never per body chunk or trailer: these would put Envoy into the VM on every SSE chunk.
    for per_chunk in [
        "proxy_on_response_body",
        "proxy_on_response_trailers",
        "proxy_on_request_trailers",
        "proxy_on_log",
        // Envoy calls `on_delete` right after `on_done` at every stream end: one entry is enough.
        "proxy_on_done",
    ] {
        assert!(!names.contains(&per_chunk), "{per_chunk} is exported");
    }
}

/// A stream of a root context whose configuration was refused gets no context in the VM: its
/// callbacks continue (the SDK's dispatcher panicked when `create_http_context` gave `None`,
/// trapping the VM), and the VM keeps working.
#[test]
fn streams_of_an_unconfigured_root_continue_without_trapping() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    let (mut vm, accepted) = h
        .vm_any(r#"{"models":{}, "no_such_field": 1}"#)
        .expect("vm");
    assert!(!accepted, "a bad configuration must be refused");
    for _ in 0..3 {
        let r = vm
            .request(
                "POST",
                "/v1/chat/completions",
                &[("x-prefix-router-cluster", "admin")],
                br#"{"model":"m","prompt":"hi"}"#,
            )
            .expect("no trap");
        assert_eq!(r.headers_action, 0, "headers continue");
        assert_eq!(r.body_action, Some(0), "body continues");
        assert!(r.local_response.is_none());
        vm.finish(r.context, &[])
            .expect("stream end without a trap");
        vm.tick().expect("tick without a trap");
    }
}
