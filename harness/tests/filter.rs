//! The tests of the real `prefix_router.wasm` on the harness, as one test binary: each file
//! beside this one is a module here (`harness/Cargo.toml` has `autotests = false`), so the
//! wasmtime-sized test binary is compiled and linked once instead of once per file, and the
//! files' tests run in parallel in one process sharing the compiled module. One file's tests:
//! `cargo test -p proxy-wasm-host --test filter fuzz::`.

mod chat_text;
mod envoy_like;
mod exports;
mod fuzz;
mod hashes;
mod host_calls;
mod index_records;
mod load_leases;
mod pd;
mod reload;
mod token_ids;

/// A four-worker plugin config whose debug header (`x-dbg`) reports each decision's match.
pub(crate) const DEBUG_CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}},
  "default_model":"llama","debug_header":"x-dbg"}"#;

/// Sends `body` to `path`, answers 200 and returns `(matched, total)` blocks from the debug
/// header of [`DEBUG_CONFIG`].
pub(crate) fn matched_total(vm: &mut proxy_wasm_host::Vm, path: &str, body: &str) -> (u32, u32) {
    let r = vm
        .request("POST", path, &[], body.as_bytes())
        .expect("request");
    assert!(r.header("x-prefix-router-cluster").is_some(), "{body:.80}");
    let hdrs = vm.finish(r.context, &[]).expect("finish");
    let dbg = hdrs
        .iter()
        .find(|e| e.0 == "x-dbg")
        .map(|e| e.1.clone())
        .expect("debug header");
    let field = |k: &str| -> u32 {
        dbg.split("; ")
            .find_map(|kv| kv.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {dbg}"))
    };
    (field("matched="), field("total="))
}

/// Every `.rs` file in `harness/tests/` is a module above: with `autotests = false` cargo would
/// silently skip a new file that is not.
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = include_str!("filter.rs");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&here).expect("harness/tests") {
        let path = entry.expect("a directory entry").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_some_and(|e| e == "rs")
            && stem != "filter"
            && !this.contains(&format!("\nmod {stem};\n"))
        {
            missing.push(stem.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "not declared in harness/tests/filter.rs: {missing:?}"
    );
}
