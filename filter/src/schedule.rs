//! The root timer's schedules on the wall clock: load-poll rounds ([`crate::poll::Poller`]),
//! peer batches (`peer_flush`), and the HTTP calls they wait on ([`Calls`]).
//!
//! proxy-wasm gives a filter the wall clock only (`proxy_get_current_time_nanoseconds`), and NTP
//! or an operator can step it either way. Two rules keep every schedule going through a step:
//!
//! - **A last run in the future reads as long ago** ([`since`]). After a step back the schedule
//!   is due at once and re-anchors on the new clock, instead of waiting out the step (loads
//!   going stale, the outbox overflowing). After a step forward it is due at once as well (the
//!   step looks like a long pause), then keeps its period. Either way a step costs at most one
//!   early run per schedule. For the poller this early round is what keeps the polled view
//!   usable: answers stamped before a step back lie in the future, which `poll` reads as stale,
//!   and the round re-stamps them within one round trip.
//! - **A call's age never goes negative** ([`Calls::expire`]). A call sent "in the future" (the
//!   clock stepped back since) is re-dated to now, so its expiry comes at most its timeout plus
//!   [`EXPIRY_MARGIN_MS`] later than without the step. A step forward past that expires the
//!   calls in flight (it cannot be told from a stalled thread): their targets are asked again
//!   and the late answers are ignored.
//!
//! **Lost calls.** Envoy answers a call that timed out itself (an `on_http_call_response` without
//! headers), so a call normally leaves [`Calls`] through its answer. One whose answer never
//! comes would otherwise hold its token forever: a worker never polled again, or peer batches
//! stopped at their in-flight cap. [`Calls::expire`] forgets it once `timeout + margin` passed;
//! an answer arriving later finds no token and is ignored, so nothing is counted twice.
//!
//! Costs: [`since`] is one subtraction; [`Calls`] is a small vector scanned linearly (one entry
//! per call in flight: a worker per model, a few per peer), allocated once at its largest.

/// What a call gets beyond its own timeout before it is given up: Envoy delivers the timeout
/// itself, so only an answer that is really lost (or a thread stalled this long) reaches it.
pub const EXPIRY_MARGIN_MS: u64 = 1000;

/// Milliseconds from `last_ms` to `now_ms`, reading a `last_ms` in the future (the clock stepped
/// back) as long ago (`u64::MAX`): the schedule is due now (module docs).
pub fn since(last_ms: u64, now_ms: u64) -> u64 {
    now_ms.checked_sub(last_ms).unwrap_or(u64::MAX)
}

/// HTTP calls awaiting an answer: token, when it was sent (wall-clock ms), and what it was for.
pub struct Calls<T> {
    v: Vec<(u32, u64, T)>,
}

impl<T> Default for Calls<T> {
    fn default() -> Self {
        Calls { v: Vec::new() }
    }
}

impl<T> Calls<T> {
    pub fn push(&mut self, token: u32, now_ms: u64, what: T) {
        self.v.push((token, now_ms, what));
    }

    /// Takes the call with `token` (its answer arrived); `None` for a token not awaited (expired,
    /// answered already, or never ours).
    pub fn take(&mut self, token: u32) -> Option<T> {
        let k = self.v.iter().position(|c| c.0 == token)?;
        Some(self.v.swap_remove(k).2)
    }

    /// What the calls in flight are for.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.v.iter().map(|c| &c.2)
    }

    pub fn len(&self) -> usize {
        self.v.len()
    }

    pub fn is_empty(&self) -> bool {
        self.v.is_empty()
    }

    /// Forgets the calls sent more than `timeout_ms` + [`EXPIRY_MARGIN_MS`] before `now_ms`,
    /// passing each to `gone`; re-dates a call sent after `now_ms` to it (module docs).
    pub fn expire(&mut self, now_ms: u64, timeout_ms: u32, mut gone: impl FnMut(&T)) {
        let limit = u64::from(timeout_ms) + EXPIRY_MARGIN_MS;
        self.v.retain_mut(|(_, sent, what)| {
            if *sent > now_ms {
                *sent = now_ms;
            }
            if now_ms - *sent > limit {
                gone(what);
                return false;
            }
            true
        });
    }
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

    #[test]
    fn calls_expire_after_their_timeout_and_margin_and_never_age_backwards() {
        let mut c = Calls::default();
        c.push(1, 100_000, 'a');
        c.push(2, 100_500, 'b');
        let mut gone = Vec::new();
        let limit = 250 + EXPIRY_MARGIN_MS;
        c.expire(100_000 + limit, 250, |w| gone.push(*w));
        assert!(gone.is_empty() && c.len() == 2, "not past the limit yet");
        c.expire(100_000 + limit + 1, 250, |w| gone.push(*w));
        assert_eq!((gone.as_slice(), c.len()), (&['a'][..], 1));
        assert_eq!(c.take(1), None, "an expired token is not awaited");
        // The clock steps back 60 s: the call in flight is re-dated, not expired and not kept
        // for 60 s more.
        c.expire(40_500, 250, |w| gone.push(*w));
        assert_eq!(c.len(), 1);
        c.expire(40_500 + limit, 250, |w| gone.push(*w));
        assert_eq!(c.len(), 1);
        c.expire(40_500 + limit + 1, 250, |w| gone.push(*w));
        assert!(c.is_empty());
        assert_eq!(gone, ['a', 'b']);
        // Answered calls leave through take, once.
        c.push(7, 0, 'c');
        assert_eq!(c.iter().copied().collect::<Vec<_>>(), ['c']);
        assert_eq!(c.take(7), Some('c'));
        assert_eq!(c.take(7), None);
    }
}
