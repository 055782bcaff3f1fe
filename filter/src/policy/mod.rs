//! Worker choice: one interface ([`Policy`]) and one file per policy.
//!
//! * [`cost_aware`] (default): the worker where the request costs the fewest seconds ([`cost`]:
//!   prefill there, work queued ahead, the copy it leaves, the wait for a slot in a full batch),
//!   with a hard load bound.
//! * [`cache_aware`] (the default until 2026-11-27): cache reuse weighed against load by rules
//!   on the prompt's shape, with a hard load bound.
//! * [`round_robin`] and [`random`]: O(1) baselines for comparisons (no index, no load bound);
//!   their state (a rotation counter, a generator) lives in the policy, not in the router.
//!
//! Every policy sees the same [`Inputs`]: the model's workers, their loads as the ledger merged
//! them (own in-flight counts plus polled load, see `load.rs` and `poll.rs`), and what the
//! index matched. A policy returns a worker index and a [`Reason`]; it may be called again for
//! the same request when a load write loses a race, and must then choose from the new loads.

use crate::config::{Model, PolicyConfig, PolicyName};

pub mod cache_aware;
pub mod cost;
pub mod cost_aware;
pub mod random;
pub mod round_robin;
mod shared;
#[cfg(test)]
pub(crate) mod shared_tests;

pub use cache_aware::choose;

/// Why a worker was chosen; also the metric suffix and the debug header's `reason=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    PrefixHit,
    HashAffinity,
    LoadSpill,
    Fallback,
    Passthrough,
    ParseError,
    Rejected,
    RoundRobin,
    Random,
}

impl Reason {
    pub const ALL: [Reason; 9] = [
        Reason::PrefixHit,
        Reason::HashAffinity,
        Reason::LoadSpill,
        Reason::Fallback,
        Reason::Passthrough,
        Reason::ParseError,
        Reason::Rejected,
        Reason::RoundRobin,
        Reason::Random,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PrefixHit => "prefix_hit",
            Reason::HashAffinity => "hash_affinity",
            Reason::LoadSpill => "load_spill",
            Reason::Fallback => "fallback",
            Reason::Passthrough => "passthrough",
            Reason::ParseError => "parse_error",
            Reason::Rejected => "rejected",
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A well-mixed 64-bit hash of (key, worker id): the rendezvous score.
pub fn mix(key: u64, id: u32) -> u64 {
    // splitmix64 finaliser over the combined input.
    let mut z = key ^ (u64::from(id)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Inputs for one choice among a model's workers (slices indexed like `model.workers`).
pub struct Inputs<'a> {
    pub model: &'a Model,
    /// Each worker's requests in flight (running, waiting, or sent and not yet answered).
    pub reqs: &'a [u32],
    /// Each worker's queued prefill: prompt tokens waiting for prefill that it does not cache
    /// (polled) plus those sent since the poll that have not had their first token.
    pub tokens: &'a [u32],
    /// Each worker's admission limit: the in-flight count at which its running batch is full,
    /// `max_running_requests` plus the requests it reported waiting for prefill
    /// (`poll::capacity`); 0 or missing: unknown.
    pub capacity: &'a [u32],
    pub matched: &'a [u32],
    pub deepest: u32,
    pub total_blocks: u32,
    pub prompt_tokens: u32,
    pub affinity: u64,
    /// The hash of the prompt's first `affinity_blocks` blocks: the same for every prompt that
    /// opens alike (a prompt group), whatever follows; 0: none.
    pub group: u64,
    /// For a chat prompt of three or more messages, the block count at the end of its second
    /// message (system prompt + first user message); 0 otherwise. A worker holding more than
    /// that holds this conversation's own history (`cache_aware`).
    pub conversation_blocks: u32,
    /// For a chat prompt of two or more messages, the block count at the end of its first
    /// message (usually the system prompt); 0 otherwise.
    pub head_blocks: u32,
    /// Each worker's decayed in-flight average (`busy.rs`, `cache_aware`); empty or shorter: 0.
    pub busy: &'a [f32],
    /// Each worker's learned prefill rate (zero-context tokens per second); empty, shorter or
    /// 0: not known yet (the configured rate × weight stands in, `cost.rs`).
    pub rate: &'a [f32],
    /// Each worker's learned seconds between two requests finishing while its batch is full
    /// (`poll.rs`); empty, shorter or 0: not known (a full batch then excludes it, `cost.rs`).
    pub slot: &'a [f32],
    /// Each worker's learned prefill utilisation (0..1, `poll.rs`); empty, shorter or 0: not
    /// known (the configured queue weight applies, `cost.rs`).
    pub util: &'a [f32],
    /// Each worker's decayed sum of uncached prompt tokens it was sent (`footprint.rs`); empty
    /// or shorter: 0.
    pub placed: &'a [f32],
    /// The worker some VM of this Envoy sent a prompt with the same sibling key moments ago,
    /// when nobody held it either (`placements.rs`): its sibling follows it.
    pub recent: Option<usize>,
    /// Requests this VM lately sent whose deepest held prefix was this prompt's (`sharers.rs`):
    /// the other users a second copy of it would serve; 0 when nobody holds any of it.
    pub sharers: f32,
}

/// Estimated uncached prompt tokens if worker `i` serves the request.
pub fn uncached_tokens(inp: &Inputs, i: usize) -> u32 {
    if inp.total_blocks == 0 {
        return inp.prompt_tokens;
    }
    let m = inp
        .matched
        .get(i)
        .copied()
        .unwrap_or(0)
        .min(inp.total_blocks);
    let left = u64::from(inp.prompt_tokens) * u64::from(inp.total_blocks - m);
    (left / u64::from(inp.total_blocks)) as u32
}

/// The prompt tokens a new prompt shares with the sibling placed moments ago (`Inputs::recent`).
pub fn sibling_held_tokens(p: &PolicyConfig, inp: &Inputs) -> u32 {
    opening_tokens(p, inp.prompt_tokens, inp.head_blocks, inp.total_blocks)
}

/// The tokens of a prompt's opening, what its siblings share (`placements.rs`): its opening
/// message (`head_blocks` of its `total_blocks`), else its rendezvous blocks.
pub fn opening_tokens(
    p: &PolicyConfig,
    prompt_tokens: u32,
    head_blocks: u32,
    total_blocks: u32,
) -> u32 {
    let shared = if head_blocks > 0 {
        head_blocks
    } else {
        p.affinity_blocks.min(u32::MAX as usize) as u32
    };
    match total_blocks {
        0 => 0,
        t => (u64::from(prompt_tokens) * u64::from(shared.min(t)) / u64::from(t)) as u32,
    }
}

/// The load charge of sending the prompt to worker `w`: its uncached tokens there; for a prompt
/// nobody holds that follows its sibling (`Inputs::recent`), those past what the sibling is
/// computing (it waits in that worker's queue and then reuses it), so a group's first requests
/// do not make their worker look busier than it is and push the next siblings elsewhere.
pub fn charged_tokens(p: &PolicyConfig, inp: &Inputs, w: usize) -> u32 {
    if inp.deepest == 0 && inp.recent == Some(w) {
        inp.prompt_tokens
            .saturating_sub(sibling_held_tokens(p, inp))
    } else {
        uncached_tokens(inp, w)
    }
}

/// Fewest in-flight requests, then fewest tokens; scanning from `start` spreads ties.
pub fn least_loaded(reqs: &[u32], tokens: &[u32], start: usize) -> usize {
    let n = reqs.len();
    if n == 0 {
        return 0;
    }
    // Reduce first: `start` is a free-running counter and `start + k` would overflow once it
    // nears usize::MAX (2^32 decisions on wasm32).
    let start = start % n;
    let mut best = start;
    for k in 0..n {
        let i = (start + k) % n;
        let key = (reqs[i], tokens.get(i).copied().unwrap_or(0));
        let bk = (reqs[best], tokens.get(best).copied().unwrap_or(0));
        if key < bk {
            best = i;
        }
    }
    best
}

/// xorshift64*: the `random` policy's generator (per VM, seeded at start).
pub fn next_random(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// A worker-choice policy.
pub trait Policy {
    /// Chooses among `inp.model.workers` (non-empty).
    fn choose(&mut self, p: &PolicyConfig, inp: &Inputs) -> (usize, Reason);
    /// Whether the policy reads the prefix index (baselines skip the lookup).
    fn uses_index(&self) -> bool;
}

/// The configured policy; `seed` varies per VM so baselines do not move in lockstep.
pub fn from_config(name: PolicyName, seed: u64) -> Box<dyn Policy> {
    match name {
        PolicyName::CacheAware => Box::new(cache_aware::CacheAware),
        PolicyName::CostAware => Box::new(cost_aware::CostAware),
        PolicyName::RoundRobin => Box::new(round_robin::RoundRobin::new(seed)),
        PolicyName::Random => Box::new(random::Random::new(seed)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_loaded_start_near_the_end_of_usize_does_not_overflow() {
        // The rotation counter wraps after 2^32 decisions on wasm32 (usize = u32).
        for start in [usize::MAX, usize::MAX - 1] {
            let w = least_loaded(&[1, 0, 1], &[0, 0, 0], start);
            assert_eq!(w, 1);
        }
    }

    #[test]
    fn a_follower_is_charged_past_what_its_sibling_computes() {
        use shared_tests::{inputs, model};
        let m = model(4);
        let p = PolicyConfig::default();
        let z = [0u32; 4];
        // 1600 tokens in 100 blocks, the opening message 90 of them.
        let follow = Inputs {
            recent: Some(2),
            head_blocks: 90,
            ..inputs(&m, &z, &z, &z, 5)
        };
        assert_eq!(charged_tokens(&p, &follow, 2), 160);
        // Anywhere else, or without a sibling, the whole prompt.
        assert_eq!(charged_tokens(&p, &follow, 1), 1600);
        let alone = Inputs {
            head_blocks: 90,
            ..inputs(&m, &z, &z, &z, 5)
        };
        assert_eq!(charged_tokens(&p, &alone, 2), 1600);
        // No opening message: the rendezvous blocks (4 of 100).
        let blocks = Inputs {
            recent: Some(2),
            ..inputs(&m, &z, &z, &z, 5)
        };
        assert_eq!(charged_tokens(&p, &blocks, 2), 1536);
    }

    #[test]
    fn least_loaded_and_random() {
        assert_eq!(least_loaded(&[3, 1, 1], &[0, 5, 2], 0), 2);
        assert_eq!(least_loaded(&[0, 0], &[0, 0], 1), 1);
        let mut s = 88u64;
        let a = next_random(&mut s);
        assert_ne!(a, next_random(&mut s));
    }
}
