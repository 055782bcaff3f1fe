//! What sending one request to one worker costs, in seconds: the number the cache-aware policy
//! ranks workers by. One formula for every prompt, whatever its shape (chat or completions,
//! messages or not, how many workers hold what).
//!
//! **Prefill work.** A worker prefills a prompt in chunks of `C` tokens
//! (`policy.prefill_chunk_tokens`, SGLang's `--chunked-prefill-size`); each chunk attends to the
//! cached context and to the chunks before it. `n` new tokens after `c` cached context tokens
//! therefore cost
//!
//! ```text
//! w(n, c) = n · (1 + (c + max(0, n − C) / 2) / K)
//! ```
//!
//! zero-context token equivalents: a linear part per token plus attention to what came before,
//! which grows with it (the mean earlier-chunk context of `n` tokens is `(n − C)/2`; attention
//! inside a chunk is in the linear part). Measured with `benches/gpu-prefill/prefill_context.py`
//! on an H200, 8B model (`docs/gpu-cost.md`): a token costs ~28 us plus ~1.6 us per 1k context
//! tokens, so `K` (`policy.cost.context_tokens`, default 20480) ≈ 17.5k there (16.9-24.7k across
//! the GPUs and models measured). A 512-token turn on a 32k history costs
//! 2.6x the same turn on nothing; a 64k prompt computed afresh costs 2.4x its linear part. The
//! earlier chunks are what make holding more of a prompt never cost more: without them a
//! worker holding `h` tokens would be charged `(P − h)·h/K` for the context that a worker
//! computing all `P` afresh was not, and once `P − h` passed `K` the model would rank
//! recomputing a long history below extending it. `C` is capped at `K` for the same reason.
//! The model is relative; a worker's rate absorbs its GPU and model.
//!
//! **Rate.** Worker `i` prefills `r_i` zero-context tokens per second: its learned rate when
//! known, else the mean learned rate per unit weight of the model's workers that have one × its
//! weight (a worker not yet busy is as fast as its fleet, neither favoured nor shunned for what
//! its counters have not shown yet), else `policy.cost.prefill_tokens_per_second` × its weight.
//! Learned (`poll.rs`): the uncached prompt tokens its counters (`sglang:prompt_tokens_total`
//! − `cached_tokens_total`) grew by per second over windows in which every load poll showed
//! requests waiting (busy throughout), averaged; slightly low, since those tokens had context.
//!
//! **Cost.** Worker `i` holds `h_i` of the prompt's `P` tokens (the index's match), has `Q_i`
//! tokens of prefill queued (polled `num_waiting_uncached_tokens` plus prompts sent since and not
//! yet at their first token; their contexts are not reported, so they count at zero context) and
//! `R_i` requests in flight; the deepest holder holds `H`; `S_i` is the wait for a running slot:
//!
//! ```text
//! own_i  = w(P − h_i, h_i)                         this request's prefill there
//! cost_i = ( own_i                                 prefill it adds to the fleet
//!          + λ · (Q_i + ρ · R_i)                   work queued ahead of it
//!          + κ · (H − h_i) / (1 + n) ) / r_i       the second copy it leaves in the KV
//!          + λ · S_i                               the wait for a slot in a full batch
//! ```
//!
//! **Slot.** A worker runs at most `C_i` requests (`max_running_requests`); the rest wait.
//! Requests waiting for prefill hold no slot (their wait is `Q_i`), so its batch is full when
//! `R_i` reaches `C_i` plus the requests that were waiting at the poll (`poll::capacity`). Then
//! this request starts after `R_i − that + 1` requests finish, one every `t_i` seconds
//! (learned by Little's law from its counters, `poll.rs`): `S_i = (R_i − that + 1) · t_i`, 0
//! under it. A worker with a full batch and no learned `t_i` is not eligible (`cost_aware.rs`).
//! Short generations free slots in milliseconds, so a full batch rarely outweighs a history
//! (a trace replay of 16-slot workers at 37% prefill utilisation left its holders half the
//! time when a full batch excluded them, docs/results.md); long ones make it the cost that
//! moves the request.
//!
//! `λ` is `policy.cost.queue_weight` (0.125), `ρ` `policy.request_cost_tokens` (64: the decode
//! steps a newcomer's prefill waits between), `κ` `policy.cost.copy_weight` (1), `n` the
//! requests that lately reached the same deepest held prefix (`sharers.rs`). Why: this
//! request's time to first token there is `(Q_i + own_i) / r_i`; its own prefill is paid again by
//! the `m` requests that queue behind it on that worker before its queue empties (`m = u/(1 − u)`
//! at prefill utilisation `u` for a single queue), so time to first token plus the seconds the
//! choice adds to the fleet is `(Q_i + (1 + m)·own_i) / r_i`: `cost_i` with `λ = 1/(1 + m)`, and
//! `λ = ⅛` is `m = 7` (87.5% utilisation: near capacity, where the fleet's prefill decides every
//! request's wait). An LRU cache runs full, so a second copy of `H − h_i` tokens evicts as many
//! tokens of other prompts, which the fleet recomputes when they are asked again: `κ = 1`. A copy
//! of a prefix that `n` other requests lately reached serves them too (and takes a share of their
//! load): each pays `1/(1 + n)` of it, as a fleet prefix is paid once per worker. A
//! conversation's own history has `n = 0` (its next turn extends it: a deeper prefix). (Trace
//! replays, docs/results.md: `λ = ½` or `κ = ¼` left busy holders for recomputes and copies the
//! fleet then paid for; at 1.1-1.25x the x32 rate, `λ = ⅛` held the conversations' time to first
//! token and lost the synthetic trace's repeated prompts to queues behind their holders, which
//! the shared copy gives back.)
//!
//! **Utilisation.** `m = u/(1 − u)` holds only below capacity: a fleet whose prefill
//! utilisation `u` reaches 1 has queues that only grow, and every recompute it takes on adds to
//! all of them, so `λ = 1/(1 + m) = 1 − u` goes to 0. The configured `λ` is the bound (the
//! m = 7 of a fleet near capacity); the learned one only lowers it:
//!
//! ```text
//! λ = min(policy.cost.queue_weight, max(1 − u, 0.001))
//! ```
//!
//! `u` is the mean over the model's workers of their learned utilisation (`poll.rs`: per
//! counter window, 1 when every load answer in it showed requests waiting, else the uncached
//! prompt tokens prefilled per second over the learned rate; averaged from 0 with weight ¼ a
//! window, so it takes ~8 busy windows, 16 s at the default
//! `metrics_interval_ms`, to pass ⅞); with none learned `λ` is as configured. Below ⅞ nothing
//! changes. Above it the queue counts less against a history, down to breaking ties between
//! equal recomputes: on 2 workers replaying the conversation trace at 16x (about twice what
//! they can prefill, TTFT p50 ~26 s) the configured `λ` split conversations whose next turn
//! arrived while the last one queued, and following every holder kept the same TTFT with more
//! hits (docs/results.md, "A saturated fleet's queue weight").
//!
//! **What follows from it.**
//! - A holder keeps a follow-up while its queue costs less than recomputing what it holds
//!   elsewhere: `λ·(Q_h − Q_x) < own_x − own_h + κ·h_h` (long histories stay through deep
//!   queues, short ones move, as the seconds say). A hot prefix therefore spills once its
//!   holder's queue exceeds `(1 + κ/(1 + n))/λ` times the prefix's recompute (16 for one
//!   user's prompt, towards 8 for one many repeat): no hot-spot rule.
//! - A prefix every worker holds adds the same to every cost: queued work decides, and the
//!   rendezvous order breaks exact ties, so new conversations on a fleet-wide system prompt
//!   spread instead of stacking on its first holders. `cost_aware` counts a prefix that a fleet
//!   share of the workers holds as held by all of them (its recompute and copy are the
//!   fleet's, paid once per worker), so `h_i` here is at least that prefix.
//! - The same bytes sent as chat or as completions have the same `P`, `h_i`, `H`: the same cost.
//!
//! Costs: a few floating-point operations per worker; no allocation.

use crate::config::PolicyConfig;

/// The least queue weight a saturated fleet gets (`Cost::at_utilisation`): the queue still
/// breaks ties between equal recomputes.
pub const MIN_QUEUE_WEIGHT: f64 = 0.001;

/// One worker's inputs to its cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Worker {
    /// Prompt tokens it holds (`h_i`).
    pub held: f64,
    /// Prefill tokens queued on it (`Q_i`).
    pub queued: f64,
    /// Requests in flight on it (`R_i`).
    pub reqs: f64,
    /// Zero-context prompt tokens it prefills per second (`r_i`, > 0).
    pub rate: f64,
    /// Seconds until a running slot frees for it (`S_i`; 0: its batch has room).
    pub slot_wait: f64,
}

/// The cost model's constants, read once per decision from the policy configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// `1 / K` (0: context is free).
    per_context_token: f64,
    /// `C`, at most `K`: tokens per prefill chunk.
    chunk: f64,
    load_weight: f64,
    request_tokens: f64,
    copy_weight: f64,
    default_rate: f64,
}

impl Cost {
    pub fn new(p: &PolicyConfig) -> Cost {
        let k = p.cost.context_tokens;
        Cost {
            per_context_token: if k == 0 { 0.0 } else { 1.0 / f64::from(k) },
            chunk: f64::from(p.prefill_chunk_tokens.min(k)),
            load_weight: p.cost.queue_weight,
            request_tokens: p.request_cost_tokens,
            copy_weight: p.cost.copy_weight,
            default_rate: p.cost.prefill_tokens_per_second.max(1.0),
        }
    }

    /// `w(n, c)`: zero-context token equivalents of prefilling `new` tokens after `context`.
    pub fn work(&self, new: f64, context: f64) -> f64 {
        let earlier_chunks = (new - self.chunk).max(0.0) / 2.0;
        new * (1.0 + (context + earlier_chunks) * self.per_context_token)
    }

    /// The rate per unit weight of workers whose rate is not learned (module docs, "Rate"): the
    /// mean of `learned[i] / weights[i]` over the learned ones, else the configured rate.
    pub fn with_fleet_rate(mut self, learned: &[f32], weights: impl Iterator<Item = f64>) -> Cost {
        let (mut sum, mut n) = (0.0f64, 0u32);
        for (&r, w) in learned.iter().zip(weights) {
            if r > 0.0 && r.is_finite() && w > 0.0 {
                sum += f64::from(r) / w;
                n += 1;
            }
        }
        if n > 0 {
            self.default_rate = (sum / f64::from(n)).max(1.0);
        }
        self
    }

    /// The copy term shared by `others` requests that will use the copy too (`sharers.rs`):
    /// each pays `1/(1 + others)` of it.
    pub fn shared_by(mut self, others: f32) -> Cost {
        if others > 0.0 && others.is_finite() {
            self.copy_weight /= 1.0 + f64::from(others);
        }
        self
    }

    /// The queue weight bounded by the fleet's prefill utilisation `u` (module docs,
    /// "Utilisation"): `λ = min(λ, 1 − u)`, never below [`MIN_QUEUE_WEIGHT`]. `utils` are the
    /// workers' learned utilisations (0 or not finite: not learned); their mean is `u`, and
    /// with none learned `λ` stays as configured.
    pub fn at_utilisation(mut self, utils: &[f32]) -> Cost {
        let (mut sum, mut n) = (0.0f64, 0u32);
        for &u in utils {
            if u > 0.0 && u.is_finite() {
                sum += f64::from(u.min(1.0));
                n += 1;
            }
        }
        if n > 0 {
            let free = 1.0 - sum / f64::from(n);
            self.load_weight = self.load_weight.min(free.max(MIN_QUEUE_WEIGHT));
        }
        self
    }

    /// A worker's rate: `learned` when known (> 0), else the fleet's (or configured) rate ×
    /// `weight`.
    pub fn rate(&self, learned: f32, weight: f64) -> f64 {
        if learned > 0.0 && learned.is_finite() {
            f64::from(learned)
        } else {
            self.default_rate * weight.max(f64::MIN_POSITIVE)
        }
    }

    /// `cost_i` (module docs) for a prompt of `prompt` tokens whose deepest holder holds
    /// `deepest` of them.
    pub fn seconds(&self, prompt: f64, deepest: f64, w: &Worker) -> f64 {
        let held = w.held.min(prompt).max(0.0);
        let own = self.work(prompt - held, held);
        let queued = self.load_weight * (w.queued + self.request_tokens * w.reqs);
        let copy = self.copy_weight * (deepest - held).max(0.0);
        (own + queued + copy) / w.rate + self.load_weight * w.slot_wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default policy with `K` = `k` and `C` = `chunk`.
    fn chunked(k: u32, chunk: u32) -> PolicyConfig {
        let d = PolicyConfig::default();
        PolicyConfig {
            prefill_chunk_tokens: chunk,
            cost: crate::config::cost::CostConfig {
                context_tokens: k,
                ..d.cost
            },
            ..d
        }
    }

    fn worker(held: f64, queued: f64) -> Worker {
        Worker {
            held,
            queued,
            reqs: 0.0,
            rate: 30_000.0,
            slot_wait: 0.0,
        }
    }

    #[test]
    fn prefill_work_follows_the_h200_shape() {
        let c = Cost::new(&PolicyConfig::default());
        // 512 new tokens on a 32k history: 2.6x the same tokens on nothing (H200: 45.0 / 14.8
        // ms = 3.0x; 8192 on 32k: 628 / 245 ms = 2.6x).
        let r = c.work(512.0, 32_768.0) / c.work(512.0, 0.0);
        assert!((2.5..=2.7).contains(&r), "{r}");
        // A prompt computed afresh in 8192-token chunks: its later chunks attend to the earlier
        // ones. H200, 8B (docs/gpu-cost.md): 8192 tokens 227 ms, 65536 in chunks 4.87 s (21x;
        // in one pass 3.54 s, 16x).
        assert_eq!(c.work(8_192.0, 0.0), 8_192.0);
        let r = c.work(65_536.0, 0.0) / c.work(8_192.0, 0.0);
        assert!((18.0..=20.0).contains(&r), "{r}");
        // Extending a 16k history by 16k tokens against computing all 32k: 1021 / 1304 ms in one
        // pass, 1029 / 1611 ms in 8192-token chunks.
        let r = c.work(16_384.0, 16_384.0) / c.work(32_768.0, 0.0);
        assert!((0.6..=0.7).contains(&r), "{r}");
    }

    /// Whatever the prompt, the chunk and `K`, a worker holding more of it is charged no more
    /// prefill: recomputing a history never looks cheaper than extending it.
    #[test]
    fn holding_more_of_a_prompt_never_costs_more() {
        for (k, chunk) in [(20_480, 8_192), (1_280, 512), (4_096, 16_384), (0, 8_192)] {
            let c = Cost::new(&chunked(k, chunk));
            for prompt in [100.0, 5_000.0, 40_000.0, 200_000.0] {
                let mut last = f64::INFINITY;
                for step in 0..=100 {
                    let held = prompt * f64::from(step) / 100.0;
                    let w = c.work(prompt - held, held);
                    assert!(
                        w <= last,
                        "K {k}, C {chunk}, P {prompt}, h {held}: {w} > {last}"
                    );
                    last = w;
                }
            }
        }
    }

    /// The Mooncake synthetic trace's longest prompts (in the replay's 16x scaled tokens: ~12k,
    /// `K` 1280, `C` 512): an idle worker holding 8k of them keeps the next one, which the model
    /// without earlier chunks sent to an idle worker holding nothing.
    #[test]
    fn an_idle_holder_keeps_a_long_prompt_that_goes_on_past_k() {
        let c = Cost::new(&chunked(1_280, 512));
        let (prompt, held) = (11_968.0, 8_192.0);
        let holder = c.seconds(prompt, held, &worker(held, 0.0));
        let idle = c.seconds(prompt, held, &worker(0.0, 0.0));
        assert!(holder < idle / 2.0, "{holder} vs {idle}");
    }

    #[test]
    fn a_holder_keeps_a_long_history_through_a_queue_and_loses_a_short_one() {
        let c = Cost::new(&PolicyConfig::default());
        // 12k-token follow-up; the holder has 19.5k tokens queued, another worker none.
        let (p, q) = (12_000.0, 19_500.0);
        for (history, stays) in [(10_000.0, true), (1_000.0, false)] {
            let holder = c.seconds(p, history, &worker(history, q));
            let idle = c.seconds(p, history, &worker(0.0, 0.0));
            assert_eq!(
                holder < idle,
                stays,
                "history {history}: {holder} vs {idle}"
            );
        }
    }

    /// A prompt repeated whole: its holder has a queue, another worker none. Repeated by this
    /// request alone, the copy is a second one of a single user's prompt and the holder keeps
    /// it; repeated by three others lately, the copy serves them too and the request moves.
    #[test]
    fn a_copy_other_requests_will_use_costs_each_of_them_a_share() {
        let p = PolicyConfig {
            cost: crate::config::cost::CostConfig {
                queue_weight: 0.25,
                ..PolicyConfig::default().cost
            },
            ..PolicyConfig::default()
        };
        let (prompt, held, queued) = (6_000.0, 5_900.0, 36_000.0);
        for (others, stays) in [(0.0, true), (3.0, false)] {
            let c = Cost::new(&p).shared_by(others);
            let holder = c.seconds(prompt, held, &worker(held, queued));
            let idle = c.seconds(prompt, held, &worker(0.0, 0.0));
            assert_eq!(holder < idle, stays, "{others}: {holder} vs {idle}");
        }
        // Nothing to share, or a count that is not a number, leaves the copy whole.
        let whole = Cost::new(&p).seconds(prompt, held, &worker(0.0, 0.0));
        for others in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let c = Cost::new(&p).shared_by(others);
            assert_eq!(
                c.seconds(prompt, held, &worker(0.0, 0.0)),
                whole,
                "{others}"
            );
        }
    }

    #[test]
    fn a_prefix_every_worker_holds_leaves_the_queue_to_decide() {
        let p = PolicyConfig::default();
        let c = Cost::new(&p);
        let a = c.seconds(4_000.0, 2_000.0, &worker(2_000.0, 100.0));
        let b = c.seconds(4_000.0, 2_000.0, &worker(2_000.0, 0.0));
        assert!(b < a);
        assert!((a - b - p.cost.queue_weight * 100.0 / 30_000.0).abs() < 1e-12);
    }

    #[test]
    fn rates_scale_seconds_and_default_to_the_configured_rate_times_weight() {
        let c = Cost::new(&PolicyConfig::default());
        assert_eq!(c.rate(0.0, 2.0), 60_000.0);
        assert_eq!(c.rate(f32::NAN, 1.0), 30_000.0);
        assert_eq!(c.rate(12_000.0, 2.0), 12_000.0);
        let fast = Worker {
            rate: 60_000.0,
            ..worker(0.0, 0.0)
        };
        let slow = worker(0.0, 0.0);
        assert!(c.seconds(1000.0, 0.0, &fast) < c.seconds(1000.0, 0.0, &slow));
        // Workers not learned yet count at the fleet's mean learned rate per unit weight.
        let fleet = c.with_fleet_rate(&[40_000.0, 0.0, 20_000.0], [2.0, 1.0, 1.0].into_iter());
        assert_eq!(fleet.rate(0.0, 1.0), 20_000.0);
        assert_eq!(fleet.rate(0.0, 2.0), 40_000.0);
        assert_eq!(fleet.rate(50_000.0, 1.0), 50_000.0);
        let none =
            Cost::new(&PolicyConfig::default()).with_fleet_rate(&[0.0, 0.0], [1.0; 2].into_iter());
        assert_eq!(none.rate(0.0, 1.0), 30_000.0);
    }

    #[test]
    fn a_full_batch_keeps_a_history_while_its_slots_free_faster_than_a_recompute() {
        let c = Cost::new(&PolicyConfig::default());
        // 8k-token follow-up on a 6k history; the holder's batch is full with 2 requests ahead.
        let (p, history) = (8_000.0, 6_000.0);
        let idle = c.seconds(p, history, &worker(0.0, 0.0));
        for (slot, stays) in [(0.02, true), (2.0, false)] {
            let holder = Worker {
                slot_wait: 3.0 * slot,
                ..worker(history, 0.0)
            };
            let s = c.seconds(p, history, &holder);
            assert_eq!(s < idle, stays, "slot {slot}: {s} vs {idle}");
        }
    }

    /// A follow-up whose 1k-token history sits behind 20k queued tokens on its holder: at half
    /// the fleet's prefill capacity (or with nothing learned) the queue moves it to an idle
    /// worker; in a saturated fleet, where every worker's queue only grows, the recompute would
    /// add to it and the follow-up stays.
    #[test]
    fn a_saturated_fleet_weighs_the_queue_less_than_the_recompute() {
        let (p, history) = (1_200.0, 1_000.0);
        let base = Cost::new(&PolicyConfig::default());
        for (utils, stays) in [
            (&[][..], false),
            (&[0.0, 0.0][..], false),
            (&[0.5, 0.6][..], false),
            (&[0.85, 0.9][..], false),
            (&[1.0, 0.98][..], true),
            (&[1.0, f32::NAN, 1.0][..], true),
        ] {
            let c = base.at_utilisation(utils);
            let holder = c.seconds(p, history, &worker(history, 20_000.0));
            let idle = c.seconds(p, history, &worker(0.0, 0.0));
            assert_eq!(holder < idle, stays, "{utils:?}: {holder} vs {idle}");
        }
        // The bound only lowers the configured weight, and never to 0.
        assert_eq!(base.at_utilisation(&[0.2]).load_weight, 0.125);
        assert_eq!(
            base.at_utilisation(&[0.95]).load_weight,
            1.0 - 0.95f32 as f64
        );
        assert_eq!(base.at_utilisation(&[1.0]).load_weight, MIN_QUEUE_WEIGHT);
    }
}
