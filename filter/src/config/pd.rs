//! A prefill/decode (SGLang PD) model's configuration: its `prefill` and `decode` workers, the
//! hidden decode model, the prefill header.
//!
//! A PD model declares `prefill` workers (cluster, bootstrap host, bootstrap port) and `decode`
//! workers instead of `workers`. The model's routing workers *are* its prefill workers: the
//! prefix index, the cache-aware policy, the load ledger and the poller describe the prefill
//! workers' caches and load, unchanged. The decode workers form a hidden model (appended after
//! the configured ones, never matched by a request's `model`), so their in-flight and polled
//! loads live in the same ledger. What a request does with it: the body rewrite in
//! `pd_body.rs`, the decode choice in `Router::decode_decision`.
//!
//! Invariants: a model has either `workers` or both `prefill` and `decode`; no cluster is both a
//! prefill and a decode worker; every error names the field. The bootstrap fields are rendered
//! once here (JSON-escaped), so a request only copies them. Costs: configuration time only.

use super::{check_distinct, check_worker, err, valid_header_name, worker_id};
use super::{ConfigError, Model, RawModel, RawWorker, MAX_WORKERS_PER_MODEL};
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt::Write as _;

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// One prefill worker as written in the config.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawPrefill {
    pub cluster: String,
    /// The prefill worker's host as the decode workers reach it.
    pub bootstrap_host: String,
    #[serde(default = "default_bootstrap_port")]
    pub bootstrap_port: u16,
}

fn default_bootstrap_port() -> u16 {
    DEFAULT_BOOTSTRAP_PORT
}

/// Default of `prefill_cluster_header`.
pub fn default_prefill_header() -> String {
    "x-prefix-router-prefill-cluster".into()
}

/// A PD model's validated extra state.
#[derive(Debug, Clone)]
pub struct Pd {
    /// Per prefill worker (same order as the model's `workers`): the rendered
    /// `"bootstrap_host":"..","bootstrap_port":N,"bootstrap_room":` prefix.
    pub fields: Vec<Vec<u8>>,
    /// Index of the hidden model holding the decode workers.
    pub decode_model: usize,
}

/// The workers a model routes over and the config key they came from: `workers`, or for a PD
/// model its `prefill` clusters. Errors name the field.
pub fn routing_workers<'a>(
    field: &str,
    m: &'a RawModel,
) -> Result<(Cow<'a, [RawWorker]>, &'static str), ConfigError> {
    let pd = !m.prefill.is_empty() || !m.decode.is_empty();
    if !pd {
        return Ok((Cow::Borrowed(&m.workers), "workers"));
    }
    if !m.workers.is_empty() {
        return Err(err(
            format!("{field}.workers"),
            "a model has either `workers` or `prefill` + `decode`",
        ));
    }
    if m.prefill.is_empty() {
        return Err(err(
            format!("{field}.prefill"),
            "at least one prefill worker",
        ));
    }
    if m.decode.is_empty() {
        return Err(err(format!("{field}.decode"), "at least one decode worker"));
    }
    let ws = m
        .prefill
        .iter()
        .map(|p| RawWorker::Name(p.cluster.clone()))
        .collect();
    Ok((Cow::Owned(ws), "prefill"))
}

/// Validates the PD parts of every PD model and appends their hidden decode models; `models`
/// are the validated models in `raw` order. Call after `default_model` is resolved.
pub fn add_decode_models<'a>(
    raw: impl Iterator<Item = (&'a String, &'a RawModel)>,
    models: &mut Vec<Model>,
    poll_suffix: &str,
) -> Result<(), ConfigError> {
    let configured = models.len();
    for (mi, (name, m)) in raw.enumerate().take(configured) {
        if m.prefill.is_empty() {
            continue;
        }
        let field = format!("models.{name}");
        let mut fields = Vec::with_capacity(m.prefill.len());
        for (i, p) in m.prefill.iter().enumerate() {
            let host = &p.bootstrap_host;
            if host.is_empty() || host.bytes().any(|b| b.is_ascii_control() || b == b' ') {
                return Err(err(
                    format!("{field}.prefill[{i}].bootstrap_host"),
                    "must be a non-empty host name or address",
                ));
            }
            if p.bootstrap_port == 0 {
                return Err(err(
                    format!("{field}.prefill[{i}].bootstrap_port"),
                    "must be between 1 and 65535",
                ));
            }
            let mut f = Vec::with_capacity(host.len() + 64);
            f.extend_from_slice(b"\"bootstrap_host\":");
            // serde_json escapes the host as a JSON string
            f.extend_from_slice(&serde_json::to_vec(host).unwrap_or_else(|_| b"\"\"".to_vec()));
            let mut tail = String::new();
            let _ = write!(
                tail,
                ",\"bootstrap_port\":{},\"bootstrap_room\":",
                p.bootstrap_port
            );
            f.extend_from_slice(tail.as_bytes());
            fields.push(f);
        }
        let Some(prefill_model) = models.get(mi) else {
            continue;
        };
        let mut workers = Vec::with_capacity(m.decode.len());
        for (i, w) in m.decode.iter().enumerate() {
            let wf = format!("{field}.decode[{i}]");
            let worker = check_worker(&wf, w)?;
            let cluster = &worker.cluster;
            if prefill_model.workers.iter().any(|p| p.cluster == *cluster) {
                return Err(err(wf, format!("`{cluster}` is also a prefill worker")));
            }
            check_distinct(&wf, &workers, &worker)?;
            workers.push(worker);
        }
        if workers.len() > MAX_WORKERS_PER_MODEL {
            return Err(err(format!("{field}.decode"), "too many decode workers"));
        }
        let hidden = format!("{name}\u{0}decode");
        let decode = Model {
            index_key_prefix: format!("pr/i/{hidden}/"),
            load_key: format!("pr/l2/{hidden}"),
            poll_key: format!("pr/p3/{hidden}"),
            placed_key: format!("pr/np/{hidden}"),
            hits_key: format!("pr/h3/{hidden}"),
            peer_key: worker_id(&hidden),
            placed_peer_key: worker_id(&format!("{hidden}\u{0}placed")),
            poll_clusters: workers
                .iter()
                .map(|w| format!("{}{}", w.cluster, poll_suffix))
                .collect(),
            uniform_weights: workers.iter().all(|w| w.weight == workers[0].weight),
            total_weight: workers.iter().map(|w| w.weight).sum(),
            name: hidden,
            workers,
            pd: None,
            decode_of: Some(mi),
            ..prefill_model.clone()
        };
        let decode_model = models.len();
        models.push(decode);
        if let Some(pm) = models.get_mut(mi) {
            pm.pd = Some(Pd {
                fields,
                decode_model,
            });
        }
    }
    Ok(())
}

/// Validates `prefill_cluster_header` against the other header names.
pub fn check_header(h: &str, cluster_header: &str, debug: Option<&str>) -> Result<(), ConfigError> {
    if !valid_header_name(h) || h == cluster_header || Some(h) == debug {
        return Err(err(
            "prefill_cluster_header",
            "must be a lower-case header name distinct from cluster_header and debug_header",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const PD: &str = r#"{"models":{"m":{
        "prefill":[{"cluster":"p0","bootstrap_host":"10.0.0.1","bootstrap_port":9001},
                   {"cluster":"p1","bootstrap_host":"10.0.0.2"}],
        "decode":["d0","d1"]}}}"#;

    #[test]
    fn config_declares_prefill_and_decode_workers() {
        let c = Config::from_json(PD.as_bytes()).unwrap();
        assert_eq!(c.models.len(), 2);
        let m = &c.models[0];
        assert_eq!(m.workers.len(), 2);
        assert_eq!(m.workers[1].cluster, "p1");
        let pd = m.pd.as_ref().unwrap();
        assert_eq!(pd.decode_model, 1);
        assert_eq!(
            pd.fields[1],
            br#""bootstrap_host":"10.0.0.2","bootstrap_port":8998,"bootstrap_room":"#.to_vec()
        );
        assert_eq!(c.models[1].workers[0].cluster, "d0");
        assert_eq!(c.models[1].decode_of, Some(0));
        // the hidden decode model is never chosen by a request's model name
        assert_eq!(c.model_index(c.models[1].name.as_bytes()), None);
        assert_eq!(c.model_index(b"m"), Some(0));
        assert_eq!(c.default_model, 0);
        assert_eq!(c.prefill_cluster_header, "x-prefix-router-prefill-cluster");
    }

    fn field_of(json: &str) -> String {
        Config::from_json(json.as_bytes()).unwrap_err().field
    }

    #[test]
    fn pd_config_errors_name_the_field() {
        let p = r#"[{"cluster":"p0","bootstrap_host":"h"}]"#;
        assert_eq!(
            field_of(&format!(r#"{{"models":{{"m":{{"prefill":{p}}}}}}}"#)),
            "models.m.decode"
        );
        assert_eq!(
            field_of(r#"{"models":{"m":{"decode":["d"]}}}"#),
            "models.m.prefill"
        );
        assert_eq!(
            field_of(&format!(
                r#"{{"models":{{"m":{{"workers":["w"],"prefill":{p},"decode":["d"]}}}}}}"#
            )),
            "models.m.workers"
        );
        assert_eq!(
            field_of(
                r#"{"models":{"m":{"prefill":[{"cluster":"p0","bootstrap_host":""}],"decode":["d"]}}}"#
            ),
            "models.m.prefill[0].bootstrap_host"
        );
        assert_eq!(
            field_of(
                r#"{"models":{"m":{"prefill":[{"cluster":"p0","bootstrap_host":"h","bootstrap_port":0}],"decode":["d"]}}}"#
            ),
            "models.m.prefill[0].bootstrap_port"
        );
        assert_eq!(
            field_of(&format!(
                r#"{{"models":{{"m":{{"prefill":{p},"decode":["d","d"]}}}}}}"#
            )),
            "models.m.decode[1]"
        );
        assert_eq!(
            field_of(&format!(
                r#"{{"models":{{"m":{{"prefill":{p},"decode":["p0"]}}}}}}"#
            )),
            "models.m.decode[0]"
        );
        assert_eq!(
            field_of(&format!(
                r#"{{"models":{{"m":{{"prefill":{p},"decode":["d"]}}}},"prefill_cluster_header":"x-prefix-router-cluster"}}"#
            )),
            "prefill_cluster_header"
        );
        let e = Config::from_json(
            br#"{"models":{"m":{"prefill":[{"cluster":"p","bootstrap_host":"h","port":1}],"decode":["d"]}}}"#,
        )
        .unwrap_err();
        assert!(e.message.contains("port"), "{e}");
    }
}
