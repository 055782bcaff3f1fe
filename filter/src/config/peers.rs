//! `peers` and `peer_listener`: the other Envoy replicas that receive this replica's index
//! records (`peers.rs`).
//!
//! Invariants: a peers section has a secret that passes `secrets::check_secret` and bounded
//! batches, windows and rates; a peer listener without a secret is refused. Costs:
//! configuration time only.

use super::secrets::check_secret;
use super::{err, ConfigError, RawConfig};
use serde::Deserialize;

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

/// `peers.*`, and `peer_listener` (which needs `peers.secret`).
pub(super) fn check_peers(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(p) = &raw.peers {
        check_secret("peers.secret", &p.secret)?;
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
