//! Zero heap allocations per routing decision in steady state, counted with a counting global
//! allocator. Steady state = repeated decisions (route + release) over a warm index: every
//! shared-data key the prompts touch already exists (MemStore, like Envoy, allocates when a new
//! key is inserted) and the router's reusable buffers have grown to size.

use prefix_router::request::Endpoint;
use prefix_router_benches::{chat_body, decide_and_release, router};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.realloc(p, l, n)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations per decision over `rounds` passes of `bodies` after one warm-up pass.
fn allocs_per_decision(
    workers: usize,
    policy: &str,
    ep: Endpoint,
    bodies: &[Vec<u8>],
    rounds: usize,
) -> f64 {
    let (mut r, s) = router(workers, policy, 262_144);
    for b in bodies {
        decide_and_release(&mut r, &s, ep, b, 100);
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    for _ in 0..rounds {
        for b in bodies {
            decide_and_release(&mut r, &s, ep, b, 100);
        }
    }
    let n = (rounds * bodies.len()) as f64;
    (ALLOCS.load(Ordering::Relaxed) - before) as f64 / n
}

// One test function: the counter is process-wide and the test harness runs tests in parallel.
#[test]
fn steady_state_decisions_do_not_allocate() {
    // 4096-token chat prompts (16 KiB system prompt) in 8 prefix groups, 4 users each.
    let bodies: Vec<Vec<u8>> = (0..32).map(|i| chat_body(4 * 4096, i % 8, i)).collect();
    for (workers, policy) in [
        (64, "cache_aware"),
        (4, "cache_aware"),
        (256, "cache_aware"),
        (64, "round_robin"),
        (64, "random"),
    ] {
        let a = allocs_per_decision(workers, policy, Endpoint::Chat, &bodies, 20);
        println!("allocations per decision: {a} ({workers} workers, {policy})");
        assert_eq!(
            a, 0.0,
            "{workers} workers, {policy}: {a} allocations per decision"
        );
    }
    // 4096-token `/generate` prompts (the token-id fast path, `request::parse_fast`).
    let ids: Vec<Vec<u8>> = (0..32u64)
        .map(|i| {
            let list: Vec<String> = (0..4096u64)
                .map(|t| ((t * 7919 + (i % 8) * 104_729) % 128_000).to_string())
                .chain([i.to_string()])
                .collect();
            format!(
                r#"{{"input_ids":[{}],"sampling_params":{{"temperature":0}}}}"#,
                list.join(",")
            )
            .into_bytes()
        })
        .collect();
    let a = allocs_per_decision(64, "cache_aware", Endpoint::Generate, &ids, 20);
    println!("allocations per decision: {a} (64 workers, /generate input_ids)");
    assert_eq!(a, 0.0, "/generate input_ids: {a} allocations per decision");
}
