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
//! are CAS read-modify-writes through the VM's [`Ledger`]; a writer that keeps losing races keeps
//! its delta parked and retries, so no delta is ever lost.

use crate::config::{Config, Worker};
use crate::poll::{self, Polled};
use crate::records::{find, rd, wr, ById};
use crate::store::Store;

const REC: usize = 12;

/// Fills `reqs` / `tokens` (one slot per configured worker: `n`, with id map `ids`) from a
/// stored value; O(m log n) for m records in any order.
pub fn decode(b: &[u8], ids: &ById, n: usize, reqs: &mut Vec<u32>, tokens: &mut Vec<u32>) {
    reqs.clear();
    tokens.clear();
    reqs.resize(n, 0);
    tokens.resize(n, 0);
    ids.each(b, REC, |p, o| {
        if let (Some(r), Some(t)) = (reqs.get_mut(p), tokens.get_mut(p)) {
            *r = rd(b, o + 4);
            *t = rd(b, o + 8);
        }
    });
}

/// Applies a delta to `id`'s record in the raw value, appending the record if missing.
/// Counts saturate at 0 and `u32::MAX`; returns false if a decrement found less than it removes.
pub fn apply(b: &mut Vec<u8>, id: u32, hint: usize, dreq: i64, dtok: i64) -> bool {
    b.truncate(b.len() - b.len() % REC);
    let o = match find(b, REC, id, hint) {
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

/// CAS attempts for a load-vector update before the delta is parked.
const LOAD_RETRIES: u32 = 32;

/// A delta that lost too many CAS races, or a release parked on a busy VM; written with this
/// VM's next write of the model's load vector (or its next tick). Coalesced per worker.
#[derive(Debug, Clone, Copy)]
struct Pending {
    model: u16,
    worker: u16,
    dreq: i64,
    dtok: i64,
}

/// One VM's view of and access to the load vectors: the single home of load accounting.
///
/// Invariants: every charge is released exactly once by the caller; a delta is either written or
/// parked (never dropped), and parked deltas ride on the next write of the same model's vector or
/// on [`Ledger::tick`]; this VM's own reads include its parked deltas, so it never sees phantom
/// load of its own. Polled loads (`poll.rs`) are merged into what [`Ledger::decide`] shows the
/// policy, never into what is written.
pub struct Ledger {
    buf: Vec<u8>,
    reqs: Vec<u32>,
    tokens: Vec<u32>,
    pending: Vec<Pending>,
    /// Decisions since the last tick, and whether the last tick found this VM busy enough to
    /// park releases.
    decisions: u32,
    busy: bool,
    /// Per model: the workers' polled loads as of this VM's last tick (empty: polling off).
    polled: Vec<Vec<Polled>>,
    /// Per model: the workers by id, to place records in any order in O(log n).
    ids: Vec<ById>,
    /// Written deltas that saturated a counter (a decrement below zero or an increment past
    /// `u32::MAX`): should stay 0; exported as the `load.underflows` counter.
    pub underflows: u64,
    /// Parked deltas that saturated in the last `read` (counted once that value is written).
    read_saturated: u64,
}

impl Ledger {
    pub fn new(cfg: &Config) -> Ledger {
        let n = cfg
            .models
            .iter()
            .map(|m| m.workers.len())
            .max()
            .unwrap_or(0);
        Ledger {
            buf: Vec::with_capacity(REC * n.max(4) + 64),
            reqs: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            pending: Vec::with_capacity(n.max(4)),
            decisions: 0,
            busy: false,
            polled: cfg
                .models
                .iter()
                .map(|m| Vec::with_capacity(m.workers.len()))
                .collect(),
            ids: cfg
                .models
                .iter()
                .map(|m| ById::new(m.workers.iter().map(|w| w.id)))
                .collect(),
            underflows: 0,
            read_saturated: 0,
        }
    }

    /// Creates each model's load vector if this is the first VM to start.
    pub fn init<S: Store>(&mut self, store: &S, cfg: &Config) {
        for m in &cfg.models {
            ensure(store, &m.load_key, &m.workers, &mut self.buf);
        }
    }

    /// Reads model `mi`'s vector (with this VM's parked deltas) into `reqs`/`tokens`, merged
    /// with the polled loads when `merged`. Returns the CAS token.
    fn read<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        now: u32,
        merged: bool,
    ) -> u32 {
        let Some(model) = cfg.models.get(mi) else {
            return 0;
        };
        let cas = store.get(&model.load_key, &mut self.buf).unwrap_or(0);
        self.read_saturated = self.apply_parked(cfg, mi);
        if let Some(ids) = self.ids.get(mi) {
            decode(
                &self.buf,
                ids,
                model.workers.len(),
                &mut self.reqs,
                &mut self.tokens,
            );
        }
        if merged {
            let stale = cfg.load_poll.stale_ms / 100;
            let polled = self.polled.get(mi).map_or(&[][..], Vec::as_slice);
            poll::merge(polled, now, stale, &mut self.reqs, &mut self.tokens);
        }
        cas
    }

    /// Chooses and charges atomically: reads the loads (merged with polled ones), lets `choose`
    /// pick `(worker, tokens to charge, extra)`, and charges one request and those tokens in the
    /// same CAS. If another thread wrote in between, it re-reads and re-chooses, so a load bound
    /// checked by `choose` holds across threads. After `LOAD_RETRIES` lost races the last choice
    /// stands and its charge is parked.
    pub fn decide<S: Store, T>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        now: u32,
        mut choose: impl FnMut(&[u32], &[u32]) -> (usize, u32, T),
    ) -> (usize, u32, T) {
        self.decisions = self.decisions.saturating_add(1);
        let mut attempt = 1;
        loop {
            let cas = self.read(store, cfg, mi, now, true);
            let (w, tok, extra) = choose(&self.reqs, &self.tokens);
            let Some((model, worker)) = cfg
                .models
                .get(mi)
                .and_then(|m| Some((m, m.workers.get(w)?)))
            else {
                return (w, tok, extra);
            };
            // `buf` holds the raw vector plus parked deltas: what this write carries.
            let exact = apply(&mut self.buf, worker.id, w, 1, i64::from(tok));
            if store.set(&model.load_key, &self.buf, cas).is_ok() {
                self.underflows += self.read_saturated + u64::from(!exact);
                self.pending.retain(|p| usize::from(p.model) != mi);
                return (w, tok, extra);
            }
            if attempt >= LOAD_RETRIES {
                self.park(mi, w, 1, i64::from(tok));
                return (w, tok, extra);
            }
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
        self.read(store, cfg, mi, now, true);
        (&self.reqs, &self.tokens)
    }

    /// Adds a delta to worker `w` of model `mi`, together with the model's parked deltas, in one
    /// CAS read-modify-write; parks it if the CAS keeps losing.
    pub fn add<S: Store>(
        &mut self,
        store: &S,
        cfg: &Config,
        mi: usize,
        w: usize,
        dreq: i64,
        dtok: i64,
    ) {
        let Some(model) = cfg.models.get(mi) else {
            return;
        };
        let Some(worker) = model.workers.get(w) else {
            return;
        };
        if dreq > 0 {
            self.decisions = self.decisions.saturating_add(1);
        }
        for _ in 0..LOAD_RETRIES {
            let cas = store.get(&model.load_key, &mut self.buf).unwrap_or(0);
            let saturated = self.apply_parked(cfg, mi);
            let exact = apply(&mut self.buf, worker.id, w, dreq, dtok);
            if store.set(&model.load_key, &self.buf, cas).is_ok() {
                self.underflows += saturated + u64::from(!exact);
                self.pending.retain(|p| usize::from(p.model) != mi);
                return;
            }
        }
        self.park(mi, w, dreq, dtok);
    }

    /// Undoes a charge; the caller calls it exactly once when the stream ends.
    ///
    /// On a busy VM (at least `policy.batch_releases_min_rps` decisions per second over the last
    /// tick) the release is parked and rides on this VM's next load-vector write, usually
    /// milliseconds later, or on the next tick: two shared-data host calls fewer per request.
    /// This VM's own decisions see it at once; other threads see the worker busier by about one
    /// request per busy VM until then. On a quiet VM it is written at once.
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
        let (dreq, dtok) = (-i64::from(reqs), -i64::from(tokens));
        if self.busy {
            self.park(mi, w, dreq, dtok);
        } else {
            self.add(store, cfg, mi, w, dreq, dtok);
        }
    }

    /// The VM's timer: decides from the decisions of the last `elapsed_ms` whether releases are
    /// parked until the next tick, writes every parked delta and re-reads the polled loads.
    pub fn tick<S: Store>(&mut self, store: &S, cfg: &Config, elapsed_ms: u32) {
        let rate = f64::from(self.decisions) * 1000.0 / f64::from(elapsed_ms.max(1));
        self.busy = rate >= cfg.policy.batch_releases_min_rps;
        self.decisions = 0;
        self.flush(store, cfg);
        if cfg.load_poll.interval_ms > 0 {
            for (mi, (m, out)) in cfg.models.iter().zip(self.polled.iter_mut()).enumerate() {
                match store.get(&m.poll_key, &mut self.buf) {
                    Some(_) => match self.ids.get(mi) {
                        Some(ids) => poll::decode(&self.buf, ids, m.workers.len(), out),
                        None => out.clear(),
                    },
                    None => out.clear(),
                }
            }
        }
    }

    /// Writes every parked delta (the VM's tick, and shutdown).
    pub fn flush<S: Store>(&mut self, store: &S, cfg: &Config) {
        let mut k = 0;
        while let Some(p) = self.pending.get(k).copied() {
            let before = self.pending.len();
            self.add(
                store,
                cfg,
                usize::from(p.model),
                usize::from(p.worker),
                0,
                0,
            );
            if self.pending.len() == before {
                k += 1; // still parked (CAS kept losing): try the next model
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

    /// Number of parked load deltas (0 except under extreme contention or on a busy VM).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// This Envoy's own in-flight `(requests, tokens)` per worker of model `mi` (not merged).
    pub fn own<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize) -> Vec<(u32, u32)> {
        self.read(store, cfg, mi, 0, false);
        self.reqs
            .iter()
            .copied()
            .zip(self.tokens.iter().copied())
            .collect()
    }

    /// This Envoy's own in-flight counts of worker `w` of model `mi`, for a poll snapshot.
    pub fn own_of<S: Store>(&mut self, store: &S, cfg: &Config, mi: usize, w: usize) -> (u32, u32) {
        self.read(store, cfg, mi, 0, false);
        (
            self.reqs.get(w).copied().unwrap_or(0),
            self.tokens.get(w).copied().unwrap_or(0),
        )
    }

    fn park(&mut self, mi: usize, w: usize, dreq: i64, dtok: i64) {
        let (model, worker) = (mi as u16, w as u16);
        match self
            .pending
            .iter_mut()
            .find(|p| p.model == model && p.worker == worker)
        {
            Some(p) => {
                p.dreq += dreq;
                p.dtok += dtok;
            }
            None => self.pending.push(Pending {
                model,
                worker,
                dreq,
                dtok,
            }),
        }
    }

    /// Applies model `mi`'s parked deltas to the value in `buf`; returns how many saturated.
    fn apply_parked(&mut self, cfg: &Config, mi: usize) -> u64 {
        let Some(model) = cfg.models.get(mi) else {
            return 0;
        };
        let mut saturated = 0;
        for p in self.pending.iter().filter(|p| usize::from(p.model) == mi) {
            if let Some(w) = model.workers.get(usize::from(p.worker)) {
                if !apply(&mut self.buf, w.id, usize::from(p.worker), p.dreq, p.dtok) {
                    saturated += 1;
                }
            }
        }
        saturated
    }
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

    fn ids(ws: &[Worker]) -> ById {
        ById::new(ws.iter().map(|w| w.id))
    }

    fn cfg(workers: &[&str], extra: &str) -> Config {
        let ws: Vec<String> = workers.iter().map(|w| format!("\"{w}\"")).collect();
        let json = format!(
            r#"{{"models":{{"m":{{"workers":[{}]}}}}{extra}}}"#,
            ws.join(",")
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn increments_and_decrements_by_id() {
        let c = cfg(&["a", "b", "c"], "");
        let s = MemStore::new();
        let mut l = Ledger::new(&c);
        l.init(&s, &c);
        l.add(&s, &c, 0, 1, 1, 100);
        l.add(&s, &c, 0, 1, 1, 50);
        l.add(&s, &c, 0, 2, 1, 7);
        assert_eq!(l.own(&s, &c, 0), vec![(0, 0), (2, 150), (1, 7)]);
        // A reordered config reads the same counts by id.
        let (mut r, mut t, mut buf) = (Vec::new(), Vec::new(), Vec::new());
        s.get("pr/l/m", &mut buf);
        let ws = workers(&["c", "d", "b"]);
        decode(&buf, &ids(&ws), 3, &mut r, &mut t);
        assert_eq!((r, t), (vec![1, 0, 2], vec![7, 0, 150]));
        l.release(&s, &c, 0, 1, 2, 150);
        l.release(&s, &c, 0, 2, 1, 7);
        assert!(l.own(&s, &c, 0).iter().all(|&x| x == (0, 0)));
        assert_eq!(l.underflows, 0);
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
        decode(&b, &ids(&ws), 1, &mut r, &mut t);
        assert_eq!((r[0], t[0]), (0, 0));
        let c = cfg(&["a"], "");
        let s = MemStore::new();
        let mut l = Ledger::new(&c);
        l.release(&s, &c, 0, 0, 1, 1);
        assert_eq!(l.underflows, 1);
    }

    #[test]
    fn a_saturating_parked_delta_is_counted_when_a_decision_writes_it() {
        // A busy VM parks a release of more than was charged; the next decision carries it, the
        // counter saturates at 0 and the saturation is counted (it was silently dropped).
        let c = cfg(&["a", "b"], r#","policy":{"batch_releases_min_rps":0}"#);
        let s = MemStore::new();
        let mut l = Ledger::new(&c);
        l.init(&s, &c);
        l.tick(&s, &c, 50);
        l.release(&s, &c, 0, 0, 1, 10);
        assert_eq!(l.pending_len(), 1);
        assert_eq!(l.underflows, 0);
        l.decide(&s, &c, 0, 1, |_, _| (1, 5, ()));
        assert_eq!(l.pending_len(), 0);
        assert_eq!(l.take_underflows(), 1);
        assert_eq!(l.underflows, 0);
        assert_eq!(l.own(&s, &c, 0), vec![(0, 0), (1, 5)]);
    }

    #[test]
    fn garbage_values_do_not_panic() {
        let ws = workers(&["a"]);
        let (mut r, mut t) = (Vec::new(), Vec::new());
        decode(b"1234567", &ids(&ws), 1, &mut r, &mut t);
        assert_eq!(r, vec![0]);
        let mut b = b"12345678901234".to_vec();
        apply(&mut b, ws[0].id, 0, 1, 1);
        assert_eq!(b.len(), 24);
    }

    #[test]
    fn lost_races_park_the_delta_and_the_next_write_carries_it() {
        // Every conditional set conflicts: the charge is parked, visible to this VM only.
        let c = cfg(&["a", "b"], "");
        let s = MemStore::with_conflicts(1);
        let mut l = Ledger::new(&c);
        l.init(&s, &c);
        l.add(&s, &c, 0, 0, 1, 10);
        assert_eq!(l.pending_len(), 1);
        assert_eq!(l.own(&s, &c, 0)[0], (1, 10));
        let mut other = Ledger::new(&c);
        assert_eq!(other.own(&s, &c, 0)[0], (0, 0));
        // Contention ends: the next write of the model's vector carries the parked delta.
        let s2 = MemStore::new();
        let mut buf = Vec::new();
        s.get("pr/l/m", &mut buf);
        s2.put("pr/l/m", &buf);
        l.add(&s2, &c, 0, 1, 1, 5);
        assert_eq!(l.pending_len(), 0);
        assert_eq!(other.own(&s2, &c, 0), vec![(1, 10), (1, 5)]);
    }

    #[test]
    fn decide_rechooses_after_a_lost_race_and_charges_once() {
        let c = cfg(&["a", "b"], "");
        let s = MemStore::with_conflicts(2);
        let mut l = Ledger::new(&c);
        l.init(&s, &c);
        let mut calls = 0;
        let (w, tok, ()) = l.decide(&s, &c, 0, 1, |r, _| {
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
    fn decisions_see_polled_load_plus_own_changes() {
        // Another replica keeps 6 requests on worker a: the policy sees them, the vector not.
        let c = cfg(&["a", "b"], "");
        let s = MemStore::new();
        let mut l = Ledger::new(&c);
        l.init(&s, &c);
        let mut buf = Vec::new();
        let m = &c.models[0];
        let p = Polled {
            reqs: 6,
            tokens: 600,
            snap_reqs: 0,
            snap_tokens: 0,
            at: 10,
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
        l.tick(&s, &c, 50);
        assert_eq!(seen(&mut l, 10), vec![6, 0]);
        l.add(&s, &c, 0, 0, 1, 1);
        assert_eq!(seen(&mut l, 11), vec![7, 0], "own change since the poll");
        assert_eq!(
            l.own(&s, &c, 0)[0],
            (1, 1),
            "the vector holds own counts only"
        );
        // Both stale after stale_ms (1 s = 10 units): nothing known, own counts.
        assert_eq!(seen(&mut l, 21), vec![1, 0]);
    }
}
