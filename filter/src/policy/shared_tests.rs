//! Tests of what the two load-bounded policies ([`cache_aware`](super::cache_aware) and
//! [`cost_aware`](super::cost_aware)) share: the hard load bound and a holder's slack, the
//! rendezvous placement of prompts nobody holds (its stability as the fleet changes, weights,
//! footprints, siblings), PD prefill workers, and the integer fast path agreeing with the
//! general scan. Each takes the policy's `choose`; [`shared_policy_tests!`] makes them `#[test]`s
//! of the policy's own test module, so a failure names the policy. Also the models and
//! [`Inputs`] the policies' unit tests build.

use super::{Inputs, Reason};
use crate::config::{Config, Model, PolicyConfig};

/// A policy's choice among a model's workers (`cache_aware::choose`, `cost_aware::choose`, or
/// either's fast path or general scan).
pub type Choose = fn(&PolicyConfig, &Inputs) -> (usize, Reason);

/// A plain model of `n` equal-weight workers `w0`..
pub fn model(n: usize) -> Model {
    let names: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
    let json = format!(
        "{{\"models\":{{\"m\":{{\"workers\":[{}]}}}}}}",
        names.join(",")
    );
    Config::from_json(json.as_bytes()).unwrap().models.remove(0)
}

/// A PD model with `n` prefill workers (the model whose workers the prefill choice ranks).
pub fn pd_model(n: usize) -> Model {
    let prefill: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"cluster":"p{i}","bootstrap_host":"h"}}"#))
        .collect();
    let json = format!(
        r#"{{"models":{{"m":{{"prefill":[{}],"decode":["d0"]}}}}}}"#,
        prefill.join(",")
    );
    Config::from_json(json.as_bytes()).unwrap().models.remove(0)
}

/// One choice's inputs: no capacity, busy time, rate or footprint reported; a 1600-token,
/// 100-block prompt whose rendezvous and group keys are `key`.
pub fn inputs<'a>(
    m: &'a Model,
    reqs: &'a [u32],
    tokens: &'a [u32],
    matched: &'a [u32],
    key: u64,
) -> Inputs<'a> {
    Inputs {
        model: m,
        reqs,
        tokens,
        capacity: &[],
        matched,
        deepest: matched.iter().copied().max().unwrap_or(0),
        total_blocks: 100,
        prompt_tokens: 1600,
        affinity: key,
        group: key,
        conversation_blocks: 0,
        head_blocks: 0,
        busy: &[],
        rate: &[],
        slot: &[],
        util: &[],
        placed: &[],
        recent: None,
        sharers: 0.0,
    }
}

/// A holder's slack over the load bound grows with the tokens it holds; `also` checks more of
/// the 1600-token prompt whose short shared head the holder may not keep.
pub fn holder_slack_grows_with_the_tokens_held(choose: Choose, also: &dyn Fn(&Inputs)) {
    // 4 workers, 4 in flight on worker 0 (the holder), none elsewhere: share = 2*5/4 = 2.5.
    let m = model(4);
    let p = PolicyConfig::default();
    let reqs = [3, 0, 0, 0];
    let (z, matched) = ([0u32; 4], [90u32, 0, 0, 0]);
    let mut inp = inputs(&m, &reqs, &z, &matched, 1);
    // A chat prompt whose opening message (40 blocks) the holder holds, and more: shared.
    inp.head_blocks = 40;
    // 90% of a 1600-token prompt held: slack 1 + 2 * 1440/8192 = 1.35: cap floor(3.85) = 3,
    // 3 in flight + 1 > 3: the holder of a short shared head spills.
    assert_ne!(choose(&p, &inp).0, 0);
    // The same share of a 32k-token prompt: full slack 3, cap 5: it stays.
    inp.prompt_tokens = 32_768;
    assert_eq!(choose(&p, &inp), (0, Reason::PrefixHit));
    inp.prompt_tokens = 1600;
    also(&inp);
    // slack_full_tokens 0: every holder gets the full slack (the old rule).
    let old = PolicyConfig {
        slack_full_tokens: 0,
        ..PolicyConfig::default()
    };
    assert_eq!(choose(&old, &inp), (0, Reason::PrefixHit));
}

pub fn prefill_workers_keep_a_shorter_prefix_through_the_full_slack(choose: Choose) {
    // A PD model's prefill workers: in flight means queued prefills, mostly of cached
    // prompts, so a 2048-token system prompt keeps its holder where a plain worker spills.
    let pd = pd_model(4);
    let plain = model(4);
    let p = PolicyConfig::default();
    let reqs = [3, 0, 0, 0];
    let (z, matched) = ([0u32; 4], [94u32, 0, 0, 0]);
    for (m, stays) in [(&plain, false), (&pd, true)] {
        let mut inp = inputs(m, &reqs, &z, &matched, 1);
        inp.head_blocks = 94; // the system prompt
        inp.prompt_tokens = 2176; // 2048 held: slack 1.5 (cap 4) or 3 (cap 5)
        assert_eq!(choose(&p, &inp).0 == 0, stays, "pd {}", m.pd.is_some());
        // A sibling placed there moments ago (nothing indexed yet) follows it alike.
        let none = [0u32; 4];
        let mut inp = inputs(m, &reqs, &z, &none, 1);
        inp.prompt_tokens = 2176;
        inp.head_blocks = 94;
        inp.recent = Some(0);
        assert_eq!(
            choose(&p, &inp).0 == 0,
            stays,
            "follow, pd {}",
            m.pd.is_some()
        );
    }
}

pub fn prefix_holder_wins_when_lightly_loaded(choose: Choose) {
    let m = model(4);
    let p = PolicyConfig::default();
    let (w, r) = choose(
        &p,
        &inputs(&m, &[1, 1, 1, 1], &[100, 0, 0, 0], &[90, 0, 0, 0], 7),
    );
    assert_eq!((w, r), (0, Reason::PrefixHit));
    // The load bound is strict: with eps = 0.25 and one request in flight among 4 idle
    // workers, a second one on the same worker would exceed (1+eps)*mean+1, so it spills
    // (with load_slack 1; the default 3 lets a hot prefix take a few requests first).
    let strict = PolicyConfig {
        load_eps: 0.25,
        load_slack: 1.0,
        ..PolicyConfig::default()
    };
    let (w, r) = choose(
        &strict,
        &inputs(&m, &[1, 0, 0, 0], &[100, 0, 0, 0], &[90, 0, 0, 0], 7),
    );
    assert!(w != 0 && r == Reason::LoadSpill);
}

pub fn a_holder_busy_decoding_with_no_prefill_queue_keeps_its_conversation(choose: Choose) {
    let m = model(8);
    let p = PolicyConfig::default();
    // 20 requests decoding on the holder of 90% of a 4000-token conversation (queued prefill
    // 0), the rest of the fleet idle: far over the fleet-relative bound, well under the
    // holder's own capacity (32).
    let (reqs, tokens) = ([20, 0, 0, 0, 0, 0, 0, 0], [0u32; 8]);
    let (matched, cap) = ([90, 0, 0, 0, 0, 0, 0, 0], [32u32; 8]);
    let mut inp = inputs(&m, &reqs, &tokens, &matched, 7);
    inp.prompt_tokens = 4000;
    inp.capacity = &cap;
    assert_eq!(choose(&p, &inp), (0, Reason::PrefixHit));
    // The same holder without a reported capacity: the fleet-relative bound stands in.
    inp.capacity = &[];
    assert_eq!(choose(&p, &inp).1, Reason::LoadSpill);
    // The holder at its capacity (a new request would wait for a slot): it spills.
    let full = [20u32; 8];
    inp.capacity = &full;
    assert_eq!(choose(&p, &inp).1, Reason::LoadSpill);
}

pub fn a_deep_prefill_queue_loses_a_new_conversation_but_keeps_a_long_follow_up(choose: Choose) {
    let m = model(8);
    let p = PolicyConfig::default();
    // Worker 0 holds the shared opening (10% of a 4000-token prompt) with 6000 tokens of
    // prefill queued: recomputing 400 tokens elsewhere is cheaper than waiting.
    let tokens = vec![6000, 0, 0, 0, 0, 0, 0, 0];
    let reqs = vec![3, 1, 1, 1, 1, 1, 1, 1];
    let cap = vec![32u32; 8];
    let mut matched = vec![0u32; 8];
    matched[0] = 10;
    let mut inp = inputs(&m, &reqs, &tokens, &matched, 7);
    inp.prompt_tokens = 4000;
    inp.capacity = &cap;
    assert_ne!(choose(&p, &inp).0, 0, "new conversation leaves the queue");
    // A follow-up whose 40k-token history the holder holds (99%): waiting for 6000 queued
    // tokens beats recomputing 39.6k.
    matched[0] = 99;
    let mut inp = inputs(&m, &reqs, &tokens, &matched, 7);
    inp.prompt_tokens = 40_000;
    inp.capacity = &cap;
    assert_eq!(choose(&p, &inp), (0, Reason::PrefixHit));
}

pub fn heavy_queue_outweighs_small_reuse(choose: Choose) {
    let m = model(2);
    let p = PolicyConfig::default();
    // Worker 0 holds 10% of the prompt but has 20k tokens queued.
    let (w, r) = choose(&p, &inputs(&m, &[1, 0], &[20_000, 0], &[10, 0], 7));
    assert_eq!((w, r), (1, Reason::LoadSpill));
}

pub fn load_bound_holds_under_a_hot_prefix(choose: Choose) {
    // Every request carries the same hot prefix held by worker 0; requests never finish.
    for n in [2usize, 4, 8, 16] {
        let m = model(n);
        let p = PolicyConfig::default();
        let mut reqs = vec![0u32; n];
        let tokens = vec![0u32; n];
        let mut matched = vec![0u32; n];
        matched[0] = 100;
        for _ in 0..1000 {
            let (w, _) = choose(&p, &inputs(&m, &reqs, &tokens, &matched, 42));
            let total: u32 = reqs.iter().sum();
            let bound = (1.0 + p.load_eps) * f64::from(total + 1) / n as f64 + p.load_slack;
            assert!(f64::from(reqs[w] + 1) <= bound, "n={n} reqs={reqs:?}");
            reqs[w] += 1;
            matched[w] = 100; // the worker now holds the prefix too
        }
        let max = *reqs.iter().max().unwrap() as f64;
        let mean = 1000.0 / n as f64;
        assert!(
            max <= (1.0 + p.load_eps) * mean + p.load_slack,
            "n={n} reqs={reqs:?}"
        );
    }
}

pub fn rendezvous_moves_about_one_nth_when_a_worker_is_added(choose: Choose) {
    let m8 = model(8);
    let m9 = model(9);
    let p = PolicyConfig::default();
    let (z8, z9) = (vec![0u32; 8], vec![0u32; 9]);
    let mut moved = 0;
    let mut counts = [0u32; 8];
    let trials = 20_000u64;
    for k in 0..trials {
        let key = crate::blocks::digest(&k.to_le_bytes());
        let (a, ra) = choose(&p, &inputs(&m8, &z8, &z8, &z8, key));
        let (b, _) = choose(&p, &inputs(&m9, &z9, &z9, &z9, key));
        assert_eq!(ra, Reason::HashAffinity);
        counts[a] += 1;
        if m8.workers[a].cluster != m9.workers[b].cluster {
            moved += 1;
            assert_eq!(m9.workers[b].cluster, "w8", "only moves to the new worker");
        }
    }
    let frac = f64::from(moved) / trials as f64;
    assert!((frac - 1.0 / 9.0).abs() < 0.02, "moved {frac}");
    // And removing a worker moves only that worker's keys.
    let m7 = model(7);
    let z7 = vec![0u32; 7];
    for k in 0..2000u64 {
        let key = crate::blocks::digest(&k.to_le_bytes());
        let (a, _) = choose(&p, &inputs(&m8, &z8, &z8, &z8, key));
        let (b, _) = choose(&p, &inputs(&m7, &z7, &z7, &z7, key));
        if a != 7 {
            assert_eq!(a, b);
        }
    }
    let mean = trials as f64 / 8.0;
    assert!(
        counts
            .iter()
            .all(|&c| (f64::from(c) - mean).abs() < 0.1 * mean),
        "{counts:?}"
    );
}

pub fn weighted_rendezvous_follows_weights(choose: Choose) {
    let m = Config::from_json(br#"{"models":{"m":{"workers":["a",{"cluster":"b","weight":3}]}}}"#)
        .unwrap()
        .models
        .remove(0);
    let p = PolicyConfig::default();
    let z = [0u32; 2];
    let mut b = 0;
    for k in 0..8000u64 {
        let key = crate::blocks::digest(&k.to_le_bytes());
        if choose(&p, &inputs(&m, &z, &z, &z, key)).0 == 1 {
            b += 1;
        }
    }
    let frac = f64::from(b) / 8000.0;
    assert!((frac - 0.75).abs() < 0.03, "{frac}");
}

pub fn a_new_prompt_goes_to_the_runner_up_when_the_top_was_sent_a_prompt_more(choose: Choose) {
    let m = model(4);
    let p = PolicyConfig::default();
    let z = [0u32; 4];
    let (a, r) = choose(&p, &inputs(&m, &z, &z, &z, 42));
    assert_eq!(r, Reason::HashAffinity);
    // The runner-up: the top when `a` is over the load bound.
    let mut reqs = [0u32; 4];
    reqs[a] = 9;
    let (b, _) = choose(&p, &inputs(&m, &reqs, &z, &z, 42));
    assert_ne!(a, b);
    // `a` was sent 2000 uncached tokens more than `b` lately, more than this 1600-token
    // prompt: `b`, still reported as placement (not a spill).
    let mut placed = [0.0f32; 4];
    placed[a] = 2000.0;
    let skewed = Inputs {
        placed: &placed,
        ..inputs(&m, &z, &z, &z, 42)
    };
    assert_eq!(choose(&p, &skewed), (b, Reason::HashAffinity));
    // Within a prompt: the rendezvous top.
    placed[a] = 1500.0;
    let close = Inputs {
        placed: &placed,
        ..inputs(&m, &z, &z, &z, 42)
    };
    assert_eq!(choose(&p, &close), (a, Reason::HashAffinity));
    // Only the runner-up is compared: a worker with a large footprint stays eligible as the
    // runner-up of other prompts.
    placed[a] = 0.0;
    placed[b] = 1e9;
    let big = Inputs {
        placed: &placed,
        ..inputs(&m, &z, &z, &z, 42)
    };
    assert_eq!(choose(&p, &big).0, a);
}

pub fn a_sibling_follows_its_recent_placement_within_the_load_bound(choose: Choose) {
    let m = model(4);
    let p = PolicyConfig::default();
    let z = [0u32; 4];
    let (top, _) = choose(&p, &inputs(&m, &z, &z, &z, 5));
    let other = (top + 1) % 4;
    let inp = Inputs {
        recent: Some(other),
        ..inputs(&m, &z, &z, &z, 5)
    };
    assert_eq!(choose(&p, &inp), (other, Reason::HashAffinity));
    // Over the bound (4 of 4 in flight there): rendezvous as usual.
    let mut reqs = [0u32; 4];
    reqs[other] = 4;
    let busy = Inputs {
        reqs: &reqs,
        recent: Some(other),
        ..inputs(&m, &z, &z, &z, 5)
    };
    assert_eq!(choose(&p, &busy).0, top);
    // Only for prompts nobody holds.
    let matched = [3u32; 4];
    let held = Inputs {
        recent: Some(other),
        ..inputs(&m, &z, &z, &matched, 5)
    };
    assert_ne!(choose(&p, &held), (other, Reason::HashAffinity));
}

pub fn new_pd_prompts_avoid_a_prefill_worker_with_queued_prefills(choose: Choose) {
    let pd = pd_model(4);
    let plain = model(4);
    let p = PolicyConfig::default();
    let (z, placed) = ([0u32; 4], [0f32; 4]);
    for (m, moves) in [(&plain, false), (&pd, true)] {
        let idle = Inputs {
            placed: &placed,
            ..inputs(m, &z, &z, &z, 5)
        };
        let (top, _) = choose(&p, &idle);
        // Two prompts' worth of prefill queued on the top (one request in flight each way).
        let mut tokens = [0u32; 4];
        tokens[top] = 3200;
        let reqs = [1u32; 4];
        let busy = Inputs {
            tokens: &tokens,
            reqs: &reqs,
            placed: &placed,
            ..inputs(m, &z, &z, &z, 5)
        };
        let (w, reason) = choose(&p, &busy);
        assert_eq!(w != top, moves, "pd {}", m.pd.is_some());
        assert_eq!(reason, Reason::HashAffinity);
    }
}

/// Workers 0 and 1 of `m` hold the same 80 of 100 blocks (1280 of 1600 tokens); the group's
/// rendezvous favourite gets every request of the group while its extra queued work costs less
/// than the 1280 tokens it holds. `also` checks more of each group's inputs (favourite given).
pub fn equally_deep_holders_share_a_prompt_group(
    choose: Choose,
    m: &Model,
    also: &dyn Fn(&Inputs, usize),
) {
    let p = PolicyConfig::default();
    let matched = [80u32, 80];
    let z = [0u32; 2];
    for group in [7u64, 8, 9] {
        let fav = (0..2usize)
            .max_by_key(|&i| super::mix(group, m.workers[i].id))
            .unwrap();
        // The favourite has two more requests and 1000 more in-flight tokens: cost +628.
        let mut reqs = [0u32; 2];
        let mut tokens = [0u32; 2];
        reqs[fav] = 2;
        tokens[fav] = 1000;
        let inp = Inputs {
            reqs: &reqs,
            tokens: &tokens,
            ..inputs(m, &z, &z, &matched, 7)
        };
        // The group's opening message: a shared prompt, not one conversation's history.
        let inp = Inputs {
            group,
            head_blocks: 80,
            ..inp
        };
        assert_eq!(choose(&p, &inp), (fav, Reason::PrefixHit), "group {group}");
        // Queued work far above what it holds (12,000 tokens, > 1280 at any queue weight down to
        // a tenth): the other copy.
        let mut tokens2 = tokens;
        tokens2[fav] = 12_000;
        let inp2 = Inputs {
            tokens: &tokens2,
            ..inp
        };
        assert_eq!(choose(&p, &inp2), (1 - fav, Reason::PrefixHit));
        also(&inp, fav);
    }
}

/// The policy's fast path for equal-weight fleets (`uniform`) chooses as its general scan does,
/// over random loads, matches, capacities, learned rates, footprints and load-bound settings.
pub fn uniform_fast_path_matches_the_general_policy(uniform: Choose, general: Choose) {
    use proptest::prelude::*;
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: 2000,
        ..Default::default()
    });
    let models: Vec<Model> = [1usize, 2, 3, 4, 7, 16, 64]
        .iter()
        .map(|&n| model(n))
        .collect();
    let strat = (
        0usize..7,
        proptest::collection::vec(
            // Depths from a few values, so equally deep holders (`stick`) are common.
            (
                0u32..12,
                0u32..20_000,
                prop_oneof![Just(0u32), Just(40u32), Just(80u32), 1u32..100],
            ),
            64,
        ),
        any::<u64>(),
        prop_oneof![Just(0.0), Just(0.25), Just(1.0), 0.0f64..3.0],
        prop_oneof![Just(1.0), Just(3.0), 0.0f64..5.0],
        any::<bool>(),
        prop_oneof![Just(0u32), Just(8192u32), 1u32..4000],
        any::<bool>(),
        // Reported capacities: none, or per worker (0 = this one does not report).
        prop_oneof![Just(None), Just(Some(8u32)), (0u32..16).prop_map(Some)],
    );
    runner
        .run(
            &strat,
            |(mi, rows, key, eps, slack, miss, full, footprint, cap)| {
                let m = &models[mi];
                let n = m.workers.len();
                let reqs: Vec<u32> = rows[..n].iter().map(|r| r.0).collect();
                let tokens: Vec<u32> = rows[..n].iter().map(|r| r.1).collect();
                let matched: Vec<u32> = rows[..n]
                    .iter()
                    .map(|r| if miss { 0 } else { r.2 })
                    .collect();
                let p = PolicyConfig {
                    load_eps: eps,
                    load_slack: slack,
                    slack_full_tokens: full,
                    ..PolicyConfig::default()
                };
                // Footprints: the in-flight tokens reused as placed tokens (any spread will do).
                let placed: Vec<f32> = if footprint {
                    tokens.iter().map(|&t| t as f32).collect()
                } else {
                    Vec::new()
                };
                let capacity: Vec<u32> = match cap {
                    None => Vec::new(),
                    Some(c) => (0..n as u32).map(|i| (c + i * 5) % 17).collect(),
                };
                // Learned rates for some workers (0: the configured rate).
                let rates: Vec<f32> = tokens
                    .iter()
                    .map(|&t| if t % 3 == 0 { (t % 50_000) as f32 } else { 0.0 })
                    .collect();
                let mut inp = inputs(m, &reqs, &tokens, &matched, key);
                inp.rate = &rates;
                inp.placed = &placed;
                inp.capacity = &capacity;
                inp.group = key.rotate_left(17);
                prop_assert_eq!(uniform(&p, &inp), general(&p, &inp));
                Ok(())
            },
        )
        .unwrap();
}

/// `shared_policy_tests!(choose, choose_uniform, choose_general)` inside a policy's test module:
/// every shared test above that takes only the policy as a `#[test]` of that policy.
macro_rules! shared_policy_tests {
    ($choose:path, $uniform:path, $general:path) => {
        #[test]
        fn prefill_workers_keep_a_shorter_prefix_through_the_full_slack() {
            $crate::policy::shared_tests::prefill_workers_keep_a_shorter_prefix_through_the_full_slack($choose);
        }
        #[test]
        fn prefix_holder_wins_when_lightly_loaded() {
            $crate::policy::shared_tests::prefix_holder_wins_when_lightly_loaded($choose);
        }
        #[test]
        fn a_holder_busy_decoding_with_no_prefill_queue_keeps_its_conversation() {
            $crate::policy::shared_tests::a_holder_busy_decoding_with_no_prefill_queue_keeps_its_conversation($choose);
        }
        #[test]
        fn a_deep_prefill_queue_loses_a_new_conversation_but_keeps_a_long_follow_up() {
            $crate::policy::shared_tests::a_deep_prefill_queue_loses_a_new_conversation_but_keeps_a_long_follow_up($choose);
        }
        #[test]
        fn heavy_queue_outweighs_small_reuse() {
            $crate::policy::shared_tests::heavy_queue_outweighs_small_reuse($choose);
        }
        #[test]
        fn load_bound_holds_under_a_hot_prefix() {
            $crate::policy::shared_tests::load_bound_holds_under_a_hot_prefix($choose);
        }
        #[test]
        fn rendezvous_moves_about_one_nth_when_a_worker_is_added() {
            $crate::policy::shared_tests::rendezvous_moves_about_one_nth_when_a_worker_is_added($choose);
        }
        #[test]
        fn weighted_rendezvous_follows_weights() {
            $crate::policy::shared_tests::weighted_rendezvous_follows_weights($choose);
        }
        #[test]
        fn a_new_prompt_goes_to_the_runner_up_when_the_top_was_sent_a_prompt_more() {
            $crate::policy::shared_tests::a_new_prompt_goes_to_the_runner_up_when_the_top_was_sent_a_prompt_more($choose);
        }
        #[test]
        fn a_sibling_follows_its_recent_placement_within_the_load_bound() {
            $crate::policy::shared_tests::a_sibling_follows_its_recent_placement_within_the_load_bound($choose);
        }
        #[test]
        fn new_pd_prompts_avoid_a_prefill_worker_with_queued_prefills() {
            $crate::policy::shared_tests::new_pd_prompts_avoid_a_prefill_worker_with_queued_prefills($choose);
        }
        #[test]
        fn uniform_fast_path_matches_the_general_policy() {
            $crate::policy::shared_tests::uniform_fast_path_matches_the_general_policy(
                $uniform, $general,
            );
        }
    };
}
pub(crate) use shared_policy_tests;
