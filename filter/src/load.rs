//! Load accounting: per-worker in-flight requests and in-flight (estimated uncached) prompt
//! tokens of this Envoy, in one shared-data value per model, self-healing when a VM dies.
//!
//! **Leases.** The value (`pr/l2/<model>`) is a list of leases, one per VM holding load:
//! `vm` (lease id, u32), `beat` (heartbeat, 100 ms units, u32), `n` (u32), then `n` records
//! `(worker id, requests, tokens)` (u32 each, little-endian; only non-zero workers). A VM keeps
//! its own absolute totals locally and every write *replaces* its lease with them (never a
//! delta), so nothing it writes can drift: a lost, duplicated or wrongly removed lease is exact
//! again at the VM's next write. A VM without load has no lease.
//!
//! **Liveness.** A lease counts while its heartbeat is at most [`STALE`] (2 s) from the clock
//! (a beat in the future by up to 2 s counts too: a clock stepped back). A VM holding load
//! writes its lease at every decision and, from its tick, at least every [`HEARTBEAT`] (500 ms).
//! A VM that trapped (FAIL_RELOAD: no stream-end callbacks, no timer) stops beating: readers
//! ignore its lease after the bound and any writer drops it (every write rebuilds the value and
//! leaves dead leases out; each VM's timer also checks every 200 ms, see [`Ledger::tick`]).
//! Failure modes: a live thread stalled for more than 2 s, a plugin whose root is gone while its
//! streams drain, or a forward clock step of more than 2 s makes a live lease look dead until
//! its next write (its load is under-counted meanwhile, never leaked). In a store whose writers
//! cannot vanish ([`Store::leases_expire`] false: the native build, where every stream ends
//! through Envoy's hooks and a panic aborts Envoy) leases carry the beat [`PINNED`] and never
//! expire: a native worker thread has no timer and ticks only at stream starts, so a long stream
//! on a quiet thread would otherwise drop out of every view after 2 s.
//!
//! **Costs.** A decision: one get and one CAS, plus a walk over the leases (O(m log n)
//! for m non-zero records, n workers). A release: one get and one CAS on a quiet VM, none on a
//! busy one (rides on the next write). A tick: nothing for a VM without load and unpublished
//! changes, one get + CAS per model per heartbeat for one with load; every 200 ms one get per
//! model for the shared-data gauges and dead-lease check.

use crate::config::Config;
use crate::poll::{self, Polled};
use crate::records::{rd, ById};
use crate::store::Store;

const REC: usize = 12;
const HDR: usize = 12;

/// A lease older (or further in the future) than this many 100 ms units is dead: 2 s.
pub const STALE: u32 = 20;
/// A VM holding load rewrites its lease at least this often (100 ms units): 500 ms.
pub const HEARTBEAT: u32 = 5;
/// Ticks between the shared-data load samples (gauges, dead-lease check): 4 × 50 ms.
const SAMPLE_EVERY: u32 = 4;
/// Shared-data key of the lease-id counter.
pub const LEASE_IDS_KEY: &str = "pr/lease-ids";

/// The heartbeat of a lease that never expires (a store whose writers cannot vanish:
/// [`Store::leases_expire`] false, the native build).
pub const PINNED: u32 = u32::MAX;

/// Whether a heartbeat `beat` is alive at `now` (module docs).
pub fn alive(beat: u32, now: u32) -> bool {
    if beat == PINNED {
        return true;
    }
    if beat <= now {
        now - beat <= STALE
    } else {
        beat - now <= STALE
    }
}

/// One lease of a value: `(vm, beat, start, end)` byte offsets of the whole lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LoadLease {
    vm: u32,
    beat: u32,
    start: usize,
    end: usize,
}

/// Iterates the leases of a value; stops at a malformed tail.
struct LoadLeases<'a> {
    b: &'a [u8],
    o: usize,
}

impl<'a> LoadLeases<'a> {
    fn new(b: &'a [u8]) -> Self {
        LoadLeases { b, o: 0 }
    }
}

impl Iterator for LoadLeases<'_> {
    type Item = LoadLease;
    fn next(&mut self) -> Option<LoadLease> {
        let start = self.o;
        if start + HDR > self.b.len() {
            return None;
        }
        let n = rd(self.b, start + 8) as usize;
        let end = n
            .checked_mul(REC)
            .and_then(|r| r.checked_add(start + HDR))
            .filter(|&e| e <= self.b.len())?;
        self.o = end;
        Some(LoadLease {
            vm: rd(self.b, start),
            beat: rd(self.b, start + 4),
            start,
            end,
        })
    }
}

/// Fills `reqs` / `tokens` (one slot per configured worker: `n`, with id map `ids`) with the sum
/// of every lease stored in `b`, live or not (tests and tools that inspect shared data).
pub fn decode(b: &[u8], ids: &ById, n: usize, reqs: &mut Vec<u32>, tokens: &mut Vec<u32>) {
    reqs.clear();
    tokens.clear();
    reqs.resize(n, 0);
    tokens.resize(n, 0);
    for l in LoadLeases::new(b) {
        let recs = b.get(l.start + HDR..l.end).unwrap_or(&[]);
        ids.each(recs, REC, |p, o| {
            if let (Some(r), Some(t)) = (reqs.get_mut(p), tokens.get_mut(p)) {
                *r = r.saturating_add(rd(recs, o + 4));
                *t = t.saturating_add(rd(recs, o + 8));
            }
        });
    }
}

/// One VM's view of and access to the load leases: the single home of load accounting.
///
/// Invariants: `own` holds this VM's exact in-flight totals per model and worker (every charge
/// is released exactly once by the caller); a model is `dirty` while its lease in shared data
/// may differ from `own`, and a dirty model is written with the next write of that model or
/// at the next tick; reads use `own` for this VM, so it never sees phantom load of its own.
/// Polled loads (`poll.rs`) are merged into what [`Ledger::decide`] shows the policy, never
/// into what is written.
pub struct Ledger {
    /// This VM's lease id (non-zero after [`Ledger::init`]; from the shared counter).
    me: u32,
    /// Varies per VM (the router's seed): separates two VMs racing to create the counter.
    seed: u64,
    /// Last clock seen (100 ms units), for writes that get no clock (releases).
    now: u32,
    buf: Vec<u8>,
    out: Vec<u8>,
    reqs: Vec<u32>,
    tokens: Vec<u32>,
    /// Each worker's polled `max_running_requests` as of the last merged read (0: unknown or
    /// stale).
    capacity: Vec<u32>,
    /// Per model, per worker: this VM's in-flight `(requests, tokens)`.
    own: Vec<Vec<(u32, u32)>>,
    /// Per model: unpublished changes; a lease of ours may be in shared data; its last beat.
    dirty: Vec<bool>,
    listed: Vec<bool>,
    beat: Vec<u32>,
    /// Decisions since the last tick, and whether the last tick found this VM busy enough to
    /// park its releases until its next write ([`Ledger::release`]).
    decisions: u32,
    park_releases: bool,
    ticks: u32,
    /// Per model: the workers' polled loads as of this VM's last merged read after a tick
    /// (empty: polling off).
    polled: Vec<Vec<Polled>>,
    /// Per model: a tick passed since `polled` was read; the next merged read re-reads it. A
    /// VM that makes no decision (Envoy's main thread, an idle worker thread) reads nothing, a
    /// busy one once per tick as before, and a decision sees loads as fresh as its own time.
    polled_due: Vec<bool>,
    /// Per model: the workers by id, to place records in any order in O(log n).
    ids: Vec<ById>,
    /// Shared-data totals `(requests, tokens)` over live leases of every model, last sample.
    sampled: (u64, u64),
    /// Counter updates that saturated (a release of more than was charged, or an increment past
    /// `u32::MAX`): should stay 0; exported as the `load.underflows` counter.
    pub underflows: u64,
}

impl Ledger {
    pub fn new(cfg: &Config) -> Ledger {
        let n = cfg
            .models
            .iter()
            .map(|m| m.workers.len())
            .max()
            .unwrap_or(0);
        let models = cfg.models.len();
        Ledger {
            me: 0, // until `init`: matches no stored lease
            seed: 0,
            now: 0,
            buf: Vec::with_capacity(REC * n.max(4) + 64),
            out: Vec::with_capacity(REC * n.max(4) + 64),
            reqs: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            capacity: Vec::with_capacity(n),
            own: cfg
                .models
                .iter()
                .map(|m| vec![(0, 0); m.workers.len()])
                .collect(),
            dirty: vec![false; models],
            listed: vec![false; models],
            beat: vec![0; models],
            decisions: 0,
            park_releases: false,
            ticks: 0,
            polled: cfg
                .models
                .iter()
                .map(|m| Vec::with_capacity(m.workers.len()))
                .collect(),
            polled_due: vec![false; models],
            ids: cfg
                .models
                .iter()
                .map(|m| ById::new(m.workers.iter().map(|w| w.id)))
                .collect(),
            sampled: (0, 0),
            underflows: 0,
        }
    }

    /// Takes a lease id from the shared counter (unique among this process's VMs; `seed` varies
    /// per VM and separates two VMs racing to create the counter) and creates each model's
    /// value if this is the first VM, so later writes are always conditional.
    pub fn init<S: Store>(&mut self, store: &S, cfg: &Config) {
        let seed = self.seed;
        let mut next = 0u32;
        for _ in 0..16 {
            let cas = store.get(LEASE_IDS_KEY, &mut self.buf).unwrap_or(0);
            next = rd(&self.buf, 0).wrapping_add(1);
            if store.set(LEASE_IDS_KEY, &next.to_le_bytes(), cas).is_ok() {
                break;
            }
        }
        self.me = (next ^ ((seed as u32) & 0xffff_0000)).max(1);
        for m in &cfg.models {
            if store.get(&m.load_key, &mut self.buf).is_none() {
                let _ = store.set(&m.load_key, &[], 0);
            }
        }
    }

    /// Sets the per-VM seed used by [`Ledger::init`].
    pub fn seeded(mut self, seed: u64) -> Ledger {
        self.seed = seed;
        self
    }

    /// This VM's lease id.
    pub fn lease_id(&self) -> u32 {
        self.me
    }

    /// Reads model `mi`'s value into `buf` and the live load of this Envoy into `reqs`/`tokens`
    /// (this VM's own totals plus every other live lease), merged with the polled loads when
    /// `merged`. Returns the CAS token.
    fn read<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        now: u32,
        merged: bool,
    ) -> u32 {
        self.reqs.clear();
        self.tokens.clear();
        self.capacity.clear();
        if merged && self.polled_due.get(mi).copied().unwrap_or(false) {
            self.read_polled(store, cfg, mi);
        }
        let (Some(model), Some(own), Some(ids)) =
            (cfg.models.get(mi), self.own.get(mi), self.ids.get(mi))
        else {
            return 0;
        };
        let cas = store.get(&model.load_key, &mut self.buf).unwrap_or(0);
        for &(r, t) in own {
            self.reqs.push(r);
            self.tokens.push(t);
        }
        let clock = self.now;
        for l in LoadLeases::new(&self.buf) {
            // No clock seen yet (no decision or tick): count every lease rather than guess.
            if l.vm == self.me || (clock != 0 && !alive(l.beat, clock)) {
                continue;
            }
            let recs = self.buf.get(l.start + HDR..l.end).unwrap_or(&[]);
            ids.each(recs, REC, |p, o| {
                if let (Some(r), Some(t)) = (self.reqs.get_mut(p), self.tokens.get_mut(p)) {
                    *r = r.saturating_add(rd(recs, o + 4));
                    *t = t.saturating_add(rd(recs, o + 8));
                }
            });
        }
        if merged {
            let stale = cfg.load_poll.stale_ms / 100;
            let polled = self.polled.get(mi).map_or(&[][..], Vec::as_slice);
            poll::merge(polled, now, stale, &mut self.reqs, &mut self.tokens);
            poll::capacity(polled, now, stale, &mut self.capacity);
            if model.pd.is_some() {
                poll::exclude_unknown(polled, now, stale, &mut self.reqs);
            }
        }
        self.capacity.resize(self.reqs.len(), 0);
        cas
    }

    /// Changes this VM's own totals of worker `w` of model `mi`; counts a saturation.
    fn bump(&mut self, mi: usize, w: usize, dreq: i64, dtok: i64) {
        let Some(c) = self.own.get_mut(mi).and_then(|m| m.get_mut(w)) else {
            return;
        };
        let mut exact = true;
        for (v, d) in [(&mut c.0, dreq), (&mut c.1, dtok)] {
            let next = i64::from(*v) + d;
            exact &= (0..=i64::from(u32::MAX)).contains(&next);
            *v = next.clamp(0, i64::from(u32::MAX)) as u32;
        }
        self.underflows += u64::from(!exact);
        if let Some(d) = self.dirty.get_mut(mi) {
            *d = true;
        }
    }

    /// Writes model `mi`'s value read into `buf` at token `cas`, with this VM's lease replaced
    /// by its current totals (none when all are zero) and dead or malformed leases left out.
    /// Returns false when another VM wrote in between.
    fn write<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize, cas: u32) -> bool {
        let (Some(model), Some(own)) = (cfg.models.get(mi), self.own.get(mi)) else {
            return true;
        };
        let now = self.now;
        self.out.clear();
        for l in LoadLeases::new(&self.buf) {
            if l.vm != self.me && (now == 0 || alive(l.beat, now)) {
                if let Some(b) = self.buf.get(l.start..l.end) {
                    self.out.extend_from_slice(b);
                }
            }
        }
        let n = own.iter().filter(|c| **c != (0, 0)).count();
        if n > 0 {
            let beat = if store.leases_expire() { now } else { PINNED };
            for v in [self.me, beat, n as u32] {
                self.out.extend_from_slice(&v.to_le_bytes());
            }
            for (w, c) in model.workers.iter().zip(own) {
                if *c != (0, 0) {
                    for v in [w.id, c.0, c.1] {
                        self.out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
        if store.set(&model.load_key, &self.out, cas).is_err() {
            return false;
        }
        if let Some(d) = self.dirty.get_mut(mi) {
            *d = false;
        }
        if let Some(l) = self.listed.get_mut(mi) {
            *l = n > 0;
        }
        if let Some(b) = self.beat.get_mut(mi) {
            *b = now;
        }
        true
    }

    /// Reads and writes model `mi`'s value until the CAS holds (at most `LOAD_RETRIES` times;
    /// the model stays dirty otherwise and is written with its next write or tick).
    fn publish<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize) {
        let Some(model) = cfg.models.get(mi) else {
            return;
        };
        for _ in 0..LOAD_RETRIES {
            let cas = store.get(&model.load_key, &mut self.buf).unwrap_or(0);
            if self.write(store, cfg, mi, cas) {
                return;
            }
        }
    }

    /// Chooses and charges atomically: reads the loads (merged with polled ones), lets `choose`
    /// (given each worker's requests, tokens and polled capacity, 0 = unknown) pick `(worker,
    /// tokens to charge, extra)`, and writes this VM's lease with the charge in
    /// the same CAS. If another thread wrote in between, it re-reads and re-chooses, so a load
    /// bound checked by `choose` holds across threads. After `LOAD_RETRIES` lost races the last
    /// choice stands and its charge is written with the model's next write.
    pub fn decide<S: Store, T>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        now: u32,
        mut choose: impl FnMut(&[u32], &[u32], &[u32]) -> (usize, u32, T),
    ) -> (usize, u32, T) {
        self.decisions = self.decisions.saturating_add(1);
        self.now = now;
        let mut attempt = 1;
        loop {
            let cas = self.read(store, cfg, mi, now, true);
            let (w, tok, extra) = choose(&self.reqs, &self.tokens, &self.capacity);
            if cfg.models.get(mi).and_then(|m| m.workers.get(w)).is_none() {
                return (w, tok, extra);
            }
            self.bump(mi, w, 1, i64::from(tok));
            if self.write(store, cfg, mi, cas) || attempt >= LOAD_RETRIES {
                return (w, tok, extra);
            }
            self.bump(mi, w, -1, -i64::from(tok)); // lost the race: choose again
            attempt += 1;
        }
    }

    /// The loads a choice would see now (merged), for decisions that charge a fixed worker.
    pub fn view<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        now: u32,
    ) -> (&[u32], &[u32]) {
        self.now = now;
        self.read(store, cfg, mi, now, true);
        (&self.reqs, &self.tokens)
    }

    /// Adds a delta to worker `w` of model `mi` and writes this VM's lease.
    pub fn add<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        w: usize,
        dreq: i64,
        dtok: i64,
    ) {
        if cfg.models.get(mi).and_then(|m| m.workers.get(w)).is_none() {
            return;
        }
        if dreq > 0 {
            self.decisions = self.decisions.saturating_add(1);
        }
        self.bump(mi, w, dreq, dtok);
        self.publish(store, cfg, mi);
    }

    /// Undoes a charge; the caller calls it exactly once when the stream ends.
    ///
    /// On a busy VM (at least `policy.batch_releases_min_rps` decisions per second over the last
    /// tick) the release is only applied to this VM's totals and rides on its next write of the
    /// model's value, usually milliseconds later, or on the next tick: two shared-data host calls
    /// fewer per request. This VM's own decisions see it at once; other threads see the worker
    /// busier by about one request per busy VM until then. On a quiet VM it is written at once.
    pub fn release<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        w: usize,
        reqs: u32,
        tokens: u32,
    ) {
        if reqs == 0 && tokens == 0 {
            return;
        }
        if cfg.models.get(mi).and_then(|m| m.workers.get(w)).is_none() {
            return;
        }
        self.bump(mi, w, -i64::from(reqs), -i64::from(tokens));
        if !self.park_releases {
            self.publish(store, cfg, mi);
        }
    }

    /// Undoes part of a charge in this VM's totals only: it rides on the model's next write
    /// (usually the same stream's end, milliseconds later for a non-streamed response, or the
    /// next decision) or on the next tick at the latest. For a part that ends while the rest of
    /// the stream runs on (a request's queued prompt tokens at its first response headers), so
    /// a short response writes its lease once instead of twice (two shared-data host calls
    /// fewer); other threads see the part released up to one tick (50 ms) late, this VM at once.
    /// Only where a timer runs (the Wasm host); see [`Ledger::release`].
    pub fn release_later(&mut self, cfg: &Config, mi: usize, w: usize, reqs: u32, tokens: u32) {
        if (reqs == 0 && tokens == 0) || cfg.models.get(mi).and_then(|m| m.workers.get(w)).is_none()
        {
            return;
        }
        self.bump(mi, w, -i64::from(reqs), -i64::from(tokens));
    }

    /// The VM's timer, every `elapsed_ms` at clock `now` (100 ms units): decides from the
    /// decisions since the last tick whether releases are deferred, writes every model with
    /// unpublished changes or a heartbeat due, marks the polled loads for a re-read at the next
    /// merged read (`polled_due`) and, every 200 ms (and
    /// on a new VM's first tick), samples the shared-data totals and drops dead leases.
    pub fn tick<S: Store>(&mut self, store: &S, cfg: &Config, elapsed_ms: u32, now: u32) {
        let rate = f64::from(self.decisions) * 1000.0 / f64::from(elapsed_ms.max(1));
        self.park_releases = rate >= cfg.policy.batch_releases_min_rps;
        self.decisions = 0;
        self.now = now;
        for mi in 0..cfg.models.len() {
            let due = self.listed.get(mi).copied().unwrap_or(false)
                && store.leases_expire()
                && !self
                    .beat
                    .get(mi)
                    .is_some_and(|&b| alive(b, now) && now.abs_diff(b) < HEARTBEAT);
            if self.dirty.get(mi).copied().unwrap_or(false) || due {
                self.publish(store, cfg, mi);
            }
        }
        if self.ticks.is_multiple_of(SAMPLE_EVERY) {
            self.sample(store, cfg);
        }
        self.ticks = self.ticks.wrapping_add(1);
        if cfg.load_poll.interval_ms > 0 {
            self.polled_due.fill(true);
        }
    }

    /// Re-reads model `mi`'s polled loads (one shared-data get), due since the last tick.
    fn read_polled<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize) {
        if let Some(d) = self.polled_due.get_mut(mi) {
            *d = false;
        }
        let (Some(m), Some(out)) = (cfg.models.get(mi), self.polled.get_mut(mi)) else {
            return;
        };
        match (store.get(&m.poll_key, &mut self.buf), self.ids.get(mi)) {
            (Some(_), Some(ids)) => poll::decode(&self.buf, ids, m.workers.len(), out),
            _ => out.clear(),
        }
    }

    /// Sums the live leases of every model as stored in shared data (what the load gauges show:
    /// a release that never reached shared data stays visible there), and rewrites a value that
    /// holds a dead or malformed lease without it.
    fn sample<S: Store>(&mut self, store: &S, cfg: &Config) {
        let now = self.now;
        let (mut reqs, mut tokens) = (0u64, 0u64);
        for (mi, m) in cfg.models.iter().enumerate() {
            let Some(cas) = store.get(&m.load_key, &mut self.buf) else {
                continue;
            };
            let (mut dead, mut end) = (false, 0);
            for l in LoadLeases::new(&self.buf) {
                end = l.end;
                if !alive(l.beat, now) {
                    dead = true;
                    continue;
                }
                let recs = self.buf.get(l.start + HDR..l.end).unwrap_or(&[]);
                for r in recs.chunks_exact(REC) {
                    reqs += u64::from(rd(r, 4));
                    tokens += u64::from(rd(r, 8));
                }
            }
            if dead || end != self.buf.len() {
                // Our own lease is rewritten from our totals on the way (exact either way).
                let _ = self.write(store, cfg, mi, cas);
            }
        }
        self.sampled = (reqs, tokens);
    }

    /// `(requests, tokens)` in flight in shared data over all models, as of the last sample.
    pub fn sampled(&self) -> (u64, u64) {
        self.sampled
    }

    /// Writes every model with unpublished changes (shutdown).
    pub fn flush<S: Store>(&mut self, store: &S, cfg: &Config) {
        for mi in 0..cfg.models.len() {
            if self.dirty.get(mi).copied().unwrap_or(false) {
                self.publish(store, cfg, mi);
            }
        }
    }

    /// Saturations counted since the last call (the glue adds them to the metric).
    pub fn take_underflows(&mut self) -> u64 {
        std::mem::take(&mut self.underflows)
    }

    /// Model `mi`'s workers by id (for reading the polled loads).
    pub fn ids(&self, mi: usize) -> Option<&ById> {
        self.ids.get(mi)
    }

    /// Number of models whose lease in shared data lags this VM's totals (0 except under
    /// extreme contention or on a busy VM between writes).
    pub fn pending_len(&self) -> usize {
        self.dirty.iter().filter(|d| **d).count()
    }

    /// This Envoy's in-flight `(requests, tokens)` per worker of model `mi` (this VM's totals
    /// plus every other live lease; not merged with polled loads).
    pub fn own<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize) -> Vec<(u32, u32)> {
        self.read(store, cfg, mi, 0, false);
        self.reqs
            .iter()
            .copied()
            .zip(self.tokens.iter().copied())
            .collect()
    }

    /// Model `mi`'s traffic for the poller's schedule: its value's stamp, and whether a request
    /// is in flight (this VM's own totals, or any live lease: a lease exists only with load).
    pub fn activity<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize) -> poll::Activity {
        let Some(model) = cfg.models.get(mi) else {
            return poll::Activity {
                stamp: None,
                busy: false,
            };
        };
        let stamp = store.get(&model.load_key, &mut self.buf);
        let own = self
            .own
            .get(mi)
            .is_some_and(|o| o.iter().any(|c| *c != (0, 0)));
        let clock = self.now;
        let busy = own
            || LoadLeases::new(&self.buf)
                .any(|l| l.end > l.start + HDR && (clock == 0 || alive(l.beat, clock)));
        poll::Activity { stamp, busy }
    }

    /// This Envoy's in-flight counts of worker `w` of model `mi`, for a poll snapshot.
    pub fn own_of<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize, w: usize) -> (u32, u32) {
        self.read(store, cfg, mi, 0, false);
        (
            self.reqs.get(w).copied().unwrap_or(0),
            self.tokens.get(w).copied().unwrap_or(0),
        )
    }
}

/// CAS attempts for a write before the change is left for the model's next write.
const LOAD_RETRIES: u32 = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn cfg(workers: &[&str], extra: &str) -> Config {
        let ws: Vec<String> = workers.iter().map(|w| format!("\"{w}\"")).collect();
        let json = format!(
            r#"{{"models":{{"m":{{"workers":[{}]}}}}{extra}}}"#,
            ws.join(",")
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn ledger(s: &MemStore, c: &Config, seed: u64) -> Ledger {
        let mut l = Ledger::new(c).seeded(seed);
        l.init(s, c);
        l
    }

    type Stored = (u32, u32, Vec<(u32, u32, u32)>);

    /// `(vm, beat, records)` of every lease stored.
    fn leases(s: &MemStore) -> Vec<Stored> {
        let mut b = Vec::new();
        s.get("pr/l2/m", &mut b);
        LoadLeases::new(&b)
            .map(|l| {
                let recs = b[l.start + HDR..l.end]
                    .chunks_exact(REC)
                    .map(|r| (rd(r, 0), rd(r, 4), rd(r, 8)))
                    .collect();
                (l.vm, l.beat, recs)
            })
            .collect()
    }

    #[test]
    fn each_vm_publishes_its_totals_and_readers_sum_them_by_worker_id() {
        let c = cfg(&["a", "b", "c"], "");
        let s = MemStore::new();
        let mut l = ledger(&s, &c, 1);
        l.add(&s, &c, 0, 1, 1, 100);
        l.add(&s, &c, 0, 1, 1, 50);
        l.add(&s, &c, 0, 2, 1, 7);
        assert_eq!(l.own(&s, &c, 0), vec![(0, 0), (2, 150), (1, 7)]);
        // One lease, absolute totals of the non-zero workers only.
        let ls = leases(&s);
        assert_eq!(ls.len(), 1);
        assert_eq!(ls[0].2.len(), 2);
        // A VM with a reordered config (d new, a removed) reads the same counts by id and adds
        // its own.
        let c2 = cfg(&["c", "d", "b"], "");
        let mut other = ledger(&s, &c2, 2);
        assert_ne!(other.lease_id(), l.lease_id());
        other.add(&s, &c2, 0, 0, 1, 1);
        assert_eq!(other.own(&s, &c2, 0), vec![(2, 8), (0, 0), (2, 150)]);
        assert_eq!(l.own(&s, &c, 0), vec![(0, 0), (2, 150), (2, 8)]);
        l.release(&s, &c, 0, 1, 2, 150);
        l.release(&s, &c, 0, 2, 1, 7);
        other.release(&s, &c2, 0, 0, 1, 1);
        assert!(l.own(&s, &c, 0).iter().all(|&x| x == (0, 0)));
        assert!(leases(&s).is_empty(), "a VM without load has no lease");
        assert_eq!(l.underflows + other.underflows, 0);
    }

    #[test]
    fn release_below_zero_saturates_and_is_counted() {
        let c = cfg(&["a"], "");
        let s = MemStore::new();
        let mut l = ledger(&s, &c, 1);
        l.add(&s, &c, 0, 0, 1, 3);
        l.release(&s, &c, 0, 0, 2, 5);
        assert_eq!(l.own(&s, &c, 0), vec![(0, 0)]);
        assert_eq!(l.take_underflows(), 1);
        assert_eq!(l.underflows, 0);
    }

    #[test]
    fn a_dead_lease_stops_counting_after_the_bound_and_is_removed() {
        let c = cfg(&["a", "b"], "");
        let s = MemStore::new();
        let mut dead = ledger(&s, &c, 1);
        let mut live = ledger(&s, &c, 2);
        dead.decide(&s, &c, 0, 100, |_, _, _| (0, 10, ()));
        dead.decide(&s, &c, 0, 100, |_, _, _| (0, 10, ()));
        live.decide(&s, &c, 0, 100, |_, _, _| (1, 5, ()));
        assert_eq!(live.own(&s, &c, 0), vec![(2, 20), (1, 5)]);
        // `dead` stops here (its VM trapped). `live` keeps ticking every 50 ms.
        let mut now = 100;
        for k in 0..(2 * STALE + 10) {
            if k % 2 == 0 {
                now += 1;
            }
            live.tick(&s, &c, 50, now);
            let seen = live.own(&s, &c, 0)[0];
            if now - 100 <= STALE {
                assert_eq!(seen, (2, 20), "alive within the bound (now {now})");
            } else {
                assert_eq!(seen, (0, 0), "dead after the bound (now {now})");
            }
        }
        let ls = leases(&s);
        assert_eq!(ls.len(), 1, "{ls:?}");
        assert_eq!(ls[0].0, live.lease_id());
        assert!(
            alive(ls[0].1, now),
            "the live lease is kept by its heartbeat"
        );
        assert_eq!(live.sampled(), (1, 5));
        // A lease removed by mistake (here: by a writer whose clock jumped ahead) is back, exact,
        // at its owner's next write.
        let mut jumpy = ledger(&s, &c, 3);
        jumpy.tick(&s, &c, 50, now + 100);
        assert!(leases(&s).is_empty());
        live.tick(&s, &c, 50, now + HEARTBEAT);
        assert_eq!(leases(&s)[0].2, vec![(c.models[0].workers[1].id, 1, 5)]);
    }

    #[test]
    fn in_a_store_whose_writers_cannot_vanish_a_lease_outlives_its_heartbeat() {
        // The native build: a worker thread with a long stream and no new one never ticks.
        let c = cfg(&["a", "b"], "");
        let s = MemStore::with_lasting_leases();
        let mut quiet = ledger(&s, &c, 1);
        let mut busy = ledger(&s, &c, 2);
        quiet.decide(&s, &c, 0, 100, |_, _, _| (0, 10, ()));
        let now = 100 + 10 * STALE;
        busy.tick(&s, &c, 50, now);
        assert_eq!(busy.own(&s, &c, 0), vec![(1, 10), (0, 0)], "still counted");
        busy.decide(&s, &c, 0, now, |_, _, _| (1, 5, ()));
        let ls = leases(&s);
        assert_eq!(ls.len(), 2, "a writer keeps the other lease: {ls:?}");
        assert!(ls.iter().all(|l| l.1 == PINNED));
        // Released as usual: the lease goes with its load.
        quiet.release(&s, &c, 0, 0, 1, 10);
        assert_eq!(busy.own(&s, &c, 0), vec![(0, 0), (1, 5)]);
        assert_eq!(leases(&s).len(), 1);
        // No heartbeat writes for a lease that cannot expire.
        let sets = s.calls().1;
        for k in 1..=20 {
            busy.tick(&s, &c, 50, now + k);
        }
        assert_eq!(s.calls().1, sets, "ticks wrote a pinned lease");
    }

    #[test]
    fn near_future_beats_count_far_future_ones_do_not() {
        assert!(alive(100, 100));
        assert!(alive(100 + STALE, 100), "clock stepped back by up to 2 s");
        assert!(!alive(101 + STALE, 100));
        assert!(alive(100, 100 + STALE));
        assert!(!alive(100, 101 + STALE));
    }

    #[test]
    fn garbage_values_do_not_panic_and_are_replaced() {
        let c = cfg(&["a"], "");
        let s = MemStore::new();
        s.put("pr/l2/m", b"\x01\0\0\0\x64\0\0\0\xff\xff\xff\xff12345");
        let mut l = ledger(&s, &c, 1);
        assert_eq!(l.own(&s, &c, 0), vec![(0, 0)]);
        l.decide(&s, &c, 0, 100, |_, _, _| (0, 1, ()));
        assert_eq!(leases(&s).len(), 1);
        let mut b = Vec::new();
        s.get("pr/l2/m", &mut b);
        assert_eq!(b.len(), HDR + REC, "the malformed value was rebuilt");
    }

    #[test]
    fn lost_races_keep_the_charge_local_and_the_next_write_carries_it() {
        // Every conditional set conflicts: the charge is this VM's only.
        let c = cfg(&["a", "b"], "");
        let s = MemStore::new();
        let mut l = ledger(&s, &c, 1);
        let mut other = ledger(&s, &c, 2);
        let mut v = Vec::new();
        s.get("pr/l2/m", &mut v);
        let contended = MemStore::with_conflicts(1);
        contended.put("pr/l2/m", &v);
        l.add(&contended, &c, 0, 0, 1, 10);
        assert_eq!(l.pending_len(), 1);
        assert_eq!(l.own(&contended, &c, 0)[0], (1, 10));
        assert_eq!(other.own(&contended, &c, 0)[0], (0, 0));
        // Contention ends: the next write of the model's value carries it.
        l.add(&s, &c, 0, 1, 1, 5);
        assert_eq!(l.pending_len(), 0);
        assert_eq!(other.own(&s, &c, 0), vec![(1, 10), (1, 5)]);
    }

    #[test]
    fn decide_rechooses_after_a_lost_race_and_charges_once() {
        let c = cfg(&["a", "b"], "");
        let s = MemStore::with_conflicts(2);
        let mut l = ledger(&s, &c, 1);
        let mut calls = 0;
        let (w, tok, ()) = l.decide(&s, &c, 0, 1, |r, _, _| {
            calls += 1;
            (usize::from(r[0] > r[1]), 9, ())
        });
        assert!(calls >= 1);
        assert_eq!(tok, 9);
        let own = l.own(&s, &c, 0);
        assert_eq!(own.iter().map(|x| x.0).sum::<u32>(), 1, "{own:?}");
        assert_eq!(own[w], (1, 9));
    }

    #[test]
    fn an_idle_vm_makes_no_host_call_between_samples() {
        let c = cfg(&["a", "b"], r#","load_poll":{"interval_ms":0}"#);
        let s = MemStore::new();
        let mut l = ledger(&s, &c, 1);
        l.tick(&s, &c, 50, 10); // first tick: samples
        let before = s.calls();
        for k in 0..(SAMPLE_EVERY - 1) {
            l.tick(&s, &c, 50, 10 + k);
        }
        assert_eq!(s.calls(), before);
        // With load: a heartbeat every 500 ms, not every tick.
        l.add(&s, &c, 0, 0, 1, 1);
        let (_, sets0) = s.calls();
        for k in 0..40 {
            l.tick(&s, &c, 50, 20 + k / 2);
        }
        let (_, sets) = s.calls();
        assert!(
            sets - sets0 <= 20 / HEARTBEAT as u64 + 1,
            "{}",
            sets - sets0
        );
        assert!(sets > sets0);
    }

    #[test]
    fn decisions_see_polled_load_plus_own_changes() {
        // Another replica keeps 6 requests on worker a: the policy sees them, the leases not.
        let c = cfg(&["a", "b"], "");
        let s = MemStore::new();
        let mut l = ledger(&s, &c, 1);
        let mut buf = Vec::new();
        let m = &c.models[0];
        let p = Polled {
            reqs: 6,
            tokens: 600,
            snap_reqs: 0,
            snap_tokens: 0,
            at: 10,
            capacity: 0,
            waiting: 0,
        };
        poll::publish(&s, &m.poll_key, m.workers[0].id, 0, &p, &mut buf);
        let idle = Polled {
            at: 10,
            ..Polled::default()
        };
        poll::publish(&s, &m.poll_key, m.workers[1].id, 1, &idle, &mut buf);
        let seen = |l: &mut Ledger, now| {
            let (r, _) = l.view(&s, &c, 0, now);
            r.to_vec()
        };
        assert_eq!(seen(&mut l, 10), vec![0, 0], "not before this VM's tick");
        l.tick(&s, &c, 50, 10);
        assert_eq!(seen(&mut l, 10), vec![6, 0]);
        l.add(&s, &c, 0, 0, 1, 1);
        assert_eq!(seen(&mut l, 11), vec![7, 0], "own change since the poll");
        assert_eq!(
            l.own(&s, &c, 0)[0],
            (1, 1),
            "the leases hold own counts only"
        );
        // Both stale after stale_ms (1 s = 10 units): nothing known, own counts.
        assert_eq!(seen(&mut l, 21), vec![1, 0]);
    }

    #[test]
    fn the_polled_loads_are_read_once_per_tick_and_only_for_a_decision() {
        let c = cfg(&["a", "b"], "");
        let s = MemStore::new();
        let mut l = ledger(&s, &c, 1);
        let m = &c.models[0];
        let p = Polled {
            reqs: 3,
            at: 30,
            ..Polled::default()
        };
        poll::publish(&s, &m.poll_key, m.workers[0].id, 0, &p, &mut Vec::new());
        let gets = |s: &MemStore| s.calls().0;
        // A VM without decisions (Envoy's main thread) ticks without reading them.
        l.tick(&s, &c, 50, 10);
        let before = gets(&s);
        for now in 11..30 {
            l.tick(&s, &c, 50, now);
        }
        let per_tick_idle = gets(&s) - before;
        // Decisions after a tick read them once (with the load value), then only the load.
        let before = gets(&s);
        assert_eq!(l.view(&s, &c, 0, 30).0[0], 3);
        assert_eq!(gets(&s) - before, 2);
        let before = gets(&s);
        l.view(&s, &c, 0, 30);
        assert_eq!(gets(&s) - before, 1);
        // A newer answer is seen by the first decision after the next tick.
        poll::publish(
            &s,
            &m.poll_key,
            m.workers[0].id,
            0,
            &Polled { reqs: 5, ..p },
            &mut Vec::new(),
        );
        assert_eq!(l.view(&s, &c, 0, 30).0[0], 3, "as of the last tick");
        l.tick(&s, &c, 50, 31);
        assert_eq!(l.view(&s, &c, 0, 31).0[0], 5);
        // Idle ticks read only what the ledger's own sampling reads (the load value, every
        // 200 ms), never the polled loads.
        assert!(
            per_tick_idle <= 19 / 4 + 1,
            "{per_tick_idle} reads in 19 idle ticks"
        );
    }
}
