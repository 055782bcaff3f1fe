//! `membership`: where pool models learn their hosts (Envoy's admin `/clusters`,
//! `membership.rs`), and the `destination_header` a pool model's choice travels in.
//!
//! Invariants: checked only when some model is a pool; then the destination header is distinct
//! from the filter's other headers and a membership poll that is on has a cluster, a path and
//! periods in range. Costs: configuration time only.

use super::{err, valid_header_name, ConfigError, Model, RawConfig};
use serde::Deserialize;

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

/// `membership.*` and `destination_header`, checked only when a model is a pool.
pub(super) fn check_membership(raw: &RawConfig, models: &[Model]) -> Result<(), ConfigError> {
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
