//! Token-id prompts through the real `.wasm`, whose scanner checks and copies 64 bytes of ids
//! per Wasm SIMD step (`filter/src/id_chunks.rs`) where the separators allow it and falls back
//! to a scalar step elsewhere. The same ids must make the same prompt blocks whatever the
//! separators: a body whose separators keep the scanner on its scalar step (`",\n  "`) is
//! recorded first, then the same ids in the formats the vector step reads (`,` and `, `) and a
//! mixed one must match every block of it. One changed id must cut the match at its block.

use proxy_wasm_host::{Host, Options, Vm};

use crate::{matched_total, DEBUG_CONFIG as CONFIG};

fn route(vm: &mut Vm, body: &str) -> (u32, u32) {
    matched_total(vm, "/generate", body)
}

fn body(ids: &[u32], sep: impl Fn(usize) -> &'static str) -> String {
    let mut s = String::from(r#"{"input_ids":["#);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s += sep(i);
        }
        s += &id.to_string();
    }
    s + "]}"
}

/// Ids of every digit count (1 to 10, `0` and `u32::MAX` included), mostly vocabulary-sized.
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 16 {
                0 => 0,
                1 => u32::MAX,
                2 => (x >> 8) as u32,
                3 => (x >> 8) as u32 % 100_000_000,
                k => (x >> 8) as u32 % 10u32.pow((k % 7) as u32 + 1),
            }
        })
        .collect()
}

#[test]
fn the_same_ids_make_the_same_blocks_in_every_format() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    let mut vm = h.vm(CONFIG).expect("vm");
    // Whole blocks of 16 ids, as many as a checkpoint (the index records a prompt at 1, 2, 3,
    // 4, 6, 8, 12, 16, 24, ... blocks), so that a match covers every id.
    for (seed, blocks) in [(1u64, 1u32), (2, 4), (3, 12), (4, 24), (5, 48)] {
        let n = 16 * blocks as usize;
        let ids = ids(seed, n);
        let first = route(&mut vm, &body(&ids, |_| ",\n  "));
        assert_eq!(first, (0, blocks), "seed {seed}: first sight");
        let again = route(&mut vm, &body(&ids, |_| ",\n  "));
        assert_eq!(
            again,
            (blocks, blocks),
            "seed {seed}: a repeat matches every block"
        );
        for (name, sep) in [
            ("compact", (|_| ",") as fn(usize) -> &'static str),
            ("json.dumps", |_| ", "),
            ("mixed", |i| [",", ", ", " ,", ",\t"][i % 4]),
        ] {
            assert_eq!(
                route(&mut vm, &body(&ids, sep)),
                again,
                "seed {seed}, {name}: every block matches"
            );
        }
        // One id changed in the middle: the match stops at its block.
        let mut changed = ids.clone();
        let at = n / 2;
        changed[at] = changed[at].wrapping_add(1);
        let (m, t) = route(&mut vm, &body(&changed, |_| ", "));
        assert_eq!(t, blocks);
        assert!(
            16 * m as usize <= at,
            "seed {seed}: {m}/{blocks} after a change at id {at}"
        );
    }
}

/// The test above only exercises the vector step if the build has it: the shipped `.wasm` is
/// built with `simd128` (`.cargo/config.toml`), so it is valid Wasm only with SIMD enabled.
#[test]
fn the_filter_is_built_with_wasm_simd() {
    let bytes = std::fs::read(proxy_wasm_host::filter_wasm().expect("build")).expect("read");
    let mut no_simd = wasmtime::Config::new();
    no_simd.wasm_relaxed_simd(false).wasm_simd(false);
    let engine = wasmtime::Engine::new(&no_simd).expect("engine");
    assert!(
        wasmtime::Module::validate(&engine, &bytes).is_err(),
        "prefix_router.wasm has no SIMD instructions: was it built without .cargo/config.toml's \
         target-feature (a RUSTFLAGS variable replaces it)?"
    );
    assert!(wasmtime::Module::validate(&wasmtime::Engine::default(), &bytes).is_ok());
}
