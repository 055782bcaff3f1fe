//! `models`: each model as written and as validated (its workers, block sizes, every
//! shared-data key), and what a request for an unknown model gets.
//!
//! Invariants: at least one model; each has its workers (or a pool, or PD workers, see
//! `config/pd.rs`), at most [`MAX_WORKERS_PER_MODEL`], pairwise distinct by id; block sizes are
//! in range; the default model exists. Costs: configuration time only.

use super::pool::{check_pool, RawPool};
use super::{check_distinct, check_worker, err, pd, worker_id, Pool, RawWorker, Worker};
use super::{ConfigError, RawConfig, INDEX_KEY_PREFIX, MAX_BLOCK_BYTES, MAX_PROMPT_BLOCKS};
use super::{MAX_TOKEN_BLOCK, MAX_WORKERS_PER_MODEL};
use serde::Deserialize;

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

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum UnknownModel {
    /// Route to the default model's workers (reason `fallback`).
    #[default]
    Default,
    /// Answer 404 with an OpenAI-style error body.
    Reject,
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
    /// Identity of this model's placements in peer record batches (`placements.rs`; hash of the
    /// name and a suffix, so a replica without placements ignores them as an unknown model).
    pub placed_peer_key: u32,
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

/// `models`, `default_model` and the block sizes: the configured models in name order, then
/// the PD models' hidden decode models (`config/pd.rs`); and the default model's position.
pub(super) fn check_models(raw: &RawConfig) -> Result<(Vec<Model>, usize), ConfigError> {
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
            poll_key: format!("pr/p3/{name}"),
            placed_key: format!("pr/np/{name}"),
            hits_key: format!("pr/h3/{name}"),
            peer_key: worker_id(name),
            placed_peer_key: worker_id(&format!("{name}\u{0}placed")),
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

fn check_block(field: &str, v: usize, max: usize) -> Result<(), ConfigError> {
    if v == 0 || v > max {
        return Err(err(field, format!("must be between 1 and {max}")));
    }
    Ok(())
}
