//! The prefix index: which workers recently received which prompt prefixes.
//!
//! Layout: a fixed slot table in Envoy shared data shared by all models (the model seeds every
//! hash), `capacity/4` keys per model (`pr/i2/<bucket>`, see [`KEY_PREFIX`] and [`resize`]),
//! each holding one bucket of [`ENTRIES`] entries; an entry is a full
//! 64-bit block-chain hash (the tag) plus up to [`HOLDERS`] `(worker id, time)` pairs. A block
//! hash picks its bucket; a new tag replaces the bucket's least recently used entry, and a new
//! holder replaces the entry's oldest one. Because the key space is fixed, memory is bounded by
//! configuration even though Envoy never deletes shared-data keys.
//!
//! Only checkpoint blocks are recorded (see [`crate::blocks::nth_checkpoint`]), and the
//! sub-checkpoints of a prompt's top gap ([`crate::blocks::sub_checkpoints`]). Writes are CAS
//! read-modify-writes with bounded retries: under contention an update may be lost (counted),
//! never half-applied, because every write replaces a whole, self-validating bucket. A decision
//! writes the records its worker is not known to hold at once and its request takes them back if
//! it fails ([`Plan`], [`Index::write_ahead`], [`Index::retract`]).
//!
//! Lookup cost: a prompt of `n` blocks has `m <= 2·log2(n) + 2` checkpoints. A hash covers its
//! whole prefix, so a worker holding checkpoint j received every shallower one; but presence in
//! the table is *not* monotone in j (one checkpoint's bucket may evict it, or its record may be
//! older than deeper ones). The lookup gallops (probe 0, 1, 3, 7, ...) and treats a miss as a
//! hole when the next gallop position hits, then binary-searches: at most
//! `2·ceil(log2(m+1)) + 2` probes, 2 for a prompt nobody has seen (checkpoints 0 and 1), then at
//! most 2 over the sub-checkpoints above the deepest checkpoint found (recorded by a prompt that
//! ended in that gap: a follow-up finds its previous prompt within an eighth of its end), plus at
//! most [`BOUNDARY_PROBES`] message-boundary probes for chats ([`Index::lookup_bounds`]).
//! Holes further up only shorten the match. [`Index::record`] repairs holes and rewrites a
//! worker's whole path once any of its records on it is older than a quarter of the TTL, so a
//! prefix requested without pause never expires from under its deeper checkpoints.
//!
//! Time stamps are 32-bit 100 ms units; [`age`] treats a stamp up to [`FUTURE_SLACK`] ahead of
//! the reader's clock as age 0 (clocks of threads, replicas and peers differ, and clocks step).
//!
//! Each VM also keeps a small direct-mapped cache of recent probe results ([`ProbeCache`], 4096
//! slots, `index.local_cache_ms`): a hot prefix is then matched with no host call at all. What the
//! cache can miss is another thread's record made within the last `local_cache_ms`; the cost is a
//! slightly stale match (never a wrong worker: holders are still verified against the config),
//! and a miss for a brand-new prefix falls back to rendezvous hashing, which every thread and
//! replica computes identically.

use crate::blocks::{
    checkpoints_upto, is_checkpoint, nth_checkpoint, sub_checkpoints, top_sub_checkpoints,
    SUB_CHECKPOINTS,
};
use crate::config::{Config, Model};
use crate::store::Store;
use std::fmt::Write;

/// Shared-data key prefix of the index: `pr/i2/<bucket>`. The `2` is the layout version (the
/// bucket encoding below); a new layout gets a new prefix, so no VM ever decodes another
/// layout's bytes. One table serves every model (the model is part of every hash). Defined
/// with the other shared-data keys in the config layer, which writes it into every model.
pub const KEY_PREFIX: &str = crate::config::INDEX_KEY_PREFIX;
/// Holds the table's bucket count (u32 LE) as last configured (see [`resize`]).
pub const SIZE_KEY: &str = "pr/i2/size";
/// Buckets a VM empties per tick when the table shrank (see [`clear_some`]).
pub const CLEAR_PER_TICK: u32 = 256;

pub const ENTRIES: usize = 4;
/// Most message-boundary probes per lookup (see [`Index::lookup_bounds`]).
pub const BOUNDARY_PROBES: usize = 4;
pub const HOLDERS: usize = 4;
const HOLDER_BYTES: usize = 8;
const ENTRY_BYTES: usize = 8 + HOLDERS * HOLDER_BYTES;
pub const BUCKET_BYTES: usize = ENTRIES * ENTRY_BYTES;

/// One decoded bucket, on the stack.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct Entry {
    tag: u64,
    holders: [(u32, u32); HOLDERS],
}

type Bucket = [Entry; ENTRIES];

fn decode(bytes: &[u8]) -> Bucket {
    let mut b = [Entry::default(); ENTRIES];
    if bytes.len() != BUCKET_BYTES {
        return b; // missing or foreign value: treat as empty, the next write repairs it
    }
    for (e, raw) in b.iter_mut().zip(bytes.chunks_exact(ENTRY_BYTES)) {
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&raw[..8]);
        e.tag = u64::from_le_bytes(tag);
        for (h, hr) in e
            .holders
            .iter_mut()
            .zip(raw[8..].chunks_exact(HOLDER_BYTES))
        {
            let mut id = [0u8; 4];
            let mut t = [0u8; 4];
            id.copy_from_slice(&hr[..4]);
            t.copy_from_slice(&hr[4..]);
            *h = (u32::from_le_bytes(id), u32::from_le_bytes(t));
        }
    }
    b
}

fn encode(b: &Bucket, out: &mut [u8; BUCKET_BYTES]) {
    for (e, raw) in b.iter().zip(out.chunks_exact_mut(ENTRY_BYTES)) {
        raw[..8].copy_from_slice(&e.tag.to_le_bytes());
        for (h, hr) in e
            .holders
            .iter()
            .zip(raw[8..].chunks_exact_mut(HOLDER_BYTES))
        {
            hr[..4].copy_from_slice(&h.0.to_le_bytes());
            hr[4..].copy_from_slice(&h.1.to_le_bytes());
        }
    }
}

/// Tags are block hashes; 0 marks an empty entry, so a (2^-64-likely) zero hash becomes 1.
fn tag_of(h: u64) -> u64 {
    h.max(1)
}

/// Stamps at most this far ahead of `now` (1 hour in the filter's 100 ms units) are treated as
/// written "now": another thread or replica whose clock is slightly ahead, or our own clock
/// stepping back, must not make a fresh record look 2^32 units old (evicted first, ignored by
/// lookups). Stamps further ahead are garbage and count as infinitely old.
pub const FUTURE_SLACK: u32 = 36_000;

/// Age of a stamp `t` at `now`, on a wrapping 32-bit clock (see [`FUTURE_SLACK`]).
pub fn age(now: u32, t: u32) -> u32 {
    let d = now.wrapping_sub(t);
    if d <= u32::MAX - FUTURE_SLACK {
        d
    } else {
        0 // t is ahead of now by less than FUTURE_SLACK
    }
}

/// One worker seen by a lookup.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub id: u32,
    /// Deepest prefix (in blocks) the worker holds among the probes made.
    pub blocks: u32,
    /// Time stamp of the worker's oldest record among the probes that found it.
    pub oldest: u32,
}

/// What [`Index::record`] needs to know about what the chosen worker already holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Known {
    /// Deepest prefix the lookup proved the worker holds (0: none).
    pub blocks: u32,
    /// Time stamp of its oldest record seen on the way.
    pub oldest: u32,
    /// A probe shallower than `blocks` did not find the worker (evicted or expired checkpoint).
    pub hole: bool,
}

/// Most probes one lookup logs for hole detection (gallop + binary search + boundaries).
const PROBE_LOG: usize = 64;

/// What a lookup learned: for each worker seen, the deepest checkpoint it holds (in blocks).
#[derive(Debug, Default, Clone)]
pub struct Matches {
    pub workers: Vec<Held>,
    /// Longest matched prefix over all workers, in blocks.
    pub deepest: u32,
    pub probes: u32,
    /// Each probe made (cache hits included): its depth in blocks and the live holders it found.
    probed: Vec<(u32, [u32; HOLDERS])>,
}

impl Matches {
    /// Sized so a lookup never grows it (at most `HOLDERS` new workers per probe).
    pub fn with_capacity() -> Matches {
        Matches {
            workers: Vec::with_capacity(128),
            probed: Vec::with_capacity(PROBE_LOG),
            ..Matches::default()
        }
    }
    pub fn clear(&mut self) {
        self.workers.clear();
        self.probed.clear();
        self.deepest = 0;
        self.probes = 0;
    }
    /// Matched blocks for `id` (0 when unknown).
    pub fn blocks_for(&self, id: u32) -> u32 {
        self.workers
            .iter()
            .find(|w| w.id == id)
            .map_or(0, |w| w.blocks)
    }
    /// What the lookup proved about `id`'s records, for [`Index::record`].
    pub fn known_for(&self, id: u32) -> Known {
        let Some(w) = self.workers.iter().find(|w| w.id == id) else {
            return Known::default();
        };
        // A probe shallower than the worker's match that did not find it, in an entry with room
        // for another holder: its record was evicted or expired, not crowded out by 4 other
        // holders (rewriting a crowded entry would only evict another worker, on every request).
        let hole = self
            .probed
            .iter()
            .any(|(b, ids)| *b < w.blocks && !ids.contains(&id) && ids.contains(&0));
        Known {
            blocks: w.blocks,
            oldest: w.oldest,
            hole,
        }
    }
    fn note(&mut self, id: u32, blocks: u32, t: u32, now: u32) {
        match self.workers.iter_mut().find(|w| w.id == id) {
            Some(w) => {
                w.blocks = w.blocks.max(blocks);
                if age(now, t) > age(now, w.oldest) {
                    w.oldest = t;
                }
            }
            None => self.workers.push(Held {
                id,
                blocks,
                oldest: t,
            }),
        }
    }
}

/// Outcome counters of a `record` call.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriteStats {
    pub writes: u32,
    pub conflicts: u32,
    pub dropped: u32,
    /// Records written ahead and taken back ([`Index::retract`]).
    pub retracted: u32,
}

/// Most index writes one request can plan: every checkpoint of the longest hashable prompt
/// (`max_prompt_blocks` <= 2^20 blocks: 41 checkpoints, or 40 and 3 sub-checkpoints) plus its
/// chat end.
pub const MAX_PLANNED: usize = 48;

/// The index writes one decision plans ([`Index::plan`]). `Copy` and fixed-size: the stream
/// keeps it without allocating, and it bounds what one request can write.
///
/// Its first [`Plan::fresh`] hashes are prefixes the worker is not known to hold; the rest
/// rewrite what it holds (a refresh). The fresh ones are written when the request is routed
/// ([`Index::write_ahead`]): a follow-up or sibling routed while this request is still queued
/// for prefill sees where its prefix is going, and queues behind it there, where it will be
/// cached by the time the follow-up is prefilled (the worker serves its queue in order). The
/// refresh waits for a 2xx response ([`Index::write`]); a request that fails or ends without a
/// response takes its fresh records back ([`Index::retract`]), restoring the stamps they
/// replaced, so what a failed request leaves in the index is nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub model: u16,
    /// Worker id the records name.
    pub worker: u32,
    /// Decision time (the records' time stamp when the caller has no fresher clock).
    pub at: u32,
    len: u8,
    /// Leading hashes the worker is not known to hold.
    fresh: u8,
    /// Leading hashes written ahead ([`Index::write_ahead`]); those of them in `ahead_ok` were
    /// applied, each replacing `prior` (the worker's previous stamp there, 0: none).
    ahead: u8,
    ahead_ok: u64,
    hashes: [u64; MAX_PLANNED],
    prior: [u32; MAX_PLANNED],
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            model: 0,
            worker: 0,
            at: 0,
            len: 0,
            fresh: 0,
            ahead: 0,
            ahead_ok: 0,
            hashes: [0; MAX_PLANNED],
            prior: [0; MAX_PLANNED],
        }
    }
}

impl Plan {
    pub fn hashes(&self) -> &[u64] {
        self.hashes.get(..usize::from(self.len)).unwrap_or_default()
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// How many leading hashes the worker is not known to hold.
    pub fn fresh(&self) -> usize {
        usize::from(self.fresh)
    }
    /// The plan for another worker (a fallback host served the request): what was written ahead
    /// was for the first one, so nothing counts as written and the answer writes every hash for
    /// `worker`. Call it once [`Index::retract`] took back the first worker's early records.
    pub fn move_to(&mut self, worker: u32) {
        self.worker = worker;
        self.ahead = 0;
        self.ahead_ok = 0;
    }
    /// The hashes written ahead ([`Index::write_ahead`]) and applied.
    pub fn written_ahead(&self) -> impl Iterator<Item = u64> + '_ {
        self.hashes()
            .iter()
            .take(usize::from(self.ahead))
            .enumerate()
            .filter(|(i, _)| self.ahead_ok & (1 << i) != 0)
            .map(|(_, &h)| h)
    }
    /// The hashes a 2xx response still has to write: all of them when none was written ahead.
    pub fn due_at_answer(&self) -> &[u64] {
        self.hashes()
            .get(usize::from(self.ahead)..)
            .unwrap_or_default()
    }
    fn push(&mut self, h: u64) {
        if let Some(slot) = self.hashes.get_mut(usize::from(self.len)) {
            *slot = h;
            self.len += 1;
        }
    }
}

/// A model's index (a view over the store; holds no data of its own).
pub struct Index<'a> {
    pub key_prefix: &'a str,
    pub buckets: u32,
    /// Holder lifetime in time units (the caller's clock, 100 ms in the filter).
    pub ttl: u32,
    pub cas_retries: u32,
    /// Lifetime of VM-local probe results (same time unit as `ttl`); 0 disables the cache.
    pub cache_ttl: u32,
}

/// Reusable buffers so lookups and writes do not allocate in steady state.
pub struct IndexBuffers {
    key: String,
    buf: Vec<u8>,
    cache: ProbeCache,
    /// Hashes this VM's writes recorded since the caller last cleared it (sent to peers).
    pub written: Vec<u64>,
    /// The peer listener's copy of its sender table (`peers::admit`).
    pub peer_table: Vec<u8>,
}

impl Default for IndexBuffers {
    fn default() -> Self {
        IndexBuffers {
            key: String::with_capacity(64),
            buf: Vec::with_capacity(BUCKET_BYTES),
            cache: ProbeCache::default(),
            written: Vec::with_capacity(128),
            peer_table: Vec::new(),
        }
    }
}

const CACHE_SLOTS: usize = 4096;

/// One cached probe result: the holders of `tag` as last read or written by this VM (all zero
/// holders = the checkpoint was absent).
#[derive(Clone, Copy, Default)]
struct Cached {
    tag: u64,
    at: u32,
    valid: bool,
    holders: [(u32, u32); HOLDERS],
}

/// VM-local, direct-mapped cache of probe results (allocated on first use, ~200 KiB).
#[derive(Default)]
pub struct ProbeCache {
    slots: Vec<Cached>,
}

impl ProbeCache {
    fn slot(h: u64) -> usize {
        (h >> 40) as usize % CACHE_SLOTS
    }
    fn get(&self, tag: u64, now: u32, ttl: u32) -> Option<[(u32, u32); HOLDERS]> {
        let c = self.slots.get(Self::slot(tag))?;
        (c.valid && c.tag == tag && age(now, c.at) <= ttl).then_some(c.holders)
    }
    fn put(&mut self, tag: u64, now: u32, holders: [(u32, u32); HOLDERS]) {
        if self.slots.is_empty() {
            self.slots = vec![Cached::default(); CACHE_SLOTS];
        }
        if let Some(c) = self.slots.get_mut(Self::slot(tag)) {
            *c = Cached {
                tag,
                at: now,
                valid: true,
                holders,
            };
        }
    }
}

impl<'a> Index<'a> {
    /// The index of `model` as configured.
    pub fn for_model(cfg: &Config, model: &'a Model) -> Index<'a> {
        Index {
            key_prefix: &model.index_key_prefix,
            buckets: cfg.index_buckets,
            ttl: cfg.index.ttl_seconds.saturating_mul(10),
            cas_retries: cfg.index.cas_retries,
            cache_ttl: cfg.index.local_cache_ms / 100,
        }
    }

    /// Records `worker` as a holder of the prefix whose last block hash is `h` (a peer's record).
    pub fn add<S: Store>(
        &self,
        store: &S,
        h: u64,
        worker: u32,
        now: u32,
        sc: &mut IndexBuffers,
    ) -> WriteStats {
        let mut st = WriteStats::default();
        self.add_holder(store, h, worker, now, sc, &mut st);
        st
    }

    fn key_for(&self, h: u64, key: &mut String) {
        key.clear();
        key.push_str(self.key_prefix);
        let bucket = (h % u64::from(self.buckets.max(1))) as u32;
        let _ = write!(key, "{bucket}");
    }

    /// Probes checkpoint `j` and records its live holders in `out`. True on a hit.
    fn probe<S: Store>(
        &self,
        store: &S,
        hashes: &[u64],
        j: usize,
        now: u32,
        sc: &mut IndexBuffers,
        out: &mut Matches,
    ) -> bool {
        self.probe_blocks(store, hashes, nth_checkpoint(j), now, sc, out)
    }

    /// Probes the prefix of `blocks` blocks and records its live holders in `out`.
    fn probe_blocks<S: Store>(
        &self,
        store: &S,
        hashes: &[u64],
        blocks: usize,
        now: u32,
        sc: &mut IndexBuffers,
        out: &mut Matches,
    ) -> bool {
        let Some(&h) = hashes.get(blocks.wrapping_sub(1)) else {
            return false;
        };
        let tag = tag_of(h);
        let cached = if self.cache_ttl > 0 {
            sc.cache.get(tag, now, self.cache_ttl)
        } else {
            None
        };
        let holders = match cached {
            Some(hs) => hs,
            None => {
                out.probes += 1;
                self.key_for(h, &mut sc.key);
                let found = match store.get(&sc.key, &mut sc.buf) {
                    Some(_) => decode(&sc.buf)
                        .iter()
                        .find(|e| e.tag == tag)
                        .map(|e| e.holders),
                    None => None,
                };
                let hs = found.unwrap_or_default();
                if self.cache_ttl > 0 {
                    sc.cache.put(tag, now, hs);
                }
                hs
            }
        };
        let mut hit = false;
        let mut live = [0u32; HOLDERS];
        for (&(id, t), l) in holders.iter().zip(live.iter_mut()) {
            if id != 0 && age(now, t) <= self.ttl {
                out.note(id, blocks as u32, t, now);
                *l = id;
                hit = true;
            }
        }
        if out.probed.len() < PROBE_LOG {
            out.probed.push((blocks as u32, live));
        }
        if hit {
            out.deepest = out.deepest.max(blocks as u32);
        }
        hit
    }

    /// Finds, for the prompt whose block hashes are `hashes`, the longest recorded prefix and
    /// what each holder seen on the way holds. See the module docs for the probe bound.
    pub fn lookup<S: Store>(
        &self,
        store: &S,
        hashes: &[u64],
        now: u32,
        sc: &mut IndexBuffers,
        out: &mut Matches,
    ) {
        out.clear();
        let m = checkpoints_upto(hashes.len());
        if m == 0 {
            return;
        }
        // Gallop over checkpoints 0, 1, 3, 7, ... A miss may be a hole (one checkpoint evicted
        // from its bucket or expired while deeper ones live), so it ends the gallop only when the
        // next gallop position misses too.
        let mut lo = None; // last checkpoint known to hit
        let mut hi = m; // first checkpoint known to miss (or m)
        let mut j = 0usize;
        while j < m {
            if self.probe(store, hashes, j, now, sc, out) {
                lo = Some(j);
                j = 2 * j + 1;
                continue;
            }
            let next = (2 * j + 1).min(m - 1);
            if next > j && self.probe(store, hashes, next, now, sc, out) {
                lo = Some(next); // j was a hole
                j = 2 * next + 1;
                continue;
            }
            hi = j;
            break;
        }
        let Some(mut lo) = lo else {
            return;
        };
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.probe(store, hashes, mid, now, sc, out) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        // The gap above the deepest checkpoint found: its sub-checkpoints within the prompt,
        // recorded by prompts that ended in it. A prompt's are recorded all together, so a
        // binary search finds the deepest (at most 2 probes).
        let mut subs = [0usize; SUB_CHECKPOINTS];
        let mut k = 0;
        for (slot, x) in subs
            .iter_mut()
            .zip(sub_checkpoints(lo).take_while(|&x| x <= hashes.len()))
        {
            *slot = x;
            k += 1;
        }
        let (mut below, mut above) = (0usize, k + 1); // positions in 1..=k; 0 = the checkpoint
        while above - below > 1 {
            let mid = below + (above - below) / 2;
            let hit = subs
                .get(mid - 1)
                .is_some_and(|&x| self.probe_blocks(store, hashes, x, now, sc, out));
            if hit {
                below = mid;
            } else {
                above = mid;
            }
        }
    }

    /// After [`Index::lookup`]: probes the message boundaries `ends` (block counts, ascending)
    /// that lie deeper than the match found so far, deepest first, and stops at the first hit.
    /// A conversation's previous turn ended exactly at one of them (it was recorded there by
    /// [`Index::record_end`]), so a long conversation matches its whole history, not just the
    /// nearest checkpoint below it. At most [`BOUNDARY_PROBES`] probes.
    pub fn lookup_bounds<S: Store>(
        &self,
        store: &S,
        hashes: &[u64],
        ends: &[usize],
        now: u32,
        sc: &mut IndexBuffers,
        out: &mut Matches,
    ) {
        let floor = out.deepest as usize;
        for &blocks in ends
            .iter()
            .rev()
            .filter(|&&b| b > floor)
            .take(BOUNDARY_PROBES)
        {
            if self.probe_blocks(store, hashes, blocks, now, sc, out) {
                return;
            }
        }
    }

    /// Records `worker` as a holder of the prefix of `blocks` blocks (the end of a chat prompt)
    /// unless it is a checkpoint (recorded by [`Index::record`] already).
    pub fn record_end<S: Store>(
        &self,
        store: &S,
        hashes: &[u64],
        blocks: usize,
        worker: u32,
        now: u32,
        sc: &mut IndexBuffers,
    ) -> WriteStats {
        let mut st = WriteStats::default();
        if !is_checkpoint(blocks) {
            if let Some(&h) = hashes.get(blocks.wrapping_sub(1)) {
                self.add_holder(store, h, worker, now, sc, &mut st);
            }
        }
        st
    }

    /// True when the checkpoints the worker is known to hold must be rewritten: one of its
    /// records on the path is older than a quarter of the TTL, or a probe found a hole.
    pub fn needs_refresh(&self, known: Known, now: u32) -> bool {
        known.blocks > 0 && (known.hole || age(now, known.oldest) > self.ttl / 4)
    }

    /// Plans what [`Index::record`] writes (checkpoints and the sub-checkpoints of the top gap,
    /// then the chat end `end` in blocks): first those deeper than what the worker is known to
    /// hold ([`Plan::fresh`]), then, on a refresh, those it holds.
    pub fn plan(&self, hashes: &[u64], end: Option<usize>, known: Known, now: u32, out: &mut Plan) {
        out.len = 0;
        out.ahead = 0;
        out.ahead_ok = 0;
        let refresh = self.needs_refresh(known, now);
        let m = checkpoints_upto(hashes.len());
        let top = top_sub_checkpoints(hashes.len());
        let end = end.filter(|&e| !is_checkpoint(e) && !top.clone().any(|x| x == e));
        let points = (0..m).map(nth_checkpoint).chain(top).chain(end);
        for blocks in points.clone().filter(|&b| b as u32 > known.blocks) {
            if let Some(&h) = hashes.get(blocks.wrapping_sub(1)) {
                out.push(h);
            }
        }
        out.fresh = out.len;
        if refresh {
            for blocks in points.filter(|&b| b as u32 <= known.blocks) {
                if let Some(&h) = hashes.get(blocks.wrapping_sub(1)) {
                    out.push(h);
                }
            }
        }
    }

    /// Writes a plan's fresh records when its request is routed ([`Plan`]): `plan.worker`
    /// becomes a holder of each, stamped `plan.at`, and the plan keeps the stamps they replaced
    /// for [`Index::retract`]. The caller then writes [`Plan::due_at_answer`] on a 2xx.
    pub fn write_ahead<S: Store>(
        &self,
        store: &S,
        plan: &mut Plan,
        sc: &mut IndexBuffers,
    ) -> WriteStats {
        let mut st = WriteStats::default();
        let n = plan.fresh();
        for i in 0..n {
            let Some(&h) = plan.hashes.get(i) else { break };
            if let Some(prior) = self.add_holder(store, h, plan.worker, plan.at, sc, &mut st) {
                if let Some(p) = plan.prior.get_mut(i) {
                    *p = prior;
                }
                plan.ahead_ok |= 1 << i;
            }
        }
        plan.ahead = plan.fresh;
        st
    }

    /// Takes back what [`Index::write_ahead`] wrote for a request that failed or ended without
    /// an answer: each record still stamped `plan.at` for `plan.worker` gets its prior stamp
    /// back, or is removed where it had none. A record rewritten since (a later request to the
    /// same worker) is left alone.
    pub fn retract<S: Store>(&self, store: &S, plan: &Plan, sc: &mut IndexBuffers) -> WriteStats {
        let mut st = WriteStats::default();
        for (i, &h) in plan
            .hashes()
            .iter()
            .enumerate()
            .take(usize::from(plan.ahead))
        {
            if plan.ahead_ok & (1 << i) == 0 {
                continue;
            }
            let prior = plan.prior.get(i).copied().unwrap_or(0);
            self.restore_holder(store, h, plan.worker, plan.at, prior, sc, &mut st);
        }
        st
    }

    /// Makes a plan's writes: `worker` becomes a holder of each planned prefix.
    pub fn write<S: Store>(
        &self,
        store: &S,
        planned: &[u64],
        worker: u32,
        now: u32,
        sc: &mut IndexBuffers,
    ) -> WriteStats {
        let mut st = WriteStats::default();
        for &h in planned {
            self.add_holder(store, h, worker, now, sc, &mut st);
        }
        st
    }

    /// Records `worker` as a holder of every checkpoint deeper than `known.blocks` (what the
    /// lookup proved it already holds), and rewrites every checkpoint up to `known.blocks` too
    /// when [`Index::needs_refresh`]: a hot prefix must never lose its shallow checkpoints while
    /// requests keep refreshing only the deep ones (the lookup gallops from checkpoint 0).
    pub fn record<S: Store>(
        &self,
        store: &S,
        hashes: &[u64],
        worker: u32,
        known: Known,
        now: u32,
        sc: &mut IndexBuffers,
    ) -> WriteStats {
        let mut p = Plan::default();
        self.plan(hashes, None, known, now, &mut p);
        self.write(store, p.hashes(), worker, now, sc)
    }

    /// Makes `worker` a holder of `h` stamped `now`; returns the stamp it replaced (0: it was
    /// not a holder) once written, `None` when the write was dropped.
    fn add_holder<S: Store>(
        &self,
        store: &S,
        h: u64,
        worker: u32,
        now: u32,
        sc: &mut IndexBuffers,
        st: &mut WriteStats,
    ) -> Option<u32> {
        let tag = tag_of(h);
        let (prior, holders) = self.update_bucket(store, h, sc, st, |bucket| {
            let (i, prior) = upsert(bucket, tag, worker, now);
            bucket.get(i).map(|e| (prior, e.holders))
        })?;
        st.writes += 1;
        sc.written.push(h);
        if self.cache_ttl > 0 {
            sc.cache.put(tag, now, holders);
        }
        Some(prior)
    }

    /// Gives `worker`'s record of `h` its `prior` stamp back (removes it when `prior` is 0), if
    /// it still carries `stamp`. Counted in `st.retracted`; a record already changed is not.
    #[allow(clippy::too_many_arguments)]
    fn restore_holder<S: Store>(
        &self,
        store: &S,
        h: u64,
        worker: u32,
        stamp: u32,
        prior: u32,
        sc: &mut IndexBuffers,
        st: &mut WriteStats,
    ) {
        let tag = tag_of(h);
        let restored = self.update_bucket(store, h, sc, st, |bucket| {
            let e = bucket.iter_mut().find(|e| e.tag == tag)?;
            let slot = e.holders.iter_mut().find(|x| **x == (worker, stamp))?;
            *slot = if prior == 0 { (0, 0) } else { (worker, prior) };
            Some(e.holders)
        });
        if let Some(holders) = restored {
            st.retracted += 1;
            if self.cache_ttl > 0 {
                sc.cache.put(tag, stamp, holders);
            }
        }
    }

    /// One CAS read-modify-write of `h`'s bucket: `change` edits the decoded bucket and says
    /// what to return once it is written (`None`: nothing to write, and nothing is). A lost
    /// race rereads and retries (`st.conflicts`) up to `cas_retries` times, then gives up
    /// (`st.dropped`): never half-applied, every write replaces a whole bucket.
    fn update_bucket<S: Store, R>(
        &self,
        store: &S,
        h: u64,
        sc: &mut IndexBuffers,
        st: &mut WriteStats,
        mut change: impl FnMut(&mut Bucket) -> Option<R>,
    ) -> Option<R> {
        self.key_for(h, &mut sc.key);
        let mut enc = [0u8; BUCKET_BYTES];
        for _ in 0..self.cas_retries {
            let cas = store.get(&sc.key, &mut sc.buf).unwrap_or(0);
            let mut bucket = decode(&sc.buf);
            let r = change(&mut bucket)?;
            encode(&bucket, &mut enc);
            match store.set(&sc.key, &enc, cas) {
                Ok(()) => return Some(r),
                Err(_) => st.conflicts += 1,
            }
        }
        st.dropped += 1;
        None
    }
}

/// Records that the table now has `buckets` buckets. Returns the bucket range this VM must
/// empty, when the table shrank (a smaller `index.capacity` or fewer models on reload): Envoy
/// never deletes keys, so without this the old tail would hold memory for the process's life.
/// Only the VM whose CAS moves the size record cleans (one per change); growth and model renames
/// need no cleaning (the same keys are reused; misplaced entries just miss and age out by LRU).
pub fn resize<S: Store>(store: &S, buckets: u32) -> Option<std::ops::Range<u32>> {
    let mut buf = Vec::with_capacity(4);
    let cas = store.get(SIZE_KEY, &mut buf).unwrap_or(0);
    let old = <[u8; 4]>::try_from(buf.as_slice()).map_or(0, u32::from_le_bytes);
    if old == buckets {
        return None;
    }
    store.set(SIZE_KEY, &buckets.to_le_bytes(), cas).ok()?;
    (old > buckets).then_some(buckets..old)
}

/// Empties up to `n` buckets of `range` (advancing it): one host call each, bounded per tick.
pub fn clear_some<S: Store>(store: &S, range: &mut std::ops::Range<u32>, n: u32, key: &mut String) {
    for _ in 0..n {
        if range.start >= range.end {
            return;
        }
        key.clear();
        key.push_str(KEY_PREFIX);
        let _ = write!(key, "{}", range.start);
        let _ = store.set(key, b"", 0);
        range.start += 1;
    }
}

/// Inserts or refreshes `worker` as a holder of `tag` in the bucket (LRU replacement); returns
/// the entry's position and the worker's stamp it replaced (0: it was not a holder).
fn upsert(bucket: &mut Bucket, tag: u64, worker: u32, now: u32) -> (usize, u32) {
    let recency = |e: &Entry| {
        e.holders
            .iter()
            .filter(|h| h.0 != 0)
            .map(|h| age(now, h.1))
            .min()
            .unwrap_or(u32::MAX)
    };
    let idx = match bucket.iter().position(|e| e.tag == tag) {
        Some(i) => i,
        None => {
            // Empty entries first, then the least recently used one.
            let victim = bucket
                .iter()
                .enumerate()
                .max_by_key(|(_, e)| if e.tag == 0 { u32::MAX } else { recency(e) })
                .map_or(0, |(i, _)| i);
            bucket[victim] = Entry {
                tag,
                holders: [(0, 0); HOLDERS],
            };
            victim
        }
    };
    let e = &mut bucket[idx];
    if let Some(h) = e.holders.iter_mut().find(|h| h.0 == worker) {
        let prior = h.1;
        h.1 = now;
        return (idx, prior);
    }
    // Empty slot, else the oldest holder.
    let slot = e
        .holders
        .iter()
        .enumerate()
        .max_by_key(|(_, h)| if h.0 == 0 { u32::MAX } else { age(now, h.1) })
        .map_or(0, |(i, _)| i);
    e.holders[slot] = (worker, now);
    (idx, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{chain_seed, hash_blocks};
    use crate::store::MemStore;

    fn hashes(text: &[u8]) -> Vec<u64> {
        let mut v = Vec::new();
        hash_blocks(chain_seed(b"m", None), text, 8, 100_000, &mut v);
        v
    }

    fn idx(buckets: u32) -> Index<'static> {
        Index {
            key_prefix: "pr/i/m/",
            buckets,
            ttl: 6000,
            cas_retries: 4,
            cache_ttl: 0,
        }
    }

    #[test]
    fn bucket_roundtrip_and_garbage() {
        let mut b: Bucket = [Entry::default(); ENTRIES];
        upsert(&mut b, 77, 5, 100);
        upsert(&mut b, 77, 6, 101);
        let mut enc = [0u8; BUCKET_BYTES];
        encode(&b, &mut enc);
        assert_eq!(decode(&enc), b);
        assert_eq!(decode(b"short"), [Entry::default(); ENTRIES]);
    }

    #[test]
    fn lookup_finds_longest_prefix_with_few_probes() {
        let s = MemStore::new();
        let ix = idx(1 << 16);
        let mut sc = IndexBuffers::default();
        let mut m = Matches::default();
        let base = b"x".repeat(8 * 200);
        let a = hashes(&base);
        ix.lookup(&s, &a, 10, &mut sc, &mut m);
        assert_eq!(
            (m.deepest, m.probes),
            (0, 2),
            "an unseen prompt: checkpoints 0 and 1"
        );
        let st = ix.record(&s, &a, 7, Known::default(), 10, &mut sc);
        assert_eq!(st.writes as usize, checkpoints_upto(200));
        // Same prompt: every checkpoint up to 192 matches.
        ix.lookup(&s, &a, 11, &mut sc, &mut m);
        assert_eq!(m.deepest, 192);
        assert_eq!(m.blocks_for(7), 192);
        assert!(m.probes as f64 <= 2.0 * ((checkpoints_upto(200) + 1) as f64).log2().ceil() + 2.0);
        // A prompt sharing the first 100 blocks: deepest checkpoint <= 100 is 96.
        let mut other = base[..8 * 100].to_vec();
        other.extend_from_slice(&b"y".repeat(8 * 300));
        let b = hashes(&other);
        ix.lookup(&s, &b, 12, &mut sc, &mut m);
        assert_eq!(m.deepest, 96);
        assert_eq!(m.blocks_for(7), 96);
        assert_eq!(m.blocks_for(8), 0);
        // Recording worker 8 for it writes only checkpoints beyond what it is known to hold.
        let st = ix.record(&s, &b, 8, Known::default(), 12, &mut sc);
        assert_eq!(st.writes as usize, checkpoints_upto(400));
        ix.lookup(&s, &b, 13, &mut sc, &mut m);
        assert_eq!(m.deepest, 384);
        assert_eq!(m.blocks_for(8), 384);
        let st = ix.record(&s, &b, 8, m.known_for(8), 13, &mut sc);
        assert_eq!(st.writes, 0, "nothing new to write, holder fresh");
    }

    #[test]
    fn holders_expire_after_ttl() {
        let s = MemStore::new();
        let ix = idx(1024);
        let mut sc = IndexBuffers::default();
        let mut m = Matches::default();
        let a = hashes(&b"z".repeat(64));
        ix.record(&s, &a, 3, Known::default(), 1000, &mut sc);
        ix.lookup(&s, &a, 1000 + 6000, &mut sc, &mut m);
        assert_eq!(m.deepest, 8);
        ix.lookup(&s, &a, 1000 + 6001, &mut sc, &mut m);
        assert_eq!(m.deepest, 0);
        // Stale holders are refreshed on record.
        ix.lookup(&s, &a, 1000 + 2000, &mut sc, &mut m);
        let st = ix.record(&s, &a, 3, m.known_for(3), 3000, &mut sc);
        assert_eq!(st.writes as usize, checkpoints_upto(8), "the whole path");
    }

    #[test]
    fn memory_is_bounded_by_capacity() {
        let s = MemStore::new();
        let ix = idx(64);
        let mut sc = IndexBuffers::default();
        for i in 0..5000u32 {
            let a = hashes(format!("prompt number {i} with some padding").as_bytes());
            ix.record(&s, &a, 1 + i % 5, Known::default(), i, &mut sc);
        }
        assert!(s.len() <= 64, "{} keys", s.len());
        // Recent prompts are still found (LRU within a bucket keeps the newest).
        let a = hashes(b"prompt number 4999 with some padding");
        let mut m = Matches::default();
        ix.lookup(&s, &a, 5000, &mut sc, &mut m);
        assert!(m.deepest > 0);
    }

    #[test]
    fn several_holders_per_block_with_lru_replacement() {
        let s = MemStore::new();
        let ix = idx(1024);
        let mut sc = IndexBuffers::default();
        let a = hashes(&b"q".repeat(8));
        for (w, t) in [(1, 10), (2, 11), (3, 12), (4, 13), (5, 14)] {
            ix.record(&s, &a, w, Known::default(), t, &mut sc);
        }
        let mut m = Matches::default();
        ix.lookup(&s, &a, 20, &mut sc, &mut m);
        let mut ids: Vec<u32> = m.workers.iter().map(|w| w.id).collect();
        ids.sort();
        assert_eq!(ids, vec![2, 3, 4, 5], "oldest holder (1) replaced");
    }

    #[test]
    fn cas_races_lose_updates_but_never_corrupt() {
        // Every 2nd conditional write loses a race.
        let s = MemStore::with_conflicts(2);
        let ix = idx(256);
        let mut sc = IndexBuffers::default();
        let mut total = WriteStats::default();
        for i in 0..300u32 {
            let a = hashes(format!("race {i} ........").as_bytes());
            let st = ix.record(&s, &a, 1 + i % 3, Known::default(), i, &mut sc);
            total.writes += st.writes;
            total.conflicts += st.conflicts;
            total.dropped += st.dropped;
        }
        assert!(total.conflicts > 0);
        // Every stored value still decodes to a well-formed bucket.
        let mut buf = Vec::new();
        for k in s.keys() {
            s.get(&k, &mut buf).unwrap();
            assert_eq!(buf.len(), BUCKET_BYTES);
            for e in decode(&buf) {
                assert!(e.tag == 0 || e.holders.iter().any(|h| h.0 != 0));
            }
        }
        // With one retry only and constant conflicts, updates are dropped, not corrupted.
        let s = MemStore::with_conflicts(1);
        let ix1 = Index {
            cas_retries: 1,
            ..idx(256)
        };
        s.put("pr/i/m/0", b"garbage");
        let a = hashes(b"abc");
        let st = ix1.record(&s, &a, 1, Known::default(), 1, &mut sc);
        assert!(st.dropped > 0 || st.writes > 0);
    }

    #[test]
    fn a_follow_up_matches_its_previous_prompt_within_the_gap() {
        let s = MemStore::new();
        let ix = idx(1 << 14);
        let mut sc = IndexBuffers::default();
        let mut m = Matches::default();
        // Turn 1: 121 blocks, recorded at its checkpoints (deepest 96) and at the
        // sub-checkpoints of its top gap (104, 112, 120).
        let turn1 = b"a".repeat(8 * 121);
        let st = ix.record(&s, &hashes(&turn1), 3, Known::default(), 10, &mut sc);
        assert_eq!(st.writes as usize, checkpoints_upto(121) + 3);
        // Turn 2 extends it to 123 blocks: matched at 120, not at 96.
        let mut turn2 = turn1.clone();
        turn2.extend_from_slice(&b"b".repeat(8 * 2));
        let h2 = hashes(&turn2);
        ix.lookup(&s, &h2, 11, &mut sc, &mut m);
        assert_eq!((m.blocks_for(3), m.deepest), (120, 120));
        let coarse = 2.0 * ((checkpoints_upto(123) + 1) as f64).log2().ceil() + 2.0;
        assert!(f64::from(m.probes) <= coarse + 2.0, "{} probes", m.probes);
        // Nothing new to write for turn 2 (no checkpoint or top sub-checkpoint above 120).
        let mut p = Plan::default();
        ix.plan(&h2, None, m.known_for(3), 11, &mut p);
        assert!(p.is_empty());
        // A sibling that left turn 1 after 100 blocks holds only what they share up to 96.
        let mut sibling = turn1[..8 * 100].to_vec();
        sibling.extend_from_slice(&b"c".repeat(8 * 23));
        ix.lookup(&s, &hashes(&sibling), 12, &mut sc, &mut m);
        assert_eq!(m.blocks_for(3), 96);
    }

    #[test]
    fn probe_cache_saves_host_calls_and_expires() {
        let s = MemStore::new();
        let ix = Index {
            cache_ttl: 10,
            ..idx(1 << 12)
        };
        let mut sc = IndexBuffers::default();
        let mut m = Matches::default();
        let a = hashes(&b"c".repeat(8 * 100));
        ix.lookup(&s, &a, 100, &mut sc, &mut m);
        assert_eq!((m.deepest, m.probes), (0, 2));
        ix.record(&s, &a, 5, Known::default(), 100, &mut sc);
        // Everything this VM wrote is served from its cache: no host call.
        let (gets, _) = s.calls();
        ix.lookup(&s, &a, 105, &mut sc, &mut m);
        assert_eq!((m.deepest, m.probes, s.calls().0), (96, 0, gets));
        // Another VM (empty cache) records a second holder: we see it once our entries expire.
        let mut other = IndexBuffers::default();
        ix.record(&s, &a, 6, Known::default(), 106, &mut other);
        ix.lookup(&s, &a, 108, &mut sc, &mut m);
        assert_eq!(m.blocks_for(6), 0, "stale by design within cache_ttl");
        ix.lookup(&s, &a, 117, &mut sc, &mut m);
        assert_eq!(m.blocks_for(6), 96);
        assert!(m.probes > 0);
    }

    #[test]
    fn conversation_ends_are_matched_beyond_checkpoints() {
        let s = MemStore::new();
        let ix = idx(1 << 12);
        let mut sc = IndexBuffers::default();
        let mut m = Matches::default();
        // Turn 1: 70 blocks; recorded at its checkpoints (deepest 64) and at its end (70).
        let turn1 = b"t".repeat(8 * 70);
        let a = hashes(&turn1);
        ix.record(&s, &a, 3, Known::default(), 10, &mut sc);
        let st = ix.record_end(&s, &a, 70, 3, 10, &mut sc);
        assert_eq!(st.writes, 1);
        // Turn 2 resends turn 1 and adds 20 blocks; its message ends are at 70, 80 and 90.
        let mut turn2 = turn1.clone();
        turn2.extend_from_slice(&b"u".repeat(8 * 20));
        let b = hashes(&turn2);
        ix.lookup(&s, &b, 11, &mut sc, &mut m);
        assert_eq!(m.deepest, 64, "checkpoints alone stop at 64");
        ix.lookup_bounds(&s, &b, &[10, 70, 80, 90], 11, &mut sc, &mut m);
        assert_eq!((m.deepest, m.blocks_for(3)), (70, 70));
        // Checkpoint ends are not written twice.
        assert_eq!(ix.record_end(&s, &b, 64, 3, 12, &mut sc).writes, 0);
    }

    /// Looks `hashes` up and records worker `w` the way the router does; returns the match.
    fn serve(
        ix: &Index,
        s: &MemStore,
        hashes: &[u64],
        w: u32,
        now: u32,
        sc: &mut IndexBuffers,
    ) -> u32 {
        let mut m = Matches::default();
        ix.lookup(s, hashes, now, sc, &mut m);
        ix.record(s, hashes, w, m.known_for(w), now, sc);
        m.blocks_for(w)
    }

    #[test]
    fn a_hot_prefix_keeps_its_match_past_the_ttl() {
        // A 32-block system prompt followed by a different question every 10 s for 3 TTLs: each
        // request's deepest record is fresh, the shared checkpoints must stay fresh too.
        let s = MemStore::new();
        let ix = idx(1 << 14); // ttl 6000 units = 600 s
        let mut sc = IndexBuffers::default();
        let sys = b"s".repeat(8 * 32);
        let mut last = 0;
        for i in 0..1800u32 {
            let mut p = sys.clone();
            p.extend_from_slice(format!("question {i:06} ").repeat(8).as_bytes());
            let now = 100 + i * 10;
            last = serve(&ix, &s, &hashes(&p), 7, now, &mut sc);
            if i > 0 {
                assert!(last >= 32, "request {i} at t={now}: matched {last}");
            }
        }
        assert!(last >= 32);
    }

    #[test]
    fn a_plan_holds_every_write_of_the_longest_prompt() {
        // The longest prompt, and the longest one with three sub-checkpoints in its top gap.
        let max = crate::config::MAX_PROMPT_BLOCKS;
        for (n, subs) in [(max, 0), (max - 1, SUB_CHECKPOINTS)] {
            let writes = checkpoints_upto(n) + subs + 1;
            assert!(writes <= MAX_PLANNED, "{writes}");
            let hs: Vec<u64> = (1..=n as u64).collect();
            let mut p = Plan::default();
            let known = Known {
                blocks: 5,
                oldest: 0,
                hole: true,
            };
            idx(64).plan(&hs, Some(n - 7), known, 10, &mut p);
            assert_eq!(p.hashes().len(), writes);
        }
    }

    #[test]
    fn records_written_ahead_are_taken_back_as_they_were() {
        let s = MemStore::new();
        let ix = idx(1 << 16);
        let mut sc = IndexBuffers::default();
        let a = hashes(&b"w".repeat(8 * 40));
        // Worker 3 holds the first 16 blocks since t=10 (worker 5 too); a request for all 40 is
        // routed to it at t=20: fresh are the checkpoints past 16, a refresh would add the rest.
        ix.record(&s, &a[..16], 3, Known::default(), 10, &mut sc);
        ix.record(&s, &a[..16], 5, Known::default(), 10, &mut sc);
        let known = Known {
            blocks: 16,
            oldest: 10,
            hole: true,
        };
        let mut p = Plan {
            worker: 3,
            at: 20,
            ..Plan::default()
        };
        ix.plan(&a, None, known, 20, &mut p);
        assert_eq!(p.fresh(), 4, "24, 32 and the top gap's 36 and 40");
        assert!(p.hashes().len() > p.fresh(), "the refresh after them");
        let st = ix.write_ahead(&s, &mut p, &mut sc);
        assert_eq!(
            (st.writes, p.due_at_answer().len()),
            (4, p.hashes().len() - 4)
        );
        let mut m = Matches::default();
        ix.lookup(&s, &a, 21, &mut sc, &mut m);
        assert_eq!(
            (m.blocks_for(3), m.blocks_for(5)),
            (40, 16),
            "seen before any answer"
        );
        // A later request's write of checkpoint 24 for the same worker stays; 32, 36, 40 go.
        ix.write(&s, &a[23..24], 3, 22, &mut sc);
        assert_eq!(ix.retract(&s, &p, &mut sc).retracted, 3);
        ix.lookup(&s, &a, 23, &mut sc, &mut m);
        assert_eq!(m.blocks_for(3), 24, "24 was rewritten since");
        // A worker that did not hold 24 loses it again; one that did gets its old stamp back.
        let holders = |h: u64| {
            let (mut key, mut buf) = (String::new(), Vec::new());
            ix.key_for(h, &mut key);
            s.get(&key, &mut buf);
            decode(&buf)
                .iter()
                .find(|e| e.tag == tag_of(h))
                .map(|e| e.holders)
        };
        for (worker, after) in [(5, None), (3, Some((3, 22)))] {
            let mut q = Plan {
                worker,
                at: 30,
                ..Plan::default()
            };
            ix.plan(&a[..24], None, known, 30, &mut q);
            assert_eq!(ix.write_ahead(&s, &mut q, &mut sc).writes, 1);
            ix.lookup(&s, &a[..24], 31, &mut sc, &mut m);
            assert_eq!(m.blocks_for(worker), 24);
            assert_eq!(ix.retract(&s, &q, &mut sc).retracted, 1);
            assert_eq!(ix.retract(&s, &q, &mut sc).retracted, 0, "nothing twice");
            let got = holders(a[23]).unwrap_or_default();
            assert_eq!(
                got.iter().find(|x| x.0 == worker).copied(),
                after,
                "{got:?}"
            );
        }
        ix.lookup(&s, &a[..24], 32, &mut sc, &mut m);
        assert_eq!((m.blocks_for(5), m.blocks_for(3)), (16, 24));
    }

    #[test]
    fn a_missing_shallow_checkpoint_is_a_hole_not_a_miss() {
        let s = MemStore::new();
        let ix = idx(1 << 16);
        let mut sc = IndexBuffers::default();
        let a = hashes(&b"h".repeat(8 * 100));
        ix.record(&s, &a, 4, Known::default(), 10, &mut sc);
        // Checkpoint 0 (1 block) is evicted from its bucket: overwrite that bucket with garbage.
        let mut key = String::new();
        ix.key_for(a[0], &mut key);
        s.put(&key, b"evicted");
        let mut m = Matches::default();
        ix.lookup(&s, &a, 11, &mut sc, &mut m);
        assert_eq!(m.blocks_for(4), 96, "deeper checkpoints still match");
        let k = m.known_for(4);
        assert!(k.hole && ix.needs_refresh(k, 11));
        // Recording repairs the hole.
        ix.record(&s, &a, 4, k, 11, &mut sc);
        ix.lookup(&s, &a, 12, &mut sc, &mut m);
        let k = m.known_for(4);
        assert_eq!((k.blocks, k.hole), (96, false));
        assert!(!ix.needs_refresh(k, 12));
    }

    #[test]
    fn a_clock_stepping_back_keeps_records_fresh() {
        let s = MemStore::new();
        let ix = idx(1 << 10);
        let mut sc = IndexBuffers::default();
        let a = hashes(&b"c".repeat(8 * 20));
        ix.record(&s, &a, 9, Known::default(), 5000, &mut sc);
        // Another thread's clock is 1 s (10 units) behind, or ours stepped back.
        let mut m = Matches::default();
        ix.lookup(&s, &a, 4990, &mut sc, &mut m);
        assert_eq!(
            m.blocks_for(9),
            20,
            "checkpoint 16, then sub-checkpoints 18 and 20"
        );
        assert_eq!(age(4990, 5000), 0);
        assert_eq!(age(5000, 4990), 10);
        // A fresh-but-future holder is not the oldest one in its entry: a new holder replaces
        // the truly oldest.
        let mut b: Bucket = [Entry::default(); ENTRIES];
        upsert(&mut b, 1, 1, 100);
        upsert(&mut b, 1, 2, 110); // stamped ahead of the writer below
        upsert(&mut b, 1, 3, 50);
        upsert(&mut b, 1, 4, 60);
        upsert(&mut b, 1, 5, 105);
        let e = b.iter().find(|e| e.tag == 1).unwrap();
        let ids: Vec<u32> = e.holders.iter().map(|h| h.0).collect();
        assert!(ids.contains(&2) && !ids.contains(&3), "{ids:?}");
        // Stamps absurdly far ahead (garbage) count as expired.
        assert!(age(10, 10 + FUTURE_SLACK + 1) > 6000);
    }
}
