//! The root timer's schedules on the wall clock: load-poll rounds ([`crate::poll::Poller`])
//! and peer batches (`glue`).
//!
//! proxy-wasm gives a filter the wall clock only (`proxy_get_current_time_nanoseconds`), and NTP
//! or an operator can step it either way. This rule keeps every schedule going through a step:
//!
//! - **A last run in the future reads as long ago** ([`since`]). After a step back the schedule
//!   is due at once and re-anchors on the new clock, instead of waiting out the step (loads
//!   going stale, the outbox overflowing). After a step forward it is due at once as well (the
//!   step looks like a long pause), then keeps its period. Either way a step costs at most one
//!   early run per schedule. For the poller this early round is what keeps the polled view
//!   usable: answers stamped before a step back lie in the future, which `poll` reads as stale,
//!   and the round re-stamps them within one round trip.
//!
//! Costs: [`since`] is one subtraction.

/// Milliseconds from `last_ms` to `now_ms`, reading a `last_ms` in the future (the clock stepped
/// back) as long ago (`u64::MAX`): the schedule is due now (module docs).
pub fn since(last_ms: u64, now_ms: u64) -> u64 {
    now_ms.checked_sub(last_ms).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_last_run_in_the_future_is_due() {
        assert_eq!(since(1000, 1250), 250);
        assert_eq!(since(1000, 1000), 0);
        assert_eq!(since(61_000, 1000), u64::MAX, "stepped back: due");
        assert_eq!(since(0, 5), 5);
    }
}
