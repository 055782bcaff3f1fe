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
//! Siblings of a prompt placed moments ago, before the index has it, follow it instead
//! (`placements.rs`).
//!
//! Invariants and costs: one `f32` per worker per model, allocated once; decayed at most once per
//! 100 ms clock step per model (one pass over the workers), one addition per placement, no host
//! call. Per VM: each Envoy thread balances what it places, so the fleet's footprints stay within
//! a few prompts of each other. With `window_ms` 0 nothing is kept and every worker reads as 0
//! (plain rendezvous).

use crate::config::Config;

/// Per model: each worker's decayed placed tokens and the clock of the last decay.
pub struct Footprint {
    placed: Vec<Vec<f32>>,
    last: Vec<u32>,
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
        }
    }

    /// Decays model `mi`'s sums to `now` (100 ms units) with time constant `window_ms`.
    pub fn decay(&mut self, mi: usize, now: u32, window_ms: u32) {
        let (Some(v), Some(last)) = (self.placed.get_mut(mi), self.last.get_mut(mi)) else {
            return;
        };
        // A restart (first decay, clock stepped back) keeps the sums as they are.
        let Some(crate::decay::Step::Keep(keep)) = crate::decay::step(last, now, window_ms) else {
            return;
        };
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
