//! A plugin configuration reload on the real `prefix_router.wasm`: in Envoy, a new filter config
//! (LDS update) with the same `vm_id` runs beside the old one (which drains its streams) on the
//! SAME shared data. Here VM `old` runs workers w0..w3, VM `new` runs w0, w2, w3, w4 (w1 removed,
//! w4 added, so every kept worker also moved position), both on one store:
//!
//! * prefixes held only by the removed w1 are never routed to w1 by the new config;
//! * prefixes held by kept workers still hit them (holders are keyed by a stable worker id, not
//!   by position);
//! * streams charged by the old config and released after the reload bring every load record
//!   and gauge back to exactly zero, and the new config sees their load while they run.

use proxy_wasm_host::{Host, Options, Vm};
use std::collections::BTreeMap;

const OLD: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}},
  "debug_header":"x-prefix-router-decision"}"#;
const NEW: &str = r#"{"models":{"llama":{"workers":["w0","w2","w3","w4"]}},
  "debug_header":"x-prefix-router-decision"}"#;

fn body(i: usize, q: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"Conversation {i}: {}"}},{{"role":"user","content":"{q}"}}]}}"#,
        "a long shared system prompt ".repeat(12)
    )
    .into_bytes()
}

fn route(vm: &mut Vm, b: &[u8]) -> (i32, String) {
    let r = vm.request("POST", "/v1/chat/completions", &[], b).unwrap();
    let c = r.header("x-prefix-router-cluster").unwrap().to_string();
    (r.context, c)
}

fn reason(hdrs: &[(String, String)]) -> String {
    let v = &hdrs
        .iter()
        .find(|(k, _)| k == "x-prefix-router-decision")
        .unwrap()
        .1;
    v.split("reason=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string()
}

fn inflight(h: &Host) -> i64 {
    h.stats
        .all()
        .iter()
        .filter(|(n, _)| n.starts_with("prefix_router.inflight_requests."))
        .map(|(_, v)| *v)
        .sum()
}

#[test]
fn reload_never_routes_to_removed_workers_and_keeps_kept_holders() {
    let h = Host::filter(Options::default()).unwrap();
    h.set_clock(1_700_000_000_000_000_000);
    let mut old = h.vm(OLD).unwrap();
    // 64 conversations indexed by the old config
    let mut owner = BTreeMap::new();
    for i in 0..64 {
        let (ctx, c) = route(&mut old, &body(i, "first"));
        old.finish(ctx, &[]).unwrap();
        owner.insert(i, c);
    }
    // Envoy's 200 ms timer: the old VM's last parked release reaches shared data.
    old.elapse(200).unwrap();
    assert!(owner.values().any(|c| c == "w1"), "{owner:?}");
    let mut new = h.vm(NEW).unwrap();
    let mut kept_hits = 0;
    for (i, was) in &owner {
        let (ctx, c) = route(&mut new, &body(*i, "second"));
        let hdrs = new.finish(ctx, &[]).unwrap();
        assert!(
            ["w0", "w2", "w3", "w4"].contains(&c.as_str()),
            "conversation {i}: routed to {c} (was {was})"
        );
        if was != "w1" && c == *was && reason(&hdrs) == "prefix_hit" {
            kept_hits += 1;
        }
    }
    let kept = owner.values().filter(|c| *c != "w1").count();
    // a few may spill (load bound), the rest follow their holder across the reload
    assert!(
        kept_hits * 10 >= kept * 8,
        "{kept_hits}/{kept} kept holders hit"
    );

    // streams still running on the old config while the new one serves (Envoy drains the old
    // filter chain): they are charged under the old config and released after the reload
    let open: Vec<(i32, String)> = (0..6).map(|i| route(&mut old, &body(i, "open"))).collect();
    old.elapse(200).unwrap(); // metrics are flushed on the tick
    new.elapse(200).unwrap();
    assert_eq!(inflight(&h), 6);
    // the new config sees the old streams' load (same load leases, records by worker id)
    assert_eq!(h.shared.load_totals("llama").0, 6);

    let (ctx, c) = route(&mut new, &body(1000, "during"));
    assert_ne!(c, "w1");
    new.finish(ctx, &[]).unwrap();

    // the old config drains: its streams end after the reload
    for (k, (ctx, _)) in open.into_iter().enumerate() {
        if k % 2 == 0 {
            old.finish(ctx, &[]).unwrap();
        } else {
            old.abort(ctx).unwrap();
        }
    }
    // ...then Envoy removes the old plugin (root on_done + on_delete), with no tick in between:
    // whatever the old VM still held (batched metric deltas) must reach Envoy by then, and a
    // stream that outlives the root still releases its charge.
    let (late, _) = route(&mut old, &body(2000, "late"));
    assert!(old.shutdown().unwrap());
    old.finish(late, &[]).unwrap();
    new.elapse(200).unwrap();
    assert_eq!(inflight(&h), 0, "{:?}", h.stats.all());
    assert!(
        h.stats
            .all()
            .iter()
            .filter(|(n, _)| n.starts_with("prefix_router.inflight_tokens."))
            .all(|(_, v)| *v == 0),
        "{:?}",
        h.stats.all()
    );
    assert_eq!(
        h.shared.load_totals("llama"),
        (0, 0),
        "load not back to zero: {:?}",
        h.shared.load_leases("llama")
    );
    for vm in [&old, &new] {
        assert!(vm.logs().iter().all(|(lvl, _)| *lvl < 4), "{:?}", vm.logs());
    }
}
