//! Fuzzing the real `prefix_router.wasm` under the wasmtime host: random and mutated request
//! bodies (valid JSON with wrong types, huge numbers, deep nesting, invalid UTF-8, lone
//! surrogates, truncation, byte flips, duplicate keys, 10 MB strings, random bytes) on random
//! paths and methods, with spoofed routing headers.
//!
//! For every body the filter must not trap (a panic is a trap: the filter is built with
//! panic=abort) and must do one of exactly two things: route to a cluster of the configured set
//! (one `x-prefix-router-cluster` value, the debug header naming a known reason), or answer a
//! local OpenAI-style JSON 404 (only with `unknown_model: reject`). A tenth of the streams end
//! as client aborts (no `on_log`). Afterwards every in-flight gauge and the shared-data load leases
//! are back at zero, nothing was logged at error level, and the shared-data key count is within
//! the configured index capacity.
//!
//! CI runs a bounded slice (20,000 bodies by default). The full run:
//!
//! ```sh
//! PREFIX_ROUTER_FUZZ_BODIES=1000000 cargo test --release -p proxy-wasm-host --test filter fuzz:: -- --nocapture
//! ```
//! (`PREFIX_ROUTER_FUZZ_SEED` picks another sequence.)

use proxy_wasm_host::{Host, Options, Vm};
use std::collections::BTreeMap;
use std::time::Instant;

const CFG_DEFAULT: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]},
  "qwen/q-7b":{"workers":["q0",{"cluster":"q1","weight":3}],"text_block_bytes":32,"token_block_size":8}},
  "default_model":"llama","debug_header":"x-prefix-router-decision",
  "index":{"capacity":256,"ttl_seconds":30}}"#;
const CFG_REJECT: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]},
  "qwen/q-7b":{"workers":["q0",{"cluster":"q1","weight":3}]}},
  "default_model":"llama","unknown_model":"reject","passthrough_cluster":"pt",
  "debug_header":"x-prefix-router-decision","index":{"capacity":64},
  "max_prompt_blocks":64,"policy":{"name":"cache_aware","load_eps":0.1}}"#;
const LLAMA: [&str; 4] = ["w0", "w1", "w2", "w3"];
const QWEN: [&str; 2] = ["q0", "q1"];
const REASONS: [&str; 9] = [
    "prefix_hit",
    "hash_affinity",
    "load_spill",
    "fallback",
    "passthrough",
    "parse_error",
    "rejected",
    "round_robin",
    "random",
];
const HUGE: usize = 10 << 20; // 10 MiB strings

/// xorshift64*: small, deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.next() % 1000 < per_mille
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

const WORDS: [&str; 12] = [
    "You are a helpful assistant.",
    "the",
    "système",
    "日本語のテキスト",
    "emoji 🦀🚀",
    "\\n",
    "\\\"quoted\\\"",
    "\\u00e9",
    "\\ud83e\\udd80",
    "tab\\t",
    "<|eot_id|>",
    "a",
];

fn text(r: &mut Rng, max_words: usize) -> String {
    let n = r.below(max_words + 1);
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(r.pick(&WORDS));
    }
    s
}

/// A random JSON value of any type (strings escaped already), nesting bounded by `depth`.
fn value(r: &mut Rng, depth: u32) -> String {
    match r.below(if depth == 0 { 7 } else { 9 }) {
        0 => "null".into(),
        1 => r.pick(&["true", "false"]).to_string(),
        2 => format!("{}", r.next() as i64),
        3 => r
            .pick(&[
                "1e999999",
                "-1e-999999",
                "18446744073709551616000000000",
                "-9223372036854775809",
                "4294967296",
                "-1",
                "0.5",
                "1E+2",
                "-0",
                "123456789012345678901234567890.5e30",
            ])
            .to_string(),
        4 | 5 => format!("\"{}\"", text(r, 12)),
        6 => format!(
            "\"{}\"",
            r.pick(&["\\ud800", "\\udfff\\ud800", "\\u0000", "\\x41", "\\"])
        ),
        7 => {
            let n = r.below(4);
            let items: Vec<String> = (0..n).map(|_| value(r, depth - 1)).collect();
            format!("[{}]", items.join(","))
        }
        _ => {
            let n = r.below(4);
            let items: Vec<String> = (0..n)
                .map(|_| {
                    let k = r
                        .pick(&["model", "role", "content", "text", "type", "x"])
                        .to_string();
                    format!("\"{k}\":{}", value(r, depth - 1))
                })
                .collect();
            format!("{{{}}}", items.join(","))
        }
    }
}

fn model_field(r: &mut Rng) -> Option<String> {
    match r.below(10) {
        0..=3 => Some("\"llama\"".into()),
        4 | 5 => Some("\"qwen/q-7b\"".into()),
        6 => Some(format!("\"unknown-{}\"", r.below(1000))),
        7 => None,
        8 => Some(
            r.pick(&["\"\"", "\"LLAMA\"", "\"llama \"", "\"\\u006clama\""])
                .to_string(),
        ),
        _ => Some(value(r, 2)), // any type
    }
}

fn tokens_upto(r: &mut Rng, max: usize) -> String {
    let n = r.below(max);
    tokens(r, n)
}

fn tokens(r: &mut Rng, n: usize) -> String {
    let ids: Vec<String> = (0..n).map(|_| (r.next() % 200_000).to_string()).collect();
    format!("[{}]", ids.join(","))
}

fn message(r: &mut Rng) -> String {
    let role = r.pick(&["system", "user", "assistant", "tool"]);
    let content = match r.below(6) {
        0..=2 => format!("\"{}\"", text(r, 60)),
        3 => {
            let parts: Vec<String> = (0..r.below(4))
                .map(|_| {
                    if r.chance(700) {
                        format!("{{\"type\":\"text\",\"text\":\"{}\"}}", text(r, 20))
                    } else {
                        format!(
                            "{{\"type\":\"image_url\",\"image_url\":{{\"url\":\"data:image/png;base64,{}\"}}}}",
                            r.next()
                        )
                    }
                })
                .collect();
            format!("[{}]", parts.join(","))
        }
        4 => "null".into(),
        _ => value(r, 3), // wrong types
    };
    let mut m = format!("{{\"role\":\"{role}\",\"content\":{content}");
    if r.chance(100) {
        m.push_str(&format!(",\"name\":{}", value(r, 1)));
    }
    if r.chance(50) {
        m.push_str(
            ",\"tool_calls\":[{\"id\":\"c1\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]",
        );
    }
    m.push('}');
    m
}

/// A well-formed (or type-confused) body for one of the three endpoints.
fn body_for(r: &mut Rng, ep: usize) -> String {
    let mut fields: Vec<String> = Vec::new();
    if let Some(m) = model_field(r) {
        fields.push(format!("\"model\":{m}"));
    }
    match ep {
        0 => {
            let msgs = match r.below(10) {
                0 => value(r, 3),
                _ => {
                    let n = 1 + r.below(6);
                    let ms: Vec<String> = (0..n).map(|_| message(r)).collect();
                    format!("[{}]", ms.join(","))
                }
            };
            fields.push(format!("\"messages\":{msgs}"));
        }
        1 => {
            let p = match r.below(7) {
                0 | 1 => format!("\"{}\"", text(r, 200)),
                2 => format!("[\"{}\",\"{}\"]", text(r, 30), text(r, 5)),
                3 => tokens_upto(r, 300),
                4 => format!("[{},{}]", tokens_upto(r, 100), tokens(r, 3)),
                5 => "[]".into(),
                _ => value(r, 3),
            };
            fields.push(format!("\"prompt\":{p}"));
        }
        _ => {
            let p = match r.below(5) {
                0 | 1 => format!("\"text\":\"{}\"", text(r, 200)),
                2 => format!("\"input_ids\":{}", tokens_upto(r, 400)),
                3 => format!("\"input_ids\":[{}]", tokens_upto(r, 50)),
                _ => format!("\"{}\":{}", r.pick(&["text", "input_ids"]), value(r, 3)),
            };
            fields.push(p);
            if r.chance(300) {
                fields.push(format!("\"lora_path\":{}", value(r, 1)));
            }
        }
    }
    // sampling parameters, sometimes of the wrong type or huge
    if r.chance(500) {
        fields.push(format!("\"max_tokens\":{}", value(r, 1)));
    }
    if r.chance(300) {
        fields.push(format!("\"stream\":{}", value(r, 1)));
    }
    if r.chance(100) {
        // duplicate keys
        fields.push(format!("\"model\":{}", value(r, 1)));
    }
    // shuffle field order a little
    if fields.len() > 1 && r.chance(300) {
        let i = r.below(fields.len());
        fields.swap(0, i);
    }
    format!("{{{}}}", fields.join(","))
}

fn mutate(r: &mut Rng, mut b: Vec<u8>) -> (Vec<u8>, &'static str) {
    let kind = match r.below(20) {
        0..=6 => return (b, "valid"),
        7 => {
            let cut = r.below(b.len() + 1);
            b.truncate(cut);
            "truncated"
        }
        8 | 9 => {
            for _ in 0..1 + r.below(4) {
                if !b.is_empty() {
                    let i = r.below(b.len());
                    b[i] ^= 1 << r.below(8);
                }
            }
            "bit_flips"
        }
        10 | 11 => {
            // invalid UTF-8 inside the JSON (usually inside a string)
            let bad: &[&[u8]] = &[
                b"\xff",
                b"\xc3",
                b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80",
                b"\x80\x80",
                b"\xc0\xaf",
            ];
            for _ in 0..1 + r.below(3) {
                let i = r.below(b.len() + 1);
                let ins = r.pick(bad);
                b.splice(i..i, ins.iter().copied());
            }
            "invalid_utf8"
        }
        12 => {
            let frags: &[&[u8]] = &[
                b"{", b"}", b"[", b"]", b"\"", b"\\", b",", b":", b"\\u", b"\\ud800", b"\0",
                b"null",
            ];
            for _ in 0..1 + r.below(3) {
                let i = r.below(b.len() + 1);
                let ins = r.pick(frags);
                b.splice(i..i, ins.iter().copied());
            }
            "json_fragments"
        }
        13 => {
            let depth = r.pick(&[64usize, 127, 128, 129, 1000, 100_000]);
            let open = if r.chance(500) { "[" } else { "{\"a\":" };
            let close = if open == "[" { "]" } else { "}" };
            let nested = format!("{}1{}", open.repeat(depth), close.repeat(depth));
            let f = r.pick(&[
                "messages",
                "prompt",
                "text",
                "input_ids",
                "model",
                "content",
            ]);
            b = format!("{{\"model\":\"llama\",\"{f}\":{nested}}}").into_bytes();
            "deep_nesting"
        }
        14 => {
            b = (0..r.below(256)).map(|_| r.next() as u8).collect();
            "random_bytes"
        }
        15 => {
            // a value replaced by a huge / odd number
            let n = r.pick(&[
                "1e999999",
                "99999999999999999999999999999999",
                "-0.0e-0",
                "NaN",
                "Infinity",
                "0x10",
            ]);
            let mut s = String::from_utf8_lossy(&b).into_owned();
            if let Some(i) = s.find(':') {
                s.insert_str(i + 1, n);
            }
            b = s.into_bytes();
            "odd_numbers"
        }
        16 => {
            b.extend_from_slice(r.pick(&[&b" "[..], b"\n{}", b"garbage", b",", b"\0"]));
            "trailing_data"
        }
        17 => {
            let s = r.pick(&[
                &b""[..],
                b"{}",
                b"[]",
                b"null",
                b"0",
                b"\"x\"",
                b"{\"model\":null}",
                b"   ",
            ]);
            b = s.to_vec();
            "tiny"
        }
        _ => {
            // BOM / whitespace prefix, or a type-confused top level
            let pre = r.pick(&[&b"\xef\xbb\xbf"[..], b"  \n\t", b"["]);
            b.splice(0..0, pre.iter().copied());
            "prefix_bytes"
        }
    };
    (b, kind)
}

/// A 10 MiB body: a huge prompt string (valid, with invalid UTF-8, or unterminated), or a huge
/// token list.
fn huge_body(r: &mut Rng) -> (Vec<u8>, &'static str) {
    let mut s = Vec::with_capacity(HUGE + 128);
    match r.below(4) {
        0 => {
            s.extend_from_slice(
                b"{\"model\":\"llama\",\"messages\":[{\"role\":\"user\",\"content\":\"",
            );
            s.resize(s.len() + HUGE, b'x');
            s.extend_from_slice(b"\"}]}");
            (s, "huge_string")
        }
        1 => {
            s.extend_from_slice(b"{\"prompt\":\"");
            s.resize(s.len() + HUGE, b'y');
            s[HUGE / 2] = 0xff;
            s.extend_from_slice(b"\"}");
            (s, "huge_string_invalid_utf8")
        }
        2 => {
            s.extend_from_slice(b"{\"model\":\"qwen/q-7b\",\"text\":\"");
            s.resize(s.len() + HUGE, b'z'); // unterminated
            (s, "huge_string_truncated")
        }
        _ => {
            s.extend_from_slice(b"{\"input_ids\":[");
            while s.len() < HUGE {
                s.extend_from_slice(b"123456,");
            }
            s.extend_from_slice(b"1]}");
            (s, "huge_token_list")
        }
    }
}

struct Target {
    host: Host,
    vms: Vec<Vm>,
    cfg: &'static str,
    reject: bool,
}

impl Target {
    fn new(cfg: &'static str, vms: usize, reject: bool) -> Target {
        let host = Host::filter(Options::default()).expect("load prefix_router.wasm");
        host.set_clock(1_700_000_000_000_000_000);
        let vms = (0..vms).map(|_| host.vm(cfg).expect("vm starts")).collect();
        Target {
            host,
            vms,
            cfg,
            reject,
        }
    }
}

fn inflight_sum(h: &Host) -> i64 {
    h.stats
        .all()
        .iter()
        .filter(|(n, _)| n.starts_with("prefix_router.inflight_"))
        .map(|(_, v)| v.abs())
        .sum()
}

fn load_vectors_zero(h: &Host, models: &[&str]) -> bool {
    models.iter().all(|m| h.shared.load_totals(m) == (0, 0))
}

#[test]
fn random_and_mutated_bodies_never_trap_and_always_have_a_defined_outcome() {
    let n: usize = std::env::var("PREFIX_ROUTER_FUZZ_BODIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("PREFIX_ROUTER_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut targets = [
        Target::new(CFG_DEFAULT, 2, false),
        Target::new(CFG_REJECT, 1, true),
    ];
    let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    let mut traps = 0u64;
    let mut bytes = 0u64;
    let mut open: Vec<(usize, usize, i32)> = Vec::new(); // (target, vm, ctx) streams kept open
    let t0 = Instant::now();
    for i in 0..n {
        let ti = usize::from(r.chance(300));
        let ep = r.below(3);
        let (body, kind) = if i % 5000 == 4999 {
            huge_body(&mut r)
        } else {
            let b = body_for(&mut r, ep).into_bytes();
            mutate(&mut r, b)
        };
        *kinds.entry(kind).or_default() += 1;
        bytes += body.len() as u64;
        let (method, path) = match r.below(40) {
            0 => ("GET", "/v1/chat/completions"),
            1 => ("PUT", "/v1/completions"),
            2 => ("POST", "/v1/embeddings"),
            3 => ("DELETE", "/generate"),
            4 => ("POST", "/v1/chat/completions?x=1&y=%ff"),
            5 => ("post", "/v1/chat/completions"),
            6 => ("PUT", "/generate"),
            7 => ("POST", "/v1/chat/completions/"),
            _ => (
                "POST",
                ["/v1/chat/completions", "/v1/completions", "/generate"][ep],
            ),
        };
        let mut hdrs: Vec<(&str, &str)> = vec![("content-type", "application/json")];
        if r.chance(200) {
            // Envoy hands filters lower-cased header names (the casing variants are tested
            // against the real Envoy in tests/integration/test_headers.py); duplicates stay.
            hdrs.push(("x-prefix-router-cluster", "evil"));
            hdrs.push(("x-prefix-router-cluster", "w0"));
            hdrs.push(("x-prefix-router-decision", "worker=evil"));
        }
        let t = &mut targets[ti];
        if i % 997 == 0 {
            // time passes: exercise holder expiry (ttl 30 s on target 0)
            let now = t.host.clock.lock().unwrap().unwrap_or(0);
            t.host.set_clock(now + 7_000_000_000);
        }
        let vi = r.below(t.vms.len());
        let inference = matches!(
            (method, path.split('?').next().unwrap()),
            ("POST", "/v1/chat/completions")
                | ("POST", "/v1/completions")
                | ("POST", "/generate")
                | ("PUT", "/generate")
        );
        let res = t.vms[vi].request(method, path, &hdrs, &body);
        let resp = match res {
            Ok(resp) => resp,
            Err(e) => {
                traps += 1;
                if failures.len() < 10 {
                    failures.push(format!(
                        "#{i} {kind} {method} {path} trapped: {e:#}; body[..200]={:?}",
                        String::from_utf8_lossy(&body[..body.len().min(200)])
                    ));
                }
                // like FAIL_RELOAD: a fresh VM replaces the trapped one
                t.vms[vi] = t.host.vm(t.cfg).expect("vm restarts");
                continue;
            }
        };
        let outcome: String;
        if let Some((status, rbody, _)) = &resp.local_response {
            let s = String::from_utf8_lossy(rbody);
            let ok = t.reject
                && inference
                && *status == 404
                && s.starts_with("{\"object\":\"error\"")
                && s.contains("\"code\":404")
                && s.ends_with('}');
            if !ok && failures.len() < 10 {
                failures.push(format!("#{i} {kind}: unexpected local reply {status} {s}"));
            }
            outcome = "local_404".into();
        } else {
            let set: Vec<&str> = resp
                .request_headers
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("x-prefix-router-cluster"))
                .map(|(_, v)| v.as_str())
                .collect();
            let leaked_debug = resp
                .request_headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case("x-prefix-router-decision"));
            let valid = |c: &str| {
                LLAMA.contains(&c) || QWEN.contains(&c) || (t.reject && c == "pt" && !inference)
            };
            if (set.len() != 1 || !valid(set[0]) || leaked_debug) && failures.len() < 10 {
                failures.push(format!(
                    "#{i} {kind} {method} {path}: cluster header {set:?}, debug header forwarded: {leaked_debug}"
                ));
            }
            outcome = String::new();
        }
        let ctx = resp.context;
        // finish now (most), abort (a tenth), or keep open for a while (concurrency)
        let roll = r.below(100);
        let reason = if roll < 10 {
            t.vms[vi].abort(ctx).map(|_| Some(String::from("aborted")))
        } else if roll < 20 {
            open.push((ti, vi, ctx));
            Ok(Some(String::from("open")))
        } else {
            t.vms[vi].finish(ctx, &[]).map(|h| {
                h.iter()
                    .find(|(k, _)| k == "x-prefix-router-decision")
                    .and_then(|(_, v)| v.split("reason=").nth(1))
                    .map(|v| v.split(';').next().unwrap_or("").to_string())
            })
        };
        let label = match reason {
            Err(e) => {
                traps += 1;
                if failures.len() < 10 {
                    failures.push(format!("#{i} {kind}: stream end trapped: {e:#}"));
                }
                t.vms[vi] = t.host.vm(t.cfg).expect("vm restarts");
                open.retain(|o| !(o.0 == ti && o.1 == vi));
                continue;
            }
            Ok(_) if !outcome.is_empty() => outcome,
            Ok(Some(x)) if x == "open" => "held_open".into(),
            Ok(Some(x)) if x == "aborted" => "aborted".into(),
            Ok(Some(x)) => {
                if !REASONS.contains(&x.as_str()) && failures.len() < 10 {
                    failures.push(format!("#{i} {kind}: unknown reason {x}"));
                }
                x
            }
            // no decision header: only a passthrough to the configured passthrough_cluster
            Ok(None) => {
                if (!t.reject || inference) && failures.len() < 10 {
                    failures.push(format!("#{i} {kind} {method} {path}: no decision header"));
                }
                "passthrough_cluster".into()
            }
        };
        *outcomes.entry(label).or_default() += 1;
        if open.len() > 64 {
            let (oti, ovi, octx) = open.remove(0);
            targets[oti].vms[ovi]
                .finish(octx, &[])
                .expect("finish held stream");
        }
        if i % 1000 == 0 {
            for t in targets.iter_mut() {
                for vm in t.vms.iter_mut() {
                    vm.elapse(200).expect("tick");
                }
            }
        }
    }
    for (ti, vi, ctx) in open.drain(..) {
        targets[ti].vms[vi]
            .finish(ctx, &[])
            .expect("finish held stream");
    }
    for t in targets.iter_mut() {
        for vm in t.vms.iter_mut() {
            vm.elapse(200).expect("tick");
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "fuzz: {n} bodies ({:.1} MiB) in {secs:.1} s ({:.0} bodies/s), traps {traps}",
        bytes as f64 / (1 << 20) as f64,
        n as f64 / secs
    );
    eprintln!("fuzz: inputs {kinds:?}");
    eprintln!("fuzz: outcomes {outcomes:?}");
    for t in &targets {
        eprintln!(
            "fuzz: shared data {} keys, {} bytes",
            t.host.shared.len(),
            t.host.shared.bytes()
        );
    }
    assert!(
        failures.is_empty() && traps == 0,
        "{traps} traps; {failures:#?}"
    );
    for (k, t) in targets.iter().enumerate() {
        assert_eq!(
            inflight_sum(&t.host),
            0,
            "target {k}: {:?}",
            t.host.stats.all()
        );
        assert!(
            load_vectors_zero(&t.host, &["llama", "qwen/q-7b"]),
            "target {k}"
        );
        for vm in &t.vms {
            let errs: Vec<_> = vm.logs().iter().filter(|(lvl, _)| *lvl >= 4).collect();
            assert!(errs.is_empty(), "target {k} logged errors: {errs:?}");
        }
    }
    // capacity 256 -> 64 buckets per model (+ its load leases, polled-load value and recent
    // placements), plus the poller lease and the load-lease id counter; capacity 64 -> 16 (+3) (+2)
    assert!(
        targets[0].host.shared.len() <= 2 * (64 + 3) + 2,
        "{}",
        targets[0].host.shared.len()
    );
    assert!(
        targets[1].host.shared.len() <= 2 * (16 + 3) + 2,
        "{}",
        targets[1].host.shared.len()
    );
}

/// The prefix index is a fixed slot table: however many distinct prompts flow through, the number
/// of shared-data keys (and their bytes) never exceeds `capacity / 4` buckets per model plus the
/// the load leases, the recent placements and the lease-id counter, and the table does fill up to
/// that bound (keys are really used).
#[test]
fn shared_data_keys_never_exceed_the_index_capacity() {
    let n: usize = std::env::var("PREFIX_ROUTER_DISTINCT_PROMPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let cfg = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}},"index":{"capacity":400}}"#;
    let host = Host::filter(Options::default()).expect("load prefix_router.wasm");
    host.set_clock(1_700_000_000_000_000_000);
    let mut vms: Vec<Vm> = (0..2).map(|_| host.vm(cfg).unwrap()).collect();
    // index buckets + the load leases + the lease-id counter + the index size record (`pr/i2/size`)
    // + the recent placements (`pr/np/llama`)
    let bound = 400 / 4 + 4;
    let mut max_keys = 0;
    let mut max_bytes = 0;
    for i in 0..n {
        // distinct from the first block on: every prompt adds new checkpoints
        let body = format!(
            r#"{{"model":"llama","prompt":"{i:08} distinct prompt {}"}}"#,
            "padding text ".repeat(8 + i % 50)
        );
        let r = vms[i % 2]
            .roundtrip("POST", "/v1/completions", &[], body.as_bytes())
            .unwrap();
        assert!(r.header("x-prefix-router-cluster").is_some());
        if i % 100 == 0 || i + 1 == n {
            max_keys = max_keys.max(host.shared.len());
            max_bytes = max_bytes.max(host.shared.bytes());
            assert!(
                host.shared.len() <= bound,
                "{} keys after {i}",
                host.shared.len()
            );
        }
    }
    eprintln!("distinct prompts {n}: max {max_keys} keys (bound {bound}), max {max_bytes} bytes");
    assert_eq!(max_keys, bound, "the table fills up to exactly its bound");
    // 100 buckets of 160 bytes + the placements (2 KiB) + the load leases + key names
    assert!(max_bytes < 100 * 200 + 1024, "{max_bytes}");
}
