//! Shared placement across Envoy replicas: each replica sends the index records it makes to
//! every peer, so a conversation placed through one replica is found through any other.
//!
//! **Sending.** Every index write a decision makes (a checkpoint or a chat prompt's end, see
//! `index.rs`) is also appended to the VM's [`Outbox`] as a 16-byte record `(model key, worker
//! id, block hash)`. Each `peers.flush_ms` the VM's timer POSTs the batch to every peer cluster
//! (`dispatch_http_call`, fire-and-forget with `peers.timeout_ms`). The outbox holds at most
//! `peers.max_batch` records; beyond that records are dropped and counted. Nothing waits on a
//! peer: a down or slow peer costs freshness (its index misses what it was not told), never a
//! request. In the native build only Envoy's main thread can start calls: the worker threads
//! hand their records to it through shared data ([`RELAY_KEY`], bounded by `max_batch` too) and
//! it sends them with its own batch.
//!
//! **Receiving.** Only the filter on the peer listener (`peer_listener: true`) accepts batches, at
//! `POST /prefix-router/v1/records` with the shared secret in `x-prefix-router-peer-secret`
//! (compared in constant time). Each record is applied as a holder write with the receiver's own
//! clock, exactly as a local decision would write it; records naming a model or worker this
//! replica does not have are ignored. A batch is bounded by `max_batch` records, so one peer
//! request can write at most that many index entries. Received records are not forwarded again.
//!
//! **Staleness.** A record reaches a peer's shared data within `flush_ms` (default 100 ms) plus
//! one round trip; the peer's VMs see it at their next probe, or after their probe cache entry
//! for that hash expires (`index.local_cache_ms`) if they probed the very same prefix just before.

use crate::config::Config;
use crate::index::{Index, Scratch, WriteStats};
use crate::store::Store;

/// Batch header: format magic and version.
pub const MAGIC: &[u8; 4] = b"PRr1";
const REC: usize = 16;

/// Records made by this VM since its last batch.
pub struct Outbox {
    buf: Vec<u8>,
    max: usize,
    /// Records dropped because the outbox was full (metric).
    pub dropped: u64,
    /// The relay's value, read back ([`Outbox::hand_off`], [`Outbox::take_relayed`]).
    relay: Vec<u8>,
}

impl Outbox {
    pub fn new(max_records: usize) -> Outbox {
        let mut buf = Vec::with_capacity(MAGIC.len() + REC * max_records);
        buf.extend_from_slice(MAGIC);
        Outbox {
            buf,
            max: max_records,
            dropped: 0,
            relay: Vec::new(),
        }
    }

    pub fn push(&mut self, model_key: u32, worker: u32, hash: u64) {
        if self.len() >= self.max {
            self.dropped += 1;
            return;
        }
        self.buf.extend_from_slice(&model_key.to_le_bytes());
        self.buf.extend_from_slice(&worker.to_le_bytes());
        self.buf.extend_from_slice(&hash.to_le_bytes());
    }

    pub fn len(&self) -> usize {
        (self.buf.len() - MAGIC.len()) / REC
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batch to send (header + records).
    pub fn batch(&self) -> &[u8] {
        &self.buf
    }

    /// Empties the outbox after its batch was handed to every peer.
    pub fn clear(&mut self) {
        self.buf.truncate(MAGIC.len());
    }

    /// Hands this outbox's records to the thread that sends for everyone, through shared data
    /// ([`RELAY_KEY`]), and empties it. For a thread that cannot start calls (the native build's
    /// worker threads; Envoy's main thread sends for them). The relay holds at most `max`
    /// records in all: the rest are dropped and counted in `dropped`, as a full outbox does.
    pub fn hand_off<S: Store>(&mut self, store: &S) {
        let buf = &mut self.relay;
        let mine = self.buf.get(MAGIC.len()..).unwrap_or_default();
        if mine.is_empty() {
            return;
        }
        for _ in 0..RELAY_TRIES {
            let cas = match store.get(RELAY_KEY, buf) {
                Some(c) => c,
                None => {
                    // Create it empty first: a set on a missing key ignores its CAS token, so
                    // two first appends could each overwrite the other; two empty creates can't.
                    let _ = store.set(RELAY_KEY, &[], 0);
                    continue;
                }
            };
            let room = (self.max * REC).saturating_sub(buf.len()) / REC * REC;
            let take = mine.len().min(room);
            buf.extend_from_slice(mine.get(..take).unwrap_or_default());
            if store.set(RELAY_KEY, buf, cas).is_ok() {
                self.dropped += ((mine.len() - take) / REC) as u64;
                self.clear();
                return;
            }
        }
        // Lost the race every time: these records are dropped like an overflow.
        self.dropped += (mine.len() / REC) as u64;
        self.clear();
    }

    /// Takes the records other threads handed off ([`Outbox::hand_off`]) into this outbox, up
    /// to its capacity (the rest dropped and counted), leaving the relay empty.
    pub fn take_relayed<S: Store>(&mut self, store: &S) {
        let buf = &mut self.relay;
        let mut taken = false;
        for _ in 0..RELAY_TRIES {
            match store.get(RELAY_KEY, buf) {
                Some(cas) if !buf.is_empty() => {
                    if store.set(RELAY_KEY, &[], cas).is_ok() {
                        taken = true;
                        break;
                    }
                    // Lost to an append: read again.
                }
                _ => return,
            }
        }
        if !taken {
            return; // still in the relay: the next flush takes them
        }
        let room = (self.max * REC + MAGIC.len()).saturating_sub(self.buf.len());
        let whole = buf.len() / REC * REC;
        let take = whole.min(room);
        self.buf
            .extend_from_slice(buf.get(..take).unwrap_or_default());
        self.dropped += ((whole - take) / REC) as u64;
    }
}

/// Shared-data key of the records that threads which cannot call hand to the one that can
/// (see [`Outbox::hand_off`]): whole 16-byte records, no header. Unused by the Wasm build, where
/// every VM sends its own batches.
pub const RELAY_KEY: &str = "pr/peer-relay";
/// CAS attempts of a relay append or drain before giving up for this flush.
const RELAY_TRIES: usize = 4;

/// What applying a batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub records: u32,
    /// Records naming a model or worker this replica does not have.
    pub ignored: u32,
    pub writes: WriteStats,
}

/// Why a batch was refused (the receiver answers 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadBatch {
    Format,
    TooLarge,
}

/// Constant-time comparison of the presented secret with the configured one.
pub fn secret_ok(presented: &[u8], secret: &str) -> bool {
    let s = secret.as_bytes();
    if presented.len() != s.len() {
        return false;
    }
    presented
        .iter()
        .zip(s)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// Applies a peer's batch to this replica's index at time `now` (100 ms units).
pub fn apply<S: Store>(
    store: &S,
    cfg: &Config,
    body: &[u8],
    now: u32,
    sc: &mut Scratch,
) -> Result<Applied, BadBatch> {
    let Some(recs) = body.strip_prefix(MAGIC.as_slice()) else {
        return Err(BadBatch::Format);
    };
    if recs.len() % REC != 0 {
        return Err(BadBatch::Format);
    }
    let max = cfg.peers.as_ref().map_or(0, |p| p.max_batch);
    if recs.len() / REC > max {
        return Err(BadBatch::TooLarge);
    }
    let mut out = Applied::default();
    for r in recs.chunks_exact(REC) {
        let mut k = [0u8; 4];
        let mut w = [0u8; 4];
        let mut h = [0u8; 8];
        k.copy_from_slice(&r[..4]);
        w.copy_from_slice(&r[4..8]);
        h.copy_from_slice(&r[8..]);
        let (key, worker, hash) = (
            u32::from_le_bytes(k),
            u32::from_le_bytes(w),
            u64::from_le_bytes(h),
        );
        out.records += 1;
        let Some(model) = cfg.models.iter().find(|m| m.peer_key == key) else {
            out.ignored += 1;
            continue;
        };
        if !model.workers.iter().any(|x| x.id == worker) {
            out.ignored += 1;
            continue;
        }
        let ix = Index::for_model(cfg, model);
        let st = ix.add(store, hash, worker, now, sc);
        out.writes.writes += st.writes;
        out.writes.conflicts += st.conflicts;
        out.writes.dropped += st.dropped;
    }
    sc.written.clear(); // received records are never forwarded again
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Matches;
    use crate::store::MemStore;

    fn cfg() -> Config {
        Config::from_json(
            br#"{"models":{"m":{"workers":["a","b"]}},
                 "peers":{"clusters":["p0"],"secret":"0123456789abcdef","max_batch":4}}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_relay_carries_records_once_and_stays_bounded() {
        let s = MemStore::new();
        let rec = |o: &mut Outbox, n: u64| (0..n).for_each(|i| o.push(7, 1, i));
        // Two threads hand off 3 records each; the relay holds at most 4 (max_batch).
        let (mut a, mut b) = (Outbox::new(4), Outbox::new(4));
        rec(&mut a, 3);
        a.hand_off(&s);
        rec(&mut b, 3);
        b.hand_off(&s);
        assert!(a.is_empty() && b.is_empty());
        assert_eq!(
            (a.dropped, b.dropped),
            (0, 2),
            "the relay's bound drops the excess"
        );
        // The sender already holds 1 record of its own: it takes 3 of the relay's 4.
        let mut main = Outbox::new(4);
        rec(&mut main, 1);
        main.take_relayed(&s);
        assert_eq!((main.len(), main.dropped), (4, 1));
        let mut v = Vec::new();
        s.get(RELAY_KEY, &mut v);
        assert!(v.is_empty(), "drained");
        main.clear();
        main.take_relayed(&s);
        assert!(main.is_empty(), "nothing is taken twice");
        // A relay that keeps losing its CAS race gives up without taking anything.
        let busy = MemStore::with_conflicts(1);
        busy.put(RELAY_KEY, &[0u8; 16]);
        main.take_relayed(&busy);
        assert!(main.is_empty());
        busy.get(RELAY_KEY, &mut v);
        assert_eq!(v.len(), 16, "still there for the next flush");
    }

    #[test]
    fn a_batch_from_a_peer_becomes_local_holders() {
        let c = cfg();
        let m = &c.models[0];
        let mut ob = Outbox::new(4);
        ob.push(m.peer_key, m.workers[1].id, 0xABCD);
        ob.push(m.peer_key, 12345, 0xBEEF); // unknown worker
        ob.push(77, m.workers[0].id, 0xF00D); // unknown model
        assert_eq!(ob.len(), 3);
        let s = MemStore::new();
        let mut sc = Scratch::default();
        let a = apply(&s, &c, ob.batch(), 10, &mut sc).unwrap();
        assert_eq!((a.records, a.ignored, a.writes.writes), (3, 2, 1));
        // The lookup for a one-block prompt with that hash finds worker b.
        let ix = Index::for_model(&c, m);
        let mut out = Matches::default();
        ix.lookup(&s, &[0xABCD], 11, &mut sc, &mut out);
        assert_eq!(out.blocks_for(m.workers[1].id), 1);
        assert!(sc.written.is_empty(), "not forwarded again");
        ob.clear();
        assert!(ob.is_empty());
        assert_eq!(ob.batch(), MAGIC);
    }

    #[test]
    fn bounded_outbox_and_malformed_batches() {
        let c = cfg();
        let mut ob = Outbox::new(2);
        for i in 0..5 {
            ob.push(1, 2, i);
        }
        assert_eq!((ob.len(), ob.dropped), (2, 3));
        let s = MemStore::new();
        let mut sc = Scratch::default();
        for bad in [&b""[..], b"PRr0", b"PRr1abc", b"\x00\x01"] {
            assert_eq!(apply(&s, &c, bad, 1, &mut sc), Err(BadBatch::Format));
        }
        let mut big = MAGIC.to_vec();
        big.extend_from_slice(&[0u8; 16 * 5]);
        assert_eq!(apply(&s, &c, &big, 1, &mut sc), Err(BadBatch::TooLarge));
        assert_eq!(s.len(), 0, "nothing written");
    }

    #[test]
    fn secret_comparison() {
        assert!(secret_ok(b"0123456789abcdef", "0123456789abcdef"));
        assert!(!secret_ok(b"0123456789abcdeX", "0123456789abcdef"));
        assert!(!secret_ok(b"0123456789abcde", "0123456789abcdef"));
        assert!(!secret_ok(b"", "0123456789abcdef"));
    }
}
