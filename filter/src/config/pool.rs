//! A pool model's `pool`: the Envoy cluster whose healthy hosts are the model's workers
//! (`membership.rs`), validated into a [`Pool`].
//!
//! Invariants: a pool model has no `workers`, `prefill` or `decode`; its cluster names are
//! printable; fallbacks and the worker count are bounded. Costs: configuration time only.

use super::{err, ConfigError, RawModel, MAX_WORKERS_PER_MODEL};
use serde::Deserialize;

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

/// Validates a model's `pool` (exclusive with `workers`, `prefill` and `decode`).
pub(super) fn check_pool(
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

#[cfg(test)]
mod tests {
    use crate::config::{worker_id, Config};

    fn field_of(json: &str) -> String {
        Config::from_json(json.as_bytes()).unwrap_err().field
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
}
