//! Load accounting: per-worker in-flight requests and in-flight (estimated uncached) prompt
//! tokens, in one shared-data value per model so a routing decision reads all loads with a single
//! host call.
//!
//! The value is a list of 12-byte records `(worker id, requests, tokens)`, little-endian. Records
//! are found by worker id (the configured position is tried first, so the common case is O(1)),
//! which keeps counts correct across config reloads that add, remove or reorder workers: VMs
//! running the old config keep decrementing the records they incremented.
//!
//! Increments happen when the filter routes, decrements exactly once when the stream ends. Both
//! are CAS read-modify-writes; a writer that keeps losing races keeps its delta pending and
//! retries (see `router.rs`), so no delta is ever lost.

use crate::config::Worker;
use crate::store::Store;

const REC: usize = 12;

fn rd(b: &[u8], at: usize) -> u32 {
    match b.get(at..at + 4) {
        Some(s) => u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        None => 0,
    }
}

fn wr(b: &mut [u8], at: usize, v: u32) {
    if let Some(s) = b.get_mut(at..at + 4) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

/// Offset of `id`'s record in `b`, trying position `hint` first.
fn find(b: &[u8], id: u32, hint: usize) -> Option<usize> {
    let n = b.len() / REC;
    if hint < n && rd(b, hint * REC) == id {
        return Some(hint * REC);
    }
    (0..n).map(|i| i * REC).find(|&o| rd(b, o) == id)
}

/// Fills `reqs` / `tokens` (one slot per configured worker) from a stored value.
pub fn decode(b: &[u8], workers: &[Worker], reqs: &mut Vec<u32>, tokens: &mut Vec<u32>) {
    reqs.clear();
    tokens.clear();
    let b = &b[..b.len() - b.len() % REC];
    for (i, w) in workers.iter().enumerate() {
        match find(b, w.id, i) {
            Some(o) => {
                reqs.push(rd(b, o + 4));
                tokens.push(rd(b, o + 8));
            }
            None => {
                reqs.push(0);
                tokens.push(0);
            }
        }
    }
}

/// Applies a delta to `id`'s record in the raw value, appending the record if missing.
/// Counts saturate at 0 and `u32::MAX`; returns false if a decrement found less than it removes.
pub fn apply(b: &mut Vec<u8>, id: u32, hint: usize, dreq: i64, dtok: i64) -> bool {
    b.truncate(b.len() - b.len() % REC);
    let o = match find(b, id, hint) {
        Some(o) => o,
        None => {
            let o = b.len();
            b.extend_from_slice(&id.to_le_bytes());
            b.extend_from_slice(&[0u8; 8]);
            o
        }
    };
    let mut exact = true;
    for (off, d) in [(4, dreq), (8, dtok)] {
        let cur = i64::from(rd(b, o + off));
        let next = cur + d;
        exact &= next >= 0;
        wr(b, o + off, next.clamp(0, i64::from(u32::MAX)) as u32);
    }
    exact
}

/// Writes one value per configured worker in config order (the layout `decode` reads in O(1)).
pub fn initial(workers: &[Worker], out: &mut Vec<u8>) {
    out.clear();
    for w in workers {
        out.extend_from_slice(&w.id.to_le_bytes());
        out.extend_from_slice(&[0u8; 8]);
    }
}

/// Ensures `key` exists (a fresh VM on a fresh Envoy). Existing values are left alone, so a
/// config reload never resets counts that in-flight requests will decrement.
pub fn ensure<S: Store>(store: &S, key: &str, workers: &[Worker], buf: &mut Vec<u8>) {
    if store.get(key, buf).is_none() {
        initial(workers, buf);
        let _ = store.set(key, buf, 0);
    }
}

/// A change to one worker's counters; `hint` is its position in the current config.
#[derive(Debug, Clone, Copy)]
pub struct Delta {
    pub id: u32,
    pub hint: usize,
    pub dreq: i64,
    pub dtok: i64,
}

/// Read-modify-write of one worker's counters with up to `retries` CAS attempts.
pub fn update<S: Store>(store: &S, key: &str, buf: &mut Vec<u8>, d: Delta, retries: u32) -> bool {
    for _ in 0..retries {
        let cas = store.get(key, buf).unwrap_or(0);
        apply(buf, d.id, d.hint, d.dreq, d.dtok);
        if store.set(key, buf, cas).is_ok() {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::worker_id;
    use crate::store::MemStore;

    fn workers(names: &[&str]) -> Vec<Worker> {
        names
            .iter()
            .map(|n| Worker {
                cluster: n.to_string(),
                weight: 1.0,
                id: worker_id(n),
            })
            .collect()
    }

    #[test]
    fn increments_and_decrements_by_id() {
        let ws = workers(&["a", "b", "c"]);
        let s = MemStore::new();
        let mut buf = Vec::new();
        ensure(&s, "l", &ws, &mut buf);
        assert!(update(
            &s,
            "l",
            &mut buf,
            Delta {
                id: ws[1].id,
                hint: 1,
                dreq: 1,
                dtok: 100
            },
            4
        ));
        assert!(update(
            &s,
            "l",
            &mut buf,
            Delta {
                id: ws[1].id,
                hint: 1,
                dreq: 1,
                dtok: 50
            },
            4
        ));
        assert!(update(
            &s,
            "l",
            &mut buf,
            Delta {
                id: ws[2].id,
                hint: 2,
                dreq: 1,
                dtok: 7
            },
            4
        ));
        let (mut r, mut t) = (Vec::new(), Vec::new());
        s.get("l", &mut buf);
        decode(&buf, &ws, &mut r, &mut t);
        assert_eq!((r.clone(), t.clone()), (vec![0, 2, 1], vec![0, 150, 7]));
        // A reordered config reads the same counts by id.
        let ws2 = workers(&["c", "d", "b"]);
        decode(&buf, &ws2, &mut r, &mut t);
        assert_eq!((r, t), (vec![1, 0, 2], vec![7, 0, 150]));
    }

    #[test]
    fn decrement_below_zero_saturates_and_reports() {
        let mut b = Vec::new();
        assert!(!apply(&mut b, 9, 0, -1, -5));
        let ws = vec![Worker {
            cluster: "x".into(),
            weight: 1.0,
            id: 9,
        }];
        let (mut r, mut t) = (Vec::new(), Vec::new());
        decode(&b, &ws, &mut r, &mut t);
        assert_eq!((r[0], t[0]), (0, 0));
    }

    #[test]
    fn garbage_values_do_not_panic() {
        let ws = workers(&["a"]);
        let (mut r, mut t) = (Vec::new(), Vec::new());
        decode(b"1234567", &ws, &mut r, &mut t);
        assert_eq!(r, vec![0]);
        let mut b = b"12345678901234".to_vec();
        apply(&mut b, ws[0].id, 0, 1, 1);
        assert_eq!(b.len(), 24);
    }

    #[test]
    fn contention_retries_then_reports_failure() {
        let ws = workers(&["a"]);
        let s = MemStore::with_conflicts(1);
        let mut buf = Vec::new();
        ensure(&s, "l", &ws, &mut buf);
        assert!(!update(
            &s,
            "l",
            &mut buf,
            Delta {
                id: ws[0].id,
                hint: 0,
                dreq: 1,
                dtok: 1
            },
            3
        ));
        let s = MemStore::with_conflicts(2);
        ensure(&s, "l", &ws, &mut buf);
        assert!(update(
            &s,
            "l",
            &mut buf,
            Delta {
                id: ws[0].id,
                hint: 0,
                dreq: 1,
                dtok: 1
            },
            3
        ));
    }
}
