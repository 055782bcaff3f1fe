//! The clock step of a per-worker decayed value (`busy.rs` averages, `footprint.rs` sums): how
//! much of the old value survives from the last update to now.
//!
//! Invariants: time is the decision clock (100 ms units); at most one step per clock value (a
//! second update at the same clock is no step); the first update and a clock that stepped back
//! are a *restart* (no elapsed time to decay by: each user says what a restart means) rather than
//! an extrapolation; a window of 0 takes no step.
//! Cost: one `exp` per step.

/// One step of a decayed value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    /// The share of the old value that survives: `exp(-dt / window)`.
    Keep(f32),
    /// The first update (the clock was 0) or a clock that stepped back.
    Restart,
}

/// Advances `last` to `now` and returns the step, or `None` when there is none (window 0 or the
/// same clock).
pub fn step(last: &mut u32, now: u32, window_ms: u32) -> Option<Step> {
    if window_ms == 0 || now == *last {
        return None;
    }
    let restart = *last == 0 || now < *last;
    let dt_ms = f64::from(now.wrapping_sub(*last)) * 100.0;
    *last = now;
    if restart {
        return Some(Step::Restart);
    }
    Some(Step::Keep((-dt_ms / f64::from(window_ms)).exp() as f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_once_per_clock_value_and_restarts_after_a_step_back() {
        let mut last = 0;
        assert_eq!(step(&mut last, 10, 1000), Some(Step::Restart), "first");
        assert_eq!(last, 10);
        assert_eq!(step(&mut last, 10, 1000), None, "same clock");
        match step(&mut last, 20, 1000) {
            Some(Step::Keep(k)) => assert!((k - (-1.0f32).exp()).abs() < 1e-6, "{k}"),
            s => panic!("{s:?}"),
        }
        assert_eq!(
            step(&mut last, 15, 1000),
            Some(Step::Restart),
            "a step back"
        );
        assert_eq!(last, 15);
        assert_eq!(step(&mut last, 99, 0), None, "window 0");
    }
}
