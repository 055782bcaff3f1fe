//! One HTTP stream's context ([`Stream`]): reads the request head and body, asks the router,
//! points the request at the worker, credits the worker that served, settles the index records
//! the decision wrote (the rest written for a 2xx, all taken back for a failure or a reset) and
//! gives the load charge back (see the invariants in `glue.rs`).
//!
//! Host calls per inference request (steady state, cache-aware): 1 header-map read (and 1
//! removal per filter header the client sent), 1 clock read, 1 body read, 1 load read + 1 load
//! CAS, the index probes (O(log log n), see `index.rs`), 1 header add, a metric flush at most
//! once per 100 ms (a new prefix: its records, written at the decision); at the response
//! headers the queued-prefill release, when the decision planned records 1 `:status` read (a
//! refresh's writes for a 2xx, the retraction for a failure), and the `upstream.address`
//! read only on the responses `served.rs` picks; at the end the release (`load.rs`: 1 load
//! read + 1 CAS, or parked on a busy thread). The queued-prefill part released at the response
//! headers makes no host call in the Wasm build: it rides on the end's write (or the next
//! decision or tick, `Ledger::release_later`).

use super::{Action, Installed};
use crate::charge::{Charge, Due};
use crate::header_pairs;
use crate::host::{self, now_ticks, Buffer, Host, Map};
use crate::index::Plan;
use crate::metrics::Counter;
use crate::peer_flush;
use crate::policy::Reason;
use crate::request::Endpoint;
use crate::router::{Decision, Outcome, Router};
use std::rc::Rc;

pub struct Stream {
    /// The state of the configuration this stream started under.
    state: Rc<Installed>,
    endpoint: Option<Endpoint>,
    /// What was decided (kept for the debug header): the routed worker (the prefill worker for
    /// PD models; passthrough's too) and, PD models only, the decode worker.
    decision: Option<Decision>,
    decode: Option<Decision>,
    /// The worker first chosen, when another one served (`credit_server`).
    chosen: Option<u16>,
    /// The load still to give back (`charge.rs`); set before any host call after the charge,
    /// so the stream's end releases it whatever happens next.
    charge: Charge,
    /// A peer's record batch (peer listener only), applied when its body is complete.
    peer_batch: bool,
    /// Index writes of this stream's decision: those written ahead are settled (kept or taken
    /// back) by the response status, or taken back at the end when no response came.
    plan: Option<Plan>,
    /// The response status was 2xx: the decision's prediction joins the self-check at the end.
    served: bool,
    /// Value of `tenant_header` (set by Envoy after authentication); empty when not configured.
    tenant: Vec<u8>,
}

/// Points the request at decision `d`'s worker: its cluster in the cluster header, or for a
/// pool model the pool's cluster and, in the destination header, the chosen host and its
/// fallbacks (`Router::destination`).
fn point(h: &impl Host, r: &mut Router, d: &Decision) {
    let cfg = r.cfg();
    let pool = cfg
        .models
        .get(usize::from(d.model))
        .and_then(|m| m.pool.as_ref());
    match pool {
        None => h.add_header(Map::RequestHeaders, &cfg.cluster_header, r.cluster(d)),
        Some(p) => {
            h.add_header(Map::RequestHeaders, &cfg.cluster_header, &p.cluster);
            let (name, value) = r.destination(d);
            h.add_header(Map::RequestHeaders, name, value);
        }
    }
}

fn local_reply(h: &impl Host, status: u32, body: &str) -> Action {
    h.local_reply(
        status,
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    Action::Pause
}

/// The request header fields the filter reads, borrowed from one serialized header map. Each
/// is the header's first value, as a single-header read (`proxy_get_header_map_value`) gives.
#[derive(Default)]
struct Head<'a> {
    method: Option<&'a [u8]>,
    path: Option<&'a [u8]>,
    /// Value of `tenant_header` (none when not configured or absent).
    tenant: Option<&'a [u8]>,
}

impl Stream {
    pub(super) fn new(state: Rc<Installed>) -> Stream {
        Stream {
            state,
            endpoint: None,
            decision: None,
            decode: None,
            chosen: None,
            charge: Charge::default(),
            peer_batch: false,
            plan: None,
            served: false,
            tenant: Vec::new(),
        }
    }

    /// Picks the fields of [`Head`] out of the request header map and removes the client's
    /// values of the filter's own header names (one removal per name present): whatever the
    /// client sent under them is never trusted or forwarded. A map without `:method` (the read
    /// failed: Envoy always has one) removes them unconditionally.
    fn read_head<'a>(&self, h: &impl Host, raw: &'a [u8]) -> Head<'a> {
        let r = self.state.router.borrow();
        let cfg = &r.cfg();
        let tenant = cfg.tenant_header.as_deref().map(str::as_bytes);
        let ours = [
            Some(cfg.cluster_header.as_str()),
            Some(cfg.prefill_cluster_header.as_str()),
            cfg.debug_header.as_deref(),
            Some(cfg.destination_header.as_str()),
        ];
        let mut removed = [false; 4];
        let mut head = Head::default();
        for (k, v) in header_pairs::decode(raw) {
            let slot = match k {
                b":method" => &mut head.method,
                b":path" => &mut head.path,
                _ if Some(k) == tenant => &mut head.tenant,
                _ => {
                    for (name, done) in ours.iter().zip(removed.iter_mut()) {
                        if let Some(name) = name.filter(|n| n.as_bytes() == k) {
                            if !*done {
                                *done = true;
                                h.remove_header(Map::RequestHeaders, name);
                            }
                        }
                    }
                    continue;
                }
            };
            slot.get_or_insert(v);
        }
        if head.method.is_none() {
            for name in ours.into_iter().flatten() {
                h.remove_header(Map::RequestHeaders, name);
            }
        }
        head
    }

    fn decide(&mut self, h: &impl Host, body: &[u8]) -> Action {
        let Some(ep) = self.endpoint.take() else {
            return Action::Continue;
        };
        let (now, _) = now_ticks(h);
        let outcome = {
            let mut r = self.state.router.borrow_mut();
            let o = r.route_for(h, ep, body, &self.tenant, now);
            self.plan = r.take_plan();
            self.state.metrics.index_writes(&r.take_ahead_stats());
            o
        };
        let m = &self.state.metrics;
        match outcome {
            Outcome::Reject { status, body } => {
                m.request(Reason::Rejected);
                m.maybe_flush(h, now);
                local_reply(h, status, &body)
            }
            Outcome::Unplaced { model } => {
                m.add(Counter::PoolUnplaced, 1);
                m.request(Reason::Fallback);
                m.maybe_flush(h, now);
                let r = self.state.router.borrow();
                if let Some(pool) = r
                    .cfg()
                    .models
                    .get(usize::from(model))
                    .and_then(|m| m.pool.as_ref())
                {
                    h.add_header(Map::RequestHeaders, &r.cfg().cluster_header, &pool.cluster);
                }
                Action::Continue
            }
            Outcome::Route(d) => {
                // Owned by the stream before any host call: whatever happens next (a panic the
                // native guard catches included, also in a PD model's decode charge), its end
                // releases the charge.
                self.charge = Charge {
                    routed: Some(d),
                    decode: None,
                };
                if let Some(action) = self.pd_route(h, &d, body, now) {
                    return action;
                }
                self.decision = Some(d);
                let m = &self.state.metrics;
                m.decision(&d);
                m.maybe_flush(h, now);
                point(h, &mut self.state.router.borrow_mut(), &d);
                Action::Continue
            }
        }
    }

    /// PD model: rewrites the body for the prefill worker `d` chose, picks and charges a decode
    /// worker, and points the cluster header at it and the prefill header at `d`'s worker (the
    /// route mirrors the body there). `None`: not a PD model, route as usual.
    fn pd_route(&mut self, h: &impl Host, d: &Decision, body: &[u8], now: u32) -> Option<Action> {
        let mut guard = self.state.router.borrow_mut();
        let r = &mut *guard;
        let rewritten = r.rewrite_for_prefill(d, body)?;
        let m = &self.state.metrics;
        if rewritten.is_err() {
            // not a JSON object: no worker could use it; undo the prefill charge (the stream's
            // no more)
            self.charge.routed = None;
            r.release(h, d);
            m.add(Counter::PdBadBody, 1);
            m.request(Reason::Rejected);
            m.maybe_flush(h, now);
            return Some(local_reply(
                h,
                400,
                r#"{"object":"error","message":"request body must be a JSON object","type":"BadRequestError","code":400}"#,
            ));
        }
        let dec = r.decode_decision(h, d, body.len(), now)?;
        // Both charges are owned by the stream before any host call (see `decide`).
        self.charge.decode = Some(dec);
        self.decision = Some(*d);
        self.decode = Some(dec);
        h.set_buffer(Buffer::RequestBody, body.len(), r.rewritten().body());
        let length = h.header(Map::RequestHeaders, "content-length");
        if length.is_some_and(|v| !v.is_empty()) {
            let len = r.rewritten().body().len().to_string();
            h.replace_header(Map::RequestHeaders, "content-length", &len);
        }
        h.add_header(
            Map::RequestHeaders,
            &r.cfg().cluster_header,
            r.cluster(&dec),
        );
        h.add_header(
            Map::RequestHeaders,
            &r.cfg().prefill_cluster_header,
            r.cluster(d),
        );
        m.decision(d);
        m.add(Counter::PdRequests, 1);
        m.add(Counter::PdClientFields, i64::from(r.rewritten().dropped()));
        m.inflight(&dec, 1);
        m.maybe_flush(h, now);
        Some(Action::Continue)
    }

    /// Gives back the part of this stream's charge that is due `at` (see [`Charge::take`]),
    /// each part exactly once: the ledger write and the in-flight gauges together. At the end,
    /// where no tick may follow (a closing root, the native build), batched state goes out now.
    fn release(&mut self, h: &impl Host, at: Due) {
        let parts = self.charge.take(at);
        if parts == [None, None] {
            return; // nothing charged, or released already: no host call
        }
        let s = &*self.state;
        // What ends at the first response headers rides on the stream's end (or the next
        // decision or tick) where a timer runs: one lease write per short response, not two.
        let later = at == Due::Answer && !h.eager_flush();
        for d in parts.iter().flatten() {
            // Borrowed only if a callback re-entered the glue: the gauges still move.
            if let Ok(mut r) = s.router.try_borrow_mut() {
                if later {
                    r.release_later(d);
                } else {
                    r.release(h, d);
                }
            }
            s.metrics.inflight(d, -1);
        }
        if at == Due::End && (s.closing.get() || h.eager_flush()) {
            s.flush_all(h);
        }
    }

    /// `proxy_on_request_headers`. One host call reads the whole header map (see
    /// `header_pairs`); the filter's own routing headers are removed only when the client sent
    /// them.
    pub fn on_request_headers(&mut self, h: &impl Host, end_of_stream: bool) -> Action {
        let raw = h.header_pairs(Map::RequestHeaders);
        let head = self.read_head(h, &raw);
        if self.state.router.borrow().cfg().peer_listener {
            let m = &self.state.metrics;
            self.peer_batch =
                peer_flush::batch_headers(h, m, head.method, head.path, end_of_stream);
            return Action::Pause;
        }
        let (method, path) = (
            head.method.unwrap_or_default(),
            head.path.unwrap_or_default(),
        );
        if let Some(ep) = Endpoint::classify(method, path) {
            self.endpoint = Some(ep);
            self.tenant.clear();
            self.tenant
                .extend_from_slice(head.tenant.unwrap_or_default());
            if end_of_stream {
                return self.decide(h, &[]);
            }
            return Action::Pause;
        }
        let m = &self.state.metrics;
        m.request(Reason::Passthrough);
        let mut r = self.state.router.borrow_mut();
        let d = r.passthrough();
        match (&d, &r.cfg().passthrough_cluster) {
            (Some(d), _) => point(h, &mut r, d),
            (None, Some(c)) => h.add_header(Map::RequestHeaders, &r.cfg().cluster_header, c),
            (None, None) => {
                // a pool model with no known worker: its cluster's fallback policy picks
                let cfg = &r.cfg();
                let pool = cfg
                    .models
                    .get(cfg.default_model)
                    .and_then(|m| m.pool.as_ref());
                let cluster = pool.map_or("", |p| p.cluster.as_str());
                h.add_header(Map::RequestHeaders, &cfg.cluster_header, cluster);
            }
        }
        self.decision = d;
        Action::Continue
    }

    /// `proxy_on_request_body`. A request body that ends in trailers is never seen whole here
    /// (the module does not export `proxy_on_request_trailers`, to keep Envoy out of the VM for
    /// every other stream's trailers): it goes upstream without a routing decision, and the
    /// route's missing cluster header answers it (see docs/design.md).
    pub fn on_request_body(
        &mut self,
        h: &impl Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.peer_batch {
            if !end_of_stream {
                return Action::Pause;
            }
            self.peer_batch = false;
            let body = h.buffer(Buffer::RequestBody, body_size);
            peer_flush::receive_batch(h, &self.state.router, &self.state.metrics, &body);
            return Action::Pause;
        }
        if self.endpoint.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause; // Envoy buffers until the whole body is here
        }
        let body = h.buffer(Buffer::RequestBody, body_size);
        self.decide(h, &body)
    }

    /// `proxy_on_response_headers`: once per response (never per body chunk). Adds the debug
    /// header when configured.
    pub fn on_response_headers(&mut self, h: &impl Host) -> Action {
        self.credit_server(h);
        self.release(h, Due::Answer);
        if let Some(plan) = self.plan.take() {
            self.commit(h, &plan);
        }
        let r = self.state.router.borrow();
        if let (Some(name), Some(d)) = (&r.cfg().debug_header, &self.decision) {
            h.add_header(
                Map::ResponseHeaders,
                name,
                &r.debug_value(d, self.decode.as_ref(), self.chosen),
            );
        }
        Action::Continue
    }

    /// When another worker than the chosen one answered (a fallback, after a retry or because
    /// the chosen one was unusable), the stream's charge, its index records and its debug header
    /// go to the worker that served. It is learnt from one `upstream.address` read, for models
    /// whose workers have addresses, on the responses `served.rs` picks. PD decisions keep
    /// their pair.
    fn credit_server(&mut self, h: &impl Host) {
        let Some(d) = self.charge.routed.or(self.decision) else {
            return;
        };
        if self.decode.is_some() {
            return;
        }
        let mi = usize::from(d.model);
        let watch = &self.state.served;
        let served = {
            let r = self.state.router.borrow();
            let chosen = r
                .cfg()
                .models
                .get(mi)
                .and_then(|m| m.workers.get(usize::from(d.worker)))
                .and_then(|w| w.address.as_deref());
            let Some(chosen) = chosen else {
                return;
            };
            let needed = self.plan.is_some() || r.cfg().debug_header.is_some();
            if !watch.should_read(needed, d.model, d.worker) {
                return;
            }
            let Some(served) = h.upstream_address() else {
                return;
            };
            if served == chosen.as_bytes() {
                // the chosen worker served (also when workers share an address)
                watch.saw(d.model, d.worker, false);
                return;
            }
            served
        };
        let Ok(mut r) = self.state.router.try_borrow_mut() else {
            return;
        };
        let Some(to) = r.worker_at(mi, &served).filter(|&w| w != d.worker) else {
            return;
        };
        watch.saw(d.model, d.worker, true);
        let m = &self.state.metrics;
        m.add(Counter::ServedByFallback, 1);
        if let Some(mut charged) = self.charge.routed {
            m.inflight(&charged, -1);
            r.move_charge(h, &mut charged, to);
            m.inflight(&charged, 1);
            self.charge.routed = Some(charged);
        }
        if let Some(dec) = self.decision.as_mut() {
            self.chosen = Some(dec.worker);
            dec.worker = to;
        }
        if let Some(plan) = self.plan.as_mut() {
            // The records written at the decision name the chosen worker: take them back; the
            // answer records the prompt for the one that served.
            m.index_writes(&r.abandon(h, plan));
            plan.move_to(r.worker_id(mi, to));
        }
    }

    /// Settles the decision's index records by the response status (one `:status` read): the
    /// rest written for a 2xx, what was written ahead taken back otherwise.
    fn commit(&mut self, h: &impl Host, plan: &Plan) {
        let status = host::status(h, Map::ResponseHeaders).unwrap_or(0);
        let Ok(mut r) = self.state.router.try_borrow_mut() else {
            return;
        };
        self.served = (200..300).contains(&status);
        // Stamped with the decision's time: no clock read (a host call) for it. A request sent
        // before membership named any host (worker 0) is recorded for the host that served, at
        // the response's time (after the host's join time when membership arrived meanwhile).
        let w = if plan.worker == 0 {
            let Some(a) = h.upstream_address() else {
                return;
            };
            let (now, _) = now_ticks(h);
            r.commit_served(h, plan, &a, status, now, self.state.closing.get())
        } else {
            r.commit(h, plan, status, plan.at)
        };
        self.state.metrics.index_writes(&w);
    }

    /// `proxy_on_delete` (Envoy calls it right after `on_done`, not exported): the stream ended,
    /// whichever way (response complete, client reset, local reply). Releases the charge.
    pub fn on_done(&mut self, h: &impl Host) {
        self.release(h, Due::End);
        // No response headers came (a client or upstream reset): take back what the decision
        // wrote ahead.
        if let Some(plan) = self.plan.take() {
            if let Ok(mut r) = self.state.router.try_borrow_mut() {
                let w = r.abandon(h, &plan);
                self.state.metrics.index_writes(&w);
            }
        }
        if let (true, Some(d)) = (self.served, self.decision) {
            if let Ok(mut r) = self.state.router.try_borrow_mut() {
                r.observe_served(&d);
            }
        }
    }
}
