//! Live membership of pool models: the hosts of a model's Envoy cluster (EDS or DNS), read from
//! Envoy's admin `GET /clusters` (text format) by the poll lease holder, published in shared
//! data for every VM, and turned into that model's worker list ([`with_members`]).
//!
//! Source: one admin line per host field, `<cluster>::<ip>:<port>::<field>::<value>`; we read
//! the `health_flags` line (`healthy`, or `/`-separated failure flags) and the `weight` line.
//! Only hosts whose flags are exactly `healthy` are members: a host failing active health
//! checks, ejected by outlier detection, or marked unhealthy or draining by EDS gets no new
//! requests (override_host would not send to it either).
//!
//! Identity: a member's worker identity is its address (`config::worker_id` of `ip:port`), so
//! index records, loads and peer records name the same worker in every VM and every replica,
//! whatever order or moment they learned the fleet in.
//!
//! The published record (`pr/m1/<model>`): one line per member, `<joined>\t<weight>\t<address>`,
//! sorted by address. `joined` is when the host last became a member (the clock in 100 ms units):
//! a host that left and came back, or whose health check failed and recovered, has a new
//! `joined`, and the router ignores its index entries older than that (a restarted pod at the
//! same address has an empty cache).
//!
//! Bounds: at most `max_workers` members per model (the first by address beyond are dropped and
//! counted); addresses longer than `config::MAX_ADDRESS` bytes or not `host:port` are skipped; an
//! answer longer than [`MAX_ANSWER`] bytes is not parsed at all (the last membership stays).
//!
//! Costs: the lease holder makes one admin call per `membership.interval_ms` and scans the
//! answer once (about 1 KB per host). Every VM reads each pool model's record once per interval
//! (one shared-data read) and rebuilds its router only when the bytes changed.

use crate::config::{valid_address, worker_id, Config, Worker};
use crate::store::Store;

/// Largest admin answer parsed: about 1 KB per host for several thousand hosts.
pub const MAX_ANSWER: usize = 8 << 20;

/// One healthy host of a pool cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub address: String,
    pub weight: u32,
    /// When it last became a member (100 ms units; 0 = unknown).
    pub joined: u32,
}

/// What one admin answer said about one cluster.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// Healthy hosts, sorted by address, each once.
    pub members: Vec<Member>,
    /// Hosts seen with any other health flags.
    pub unhealthy: usize,
    /// Hosts dropped: malformed address, or beyond `max`.
    pub dropped: usize,
}

/// Reads `cluster`'s hosts out of an admin `/clusters` text answer. `None`: the answer is too
/// large to trust or names no host of `cluster` and has no line of it at all (not an admin
/// answer for this cluster: keep the last membership). A cluster with lines but no healthy host
/// gives an empty member list.
pub fn scan(body: &[u8], cluster: &str, max: usize) -> Option<Scan> {
    if body.len() > MAX_ANSWER || cluster.is_empty() {
        return None;
    }
    let mut seen_cluster = false;
    // (address, weight, healthy) per host in answer order; Envoy writes a host's lines together.
    let mut hosts: Vec<(&[u8], u32, bool)> = Vec::new();
    for line in body.split(|&b| b == b'\n') {
        let Some(rest) = line
            .strip_prefix(cluster.as_bytes())
            .and_then(|r| r.strip_prefix(b"::"))
        else {
            continue;
        };
        seen_cluster = true;
        // `<address>::<field>::<value>`; an address may hold single colons, never `::` except
        // in IPv6 (written in brackets by Envoy).
        let Some((address, field, value)) = split_host_line(rest) else {
            continue;
        };
        // Envoy writes a host's lines together: the last host is almost always the one.
        let last = hosts
            .last()
            .filter(|h| h.0 == address)
            .map(|_| hosts.len() - 1);
        let slot = match last.or_else(|| hosts.iter().position(|h| h.0 == address)) {
            Some(i) => i,
            None => {
                if !valid_address(address) {
                    continue;
                }
                hosts.push((address, 1, false));
                hosts.len() - 1
            }
        };
        let Some(h) = hosts.get_mut(slot) else {
            continue;
        };
        match field {
            b"health_flags" => h.2 = value == b"healthy",
            b"weight" => {
                h.1 = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.trim().parse::<u32>().ok())
                    .filter(|&w| w > 0)
                    .unwrap_or(1);
            }
            _ => {}
        }
    }
    if !seen_cluster {
        return None;
    }
    let mut out = Scan::default();
    for (address, weight, healthy) in hosts {
        if !healthy {
            out.unhealthy += 1;
            continue;
        }
        let Ok(address) = std::str::from_utf8(address) else {
            out.dropped += 1;
            continue;
        };
        out.members.push(Member {
            address: address.to_string(),
            weight,
            joined: 0,
        });
    }
    out.members.sort_by(|a, b| a.address.cmp(&b.address));
    out.members.dedup_by(|a, b| a.address == b.address);
    if out.members.len() > max {
        out.dropped += out.members.len() - max;
        out.members.truncate(max);
    }
    Some(out)
}

/// `<address>::<field>::<value>` → its three parts (the field and value are the last two
/// `::`-separated parts, so a bracketed IPv6 address with `::` inside stays whole).
fn split_host_line(rest: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let last = rfind2(rest)?;
    let value = rest.get(last + 2..)?;
    let head = rest.get(..last)?;
    let mid = rfind2(head)?;
    Some((head.get(..mid)?, head.get(mid + 2..)?, value))
}

fn rfind2(s: &[u8]) -> Option<usize> {
    s.windows(2).rposition(|w| w == b"::")
}

/// `cfg` with pool model `mi`'s workers set to `members` (at most its
/// `max_workers`; `membership.rs`). `None` when `mi` is not a pool model.
pub fn with_members(cfg: &Config, mi: usize, members: &[Member]) -> Option<Config> {
    let mut cfg = cfg.clone();
    let m = cfg.models.get_mut(mi)?;
    let pool = m.pool.as_ref()?;
    let workers: Vec<Worker> = members
        .iter()
        .take(pool.max_workers)
        .map(|x| Worker {
            cluster: x.address.clone(),
            weight: f64::from(x.weight.max(1)),
            address: Some(x.address.clone()),
            id: worker_id(&x.address),
        })
        .collect();
    m.poll_clusters = vec![pool.load_cluster.clone(); workers.len()];
    m.uniform_weights = workers.windows(2).all(|w| w[0].weight == w[1].weight);
    m.total_weight = workers.iter().map(|w| w.weight).sum();
    m.workers = workers;
    Some(cfg)
}

/// Encodes members as the published record (module docs).
pub fn encode(members: &[Member], out: &mut Vec<u8>) {
    out.clear();
    for m in members {
        out.extend_from_slice(m.joined.to_string().as_bytes());
        out.push(b'\t');
        out.extend_from_slice(m.weight.to_string().as_bytes());
        out.push(b'\t');
        out.extend_from_slice(m.address.as_bytes());
        out.push(b'\n');
    }
}

/// Decodes a published record; malformed lines are skipped, at most `max` members kept.
pub fn decode(b: &[u8], max: usize, out: &mut Vec<Member>) {
    out.clear();
    for line in b.split(|&c| c == b'\n') {
        if out.len() >= max {
            break;
        }
        let mut parts = line.splitn(3, |&c| c == b'\t');
        let (Some(j), Some(w), Some(a)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let num = |v: &[u8]| std::str::from_utf8(v).ok()?.parse::<u32>().ok();
        let (Some(joined), Some(weight)) = (num(j), num(w)) else {
            continue;
        };
        if !valid_address(a) || weight == 0 {
            continue;
        }
        let Ok(address) = std::str::from_utf8(a) else {
            continue;
        };
        out.push(Member {
            address: address.to_string(),
            weight,
            joined,
        });
    }
}

/// Gives each scanned member its `joined` time: kept from `previous` (the record published
/// before) when the host was already a member, `now` when it is new.
pub fn stamp(scan: &mut [Member], previous: &[Member], now: u32) {
    for m in scan.iter_mut() {
        m.joined = previous
            .iter()
            .find(|p| p.address == m.address)
            .map_or(now.max(1), |p| p.joined);
    }
}

/// Publishes `members` for model key `key` when they differ from what is there (one read, and
/// a write only on change). Returns true when the record changed.
pub fn publish<S: Store>(store: &S, key: &str, members: &[Member], buf: &mut Vec<u8>) -> bool {
    let mut old = Vec::new();
    let cas = store.get(key, &mut old).unwrap_or(0);
    encode(members, buf);
    if cas != 0 && old == *buf {
        return false;
    }
    // One writer (the poll lease holder); a CAS miss means another holder wrote meanwhile: its
    // record is as fresh as ours, the next round reconciles.
    store.set(key, buf, cas).is_ok()
}

/// One VM's view of the published memberships: what it last applied per model, so a record
/// that did not change costs one shared-data read and a comparison.
#[derive(Default)]
pub struct View {
    /// Per model: the record bytes last applied (`None`: none yet, or not a pool model).
    applied: Vec<Option<Vec<u8>>>,
    last_ms: Option<u64>,
    buf: Vec<u8>,
}

/// A membership change to apply: the new configuration and, per pool model that changed, its
/// members (with their join times).
pub struct Change {
    pub cfg: Config,
    pub members: Vec<(usize, Vec<Member>)>,
}

impl View {
    /// A new configuration from Envoy: nothing of it applied yet.
    pub fn reset(&mut self) {
        self.applied.clear();
        self.last_ms = None;
    }

    /// Reads each pool model's record when `membership.interval_ms` passed since the last look
    /// (`force`: now); returns the configuration to rebuild with when any changed.
    pub fn look<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        now_ms: u64,
        force: bool,
    ) -> Option<Change> {
        let every = u64::from(cfg.membership.interval_ms);
        if every == 0 || !cfg.models.iter().any(|m| m.pool.is_some()) {
            return None;
        }
        let due = self
            .last_ms
            .is_none_or(|at| crate::schedule::since(at, now_ms) >= every / 2);
        if !force && !due {
            return None;
        }
        self.last_ms = Some(now_ms);
        self.applied.resize(cfg.models.len(), None);
        let mut change: Option<Change> = None;
        for (mi, m) in cfg.models.iter().enumerate() {
            let Some(pool) = &m.pool else {
                continue;
            };
            if store.get(&pool.members_key, &mut self.buf).is_none() {
                continue;
            }
            let Some(slot) = self.applied.get_mut(mi) else {
                continue;
            };
            if slot.as_deref() == Some(self.buf.as_slice()) {
                continue;
            }
            *slot = Some(self.buf.clone());
            let mut members = Vec::new();
            decode(&self.buf, pool.max_workers, &mut members);
            let base = change.as_ref().map_or(cfg, |c| &c.cfg);
            let Some(next) = with_members(base, mi, &members) else {
                continue;
            };
            match &mut change {
                Some(c) => {
                    c.cfg = next;
                    c.members.push((mi, members));
                }
                None => {
                    change = Some(Change {
                        cfg: next,
                        members: vec![(mi, members)],
                    })
                }
            }
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    const ANSWER: &str = "\
m1::observability_name::m1
m1::default_priority::max_connections::1024
m1::added_via_api::false
m1::10.0.0.2:30000::cx_active::0
m1::10.0.0.2:30000::rq_total::7
m1::10.0.0.2:30000::hostname::
m1::10.0.0.2:30000::health_flags::healthy
m1::10.0.0.2:30000::weight::3
m1::10.0.0.1:30000::health_flags::healthy
m1::10.0.0.1:30000::weight::1
m1::10.0.0.3:30000::health_flags::/failed_active_hc
m1::10.0.0.3:30000::weight::1
m1_load::10.0.0.9:30000::health_flags::healthy
m1x::10.0.0.8:30000::health_flags::healthy
";

    #[test]
    fn reads_healthy_hosts_of_one_cluster_sorted_with_weights() {
        let s = scan(ANSWER.as_bytes(), "m1", 64).unwrap();
        let got: Vec<(&str, u32)> = s
            .members
            .iter()
            .map(|m| (m.address.as_str(), m.weight))
            .collect();
        assert_eq!(got, vec![("10.0.0.1:30000", 1), ("10.0.0.2:30000", 3)]);
        assert_eq!(s.unhealthy, 1);
        let l = scan(ANSWER.as_bytes(), "m1_load", 64).unwrap();
        assert_eq!(l.members.len(), 1);
        assert_eq!(l.members[0].address, "10.0.0.9:30000");
    }

    #[test]
    fn an_answer_without_the_cluster_keeps_the_last_membership() {
        assert_eq!(scan(ANSWER.as_bytes(), "other", 64), None);
        assert_eq!(scan(b"", "m1", 64), None);
        assert_eq!(scan(b"<html>not admin</html>", "m1", 64), None);
        // the cluster is there but every host failed: an empty membership
        let s = scan(
            b"m1::10.0.0.1:1::health_flags::/failed_outlier_check\n",
            "m1",
            8,
        )
        .unwrap();
        assert!(s.members.is_empty());
        assert_eq!(s.unhealthy, 1);
    }

    #[test]
    fn ipv6_and_hostnames_stay_whole() {
        let a = "p::[fd00::1]:30000::health_flags::healthy\np::[fd00::1]:30000::weight::2\n";
        let s = scan(a.as_bytes(), "p", 8).unwrap();
        assert_eq!(s.members[0].address, "[fd00::1]:30000");
        assert_eq!(s.members[0].weight, 2);
    }

    #[test]
    fn malformed_and_huge_answers_are_bounded() {
        let junk =
            "m1::::::\nm1::nohost::health_flags::healthy\nm1::a b:1::health_flags::healthy\n\
                    m1::h:99999::health_flags::healthy\nm1::h:0::health_flags::healthy\n\
                    m1::h:1::weight::-3\nm1::h:1::health_flags::healthy\n";
        let mut bytes = junk.as_bytes().to_vec();
        bytes.extend_from_slice(b"m1::\xff\xfe:1::health_flags::healthy\n");
        let s = scan(&bytes, "m1", 8).unwrap();
        assert_eq!(s.members.len(), 1);
        assert_eq!(s.members[0].address, "h:1");
        assert_eq!(s.members[0].weight, 1, "a bad weight reads as 1");
        let long = format!("m1::{}:1::health_flags::healthy\n", "x".repeat(100));
        assert!(scan(long.as_bytes(), "m1", 8).unwrap().members.is_empty());
        let mut many = String::new();
        for i in 0..100 {
            many.push_str(&format!("m1::10.1.0.{i}:80::health_flags::healthy\n"));
        }
        let s = scan(many.as_bytes(), "m1", 16).unwrap();
        assert_eq!((s.members.len(), s.dropped), (16, 84));
        let huge = vec![b'x'; MAX_ANSWER + 1];
        assert_eq!(scan(&huge, "m1", 8), None);
    }

    #[test]
    fn records_round_trip_and_keep_join_times() {
        let mut s = scan(ANSWER.as_bytes(), "m1", 64).unwrap().members;
        stamp(&mut s, &[], 50);
        assert!(s.iter().all(|m| m.joined == 50));
        let store = MemStore::new();
        let mut buf = Vec::new();
        assert!(publish(&store, "k", &s, &mut buf));
        assert!(!publish(&store, "k", &s, &mut buf), "unchanged: no write");
        let mut raw = Vec::new();
        assert!(store.get("k", &mut raw).is_some());
        let mut back = Vec::new();
        decode(&raw, 64, &mut back);
        assert_eq!(back, s);
        // one host stays, one leaves, one arrives: only the new one gets the new time
        let mut next = vec![
            Member {
                address: "10.0.0.1:30000".into(),
                weight: 1,
                joined: 0,
            },
            Member {
                address: "10.0.0.4:30000".into(),
                weight: 1,
                joined: 0,
            },
        ];
        stamp(&mut next, &back, 90);
        assert_eq!(next[0].joined, 50);
        assert_eq!(next[1].joined, 90);
    }

    #[test]
    fn decoding_skips_bad_lines() {
        let mut out = Vec::new();
        decode(
            b"1\t1\th:1\nx\t1\th:2\n3\t0\th:3\n4\t1\tbad\n5\t2\th:5\n",
            8,
            &mut out,
        );
        let a: Vec<&str> = out.iter().map(|m| m.address.as_str()).collect();
        assert_eq!(a, vec!["h:1", "h:5"]);
        decode(b"1\t1\th:1\n2\t1\th:2\n", 1, &mut out);
        assert_eq!(out.len(), 1);
    }
}
