//! `policy.cost`: the parameters of the `cost_aware` policy's cost model (`policy/cost.rs`).
//!
//! Invariants: every value is finite and in its stated range once [`CostConfig::validate`]
//! passed; errors name the field as written. Costs: configuration time only.

use super::{err, ConfigError};
use serde::Deserialize;

/// The cost model's parameters (`policy.cost` in the plugin configuration).
#[derive(Debug, Deserialize, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CostConfig {
    /// Zero-context prompt tokens a unit-weight worker prefills per second, until its own rate
    /// is learned from its counters: converts prefill work into seconds.
    #[serde(default = "default_prefill_tokens_per_second")]
    pub prefill_tokens_per_second: f64,
    /// Cached context tokens at which a new token costs twice its zero-context prefill: the
    /// attention term of prefill (H200, 8B shape: ~29 us per token plus ~1.4 us per token per
    /// 1k context tokens, so about 20k; `/work/shared/REFERENCE.md`). 0: context costs nothing.
    #[serde(default = "default_context_tokens")]
    pub context_tokens: u32,
    /// Share of a second copy's tokens that the fleet recomputes later: a full LRU cache evicts
    /// as many tokens of other prompts for it (shared by the requests that lately reached the
    /// same prefix, `sharers.rs`).
    #[serde(default = "default_copy_weight")]
    pub copy_weight: f64,
    /// `λ` of `policy/cost.rs`: a second of prefill queued ahead counts 1/(1 + m) of a second
    /// of prefill the choice adds, which this request and the m requests that queue behind it
    /// pay; m = 7 (M/M/1 at 87.5% prefill utilisation: near capacity).
    #[serde(default = "default_queue_weight")]
    pub queue_weight: f64,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            prefill_tokens_per_second: default_prefill_tokens_per_second(),
            context_tokens: default_context_tokens(),
            copy_weight: default_copy_weight(),
            queue_weight: default_queue_weight(),
        }
    }
}

fn default_prefill_tokens_per_second() -> f64 {
    // An 8B model on one H200 with no cached context (34-37k tokens/s measured with PyTorch's
    // fused attention; sglang-sim's default is 30k).
    30_000.0
}
fn default_context_tokens() -> u32 {
    // 29 us / 1.4 us per 1k context tokens (REFERENCE.md, "What a GPU worker's time really is").
    20_480
}
fn default_queue_weight() -> f64 {
    // Trace replays (docs/results.md): 0.5 left busy holders for recomputes the fleet then
    // paid for; 0.25 kept less of the cache and, near capacity, more time to first token.
    0.125
}
fn default_copy_weight() -> f64 {
    // An LRU cache runs full: a copy displaces as many tokens of other prompts, recomputed when
    // they are asked again (trace replays, docs/results.md: 0.25 left holders for copies that
    // evicted other conversations' histories).
    1.0
}

impl CostConfig {
    /// Checks every field (errors name `policy.cost.<field>`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = self.prefill_tokens_per_second;
        if !(r.is_finite() && (1.0..=1e9).contains(&r)) {
            return Err(err(
                "policy.cost.prefill_tokens_per_second",
                "must be between 1 and 1000000000",
            ));
        }
        if self.context_tokens > 1 << 24 {
            return Err(err(
                "policy.cost.context_tokens",
                "must be at most 16777216",
            ));
        }
        let c = self.copy_weight;
        if !(c.is_finite() && (0.0..=100.0).contains(&c)) {
            return Err(err("policy.cost.copy_weight", "must be between 0 and 100"));
        }
        let q = self.queue_weight;
        if !(q.is_finite() && (0.0..=100.0).contains(&q)) {
            return Err(err("policy.cost.queue_weight", "must be between 0 and 100"));
        }
        Ok(())
    }
}
