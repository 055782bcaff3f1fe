//! Wasmtime fuel (≈ Wasm instructions) per request of the real `.wasm` for `benches/overhead`'s
//! 4 KB chat body (the same bytes as `body_of_size(4)` there), steady state (the prompt already
//! indexed, 50 requests of warm-up), the bench's plugin config without load polls:
//!
//!   cargo run --release -p proxy-wasm-host --example request_fuel [REQUESTS] [esc] [fresh]
//!
//! `esc`: every 12th space of the system prompt written as the JSON escape `\n` (chat text as
//! clients send it: the text fast path decodes it, serde does otherwise). `fresh`: each request
//! opens its system prompt with its own number, so no two share a block (nothing for
//! `block_memo.rs` to reuse, an index miss each). `PREFIX_ROUTER_WASM` names another build.

use proxy_wasm_host::{Host, Options};

const CONFIG: &str = r#"{"models":{"llama":{"workers":[{"cluster":"w0","address":"127.0.0.1:1"},{"cluster":"w1","address":"127.0.0.2:1"},{"cluster":"w2","address":"127.0.0.3:1"},{"cluster":"w3","address":"127.0.0.4:1"}]}},"default_model":"llama","unknown_model":"default","cluster_header":"x-prefix-router-cluster","debug_header":null,"policy":{"name":"cache_aware"},"load_poll":{"interval_ms":0}}"#;

/// `benches/overhead_modes/common.py`'s `body_of_size`, optionally with `\n` escapes.
fn body_of_size(kb: usize, escapes: bool) -> Vec<u8> {
    let words = [
        "the", "model", "cache", "prefix", "routing", "worker", "token", "prompt", "system",
    ];
    let head = r#"{"model":"llama","messages":[{"role":"system","content":""#;
    let tail = r#""},{"role":"user","content":"What is the answer?"}],"max_tokens":64}"#;
    let n = kb * 1024 - head.len() - tail.len();
    let (mut text, mut len, mut i) = (Vec::new(), 0, 0usize);
    while len < n {
        let w = words[(i * 7 + i / 3) % words.len()];
        text.push(w);
        len += w.len() + 1;
        i += 1;
    }
    let mut content = text.join(" ");
    content.truncate(n);
    if escapes {
        let mut o = String::new();
        for (k, part) in content.split(' ').enumerate() {
            if k > 0 {
                o.push_str(if k % 12 == 0 { "\\n" } else { " " });
            }
            o.push_str(part);
        }
        content = o;
    }
    format!("{head}{content}{tail}").into_bytes()
}

/// `body` with its system prompt's first 8 bytes replaced by `i` (same length).
fn numbered(body: &[u8], i: u64) -> Vec<u8> {
    let at = br#"{"model":"llama","messages":[{"role":"system","content":""#.len();
    let mut b = body.to_vec();
    if let Some(slot) = b.get_mut(at..at + 8) {
        slot.copy_from_slice(format!("{:08}", i % 100_000_000).as_bytes());
    }
    b
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let escapes = args.iter().any(|a| a == "esc");
    let fresh = args.iter().any(|a| a == "fresh");
    let h = Host::filter(Options { fuel: true }).expect("load prefix_router.wasm");
    let mut vm = h.vm(CONFIG).expect("vm");
    let body = body_of_size(4, escapes);
    let headers = [("content-type", "application/json")];
    let mut i = 0;
    let mut send = || {
        i += 1;
        let b = if fresh {
            numbered(&body, i)
        } else {
            body.clone()
        };
        vm.roundtrip("POST", "/v1/chat/completions", &headers, &b)
            .expect("roundtrip")
            .fuel
    };
    for _ in 0..50 {
        send();
    }
    let fuel: u64 = (0..n.max(1)).map(|_| send()).sum();
    println!(
        "fuel per request {} ({} bytes{}{})",
        fuel / n.max(1),
        body.len(),
        if escapes { ", \\n escapes" } else { "" },
        if fresh { ", a new prompt each" } else { "" }
    );
}
