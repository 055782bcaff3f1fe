//! `policy`: which policy routes, and the cache-aware policy's load bound, slack, rendezvous
//! and token-estimate parameters (the cost model's are in `config/cost.rs`).
//!
//! Invariants: once [`check_policy`] passed, every number is finite and in its stated range.
//! Each default says what measurement chose it. Costs: configuration time only.

use super::{cost, err, ConfigError};
use serde::Deserialize;

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    /// Rules on the prompt's shape and the holders' count (`policy/cache_aware.rs`): the
    /// default before `cost_aware`, kept for comparison and as a fallback.
    CacheAware,
    /// The cost in seconds (`policy/cost.rs`, `policy/cost_aware.rs`): the default since it
    /// led `cache_aware` on the matrix of workloads (docs/results.md, "Matrix").
    #[default]
    CostAware,
    RoundRobin,
    Random,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    #[serde(default)]
    pub name: PolicyName,
    /// Load bound: a worker may take a request only while
    /// `in_flight + 1 <= (1 + load_eps) * weighted_mean(in_flight incl. this one) + 1`.
    #[serde(default = "default_load_eps")]
    pub load_eps: f64,
    /// The bound's absolute slack (the `+ 1` above, in requests): matters at low concurrency,
    /// where a relative slack alone would spill the second or third request on a hot prefix.
    #[serde(default = "default_load_slack")]
    pub load_slack: f64,
    /// Prompt tokens a holder must hold to get the whole `load_slack`; less gets a linear share
    /// above 1 (0: every holder gets `load_slack`).
    #[serde(default = "default_slack_full_tokens")]
    pub slack_full_tokens: u32,
    /// `slack_full_tokens` for the prefill workers of a PD model: their in-flight requests are
    /// prefills only (released at the decode worker's first token), mostly of cached prompts,
    /// so a holder's short queue costs less than a second copy of the prefix.
    #[serde(default = "default_prefill_slack_full_tokens")]
    pub prefill_slack_full_tokens: u32,
    /// The workers' prefill chunk (SGLang's `--chunked-prefill-size`): a new prompt's sibling
    /// sent in the same 100 ms clock step follows it only when their opening is at least this
    /// long (`router/mod.rs`, placements).
    #[serde(default = "default_prefill_chunk_tokens")]
    pub prefill_chunk_tokens: u32,
    /// A prefix cached on at least this share of the model's workers (and at least 3; all the
    /// index's holder slots in larger fleets) is a fleet prefix. `cache_aware`: a prompt's
    /// opening message so held no longer decides where a new conversation on it goes, the
    /// least busy eligible worker does; `cost_aware`: every worker counts as holding it (0:
    /// off).
    #[serde(default = "default_fleet_prefix_share")]
    pub fleet_prefix_share: f64,
    /// Time constant of each worker's decayed in-flight average (`busy.rs`); 0: off.
    #[serde(default = "default_busy_window_ms")]
    pub busy_window_ms: u32,
    /// Workers within this many requests of the least busy one share new conversations by
    /// rendezvous, so replicas and threads acting on the same averages do not herd onto one.
    #[serde(default = "default_busy_tolerance")]
    pub busy_tolerance: f64,
    /// One knob for the two uses of new prompts' placements; read it through
    /// [`PolicyConfig::footprint_decay_ms`] (the time constant of each worker's decayed sum of
    /// prompt tokens it was sent uncached, `footprint.rs`: a prompt nobody holds goes to its
    /// rendezvous runner-up when the top was sent more than one such prompt more) and
    /// [`PolicyConfig::follows_placements`] (whether a new prompt follows a sibling placed
    /// moments ago, `placements.rs`); 0 turns both off (plain rendezvous).
    #[serde(default = "default_placement_window_ms")]
    pub placement_window_ms: u32,
    /// Weight of a worker's queued prefill (uncached prompt tokens waiting for prefill, polled,
    /// plus those this Envoy sent since and that have not had their first token) in its cost.
    #[serde(default = "default_load_weight")]
    pub load_weight: f64,
    /// Cost of one request in flight on a worker, in prompt-token equivalents: a decoding
    /// request delays a new one only through the batch (every decode step reads its KV).
    #[serde(default = "default_request_cost_tokens")]
    pub request_cost_tokens: f64,
    /// Leading blocks whose hash picks the rendezvous worker when nobody holds the prefix.
    #[serde(default = "default_affinity_blocks")]
    pub affinity_blocks: usize,
    /// Rendezvous key of a chat prompt with two or more messages: the prompt through its second
    /// message (true: conversations over one system prompt spread) or the first
    /// `affinity_blocks` blocks (false).
    #[serde(default = "default_conversation_key")]
    pub conversation_key: bool,
    /// Text bytes per token when estimating the tokens of a text prompt.
    #[serde(default = "default_chars_per_token")]
    pub chars_per_token: u32,
    /// A VM routing at least this many requests per second (measured over each tick) parks its
    /// load releases until its next decision, saving two shared-data host calls per request;
    /// below it releases are written at once, so other threads never see phantom load on a
    /// quiet proxy. 0 parks always.
    #[serde(default = "default_batch_releases_min_rps")]
    pub batch_releases_min_rps: f64,
    /// Tokens charged per non-text content part (image, audio, video), whatever its JSON size.
    #[serde(default = "default_media_part_tokens")]
    pub media_part_tokens: u32,
    /// Most prompt tokens one request is charged (a client cannot inflate a worker's load
    /// beyond this per request, whatever it sends).
    #[serde(default = "default_max_request_tokens")]
    pub max_request_tokens: u32,
    /// The cost model's parameters (`config/cost.rs`).
    #[serde(default)]
    pub cost: cost::CostConfig,
}

impl PolicyConfig {
    /// Time constant of the workers' uncached-prompt footprints (`footprint.rs`; 0: off).
    pub fn footprint_decay_ms(&self) -> u32 {
        self.placement_window_ms
    }

    /// Whether a prompt nobody holds follows a sibling placed moments ago (`placements.rs`).
    pub fn follows_placements(&self) -> bool {
        self.placement_window_ms > 0
    }

    /// The tokens charged for `bytes` of a body read as text (a malformed body, a PD decode
    /// worker's copy): `bytes / chars_per_token`, at most `max_request_tokens`.
    pub fn body_tokens(&self, bytes: usize) -> u32 {
        (bytes / self.chars_per_token.max(1) as usize).min(self.max_request_tokens as usize) as u32
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            name: PolicyName::default(),
            load_eps: default_load_eps(),
            load_slack: default_load_slack(),
            slack_full_tokens: default_slack_full_tokens(),
            prefill_slack_full_tokens: default_prefill_slack_full_tokens(),
            prefill_chunk_tokens: default_prefill_chunk_tokens(),
            fleet_prefix_share: default_fleet_prefix_share(),
            busy_window_ms: default_busy_window_ms(),
            busy_tolerance: default_busy_tolerance(),
            placement_window_ms: default_placement_window_ms(),
            load_weight: default_load_weight(),
            request_cost_tokens: default_request_cost_tokens(),
            affinity_blocks: default_affinity_blocks(),
            conversation_key: default_conversation_key(),
            chars_per_token: default_chars_per_token(),
            batch_releases_min_rps: default_batch_releases_min_rps(),
            media_part_tokens: default_media_part_tokens(),
            max_request_tokens: default_max_request_tokens(),
            cost: cost::CostConfig::default(),
        }
    }
}

fn default_load_slack() -> f64 {
    3.0
}
fn default_slack_full_tokens() -> u32 {
    // load/compare agentic (16 workers, one 3k-token system prompt under 40 conversations): the
    // full slack for any holder stacked new conversations on the head's holders (9 of 16 workers
    // used, TTFT p99 586 ms); slack 1 for all: 14 of 16, p99 131 ms. Long documents (32k) keep
    // the full slack that raised long-context hit rates from 72% to 81-83%.
    8192
}
fn default_prefill_chunk_tokens() -> u32 {
    // SGLang's default `--chunked-prefill-size` on large GPUs (H100, H200), and sglang-sim's.
    8192
}
fn default_prefill_slack_full_tokens() -> u32 {
    // load/pd_compare --sizes 2,4 (2048-token system prompts, KV 40960 tokens per worker): with
    // 8192 every extra copy of a prompt group at 4+4 was a load spill from its holder, and the
    // copies evicted each other at 2+2: 75.5-79.6% prefill hit rate at 2+2; with 2048,
    // 80.3-81.4% (SGLang's router: 81.0%), TTFT p99 unchanged.
    2048
}
fn default_fleet_prefix_share() -> f64 {
    // scripts/demo (16 groups on 4 workers, everything fits in the caches): at 0.5 a group that
    // spilled once (2 of 4 holders) counted as fleet-wide and spread, 71% hit rate against 86%
    // with the rule off; 0.75 gave 84%. Fleets of 8+ need all 4 index holder slots either way.
    0.75
}
fn default_busy_window_ms() -> u32 {
    10_000
}
fn default_busy_tolerance() -> f64 {
    0.5
}
fn default_placement_window_ms() -> u32 {
    // Long enough to cover how long a prefix stays cached under steady traffic.
    60_000
}
fn default_load_eps() -> f64 {
    1.0
}
fn default_load_weight() -> f64 {
    // The tokens weighed are queued prefill (polled `num_waiting_uncached_tokens` plus prompts
    // sent since and not yet at their first token). A queued token delays this request by one
    // token of prefill; a token recomputed elsewhere delays it as much and is paid again by the
    // fleet: the requests that queue behind it on that worker, and the prefixes its copy evicts.
    // Waiting is therefore worth up to two tokens per token recomputed (docs/design.md,
    // "Queued prefill"; docs/results.md: at 1.0 the 32k-token documents of long_context were
    // copied to idle workers, 55.8% hit rate, against 72.3% at 0.5). A holder of the
    // conversation's own history is not charged at all (`policy/cache_aware.rs`).
    // `cost_aware` has its own weight (`policy.cost.queue_weight`).
    0.5
}
fn default_request_cost_tokens() -> f64 {
    64.0
}
fn default_conversation_key() -> bool {
    true
}
fn default_affinity_blocks() -> usize {
    4
}
fn default_chars_per_token() -> u32 {
    4
}
fn default_media_part_tokens() -> u32 {
    1024
}
fn default_max_request_tokens() -> u32 {
    // A 128k-token context: no engine prefills more for one request.
    131_072
}
fn default_batch_releases_min_rps() -> f64 {
    // A parked release waits for the VM's next decision, on average 1/rate: about one phantom
    // request per busy VM whatever the rate (Little's law), which is noise once a proxy carries
    // hundreds of seconds-long LLM streams. Below this rate host calls are cheap anyway.
    200.0
}

/// `policy.*`.
pub(super) fn check_policy(p: &PolicyConfig) -> Result<(), ConfigError> {
    if !(p.load_eps.is_finite() && p.load_eps >= 0.0 && p.load_eps <= 100.0) {
        return Err(err("policy.load_eps", "must be between 0 and 100"));
    }
    if !(p.batch_releases_min_rps.is_finite()
        && p.batch_releases_min_rps >= 0.0
        && p.batch_releases_min_rps <= 1e9)
    {
        return Err(err(
            "policy.batch_releases_min_rps",
            "must be between 0 and 1000000000",
        ));
    }
    if !(p.load_slack.is_finite() && p.load_slack >= 0.0 && p.load_slack <= 1e6) {
        return Err(err("policy.load_slack", "must be between 0 and 1000000"));
    }
    if !(p.fleet_prefix_share.is_finite() && (0.0..=1.0).contains(&p.fleet_prefix_share)) {
        return Err(err("policy.fleet_prefix_share", "must be between 0 and 1"));
    }
    if !(p.busy_tolerance.is_finite() && p.busy_tolerance >= 0.0 && p.busy_tolerance <= 1e6) {
        return Err(err(
            "policy.busy_tolerance",
            "must be between 0 and 1000000",
        ));
    }
    if !(p.load_weight.is_finite() && p.load_weight >= 0.0) {
        return Err(err("policy.load_weight", "must be a finite number >= 0"));
    }
    if !(p.request_cost_tokens.is_finite() && p.request_cost_tokens >= 0.0) {
        return Err(err(
            "policy.request_cost_tokens",
            "must be a finite number >= 0",
        ));
    }
    if p.affinity_blocks == 0 {
        return Err(err("policy.affinity_blocks", "must be at least 1"));
    }
    if p.media_part_tokens > 1 << 20 {
        return Err(err("policy.media_part_tokens", "must be at most 1048576"));
    }
    if p.max_request_tokens == 0 || p.max_request_tokens > 1 << 24 {
        return Err(err(
            "policy.max_request_tokens",
            "must be between 1 and 16777216",
        ));
    }
    if p.chars_per_token == 0 {
        return Err(err("policy.chars_per_token", "must be at least 1"));
    }
    p.cost.validate()
}
