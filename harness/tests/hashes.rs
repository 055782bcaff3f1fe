//! The real `.wasm` hashes prompts exactly as the native build does. The `.wasm` computes xxh3
//! with its own Wasm SIMD code (`filter/src/xxh3.rs`: two windows' 128-bit products folded at
//! once, for 64-byte text blocks and the 17-to-128-byte token-id blocks), the native build with
//! 128-bit multiplies; replicas, peers and the native module must
//! all agree on every block hash, so a hash the `.wasm` computes differently would split the
//! fleet's index without failing any single-build test. Here the `.wasm` reports the hashes it
//! writes through its peer batches (16-byte records: model key, worker, block hash), and each
//! index record must be one of the block hashes the native crate computes for the same prompt
//! (a new prompt's placement travels in the same batches under the model's placement key, with
//! its sibling key in the hash's place).

use prefix_router::blocks::{chain_seed, hash_blocks, hash_token_blocks};
use prefix_router::config::Config;
use prefix_router::request::{self, Endpoint};
use proxy_wasm_host::{Host, Options};
use std::collections::HashSet;

const CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}},
  "peers":{"clusters":["peer0"],"secret":"0123456789abcdef","flush_ms":10}}"#;

fn words(n: usize, seed: u64) -> String {
    let w = ["alpha ", "beta ", "gamma ", "delta ", "epsilon ", "zeta "];
    let mut x = seed | 1;
    let mut s = String::new();
    while s.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s += w[(x % 6) as usize];
    }
    s
}

/// The block hashes the native crate computes for `body`, chained from the model's seed: text
/// in 64-byte blocks, token ids (canonical text, ~110 bytes per block) in blocks of 16 ids.
fn native(ep: Endpoint, body: &[u8]) -> HashSet<u64> {
    let mut canon = Vec::new();
    request::parse(ep, body, &mut canon, 1 << 20).expect("parse");
    let (seed, mut out) = (chain_seed(b"llama", None), Vec::new());
    match ep {
        Endpoint::Chat => hash_blocks(seed, &canon, 64, 1 << 16, &mut out),
        _ => hash_token_blocks(seed, &canon, 16, 1 << 16, &mut out),
    };
    out.into_iter().collect()
}

#[test]
fn the_wasm_hashes_every_block_as_the_native_build_does() {
    let host = Host::filter(Options::default()).expect("load prefix_router.wasm");
    let mut vm = host.vm(CONFIG).expect("configure");
    let cfg = Config::from_json(CONFIG.as_bytes()).expect("config");
    let (index_key, placed_key) = (cfg.models[0].peer_key, cfg.models[0].placed_peer_key);
    let mut cases: Vec<(&str, Endpoint, Vec<u8>)> = Vec::new();
    for (i, n) in [100usize, 1000, 4000, 9000].into_iter().enumerate() {
        let chat = format!(
            r#"{{"model":"llama","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"q{i}"}}]}}"#,
            words(n, i as u64 + 1)
        );
        cases.push(("/v1/chat/completions", Endpoint::Chat, chat.into_bytes()));
        let ids: Vec<String> = (0..n as u64 / 4)
            .map(|k| ((k * 7919 + i as u64 * 104_729) % 150_000).to_string())
            .collect();
        let generate = format!(r#"{{"input_ids":[{}]}}"#, ids.join(", "));
        cases.push(("/generate", Endpoint::Generate, generate.into_bytes()));
    }
    for (k, (path, ep, body)) in cases.iter().enumerate() {
        let r = vm.request("POST", path, &[], body).expect("request");
        vm.finish(r.context, &[]).expect("finish");
        host.set_clock((k as u64 + 1) * 1_000_000_000);
        vm.elapse(20).expect("tick");
        let calls: Vec<_> = vm
            .take_http_calls()
            .into_iter()
            .filter(|c| c.cluster == "peer0")
            .collect();
        assert!(!calls.is_empty(), "{path}: a peer batch after the response");
        let want = native(*ep, body);
        let mut got = 0;
        for call in &calls {
            assert_eq!(call.body.get(..4), Some(&b"PRr2"[..]), "batch header");
            // 28-byte header (magic, sender, sequence, timestamp), records, 32-byte MAC.
            let recs = &call.body[28..call.body.len() - 32];
            assert_eq!(recs.len() % 16, 0);
            for rec in recs.chunks(16) {
                let key = u32::from_le_bytes(rec[..4].try_into().unwrap());
                if key == placed_key {
                    continue;
                }
                assert_eq!(key, index_key, "{path}: a record of an unknown kind");
                let h = u64::from_le_bytes(rec[8..16].try_into().unwrap());
                assert!(
                    want.contains(&h),
                    "{path} ({} bytes): the .wasm wrote block hash {h:#x}, which the native build never computes",
                    body.len()
                );
                got += 1;
            }
            vm.answer_http_call(call.token, 200, b"").expect("answer");
        }
        // Checkpoints 1, 2, 3, 4, 6, 8, ...: every prompt here has at least two blocks.
        assert!(got >= 2, "{path}: {got} records");
    }
}
