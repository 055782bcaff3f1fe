//! Self-healing load accounting on the real `prefix_router.wasm`.
//!
//! Under `fail_open: FAIL_RELOAD` Envoy replaces a VM that trapped with a fresh one: the trapped
//! VM's streams never get their stream-end callbacks and its batched state is gone. Each VM
//! publishes its absolute in-flight totals in a lease with a heartbeat; readers ignore a lease
//! whose heartbeat is older than the bound (2 s) and any VM's timer removes it from shared data.
//! Here a VM is dropped mid-stream (it simply disappears, as after a trap) and the load in
//! shared data itself, not the VM-side gauges, must return to what the live VMs hold.

use proxy_wasm_host::{Host, Options, Vm};

const CONFIG: &str = r#"{"models":{"llama":{"workers":["w0","w1","w2","w3"]}}}"#;
/// The stated bound: a lease without a heartbeat for more than 2 s is dead.
const BOUND_MS: u64 = 2_000;
const T0: u64 = 1_700_000_000_000_000_000;

fn body(i: usize) -> Vec<u8> {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"system {i}"}},{{"role":"user","content":"question {i}"}}]}}"#
    )
    .into_bytes()
}

fn open(vm: &mut Vm, i: usize) -> i32 {
    vm.request("POST", "/v1/chat/completions", &[], &body(i))
        .expect("request")
        .context
}

/// Moves the shared clock to `ms` after T0 in 100 ms steps, ticking `vm` at each step (Envoy
/// calls every live VM's timer every 50 ms).
fn advance(h: &Host, vm: &mut Vm, from_ms: u64, to_ms: u64) {
    let mut t = from_ms;
    while t < to_ms {
        t += 100;
        h.set_clock(T0 + t * 1_000_000);
        vm.elapse(100).expect("tick");
    }
}

fn gauge(h: &Host, name: &str) -> i64 {
    h.stats.get(name).unwrap_or(-1)
}

#[test]
fn a_vm_dropped_mid_stream_stops_counting_within_the_bound() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(T0);
    let mut doomed = h.vm(CONFIG).expect("vm");
    let mut live = h.vm(CONFIG).expect("vm");
    for i in 0..3 {
        open(&mut doomed, i);
    }
    let kept = open(&mut live, 100);
    doomed.elapse(200).expect("tick");
    live.elapse(200).expect("tick");
    assert_eq!(
        h.shared.load_totals("llama").0,
        4,
        "3 + 1 streams in flight"
    );
    let leases = h.shared.load_leases("llama");
    assert_eq!(leases.len(), 2, "one lease per VM holding load: {leases:?}");

    // The VM traps: it disappears without on_log / on_done / on_delete for its streams.
    drop(doomed);

    // Within the bound the dead lease still counts (the bound is what it is: a stalled thread
    // is not declared dead at once)...
    advance(&h, &mut live, 0, BOUND_MS / 2);
    assert_eq!(h.shared.load_totals("llama").0, 4);
    // ...and once it has passed (plus one 200 ms sampling period), shared data holds only what
    // the live VM has in flight: the dead lease is gone, the live one kept by its heartbeat.
    advance(&h, &mut live, BOUND_MS / 2, BOUND_MS + 400);
    let leases = h.shared.load_leases("llama");
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(h.shared.load_totals("llama").0, 1, "{leases:?}");
    assert_eq!(gauge(&h, "prefix_router.load.requests"), 1);

    // The live VM's decisions see the dead VM's workers as free again: its stream ends and
    // everything is back to 0, in shared data and in the shared-data gauges.
    live.finish(kept, &[]).expect("finish");
    advance(&h, &mut live, BOUND_MS + 400, BOUND_MS + 800);
    assert_eq!(h.shared.load_totals("llama"), (0, 0));
    assert_eq!(gauge(&h, "prefix_router.load.requests"), 0);
    assert_eq!(gauge(&h, "prefix_router.load.tokens"), 0);
    assert!(
        live.logs().iter().all(|(lvl, _)| *lvl < 4),
        "{:?}",
        live.logs()
    );
}

#[test]
fn a_new_vm_cleans_a_dead_lease_when_no_other_vm_is_left() {
    // The only VM traps; FAIL_RELOAD starts a fresh one later: its first timer call removes the
    // dead lease once it is past the bound.
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(T0);
    let mut doomed = h.vm(CONFIG).expect("vm");
    for i in 0..5 {
        open(&mut doomed, i);
    }
    doomed.elapse(100).expect("tick");
    assert_eq!(h.shared.load_totals("llama").0, 5);
    drop(doomed);
    h.set_clock(T0 + (BOUND_MS + 100) * 1_000_000);
    let mut fresh = h.vm(CONFIG).expect("vm");
    fresh.tick().expect("tick");
    assert_eq!(h.shared.load_totals("llama"), (0, 0));
    assert!(h.shared.load_leases("llama").is_empty());
    // and its decisions spread over all four workers again (none looks busy)
    let mut seen = std::collections::BTreeSet::new();
    for i in 10..30 {
        let r = fresh
            .roundtrip("POST", "/v1/chat/completions", &[], &body(i))
            .expect("roundtrip");
        seen.insert(
            r.header("x-prefix-router-cluster")
                .unwrap_or("")
                .to_string(),
        );
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}
