//! Typed plugin configuration, validated once in `on_configure`: the raw document
//! ([`RawConfig`]), the validated [`Config`], and the entry point between them.
//!
//! One concept per file under `config/`, each with its section's raw struct, its defaults (the
//! `default_*` functions) and its check: `models.rs`, `workers.rs`, `pool.rs`, `pd.rs`,
//! `index.rs`, `policy.rs` (and `cost.rs`), `load_poll.rs`, `peers.rs`, `membership.rs`,
//! `headers.rs`, `secrets.rs`, `error.rs`; the top-level defaults are here. The example in
//! `docs/configuration.md` lists every field with its default, and `filter/tests/config_doc.rs`
//! checks it against these. Every public item is re-exported here (`crate::config::X`).
//!
//! Invariants: [`Config::validate`] checks one section per function, in a fixed order, and every
//! error names the offending field as the operator wrote it; a [`Config`] that exists is valid.
//! This layer imports no runtime module (the shared-data keys of every model are named in
//! `models.rs`). Costs: configuration time only.

pub mod cost;
mod error;
mod headers;
mod index;
mod load_poll;
mod membership;
mod models;
pub mod pd;
mod peers;
mod policy;
mod pool;
mod secrets;
mod workers;

pub(crate) use error::err;
pub use error::ConfigError;
pub(crate) use headers::valid_header_name;
pub use index::IndexConfig;
pub use load_poll::LoadPollConfig;
pub use membership::MembershipConfig;
pub use models::{Model, RawModel, UnknownModel};
pub use peers::{PeersConfig, PEER_PATH};
pub use policy::{PolicyConfig, PolicyName};
pub use pool::{Pool, RawPool};
pub use secrets::MIN_SECRET_LEN;
pub(crate) use workers::{check_distinct, check_worker};
pub use workers::{valid_address, worker_id, RawWorker, Worker};

use headers::{check_headers, check_tenant_header};
use index::check_index;
use load_poll::check_load_poll;
use membership::check_membership;
use models::check_models;
use peers::check_peers;
use policy::check_policy;
use secrets::{check_hash_key, derive_hash_key};
use serde::Deserialize;
use std::collections::BTreeMap;

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
    #[serde(default = "headers::default_cluster_header")]
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
    #[serde(default = "headers::default_destination_header")]
    pub destination_header: String,
    /// How pool models learn their hosts (`membership.rs`).
    #[serde(default)]
    pub membership: MembershipConfig,
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

/// `passthrough_cluster`: a name when set.
fn check_passthrough(raw: &RawConfig) -> Result<(), ConfigError> {
    if let Some(p) = &raw.passthrough_cluster {
        if p.is_empty() {
            return Err(err("passthrough_cluster", "must not be empty"));
        }
    }
    Ok(())
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
        assert_eq!(c.policy.name, PolicyName::CostAware);
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
}
