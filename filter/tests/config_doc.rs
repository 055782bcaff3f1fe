//! The plugin configuration example in `docs/configuration.md` against the code: it parses and
//! validates (`Config::from_json`), it names every field of every section (compared with the
//! field lists serde derives for the `Raw*` / `*Config` structs), and every value outside
//! `models` and `peers` is the default (the whole example, with `peers` removed, deserializes to
//! the same `RawConfig` as a config that gives only its models).

use prefix_router::config::pd::RawPrefill;
use prefix_router::config::{
    Config, IndexConfig, LoadPollConfig, MembershipConfig, PeersConfig, PolicyConfig, RawConfig,
    RawModel, RawPool,
};
use serde::de::{self, DeserializeOwned, Visitor};
use serde_json::{json, Value};
use std::collections::BTreeSet;

const DOC: &str = include_str!("../../docs/configuration.md");

/// The first ```json block after the "## Plugin configuration" heading.
fn doc_example() -> Value {
    let section = &DOC[DOC
        .find("## Plugin configuration")
        .expect("docs/configuration.md has a \"## Plugin configuration\" section")..];
    let start = section.find("```json\n").expect("a ```json block") + "```json\n".len();
    let end = start + section[start..].find("\n```").expect("the block ends");
    serde_json::from_str(&section[start..end]).expect("the example is JSON")
}

/// A deserializer that only records the field names serde derived for a struct.
struct FieldsOf;

#[derive(Debug)]
struct Fields(&'static [&'static str]);

impl std::fmt::Display for Fields {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}
impl std::error::Error for Fields {}
impl de::Error for Fields {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        panic!("not a struct: {msg}")
    }
}

impl<'de> de::Deserializer<'de> for FieldsOf {
    type Error = Fields;
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Fields> {
        Err(Fields(fields))
    }
    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Fields> {
        panic!("not a struct")
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

fn fields<T: DeserializeOwned>() -> BTreeSet<&'static str> {
    match T::deserialize(FieldsOf) {
        Err(Fields(f)) => f.iter().copied().collect(),
        Ok(_) => unreachable!(),
    }
}

/// The union of the keys of `objects` (the example may spread a struct's fields over several
/// instances, e.g. worker forms over several models).
fn keys<'a>(objects: impl IntoIterator<Item = &'a Value>) -> BTreeSet<&'a str> {
    objects
        .into_iter()
        .flat_map(|o| o.as_object().expect("an object").keys())
        .map(String::as_str)
        .collect()
}

fn assert_lists_all(what: &str, listed: BTreeSet<&str>, expected: BTreeSet<&'static str>) {
    let missing: Vec<_> = expected.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&expected).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/configuration.md example, {what}: missing {missing:?}, unknown {unknown:?}"
    );
}

#[test]
fn the_documented_example_is_a_valid_config() {
    let doc = doc_example();
    let text = serde_json::to_vec(&doc).unwrap();
    // `peers.secret` is a placeholder the filter accepts (16+ printable characters, no space).
    if let Err(e) = Config::from_json(&text) {
        panic!("docs/configuration.md example: {e}");
    }
}

#[test]
fn the_documented_example_lists_every_field() {
    let doc = doc_example();
    let models: Vec<&Value> = doc["models"].as_object().unwrap().values().collect();
    assert_lists_all("top level", keys([&doc]), fields::<RawConfig>());
    assert_lists_all(
        "models.<m>",
        keys(models.iter().copied()),
        fields::<RawModel>(),
    );
    for (section, expected) in [
        ("index", fields::<IndexConfig>()),
        ("policy", fields::<PolicyConfig>()),
        ("load_poll", fields::<LoadPollConfig>()),
        ("peers", fields::<PeersConfig>()),
        ("membership", fields::<MembershipConfig>()),
    ] {
        assert_lists_all(section, keys([&doc[section]]), expected);
    }
    let pools = models.iter().filter_map(|m| m.get("pool"));
    assert_lists_all("models.<m>.pool", keys(pools), fields::<RawPool>());
    let prefill = models
        .iter()
        .filter_map(|m| m.get("prefill"))
        .flat_map(|p| p.as_array().unwrap());
    assert_lists_all(
        "models.<m>.prefill[]",
        keys(prefill),
        fields::<RawPrefill>(),
    );
    // `RawWorker` is an untagged enum (a name or an object), whose object form serde does not
    // describe as a struct: its fields are spelled here.
    let worker_objects = models
        .iter()
        .flat_map(|m| ["workers", "decode"].map(|k| m.get(k)))
        .flatten()
        .flat_map(|w| w.as_array().unwrap())
        .filter(|w| w.is_object());
    assert_lists_all(
        "models.<m>.workers[]",
        keys(worker_objects),
        ["cluster", "weight", "address"].into(),
    );
}

/// Asserts that `shown` and `bare` (the same section with only its required fields) read as the
/// same `T`: every other field `shown` lists has its default.
fn assert_defaults<T: DeserializeOwned + std::fmt::Debug>(what: &str, shown: &Value, bare: &Value) {
    let read = |v: &Value| format!("{:?}", serde_json::from_value::<T>(v.clone()).unwrap());
    assert_eq!(
        read(shown),
        read(bare),
        "docs/configuration.md example, {what}: a value differs from its default"
    );
}

#[test]
fn the_documented_example_shows_the_defaults() {
    let doc = doc_example();
    // Everything outside `models` and `peers`: the example without `peers` reads as a config
    // that gives only the models (and the default model, required with several).
    let mut without_peers = doc.clone();
    without_peers.as_object_mut().unwrap().remove("peers");
    let minimal = json!({"models": doc["models"], "default_model": doc["default_model"]});
    assert_defaults::<RawConfig>("outside `models`", &without_peers, &minimal);
    // `peers`: every field but the required secret (and the example's clusters) is the default.
    let peers = &doc["peers"];
    let bare = json!({"secret": peers["secret"], "clusters": peers["clusters"]});
    assert_defaults::<PeersConfig>("`peers`", peers, &bare);
    // Pools and PD prefill workers show their defaults too (the load cluster is the example's).
    for m in doc["models"].as_object().unwrap().values() {
        if let Some(pool) = m.get("pool") {
            let bare = json!({"cluster": pool["cluster"], "load_cluster": pool["load_cluster"]});
            assert_defaults::<RawPool>("`pool`", pool, &bare);
        }
        for p in m
            .get("prefill")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let bare = json!({"cluster": p["cluster"], "bootstrap_host": p["bootstrap_host"]});
            assert_defaults::<RawPrefill>("`prefill`", p, &bare);
        }
    }
}
