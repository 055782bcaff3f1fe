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
