//! How busy each worker has been lately: a time-decayed average of its in-flight requests.
//!
//! The load a decision sees (own in-flight counts merged with polled ones, see `load.rs` and
//! `poll.rs`) says how many requests a worker has *now*. In conversational traffic that is
//! nearly the same small number everywhere (a closed loop of clients, one request each), while
//! the workers differ in how many conversations they carry: a worker holding five conversations
//! is busy five times as often as one holding one. The decayed average of in-flight requests
//! (Little's law: request rate x latency) tells them apart, so a new conversation can go where
//! the fewest conversations live (see `policy/cache_aware.rs`, fleet prefixes).
//!
//! Invariants and costs: one `f32` per worker per model, allocated once; updated from the loads
//! a decision already read (no host call), at most once per 100 ms clock step per model (the
//! decision clock's resolution), so the cost per decision is one comparison on most decisions
//! and one pass over the workers on the others. With `interval` 0 no average is kept and every
//! worker reads as 0. Sampling at decision instants is unbiased for Poisson-like arrivals; a
//! model without traffic keeps its last average until its next decision, which is the only time
//! it is read.

use crate::config::Config;

/// Per model: the decayed in-flight average of each worker and the clock of its last sample.
pub struct Busy {
    avg: Vec<Vec<f32>>,
    last: Vec<u32>,
}

impl Busy {
    pub fn new(cfg: &Config) -> Busy {
        Busy {
            avg: cfg
                .models
                .iter()
                .map(|m| vec![0.0; m.workers.len()])
                .collect(),
            last: vec![0; cfg.models.len()],
        }
    }

    /// Folds the in-flight counts `reqs` of model `mi`, seen at `now` (100 ms units), into the
    /// averages with time constant `window_ms` (0: off). The first sample sets the averages.
    pub fn observe(&mut self, mi: usize, now: u32, window_ms: u32, reqs: &[u32]) {
        let (Some(avg), Some(last)) = (self.avg.get_mut(mi), self.last.get_mut(mi)) else {
            return;
        };
        let Some(step) = crate::decay::step(last, now, window_ms) else {
            return;
        };
        // A restart (first sample, clock stepped back) sets the averages.
        let a = match step {
            crate::decay::Step::Keep(keep) => 1.0 - keep,
            crate::decay::Step::Restart => 1.0,
        };
        for (v, &r) in avg.iter_mut().zip(reqs) {
            // A worker marked unavailable (`poll::exclude_unknown`) keeps its average: the mark
            // is not a load, and averaging it in would make the worker look busy for minutes.
            if r < crate::poll::UNAVAILABLE {
                *v += a * (r as f32 - *v);
            }
        }
    }

    /// Model `mi`'s averages (indexed like its workers); empty for an unknown model.
    pub fn of(&self, mi: usize) -> &[f32] {
        self.avg.get(mi).map_or(&[][..], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::from_json(br#"{"models":{"m":{"workers":["a","b"]}}}"#).unwrap()
    }

    #[test]
    fn decays_toward_the_in_flight_counts() {
        let mut b = Busy::new(&cfg());
        b.observe(0, 10, 10_000, &[4, 0]);
        assert_eq!(b.of(0), &[4.0, 0.0], "the first sample sets the averages");
        // One window later the gap to the new counts has shrunk to 1/e.
        b.observe(0, 110, 10_000, &[0, 2]);
        let v = b.of(0);
        assert!((v[0] - 4.0 / std::f32::consts::E).abs() < 0.01, "{v:?}");
        assert!((v[1] - 2.0 * (1.0 - 1.0 / std::f32::consts::E)).abs() < 0.01);
        // The same clock step is one sample, whatever happens within it.
        let before = b.of(0).to_vec();
        b.observe(0, 110, 10_000, &[100, 100]);
        assert_eq!(b.of(0), &before[..]);
    }

    #[test]
    fn off_unknown_model_and_clock_steps_back() {
        let mut b = Busy::new(&cfg());
        b.observe(0, 10, 0, &[4, 4]);
        assert_eq!(b.of(0), &[0.0, 0.0], "window 0 keeps nothing");
        b.observe(7, 10, 10_000, &[4, 4]);
        assert!(b.of(7).is_empty());
        b.observe(0, 50, 10_000, &[2, 2]);
        b.observe(0, 40, 10_000, &[9, 9]);
        assert_eq!(b.of(0), &[9.0, 9.0], "a step back restarts");
    }
}
