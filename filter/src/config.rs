//! Typed plugin configuration, validated once in `on_configure`.
//!
//! Every default lives in this file (the `default_*` functions); the example in
//! `docs/configuration.md` lists every field with its default, and `filter/tests/config_doc.rs`
//! checks it against these.
//!
//! Invariants: [`Config::validate`] checks one section per function, in a fixed order, and every
//! error names the offending field as the operator wrote it; a [`Config`] that exists is valid.
//! This layer imports no runtime module (the PD sections are in `config/pd.rs`; the shared-data
//! keys of every model are named here). Costs: configuration time only.

pub mod cost;
pub mod pd;

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// Hard ceilings that keep per-request work and memory bounded whatever the config says.
pub const MAX_WORKERS_PER_MODEL: usize = 1024;
pub const MAX_BLOCK_BYTES: usize = 1 << 16;
pub const MAX_TOKEN_BLOCK: usize = 4096;
pub const MAX_PROMPT_BLOCKS: usize = 1 << 20;
/// Key prefix of the prefix index's buckets, one table for every model (`index::KEY_PREFIX`).
pub const INDEX_KEY_PREFIX: &str = "pr/i2/";
/// Longest worker address accepted (`[v6 address]:port` fits).
pub const MAX_ADDRESS: usize = 64;

/// Raw configuration as written by the operator (JSON).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub models: BTreeMap<String, RawModel>,
    #[serde(default)]
    pub default_model: Option<String>,
    #[serde(default)]
    pub unknown_model: UnknownModel,
    #[serde(default)]
    pub passthrough_cluster: Option<String>,
    #[serde(default = "default_cluster_header")]
    pub cluster_header: String,
    /// PD models: the header naming the prefill worker (a route's mirror policy reads it).
    #[serde(default = "pd::default_prefill_header")]
    pub prefill_cluster_header: String,
    #[serde(default)]
    pub debug_header: Option<String>,
    /// Secret that keys block hashes and bucket choice (index poisoning, see `blocks.rs`).
    /// Every replica (and peer) must use the same value.
    #[serde(default)]
    pub hash_key: Option<String>,
    /// Request header naming the tenant (set or overwritten by Envoy after authentication, never
    /// taken from the client): tenants never share index entries.
    #[serde(default)]
    pub tenant_header: Option<String>,
    #[serde(default = "default_text_block_bytes")]
    pub text_block_bytes: usize,
    #[serde(default = "default_token_block_size")]
    pub token_block_size: usize,
    #[serde(default = "default_max_prompt_blocks")]
    pub max_prompt_blocks: usize,
    #[serde(default)]
    pub index: IndexConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub load_poll: LoadPollConfig,
    #[serde(default)]
    pub peers: Option<PeersConfig>,
    /// True only on the filter of the peer listener: it accepts peers' index records (and
    /// nothing else) there. The client listener never accepts them.
    #[serde(default)]
    pub peer_listener: bool,
    /// Request header naming the chosen host of a pool model (`IP:PORT`, fallbacks after it,
    /// comma-separated), read by the pool cluster's override_host load-balancing policy.
    #[serde(default = "default_destination_header")]
    pub destination_header: String,
    /// How pool models learn their hosts (`membership.rs`).
    #[serde(default)]
    pub membership: MembershipConfig,
}

/// Polling every worker's own load (`/v1/loads`, else `/get_load`), so several Envoy replicas
/// and traffic that bypasses Envoy are seen as one load. See `poll.rs`.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct LoadPollConfig {
    /// Poll period per worker; 0 disables polling (each Envoy sees only its own requests).
    #[serde(default = "default_poll_interval_ms")]
    pub interval_ms: u32,
    /// Poll period of a model without traffic (no request in flight and none since its last
    /// round); below `interval_ms` it is `interval_ms`. See `poll::Poller`.
    #[serde(default = "default_poll_no_traffic_interval_ms")]
    pub no_traffic_interval_ms: u32,
    #[serde(default = "default_poll_path")]
    pub path: String,
    /// Tried for a worker whose `path` answered 404 (older SGLang).
    #[serde(default = "default_poll_fallback_path")]
    pub fallback_path: String,
    #[serde(default = "default_poll_timeout_ms")]
    pub timeout_ms: u32,
    /// A worker whose last good poll is older than this counts as unknown, not idle.
    #[serde(default = "default_poll_stale_ms")]
    pub stale_ms: u32,
    /// Polls go to the cluster named worker cluster + this suffix (e.g. `_load`: the worker's own
    /// host only, no outlier detection, no fallbacks, so a failing load endpoint never ejects the
    /// worker and a fallback never answers for it); empty = the worker cluster itself.
    #[serde(default)]
    pub cluster_suffix: String,
    /// Each worker's Prometheus page, read every `metrics_interval_ms` for its prompt and cached
    /// token counters: the index's self-check (`hits.rs`). SGLang serves it with
    /// `--enable-metrics`; a worker without it is never checked.
    #[serde(default = "default_poll_metrics_path")]
    pub metrics_path: String,
    /// 0 disables the self-check.
    #[serde(default = "default_poll_metrics_interval_ms")]
    pub metrics_interval_ms: u32,
}

impl Default for LoadPollConfig {
    fn default() -> Self {
        LoadPollConfig {
            interval_ms: default_poll_interval_ms(),
            no_traffic_interval_ms: default_poll_no_traffic_interval_ms(),
            path: default_poll_path(),
            fallback_path: default_poll_fallback_path(),
            timeout_ms: default_poll_timeout_ms(),
            stale_ms: default_poll_stale_ms(),
            cluster_suffix: String::new(),
            metrics_path: default_poll_metrics_path(),
            metrics_interval_ms: default_poll_metrics_interval_ms(),
        }
    }
}

/// Where pool models' hosts are read: Envoy's admin `/clusters` (text format) through a
/// loopback cluster the public route can never name. See `membership.rs`.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct MembershipConfig {
    #[serde(default = "default_membership_cluster")]
    pub cluster: String,
    #[serde(default = "default_membership_path")]
    pub path: String,
    /// How often the poll lease holder reads it and every VM looks at the result; 0 = never
    /// (pool models are then served only by the pool cluster's fallback policy).
    #[serde(default = "default_membership_interval_ms")]
    pub interval_ms: u32,
    #[serde(default = "default_membership_timeout_ms")]
    pub timeout_ms: u32,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            cluster: default_membership_cluster(),
            path: default_membership_path(),
            interval_ms: default_membership_interval_ms(),
            timeout_ms: default_membership_timeout_ms(),
        }
    }
}

fn default_membership_cluster() -> String {
    "admin".into()
}
fn default_membership_path() -> String {
    "/clusters".into()
}
fn default_membership_interval_ms() -> u32 {
    1000
}
fn default_membership_timeout_ms() -> u32 {
    1000
}
fn default_destination_header() -> String {
    "x-gateway-destination-endpoint".into()
}

/// Other Envoy replicas that receive this replica's index records. See `peers.rs`.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct PeersConfig {
    /// One Envoy cluster per peer, each pointing at that peer's peer listener.
    #[serde(default)]
    pub clusters: Vec<String>,
    /// Shared by every replica; keys the HMAC-SHA256 that authenticates each batch (the
    /// secret itself never travels). See `peers.rs`.
    pub secret: String,
    /// How often a VM sends the records it made since its last batch.
    #[serde(default = "default_peer_flush_ms")]
    pub flush_ms: u32,
    #[serde(default = "default_peer_timeout_ms")]
    pub timeout_ms: u32,
    /// Records a VM keeps for its next batch; more are dropped (counted).
    #[serde(default = "default_peer_max_batch")]
    pub max_batch: usize,
    /// Receiver: a batch whose sender timestamp is more than this many seconds from the
    /// receiver's wall clock (either way) is refused as stale. Replicas' clocks must agree
    /// within it (NTP).
    #[serde(default = "default_peer_window_s")]
    pub window_s: u32,
    /// Receiver: records per second each sender may have applied (a token bucket one second
    /// deep); the rest of a batch is dropped and counted.
    #[serde(default = "default_peer_max_records_per_s")]
    pub max_records_per_s: u32,
}
/// Path peers POST record batches to.
pub const PEER_PATH: &str = "/prefix-router/v1/records";
/// Shortest accepted peer secret.
pub const MIN_SECRET_LEN: usize = 16;

fn default_poll_interval_ms() -> u32 {
    100
}
fn default_poll_no_traffic_interval_ms() -> u32 {
    500
}
fn default_poll_path() -> String {
    "/v1/loads".into()
}
fn default_poll_fallback_path() -> String {
    "/get_load".into()
}
fn default_poll_metrics_path() -> String {
    "/metrics".into()
}
fn default_poll_metrics_interval_ms() -> u32 {
    2000
}
fn default_poll_timeout_ms() -> u32 {
    250
}
fn default_poll_stale_ms() -> u32 {
    1000
}
fn default_peer_flush_ms() -> u32 {
    100
}
fn default_peer_timeout_ms() -> u32 {
    250
}
fn default_peer_max_batch() -> usize {
    4096
}
fn default_peer_window_s() -> u32 {
    30
}
fn default_peer_max_records_per_s() -> u32 {
    20_000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    #[serde(default)]
    pub workers: Vec<RawWorker>,
    /// PD disaggregation (`config/pd.rs`): prefill and decode workers instead of `workers`.
    #[serde(default)]
    pub prefill: Vec<pd::RawPrefill>,
    #[serde(default)]
    pub decode: Vec<RawWorker>,
    /// Pool mode: the workers are the healthy hosts of one Envoy cluster (`membership.rs`).
    #[serde(default)]
    pub pool: Option<RawPool>,
    #[serde(default)]
    pub text_block_bytes: Option<usize>,
    #[serde(default)]
    pub token_block_size: Option<usize>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum RawWorker {
    Name(String),
    Weighted {
        cluster: String,
        #[serde(default = "default_weight")]
        weight: f64,
        /// The worker's `IP:PORT`, to credit it with the requests it served as another
        /// worker's fallback (`upstream.address` at the response).
        #[serde(default)]
        address: Option<String>,
    },
}

/// A pool model's cluster (`membership.rs`).
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    /// The Envoy cluster whose hosts are the workers (override_host load balancing).
    pub cluster: String,
    /// The cluster load polls and counter reads go through (same hosts, override_host, no
    /// health checks or outlier detection); default `<cluster><load_poll.cluster_suffix>`.
    #[serde(default)]
    pub load_cluster: Option<String>,
    /// Hosts named after the chosen one in the destination header (tried on retries).
    #[serde(default = "default_pool_fallbacks")]
    pub fallbacks: usize,
    /// Most hosts used; more are left to the cluster's fallback policy (counted).
    #[serde(default = "default_pool_max_workers")]
    pub max_workers: usize,
}

fn default_pool_fallbacks() -> usize {
    2
}
fn default_pool_max_workers() -> usize {
    64
}

/// A validated pool (see [`RawPool`]).
#[derive(Debug, Clone)]
pub struct Pool {
    pub cluster: String,
    pub load_cluster: String,
    pub fallbacks: usize,
    pub max_workers: usize,
    /// Shared-data key of the published membership.
    pub members_key: String,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum UnknownModel {
    /// Route to the default model's workers (reason `fallback`).
    #[default]
    Default,
    /// Answer 404 with an OpenAI-style error body.
    Reject,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct IndexConfig {
    /// Entries (prompt checkpoints) per model; rounded up to a multiple of 4 (one bucket).
    #[serde(default = "default_capacity")]
    pub capacity: usize,
    /// A holder not refreshed for this long is ignored (the worker has likely evicted it).
    #[serde(default = "default_ttl_seconds")]
    pub ttl_seconds: u32,
    /// CAS attempts per index bucket write before the update is dropped (counted).
    #[serde(default = "default_cas_retries")]
    pub cas_retries: u32,
    /// How long a VM reuses a probe result before asking shared data again (0 disables).
    #[serde(default = "default_local_cache_ms")]
    pub local_cache_ms: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            capacity: default_capacity(),
            ttl_seconds: default_ttl_seconds(),
            cas_retries: default_cas_retries(),
            local_cache_ms: default_local_cache_ms(),
        }
    }
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    #[default]
    CacheAware,
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
    /// A prompt's opening message (a system prompt) cached on at least this share of the
    /// model's workers is a fleet prefix: it no longer decides where a new conversation on it
    /// goes; the least busy eligible worker does (0: off).
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

fn default_cluster_header() -> String {
    "x-prefix-router-cluster".into()
}
fn default_text_block_bytes() -> usize {
    64
}
fn default_token_block_size() -> usize {
    16
}
fn default_max_prompt_blocks() -> usize {
    16384
}
fn default_weight() -> f64 {
    1.0
}
fn default_capacity() -> usize {
    262_144
}
fn default_ttl_seconds() -> u32 {
    600
}
fn default_cas_retries() -> u32 {
    4
}
fn default_local_cache_ms() -> u32 {
    1000
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
    // `λ` of policy/cost.rs: a second of prefill queued ahead counts 1/(1 + m) of a second of
    // prefill the choice adds, which this request and the m requests that queue behind it pay;
    // m = 3 (M/M/1 at 75% prefill utilisation). Trace replays (docs/results.md): 0.5 left
    // busy holders for recomputes the fleet then paid for.
    0.25
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

/// A configuration error naming the offending field.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid config field `{}`: {}", self.field, self.message)
    }
}

pub(crate) fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// One upstream worker (an Envoy cluster).
#[derive(Debug, Clone)]
pub struct Worker {
    /// The worker's cluster; a pool worker's address.
    pub cluster: String,
    pub weight: f64,
    /// `IP:PORT` when known (always for a pool worker): matched against `upstream.address`.
    pub address: Option<String>,
    /// Stable non-zero identity stored in shared data: index holders and load entries name
    /// workers by this id, so a config with reordered or removed workers never misreads them.
    pub id: u32,
}

#[derive(Debug, Clone)]
pub struct Model {
    pub name: String,
    pub workers: Vec<Worker>,
    /// Bytes per hashed block (text) and tokens per block (token ids).
    pub text_block_bytes: usize,
    pub token_block_size: usize,
    /// Shared-data key prefixes for this model's index buckets and load vector.
    pub index_key_prefix: String,
    pub load_key: String,
    /// Shared-data key of the workers' polled loads (`poll.rs`).
    pub poll_key: String,
    /// Shared-data key of the recent placements of new prompts (`placements.rs`).
    pub placed_key: String,
    /// Shared-data key of the workers' polled token counters (`hits.rs`).
    pub hits_key: String,
    /// Model identity in peer record batches (hash of the name, like worker ids).
    pub peer_key: u32,
    /// Per worker: the cluster its load is polled through (`load_poll.cluster_suffix`).
    pub poll_clusters: Vec<String>,
    /// True when all weights are equal (rendezvous can skip the logarithm).
    pub uniform_weights: bool,
    pub total_weight: f64,
    /// PD model: bootstrap fields per prefill worker and its decode model (`config/pd.rs`).
    pub pd: Option<pd::Pd>,
    /// Hidden decode model of the PD model at this index; never matched by name.
    pub decode_of: Option<usize>,
    /// Pool mode: the workers are this cluster's current hosts (empty until first learned).
    pub pool: Option<Pool>,
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub models: Vec<Model>,
    pub default_model: usize,
    pub unknown_model: UnknownModel,
    pub passthrough_cluster: Option<String>,
    pub cluster_header: String,
    pub prefill_cluster_header: String,
    pub debug_header: Option<String>,
    /// 64-bit key derived from `hash_key` (0 when unset: unkeyed).
    pub hash_key: u64,
    pub tenant_header: Option<String>,
    pub max_prompt_blocks: usize,
    pub index_buckets: u32,
    pub index: IndexConfig,
    pub policy: PolicyConfig,
    pub load_poll: LoadPollConfig,
    pub peers: Option<PeersConfig>,
    pub peer_listener: bool,
    pub destination_header: String,
    pub membership: MembershipConfig,
}

/// Worker identity: xxh3 of the cluster name, never 0 (0 marks an empty slot).
pub fn worker_id(cluster: &str) -> u32 {
    let h = xxhash_rust::xxh3::xxh3_64(cluster.as_bytes());
    let id = (h ^ (h >> 32)) as u32;
    if id == 0 {
        1
    } else {
        id
    }
}

/// Validates a model's `pool` (exclusive with `workers`, `prefill` and `decode`).
fn check_pool(
    field: &str,
    m: &RawModel,
    suffix: &str,
    model: &str,
) -> Result<Option<Pool>, ConfigError> {
    let Some(p) = &m.pool else {
        return Ok(None);
    };
    if !m.workers.is_empty() || !m.prefill.is_empty() || !m.decode.is_empty() {
        return Err(err(
            format!("{field}.pool"),
            "a pool model has no `workers`, `prefill` or `decode`",
        ));
    }
    let printable = |c: &str| !c.is_empty() && !c.bytes().any(|b| b.is_ascii_control());
    if !printable(&p.cluster) {
        return Err(err(
            format!("{field}.pool.cluster"),
            "must be a non-empty printable name",
        ));
    }
    let load_cluster = p
        .load_cluster
        .clone()
        .unwrap_or_else(|| format!("{}{suffix}", p.cluster));
    if !printable(&load_cluster) {
        return Err(err(
            format!("{field}.pool.load_cluster"),
            "must be a non-empty printable name",
        ));
    }
    if p.fallbacks > 16 {
        return Err(err(
            format!("{field}.pool.fallbacks"),
            "must be between 0 and 16",
        ));
    }
    if p.max_workers == 0 || p.max_workers > MAX_WORKERS_PER_MODEL {
        return Err(err(
            format!("{field}.pool.max_workers"),
            format!("must be between 1 and {MAX_WORKERS_PER_MODEL}"),
        ));
    }
    Ok(Some(Pool {
        cluster: p.cluster.clone(),
        load_cluster,
        fallbacks: p.fallbacks,
        max_workers: p.max_workers,
        members_key: format!("pr/m1/{model}"),
    }))
}

/// `host:port` with a numeric port, printable, at most [`MAX_ADDRESS`] bytes, no whitespace.
pub fn valid_address(a: &[u8]) -> bool {
    if a.is_empty() || a.len() > MAX_ADDRESS {
        return false;
    }
    if a.iter().any(|b| !b.is_ascii_graphic() || *b == b',') {
        return false;
    }
    let Some(colon) = a.iter().rposition(|&b| b == b':') else {
        return false;
    };
    let (host, port) = (&a[..colon], &a[colon + 1..]);
    !host.is_empty()
        && !port.is_empty()
        && port.len() <= 5
        && port.iter().all(u8::is_ascii_digit)
        && std::str::from_utf8(port)
            .ok()
            .and_then(|p| p.parse::<u16>().ok())
            .is_some_and(|p| p > 0)
}

/// The 64-bit hashing key of a `hash_key` secret.
fn derive_hash_key(secret: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(secret.as_bytes(), 0x6861_7368_6b65_7921)
    // "hashkey!"
}

pub(crate) fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl Config {
    /// Parses and validates the plugin configuration JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| {
            // Unknown fields, wrong types and bad enum values: serde's message says what, the
            // field is located by config_path (syntax errors have no field: `<root>`).
            let field = match e.classify() {
                serde_json::error::Category::Data => serde_json::from_slice(bytes)
                    .map(|doc| crate::config_path::locate::<RawConfig>(&doc))
                    .unwrap_or_else(|_| "<root>".to_string()),
                _ => "<root>".to_string(),
            };
            err(field, e.to_string())
        })?;
        Config::validate(raw)
    }

    /// Validates every section (each error names its field) and builds the configuration.
    pub fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let (models, default_model) = check_models(&raw)?;
        check_headers(&raw)?;
        check_hash_key(&raw)?;
        check_tenant_header(&raw)?;
        check_passthrough(&raw)?;
        check_index(&raw.index)?;
        check_policy(&raw.policy)?;
        check_load_poll(&raw.load_poll)?;
        check_peers(&raw)?;
        check_membership(&raw, &models)?;
        let idx = &raw.index;
        Ok(Config {
            destination_header: raw.destination_header,
            membership: raw.membership,
            load_poll: raw.load_poll,
            peers: raw.peers,
            peer_listener: raw.peer_listener,
            // One table for all models (the model is in every hash): renaming a model reuses
            // it; `capacity` entries per model.
            index_buckets: (idx.capacity.div_ceil(4) * models.len().max(1)).min(u32::MAX as usize)
                as u32,
            models,
            default_model,
            unknown_model: raw.unknown_model,
            passthrough_cluster: raw.passthrough_cluster,
            cluster_header: raw.cluster_header,
            prefill_cluster_header: raw.prefill_cluster_header,
            debug_header: raw.debug_header,
            hash_key: raw.hash_key.as_deref().map_or(0, derive_hash_key),
            tenant_header: raw.tenant_header,
            max_prompt_blocks: raw.max_prompt_blocks,
            index: raw.index,
            policy: raw.policy,
        })
    }

    /// Index of the model named `name`, if configured. Linear: configs hold a handful of models.
    pub fn model_index(&self, name: &[u8]) -> Option<usize> {
        self.models
            .iter()
            .position(|m| m.decode_of.is_none() && m.name.as_bytes() == name)
    }
}

/// `models`, `default_model` and the block sizes: the configured models in name order, then
/// the PD models' hidden decode models (`config/pd.rs`); and the default model's position.
fn check_models(raw: &RawConfig) -> Result<(Vec<Model>, usize), ConfigError> {
    if raw.models.is_empty() {
        return Err(err("models", "at least one model is required"));
    }
    check_block("text_block_bytes", raw.text_block_bytes, MAX_BLOCK_BYTES)?;
    check_block("token_block_size", raw.token_block_size, MAX_TOKEN_BLOCK)?;
    if raw.max_prompt_blocks == 0 || raw.max_prompt_blocks > MAX_PROMPT_BLOCKS {
        return Err(err("max_prompt_blocks", "must be between 1 and 1048576"));
    }
    let mut models = Vec::with_capacity(raw.models.len());
    for (name, m) in &raw.models {
        let field = format!("models.{name}");
        if name.is_empty() {
            return Err(err("models", "model names must not be empty"));
        }
        let pool = check_pool(&field, m, &raw.load_poll.cluster_suffix, name)?;
        let (raw_workers, key) = pd::routing_workers(&field, m)?;
        if raw_workers.is_empty() && pool.is_none() {
            return Err(err(format!("{field}.{key}"), "at least one worker"));
        }
        if raw_workers.len() > MAX_WORKERS_PER_MODEL {
            return Err(err(
                format!("{field}.{key}"),
                format!("at most {MAX_WORKERS_PER_MODEL} workers"),
            ));
        }
        let mut workers: Vec<Worker> = Vec::with_capacity(raw_workers.len());
        for (i, w) in raw_workers.iter().enumerate() {
            let wf = format!("{field}.{key}[{i}]");
            let worker = check_worker(&wf, w)?;
            check_distinct(&wf, &workers, &worker)?;
            workers.push(worker);
        }
        let text_block_bytes = m.text_block_bytes.unwrap_or(raw.text_block_bytes);
        let token_block_size = m.token_block_size.unwrap_or(raw.token_block_size);
        check_block(
            &format!("{field}.text_block_bytes"),
            text_block_bytes,
            MAX_BLOCK_BYTES,
        )?;
        check_block(
            &format!("{field}.token_block_size"),
            token_block_size,
            MAX_TOKEN_BLOCK,
        )?;
        let uniform_weights = workers.windows(2).all(|w| w[0].weight == w[1].weight);
        let total_weight = workers.iter().map(|w| w.weight).sum();
        models.push(Model {
            index_key_prefix: INDEX_KEY_PREFIX.to_string(),
            load_key: format!("pr/l2/{name}"),
            poll_key: format!("pr/p2/{name}"),
            placed_key: format!("pr/np/{name}"),
            hits_key: format!("pr/h1/{name}"),
            peer_key: worker_id(name),
            poll_clusters: workers
                .iter()
                .map(|w| format!("{}{}", w.cluster, raw.load_poll.cluster_suffix))
                .collect(),
            name: name.clone(),
            workers,
            text_block_bytes,
            token_block_size,
            uniform_weights,
            total_weight,
            pd: None,
            decode_of: None,
            pool,
        });
    }
    let default_model = match &raw.default_model {
        Some(d) => models
            .iter()
            .position(|m| &m.name == d)
            .ok_or_else(|| err("default_model", format!("`{d}` is not in models")))?,
        None if models.len() == 1 => 0,
        None => {
            return Err(err(
                "default_model",
                "required when more than one model is configured",
            ))
        }
    };
    pd::add_decode_models(
        raw.models.iter(),
        &mut models,
        &raw.load_poll.cluster_suffix,
    )?;
    Ok((models, default_model))
}

/// One worker as written (`wf`: its field): its address, cluster name and weight.
pub(crate) fn check_worker(wf: &str, w: &RawWorker) -> Result<Worker, ConfigError> {
    let (cluster, weight, address) = match w {
        RawWorker::Name(c) => (c.clone(), 1.0, None),
        RawWorker::Weighted {
            cluster,
            weight,
            address,
        } => (cluster.clone(), *weight, address.clone()),
    };
    if address
        .as_ref()
        .is_some_and(|a| !valid_address(a.as_bytes()))
    {
        return Err(err(format!("{wf}.address"), "must be IP:PORT"));
    }
    if cluster.is_empty() || cluster.bytes().any(|b| b.is_ascii_control()) {
        return Err(err(wf, "cluster must be a non-empty printable name"));
    }
    if !(weight.is_finite() && weight > 0.0 && weight <= 1e6) {
        return Err(err(format!("{wf}.weight"), "must be > 0 and <= 1e6"));
    }
    Ok(Worker {
        id: worker_id(&cluster),
        cluster,
        weight,
        address,
    })
}

/// `w` (field `wf`) names no worker of `workers` and no id of theirs (ids are hashes of names).
pub(crate) fn check_distinct(wf: &str, workers: &[Worker], w: &Worker) -> Result<(), ConfigError> {
    if let Some(prev) = workers.iter().find(|p| p.id == w.id) {
        let cluster = &w.cluster;
        let msg = if prev.cluster == *cluster {
            format!("duplicate cluster `{cluster}`")
        } else {
            format!("`{cluster}` collides with `{}`; rename one", prev.cluster)
        };
        return Err(err(wf, msg));
    }
    Ok(())
}

/// `cluster_header`, `debug_header` and `prefill_cluster_header`: lower-case and distinct.
fn check_headers(raw: &RawConfig) -> Result<(), ConfigError> {
    if !valid_header_name(&raw.cluster_header) {
        return Err(err(
            "cluster_header",
            "must be a lower-case header name ([a-z0-9_-]+)",
        ));
    }
    if let Some(h) = &raw.debug_header {
        if !valid_header_name(h) || *h == raw.cluster_header {
            return Err(err(
                "debug_header",
                "must be a lower-case header name distinct from cluster_header",
            ));
        }
    }
    pd::check_header(
        &raw.prefill_cluster_header,
        &raw.cluster_header,
        raw.debug_header.as_deref(),
    )?;
    Ok(())
}

/// `hash_key`: a secret of at least [`MIN_SECRET_LEN`] printable characters.
fn check_hash_key(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(k) = &raw.hash_key {
        if k.len() < MIN_SECRET_LEN || k.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
            return Err(err(
                "hash_key",
                format!("must be at least {MIN_SECRET_LEN} printable characters"),
            ));
        }
    }
    Ok(())
}

/// `tenant_header`: lower-case and distinct from the cluster and debug headers.
fn check_tenant_header(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(h) = &raw.tenant_header {
        if !valid_header_name(h) || *h == raw.cluster_header || raw.debug_header.as_ref() == Some(h)
        {
            return Err(err(
                "tenant_header",
                "must be a lower-case header name distinct from cluster_header and debug_header",
            ));
        }
    }
    Ok(())
}

/// `passthrough_cluster`: a name when set.
fn check_passthrough(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(p) = &raw.passthrough_cluster {
        if p.is_empty() {
            return Err(err("passthrough_cluster", "must not be empty"));
        }
    }
    Ok(())
}

/// `index.*`.
fn check_index(idx: &IndexConfig) -> Result<(), ConfigError> {
    if idx.capacity < 4 || idx.capacity > 1 << 26 {
        return Err(err("index.capacity", "must be between 4 and 67108864"));
    }
    if idx.ttl_seconds == 0 || idx.ttl_seconds > 30 * 24 * 3600 {
        return Err(err("index.ttl_seconds", "must be between 1 and 2592000"));
    }
    // The cache works in the filter's 100 ms clock units: 1..99 would round to 0 and
    // silently turn it off, so it is refused rather than guessed.
    if idx.local_cache_ms > 60_000 || (1..100).contains(&idx.local_cache_ms) {
        return Err(err(
            "index.local_cache_ms",
            "must be 0 (off) or between 100 and 60000 (100 ms resolution)",
        ));
    }
    if idx.cas_retries == 0 || idx.cas_retries > 64 {
        return Err(err("index.cas_retries", "must be between 1 and 64"));
    }
    Ok(())
}

/// `policy.*`.
fn check_policy(p: &PolicyConfig) -> Result<(), ConfigError> {
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

/// `load_poll.*`.
fn check_load_poll(lp: &LoadPollConfig) -> Result<(), ConfigError> {
    if lp.interval_ms > 60_000 {
        return Err(err("load_poll.interval_ms", "must be between 0 and 60000"));
    }
    if lp.no_traffic_interval_ms > 60_000 {
        return Err(err(
            "load_poll.no_traffic_interval_ms",
            "must be between 0 and 60000",
        ));
    }
    for (f, v) in [
        ("path", &lp.path),
        ("fallback_path", &lp.fallback_path),
        ("metrics_path", &lp.metrics_path),
    ] {
        if !v.starts_with('/') || v.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            return Err(err(
                format!("load_poll.{f}"),
                "must be a path starting with /",
            ));
        }
    }
    if lp.metrics_interval_ms > 600_000 {
        return Err(err(
            "load_poll.metrics_interval_ms",
            "must be between 0 and 600000",
        ));
    }
    if lp.cluster_suffix.bytes().any(|b| b.is_ascii_control()) {
        return Err(err("load_poll.cluster_suffix", "must be printable"));
    }
    if lp.timeout_ms == 0 || lp.timeout_ms > 60_000 {
        return Err(err("load_poll.timeout_ms", "must be between 1 and 60000"));
    }
    if lp.stale_ms < lp.interval_ms || lp.stale_ms > 600_000 {
        return Err(err(
            "load_poll.stale_ms",
            "must be at least interval_ms and at most 600000",
        ));
    }
    Ok(())
}

/// `peers.*`, and `peer_listener` (which needs `peers.secret`).
fn check_peers(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(p) = &raw.peers {
        if p.secret.len() < MIN_SECRET_LEN || p.secret.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
            return Err(err(
                "peers.secret",
                format!("must be at least {MIN_SECRET_LEN} printable characters"),
            ));
        }
        for (i, c) in p.clusters.iter().enumerate() {
            if c.is_empty() || c.bytes().any(|b| b.is_ascii_control()) {
                return Err(err(
                    format!("peers.clusters[{i}]"),
                    "must be a cluster name",
                ));
            }
        }
        if p.flush_ms == 0 || p.flush_ms > 60_000 {
            return Err(err("peers.flush_ms", "must be between 1 and 60000"));
        }
        if p.timeout_ms == 0 || p.timeout_ms > 60_000 {
            return Err(err("peers.timeout_ms", "must be between 1 and 60000"));
        }
        if p.max_batch == 0 || p.max_batch > 65_536 {
            return Err(err("peers.max_batch", "must be between 1 and 65536"));
        }
        if p.window_s == 0 || p.window_s > 3600 {
            return Err(err("peers.window_s", "must be between 1 and 3600"));
        }
        if p.max_records_per_s == 0 || p.max_records_per_s > 10_000_000 {
            return Err(err(
                "peers.max_records_per_s",
                "must be between 1 and 10000000",
            ));
        }
    } else if raw.peer_listener {
        return Err(err(
            "peer_listener",
            "needs `peers.secret` (the secret that authenticates peers' batches)",
        ));
    }
    Ok(())
}

/// `membership.*` and `destination_header`, checked only when a model is a pool.
fn check_membership(raw: &RawConfig, models: &[Model]) -> Result<(), ConfigError> {
    let mem = &raw.membership;
    if models.iter().any(|m| m.pool.is_some()) {
        if !valid_header_name(&raw.destination_header)
            || raw.destination_header == raw.cluster_header
            || raw.debug_header.as_ref() == Some(&raw.destination_header)
            || raw.tenant_header.as_ref() == Some(&raw.destination_header)
            || raw.destination_header == raw.prefill_cluster_header
        {
            return Err(err(
                "destination_header",
                "must be a lower-case header name distinct from the filter's other headers",
            ));
        }
        if mem.interval_ms > 0 {
            if mem.cluster.is_empty() || !mem.path.starts_with('/') {
                return Err(err(
                    "membership",
                    "needs a cluster and a path starting with /",
                ));
            }
            if !(100..=600_000).contains(&mem.interval_ms) {
                return Err(err(
                    "membership.interval_ms",
                    "must be 0 (off) or between 100 and 600000",
                ));
            }
            if mem.timeout_ms == 0 || mem.timeout_ms > 60_000 {
                return Err(err("membership.timeout_ms", "must be between 1 and 60000"));
            }
        }
    }
    Ok(())
}

fn check_block(field: &str, v: usize, max: usize) -> Result<(), ConfigError> {
    if v == 0 || v > max {
        return Err(err(field, format!("must be between 1 and {max}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = Config::from_json(br#"{"models":{"m":{"workers":["a","b"]}}}"#).unwrap();
        assert_eq!(c.default_model, 0);
        assert_eq!(c.cluster_header, "x-prefix-router-cluster");
        assert_eq!(c.models[0].text_block_bytes, 64);
        assert_eq!(c.models[0].token_block_size, 16);
        assert_eq!(c.index.capacity, 262_144);
        assert_eq!(c.index_buckets, 65_536);
        assert_eq!(c.policy.name, PolicyName::CacheAware);
        assert_eq!(c.policy.load_eps, 1.0);
        assert!(c.debug_header.is_none());
        assert_eq!((c.hash_key, c.tenant_header.as_deref()), (0, None));
        assert!(c.models[0].uniform_weights);
    }

    #[test]
    fn weighted_workers_and_overrides() {
        let c = Config::from_json(
            br#"{"models":{"m":{"workers":["a",{"cluster":"b","weight":2}],"token_block_size":32},
                 "n":{"workers":["c"]}},
                "default_model":"n","unknown_model":"reject","policy":{"name":"round_robin"}}"#,
        )
        .unwrap();
        assert_eq!(c.models[0].workers[1].weight, 2.0);
        assert!(!c.models[0].uniform_weights);
        assert_eq!(c.models[0].token_block_size, 32);
        assert_eq!(c.default_model, 1);
        assert_eq!(c.unknown_model, UnknownModel::Reject);
        assert_eq!(c.policy.name, PolicyName::RoundRobin);
    }

    fn field_of(json: &str) -> String {
        Config::from_json(json.as_bytes()).unwrap_err().field
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field_of(r#"{"models":{}}"#), "models");
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":[]}}}"#),
            "models.m.workers"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a","a"]}}}"#),
            "models.m.workers[1]"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":[{"cluster":"a","weight":0}]}}}"#),
            "models.m.workers[0].weight"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]},"n":{"workers":["b"]}}}"#),
            "default_model"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]}},"default_model":"x"}"#),
            "default_model"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]}},"cluster_header":"X-Bad"}"#),
            "cluster_header"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]}},"index":{"capacity":1}}"#),
            "index.capacity"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]}},"policy":{"load_eps":-1}}"#),
            "policy.load_eps"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]}},"text_block_bytes":0}"#),
            "text_block_bytes"
        );
        for ms in [1, 50, 99, 60_001] {
            assert_eq!(
                field_of(&format!(
                    r#"{{"models":{{"m":{{"workers":["a"]}}}},"index":{{"local_cache_ms":{ms}}}}}"#
                )),
                "index.local_cache_ms"
            );
        }
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["a"]}},"hash_key":"short"}"#),
            "hash_key"
        );
        assert_eq!(
            field_of(
                r#"{"models":{"m":{"workers":["a"]}},"tenant_header":"x-prefix-router-cluster"}"#
            ),
            "tenant_header"
        );
        for (peers, field) in [
            (r#""window_s":0"#, "peers.window_s"),
            (r#""window_s":3601"#, "peers.window_s"),
            (r#""max_records_per_s":0"#, "peers.max_records_per_s"),
            (r#""max_records_per_s":-5"#, "peers.max_records_per_s"),
            (r#""secret":"0123456789abcde""#, "peers.secret"),
        ] {
            let json = format!(
                r#"{{"models":{{"m":{{"workers":["a"]}}}},"peers":{{"secret":"0123456789abcdef",{peers}}}}}"#
            )
            .replace(r#""secret":"0123456789abcdef","secret""#, r#""secret""#);
            assert_eq!(field_of(&json), field, "{json}");
        }
        let c = Config::from_json(
            br#"{"models":{"m":{"workers":["a"]}},"peers":{"secret":"0123456789abcdef"}}"#,
        )
        .unwrap();
        let p = c.peers.unwrap();
        assert_eq!((p.window_s, p.max_records_per_s), (30, 20_000));
        let e = Config::from_json(br#"{"models":{"m":{"workers":["a"]}},"bogus":1}"#).unwrap_err();
        assert!(e.message.contains("bogus"), "{e}");
        assert_eq!(e.field, "bogus");
        let e = Config::from_json(br#"{"models":{"m":{"workers":["a"]}},"policy":{"name":"x"}}"#)
            .unwrap_err();
        assert!(e.message.contains("unknown variant"), "{e}");
        assert_eq!(e.field, "policy.name");
    }

    #[test]
    fn serde_errors_name_the_field() {
        const M: &str = r#""models":{"m":{"workers":["a"]}}"#;
        let cases = [
            // unknown fields, at every level
            (
                format!(r#"{{{M},"policy":{{"load_epz":1}}}}"#),
                "policy.load_epz",
            ),
            (
                format!(r#"{{{M},"index":{{"capacity":4096,"ttl":5}}}}"#),
                "index.ttl",
            ),
            (
                format!(r#"{{{M},"load_poll":{{"intervall_ms":5}}}}"#),
                "load_poll.intervall_ms",
            ),
            (
                r#"{"models":{"m":{"workers":["a"],"x":1}}}"#.to_string(),
                "models.m.x",
            ),
            // wrong types
            (
                format!(r#"{{{M},"policy":{{"load_eps":"high"}}}}"#),
                "policy.load_eps",
            ),
            (
                format!(r#"{{{M},"index":{{"capacity":-1}}}}"#),
                "index.capacity",
            ),
            (format!(r#"{{{M},"debug_header":7}}"#), "debug_header"),
            (format!(r#"{{{M},"peer_listener":"yes"}}"#), "peer_listener"),
            (format!(r#"{{{M},"policy":5}}"#), "policy"),
            (
                r#"{"models":{"m":{"workers":"a"}}}"#.to_string(),
                "models.m.workers",
            ),
            (
                r#"{"models":{"m":{"workers":["a",5]}}}"#.to_string(),
                "models.m.workers[1]",
            ),
            (
                r#"{"models":{"m":{"workers":["a",{"cluster":"b","weight":"2"}]}}}"#.to_string(),
                "models.m.workers[1].weight",
            ),
            // bad enum values, missing required fields
            (
                format!(r#"{{{M},"unknown_model":"drop"}}"#),
                "unknown_model",
            ),
            (format!(r#"{{{M},"peers":{{"clusters":[]}}}}"#), "peers"),
            (r#"{"policy":{}}"#.to_string(), "<root>"),
            // not an object, not JSON
            ("[]".to_string(), "<root>"),
            ("{".to_string(), "<root>"),
        ];
        for (json, field) in cases {
            let e = Config::from_json(json.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
        }
        // the message still says what is wrong, and where in the text
        let e = Config::from_json(format!(r#"{{{M},"policy":{{"load_epz":1}}}}"#).as_bytes())
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("invalid config field `policy.load_epz`: unknown field `load_epz`"),
            "{e}"
        );
        assert!(e.message.contains("line 1"), "{e}");
    }

    #[test]
    fn a_pool_model_is_validated_and_takes_its_members() {
        let pool = |p: &str| format!(r#"{{"models":{{"m":{{"pool":{p}}}}}}}"#);
        let c = Config::from_json(pool(r#"{"cluster":"m"}"#).as_bytes()).unwrap();
        let p = c.models[0].pool.as_ref().unwrap();
        assert_eq!(
            (p.load_cluster.as_str(), p.fallbacks, p.max_workers),
            ("m", 2, 64)
        );
        assert!(c.models[0].workers.is_empty());
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        for (bad, field) in [
            (r#"{"cluster":""}"#, "models.m.pool.cluster"),
            (
                r#"{"cluster":"m","fallbacks":17}"#,
                "models.m.pool.fallbacks",
            ),
            (
                r#"{"cluster":"m","max_workers":0}"#,
                "models.m.pool.max_workers",
            ),
        ] {
            assert_eq!(field_of(&pool(bad)), field, "{bad}");
        }
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":["w"],"pool":{"cluster":"m"}}}}"#),
            "models.m.pool"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"workers":[{"cluster":"w","address":"nope"}]}}}"#),
            "models.m.workers[0].address"
        );
        assert_eq!(
            field_of(
                r#"{"models":{"m":{"pool":{"cluster":"m"}}},"destination_header":"x-prefix-router-cluster"}"#
            ),
            "destination_header"
        );
        let members: Vec<crate::membership::Member> = (0..3)
            .map(|i| crate::membership::Member {
                address: format!("10.0.0.{i}:80"),
                weight: 1 + i,
                joined: 5,
            })
            .collect();
        let c = Config::from_json(pool(r#"{"cluster":"m","max_workers":2}"#).as_bytes()).unwrap();
        let next = crate::membership::with_members(&c, 0, &members).unwrap();
        let m = &next.models[0];
        assert_eq!(m.workers.len(), 2, "at most max_workers");
        assert_eq!(
            m.workers[1].id,
            worker_id("10.0.0.1:80"),
            "identity is the address"
        );
        assert_eq!(m.poll_clusters, vec!["m", "m"]);
        assert!(!m.uniform_weights);
        assert_eq!(m.total_weight, 3.0);
    }

    #[test]
    fn worker_ids_are_stable_and_nonzero() {
        assert_eq!(worker_id("w0"), worker_id("w0"));
        assert_ne!(worker_id("w0"), worker_id("w1"));
        assert_ne!(worker_id(""), 0);
    }
}
