//! What the LB sees of Envoy ([`LbHost`]: the request's header, the cluster's hosts, the retry
//! predicates) and [`Table`], one LB instance's map from a host's address to its two indexes.
//!
//! Envoy names hosts by position, twice: the answer of `choose_host` counts healthy hosts only,
//! the retry predicate and the host stats count every member. The filter names hosts by address
//! (`IP:PORT`). The table maps one to the others without a call per host per request:
//! - rebuilt (one address call per host, one sort) when Envoy reports a membership change, and
//!   when a lookup cannot be trusted (below): never in steady state;
//! - a lookup is a binary search, then one call to check that the healthy position still holds
//!   that address (health changes reorder healthy hosts without a membership event); a stale
//!   position rebuilds the table (at most once per pick);
//! - a host the table saw unhealthy costs one call (the healthy count): the table is rebuilt
//!   when the count moved, so a host that became healthy is seen at its first listing; an
//!   address the table does not know costs one call (the member count), rebuilt when it moved.
//!
//! Invariant: after [`Table::find`] returns `Some`, the slot's positions were right at the time
//! of the call (checked against Envoy, or just rebuilt from it). A `None` is right unless one
//! host left the healthy set and another joined it between two builds (the count did not move):
//! then the joined one is skipped until a position check fails, which the left one's causes.

/// Envoy as the LB sees it during one `choose_host` (priority 0 only: pool clusters have one).
pub(crate) trait LbHost {
    /// The first value of request header `name` (lower case), None when absent.
    fn header(&self, name: &[u8]) -> Option<&[u8]>;
    /// Every member, and the healthy ones (Envoy's `hosts()` / `healthyHosts()`).
    fn hosts_count(&self) -> usize;
    fn healthy_count(&self) -> usize;
    /// `IP:PORT` of member `i` / of healthy host `i`.
    fn host_address(&self, i: usize) -> Option<&[u8]>;
    fn healthy_address(&self, i: usize) -> Option<&[u8]>;
    /// Whether the route's retry predicates reject member `i` (this request already tried it).
    fn rejected(&self, i: usize) -> bool;
    /// Requests in flight to member `i`.
    fn active_requests(&self, i: usize) -> u64;
}

/// A host's two positions: in `healthyHosts()` (the hook's answer) and in `hosts()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) healthy: u32,
    pub(crate) member: u32,
}

/// Marks a member that was not healthy when the table was built.
const UNHEALTHY: u32 = u32::MAX;

struct Entry {
    address: Box<[u8]>,
    member: u32,
    healthy: u32,
}

#[derive(Default)]
pub(crate) struct Table {
    /// Sorted by address.
    entries: Vec<Entry>,
    /// Member position of each healthy position.
    members_of_healthy: Vec<u32>,
    /// Rebuild before the next lookup (a membership change, or never built).
    stale: bool,
    /// Envoy's member count at the last build.
    members: usize,
}

impl Table {
    pub(crate) fn new() -> Table {
        Table {
            stale: true,
            ..Table::default()
        }
    }

    /// Rebuild before the next lookup: Envoy reported a membership change.
    pub(crate) fn invalidate(&mut self) {
        self.stale = true;
    }

    /// The member position of healthy host `i` (as of the last rebuild).
    pub(crate) fn member_of_healthy(&self, i: usize) -> Option<u32> {
        self.members_of_healthy.get(i).copied()
    }

    /// Rebuilds from Envoy when stale; `rebuilt` tells whether this pick already rebuilt.
    pub(crate) fn refresh(&mut self, h: &impl LbHost, rebuilt: &mut bool) {
        if self.stale || self.members_of_healthy.len() != h.healthy_count() {
            self.rebuild(h);
            *rebuilt = true;
        }
    }

    /// Host `address`'s positions, None when it is not a healthy member. `rebuilt`: whether this
    /// pick already rebuilt the table (a second rebuild would not see anything new).
    pub(crate) fn find(
        &mut self,
        h: &impl LbHost,
        address: &[u8],
        rebuilt: &mut bool,
    ) -> Option<Slot> {
        if self.stale {
            self.rebuild(h);
            *rebuilt = true;
        }
        loop {
            let found = self
                .entries
                .binary_search_by(|e| (*e.address).cmp(address))
                .ok()
                .and_then(|i| self.entries.get(i));
            let trusted = match found {
                Some(e) if e.healthy != UNHEALTHY => {
                    h.healthy_address(e.healthy as usize) == Some(address)
                }
                Some(_) => *rebuilt || h.healthy_count() == self.members_of_healthy.len(),
                None => *rebuilt || h.hosts_count() == self.members,
            };
            if trusted {
                return found.filter(|e| e.healthy != UNHEALTHY).map(|e| Slot {
                    healthy: e.healthy,
                    member: e.member,
                });
            }
            if *rebuilt {
                return None;
            }
            self.rebuild(h);
            *rebuilt = true;
        }
    }

    fn rebuild(&mut self, h: &impl LbHost) {
        self.entries.clear();
        self.members_of_healthy.clear();
        let n = h.hosts_count().min(u32::MAX as usize - 1);
        self.members = n;
        for i in 0..n {
            if let Some(a) = h.host_address(i) {
                self.entries.push(Entry {
                    address: a.into(),
                    member: i as u32,
                    healthy: UNHEALTHY,
                });
            }
        }
        self.entries
            .sort_unstable_by(|a, b| a.address.cmp(&b.address));
        let healthy = h.healthy_count().min(u32::MAX as usize - 1);
        for i in 0..healthy {
            let at = h
                .healthy_address(i)
                .and_then(|a| self.entries.binary_search_by(|e| (*e.address).cmp(a)).ok());
            let member = match at.and_then(|j| self.entries.get_mut(j)) {
                Some(e) => {
                    e.healthy = i as u32;
                    e.member
                }
                None => UNHEALTHY,
            };
            self.members_of_healthy.push(member);
        }
        self.stale = false;
    }
}
