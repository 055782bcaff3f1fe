//! `load_poll`: polling every worker's own load and token counters (`poll.rs`, `hits.rs`).
//!
//! Invariants: once [`check_load_poll`] passed, every period and timeout is in range, every path
//! starts with `/`, and a worker's load goes stale no sooner than the next poll is due.
//! Costs: configuration time only.

use super::{err, ConfigError};
use serde::Deserialize;

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

/// `load_poll.*`.
pub(super) fn check_load_poll(lp: &LoadPollConfig) -> Result<(), ConfigError> {
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
