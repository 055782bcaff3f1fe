//! `index`: the prefix index's size, entry lifetime, write retries and per-VM probe cache
//! (`index.rs`).
//!
//! Invariants: once [`check_index`] passed, the capacity is at least one bucket and every value
//! is in range; a probe-cache period the 100 ms clock would round to 0 is refused, not guessed.
//! Costs: configuration time only.

use super::{err, ConfigError};
use serde::Deserialize;

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

/// `index.*`.
pub(super) fn check_index(idx: &IndexConfig) -> Result<(), ConfigError> {
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
