//! The router's peer records (`peers.rs`): the outbox its index writes fill, its hand-off to the
//! root that sends, and a peer's batch applied to this replica's index.

use super::Router;
use crate::config::PeersConfig;
use crate::peers::Outbox;
use crate::store::Store;

impl Router {
    /// The peers' configuration and this VM's records for them (`None` without `peers`).
    pub fn outbox(&mut self) -> Option<(&PeersConfig, &mut Outbox)> {
        Some((self.cfg.peers.as_ref()?, self.outbox.as_mut()?))
    }

    /// Hands this VM's peer records to the root that sends them (a VM that cannot call,
    /// `peers::Outbox::hand_off`).
    pub fn hand_off_peer_records<S: Store>(&mut self, store: &S) {
        if let Some(ob) = self.outbox.as_mut() {
            ob.hand_off(store);
        }
    }

    /// Applies a peer's record batch at the peer listener (`peers::receive`).
    pub fn receive_peer_batch<S: Store>(
        &mut self,
        store: &S,
        body: &[u8],
        now_ms: u64,
        now: u32,
    ) -> Result<crate::peers::Applied, crate::peers::Refused> {
        crate::peers::receive(
            store,
            &self.cfg,
            body,
            now_ms,
            now,
            &mut self.index_bufs,
            &mut self.placements,
        )
    }
}
