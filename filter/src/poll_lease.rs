//! The poll lease: which one VM of an Envoy polls the workers ([`crate::poll`]). A lease in
//! shared data names its holder and expiry; each VM keeps a [`LeaseView`] so that most ticks
//! read nothing. Invariant: at most one holder at a time, except for at most half a ttl after
//! two VMs took a fresh lease at once (harmless: both publish the same kind of answer).

use crate::store::Store;

/// Election of the one VM per Envoy that polls: a lease in shared data (`owner`, `expires` in ms).
/// The holder renews it once half its time is gone (every few ticks: `ttl` spans several), reading
/// it only then ([`LeaseView`]); another VM takes it over only once it expired (the holder's thread
/// stalled, or its VM was replaced or trapped). Two pollers for a moment are harmless (both publish
/// the same kind of answer). After the 16 bytes the value carries the holder's poll schedule as of
/// its last write (`Poller::write_pace`, up to half a ttl old), which a VM taking the lease over
/// adopts: a hand-over does not restart the back-offs.
pub struct PollLease;

pub const LEASE_KEY: &str = "pr/poller";

impl PollLease {
    /// Takes or renews the lease for `me` until `now_ms + ttl_ms`; true if `me` holds it.
    pub fn hold<S: Store>(store: &S, me: u64, now_ms: u64, ttl_ms: u64, buf: &mut Vec<u8>) -> bool {
        Self::hold_until(store, me, now_ms, ttl_ms, buf, |_| {}).held
    }

    /// [`PollLease::hold`], also saying until when the lease it read or wrote runs and whether
    /// `me` took it over from another VM (then `buf` holds that VM's value: its schedule
    /// after the first 16 bytes). A written lease carries `pace`'s bytes after its owner and
    /// expiry: the holder's poll schedule, for whoever takes the lease over next.
    pub fn hold_until<S: Store>(
        store: &S,
        me: u64,
        now_ms: u64,
        ttl_ms: u64,
        buf: &mut Vec<u8>,
        pace: impl FnOnce(&mut Vec<u8>),
    ) -> Hold {
        let cas = store.get(LEASE_KEY, buf);
        let mut taken = false;
        if let Some(cur) = buf.get(..16) {
            let owner = u64::from_le_bytes(cur[..8].try_into().unwrap_or([0; 8]));
            let expires = u64::from_le_bytes(cur[8..16].try_into().unwrap_or([0; 8]));
            if owner != me && now_ms < expires {
                return Hold::until(false, expires);
            }
            // Ours with more than half its time left: renewed at a later tick (a CAS fewer on
            // most ticks; the holder still renews long before anyone may take over). An expiry
            // further than `ttl_ms` ahead (the clock stepped back) is re-anchored now.
            let left = expires.saturating_sub(now_ms);
            if owner == me && left > ttl_ms / 2 && left <= ttl_ms {
                return Hold::until(true, expires);
            }
            taken = owner != me;
        }
        let until = now_ms + ttl_ms;
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&me.to_le_bytes());
        v.extend_from_slice(&until.to_le_bytes());
        pace(&mut v);
        // A CAS on a missing key inserts, so two VMs racing for a fresh lease both "win" once;
        // the next renewal settles it (only the last writer sees itself as owner).
        match store.set(LEASE_KEY, &v, cas.unwrap_or(0)) {
            Ok(_) => Hold {
                held: true,
                until_ms: until,
                taken,
            },
            Err(_) => Hold::until(false, 0),
        }
    }
}

/// What [`PollLease::hold_until`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub held: bool,
    /// Expiry of the lease read or written (ms); 0: unknown, a lost CAS.
    pub until_ms: u64,
    /// `held`, taken over from another VM whose value is in the caller's buffer.
    pub taken: bool,
}

impl Hold {
    fn until(held: bool, until_ms: u64) -> Hold {
        Hold {
            held,
            until_ms,
            taken: false,
        }
    }
}

/// What one VM last learned of the poll lease, so that most of its ticks read nothing: while
/// its own lease has more than half its time left it holds it (the read would change nothing:
/// [`PollLease::hold`] renews only after that), and while another VM's has not expired nobody
/// may take it. An expiry further than the ttl ahead (the clock stepped back) is read again.
/// Cost: the holder reads the lease about once per half ttl (it renews then), another VM once
/// per expiry it saw, instead of every VM on every 50 ms tick. The one case the read would
/// have caught sooner, two VMs that both took a fresh lease at once, lasts until the loser's
/// renewal (at most half a ttl of two pollers, which is harmless).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseView {
    held: bool,
    /// Expiry of the lease last read or written (ms); 0: unknown.
    until_ms: u64,
}

impl LeaseView {
    /// [`PollLease::hold`] without the shared-data read when this view already knows.
    pub fn hold<S: Store>(
        &mut self,
        store: &S,
        me: u64,
        now_ms: u64,
        ttl_ms: u64,
        buf: &mut Vec<u8>,
    ) -> bool {
        self.hold_with(store, me, now_ms, ttl_ms, buf, |_| {}).held
    }

    /// [`LeaseView::hold`] through [`PollLease::hold_until`]: a written lease carries `pace`,
    /// and a lease taken over from another VM leaves that VM's value in `buf` (`taken`). When
    /// this view already knows, nothing is read and `pace` is not called.
    pub fn hold_with<S: Store>(
        &mut self,
        store: &S,
        me: u64,
        now_ms: u64,
        ttl_ms: u64,
        buf: &mut Vec<u8>,
        pace: impl FnOnce(&mut Vec<u8>),
    ) -> Hold {
        let left = self.until_ms.checked_sub(now_ms).filter(|&l| l <= ttl_ms);
        match left {
            Some(l) if self.held && l > ttl_ms / 2 => return Hold::until(true, self.until_ms),
            Some(l) if !self.held && l > 0 => return Hold::until(false, self.until_ms),
            _ => {}
        }
        let hold = PollLease::hold_until(store, me, now_ms, ttl_ms, buf, pace);
        *self = LeaseView {
            held: hold.held,
            until_ms: hold.until_ms,
        };
        hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn one_lease_holder_until_it_expires() {
        let s = MemStore::new();
        let mut b = Vec::new();
        assert!(PollLease::hold(&s, 1, 1000, 300, &mut b));
        assert!(!PollLease::hold(&s, 2, 1100, 300, &mut b));
        let cas = s.get(LEASE_KEY, &mut b);
        assert!(PollLease::hold(&s, 1, 1100, 300, &mut b));
        assert_eq!(
            s.get(LEASE_KEY, &mut b),
            cas,
            "more than half left: not renewed yet"
        );
        assert!(PollLease::hold(&s, 1, 1200, 300, &mut b), "renewal");
        assert_ne!(s.get(LEASE_KEY, &mut b), cas);
        assert!(!PollLease::hold(&s, 2, 1499, 300, &mut b));
        assert!(
            PollLease::hold(&s, 2, 1500, 300, &mut b),
            "expired: taken over"
        );
        assert!(!PollLease::hold(&s, 1, 1600, 300, &mut b));
        // The clock steps back 600 ms: the holder re-anchors its expiry at once, so a holder
        // that dies after a step is taken over within a ttl, not a ttl plus the step.
        assert!(PollLease::hold(&s, 2, 1600, 300, &mut b));
        let cas = s.get(LEASE_KEY, &mut b);
        assert!(PollLease::hold(&s, 2, 1000, 300, &mut b));
        assert_ne!(s.get(LEASE_KEY, &mut b), cas, "re-anchored");
        assert!(
            PollLease::hold(&s, 1, 1301, 300, &mut b),
            "taken over at 1000 + ttl"
        );
    }

    /// Two VMs ticking every 50 ms through their [`LeaseView`]s: exactly one holds the lease at
    /// every tick, as with a read on each tick, for under a third of the reads; when the holder
    /// stops ticking (its VM gone), the other takes over within the ttl plus a tick; a clock
    /// stepped back is read again at once.
    #[test]
    fn a_lease_view_reads_the_lease_rarely_and_hands_it_over_as_before() {
        let s = MemStore::new();
        let mut b = Vec::new();
        let (ttl, mut views) = (300, [LeaseView::default(); 2]);
        let mut holder_at = Vec::new();
        let mut now = 1_000_000;
        for tick in 0..400 {
            let mut held = Vec::new();
            // VM 1 ticks first (so it takes the lease) and stops at tick 200 (its VM gone).
            for vm in [1usize, 0] {
                if vm == 1 && tick >= 200 {
                    continue;
                }
                if views[vm].hold(&s, vm as u64 + 1, now, ttl, &mut b) {
                    held.push(vm);
                }
            }
            holder_at.push(held);
            now += 50;
        }
        assert!(
            holder_at[..200].iter().all(|h| h == &[1]),
            "{:?}",
            &holder_at[..10]
        );
        let gap = holder_at[200..].iter().take_while(|h| h.is_empty()).count();
        assert!(gap <= 7, "taken over after {gap} ticks");
        assert!(holder_at[200 + gap..].iter().all(|h| h == &[0]));
        let (gets, _) = s.calls();
        assert!(gets < 600 / 3, "{gets} reads for 600 ticks");
        // The clock steps back 10 s: the holder reads (and re-anchors) at once.
        let before = s.calls().0;
        assert!(views[0].hold(&s, 1, now - 10_000, ttl, &mut b));
        assert_eq!(s.calls().0, before + 1);
    }
}
