//! Requests of a pool model sent before membership named any host (`Outcome::Unplaced`): their
//! prompts are planned all the same and recorded for the host that served (`upstream.address`),
//! at once when membership names it, else kept until the rebuild that does.
//!
//! Bounds: at most [`EARLY_PLANS`] plans per VM, each kept at most [`EARLY_MAX_AGE`]; costs
//! nothing once membership is known (no request is unplaced then).

use super::Router;
use crate::config::{valid_address, worker_id};
use crate::index::{Index, Plan, WriteStats};
use crate::store::Store;

/// Plans of unplaced requests a VM keeps until membership names their host.
const EARLY_PLANS: usize = 64;
/// How long such a plan waits for its host (100 ms units): the first membership reads, and
/// the health checks a new host passes before it is a member.
const EARLY_MAX_AGE: u32 = 300;

impl Router {
    /// Plans an unplaced pool request's records (as [`Router::plan_record`] for a worker that
    /// holds nothing of it) for a host not known yet: worker id 0, set to the host that served
    /// by [`Router::commit_served`].
    pub(super) fn plan_unplaced(&mut self, mi: usize, now: u32) {
        let Some(model) = self.cfg.models.get(mi).filter(|m| m.pool.is_some()) else {
            return;
        };
        let ix = Index::for_model(&self.cfg, model);
        let mut plan = Plan::default();
        plan.model = mi as u16;
        plan.at = now;
        let end = self.ends.last().copied();
        ix.plan(&self.hashes, end, Default::default(), now, &mut plan);
        if !plan.is_empty() {
            self.plan = Some(plan);
        }
    }

    /// An unplaced request's plan ([`Outcome::Unplaced`]) once its response came, from the
    /// host at `address` (Envoy's `upstream.address`) with `status`, at `now`: written now when
    /// membership already names that host or this router was replaced (`replaced`: a newer
    /// membership may name it, and its join time is older than `now`), else kept until it does
    /// ([`Router::write_early`]). A failed response, or an address that is no `host:port`,
    /// writes nothing.
    pub fn commit_served<S: Store>(
        &mut self,
        store: &S,
        plan: &Plan,
        address: &[u8],
        status: u32,
        now: u32,
        replaced: bool,
    ) -> WriteStats {
        if plan.worker != 0 || !(200..300).contains(&status) || !valid_address(address) {
            return WriteStats::default();
        }
        let Ok(address) = std::str::from_utf8(address) else {
            return WriteStats::default();
        };
        let mut p = *plan;
        p.worker = worker_id(address);
        let mi = usize::from(p.model);
        if replaced
            || self
                .ids
                .get(mi)
                .and_then(|ids| ids.position(p.worker))
                .is_some()
        {
            return self.commit(store, &p, status, now);
        }
        if self.early.len() >= EARLY_PLANS {
            self.early.remove(0);
        }
        self.early.push(p);
        WriteStats::default()
    }

    /// Writes the kept plans of unplaced requests whose host membership now names, stamped
    /// `now` (when its host is known to be a member: never older than its join time); drops
    /// those older than [`EARLY_MAX_AGE`]. Called after a membership rebuild.
    pub fn write_early<S: Store>(&mut self, store: &S, now: u32) -> WriteStats {
        let mut total = WriteStats::default();
        let early = std::mem::take(&mut self.early);
        for p in early {
            if now.wrapping_sub(p.at) > EARLY_MAX_AGE {
                continue;
            }
            let mi = usize::from(p.model);
            if self
                .ids
                .get(mi)
                .and_then(|ids| ids.position(p.worker))
                .is_none()
            {
                self.early.push(p);
                continue;
            }
            let st = self.commit(store, &p, 200, now);
            total.writes += st.writes;
            total.conflicts += st.conflicts;
            total.dropped += st.dropped;
        }
        total
    }
}
