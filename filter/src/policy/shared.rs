//! What the two index policies (`cache_aware`, `cost_aware`) share, so both decide alike where
//! only their ranking differs: the rendezvous score, the fleet-relative load bound and its slack,
//! a worker's own capacity, two choices for a prompt nobody holds, and the decision's reason.
//!
//! Costs: a few arithmetic operations per worker; no allocation.

use super::{mix, sibling_held_tokens, Inputs, Reason};
use crate::config::{Model, PolicyConfig};

/// Rendezvous score of worker `i` for `key` (higher wins).
pub(super) fn hrw(model: &Model, i: usize, key: u64) -> f64 {
    let w = &model.workers[i];
    let h = mix(key, w.id);
    if model.uniform_weights {
        return h as f64;
    }
    // u in (0, 1): never 0 so ln is finite and negative.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -w.weight / u.ln()
}

/// The load bound's slack for a worker holding `held` tokens of the prompt (see
/// [`holder_slack`]); the prefill workers of a PD model reach the full slack at
/// `prefill_slack_full_tokens`.
pub(super) fn slack_for(p: &PolicyConfig, inp: &Inputs, held: u32) -> f64 {
    let full = if inp.model.pd.is_some() {
        p.prefill_slack_full_tokens
    } else {
        p.slack_full_tokens
    };
    if full == 0 {
        return p.load_slack;
    }
    let f = (f64::from(held) / f64::from(full)).min(1.0);
    1.0 + (p.load_slack - 1.0).max(0.0) * f
}

/// For a prompt nobody holds, the worker its sibling went to moments ago (`Inputs::recent`),
/// while that worker is under the load bound with the slack of a holder of the part they share
/// (the opening message, else the rendezvous blocks): it is about to hold it.
pub(super) fn follow_sibling(p: &PolicyConfig, inp: &Inputs) -> Option<usize> {
    if inp.deepest != 0 {
        return None;
    }
    let w = inp.recent.filter(|&w| w < inp.model.workers.len())?;
    let slack = slack_for(p, inp, sibling_held_tokens(p, inp));
    under_bound(p, inp, total_reqs(inp) as f64, w, slack).then_some(w)
}

/// Whether worker `i` starts a new request at once by its own account: fewer requests in
/// flight than its admission limit (`Inputs::capacity`: the `max_running_requests` it reports
/// plus the requests it reported waiting for prefill, which hold no running slot;
/// `Some(false)`: saturated, the request would wait for a running one to finish). `None` when
/// it reports no capacity (polling off, `/get_load`, a stale answer) and on PD models, whose
/// prefill workers hold prefills only.
pub(super) fn room(inp: &Inputs, i: usize) -> Option<bool> {
    if inp.model.pd.is_some() {
        return None;
    }
    let cap = inp.capacity.get(i).copied().filter(|&c| c > 0)?;
    Some(inp.reqs.get(i).copied().unwrap_or(0) < cap)
}

/// What the worker's own capacity says of its eligibility (module docs): a saturated worker
/// never (`Some(false)`); a holder of some of the prompt under the capacity it reports always
/// (`Some(true)`: its requests in flight are mostly decoding, which a new request barely waits
/// for; only its queued prefill, in the cost, delays it). `None`: the fleet-relative load bound
/// decides.
pub(super) fn by_capacity(inp: &Inputs, i: usize) -> Option<bool> {
    match room(inp, i) {
        Some(true) if inp.matched.get(i).copied().unwrap_or(0) == 0 => None,
        r => r,
    }
}

/// `reqs_i + 1 <= (1 + load_eps) * (R + 1) * w_i / W + slack`.
pub(super) fn under_bound(
    p: &PolicyConfig,
    inp: &Inputs,
    total: f64,
    i: usize,
    slack: f64,
) -> bool {
    let model = inp.model;
    let r = f64::from(inp.reqs.get(i).copied().unwrap_or(0));
    // Same operation order as the uniform path's `share`, so both round alike.
    let share = (1.0 + p.load_eps) * (total + 1.0) * model.workers[i].weight / model.total_weight;
    r + 1.0 <= share + slack
}

/// Two choices for a prompt nobody holds: the rendezvous top `a` and runner-up `b` (both under
/// the load bound). `b` wins when the uncached tokens `a` was sent lately (`footprint.rs`), per
/// unit weight, exceed `b`'s by more than this prompt: new prefixes then fill the caches evenly
/// (the best of two choices), while a prefix keeps its rendezvous worker whenever the two are
/// close, so siblings and replicas still agree, and a worker left with a large footprint (a long
/// document) only stops being the first choice. On PD prefill workers the prefills queued on
/// each (in-flight tokens) are added to its sum (`load/pd_compare --sizes 4 --runs 5`: TTFT p99
/// median 433 -> 356 ms, hit rate unchanged). No sums kept (policy off, tests): `a`.
pub(super) fn two_choices(inp: &Inputs, a: usize, b: Option<usize>) -> usize {
    let Some(b) = b else {
        return a;
    };
    let (Some(&fa), Some(&fb)) = (inp.placed.get(a), inp.placed.get(b)) else {
        return a;
    };
    let (wa, wb) = (inp.model.workers[a].weight, inp.model.workers[b].weight);
    // PD prefill workers: the prefills queued on each (in-flight uncached tokens, fleet-wide
    // through the load ledger, released at the first token) count too, so a burst of new
    // prompts spreads its prefill work over the workers rather than queueing behind one.
    let queued = |i: usize| match inp.model.pd {
        Some(_) => f64::from(inp.tokens.get(i).copied().unwrap_or(0)),
        None => 0.0,
    };
    let (fa, fb) = (f64::from(fa) + queued(a), f64::from(fb) + queued(b));
    if fa / wa - fb / wb > f64::from(inp.prompt_tokens) / wb {
        b
    } else {
        a
    }
}

/// The model's requests in flight, for the load bound; a worker marked unavailable
/// (`poll::UNAVAILABLE`) counts none, so the mark excludes that worker without raising everyone
/// else's bound.
pub(super) fn total_reqs(inp: &Inputs) -> u64 {
    inp.reqs
        .iter()
        .filter(|&&r| r < crate::poll::UNAVAILABLE)
        .map(|&r| u64::from(r))
        .sum()
}

pub(super) fn reason_of(inp: &Inputs, chosen: usize, top: usize) -> Reason {
    if inp.deepest == 0 {
        if chosen == top {
            Reason::HashAffinity
        } else {
            Reason::LoadSpill
        }
    } else if inp.matched.get(chosen).copied().unwrap_or(0) >= inp.deepest {
        Reason::PrefixHit
    } else {
        Reason::LoadSpill
    }
}

/// Fewest holders of a fleet prefix: one holder has never spilled, and two may be a prompt group
/// plus one spill (a sibling routed before the first answer was indexed).
pub(super) const MIN_FLEET_HOLDERS: usize = 3;

/// How many of a model's `n` workers must hold a prefix for it to be a fleet prefix: the share
/// `fleet_prefix_share` of them, at most the index's `HOLDERS` slots for it (a larger fleet
/// cannot list more), never fewer than [`MIN_FLEET_HOLDERS`]. `None`: the rule is off (share 0).
pub(super) fn fleet_holders(p: &PolicyConfig, n: usize) -> Option<usize> {
    if p.fleet_prefix_share <= 0.0 {
        return None;
    }
    let share = (p.fleet_prefix_share * n as f64).ceil() as usize;
    // HOLDERS (4) >= MIN_FLEET_HOLDERS (3): the clamp's bounds are in order.
    Some(share.clamp(MIN_FLEET_HOLDERS, crate::index::HOLDERS))
}

/// The deepest prefix (blocks) of this prompt that a fleet share of the workers holds: at least
/// `fleet_prefix_share` of them (0.75), or all of the index's `HOLDERS` slots for it in a fleet
/// larger than that share allows, and never fewer than [`MIN_FLEET_HOLDERS`]. 0: none (or the
/// share is 0). Whatever its shape: the depth that the `k`-th deepest holder reaches.
///
/// Costs: one pass over the workers keeping the `k ≤ HOLDERS` deepest matches; no allocation.
pub(super) fn fleet_held_blocks(p: &PolicyConfig, inp: &Inputs) -> u32 {
    let n = inp.model.workers.len();
    let Some(k) = fleet_holders(p, n).filter(|&k| inp.deepest > 0 && k <= n) else {
        return 0;
    };
    let mut top = [0u32; crate::index::HOLDERS];
    // `top[..k]` holds the k deepest matches, deepest first.
    for &m in inp.matched {
        if m <= top[k - 1] {
            continue;
        }
        let mut j = k - 1;
        while j > 0 && top[j - 1] < m {
            top[j] = top[j - 1];
            j -= 1;
        }
        top[j] = m;
    }
    top[k - 1]
}
