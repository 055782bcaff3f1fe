//! A pool model's side of the router (`membership.rs`): the destination header naming the chosen
//! host and its fallbacks, the worker that actually served (the charge moves to it), and a
//! rebuild after a membership change keeping what the old router knew.

use super::{Decision, Router};
use crate::store::Store;

impl Router {
    /// The destination header's name and value for a pool model's decision (`membership.rs`):
    /// the chosen worker's address, then up to the pool's `fallbacks` others, those predicted to
    /// hold the most of the prompt first (ties: list order after the chosen one). The value is
    /// empty for a model that is not a pool. Call right after the decision's [`Router::route`].
    /// Written into a buffer the router reuses: no allocation in steady state.
    pub fn destination(&mut self, d: &Decision) -> (&str, &str) {
        let mut dest = std::mem::take(&mut self.dest);
        self.fill_destination(d, &mut dest);
        self.dest = dest;
        (&self.cfg.destination_header, &self.dest)
    }

    /// [`Router::destination`]'s value, into `out`.
    fn fill_destination(&self, d: &Decision, out: &mut String) {
        out.clear();
        let Some(m) = self.cfg.models.get(usize::from(d.model)) else {
            return;
        };
        let (Some(pool), Some(first)) = (&m.pool, m.workers.get(usize::from(d.worker))) else {
            return;
        };
        out.push_str(&first.cluster);
        let n = m.workers.len();
        let chosen = usize::from(d.worker);
        let held = |w: usize| {
            if usize::from(d.model) == self.last_model {
                self.matched.get(w).copied().unwrap_or(0)
            } else {
                0
            }
        };
        let mut taken = 0u64; // bitmap of positions used, for the first 64 after `chosen`
        for _ in 0..pool.fallbacks.min(n.saturating_sub(1)).min(63) {
            let mut best: Option<(u32, usize)> = None;
            for k in 1..n.min(64) {
                let w = (chosen + k) % n;
                if taken & (1 << k) != 0 {
                    continue;
                }
                let b = held(w);
                if best.is_none_or(|(bb, _)| b > bb) {
                    best = Some((b, k));
                }
            }
            let Some((_, k)) = best else { break };
            taken |= 1 << k;
            if let Some(w) = m.workers.get((chosen + k) % n) {
                out.push(',');
                out.push_str(&w.cluster);
            }
        }
    }

    /// The position of model `mi`'s worker at `address` (`IP:PORT`, as Envoy's
    /// `upstream.address` gives it), if it has one.
    pub fn worker_at(&self, mi: usize, address: &[u8]) -> Option<u16> {
        let m = self.cfg.models.get(mi)?;
        m.workers
            .iter()
            .position(|w| w.address.as_deref().map(str::as_bytes) == Some(address))
            .map(|w| w as u16)
    }

    /// Moves what is left of decision `d`'s charge to worker `to` of the same model (a fallback
    /// served the request): released on the chosen worker, charged to the one that serves.
    pub fn move_charge<S: Store>(&mut self, store: &S, d: &mut Decision, to: u16) {
        let (mi, from) = (usize::from(d.model), usize::from(d.worker));
        let (reqs, tokens) = (d.charged_reqs, d.charged_tokens);
        self.ledger
            .release(store, &self.cfg, mi, from, reqs, tokens);
        self.ledger.add(
            store,
            &self.cfg,
            mi,
            usize::from(to),
            i64::from(reqs),
            i64::from(tokens),
        );
        d.worker = to;
    }

    /// After a membership change rebuilt this router from `old`'s configuration: every worker
    /// still present keeps its self-check window, each pool worker's join time applies
    /// (`membership.rs`), and the peer records not sent yet go out with this router's next batch
    /// (they name workers by address, valid across the change).
    pub fn adopt(&mut self, old: &mut Router, joined: &[(usize, Vec<crate::membership::Member>)]) {
        if let (Some(_), Some(_)) = (&self.outbox, &old.outbox) {
            std::mem::swap(&mut self.outbox, &mut old.outbox);
        }
        self.early = std::mem::take(&mut old.early);
        for (mi, m) in self.cfg.models.iter().enumerate() {
            let (Some(old_m), Some(old_ids)) = (old.cfg.models.get(mi), old.ids.get(mi)) else {
                continue;
            };
            if old_m.name != m.name {
                continue;
            }
            for (w, wk) in m.workers.iter().enumerate() {
                if let Some(win) = old_ids
                    .position(wk.id)
                    .and_then(|ow| old.verifier.window(mi, ow))
                {
                    self.verifier.carry(mi, w, win);
                }
            }
        }
        for (mi, members) in joined {
            let Some(m) = self.cfg.models.get(*mi) else {
                continue;
            };
            for (w, wk) in m.workers.iter().enumerate() {
                if let Some(x) = members.iter().find(|x| x.address == wk.cluster) {
                    self.verifier.joined(*mi, w, x.joined);
                }
            }
        }
    }
}
