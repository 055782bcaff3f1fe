//! A prefill/decode model's side of the router (`config/pd.rs`): the decode worker of a PD
//! decision and the prefill body rewrite (`pd_body.rs`).

use super::{Decision, Router};
use crate::pd_body::{BadBody, Rewriter};
use crate::policy::{self, Reason};
use crate::store::Store;

impl Router {
    /// The decode half of a PD decision: the least loaded decode worker of the model `prefill`
    /// routed to (`policy::least_loaded`, ties spread from a random start), chosen and charged
    /// in one CAS: one request and the body's estimated tokens (`body_len / chars_per_token`,
    /// capped at `policy.max_request_tokens` like every other charge, so a junk field cannot
    /// inflate a decode worker's load). `None` when the model is not a PD model.
    pub fn decode_decision<S: Store>(
        &mut self,
        store: &S,
        prefill: &Decision,
        body_len: usize,
        now: u32,
    ) -> Option<Decision> {
        let dm = self
            .cfg
            .models
            .get(usize::from(prefill.model))?
            .pd
            .as_ref()?
            .decode_model;
        let start = (self.pd_body.room() & 0xffff) as usize;
        let tokens = self.cfg.policy.body_tokens(body_len).max(1);
        let (w, tok, ()) = self
            .ledger
            .decide(store, &self.cfg, dm, now, |reqs, toks, _| {
                (policy::least_loaded(reqs, toks, start), tokens, ())
            });
        Some(Decision::uncharged(dm, w, Reason::LoadSpill).with_charge(1, tok))
    }

    /// PD model: rewrites `body` for the prefill worker `prefill` chose, with a fresh room
    /// (`pd_body.rs`); the result is [`Router::rewritten`]. `None`: not a PD model.
    pub fn rewrite_for_prefill(
        &mut self,
        prefill: &Decision,
        body: &[u8],
    ) -> Option<Result<(), BadBody>> {
        let pd = self
            .cfg
            .models
            .get(usize::from(prefill.model))?
            .pd
            .as_ref()?;
        let fields = pd.fields.get(usize::from(prefill.worker))?;
        Some(self.pd_body.rewrite_with_room(body, fields))
    }

    /// The last PD body rewrite ([`Router::rewrite_for_prefill`]).
    pub fn rewritten(&self) -> &Rewriter {
        &self.pd_body
    }
}
