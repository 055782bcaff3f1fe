//! The cache-aware policy: cache reuse weighed against load, with a hard load bound.
//!
//! For a prompt of `P` estimated tokens in `B` blocks:
//!
//! * **Load bound.** Worker `i` (weight `w_i`, total weight `W`) is eligible only while
//!   `reqs_i + 1 <= (1 + load_eps) * (R + 1) * w_i / W + s_i`, where `R` is the model's total
//!   in-flight requests, and the slack `s_i` is 1 for a worker holding none of the prompt and
//!   grows for a holder with the tokens it holds, up to `load_slack` (default 3) at
//!   `slack_full_tokens` (default 8192). A hot prefix therefore spills to a second worker instead
//!   of piling onto one (bounded-load consistent hashing), while at low concurrency a holder may
//!   take a few requests more before its cached prefix is recomputed elsewhere.
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
//! * **Some worker holds a prefix**: the eligible worker with the lowest expected cost wins,
//!   `cost_i = (P * (B - matched_i) / B + load_weight * tokens_i + request_cost_tokens * reqs_i) / w_i`
//!   — the prefill it would still have to do plus the work already queued on it (in-flight
//!   uncached prompt tokens and a per-request decode charge). A worker holding this
//!   conversation's own history ([`history_depth`]) is charged no queued tokens: its queue
//!   delays one turn, leaving moves the conversation for good ([`queued_tokens_cost`]).
//!   Ties go to the rendezvous order.
//!   Workers holding as much of the prompt as the cheapest one, and costing at most the tokens it
//!   holds more, share the prompt by rendezvous on its opening blocks ([`stick`]): a prompt group
//!   that was copied to a second worker keeps using one copy instead of alternating with the load.
//! * **A new conversation on a fleet prefix.** When the prompt's opening message (a system
//!   prompt) is followed by more, nobody holds anything past that opening, and at least
//!   `fleet_prefix_share` (0.75) of the workers hold some of it (or all of the index's
//!   `HOLDERS` slots for it are taken, in fleets larger than 8), the opening is a fleet-wide
//!   prefix that every worker will end up caching once; ranking by it would stack every new
//!   conversation on its first holders, whose caches then evict each other's histories while
//!   the rest of the fleet idles. Such a request goes to the least busy eligible worker (decayed
//!   in-flight average, `busy.rs`, plus the requests in flight now, per unit weight; load bound with slack 1), rendezvous among
//!   those within `busy_tolerance` of the least busy so that threads and replicas reading the
//!   same averages spread rather than herd. Prompts whose opening is held by fewer workers (a
//!   document or a per-tenant prompt) keep the cost rule above, and a conversation's later
//!   turns, whose history some worker holds, are cost-ranked as before. A prompt without
//!   message structure has no opening message: the longest prefix held of it stands in, counted
//!   over the workers holding exactly that much ([`is_fleet_prefix`]).

use super::shared::{
    by_capacity, fleet_holders, follow_sibling, hrw, reason_of, room, slack_for, total_reqs,
    two_choices, under_bound, MIN_FLEET_HOLDERS,
};
use super::{least_loaded, mix, uncached_tokens, Inputs, Policy, Reason};
use crate::config::PolicyConfig;

/// The policy (stateless: everything it needs is in [`Inputs`]).
pub struct CacheAware;

impl Policy for CacheAware {
    fn choose(&mut self, p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
        choose(p, inp)
    }
    fn uses_index(&self) -> bool {
        true
    }
}

/// The load bound's absolute slack for worker `i`: 1 for a worker holding none of the prompt (a
/// slow or busy worker stops receiving *new* prefixes at low concurrency); for a holder it grows
/// with the prompt tokens it holds, up to `load_slack` at `slack_full_tokens`: queueing a few
/// requests more is worth it to reuse a 32k-token document, not to reuse a 3k-token system prompt
/// that every worker can cache once (holders of a shared head then spill new conversations to
/// the rest of the fleet instead of stacking them).
fn holder_slack(p: &PolicyConfig, inp: &Inputs, history: Option<u32>, i: usize) -> f64 {
    if inp.matched.get(i).copied().unwrap_or(0) == 0 {
        return 1.0;
    }
    // A worker holding this conversation's own history keeps it through the full slack: the
    // next turn of a tool loop arrives while other replicas may still count the previous turn as
    // in flight (until their next poll).
    if owns_history(inp, history, i) {
        return p.load_slack;
    }
    let held = inp.prompt_tokens.saturating_sub(uncached_tokens(inp, i));
    slack_for(p, inp, held)
}

/// The depth (blocks) past which a worker holds this conversation's own history, not a prefix
/// other prompts share. A chat prompt of three or more messages: past its opening two
/// (`Inputs::conversation_blocks`); of two, none (its opening message is shared by design). A
/// prompt without message structure (a completions text, one chat message) says nothing of what
/// is shared, so its holders and its shape say it: a follow-up turn carries the conversation so
/// far, most of its prompt, and only its holder (or a second copy, made when a turn found the
/// holder saturated) has it. So when at most two workers hold the deepest match, that match is
/// at least half the prompt and the prompt goes on past it, the history is what those workers
/// hold past the deepest match of the others (a system prompt the fleet caches). A new prompt
/// sharing an opening with an earlier one, and a prefix three workers hold, are shared.
/// `None`: no history known.
fn history_depth(inp: &Inputs) -> Option<u32> {
    if inp.conversation_blocks > 0 {
        return Some(inp.conversation_blocks);
    }
    if inp.head_blocks > 0
        || inp.model.pd.is_some()
        || inp.deepest == 0
        || inp.deepest >= inp.total_blocks
    {
        return None;
    }
    let (mut deepest, mut shared) = (0usize, 0u32);
    for &m in inp.matched {
        if m == inp.deepest {
            deepest += 1;
        } else {
            shared = shared.max(m);
        }
    }
    // A follow-up turn carries the conversation so far: most of its prompt.
    let most = 2 * u64::from(inp.deepest) >= u64::from(inp.total_blocks);
    (deepest <= MAX_HISTORY_HOLDERS && most).then_some(shared)
}

/// Most holders of a conversation's own history without message structure: its holder and one
/// copy (a turn that once found its holder saturated). Three is a shared prefix, as for a fleet
/// prefix ([`MIN_FLEET_HOLDERS`]).
const MAX_HISTORY_HOLDERS: usize = MIN_FLEET_HOLDERS - 1;

/// Whether worker `i` holds this conversation's own history ([`history_depth`]).
fn owns_history(inp: &Inputs, history: Option<u32>, i: usize) -> bool {
    history.is_some_and(|d| inp.matched.get(i).copied().unwrap_or(0) > d)
}

/// The queued prefill worker `i` is charged for: `load_weight` per queued token, none for a
/// worker holding this conversation's own history. A queue delays this turn once and drains at
/// the worker's prefill rate, while leaving moves the conversation: its history is recomputed
/// (prefill added to the fleet, a second copy in its KV) and its next turns follow the new
/// copy. Such a holder is left for its running requests (the per-request term), when it cannot
/// start the request (at the `max_running_requests` it reports), or, capacity unknown, beyond the
/// load bound; never for other prompts' prefill. PD prefill workers keep the charge.
fn queued_tokens_cost(p: &PolicyConfig, inp: &Inputs, history: Option<u32>, i: usize) -> f64 {
    // A PD prefill worker does nothing but prefill: its queue is the whole of its load.
    if inp.model.pd.is_none() && owns_history(inp, history, i) {
        return 0.0;
    }
    p.load_weight * f64::from(inp.tokens.get(i).copied().unwrap_or(0))
}

/// Eligibility: [`by_capacity`], else the load bound with [`holder_slack`].
fn cap_ok(p: &PolicyConfig, inp: &Inputs, history: Option<u32>, total: f64, i: usize) -> bool {
    by_capacity(inp, i)
        .unwrap_or_else(|| under_bound(p, inp, total, i, holder_slack(p, inp, history, i)))
}

/// The cache-aware choice: `(worker index, reason)`. `model.workers` must be non-empty.
///
/// Equal weights (the common fleet) take an integer fast path; weighted fleets the general one.
/// Both make the same choice (tested), so replicas agree whichever path they take.
pub fn choose(p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
    if let Some(w) = follow_sibling(p, inp) {
        return (w, Reason::HashAffinity);
    }
    if is_fleet_prefix(p, inp) {
        if let Some(w) = choose_least_busy(p, inp) {
            return (w, reason_of(inp, w, w));
        }
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

/// A new conversation on a fleet prefix (module docs).
fn is_fleet_prefix(p: &PolicyConfig, inp: &Inputs) -> bool {
    // The opening: the first message when the prompt has two or more, and nobody holds past it;
    // a prompt without message structure (a completions text, one chat message) has none to go
    // by, so what the fleet holds of it is the candidate, provided the prompt goes on past it (a
    // repeated prompt is a hit). PD prefill workers keep the message rule only (their siblings
    // follow the opening message).
    let unstructured = inp.head_blocks == 0 && inp.model.pd.is_none();
    let opened = if unstructured {
        inp.deepest < inp.total_blocks
    } else {
        inp.head_blocks > 0 && inp.deepest <= inp.head_blocks
    };
    if p.fleet_prefix_share <= 0.0 || inp.deepest == 0 || !opened {
        return false;
    }
    // The index keeps at most `HOLDERS` holders per checkpoint: in a larger fleet a prefix
    // whose holder slots are all taken counts as held widely enough. Without an opening message
    // only the holders of the whole match count: one worker holding a conversation's history
    // and three holding its first block are no fleet prefix.
    let holders = inp
        .matched
        .iter()
        .filter(|&&m| m > 0 && (!unstructured || m == inp.deepest))
        .count();
    // At least three, whatever the fleet's size: one holder has never spilled, and two may be a
    // prompt group plus one spill (a sibling routed before the first answer was indexed); with
    // two workers that made every spilled group "fleet-wide" and spread it over both caches
    // for good (`load/pd_compare --sizes 2`: 72-75% prefill hit rate, 78-79% with three).
    fleet_holders(p, inp.model.workers.len()).is_some_and(|need| holders >= need)
}

/// The least busy worker under the load bound with slack 1, rendezvous among those within
/// `busy_tolerance` of it; `None` when every worker is at its bound.
fn choose_least_busy(p: &PolicyConfig, inp: &Inputs) -> Option<usize> {
    let model = inp.model;
    let total = total_reqs(inp) as f64;
    // The decayed average plus the requests in flight now: the average alone moves slowly
    // (`busy_window_ms`), so a worker that just took new conversations would keep looking idle
    // and take every conversation starting in the next seconds.
    let busy = |i: usize| {
        let now = f64::from(inp.reqs.get(i).copied().unwrap_or(0));
        (f64::from(inp.busy.get(i).copied().unwrap_or(0.0)) + now) / model.workers[i].weight
    };
    let eligible = |i: usize| room(inp, i) != Some(false) && under_bound(p, inp, total, i, 1.0);
    let n = model.workers.len();
    let least = (0..n)
        .filter(|&i| eligible(i))
        .map(busy)
        .fold(f64::INFINITY, f64::min);
    if !least.is_finite() {
        return None;
    }
    let mut best: Option<(usize, f64)> = None;
    for i in 0..n {
        if !eligible(i) || busy(i) > least + p.busy_tolerance {
            continue;
        }
        let score = hrw(model, i, inp.affinity);
        if best.is_none_or(|(_, s)| score > s) {
            best = Some((i, score));
        }
    }
    best.map(|(i, _)| i)
}

/// The per-request scan over every worker, so its cost per worker is what keeps a decision
/// nearly flat from 4 to 256 workers: the load bound becomes two integer thresholds computed
/// once, rendezvous scores stay integers, and only holders pay the uncached-token division.
fn choose_uniform(p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
    let model = inp.model;
    let n = model.workers.len();
    let total = total_reqs(inp);
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
        .zip(inp.reqs.iter().zip(inp.tokens.iter()))
        .zip(inp.matched.iter())
        .enumerate();
    if inp.deepest == 0 {
        // Nobody holds the prompt (so every cap is `cap_other`): the eligible worker with the
        // highest rendezvous score, and the overall top to tell affinity from spill.
        let (mut top, mut top_score) = (0usize, 0u64);
        // The two highest-scoring eligible workers.
        let mut best: Option<(usize, u64)> = None;
        let mut second: Option<(usize, u64)> = None;
        for (i, ((w, (&r, _)), _)) in rows {
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
    // Someone holds a prefix: lowest cost; rendezvous scores only to break exact ties.
    let prompt = f64::from(inp.prompt_tokens);
    let history = history_depth(inp);
    let cost_of = |i: usize| -> Option<f64> {
        let (r, m) = (inp.reqs[i], inp.matched[i]);
        let eligible = by_capacity(inp, i).unwrap_or_else(|| {
            let cap = if m > 0 {
                cap(holder_slack(p, inp, history, i))
            } else {
                cap_other
            };
            u64::from(r) < cap
        });
        if !eligible {
            return None;
        }
        let uncached = if m == 0 {
            prompt
        } else {
            f64::from(uncached_tokens(inp, i))
        };
        Some(
            uncached
                + queued_tokens_cost(p, inp, history, i)
                + p.request_cost_tokens * f64::from(r),
        )
    };
    let mut best: Option<(usize, f64, u32)> = None;
    for (i, ((w, _), _)) in rows {
        let Some(cost) = cost_of(i) else {
            continue;
        };
        let better = match best {
            None => true,
            Some((_, c, b)) => {
                cost < c || (cost == c && mix(inp.affinity, w.id) > mix(inp.affinity, b))
            }
        };
        if better {
            best = Some((i, cost, w.id));
        }
    }
    match best {
        Some((chosen, cost, _)) => {
            let chosen = stick(inp, chosen, cost, cost_of, |i| {
                mix(inp.group, model.workers[i].id) as f64
            });
            (chosen, reason_of(inp, chosen, 0))
        }
        None => (least_loaded(inp.reqs, inp.tokens, 0), Reason::LoadSpill),
    }
}

/// Among the workers holding as much of the prompt as `chosen` (the cheapest), those whose cost
/// is within the tokens `chosen` holds of its cost share the prompt by rendezvous on its
/// opening (`Inputs::group`), so every request of a prompt group returns to one copy of its
/// prefix instead of alternating between copies with the load, which doubles the group's cache
/// footprint for good once it has spilled (measured with `load/pd_compare --sizes 2`: 5-8 of 32
/// groups alternating between both prefill workers). A copy is abandoned only when its worker's
/// queue costs more than recomputing the prefix elsewhere; the load bound still applies.
fn stick(
    inp: &Inputs,
    chosen: usize,
    chosen_cost: f64,
    cost_of: impl Fn(usize) -> Option<f64>,
    score: impl Fn(usize) -> f64,
) -> usize {
    let depth = inp.matched.get(chosen).copied().unwrap_or(0);
    if depth == 0 || inp.group == 0 {
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
    let held = f64::from(
        inp.prompt_tokens
            .saturating_sub(uncached_tokens(inp, chosen)),
    );
    let w = inp.model.workers[chosen].weight;
    let limit = chosen_cost + held / w;
    let mut best = (chosen, score(chosen));
    for i in 0..inp.model.workers.len() {
        if i == chosen || inp.matched.get(i).copied().unwrap_or(0) != depth {
            continue;
        }
        let Some(c) = cost_of(i) else {
            continue;
        };
        let s = score(i);
        if c <= limit && s > best.1 {
            best = (i, s);
        }
    }
    best.0
}

/// Any weights; also the reference the uniform fast path is tested against.
fn choose_general(p: &PolicyConfig, inp: &Inputs) -> (usize, Reason) {
    let model = inp.model;
    let n = model.workers.len();
    let total = total_reqs(inp) as f64;
    let mut top = 0usize; // rendezvous top overall
    let mut top_score = f64::MIN;
    let mut best: Option<(usize, f64, f64)> = None; // (index, cost, hrw)
    let mut second: Option<(usize, f64)> = None; // runner-up by rendezvous (`deepest == 0`)
                                                 // Worker `i`'s cost per unit weight, `None` over the load bound.
    let history = history_depth(inp);
    let cost_of = |i: usize| -> Option<f64> {
        if !cap_ok(p, inp, history, total, i) {
            return None;
        }
        let w = model.workers[i].weight;
        let r = f64::from(inp.reqs.get(i).copied().unwrap_or(0));
        Some(
            (f64::from(uncached_tokens(inp, i))
                + queued_tokens_cost(p, inp, history, i)
                + p.request_cost_tokens * r)
                / w,
        )
    };
    for i in 0..n {
        let score = hrw(model, i, inp.affinity);
        if score > top_score {
            top_score = score;
            top = i;
        }
        let cost = if inp.deepest == 0 {
            if !cap_ok(p, inp, None, total, i) {
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
    let chosen = stick(inp, chosen, cost, cost_of, |i| hrw(model, i, inp.group));
    (chosen, reason_of(inp, chosen, top))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::shared_tests::{inputs, model, pd_model, shared_policy_tests};

    shared_policy_tests!(choose, choose_uniform, choose_general);

    #[test]
    fn holder_slack_grows_with_the_tokens_held() {
        let p = PolicyConfig::default();
        let history = |inp: &Inputs| {
            // A holder of the conversation's own history (past its opening messages) gets it too.
            let turn = Inputs {
                conversation_blocks: 80,
                ..*inp
            };
            assert_eq!(choose(&p, &turn), (0, Reason::PrefixHit));
            let opening = Inputs {
                conversation_blocks: 90,
                ..*inp
            };
            assert_ne!(
                choose(&p, &opening).0,
                0,
                "holding only the opening is not history"
            );
        };
        crate::policy::shared_tests::holder_slack_grows_with_the_tokens_held(choose, &history);
    }

    #[test]
    fn new_conversations_on_a_fleet_prefix_go_to_the_least_busy() {
        let m = model(4);
        let p = PolicyConfig::default();
        let (reqs, z) = ([1u32, 1, 0, 0], [0u32; 4]);
        // Workers 0, 1 and 2 hold the 10-block opening (3 of 4: fleet_prefix_share 0.75);
        // nobody holds more.
        let matched = [10u32, 10, 10, 0];
        let busy = [2.0f32, 1.5, 0.0, 0.2];
        let mut inp = inputs(&m, &reqs, &z, &matched, 1);
        inp.head_blocks = 10;
        inp.busy = &busy;
        let mut seen = [0usize; 4];
        for key in 0..64 {
            inp.affinity = key;
            let (w, reason) = choose(&p, &inp);
            assert!(w == 2 || w == 3, "key {key}: {w}");
            let want = if w == 2 {
                Reason::PrefixHit
            } else {
                Reason::LoadSpill
            };
            assert_eq!(reason, want);
            seen[w] += 1;
        }
        assert!(
            seen[2] > 8 && seen[3] > 8,
            "ties spread by rendezvous: {seen:?}"
        );
        // Tolerance 0: only the least busy.
        let tight = PolicyConfig {
            busy_tolerance: 0.0,
            ..PolicyConfig::default()
        };
        assert_eq!(choose(&tight, &inp).0, 2);
        // What is in flight now counts too: worker 2 just took a request, worker 3 did not.
        let now = [1u32, 1, 1, 0];
        let mut fresh = inputs(&m, &now, &z, &matched, 1);
        fresh.head_blocks = 10;
        fresh.busy = &busy;
        assert_eq!(choose(&tight, &fresh).0, 3);
        // Off: a holder's cached opening wins again, never the idle non-holder.
        let off = PolicyConfig {
            fleet_prefix_share: 0.0,
            ..PolicyConfig::default()
        };
        for key in 0..64 {
            fresh.affinity = key;
            assert_ne!(choose(&off, &fresh).0, 3);
        }
        // Held by 2 of 4 workers: not a fleet prefix (a group that spilled once).
        let two = [10u32, 10, 0, 0];
        let mut doc = inputs(&m, &reqs, &z, &two, 1);
        doc.head_blocks = 10;
        doc.busy = &busy;
        let (w, reason) = choose(&p, &doc);
        assert!(w < 2 && reason == Reason::PrefixHit, "{w} {reason:?}");
        // A worker holds the conversation past its opening: its own history wins.
        let own = [40u32, 10, 10, 0];
        let mut turn = inputs(&m, &reqs, &z, &own, 1);
        turn.head_blocks = 10;
        turn.busy = &busy;
        assert_eq!(choose(&p, &turn), (0, Reason::PrefixHit));
        // No opening message (a single-message prompt): what the fleet holds of it is the
        // opening; held at two depths (a conversation's history on worker 0), the cost rule.
        let mut single = inputs(&m, &reqs, &z, &own, 1);
        single.busy = &busy;
        assert_eq!(choose(&p, &single), (0, Reason::PrefixHit));
    }

    #[test]
    fn a_prefix_every_index_slot_holds_spreads_prompts_without_message_structure() {
        // A completions text (no messages) whose first 2 blocks (a system prompt) are held by the
        // four workers the index lists (all of its slots) in an 8-worker fleet; nobody holds more.
        // Ranked by the prefix, every new prompt would go to those four while the rest idle.
        let m = model(8);
        let p = PolicyConfig::default();
        let (reqs, z) = ([2u32, 2, 2, 2, 0, 0, 0, 0], [0u32; 8]);
        let matched = [2u32, 2, 2, 2, 0, 0, 0, 0];
        let mut seen = [0usize; 8];
        for key in 0..64 {
            let inp = inputs(&m, &reqs, &z, &matched, key);
            assert_eq!(inp.head_blocks, 0);
            let (w, _) = choose(&p, &inp);
            seen[w] += 1;
        }
        assert_eq!(seen[..4].iter().sum::<usize>(), 0, "{seen:?}");
        assert!(seen[4..].iter().all(|&n| n > 4), "{seen:?}");
        // Three of eight slots: not known to be fleet-wide, the cost rule keeps its holders.
        let three = [2u32, 2, 2, 0, 0, 0, 0, 0];
        let inp = inputs(&m, &reqs, &z, &three, 5);
        assert!(!is_fleet_prefix(&p, &inp));
        // The whole prompt held (a repeated prompt), or a PD model: never.
        let mut whole = inputs(&m, &reqs, &z, &matched, 5);
        whole.total_blocks = 2;
        assert!(!is_fleet_prefix(&p, &whole));
        let pd = pd_model(8);
        let inp = inputs(&pd, &reqs, &z, &matched, 5);
        assert!(!is_fleet_prefix(&p, &inp));
    }

    #[test]
    fn fleet_prefix_respects_the_load_bound() {
        let m = model(4);
        let p = PolicyConfig::default();
        // The idle-looking worker 3 has 4 requests right now: share 2*(5+1)/4 = 3, cap 4.
        let (reqs, z) = ([1u32, 0, 0, 4], [0u32; 4]);
        let matched = [10u32, 10, 10, 0];
        let busy = [3.0f32, 2.0, 2.2, 0.0];
        let mut inp = inputs(&m, &reqs, &z, &matched, 9);
        inp.head_blocks = 10;
        inp.busy = &busy;
        let (w, _) = choose(&p, &inp);
        assert!(w == 1 || w == 2, "{w}");
    }

    #[test]
    fn a_conversation_waits_out_its_holders_prefill_queue_and_leaves_only_a_full_holder() {
        let m = model(8);
        let p = PolicyConfig::default();
        // A follow-up of 4000 tokens (100 blocks): its first 10 blocks a system prompt that the
        // index lists four workers for (all of its slots), the next 50 this conversation's own
        // turns, held by worker 0 alone, which has 6000 tokens of other prompts queued.
        let tokens = [6000u32, 0, 0, 0, 0, 0, 0, 0];
        let reqs = [4u32, 1, 1, 1, 1, 1, 1, 1];
        let cap = [32u32; 8];
        // The fleet above asked for a 4000-token prompt with these matches.
        let ask = |matched| Inputs {
            prompt_tokens: 4000,
            capacity: &cap,
            ..inputs(&m, &reqs, &tokens, matched, 7)
        };
        let matched = [60u32, 10, 10, 10, 0, 0, 0, 0];
        let mut inp = ask(&matched);
        // Without message structure: the history is what worker 0 holds past the others.
        assert_eq!(history_depth(&inp), Some(10));
        assert_eq!(choose(&p, &inp), (0, Reason::PrefixHit));
        // The same blocks as a prompt group's shared document (two messages: nothing is this
        // conversation's own): the queue costs more than recomputing 2000 tokens elsewhere.
        inp.head_blocks = 60;
        assert_eq!(history_depth(&inp), None);
        assert_ne!(choose(&p, &inp).0, 0);
        // A chat conversation of three or more messages: the same as the unstructured one.
        inp.head_blocks = 10;
        inp.conversation_blocks = 20;
        assert_eq!(choose(&p, &inp), (0, Reason::PrefixHit));
        // Less than half of the prompt held: a new prompt sharing an opening, not a follow-up.
        let short = [30u32, 10, 10, 10, 0, 0, 0, 0];
        let new = ask(&short);
        assert_eq!(history_depth(&new), None);
        assert_ne!(choose(&p, &new).0, 0);
        // No system prompt, worker 0 alone holds the first 60 blocks: its history.
        let alone = [60u32, 0, 0, 0, 0, 0, 0, 0];
        let first = ask(&alone);
        assert_eq!(history_depth(&first), Some(0));
        assert_eq!(choose(&p, &first), (0, Reason::PrefixHit));
        // Held by three workers: a shared prompt, not one conversation; it leaves the queue.
        let three = [60u32, 60, 60, 10, 10, 0, 0, 0];
        let shared = ask(&three);
        assert_eq!(history_depth(&shared), None);
        assert_ne!(choose(&p, &shared).0, 0);
        // The whole prompt held (a repeated prompt): shared too.
        let mut again = inputs(&m, &reqs, &tokens, &alone, 7);
        again.total_blocks = 60;
        assert_eq!(history_depth(&again), None);
        // A holder at the capacity it reports cannot start the turn: it is left.
        let full = [4u32, 32, 32, 32, 32, 32, 32, 32];
        inp.capacity = &full;
        inp.conversation_blocks = 0;
        inp.head_blocks = 0;
        assert_eq!(choose(&p, &inp).1, Reason::LoadSpill);
        // The general (weighted) path agrees.
        let mut w = model(8);
        w.uniform_weights = false;
        let inp = Inputs {
            model: &w,
            ..ask(&matched)
        };
        assert_eq!(choose(&p, &inp), (0, Reason::PrefixHit));
    }

    #[test]
    fn equally_deep_holders_share_a_prompt_group_by_its_opening_not_by_load() {
        crate::policy::shared_tests::equally_deep_holders_share_a_prompt_group(
            choose,
            &model(2),
            &|_, _| {},
        );
    }

    #[test]
    fn two_holders_are_not_a_fleet_prefix_even_in_a_two_worker_fleet() {
        let m = model(2);
        let p = PolicyConfig::default();
        let z = [0u32; 2];
        let matched = [10u32, 10];
        let inp = Inputs {
            head_blocks: 10,
            ..inputs(&m, &z, &z, &matched, 3)
        };
        assert!(!is_fleet_prefix(&p, &inp));
        let m3 = model(3);
        let z3 = [0u32; 3];
        let matched3 = [10u32, 10, 10];
        let inp3 = Inputs {
            head_blocks: 10,
            ..inputs(&m3, &z3, &z3, &matched3, 3)
        };
        assert!(is_fleet_prefix(&p, &inp3));
    }
}
