//! Prefill/decode disaggregation (SGLang PD) inside Envoy: config, the body rewrite and the
//! decode choice.
//!
//! A PD model declares `prefill` workers (cluster, bootstrap host, bootstrap port) and `decode`
//! workers instead of `workers`. The model's routing workers *are* its prefill workers: the
//! prefix index, the cache-aware policy, the load ledger and the poller describe the prefill
//! workers' caches and load, unchanged. The decode workers form a hidden model (appended after
//! the configured ones, never matched by a request's `model`), so their in-flight and polled
//! loads live in the same ledger; a decode worker is the least loaded one, chosen and charged in
//! one CAS like any decision.
//!
//! Per request the filter then (1) rewrites the JSON body, inserting
//! `"bootstrap_host":..,"bootstrap_port":..,"bootstrap_room":<random 63-bit>` right after the
//! opening brace and dropping any top-level `bootstrap_*` member the client sent (the rest of
//! the body is copied verbatim, never re-serialised); (2) sets the cluster header to the decode
//! worker (the response the client gets) and the prefill header to the prefill worker, which a
//! route's `request_mirror_policies[].cluster_header` reads: Envoy mirrors the rewritten body
//! there and discards that answer.
//!
//! Invariants: a client never chooses either worker (both headers are removed on arrival and set
//! only here) nor a bootstrap field (its own are dropped: with duplicate keys JSON parsers
//! disagree on which wins). Costs: one pass over the body and one copy into a buffer reused
//! across requests (no allocation in steady state); a key with an escape is decoded once (rare:
//! allocates). The room comes from a per-VM splitmix64 stream seeded at start: unique per
//! request with overwhelming probability, not a secret (clients never reach the bootstrap port).

use crate::config::{err, valid_header_name, ConfigError, Model, RawModel, RawWorker};
use crate::policy::{self, Reason};
use crate::router::{Decision, Router};
use crate::store::Store;
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt::Write as _;

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
/// The body fields the filter owns.
pub const BOOTSTRAP_KEYS: [&[u8]; 3] = [b"bootstrap_host", b"bootstrap_port", b"bootstrap_room"];

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
            let (cluster, weight, address) = match w {
                RawWorker::Name(c) => (c.clone(), 1.0, None),
                RawWorker::Weighted {
                    cluster,
                    weight,
                    address,
                } => (cluster.clone(), *weight, address.clone()),
            };
            let wf = format!("{field}.decode[{i}]");
            if address
                .as_ref()
                .is_some_and(|a| !crate::membership::valid_address(a.as_bytes()))
            {
                return Err(err(format!("{wf}.address"), "must be IP:PORT"));
            }
            if cluster.is_empty() || cluster.bytes().any(|b| b.is_ascii_control()) {
                return Err(err(wf, "cluster must be a non-empty printable name"));
            }
            if !(weight.is_finite() && weight > 0.0 && weight <= 1e6) {
                return Err(err(format!("{wf}.weight"), "must be > 0 and <= 1e6"));
            }
            if prefill_model.workers.iter().any(|p| p.cluster == cluster) {
                return Err(err(wf, format!("`{cluster}` is also a prefill worker")));
            }
            let id = crate::config::worker_id(&cluster);
            if let Some(prev) = workers.iter().find(|p: &&crate::config::Worker| p.id == id) {
                let msg = if prev.cluster == cluster {
                    format!("duplicate cluster `{cluster}`")
                } else {
                    format!("`{cluster}` collides with `{}`; rename one", prev.cluster)
                };
                return Err(err(wf, msg));
            }
            workers.push(crate::config::Worker {
                cluster,
                weight,
                address,
                id,
            });
        }
        if workers.len() > crate::config::MAX_WORKERS_PER_MODEL {
            return Err(err(format!("{field}.decode"), "too many decode workers"));
        }
        let hidden = format!("{name}\u{0}decode");
        let decode = Model {
            index_key_prefix: format!("pr/i/{hidden}/"),
            load_key: format!("pr/l2/{hidden}"),
            poll_key: format!("pr/p2/{hidden}"),
            placed_key: format!("pr/np/{hidden}"),
            hits_key: format!("pr/h1/{hidden}"),
            peer_key: crate::config::worker_id(&hidden),
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

/// The body could not be rewritten (not a JSON object): answered 400, counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadBody;

/// Body rewriting state kept per VM (one buffer reused across requests).
pub struct Rewriter {
    pub out: Vec<u8>,
    rng: u64,
    /// Client-sent bootstrap members dropped by the last rewrite.
    pub dropped: u32,
}

impl Rewriter {
    pub fn new(seed: u64) -> Rewriter {
        Rewriter {
            out: Vec::with_capacity(64 * 1024),
            rng: seed,
            dropped: 0,
        }
    }

    /// Restarts the room stream from `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = seed;
    }

    /// A fresh room: 63 random bits (SGLang draws `random.randint(0, 2**63 - 1)`).
    pub fn room(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) >> 1
    }

    /// Writes `body` with `fields` + `room` inserted after the opening brace into `self.out`,
    /// dropping top-level `bootstrap_*` members (counted in `self.dropped`).
    pub fn rewrite(&mut self, body: &[u8], fields: &[u8], room: u64) -> Result<(), BadBody> {
        self.out.clear();
        self.dropped = 0;
        let mut i = ws(body, 0);
        if body.get(i) != Some(&b'{') {
            return Err(BadBody);
        }
        self.out.extend_from_slice(&body[..=i]);
        self.out.extend_from_slice(fields);
        let mut num = [0u8; 20];
        self.out.extend_from_slice(itoa(room, &mut num));
        i += 1;
        let mut first = true;
        loop {
            i = ws(body, i);
            match body.get(i) {
                Some(b'}') if first => break,
                Some(b'"') => {}
                _ => return Err(BadBody),
            }
            let key_start = i;
            let key_end = skip_string(body, i).ok_or(BadBody)?;
            i = ws(body, key_end);
            if body.get(i) != Some(&b':') {
                return Err(BadBody);
            }
            i = ws(body, i + 1);
            let value_end = skip_value(body, i).ok_or(BadBody)?;
            if is_bootstrap_key(&body[key_start..key_end]) {
                self.dropped += 1;
            } else {
                self.out.push(b',');
                self.out.extend_from_slice(&body[key_start..value_end]);
            }
            i = ws(body, value_end);
            first = false;
            match body.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => break,
                _ => return Err(BadBody),
            }
        }
        // the closing brace and whatever follows it (the worker judges trailing bytes)
        self.out.extend_from_slice(&body[i..]);
        Ok(())
    }
}

fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `b[i]` is a quote: the index after the closing quote.
fn skip_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// The index after the JSON value starting at `b[i]` (structure only: scalars are taken up to
/// the next delimiter; the worker validates them).
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// Is this quoted key (quotes included) one of [`BOOTSTRAP_KEYS`], escapes decoded?
fn is_bootstrap_key(quoted: &[u8]) -> bool {
    let inner = &quoted[1..quoted.len().saturating_sub(1).max(1)];
    if !inner.contains(&b'\\') {
        return BOOTSTRAP_KEYS.contains(&inner);
    }
    match serde_json::from_slice::<String>(quoted) {
        Ok(k) => BOOTSTRAP_KEYS.contains(&k.as_bytes()),
        // an undecodable key: the worker refuses the body anyway; drop it to be safe
        Err(_) => true,
    }
}

/// The decode half of a PD decision: the least loaded decode worker of the model `prefill`
/// routed to, chosen and charged in one CAS: one request and the body's estimated tokens
/// (`body_len / chars_per_token`, capped at `policy.max_request_tokens` like every other charge,
/// so a junk field cannot inflate a decode worker's load). `None` when the model is not a PD
/// model.
pub fn decode_decision<S: Store>(
    r: &mut Router,
    store: &S,
    prefill: &Decision,
    body_len: usize,
    now: u32,
) -> Option<Decision> {
    let dm = r
        .cfg
        .models
        .get(usize::from(prefill.model))?
        .pd
        .as_ref()?
        .decode_model;
    let start = (r.pd.room() & 0xffff) as usize;
    let tokens = r.cfg.policy.body_tokens(body_len).max(1);
    let (w, tok, ()) = r.ledger.decide(store, &r.cfg, dm, now, |reqs, toks, _| {
        (policy::least_loaded(reqs, toks, start), tokens, ())
    });
    Some(Decision::uncharged(dm, w, Reason::LoadSpill).with_charge(1, tok))
}

/// Rewrites `body` for the prefill worker of `prefill` into `r.pd.out`. `None`: not a PD model.
pub fn rewrite_for(r: &mut Router, prefill: &Decision, body: &[u8]) -> Option<Result<(), BadBody>> {
    let pd = r.cfg.models.get(usize::from(prefill.model))?.pd.as_ref()?;
    let fields = pd.fields.get(usize::from(prefill.worker))?;
    let room = r.pd.room();
    Some(r.pd.rewrite(body, fields, room))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::request::Endpoint;
    use crate::router::Outcome;
    use crate::store::MemStore;
    use serde_json::Value;

    fn rw(body: &str) -> Result<Value, BadBody> {
        let mut r = Rewriter::new(7);
        r.rewrite(
            body.as_bytes(),
            br#""bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":"#,
            42,
        )?;
        Ok(serde_json::from_slice(&r.out).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&r.out));
        }))
    }

    #[test]
    fn inserts_fields_after_the_brace_and_keeps_the_rest_verbatim() {
        let body =
            r#" {"model":"m","messages":[{"role":"user","content":"hi, {\"x\":1}"}],"n":1.5e3} "#;
        let mut r = Rewriter::new(1);
        r.rewrite(
            body.as_bytes(),
            br#""bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":"#,
            9,
        )
        .unwrap();
        let out = String::from_utf8(r.out.clone()).unwrap();
        assert_eq!(
            out,
            r#" {"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":9,"model":"m","messages":[{"role":"user","content":"hi, {\"x\":1}"}],"n":1.5e3} "#
        );
        let v = rw(r#"{}"#).unwrap();
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v.as_object().unwrap().len(), 3);
    }

    #[test]
    fn client_bootstrap_fields_never_pass() {
        let v = rw(r#"{"bootstrap_room":1,"prompt":"x","bootstrap_host":"evil","bootstrap_port":[1,{"a":"}"}]}"#).unwrap();
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v["bootstrap_host"], "10.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["prompt"], "x");
        assert_eq!(v.as_object().unwrap().len(), 4);
        // an escaped key decodes to the same name: dropped too
        let mut r = Rewriter::new(1);
        r.rewrite(
            br#"{"bootstrap\u005froom":5,"a":1}"#,
            b"\"bootstrap_room\":",
            3,
        )
        .unwrap();
        assert_eq!(r.dropped, 1);
        assert_eq!(r.out, br#"{"bootstrap_room":3,"a":1}"#);
        // nested bootstrap keys belong to the client's data: kept
        let v = rw(r#"{"extra":{"bootstrap_room":1}}"#).unwrap();
        assert_eq!(v["extra"]["bootstrap_room"], 1);
    }

    #[test]
    fn non_objects_are_refused() {
        for b in [
            "",
            "[]",
            "\"x\"",
            "{",
            "{\"a\"}",
            "{\"a\":1,}",
            "{\"a\":\"",
            "{\"a\":1 \"b\":2}",
            "{,}",
        ] {
            assert_eq!(rw(b), Err(BadBody), "{b:?}");
        }
    }

    #[test]
    fn rooms_are_63_bit_and_distinct() {
        let mut r = Rewriter::new(123);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let room = r.room();
            assert!(room < 1 << 63);
            assert!(seen.insert(room));
        }
    }

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

    #[test]
    fn two_vms_configured_at_the_same_clock_reading_draw_different_rooms() {
        let store = MemStore::default();
        let body = br#"{"model":"m","prompt":"hello"}"#;
        let mut rooms = std::collections::HashSet::new();
        for _ in 0..2 {
            // the same seed: Envoy may hand two worker threads' VMs the same time
            let mut r = Router::new(Config::from_json(PD.as_bytes()).unwrap(), 5);
            r.init_store(&store);
            for _ in 0..64 {
                let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
                    panic!("rejected");
                };
                assert!(rewrite_for(&mut r, &p, body).unwrap().is_ok());
                let v: Value = serde_json::from_slice(&r.pd.out).unwrap();
                assert!(
                    rooms.insert(v["bootstrap_room"].as_u64().unwrap()),
                    "a room repeats"
                );
                r.release(&store, &p);
            }
        }
    }

    /// A router over the `PD` model and its store.
    fn pd_router() -> (Router, MemStore) {
        let store = MemStore::default();
        let mut r = Router::new(Config::from_json(PD.as_bytes()).unwrap(), 5);
        r.init_store(&store);
        (r, store)
    }

    #[test]
    fn prefill_by_cache_and_load_decode_by_load_both_released() {
        let (mut r, store) = pd_router();
        let body = br#"{"model":"m","prompt":"a long shared prefix that spans several blocks of text for the index to remember it, twice over and over again"}"#;
        // one at a time: the same prompt stays on its prefill worker (prefix hit)
        let mut prefills = Vec::new();
        for _ in 0..4 {
            let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
                panic!("rejected");
            };
            // The index records once the response is a 2xx (router::Router::commit).
            if let Some(plan) = r.take_plan() {
                r.commit(&store, &plan, 200, 10);
            }
            let d = decode_decision(&mut r, &store, &p, 400, 10).unwrap();
            assert_eq!(usize::from(d.model), 1);
            assert!(rewrite_for(&mut r, &p, body).unwrap().is_ok());
            let v: Value = serde_json::from_slice(&r.pd.out).unwrap();
            assert_eq!(v["model"], "m");
            assert!(v["bootstrap_room"].as_u64().unwrap() < 1 << 63);
            prefills.push((p.worker, p.reason));
            r.release(&store, &p);
            r.release(&store, &d);
        }
        assert!(
            prefills.iter().all(|w| w.0 == prefills[0].0),
            "{prefills:?}"
        );
        assert_eq!(prefills[3].1, Reason::PrefixHit);
        // held together: decode spreads by load, two each
        let mut held = Vec::new();
        for _ in 0..4 {
            let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
                panic!("rejected");
            };
            let d = decode_decision(&mut r, &store, &p, 400, 10).unwrap();
            held.push((p, d));
        }
        let on0 = held.iter().filter(|(_, d)| d.worker == 0).count();
        assert_eq!(on0, 2);
        for (p, d) in &held {
            r.release(&store, p);
            r.release(&store, d);
        }
        r.flush_pending(&store);
        for mi in 0..2 {
            let (reqs, toks) = r.ledger.view(&store, &r.cfg, mi, 10);
            assert!(reqs.iter().all(|&x| x == 0), "model {mi}: {reqs:?}");
            assert!(toks.iter().all(|&x| x == 0), "model {mi}: {toks:?}");
        }
        // a non-PD model has no decode half
        let c = Config::from_json(br#"{"models":{"m":{"workers":["a"]}}}"#).unwrap();
        let mut r = Router::new(c, 5);
        r.init_store(&store);
        let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
            panic!()
        };
        assert!(decode_decision(&mut r, &store, &p, 1, 10).is_none());
        assert!(rewrite_for(&mut r, &p, body).is_none());
    }

    #[test]
    fn a_client_cannot_inflate_the_decode_charge() {
        let (mut r, store) = pd_router();
        let body = br#"{"model":"m","prompt":"hello"}"#;
        let Outcome::Route(p) = r.route(&store, Endpoint::Completions, body, 10) else {
            panic!("rejected");
        };
        // A 16 MiB body (a junk field): charged at most max_request_tokens, not 4M tokens.
        let d = decode_decision(&mut r, &store, &p, 16 << 20, 10).unwrap();
        assert_eq!(d.charged_tokens, r.cfg.policy.max_request_tokens);
        r.release(&store, &p);
        r.release(&store, &d);
    }
}
