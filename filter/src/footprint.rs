//! How much new prefix each worker has been given lately: a time-decayed sum of the uncached
//! prompt tokens this VM sent it (the cache footprint it asked for).
//!
//! Rendezvous hashing spreads new prefixes over the workers binomially: 32 system prompts on 2
//! workers land 18/14 or worse about half of the time, and when the caches are tight the worker
//! with more prefixes evicts them while the other has room (measured with `load/pd_compare
//! --sizes 2`: 142 vs 114 prefill requests, 73% hit rate against SGLang's router's 78-81%, which
//! sends a new prefix to the worker with the smallest radix tree). With these sums the cache-aware
//! policy (`policy/cache_aware.rs`, `two_choices`) gives a new prefix two choices, its rendezvous
//! top and runner-up, and takes the runner-up when the top was sent more than one such prompt
//! more: footprints stay within a few prompts of each other while a prefix keeps its rendezvous
//! worker whenever the two are close (other replicas then agree), and a worker with a large
//! footprint (a long document) only stops winning comparisons until the others catch up.
//!
//! A prompt's index records are written only once its response is a 2xx (`router.rs`), so a
//! sibling arriving while the first request still prefills finds nothing, and the footprint
//! rule may send it elsewhere. The VM therefore also remembers its last placements of prompts
//! nobody held, by rendezvous key, for [`PENDING_TICKS`]: a sibling with the same key goes where
//! the first went (load bound permitting), as it would once the index had it.
//!
//! Invariants and costs: one `f32` per worker per model, allocated once; decayed at most once per
//! 100 ms clock step per model (one pass over the workers), one addition per placement, no host
//! call; the placements are a fixed table of [`PENDING_SLOTS`] slots (one probe per decision). Per VM: each Envoy thread balances what it places, so the fleet's footprints stay within
//! a few prompts of each other. With `window_ms` 0 nothing is kept and every worker reads as 0
//! (plain rendezvous).

use crate::config::Config;

/// How long a placement steers its siblings (100 ms units): a prefill's worth, after which the
/// index normally has the prompt.
pub const PENDING_TICKS: u32 = 50;
/// Remembered placements (direct-mapped by key; a collision forgets the older one).
pub const PENDING_SLOTS: usize = 256;

/// One remembered placement: (model, key, worker index, clock).
#[derive(Clone, Copy, Default)]
struct Pending {
    model: u16,
    worker: u16,
    at: u32,
    key: u64,
}

/// Per model: each worker's decayed placed tokens and the clock of the last decay; and the
/// recent placements of prompts nobody held.
pub struct Footprint {
    placed: Vec<Vec<f32>>,
    last: Vec<u32>,
    pending: Vec<Pending>,
}

impl Footprint {
    pub fn new(cfg: &Config) -> Footprint {
        Footprint {
            placed: cfg
                .models
                .iter()
                .map(|m| vec![0.0; m.workers.len()])
                .collect(),
            last: vec![0; cfg.models.len()],
            pending: vec![Pending::default(); PENDING_SLOTS],
        }
    }

    /// Remembers that model `mi`'s prompt with rendezvous key `key` (nobody held it) went to
    /// worker `w` at `now`.
    pub fn remember(&mut self, mi: usize, key: u64, w: usize, now: u32) {
        if let Some(p) = self.pending.get_mut(key as usize % PENDING_SLOTS) {
            *p = Pending {
                model: mi as u16,
                worker: w as u16,
                at: now,
                key,
            };
        }
    }

    /// The worker model `mi`'s prompt with key `key` went to within [`PENDING_TICKS`] of `now`.
    pub fn recent(&self, mi: usize, key: u64, now: u32) -> Option<usize> {
        let p = self.pending.get(key as usize % PENDING_SLOTS)?;
        (p.key == key
            && usize::from(p.model) == mi
            && p.at != 0
            && now >= p.at
            && now - p.at <= PENDING_TICKS)
            .then_some(usize::from(p.worker))
    }

    /// Decays model `mi`'s sums to `now` (100 ms units) with time constant `window_ms`.
    pub fn decay(&mut self, mi: usize, now: u32, window_ms: u32) {
        let (Some(v), Some(last)) = (self.placed.get_mut(mi), self.last.get_mut(mi)) else {
            return;
        };
        if window_ms == 0 || now == *last {
            return;
        }
        // A clock that stepped back restarts the window rather than extrapolating.
        let dt_ms = f64::from(now.saturating_sub(*last)) * 100.0;
        *last = now;
        if dt_ms == 0.0 {
            return;
        }
        let keep = (-dt_ms / f64::from(window_ms)).exp() as f32;
        for x in v.iter_mut() {
            *x *= keep;
        }
    }

    /// Worker `w` of model `mi` was given a new prefix of `tokens` tokens.
    pub fn place(&mut self, mi: usize, w: usize, tokens: u32, window_ms: u32) {
        if window_ms == 0 {
            return;
        }
        if let Some(x) = self.placed.get_mut(mi).and_then(|v| v.get_mut(w)) {
            *x += tokens as f32;
        }
    }

    /// Model `mi`'s sums (indexed like its workers); empty for an unknown model.
    pub fn of(&self, mi: usize) -> &[f32] {
        self.placed.get(mi).map_or(&[][..], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::from_json(br#"{"models":{"m":{"workers":["a","b"]}}}"#).unwrap()
    }

    #[test]
    fn sums_placements_and_decays_them() {
        let mut f = Footprint::new(&cfg());
        f.decay(0, 10, 60_000);
        f.place(0, 0, 1000, 60_000);
        f.place(0, 0, 1000, 60_000);
        f.place(0, 1, 500, 60_000);
        assert_eq!(f.of(0), &[2000.0, 500.0]);
        // One window later: 1/e of it.
        f.decay(0, 610, 60_000);
        let v = f.of(0);
        assert!((v[0] - 2000.0 / std::f32::consts::E).abs() < 1.0, "{v:?}");
        assert!((v[1] - 500.0 / std::f32::consts::E).abs() < 1.0, "{v:?}");
    }

    #[test]
    fn remembers_recent_placements_by_key() {
        let mut f = Footprint::new(&cfg());
        f.remember(0, 99, 1, 100);
        assert_eq!(f.recent(0, 99, 100 + PENDING_TICKS), Some(1));
        assert_eq!(f.recent(0, 99, 101 + PENDING_TICKS), None, "expired");
        assert_eq!(f.recent(0, 98, 100), None, "another key");
        assert_eq!(f.recent(1, 99, 100), None, "another model");
        assert_eq!(f.recent(0, 99, 99), None, "clock stepped back");
        // A colliding key replaces it.
        f.remember(0, 99 + PENDING_SLOTS as u64, 0, 110);
        assert_eq!(f.recent(0, 99, 110), None);
        assert_eq!(f.recent(0, 99 + PENDING_SLOTS as u64, 110), Some(0));
    }

    #[test]
    fn off_unknown_model_and_worker() {
        let mut f = Footprint::new(&cfg());
        f.place(0, 0, 1000, 0);
        assert_eq!(f.of(0), &[0.0, 0.0], "window 0 keeps nothing");
        f.place(7, 0, 1000, 60_000);
        f.place(0, 9, 1000, 60_000);
        assert!(f.of(7).is_empty());
        assert_eq!(f.of(0), &[0.0, 0.0]);
    }
}
