//! A worker's answer to a load poll, read in one pass: the summed in-flight requests, queued
//! prompt tokens and running-request capacity of its data-parallel ranks.
//!
//! Shapes accepted (SGLang's two load endpoints): `/v1/loads` — `{"loads":[rank...], ...}` or a
//! bare list of ranks, where a rank's requests are `num_running_reqs + num_waiting_reqs` and its
//! tokens `num_waiting_uncached_tokens`, its capacity `max_running_requests` — and `/get_load` —
//! `[{"num_reqs","num_tokens"}...]`, where `num_reqs` already counts the waiting ones and no
//! capacity is reported (0: unknown; `poll.rs` reads it from the server info) nor queued prefill
//! (0: its `num_tokens` is the KV in use plus the waiting prompts, mostly running requests'
//! context, not work queued ahead of a new request; the queued prefill the policy sees is then
//! what this Envoy sent and has not had its first token). An object without a `loads` list is itself
//! one rank. A rank counts when it has `num_running_reqs` or `num_reqs` as a non-negative
//! integer; a field of another type counts as missing. An answer with no counted rank, or that is
//! not JSON, is `None`, so a wrong endpoint is a failed poll, never an idle worker.
//!
//! Cost: one serde pass that keeps six integers per rank and skips every other field without
//! building it (no `serde_json::Value` tree, no allocation). The poller reads one answer per
//! worker per interval, so this runs tens of times a second on an idle Envoy; the tree it
//! replaced was most of the poll's own cost (~43k x86 instructions for SGLang-sim's 481-byte
//! answer, measured with callgrind, docs/performance.md).

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// A worker's load, summed over its ranks and saturated to `u32`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests running or waiting.
    pub reqs: u32,
    /// Prompt tokens waiting for prefill that the worker's cache does not hold.
    pub tokens: u32,
    /// Requests the worker runs at once (`max_running_requests`); 0: not reported.
    pub capacity: u32,
    /// Requests waiting to start (`num_waiting_reqs`, both endpoints): a worker with some is
    /// busy, which is when its counters show its prefill rate (`poll.rs`).
    pub waiting: u32,
}

/// The load in the answer `body`.
pub fn parse(body: &[u8]) -> Option<Load> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let sums = Answer.deserialize(&mut de).ok()?;
    de.end().ok()?;
    sums.any.then(|| Load {
        reqs: sat(sums.reqs),
        tokens: sat(sums.tokens),
        capacity: sat(sums.capacity),
        waiting: sat(sums.waiting),
    })
}

fn sat(v: u64) -> u32 {
    v.min(u64::from(u32::MAX)) as u32
}

/// Sums over counted ranks.
#[derive(Default, Clone, Copy)]
struct Sums {
    reqs: u64,
    tokens: u64,
    capacity: u64,
    waiting: u64,
    any: bool,
}

/// The fields of one rank that matter; the last occurrence of a key wins (as in a JSON object
/// read into a map).
#[derive(Default)]
struct Rank {
    running: Option<u64>,
    waiting: Option<u64>,
    uncached: Option<u64>,
    capacity: Option<u64>,
    reqs: Option<u64>,
}

impl Rank {
    fn add_to(&self, s: &mut Sums) {
        if let Some(running) = self.running {
            // /v1/loads: running and waiting are separate.
            s.reqs = s
                .reqs
                .saturating_add(running.saturating_add(self.waiting.unwrap_or(0)));
            s.tokens = s.tokens.saturating_add(self.uncached.unwrap_or(0));
            s.capacity = s.capacity.saturating_add(self.capacity.unwrap_or(0));
            s.waiting = s.waiting.saturating_add(self.waiting.unwrap_or(0));
            s.any = true;
        } else if let Some(n) = self.reqs {
            // /get_load: num_reqs already includes the waiting ones.
            s.reqs = s.reqs.saturating_add(n);
            s.waiting = s.waiting.saturating_add(self.waiting.unwrap_or(0));
            s.any = true;
        }
    }

    /// Reads the value of `key` into its field (or skips it).
    fn field<'de, A: MapAccess<'de>>(&mut self, key: Key, map: &mut A) -> Result<(), A::Error> {
        let slot = match key {
            Key::Running => &mut self.running,
            Key::Waiting => &mut self.waiting,
            Key::Uncached => &mut self.uncached,
            Key::Capacity => &mut self.capacity,
            Key::Reqs => &mut self.reqs,
            Key::Loads | Key::Other => {
                map.next_value::<IgnoredAny>()?;
                return Ok(());
            }
        };
        *slot = map.next_value_seed(Count)?;
        Ok(())
    }
}

/// An object key, classified without allocating.
enum Key {
    Loads,
    Running,
    Waiting,
    Uncached,
    Capacity,
    Reqs,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, k: &str) -> Result<Key, E> {
                Ok(match k {
                    "loads" => Key::Loads,
                    "num_running_reqs" => Key::Running,
                    "num_waiting_reqs" => Key::Waiting,
                    "num_waiting_uncached_tokens" => Key::Uncached,
                    "max_running_requests" => Key::Capacity,
                    "num_reqs" => Key::Reqs,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// The scalar `visit_*` methods of a visitor to which every scalar is `$v` (skipped); with
/// `integers`, integers too.
macro_rules! scalars_are {
    ($v:expr) => {
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($v)
        }
    };
    ($v:expr, integers) => {
        scalars_are!($v);
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($v)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($v)
        }
    };
}

/// Reads a list to its end, keeping nothing.
fn skip_seq<'de, A: SeqAccess<'de>>(mut s: A) -> Result<(), A::Error> {
    while s.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Reads an object to its end, keeping nothing.
fn skip_map<'de, A: MapAccess<'de>>(mut m: A) -> Result<(), A::Error> {
    while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A count: `Some` for a non-negative integer, `None` for any other JSON value (skipped).
struct Count;

impl<'de> DeserializeSeed<'de> for Count {
    type Value = Option<u64>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count {
    type Value = Option<u64>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Option<u64>, E> {
        Ok(Some(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Option<u64>, E> {
        Ok(u64::try_from(v).ok())
    }
    scalars_are!(None);
    fn visit_seq<A: SeqAccess<'de>>(self, s: A) -> Result<Option<u64>, A::Error> {
        skip_seq(s).map(|_| None)
    }
    fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<Option<u64>, A::Error> {
        skip_map(m).map(|_| None)
    }
}

/// One element of a rank list: a rank if it is an object, skipped otherwise.
struct RankOrSkip;

impl<'de> DeserializeSeed<'de> for RankOrSkip {
    type Value = Option<Rank>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Rank>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for RankOrSkip {
    type Value = Option<Rank>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    scalars_are!(None, integers);
    fn visit_seq<A: SeqAccess<'de>>(self, s: A) -> Result<Option<Rank>, A::Error> {
        skip_seq(s).map(|_| None)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Option<Rank>, A::Error> {
        let mut r = Rank::default();
        while let Some(k) = m.next_key::<Key>()? {
            r.field(k, &mut m)?;
        }
        Ok(Some(r))
    }
}

/// A list of ranks, summed (`None` if the value is not a list).
struct RankList;

impl<'de> DeserializeSeed<'de> for RankList {
    type Value = Option<Sums>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Sums>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for RankList {
    type Value = Option<Sums>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    scalars_are!(None, integers);
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Option<Sums>, A::Error> {
        let mut sums = Sums::default();
        while let Some(r) = s.next_element_seed(RankOrSkip)? {
            if let Some(r) = r {
                r.add_to(&mut sums);
            }
        }
        Ok(Some(sums))
    }
    fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<Option<Sums>, A::Error> {
        skip_map(m).map(|_| None)
    }
}

/// The whole answer: a rank list, or an object that holds one under `loads` or is one rank.
struct Answer;

impl<'de> DeserializeSeed<'de> for Answer {
    type Value = Sums;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Sums, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Answer {
    type Value = Sums;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object or array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, s: A) -> Result<Sums, A::Error> {
        Ok(RankList.visit_seq(s)?.unwrap_or_default())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Sums, A::Error> {
        // The object's own fields (it is one rank unless it holds a `loads` list) and the sums
        // of its `loads` list.
        let (mut own, mut loads) = (Rank::default(), None);
        while let Some(k) = m.next_key::<Key>()? {
            match k {
                // The last `loads` key wins, as in a map; one that is not a list leaves the
                // object to be a rank itself.
                Key::Loads => loads = m.next_value_seed(RankList)?,
                k => own.field(k, &mut m)?,
            }
        }
        Ok(loads.unwrap_or_else(|| {
            let mut s = Sums::default();
            own.add_to(&mut s);
            s
        }))
    }
    // Scalars are not answers: `any` stays false.
    scalars_are!(Sums::default(), integers);
}

/// What an older SGLang says of its capacity in `/get_server_info` (`/server_info`): the two
/// settings a `/get_load` answer lacks. Read rarely (once per worker and after a failed poll,
/// see `poll.rs`), so a `serde_json::Value` tree is fine here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerInfo {
    /// `max_running_requests`; 0: not reported.
    pub max_running_requests: u32,
    /// `max_total_num_tokens` (the KV cache's capacity in tokens); 0: not reported.
    pub max_total_num_tokens: u32,
}

/// The capacity in a server-info answer: each field at the top level (the server arguments),
/// else in the first `internal_states` entry (the scheduler's own value, which SGLang reports
/// there when the argument was left unset). `None` for anything that is not a JSON object or
/// reports neither field as a positive integer.
pub fn parse_server_info(body: &[u8]) -> Option<ServerInfo> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let top = v.as_object()?;
    let state = top
        .get("internal_states")
        .and_then(|s| s.as_array())
        .and_then(|a| a.first())
        .and_then(|s| s.as_object());
    let field = |name: &str| -> u32 {
        let of = |o: &serde_json::Map<String, serde_json::Value>| {
            o.get(name).and_then(|x| x.as_u64()).filter(|&x| x > 0)
        };
        of(top).or_else(|| state.and_then(of)).map_or(0, sat)
    };
    let info = ServerInfo {
        max_running_requests: field("max_running_requests"),
        max_total_num_tokens: field("max_total_num_tokens"),
    };
    (info != ServerInfo::default()).then_some(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_capacity_from_arguments_or_scheduler_state() {
        let sim = br#"{"model_path":"m","max_total_num_tokens":200000,"max_running_requests":16,"dp_size":1}"#;
        let want = ServerInfo {
            max_running_requests: 16,
            max_total_num_tokens: 200_000,
        };
        assert_eq!(parse_server_info(sim), Some(want));
        // Argument unset (null): the scheduler's value in internal_states.
        let unset = br#"{"max_running_requests":null,"internal_states":[{"max_running_requests":16,"max_total_num_tokens":200000}]}"#;
        assert_eq!(parse_server_info(unset), Some(want));
        for bad in [
            &b"not json"[..],
            b"[1,2]",
            b"{}",
            br#"{"max_running_requests":-3,"max_total_num_tokens":"many"}"#,
            br#"{"internal_states":"x"}"#,
        ] {
            assert_eq!(
                parse_server_info(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // Larger than u32: saturated.
        let big = br#"{"max_total_num_tokens":99999999999}"#;
        assert_eq!(
            parse_server_info(big).map(|i| i.max_total_num_tokens),
            Some(u32::MAX)
        );
    }
    use proptest::prelude::*;

    /// The model: the whole answer as a `serde_json::Value` tree, read by the rules in the
    /// module doc (what the poller did before this reader).
    fn model(body: &[u8]) -> Option<Load> {
        use serde_json::Value;
        let v: Value = serde_json::from_slice(body).ok()?;
        let ranks = match &v {
            Value::Array(a) => a.as_slice(),
            Value::Object(o) => match o.get("loads") {
                Some(Value::Array(a)) => a.as_slice(),
                _ => std::slice::from_ref(&v),
            },
            _ => return None,
        };
        let num = |r: &Value, k: &str| r.get(k).and_then(Value::as_u64);
        let (mut reqs, mut tokens, mut capacity, mut any) = (0u64, 0u64, 0u64, false);
        let mut waiting = 0u64;
        for r in ranks {
            if let Some(running) = num(r, "num_running_reqs") {
                reqs = reqs.saturating_add(
                    running.saturating_add(num(r, "num_waiting_reqs").unwrap_or(0)),
                );
                tokens = tokens.saturating_add(num(r, "num_waiting_uncached_tokens").unwrap_or(0));
                capacity = capacity.saturating_add(num(r, "max_running_requests").unwrap_or(0));
                waiting = waiting.saturating_add(num(r, "num_waiting_reqs").unwrap_or(0));
                any = true;
            } else if let Some(n) = num(r, "num_reqs") {
                reqs = reqs.saturating_add(n);
                waiting = waiting.saturating_add(num(r, "num_waiting_reqs").unwrap_or(0));
                any = true;
            }
        }
        any.then(|| Load {
            reqs: sat(reqs),
            tokens: sat(tokens),
            capacity: sat(capacity),
            waiting: sat(waiting),
        })
    }

    #[test]
    fn reads_sglang_sim_answer() {
        let body = br#"{"accelerator":null,"loads":[{"cache_hit_rate":0.0,"dp_rank":0,"gen_throughput":0.0,"max_running_requests":256,"max_total_num_tokens":800000,"num_running_reqs":3,"num_total_tokens":0,"num_used_tokens":0,"num_waiting_reqs":2,"num_waiting_uncached_tokens":41,"queues":{"grammar":0,"paused":0,"retracted":0,"waiting":0},"timestamp":1795476728.961367,"token_usage":0.0,"utilization":0.0}],"num_accelerators":1,"timestamp":"2026-11-23T23:32:08.961359+00:00","version":"sglang-sim 0.1.0"}"#;
        let load = Load {
            reqs: 5,
            tokens: 41,
            capacity: 256,
            waiting: 2,
        };
        assert_eq!(parse(body), Some(load));
        assert_eq!(parse(body), model(body));
    }

    #[test]
    fn edge_shapes_match_the_tree() {
        for body in [
            &br#"{"num_running_reqs":2,"loads":7}"#[..],
            br#"{"num_running_reqs":2,"loads":[]}"#,
            br#"{"loads":[{"num_reqs":1}],"loads":{"x":1}}"#,
            br#"{"loads":[{"num_reqs":1}],"loads":[{"num_reqs":4}]}"#,
            br#"[{"num_running_reqs":-1,"num_reqs":3}]"#,
            br#"[{"num_running_reqs":1.0,"num_reqs":3,"num_tokens":"9"}]"#,
            br#"[{"num_running_reqs":1,"num_running_reqs":null}]"#,
            br#"[{"num_running_reqs":1,"max_running_requests":16},{"num_reqs":2,"max_running_requests":8}]"#,
            br#"[{"num_reqs":18446744073709551615,"num_tokens":18446744073709551615},{"num_reqs":1}]"#,
            br#"[[{"num_reqs":1}],{"num_reqs":2},3,"x",null,true]"#,
            br#"[{"num_reqs":1}] trailing"#,
            br#"[{"num_reqs":1}]  "#,
            b"",
            b"null",
            b"7",
        ] {
            assert_eq!(parse(body), model(body), "{}", String::from_utf8_lossy(body));
        }
    }

    fn value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::{json, Value};
        let key = prop_oneof![
            Just("loads".to_string()),
            Just("num_running_reqs".to_string()),
            Just("num_waiting_reqs".to_string()),
            Just("num_waiting_uncached_tokens".to_string()),
            Just("max_running_requests".to_string()),
            Just("num_reqs".to_string()),
            Just("num_tokens".to_string()),
            "[a-z_]{1,6}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u64>().prop_map(|v| json!(v)),
            (0u64..1000).prop_map(|v| json!(v)),
            any::<i64>().prop_map(|v| json!(v)),
            (-1e6f64..1e6).prop_map(|v| json!(v)),
            "[a-z]{0,4}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::vec((key.clone(), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn one_pass_equals_the_tree(v in value(), cut in 0usize..400) {
            let body = serde_json::to_vec(&v).unwrap_or_default();
            prop_assert_eq!(parse(&body), model(&body));
            // Damaged answers: truncated.
            let cut = body.get(..cut.min(body.len())).unwrap_or(&body);
            prop_assert_eq!(parse(cut), model(cut));
        }
    }
}
