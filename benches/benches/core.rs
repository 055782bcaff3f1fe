//! Criterion benches of the pure-Rust routing core (native, over `store::MemStore`).
//!
//!   cargo bench -p prefix-router-benches --bench core              # everything (~4 min)
//!   cargo bench -p prefix-router-benches --bench core -- route/    # one group
//!
//! Groups: `hash/text` and `hash/tokens` (chained xxh3 blocks), `index/match` and `index/insert`
//! (warm slot-table index of 100k / 1M entries), `policy/choose` (cache-aware scoring over n
//! workers), `policy/decide` (a whole decision for a one-block prompt under each policy: flat in
//! n for round_robin / random), `route/` (the full decision for a 4096-token chat prompt: parse
//! only, and route + release), `load/after_reload` (a decision over 1024 workers on a load value
//! written by a config with one more worker in front: every position hint misses).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefix_router::blocks::{chain_seed, hash_blocks, hash_token_blocks};
use prefix_router::config::worker_id;
use prefix_router::index::{Index, IndexBuffers, Matches};
use prefix_router::policy::{self, Inputs};
use prefix_router::request::{self, Endpoint};
use prefix_router::router::Router;
use prefix_router::store::MemStore;
use prefix_router_benches::{
    chat_body, config, decide_and_release, router, splitmix, text, token_bytes, worker_names,
};
use std::hint::black_box;
use std::time::Duration;

const WORKERS: [usize; 4] = [4, 16, 64, 256];

fn hashing(c: &mut Criterion) {
    let seed = chain_seed(b"llama", None);
    let mut out = Vec::with_capacity(16384);
    let mut g = c.benchmark_group("hash/text");
    for chars in [1024usize, 4096, 16384, 65536] {
        let data = text(chars, 1);
        g.throughput(Throughput::Bytes(chars as u64));
        g.bench_with_input(BenchmarkId::from_parameter(chars), &data, |b, d| {
            b.iter(|| hash_blocks(seed, black_box(d.as_bytes()), 64, 16384, &mut out))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("hash/tokens");
    for tokens in [512usize, 4096, 32768] {
        let data = token_bytes(tokens, 2);
        g.throughput(Throughput::Elements(tokens as u64));
        g.bench_with_input(BenchmarkId::from_parameter(tokens), &data, |b, d| {
            b.iter(|| hash_token_blocks(seed, black_box(d), 16, 16384, &mut out))
        });
    }
    g.finish();
}

/// A random 256-block chain (a 4096-token prompt's block hashes).
fn chain(st: &mut u64) -> Vec<u64> {
    (0..256).map(|_| splitmix(st)).collect()
}

/// An index of `entries` capacity filled by recording random 256-block prompts (16 checkpoints
/// each) for random holders among `ids`, until it has seen `entries` checkpoint writes.
fn warm_index(entries: usize, ids: &[u32]) -> (MemStore, Vec<Vec<u64>>) {
    let s = MemStore::new();
    let ix = index_view(entries);
    let mut sc = IndexBuffers::default();
    let mut st = 7u64;
    let mut recent = Vec::new();
    let prompts = entries / 16;
    for p in 0..prompts {
        let h = chain(&mut st);
        let id = ids[(splitmix(&mut st) % ids.len() as u64) as usize];
        ix.record(&s, &h, id, Default::default(), 100, &mut sc);
        if p + 64 >= prompts {
            recent.push(h); // the last ones are certainly still indexed
        }
    }
    (s, recent)
}

fn index_view(entries: usize) -> Index<'static> {
    Index {
        key_prefix: "pr/i/llama/",
        buckets: (entries / 4) as u32,
        ttl: 6000,
        cas_retries: 4,
        cache_ttl: 0,
    }
}

/// The index sizes benched: 100k and 1M entries. In criterion's test mode (`cargo test --bench`,
/// as `scripts/test` runs it: no `--bench` argument, each bench runs once to show it works) 1/100
/// of them: the same code runs, and warming ten 1M-entry indexes in the unoptimised test build
/// took ~45 s of the test command's time.
fn index_sizes() -> [usize; 2] {
    let args: Vec<String> = std::env::args().collect();
    let test_mode = !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test");
    if test_mode {
        [1_000, 10_000]
    } else {
        [100_000, 1_000_000]
    }
}

fn index(c: &mut Criterion) {
    let mut g = c.benchmark_group("index/match");
    for entries in index_sizes() {
        for n in WORKERS {
            let ids: Vec<u32> = worker_names(n).iter().map(|w| worker_id(w)).collect();
            let (s, recent) = warm_index(entries, &ids);
            let ix = index_view(entries);
            let mut sc = IndexBuffers::default();
            let mut m = Matches::default();
            let mut st = 99u64;
            let miss = chain(&mut st);
            let mut k = 0usize;
            g.bench_function(BenchmarkId::new(format!("hit/{entries}"), n), |b| {
                b.iter(|| {
                    k = (k + 1) % recent.len();
                    ix.lookup(&s, black_box(&recent[k]), 101, &mut sc, &mut m);
                    m.deepest
                })
            });
            g.bench_function(BenchmarkId::new(format!("miss/{entries}"), n), |b| {
                b.iter(|| {
                    ix.lookup(&s, black_box(&miss), 101, &mut sc, &mut m);
                    m.deepest
                })
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("index/insert");
    for entries in index_sizes() {
        let ids: Vec<u32> = worker_names(64).iter().map(|w| worker_id(w)).collect();
        let (s, _) = warm_index(entries, &ids);
        let ix = index_view(entries);
        let mut sc = IndexBuffers::default();
        let mut st = 1234u64;
        let fresh: Vec<Vec<u64>> = (0..1024).map(|_| chain(&mut st)).collect();
        let mut k = 0usize;
        // 16 checkpoint writes (get + CAS set each) of a new 256-block prompt into a full index.
        g.bench_function(
            BenchmarkId::new("new_prompt_16_checkpoints", entries),
            |b| {
                b.iter(|| {
                    k = (k + 1) % fresh.len();
                    ix.record(
                        &s,
                        black_box(&fresh[k]),
                        ids[k % 64],
                        Default::default(),
                        102,
                        &mut sc,
                    )
                })
            },
        );
    }
    g.finish();
}

fn policies(c: &mut Criterion) {
    let mut g = c.benchmark_group("policy/choose");
    for n in WORKERS {
        let cfg = config(n, "cache_aware", 262_144);
        let model = &cfg.models[0];
        let mut st = 5u64;
        let reqs: Vec<u32> = (0..n).map(|_| (splitmix(&mut st) % 8) as u32).collect();
        let tokens: Vec<u32> = reqs.iter().map(|r| r * 3000).collect();
        let matched: Vec<u32> = (0..n).map(|i| if i % 7 == 0 { 96 } else { 0 }).collect();
        for (name, deepest) in [("cache_aware_hit", 96u32), ("cache_aware_miss", 0)] {
            let inp = Inputs {
                model,
                reqs: &reqs,
                tokens: &tokens,
                capacity: &[],
                matched: &matched,
                deepest,
                total_blocks: 256,
                prompt_tokens: 4096,
                affinity: 0xdead_beef,
                group: 0xdead_beef,
                conversation_blocks: 0,
                head_blocks: 0,
                busy: &[],
                rate: &[],
                slot: &[],
                util: &[],
                placed: &[],
                recent: None,
                sharers: 0.0,
            };
            g.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter(|| policy::choose(&cfg.policy, black_box(&inp)))
            });
        }
    }
    g.finish();
    // A whole decision (parse, hash, choose, charge, release) for a one-block prompt, so the
    // policy is what varies: round_robin and random must stay flat in n.
    let mut g = c.benchmark_group("policy/decide");
    let body = br#"{"model":"llama","prompt":"hello"}"#;
    for policy in ["round_robin", "random", "cache_aware"] {
        for n in WORKERS {
            let (mut r, s) = router(n, policy, 262_144);
            decide_and_release(&mut r, &s, Endpoint::Completions, body, 100);
            g.bench_function(BenchmarkId::new(policy, n), |b| {
                b.iter(|| {
                    decide_and_release(&mut r, &s, Endpoint::Completions, black_box(body), 100)
                })
            });
        }
    }
    g.finish();
}

fn route(c: &mut Criterion) {
    let mut g = c.benchmark_group("route");
    // 4096-token chat prompts: 16 KiB system prompt in 8 groups, 4 users each (steady state:
    // every prompt already indexed, so each decision is a prefix hit with no new index keys).
    let bodies: Vec<Vec<u8>> = (0..32).map(|i| chat_body(4 * 4096, i % 8, i)).collect();
    g.throughput(Throughput::Elements(1));
    let mut canon = Vec::with_capacity(1 << 17);
    let mut k = 0usize;
    g.bench_function("parse_only/4096tok", |b| {
        b.iter(|| {
            k = (k + 1) % bodies.len();
            request::parse(Endpoint::Chat, black_box(&bodies[k]), &mut canon, 1 << 20)
                .map(|p| p.kind)
        })
    });
    let seed = chain_seed(b"llama", None);
    let mut hashes = Vec::with_capacity(1024);
    g.bench_function("parse_hash/4096tok", |b| {
        b.iter(|| {
            k = (k + 1) % bodies.len();
            let _ = request::parse(Endpoint::Chat, black_box(&bodies[k]), &mut canon, 1 << 20);
            hash_blocks(seed, &canon, 64, 16384, &mut hashes)
        })
    });
    for n in WORKERS {
        let (mut r, s) = router(n, "cache_aware", 262_144);
        for b in &bodies {
            decide_and_release(&mut r, &s, Endpoint::Chat, b, 100);
        }
        g.bench_function(BenchmarkId::new("route_release/4096tok", n), |b| {
            b.iter(|| {
                k = (k + 1) % bodies.len();
                decide_and_release(&mut r, &s, Endpoint::Chat, black_box(&bodies[k]), 100)
            })
        });
    }
    g.finish();
}

/// A decision on a load value that a previous config wrote with one extra worker in front (a
/// worker was removed from a 1024-worker list): every stored record sits one position away from
/// the new config's. Compare with `same_config`: the cost must stay in the same order (a linear
/// scan per missed record made it quadratic: about 1M record reads per decision).
fn load_after_reload(c: &mut Criterion) {
    let mut g = c.benchmark_group("load/after_reload");
    let body = br#"{"model":"llama","prompt":"hello"}"#;
    // 1024 workers (the configured maximum), then the first one removed.
    let n = 1024;
    let names = worker_names(n);
    let json = |ws: &[String]| {
        let ws: Vec<String> = ws.iter().map(|w| format!("\"{w}\"")).collect();
        format!(
            r#"{{"models":{{"llama":{{"workers":[{}]}}}},"policy":{{"name":"round_robin","batch_releases_min_rps":0}}}}"#,
            ws.join(",")
        )
    };
    for (name, old) in [
        ("same_config", &names[1..]),
        ("one_of_1024_removed", &names[..]),
    ] {
        let s = MemStore::new();
        let cfg = |ws: &[String]| {
            prefix_router::config::Config::from_json(json(ws).as_bytes()).expect("valid")
        };
        let mut before = Router::new(cfg(old), 7);
        before.init_store(&s);
        // every worker of the old config carries load, so its records exist
        for _ in 0..old.len() {
            let _ = before.route(&s, Endpoint::Completions, body, 100);
        }
        let mut r = Router::new(cfg(&names[1..]), 42);
        r.init_store(&s);
        g.bench_function(BenchmarkId::new(name, n - 1), |b| {
            b.iter(|| decide_and_release(&mut r, &s, Endpoint::Completions, black_box(body), 100))
        });
    }
    g.finish();
}

fn quick() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40)
}

criterion_group! {
    name = benches;
    config = quick();
    targets = hashing, index, policies, route, load_after_reload
}
criterion_main!(benches);
