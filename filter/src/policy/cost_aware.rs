//! The cost-aware policy (`policy.name: "cost_aware"`, the default): the eligible worker where
//! the request costs the fewest seconds (`cost.rs`), with a hard load bound. One formula for
//! every prompt shape.
//!
//! For a prompt of `P` estimated tokens in `B` blocks:
//!
//! * **Eligibility.** A worker whose running batch is full (requests in flight ≥ the
//!   `max_running_requests` it reports in `/v1/loads`, or in `/get_server_info` for an older
//!   SGLang, plus the requests it reported waiting for prefill: `poll::capacity`) makes a new
//!   request wait for a running one to finish. A holder of some of the prompt stays eligible
//!   then, with that wait in its cost (`cost.rs`, `S_i`), once how fast its slots free is
//!   learned; until then, and for a worker holding none of the prompt, a full batch excludes
//!   it. A worker holding some of the prompt and under its capacity always is eligible: only
//!   its cost can move the prompt. Any other worker (none of the prompt held, or no capacity
//!   known: polling off, a stale answer) is eligible only while
//!   `reqs_i + 1 <= (1 + load_eps) * (R + 1) * w_i / W + s_i`, where `R` is the model's total
//!   in-flight requests, and the slack `s_i` is 1 for a worker holding none of the prompt and
//!   grows for a holder with the tokens it holds, up to `load_slack` (default 3) at
//!   `slack_full_tokens` (default 8192): new prefixes spread instead of piling onto one worker.
//! * **No worker holds any prefix** (`deepest == 0`): rendezvous (highest-random-weight) hashing
//!   of the prompt's rendezvous key (`router/mod.rs`) picks the top eligible worker. Sibling
//!   requests and separate Envoy replicas make the same choice with no shared state, and adding or
//!   removing a worker moves only ~1/n of the prefixes. Weighted workers use `-w / ln(u)`. The
//!   runner-up replaces the top when this VM lately sent the top more than one such prompt's
//!   uncached tokens more ([`two_choices`], `footprint.rs`), so new prefixes fill the caches
//!   evenly rather than binomially (reason still `hash_affinity`: placement, not a spill); a
//!   sibling of a prompt placed moments ago by any thread follows it until the index has it
//!   (`placements.rs`; within the load bound with the slack of a holder of the opening they
//!   share, [`follow_sibling`]).
//! * **Some worker holds a prefix**: the eligible worker with the lowest cost in seconds
//!   (`cost.rs`: the prefill it would do, the work queued ahead of it, the second copy it would
//!   leave) wins; ties go to the rendezvous order. Hot-spot protection follows from that
//!   arithmetic (see `cost.rs`), not from rules on the prompt's shape.
//! * **A fleet prefix** is the deepest prefix of the prompt that a fleet share of the workers
//!   holds (`policy.fleet_prefix_share` of them, 0.75, or all of the index's `HOLDERS` slots for
//!   it, and at least three: [`fleet_held_blocks`]); in the cost every worker holds it. Every
//!   worker will cache such a prefix once, for every conversation it is given on it, so its
//!   recompute and copy are not a price of this request: charged to it, they would stack every
//!   new conversation on the first holders, whose caches then evict each other's histories while
//!   the rest of the fleet idles (`load/compare --scenario agentic`: 8 of 16 workers used). The
//!   prefix past it (a conversation's own history, a document) is priced as above.
//!   Workers holding as much of the prompt as the cheapest one, and costing at most the seconds
//!   of prefill it holds more, share the prompt by rendezvous on its opening blocks ([`stick`]):
//!   a prompt group that was copied to a second worker keeps using one copy instead of
//!   alternating with the load.

use super::cost::{self, Cost};
use super::shared::{
    by_capacity, fleet_held_blocks, follow_sibling, hrw, reason_of, room, slack_for, total_reqs,
    two_choices, under_bound,
};
use super::{least_loaded, mix, uncached_tokens, Inputs, Policy, Reason};
use crate::config::PolicyConfig;

/// The default policy (stateless: everything it needs is in [`Inputs`]).
pub struct CostAware;

impl Policy for CostAware {
    fn choose(&mut self, p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
        choose(p, inp)
    }
    fn uses_index(&self) -> bool {
        true
    }
}

/// Prompt tokens worker `i` holds.
fn held_tokens(inp: &Inputs, i: usize) -> u32 {
    inp.prompt_tokens.saturating_sub(uncached_tokens(inp, i))
}

/// [`held_tokens`] as the cost counts it: rounded like [`tokens_in`], so that a worker holding
/// `b` blocks and one credited a fleet prefix of `b` blocks hold exactly as much (their costs
/// tie, and the rendezvous order, not a rounding, breaks the tie).
fn held_for_cost(inp: &Inputs, i: usize) -> f64 {
    tokens_in(inp, inp.matched.get(i).copied().unwrap_or(0))
}

/// The prompt tokens in its first `blocks` blocks.
fn tokens_in(inp: &Inputs, blocks: u32) -> f64 {
    match inp.total_blocks {
        0 => 0.0,
        t => (u64::from(inp.prompt_tokens) * u64::from(blocks.min(t)) / u64::from(t)) as f64,
    }
}

/// The prompt tokens the deepest holder holds (`H` in `cost.rs`).
fn deepest_held(inp: &Inputs) -> f64 {
    tokens_in(inp, inp.deepest)
}

/// Worker `i`'s zero-context prefill rate (tokens/s): learned, else configured × weight.
fn rate_of(c: &Cost, inp: &Inputs, i: usize) -> f64 {
    let learned = inp.rate.get(i).copied().unwrap_or(0.0);
    c.rate(learned, inp.model.workers[i].weight)
}

/// The prompt tokens of a prefix a fleet share of the workers holds ([`fleet_held_blocks`]).
fn fleet_tokens(p: &PolicyConfig, inp: &Inputs) -> f64 {
    tokens_in(inp, fleet_held_blocks(p, inp))
}

/// The cost model for this request: the configured constants, the fleet's learned rate for
/// workers without one, and the copy shared by the requests that lately reached its prefix.
fn cost_model(p: &PolicyConfig, inp: &Inputs) -> Cost {
    Cost::new(p)
        .with_fleet_rate(inp.rate, inp.model.workers.iter().map(|w| w.weight))
        .shared_by(inp.sharers)
        .at_utilisation(inp.util)
}

/// The seconds the request costs on worker `i` (`cost.rs`); `deepest` from [`deepest_held`],
/// `fleet` from [`fleet_tokens`]: a prefix the fleet holds counts as held by every worker.
fn seconds(c: &Cost, inp: &Inputs, deepest: f64, fleet: f64, i: usize) -> f64 {
    let w = cost::Worker {
        held: held_for_cost(inp, i).max(fleet),
        queued: f64::from(inp.tokens.get(i).copied().unwrap_or(0)),
        reqs: f64::from(inp.reqs.get(i).copied().unwrap_or(0)),
        rate: rate_of(c, inp, i),
        slot_wait: slot_wait(inp, i).unwrap_or(0.0),
    };
    c.seconds(f64::from(inp.prompt_tokens), deepest, &w)
}

/// Seconds until a running slot frees on worker `i` (`S_i` in `cost.rs`): 0 while its batch has
/// room, or where its capacity is unknown or it is a PD prefill worker ([`room`]); `None` when
/// its batch is full and how fast its slots free is not learned yet.
fn slot_wait(inp: &Inputs, i: usize) -> Option<f64> {
    if room(inp, i) != Some(false) {
        return Some(0.0);
    }
    let ahead = inp.reqs.get(i).copied().unwrap_or(0);
    let cap = inp.capacity.get(i).copied().unwrap_or(0);
    let t = inp
        .slot
        .get(i)
        .copied()
        .filter(|t| *t > 0.0 && t.is_finite())?;
    Some(f64::from(ahead.saturating_sub(cap).saturating_add(1)) * f64::from(t))
}

/// What the worker's own capacity says of `i`'s eligibility ([`by_capacity`]), except that a
/// holder of some of the prompt whose batch is full stays eligible once its slot interval is
/// learned: the wait for a slot is then a price in its cost, not a wall.
fn by_capacity_or_slot(inp: &Inputs, i: usize) -> Option<bool> {
    match by_capacity(inp, i) {
        Some(false) if inp.matched.get(i).copied().unwrap_or(0) > 0 => {
            Some(slot_wait(inp, i).is_some())
        }
        r => r,
    }
}

/// The load bound's absolute slack for worker `i`: 1 for a worker holding none of the prompt (a
/// slow or busy worker stops receiving *new* prefixes at low concurrency); for a holder it grows
/// with the prompt tokens it holds, up to `load_slack` at `slack_full_tokens`: queueing a few
/// requests more is worth it to reuse a 32k-token document, not to reuse a 3k-token system prompt
/// that every worker can cache once. Applies only where the worker's capacity is unknown.
fn holder_slack(p: &PolicyConfig, inp: &Inputs, i: usize) -> f64 {
    if inp.matched.get(i).copied().unwrap_or(0) == 0 {
        return 1.0;
    }
    slack_for(p, inp, held_tokens(inp, i))
}

/// Eligibility: [`by_capacity_or_slot`], else the load bound with [`holder_slack`].
fn cap_ok(p: &PolicyConfig, inp: &Inputs, total: f64, i: usize) -> bool {
    by_capacity_or_slot(inp, i)
        .unwrap_or_else(|| under_bound(p, inp, total, i, holder_slack(p, inp, i)))
}

/// The cache-aware choice: `(worker index, reason)`. `model.workers` must be non-empty.
///
/// Equal weights (the common fleet) take an integer fast path for the load bound and the
/// rendezvous scores; weighted fleets the general one. Both make the same choice (tested), so
/// replicas agree whichever path they take.
pub fn choose(p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
    if let Some(w) = follow_sibling(p, inp) {
        return (w, Reason::HashAffinity);
    }
    let n = inp.model.workers.len();
    if inp.model.uniform_weights
        && inp.reqs.len() == n
        && inp.tokens.len() == n
        && inp.matched.len() == n
    {
        choose_uniform(p, inp)
    } else {
        choose_general(p, inp)
    }
}

/// The per-request scan over every worker, so its cost per worker is what keeps a decision
/// nearly flat from 4 to 256 workers: the load bound becomes two integer thresholds computed
/// once and rendezvous scores stay integers.
fn choose_uniform(p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
    let model = inp.model;
    let total = total_reqs(inp);
    let n = model.workers.len();
    let share = (1.0 + p.load_eps) * (total as f64 + 1.0) / n as f64;
    // `r + 1 <= share + slack` for an integer r  <=>  `r + 1 <= floor(share + slack)`.
    let cap = |slack: f64| -> u64 {
        let c = (share + slack).floor();
        if c >= 1.0 {
            c as u64
        } else {
            0
        }
    };
    let cap_other = cap(1.0);
    let rows = model
        .workers
        .iter()
        .zip(inp.reqs.iter())
        .zip(inp.matched.iter())
        .enumerate();
    if inp.deepest == 0 {
        // Nobody holds the prompt (so every cap is `cap_other`): the eligible worker with the
        // highest rendezvous score, and the overall top to tell affinity from spill.
        let (mut top, mut top_score) = (0usize, 0u64);
        // The two highest-scoring eligible workers.
        let mut best: Option<(usize, u64)> = None;
        let mut second: Option<(usize, u64)> = None;
        for (i, ((w, &r), _)) in rows {
            let score = mix(inp.affinity, w.id);
            if i == 0 || score > top_score {
                (top, top_score) = (i, score);
            }
            if u64::from(r) >= cap_other || room(inp, i) == Some(false) {
                continue;
            }
            if best.is_none_or(|(_, s)| score > s) {
                second = best;
                best = Some((i, score));
            } else if second.is_none_or(|(_, s)| score > s) {
                second = Some((i, score));
            }
        }
        return match best {
            Some((a, _)) => {
                let chosen = two_choices(inp, a, second.map(|(b, _)| b));
                // Placement by footprint is not a spill: the reason follows `a`.
                (chosen, reason_of(inp, a, top))
            }
            None => (least_loaded(inp.reqs, inp.tokens, 0), Reason::LoadSpill),
        };
    }
    // Someone holds a prefix: fewest seconds; rendezvous scores only to break exact ties.
    let c = cost_model(p, inp);
    let (deepest, fleet) = (deepest_held(inp), fleet_tokens(p, inp));
    let cost_of = |i: usize| -> Option<f64> {
        let (r, m) = (inp.reqs[i], inp.matched[i]);
        let eligible = by_capacity_or_slot(inp, i).unwrap_or_else(|| {
            let cap = if m > 0 {
                cap(holder_slack(p, inp, i))
            } else {
                cap_other
            };
            u64::from(r) < cap
        });
        eligible.then(|| seconds(&c, inp, deepest, fleet, i))
    };
    let mut best: Option<(usize, f64, u32)> = None;
    for (i, ((w, _), _)) in rows {
        let Some(cost) = cost_of(i) else {
            continue;
        };
        let better = match best {
            None => true,
            Some((_, s, b)) => {
                cost < s || (cost == s && mix(inp.affinity, w.id) > mix(inp.affinity, b))
            }
        };
        if better {
            best = Some((i, cost, w.id));
        }
    }
    match best {
        Some((chosen, cost, _)) => {
            let chosen = stick(&c, inp, chosen, cost, cost_of, |i| {
                mix(inp.group, model.workers[i].id) as f64
            });
            (chosen, reason_of(inp, chosen, 0))
        }
        None => (least_loaded(inp.reqs, inp.tokens, 0), Reason::LoadSpill),
    }
}

/// PD prefill workers: among the workers holding as much of the prompt as `chosen` (the
/// cheapest), those whose cost is within the seconds of prefill `chosen` holds of its cost share
/// the prompt by rendezvous on its opening (`Inputs::group`), so every request of a prompt group
/// returns to one copy of its prefix instead of alternating between copies with the load, which
/// doubles the group's cache footprint for good once it has spilled (measured with
/// `load/pd_compare --sizes 2`: 5-8 of 32 groups alternating between both prefill workers). A
/// copy is abandoned only when its worker's queue costs more than recomputing the prefix
/// elsewhere; the load bound still applies. Elsewhere the cost alone decides: a prefix that
/// several workers hold adds the same to each, and new conversations on a fleet-wide system
/// prompt would otherwise stack on the group's favourite while the rest of the fleet idles.
fn stick(
    c: &Cost,
    inp: &Inputs,
    chosen: usize,
    chosen_cost: f64,
    cost_of: impl Fn(usize) -> Option<f64>,
    score: impl Fn(usize) -> f64,
) -> usize {
    let depth = inp.matched.get(chosen).copied().unwrap_or(0);
    if depth == 0 || inp.group == 0 || inp.model.pd.is_none() {
        return chosen;
    }
    // An exact tie (idle copies): the conversation's own rendezvous already chose among them, so
    // conversations over a shared prompt still spread over its holders when nothing is queued;
    // the group decides only when load would otherwise alternate between the copies.
    let tied = (0..inp.model.workers.len()).any(|i| {
        i != chosen
            && inp.matched.get(i).copied().unwrap_or(0) == depth
            && cost_of(i) == Some(chosen_cost)
    });
    if tied {
        return chosen;
    }
    let held = f64::from(held_tokens(inp, chosen));
    let limit = chosen_cost + held / rate_of(c, inp, chosen);
    let mut best = (chosen, score(chosen));
    for i in 0..inp.model.workers.len() {
        if i == chosen || inp.matched.get(i).copied().unwrap_or(0) != depth {
            continue;
        }
        let Some(s) = cost_of(i) else {
            continue;
        };
        let sc = score(i);
        if s <= limit && sc > best.1 {
            best = (i, sc);
        }
    }
    best.0
}

/// Any weights; also the reference the uniform fast path is tested against.
fn choose_general(p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
    let model = inp.model;
    let n = model.workers.len();
    let total = total_reqs(inp) as f64;
    let c = cost_model(p, inp);
    let (deepest, fleet) = (deepest_held(inp), fleet_tokens(p, inp));
    let mut top = 0usize; // rendezvous top overall
    let mut top_score = f64::MIN;
    let mut best: Option<(usize, f64, f64)> = None; // (index, cost, hrw)
    let mut second: Option<(usize, f64)> = None; // runner-up by rendezvous (`deepest == 0`)
                                                 // Worker `i`'s seconds, `None` when not eligible.
    let cost_of = |i: usize| -> Option<f64> {
        cap_ok(p, inp, total, i).then(|| seconds(&c, inp, deepest, fleet, i))
    };
    for i in 0..n {
        let score = hrw(model, i, inp.affinity);
        if score > top_score {
            top_score = score;
            top = i;
        }
        let cost = if inp.deepest == 0 {
            if !cap_ok(p, inp, total, i) {
                continue;
            }
            0.0 // pure rendezvous among eligible workers
        } else {
            match cost_of(i) {
                Some(c) => c,
                None => continue,
            }
        };
        let better = match best {
            None => true,
            Some((_, c, s)) => cost < c || (cost == c && score > s),
        };
        if inp.deepest == 0 {
            if better {
                second = best.map(|(b, _, s)| (b, s));
            } else if second.is_none_or(|(_, s)| score > s) {
                second = Some((i, score));
            }
        }
        if better {
            best = Some((i, cost, score));
        }
    }
    let Some((chosen, cost, _)) = best else {
        // Unreachable in practice (some worker is always at or below the weighted mean), but a
        // defined answer beats a panic.
        return (least_loaded(inp.reqs, inp.tokens, 0), Reason::LoadSpill);
    };
    if inp.deepest == 0 {
        let placed = two_choices(inp, chosen, second.map(|(b, _)| b));
        return (placed, reason_of(inp, chosen, top));
    }
    let chosen = stick(&c, inp, chosen, cost, cost_of, |i| hrw(model, i, inp.group));
    (chosen, reason_of(inp, chosen, top))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::shared_tests::{inputs, model, pd_model, shared_policy_tests};

    shared_policy_tests!(choose, choose_uniform, choose_general);

    #[test]
    fn holder_slack_grows_with_the_tokens_held() {
        crate::policy::shared_tests::holder_slack_grows_with_the_tokens_held(choose, &|_| {});
    }

    #[test]
    fn a_prefix_every_worker_holds_leaves_queued_work_to_decide() {
        // Every worker holds the 10-block opening, nobody more: it adds the same seconds
        // everywhere, so the work queued ahead decides (workers 0 and 1 each run a request), and
        // the rendezvous order spreads the ties between 2 and 3.
        let m = model(4);
        let p = PolicyConfig::default();
        let (reqs, z) = ([1u32, 1, 0, 0], [0u32; 4]);
        let matched = [10u32; 4];
        let mut seen = [0usize; 4];
        for key in 0..64 {
            let (w, reason) = choose(&p, &inputs(&m, &reqs, &z, &matched, key));
            assert!(w == 2 || w == 3, "key {key}: {w}");
            assert_eq!(reason, Reason::PrefixHit);
            seen[w] += 1;
        }
        assert!(seen[2] > 8 && seen[3] > 8, "ties spread: {seen:?}");
        // Prefill queued on worker 2: worker 3.
        let tokens = [0u32, 0, 50, 0];
        assert_eq!(choose(&p, &inputs(&m, &reqs, &tokens, &matched, 1)).0, 3);
    }

    #[test]
    fn a_short_prefix_on_busy_holders_spreads_prompts_to_idle_workers() {
        // Four of eight workers hold the first 2 blocks (32 tokens) of a 1600-token prompt and
        // run 6 requests each: recomputing and copying 32 tokens elsewhere (64) costs less than
        // the work queued ahead on a holder (0.25 x 6 x 64 = 96), so new prompts go to the idle
        // half, spread by rendezvous.
        let m = model(8);
        let p = PolicyConfig::default();
        let (reqs, z) = ([6u32, 6, 6, 6, 0, 0, 0, 0], [0u32; 8]);
        let matched = [2u32, 2, 2, 2, 0, 0, 0, 0];
        let mut seen = [0usize; 8];
        for key in 0..64 {
            let (w, _) = choose(&p, &inputs(&m, &reqs, &z, &matched, key));
            seen[w] += 1;
        }
        assert_eq!(seen[..4].iter().sum::<usize>(), 0, "{seen:?}");
        assert!(seen[4..].iter().all(|&n| n > 4), "{seen:?}");
        // Two idle holders keep it: the prefix is then worth more than nothing. Four holders
        // (every index slot of it) make it a fleet prefix, held as far as the cost goes by every
        // worker: new prompts on it spread over the whole fleet by rendezvous.
        let idle = [0u32; 8];
        let two = [2u32, 2, 0, 0, 0, 0, 0, 0];
        let (w, r) = choose(&p, &inputs(&m, &idle, &z, &two, 3));
        assert!(w < 2 && r == Reason::PrefixHit, "{w} {r:?}");
        let mut seen = [0usize; 8];
        for key in 0..64 {
            seen[choose(&p, &inputs(&m, &idle, &z, &matched, key)).0] += 1;
        }
        assert!(seen.iter().all(|&n| n > 2), "{seen:?}");
    }

    #[test]
    fn a_fleet_prefix_is_the_depth_a_fleet_share_of_the_workers_reaches() {
        let p = PolicyConfig::default();
        let z8 = [0u32; 8];
        let depth = |m: &crate::config::Model, matched: &[u32]| {
            let deepest = matched.iter().copied().max().unwrap_or(0);
            let inp = Inputs {
                deepest,
                ..inputs(m, &z8[..matched.len()], &z8[..matched.len()], matched, 1)
            };
            fleet_held_blocks(&p, &inp)
        };
        let (m4, m8, m2) = (model(4), model(8), model(2));
        // Eight workers: the four index slots of a prefix (min(6, 4)), whatever their order.
        assert_eq!(depth(&m8, &[10, 0, 10, 3, 10, 0, 10, 0]), 10);
        assert_eq!(depth(&m8, &[10, 10, 10, 3, 3, 0, 0, 0]), 3);
        assert_eq!(depth(&m8, &[10, 10, 10, 0, 0, 0, 0, 0]), 0);
        // Four workers: three of them; two workers: never (two holders may be one spill).
        assert_eq!(depth(&m4, &[5, 5, 5, 0]), 5);
        assert_eq!(depth(&m4, &[9, 5, 0, 5]), 5);
        assert_eq!(depth(&m4, &[5, 5, 0, 0]), 0);
        assert_eq!(depth(&m2, &[5, 5]), 0);
        let off = PolicyConfig {
            fleet_prefix_share: 0.0,
            ..PolicyConfig::default()
        };
        let inp = Inputs {
            deepest: 10,
            ..inputs(&m8, &z8, &z8, &[10u32; 8], 1)
        };
        assert_eq!(fleet_held_blocks(&off, &inp), 0);
    }

    #[test]
    fn a_shared_prefix_respects_the_load_bound() {
        let m = model(4);
        let p = PolicyConfig::default();
        // The non-holder worker 3 has 4 requests right now: share 2*(5+1)/4 = 3, cap 4: over.
        let (reqs, z) = ([1u32, 0, 0, 4], [0u32; 4]);
        let matched = [10u32, 10, 10, 0];
        let (w, _) = choose(&p, &inputs(&m, &reqs, &z, &matched, 9));
        assert!(w == 1 || w == 2, "{w}");
    }

    #[test]
    fn a_holder_with_a_deep_queue_keeps_a_long_history_and_loses_a_short_one() {
        // The case from the trace replay: a ~12k-token follow-up (98 blocks) whose holder
        // reports 5 of 16 requests and 19,564 queued prefill tokens; the rest of the fleet idle.
        let m = model(8);
        let p = PolicyConfig::default();
        let tokens = [19_564u32, 0, 0, 0, 0, 0, 0, 0];
        let reqs = [5u32, 1, 1, 1, 1, 1, 1, 1];
        let cap = [16u32; 8];
        let ask = |matched| Inputs {
            prompt_tokens: 12_000,
            total_blocks: 98,
            capacity: &cap,
            ..inputs(&m, &reqs, &tokens, matched, 7)
        };
        let c = Cost::new(&p);
        let cases = [(10u32, false), (26, true), (80, true), (97, true)].map(|(history, stays)| {
            let mut matched = [0u32; 8];
            matched[0] = history;
            (history, stays, matched)
        });
        for (history, stays, matched) in &cases {
            let (history, stays) = (*history, *stays);
            let inp = ask(matched);
            let (w, r) = choose(&p, &inp);
            // What the seconds say: the holder against an idle worker.
            let h = deepest_held(&inp);
            let (holder, idle) = (seconds(&c, &inp, h, 0.0, 0), seconds(&c, &inp, h, 0.0, 1));
            assert_eq!(holder < idle, stays, "history {history}");
            assert_eq!(w == 0, stays, "history {history}: {w} {r:?}");
            // The general (weighted) path agrees.
            let mut g = model(8);
            g.uniform_weights = false;
            let inp = Inputs { model: &g, ..inp };
            assert_eq!(choose(&p, &inp).0, w);
        }
        // A holder at the capacity it reports cannot start the turn: it is left.
        let full = [5u32, 16, 16, 16, 16, 16, 16, 16];
        let matched = [97u32, 0, 0, 0, 0, 0, 0, 0];
        let inp = Inputs {
            capacity: &full,
            ..ask(&matched)
        };
        assert_eq!(choose(&p, &inp).1, Reason::LoadSpill);
        // Unless how fast its slots free is known: the wait is then a price. One request ahead
        // of it frees in 20 ms: cheaper than recomputing 97 blocks elsewhere; in 8 s, dearer.
        for (t, stays) in [(0.02f32, true), (8.0, false)] {
            let slot = [t; 8];
            let inp = Inputs {
                capacity: &full,
                slot: &slot,
                util: &[],
                ..ask(&matched)
            };
            assert_eq!(choose(&p, &inp).0 == 0, stays, "slot {t} s");
            let mut g = model(8);
            g.uniform_weights = false;
            let general = Inputs { model: &g, ..inp };
            assert_eq!(
                choose(&p, &general).0 == 0,
                stays,
                "general path, slot {t} s"
            );
        }
    }

    #[test]
    fn a_faster_worker_drains_the_same_queue_sooner() {
        // Two workers hold the same prefix with the same prefill queued; one has been measured
        // at twice the other's rate: its queue is half the seconds.
        let m = model(2);
        let p = PolicyConfig::default();
        let (reqs, tokens, matched) = ([0u32; 2], [3000u32; 2], [50u32; 2]);
        for (rate, want) in [([30_000.0f32, 60_000.0], 1), ([60_000.0, 30_000.0], 0)] {
            let inp = Inputs {
                rate: &rate,
                slot: &[],
                util: &[],
                ..inputs(&m, &reqs, &tokens, &matched, 7)
            };
            assert_eq!(choose(&p, &inp), (want, Reason::PrefixHit));
        }
        // Unknown rates: the configured one (× weight), so equal here: the rendezvous order.
        let inp = inputs(&m, &reqs, &tokens, &matched, 7);
        let c = Cost::new(&p);
        let h = deepest_held(&inp);
        assert_eq!(seconds(&c, &inp, h, 0.0, 0), seconds(&c, &inp, h, 0.0, 1));
        // One not learned yet counts at the learned one's rate, not the configured one: a worker
        // that was never busy is neither favoured nor shunned.
        let rate = [0.0f32, 60_000.0];
        let inp = Inputs {
            rate: &rate,
            ..inputs(&m, &reqs, &tokens, &matched, 7)
        };
        let c = Cost::new(&p).with_fleet_rate(&rate, [1.0; 2].into_iter());
        assert_eq!(seconds(&c, &inp, h, 0.0, 0), seconds(&c, &inp, h, 0.0, 1));
        let top = (0..2).max_by_key(|&i| mix(inp.affinity, m.workers[i].id));
        assert_eq!(Some(choose(&p, &inp).0), top, "a tie: the rendezvous order");
    }

    #[test]
    fn chat_and_completions_forms_of_a_follow_up_get_the_same_decision() {
        // The same conversation as a chat (opening message 10 blocks, its own rendezvous keys)
        // and as one completions text (no message structure, keys of its first blocks): only
        // what the workers hold and their loads enter the cost, so the choice is the same.
        let m = model(8);
        let p = PolicyConfig::default();
        let cap = [32u32; 8];
        let fleets: [([u32; 8], [u32; 8], [u32; 8]); 6] = [
            (
                [60, 10, 10, 10, 0, 0, 0, 0],
                [6000, 0, 0, 0, 0, 0, 0, 0],
                [4, 1, 1, 1, 1, 1, 1, 1],
            ),
            (
                [95, 10, 10, 10, 0, 0, 0, 0],
                [6000, 0, 0, 0, 0, 0, 0, 0],
                [4, 1, 1, 1, 1, 1, 1, 1],
            ),
            (
                [30, 30, 10, 10, 10, 10, 10, 10],
                [0, 900, 0, 0, 0, 0, 0, 0],
                [2, 0, 1, 1, 1, 1, 1, 1],
            ),
            (
                [30, 0, 0, 0, 0, 0, 0, 0],
                [2000, 0, 0, 0, 0, 0, 0, 0],
                [1; 8],
            ),
            ([80, 0, 0, 0, 0, 0, 0, 0], [0; 8], [20, 0, 0, 0, 0, 0, 0, 0]),
            (
                [10, 10, 10, 10, 10, 10, 10, 70],
                [0, 0, 0, 0, 0, 0, 0, 30_000],
                [1; 8],
            ),
        ];
        for (matched, tokens, reqs) in &fleets {
            let completions = Inputs {
                prompt_tokens: 4000,
                capacity: &cap,
                ..inputs(&m, reqs, tokens, matched, 11)
            };
            let chat = Inputs {
                head_blocks: 10,
                affinity: 0xC4A7,
                group: 0x5EED,
                ..completions
            };
            let (a, b) = (choose(&p, &chat), choose(&p, &completions));
            // Equal seconds; between workers exactly as cheap, each form's own rendezvous key.
            let c = Cost::new(&p);
            let h = deepest_held(&chat);
            assert_eq!(a.1, b.1, "{matched:?}");
            assert_eq!(
                seconds(&c, &chat, h, 0.0, a.0),
                seconds(&c, &completions, h, 0.0, b.0),
                "{matched:?}"
            );
        }
    }

    /// A 6000-token prompt repeated whole (98 of 100 blocks held by worker 0, behind a queue;
    /// the rest of the fleet idle): one user's prompt stays, one that three other requests
    /// lately reached is copied to an idle worker (`sharers.rs`, the shared copy in `cost.rs`).
    #[test]
    fn a_prompt_other_requests_repeat_is_copied_out_of_a_queue_one_users_prompt_is_not() {
        let m = model(8);
        let p = PolicyConfig::default();
        let queued = (9_375.0 / p.cost.queue_weight) as u32;
        let tokens = [queued, 0, 0, 0, 0, 0, 0, 0];
        let reqs = [2u32, 0, 0, 0, 0, 0, 0, 0];
        let cap = [16u32; 8];
        let matched = [98u32, 0, 0, 0, 0, 0, 0, 0];
        for (sharers, stays) in [(0.0f32, true), (3.0, false)] {
            let inp = Inputs {
                prompt_tokens: 6_000,
                capacity: &cap,
                sharers,
                ..inputs(&m, &reqs, &tokens, &matched, 7)
            };
            let (w, r) = choose(&p, &inp);
            assert_eq!(w == 0, stays, "sharers {sharers}: {w} {r:?}");
            let mut g = model(8);
            g.uniform_weights = false;
            let general = Inputs { model: &g, ..inp };
            assert_eq!(choose(&p, &general).0, w, "general path, sharers {sharers}");
        }
    }

    #[test]
    fn equally_deep_prefill_workers_share_a_prompt_group_by_its_opening_not_by_load() {
        // PD prefill workers; plain workers holding the same: the cost alone, the less loaded.
        let plain = model(2);
        let p = PolicyConfig::default();
        crate::policy::shared_tests::equally_deep_holders_share_a_prompt_group(
            choose,
            &pd_model(2),
            &|inp, fav| {
                let inp3 = Inputs {
                    model: &plain,
                    ..*inp
                };
                assert_eq!(choose(&p, &inp3), (1 - fav, Reason::PrefixHit));
            },
        );
    }
}
