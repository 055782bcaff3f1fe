//! Shared fixtures for the prefix-router benches and allocation checks: deterministic prompts,
//! request bodies and plugin configurations, so every bench and test measures the same inputs.

use prefix_router::config::Config;
use prefix_router::router::{Outcome, Router};
use prefix_router::store::MemStore;

/// Characters per token the filter assumes by default (`policy.chars_per_token`).
pub const CHARS_PER_TOKEN: usize = 4;

/// splitmix64: a tiny deterministic generator for fixtures.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const WORDS: [&str; 16] = [
    "the", "model", "cache", "prefix", "routing", "worker", "token", "prompt", "system", "answer",
    "question", "context", "latency", "batch", "decode", "prefill",
];

/// `chars` bytes of plain ASCII text (words and spaces; no JSON escapes), seeded.
pub fn text(chars: usize, seed: u64) -> String {
    let mut s = String::with_capacity(chars + 16);
    let mut st = seed;
    while s.len() < chars {
        let w = WORDS[(splitmix(&mut st) % WORDS.len() as u64) as usize];
        s.push_str(w);
        s.push(' ');
    }
    s.truncate(chars);
    s
}

/// Token ids in their canonical form (each id's digits and `,`: what `request.rs` writes for
/// token prompts).
pub fn token_bytes(tokens: usize, seed: u64) -> Vec<u8> {
    let mut st = seed;
    let mut out = Vec::with_capacity(tokens * 7);
    for _ in 0..tokens {
        let t = (splitmix(&mut st) % 128_000) as u32;
        out.extend_from_slice(format!("{t},").as_bytes());
    }
    out
}

/// An OpenAI chat body: a system prompt of `system_chars` (shared by `group`) and a short user
/// turn unique to `id`. `system_chars = 4 * tokens` gives a prompt of about `tokens` tokens.
pub fn chat_body(system_chars: usize, group: u64, id: u64) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"question {id}: {}"}}],"max_tokens":128,"temperature":0.7,"stream":false}}"#,
        text(system_chars, group),
        text(64, id.wrapping_add(1 << 40)),
    )
    .into_bytes()
}

/// A body of about `bytes` bytes in total (the end-to-end bench's 1/4/16/64 KB prompts).
pub fn chat_body_of_size(bytes: usize, group: u64, id: u64) -> Vec<u8> {
    let overhead = chat_body(0, group, id).len();
    chat_body(bytes.saturating_sub(overhead), group, id)
}

/// Cluster names `w0..w{n-1}`.
pub fn worker_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i}")).collect()
}

/// Plugin configuration JSON with one model `llama` over `n` workers, as on a busy proxy
/// (`batch_releases_min_rps` 0: releases ride on the next decision, Envoy's steady state above
/// 200 requests/s per worker thread).
pub fn config_json(n: usize, policy: &str, capacity: usize) -> String {
    let workers: Vec<String> = worker_names(n).iter().map(|w| format!("\"{w}\"")).collect();
    format!(
        r#"{{"models":{{"llama":{{"workers":[{}]}}}},"index":{{"capacity":{capacity}}},"policy":{{"name":"{policy}","batch_releases_min_rps":0}}}}"#,
        workers.join(",")
    )
}

pub fn config(n: usize, policy: &str, capacity: usize) -> Config {
    Config::from_json(config_json(n, policy, capacity).as_bytes()).expect("bench config is valid")
}

/// A router over a fresh in-memory store, load vectors created.
pub fn router(n: usize, policy: &str, capacity: usize) -> (Router, MemStore) {
    let store = MemStore::new();
    let mut r = Router::new(config(n, policy, capacity), 42);
    r.init_store(&store);
    (r, store)
}

/// Routes `body` and releases it at once (one complete request lifecycle). Panics on a reject.
pub fn decide_and_release(
    r: &mut Router,
    s: &MemStore,
    ep: prefix_router::request::Endpoint,
    body: &[u8],
    now: u32,
) -> u16 {
    match r.route(s, ep, body, now) {
        Outcome::Route(d) => {
            // A 200 response: the index records are written.
            if let Some(p) = r.take_plan() {
                r.commit(s, &p, 200, now);
            }
            r.release(s, &d);
            d.worker
        }
        Outcome::Reject { status, .. } => panic!("unexpected reject {status}"),
        Outcome::Unplaced { model } => panic!("no worker for model {model}"),
    }
}
