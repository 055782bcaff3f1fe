//! Per-request cost of the real `prefix_router.wasm` under wasmtime (cranelift), through the
//! proxy-wasm host in this crate: a full request lifecycle (context create, request headers,
//! request body with the routing decision, response headers, done, log, delete) in steady state
//! (every prompt already indexed), 4 workers, default config. Also prints the wasmtime fuel
//! (≈ Wasm instructions) per request.
//!
//!   cargo build -p prefix-router --target wasm32-wasip1 --release
//!   cargo bench -p proxy-wasm-host --bench wasm

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use proxy_wasm_host::{Host, Options};
use std::time::Duration;

const CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}}}"#;

fn words(chars: usize, seed: u64) -> String {
    let w = [
        "the ", "model ", "cache ", "prefix ", "routing ", "worker ", "token ",
    ];
    let mut s = String::new();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while s.len() < chars {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(w[(x % w.len() as u64) as usize]);
    }
    s.truncate(chars);
    s
}

fn chat(chars: usize, group: u64, id: u64) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"question {id}"}}],"max_tokens":64}}"#,
        words(chars, group)
    )
    .into_bytes()
}

/// A `/generate` body of `tokens` ids below 128,000 (a Llama-3-sized vocabulary), joined by
/// `sep`: `","` (compact JSON) or `", "` (Python's `json.dumps` default, what the `requests` and
/// OpenAI clients send).
fn generate(tokens: usize, group: u64, id: u64, sep: &str) -> Vec<u8> {
    let mut ids: Vec<String> = (0..tokens as u64)
        .map(|i| ((i * 7919 + group * 104_729) % 128_000).to_string())
        .collect();
    ids.push(id.to_string());
    format!(r#"{{"input_ids":[{}]}}"#, ids.join(sep)).into_bytes()
}

/// Makes the body of request `id` in prefix group `group`.
type BodyFn = Box<dyn Fn(u64, u64) -> Vec<u8>>;

fn bench(c: &mut Criterion) {
    let cases: Vec<(&str, usize, &str, BodyFn)> = vec![
        (
            "chat_chars",
            1024,
            "/v1/chat/completions",
            Box::new(|g, i| chat(1024, g, i)),
        ),
        (
            "chat_chars",
            4096,
            "/v1/chat/completions",
            Box::new(|g, i| chat(4096, g, i)),
        ),
        (
            "chat_chars",
            16384,
            "/v1/chat/completions",
            Box::new(|g, i| chat(16384, g, i)),
        ),
        (
            "chat_chars",
            65536,
            "/v1/chat/completions",
            Box::new(|g, i| chat(65536, g, i)),
        ),
        (
            "generate_tokens",
            512,
            "/generate",
            Box::new(|g, i| generate(512, g, i, ",")),
        ),
        (
            "generate_tokens",
            4096,
            "/generate",
            Box::new(|g, i| generate(4096, g, i, ",")),
        ),
        (
            "generate_tokens_spaced",
            4096,
            "/generate",
            // Other prompts than the compact case's (groups 4 to 7): the same ids
            // hash the same whatever the separators, and prompts indexed by the previous
            // case's VM would measure another path.
            Box::new(|g, i| generate(4096, g + 4, i, ", ")),
        ),
        (
            "generate_tokens",
            32768,
            "/generate",
            Box::new(|g, i| generate(32768, g, i, ",")),
        ),
    ];
    let fuel_host = Host::filter(Options { fuel: true }).expect("load prefix_router.wasm");
    let host = Host::filter(Options::default()).expect("load prefix_router.wasm");
    let mut g = c.benchmark_group("wasm/request");
    for (name, size, path, make) in &cases {
        let bodies: Vec<Vec<u8>> = (0..16).map(|i| make(i % 4, i)).collect();
        // Fuel per request, steady state.
        let mut fvm = fuel_host.vm(CONFIG).unwrap();
        for b in &bodies {
            fvm.roundtrip("POST", path, &[], b).unwrap();
        }
        let fuel: u64 = bodies
            .iter()
            .map(|b| fvm.roundtrip("POST", path, &[], b).unwrap().fuel)
            .sum::<u64>()
            / bodies.len() as u64;
        println!(
            "fuel/{name}/{size}: {fuel} per request (body {} bytes)",
            bodies[0].len()
        );
        let mut vm = host.vm(CONFIG).unwrap();
        for b in &bodies {
            vm.roundtrip("POST", path, &[], b).unwrap();
        }
        let mut k = 0usize;
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new(*name, size), |bn| {
            bn.iter(|| {
                k = (k + 1) % bodies.len();
                vm.roundtrip("POST", path, &[], &bodies[k]).unwrap().context
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = bench
}
criterion_main!(benches);
