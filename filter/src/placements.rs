//! Where this Envoy just sent prompts nobody held: one small table per model in shared data
//! (`pr/np/<model>`), read and written by every VM, so a sibling that reaches another Envoy
//! thread before the first prompt's answer is indexed follows it.
//!
//! Why: a prompt its worker holds none of is recorded only once its response is a 2xx
//! (`router/mod.rs`, `write_ahead`), so for the length of a prefill the index says nobody holds
//! a new prompt group. Siblings arriving in that window were spread by their own keys (chat siblings have different conversation keys)
//! and each got a copy of the group's opening: measured with `load/pd_compare --sizes 4` on a
//! tight KV cache, about 4 of 7 misses more than SGLang's router were such start-up siblings on
//! the other Envoy thread (SGLang's router inserts into its tree when it routes). A placement
//! here is remembered by the prompt's *sibling key* (`router/mod.rs`: the opening message when it
//! is at least `affinity_blocks` long, else the rendezvous key) for [`TICKS`], and
//! `policy/cache_aware.rs` sends a prompt nobody holds to its sibling's worker while that worker
//! is under the load bound with the slack a holder of the opening would have.
//!
//! Value: [`SLOTS`] slots of 16 bytes, `(key u64, worker id u32, clock u32)` little-endian, in
//! sets of [`WAYS`] picked by key; a new key replaces its set's oldest slot (32 new prompt
//! groups at once lose about one placement; direct-mapped, about seven). A missing, short or longer
//! value reads as empty slots past its end and is rewritten whole, so nothing in it can make a
//! reader fail; a slot only ever names a worker id, which the router maps to its own workers
//! (unknown ids are ignored).
//!
//! Replicas: a placement this VM writes is also sent to the peers (`peers.rs`, a record under
//! the model's `placed_peer_key`), which remember it in their own table with their own clock,
//! one step back (it was made at least a flush before): a sibling reaching another replica
//! before the first prompt's answer is indexed follows it there too. Only new or changed
//! placements travel.
//!
//! Trust: a placement is written at decision time, before any answer, but it only steers
//! prompts with the same keyed sibling key (chain hashes are seeded by `hash_key`, model and
//! tenant, `blocks.rs`) for [`TICKS`], and only to a worker under the load bound: what one
//! request can do is route its own group's next siblings, as the index would after its answer.
//! A flood of new prompts only evicts slots (plain rendezvous again).
//!
//! Costs: nothing for a prompt the index holds. A prompt nobody holds: one get (2 KiB copied)
//! before the choice and one CAS after it (skipped when the slot already says so), a second
//! get + CAS after a lost race, then it gives up (a best effort: the slot is a hint).

use crate::store::Store;

/// How long a placement steers its siblings (100 ms units): a long prefill's worth, after which
/// the index normally has the prompt.
pub const TICKS: u32 = 50;
/// Slots per model.
pub const SLOTS: usize = 128;
/// Slots per set.
pub const WAYS: usize = 4;
const SLOT: usize = 16;
/// A slot that still says the same thing and is younger than this is not rewritten.
const REFRESH: u32 = TICKS / 2;

/// One VM's reusable access to the tables (no state of its own besides the last read).
pub struct Placements {
    buf: Vec<u8>,
    /// CAS token of `buf`, valid while `fresh` (the last read was of this key, with no write of
    /// ours since).
    cas: u32,
    fresh: bool,
}

impl Default for Placements {
    fn default() -> Self {
        Placements {
            buf: Vec::with_capacity(SLOTS * SLOT),
            cas: 0,
            fresh: false,
        }
    }
}

/// Byte offsets of the slots of `key`'s set.
fn set(key: u64) -> impl Iterator<Item = usize> {
    let first = (key % (SLOTS / WAYS) as u64) as usize * WAYS;
    (first..first + WAYS).map(|i| i * SLOT)
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    b.get(o..o + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    b.get(o..o + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

/// Whether a placement at `at` still steers at `now` (a clock stepped back forgets it).
fn live(at: u32, now: u32) -> bool {
    at != 0 && now >= at && now - at <= TICKS
}

impl Placements {
    /// Reads table `name` and returns the worker id a prompt with sibling key `key` was sent to
    /// within [`TICKS`] of `now`, and when (clock step).
    pub fn recent<S: Store>(
        &mut self,
        store: &S,
        name: &str,
        key: u64,
        now: u32,
    ) -> Option<(u32, u32)> {
        self.cas = store.get(name, &mut self.buf).unwrap_or(0);
        self.fresh = true;
        let b = &self.buf;
        set(key)
            .map(|o| (o, u32_at(b, o + 12)))
            .find(|&(o, at)| u64_at(b, o) == key && live(at, now))
            .map(|(o, at)| (u32_at(b, o + 8), at))
    }

    /// Remembers in table `name` that a prompt with sibling key `key` went to worker id
    /// `worker` at `now` (after [`Placements::recent`] of the same table; re-reads otherwise).
    /// True when the table now says something new: a new key, another worker, or a refreshed
    /// stamp (what is worth telling the peers); false when it already said so, or after two
    /// lost races.
    pub fn remember<S: Store>(
        &mut self,
        store: &S,
        name: &str,
        key: u64,
        worker: u32,
        now: u32,
    ) -> bool {
        for _ in 0..2 {
            if !self.fresh {
                self.cas = store.get(name, &mut self.buf).unwrap_or(0);
            }
            self.fresh = false;
            self.buf.resize(SLOTS * SLOT, 0);
            let b = &self.buf;
            // The key's own slot, else the set's oldest (an expired or future stamp is oldest).
            let age = |o: usize| {
                let at = u32_at(b, o + 12);
                if live(at, now) {
                    now - at
                } else {
                    u32::MAX
                }
            };
            let mine = set(key).find(|&o| u64_at(b, o) == key);
            let Some(o) = mine.or_else(|| set(key).max_by_key(|&o| age(o))) else {
                return false;
            };
            if mine.is_some() && u32_at(b, o + 8) == worker && age(o) < REFRESH {
                return false;
            }
            if let Some(s) = self.buf.get_mut(o..o + SLOT) {
                s[..8].copy_from_slice(&key.to_le_bytes());
                s[8..12].copy_from_slice(&worker.to_le_bytes());
                s[12..].copy_from_slice(&now.to_le_bytes());
            }
            if store.set(name, &self.buf, self.cas).is_ok() {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn another_vm_sees_a_placement_until_it_expires() {
        let s = MemStore::new();
        let (mut a, mut b) = (Placements::default(), Placements::default());
        assert_eq!(a.recent(&s, "t", 99, 100).map(|r| r.0), None);
        a.remember(&s, "t", 99, 7, 100);
        assert_eq!(
            b.recent(&s, "t", 99, 100 + TICKS),
            Some((7, 100)),
            "worker and when"
        );
        assert_eq!(
            b.recent(&s, "t", 99, 101 + TICKS).map(|r| r.0),
            None,
            "expired"
        );
        assert_eq!(b.recent(&s, "t", 98, 100).map(|r| r.0), None, "another key");
        assert_eq!(
            b.recent(&s, "u", 99, 100).map(|r| r.0),
            None,
            "another table"
        );
        assert_eq!(
            b.recent(&s, "t", 99, 99).map(|r| r.0),
            None,
            "clock stepped back"
        );
        // Keys of one set: each takes a free slot, then the oldest is replaced.
        let sets = (SLOTS / WAYS) as u64;
        for i in 1..WAYS as u64 {
            b.remember(&s, "t", 99 + i * sets, i as u32, 100 + i as u32);
        }
        assert_eq!(
            a.recent(&s, "t", 99, 110).map(|r| r.0),
            Some(7),
            "all {WAYS} fit"
        );
        b.remember(&s, "t", 99 + WAYS as u64 * sets, 9, 110);
        assert_eq!(
            a.recent(&s, "t", 99, 110).map(|r| r.0),
            None,
            "the oldest went"
        );
        assert_eq!(a.recent(&s, "t", 99 + sets, 110).map(|r| r.0), Some(1));
        assert_eq!(
            a.recent(&s, "t", 99 + WAYS as u64 * sets, 110).map(|r| r.0),
            Some(9)
        );
    }

    #[test]
    fn an_unchanged_placement_is_not_rewritten_and_a_lost_race_is_retried() {
        let s = MemStore::new();
        let mut a = Placements::default();
        a.recent(&s, "t", 5, 10).map(|r| r.0);
        assert!(a.remember(&s, "t", 5, 1, 10), "new: written");
        let sets = s.calls().1;
        a.recent(&s, "t", 5, 11).map(|r| r.0);
        assert!(!a.remember(&s, "t", 5, 1, 11), "nothing new to tell");
        assert_eq!(s.calls().1, sets, "same slot, still young: no write");
        assert!(a.remember(&s, "t", 5, 2, 11), "another worker: written");
        // Another VM writes between this VM's read and its write: the CAS fails, it re-reads
        // and both placements survive.
        let mut b = Placements::default();
        a.recent(&s, "t", 6, 12).map(|r| r.0);
        b.recent(&s, "t", 7, 12).map(|r| r.0);
        b.remember(&s, "t", 7, 2, 12);
        a.remember(&s, "t", 6, 3, 12);
        assert_eq!(a.recent(&s, "t", 6, 12).map(|r| r.0), Some(3));
        assert_eq!(a.recent(&s, "t", 7, 12).map(|r| r.0), Some(2));
        assert_eq!(a.recent(&s, "t", 5, 12).map(|r| r.0), Some(2));
    }

    #[test]
    fn malformed_values_read_as_empty_and_are_repaired() {
        let s = MemStore::new();
        let mut a = Placements::default();
        for v in [&b"x"[..], &[0xffu8; 3 * SLOTS * SLOT][..]] {
            s.put("t", v);
            assert_eq!(
                a.recent(&s, "t", 0xffff_ffff_ffff_ffff, 10).map(|r| r.0),
                None
            );
            a.remember(&s, "t", 42, 4, 10);
            assert_eq!(a.recent(&s, "t", 42, 10).map(|r| r.0), Some(4));
            let mut buf = Vec::new();
            s.get("t", &mut buf);
            assert_eq!(buf.len(), SLOTS * SLOT);
        }
    }
}
