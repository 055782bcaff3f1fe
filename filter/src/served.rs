//! Which responses read `upstream.address` to learn the worker that served (crediting a
//! fallback, `glue::Stream::credit_server`).
//!
//! The read is a host call that costs Envoy ~18k instructions per response in the `.wasm`
//! (a property lookup and a call back into the VM to allocate the copy: `docs/performance.md`),
//! 5% of a whole request, and the first choice serves nearly every request. So a response
//! reads it only when the answer matters or when a fallback is likely:
//! - the response writes index records (the stream has a plan): records must name the worker
//!   that holds the prefix, or a dead worker's records keep being refreshed;
//! - the debug header is on: it promises to name the worker that served;
//! - the chosen worker is in doubt: a read for it saw another worker serve, and no read since
//!   saw it serve itself;
//! - one response in [`SAMPLE_EVERY`] of this VM (whatever worker): how a worker that fails
//!   over without the above (Envoy's health checks moved its traffic to the fallbacks, or a
//!   retry) comes into doubt.
//!
//! What is not read: a fallback on a no-record response of an undoubted worker between
//! samples keeps its in-flight charge on the chosen worker until the stream ends (the ledger
//! is right again then) and is not in `prefix_router.served_by_fallback`.
//!
//! State is per VM and per installed configuration (a membership change starts afresh), no
//! allocation until a worker comes into doubt.

use std::cell::{Cell, RefCell};

/// One response in this many (per VM) reads the address whatever else holds.
pub const SAMPLE_EVERY: u32 = 16;

#[derive(Default)]
pub struct Watch {
    /// Responses since the last sample.
    count: Cell<u32>,
    /// (model, worker index) of the workers in doubt; nearly always empty.
    doubted: RefCell<Vec<(u16, u16)>>,
}

impl Watch {
    /// Whether this response of (`model`, `worker`) reads the served address; `needed`: it
    /// writes records or names the worker in the debug header. Counts the response for the
    /// sample either way.
    pub fn should_read(&self, needed: bool, model: u16, worker: u16) -> bool {
        let n = self.count.get() + 1;
        let sample = n >= SAMPLE_EVERY;
        self.count.set(if sample { 0 } else { n });
        needed || sample || self.in_doubt(model, worker)
    }

    fn in_doubt(&self, model: u16, worker: u16) -> bool {
        let d = self.doubted.borrow();
        !d.is_empty() && d.contains(&(model, worker))
    }

    /// What a read showed: `fell_back` when another worker served (the chosen one comes into
    /// doubt), else the chosen one served (it leaves doubt).
    pub fn saw(&self, model: u16, worker: u16, fell_back: bool) {
        let mut d = self.doubted.borrow_mut();
        let at = d.iter().position(|&k| k == (model, worker));
        match (fell_back, at) {
            (true, None) => d.push((model, worker)),
            (false, Some(i)) => {
                d.swap_remove(i);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_response_in_sample_every_reads_when_nothing_else_asks() {
        let w = Watch::default();
        let reads: Vec<bool> = (0..3 * SAMPLE_EVERY)
            .map(|_| w.should_read(false, 0, 1))
            .collect();
        assert_eq!(reads.iter().filter(|&&r| r).count(), 3);
        assert!(reads[SAMPLE_EVERY as usize - 1]);
    }

    #[test]
    fn needed_reads_always_and_still_counts_toward_the_sample() {
        let w = Watch::default();
        assert!((0..SAMPLE_EVERY - 1).all(|_| w.should_read(true, 0, 0)));
        assert!(w.should_read(false, 0, 0), "the sample's turn");
        assert!(!w.should_read(false, 0, 0));
    }

    #[test]
    fn a_worker_seen_falling_back_is_read_every_time_until_it_serves_again() {
        let w = Watch::default();
        w.saw(0, 2, true);
        w.saw(0, 2, true); // once in the list
        assert!((0..SAMPLE_EVERY * 2).all(|_| w.should_read(false, 0, 2)));
        assert!(
            !w.should_read(false, 1, 2),
            "another model's worker 2 is not in doubt"
        );
        w.saw(0, 2, false);
        let reads = (0..SAMPLE_EVERY)
            .filter(|_| w.should_read(false, 0, 2))
            .count();
        assert_eq!(reads, 1, "back to the sample only");
        assert!(w.doubted.borrow().is_empty());
    }
}
