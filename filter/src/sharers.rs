//! How many requests lately reached the same deepest held prefix as this one: the other users a
//! second copy of that prefix would serve (`policy/cost.rs`, the copy term).
//!
//! Why: a copy of a conversation's own history serves that conversation only (its next turn
//! extends it, so the next request's deepest prefix is a different one), and its first copy is
//! left unused; a copy of a prompt many requests repeat (a template, a document asked about
//! again and again) serves each of them, and shares their load. The cost charges a copy for the
//! tokens it evicts; shared by `n` other users, each pays `1/(1 + n)` of it, as a fleet prefix
//! (held by most workers) is paid once per worker.
//!
//! Counting: a direct-mapped table of [`SLOTS`] slots keyed by the chained hash of the prompt's
//! deepest held block (the model seeds every hash, so one table serves every model); each slot
//! keeps a count decayed with the footprint window (`policy.placement_window_ms`: how long a
//! prefix stays cached under steady traffic), so `n` is the requests on the prefix within about
//! the time a copy of it lives. A colliding prefix replaces the slot (its count restarts at 0: a
//! shared prefix is under-counted, never a private one over-counted). Per VM: each Envoy thread
//! counts the requests it routes.
//!
//! Costs: 16 KiB per VM, allocated once; per request with a holder, one slot read and write and
//! one decay step (`decay.rs`: one `exp`); no host call.

/// Slots of the table (a power of two).
pub const SLOTS: usize = 1024;

#[derive(Clone, Copy, Default)]
struct Slot {
    tag: u64,
    count: f32,
    at: u32,
}

/// The table (module docs).
pub struct Sharers {
    slots: Vec<Slot>,
}

impl Default for Sharers {
    fn default() -> Self {
        Sharers {
            slots: vec![Slot::default(); SLOTS],
        }
    }
}

impl Sharers {
    /// [`Sharers::observe`] for a prompt of chained block `hashes` whose deepest held prefix is
    /// `deepest` blocks (0: nobody holds any of it, nothing counted).
    pub fn observe_held(&mut self, hashes: &[u64], deepest: u32, now: u32, window_ms: u32) -> f32 {
        let prefix = deepest
            .checked_sub(1)
            .and_then(|d| hashes.get(d as usize))
            .copied()
            .unwrap_or(0);
        self.observe(prefix, now, window_ms)
    }

    /// The decayed count of earlier requests whose deepest held prefix was `prefix` (0 for the
    /// first, after a collision, for `prefix` 0, or with `window_ms` 0), then counts this one.
    /// `now` is the decision clock (100 ms units).
    pub fn observe(&mut self, prefix: u64, now: u32, window_ms: u32) -> f32 {
        if prefix == 0 || window_ms == 0 {
            return 0.0;
        }
        let i = (crate::policy::mix(prefix, 0) as usize) & (SLOTS - 1);
        let Some(s) = self.slots.get_mut(i) else {
            return 0.0;
        };
        if s.tag != prefix {
            *s = Slot {
                tag: prefix,
                count: 1.0,
                at: now,
            };
            return 0.0;
        }
        // The same clock, or one that stepped back, decays nothing.
        let n = match crate::decay::step(&mut s.at, now, window_ms) {
            Some(crate::decay::Step::Keep(keep)) => s.count * keep,
            _ => s.count,
        };
        s.count = n + 1.0;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_earlier_requests_on_a_prefix_and_forgets_them_with_the_window() {
        let mut s = Sharers::default();
        assert_eq!(s.observe(42, 10, 60_000), 0.0, "first");
        assert_eq!(s.observe(42, 10, 60_000), 1.0, "same clock");
        let n = s.observe(42, 10 + 600, 60_000); // one window later
        assert!((n - 2.0 * (-1.0f32).exp()).abs() < 1e-5, "{n}");
        // Another prefix starts at 0; the clock stepping back decays nothing.
        assert_eq!(s.observe(7, 5, 60_000), 0.0);
        assert_eq!(s.observe(7, 1, 60_000), 1.0);
    }

    #[test]
    fn a_prompt_counts_by_its_deepest_held_block() {
        let mut s = Sharers::default();
        let hashes = [11u64, 12, 13];
        assert_eq!(s.observe_held(&hashes, 2, 10, 60_000), 0.0);
        assert_eq!(
            s.observe_held(&[11, 12, 99], 2, 10, 60_000),
            1.0,
            "same two blocks"
        );
        assert_eq!(
            s.observe_held(&hashes, 3, 10, 60_000),
            0.0,
            "a deeper prefix"
        );
        assert_eq!(s.observe_held(&hashes, 0, 10, 60_000), 0.0, "nothing held");
        assert_eq!(
            s.observe_held(&hashes, 9, 10, 60_000),
            0.0,
            "past the prompt"
        );
    }

    #[test]
    fn no_prefix_or_no_window_counts_nothing() {
        let mut s = Sharers::default();
        for _ in 0..3 {
            assert_eq!(s.observe(0, 10, 60_000), 0.0);
            assert_eq!(s.observe(9, 10, 0), 0.0);
        }
    }

    #[test]
    fn a_colliding_prefix_restarts_the_slot() {
        let mut s = Sharers::default();
        let a = 1u64;
        let slot = |x: u64| (crate::policy::mix(x, 0) as usize) & (SLOTS - 1);
        let b = (2u64..).find(|&x| slot(x) == slot(a)).unwrap_or(0);
        s.observe(a, 10, 60_000);
        s.observe(a, 10, 60_000);
        assert_eq!(s.observe(b, 10, 60_000), 0.0);
        assert_eq!(s.observe(a, 10, 60_000), 0.0, "a was displaced");
    }
}
