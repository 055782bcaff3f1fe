//! The glue: moves data between the [`Host`] (Envoy) and the pure core, nothing else.
//!
//! [`Root`] is a plugin's root context, [`Stream`] one HTTP stream's context; `abi` calls their
//! methods from the module's exported proxy-wasm callbacks, `native` from Envoy's dynamic-module
//! hooks, and tests call them against `host::FakeHost`. Only the callbacks the filter needs
//! exist (see `abi`): response bodies and trailers never enter the VM. What a callback does
//! beyond moving data lives beside it: the metrics (`metrics.rs`), a stream's load charge
//! (`charge.rs`), the poll lease holder's calls (`poller.rs`), the peer batches
//! (`peer_flush.rs`).
//!
//! Invariants:
//! - A stream's load charge is owned by the stream before any host call after it is made, and
//!   given back in parts through one path ([`Stream`]'s `release`), each part exactly once,
//!   however the stream ends.
//! - The router is borrowed for one step, never across callbacks. Root callbacks and releases
//!   only try (a re-entered glue skips the step; a release still moves the gauges).
//! - Metrics are batched per VM (`metrics.rs`); routing state in shared data never is. A
//!   configuration replaced or removed flushes its VM's state, and its streams flush as they end.
//!
//! Host calls per inference request (steady state, cache-aware): 1 header-map read (and 1
//! removal per filter header the client sent), 1 clock read, 1 body read, 1 load read + 1 load
//! CAS, the index probes (O(log log n), see `index.rs`), 1 header add, a metric flush at most
//! once per 100 ms; at the response headers the queued-prefill release and, when the decision
//! planned records, 1 `:status` read (the writes only for a 2xx); at the end the release
//! (`load.rs`: 1 load read + 1 CAS, or parked on a busy thread).

use crate::charge::{Charge, Due};
use crate::config::Config;
use crate::header_pairs;
use crate::host::{self, now_ticks, Buffer, Host, Map};
use crate::index::Plan;
use crate::membership::{self, Member};
use crate::metrics::{Counter, Metrics};
use crate::peer_flush::{self, PeerSender};
use crate::policy::Reason;
use crate::poller::Polls;
use crate::request::Endpoint;
use crate::router::{Decision, Outcome, Router};
use crate::served;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// The root context's timer: flushes batched metrics and parked load releases, and re-measures
/// whether this VM is busy enough to park releases at all. Short, because a parked release is
/// phantom load for the other threads until then; an idle tick makes no host call.
const TICK_MS: u32 = 50;
/// Ticks between metric flushes from the timer (200 ms).
const METRICS_EVERY: u32 = 4;

/// What a stream callback tells Envoy (proxy-wasm `Action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue = 0,
    /// Stop iteration (headers) / stop and buffer (body).
    Pause = 1,
}

/// One installed (accepted) configuration's state, shared by the root and every stream that
/// started under it: the router, the metrics, and whether it is being replaced or removed.
struct Installed {
    router: RefCell<Router>,
    metrics: Metrics,
    /// Set when the root context is done (plugin removed: a config update drained its filter
    /// chain, or shutdown) or replaced: no tick will flush this VM's batched metrics any more,
    /// so streams still ending flush at once.
    closing: Cell<bool>,
    /// Which responses read the served worker's address (`served.rs`).
    served: served::Watch,
}

impl Installed {
    /// Sends everything this VM still holds: parked load deltas, batched metric increments
    /// and, where this root cannot call, its peer records (to the root that sends them).
    fn flush_all(&self, h: &impl Host) {
        if let Ok(mut r) = self.router.try_borrow_mut() {
            r.flush_pending(h);
            if !h.can_call() {
                r.hand_off_peer_records(h);
            }
        }
        self.metrics.flush(h);
    }
}

#[derive(Default)]
pub struct Root {
    /// The accepted configuration's state (`None` before one was accepted).
    state: Option<Rc<Installed>>,
    ticks: u32,
    /// Load polls and counter reads (when this VM holds the poll lease).
    polls: Polls,
    /// Index records sent to the peers.
    peers: PeerSender,
    /// Pool models' published memberships as this VM last applied them (`membership.rs`).
    members: membership::View,
}

impl Root {
    pub fn new() -> Root {
        Root::default()
    }

    /// `proxy_on_http_call_response`: a counter read's, a peer batch's or a load poll's answer,
    /// tried in that order (the load poll's reads the body before its token is looked up).
    pub fn on_http_call_response(&mut self, h: &impl Host, token: u32, body_size: usize) {
        let Some(s) = self.state.clone() else {
            return;
        };
        let status = host::status(h, Map::HttpCallResponseHeaders);
        let m = &s.metrics;
        if self
            .polls
            .counters_answer(h, &s.router, m, token, status, body_size)
            || self
                .polls
                .members_answer(h, &s.router, m, token, status, body_size)
        {
            return;
        }
        if self.peers.answer(m, token, status) {
            return;
        }
        self.polls
            .load_answer(h, &s.router, m, token, status, body_size);
    }

    /// The root context's teardown (`proxy_on_delete` of the root; the module does not export
    /// `proxy_on_done`).
    pub fn on_done(&mut self, h: &impl Host) -> bool {
        // Envoy is removing this plugin (its filter chain drained after a config update, or
        // shutdown). Without this, the in-flight gauge decrements of the last streams (batched
        // until the next tick, which never comes) and any parked load deltas would be lost, and
        // the gauges would stay above zero for good.
        if let Some(s) = &self.state {
            s.closing.set(true);
            s.flush_all(h);
        }
        true
    }

    /// `proxy_on_configure`: a new plugin configuration (at start or on a config update).
    pub fn on_configure(&mut self, h: &impl Host, size: usize) -> bool {
        let raw = h.buffer(Buffer::PluginConfiguration, size);
        let cfg = match Config::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                h.log_error(&format!("prefix-router: {e}"));
                return false;
            }
        };
        self.members.reset();
        self.install(h, cfg, None);
        h.set_tick_period_ms(TICK_MS);
        self.look_at_members(h, h.now_nanos() / 1_000_000, true);
        true
    }

    /// Puts a validated configuration in place: a new router and metrics; streams of the old
    /// configuration release into the old state, which no tick flushes any more. `change`: a
    /// membership change (`membership.rs`), whose router keeps what the old one knew of the
    /// workers that stay.
    fn install(&mut self, h: &impl Host, cfg: Config, change: Option<&[(usize, Vec<Member>)]>) {
        let (_, nanos) = now_ticks(h);
        let metrics = Metrics::define(h, &cfg);
        let mut router = Router::new(cfg, nanos);
        router.init_store(h);
        // The poll lease's owner: unique among this Envoy's VMs (the id), and across restarts
        // (the clock); the clock alone can repeat between two VMs. A membership change keeps
        // it, so the lease stays with its holder.
        let me = match change {
            Some(_) => self.polls.me,
            None => (u64::from(router.vm_id()) << 32) | (nanos & 0xffff_fffe) | 1,
        };
        self.polls.configure(router.cfg(), me);
        // The sender of this VM's peer batches: unique in the fleet as `me` is here (other
        // replicas' VMs would need the same id and the same clock nanoseconds).
        router.set_peer_sender(me);
        if let Some(old) = &self.state {
            if let (Some(joined), Ok(o)) = (change, old.router.try_borrow()) {
                router.adopt(&o, joined);
            }
            old.closing.set(true);
            old.flush_all(h);
        }
        self.state = Some(Rc::new(Installed {
            router: RefCell::new(router),
            metrics,
            closing: Cell::new(false),
            served: served::Watch::default(),
        }));
    }

    /// Applies pool models' published memberships when they changed (`membership.rs`): every
    /// `membership.interval_ms / 2`, or now (`force`).
    fn look_at_members(&mut self, h: &impl Host, now_ms: u64, force: bool) {
        let Some(s) = &self.state else {
            return;
        };
        let change = {
            let Ok(r) = s.router.try_borrow() else {
                return;
            };
            self.members.look(h, r.cfg(), now_ms, force)
        };
        if let Some(c) = change {
            self.install(h, c.cfg, Some(&c.members));
            if let Some(s) = &self.state {
                s.metrics.add(Counter::MembershipRebuilds, 1);
            }
        }
    }

    /// `proxy_on_tick`.
    pub fn on_tick(&mut self, h: &impl Host) {
        self.ticks = self.ticks.wrapping_add(1);
        let Some(s) = &self.state else {
            return;
        };
        // One clock read serves the whole tick.
        let (now, nanos) = now_ticks(h);
        let now_ms = nanos / 1_000_000;
        // Metrics every METRICS_EVERY ticks (200 ms): a busy thread also flushes them at a
        // decision every 100 ms, so flushing on each 50 ms tick would only add host calls.
        if self.ticks.is_multiple_of(METRICS_EVERY) {
            s.metrics.flush(h);
        }
        if let Ok(mut r) = s.router.try_borrow_mut() {
            r.tick(h, TICK_MS, now);
            let sample = self.ticks.is_multiple_of(METRICS_EVERY);
            s.metrics.after_tick(h, &mut r, sample);
        }
        self.look_at_members(h, now_ms, false);
        if let Some(s) = &self.state {
            let s = s.clone();
            self.polls.tick(h, &s.router, &s.metrics, now_ms, TICK_MS);
            self.peers.tick(h, &s.router, &s.metrics, now_ms);
        }
    }

    /// A new stream of this plugin; `None` before a configuration was accepted (the stream then
    /// has no context in the VM and every callback continues).
    pub fn new_stream(&self) -> Option<Stream> {
        let state = self.state.clone()?;
        Some(Stream {
            state,
            endpoint: None,
            decision: None,
            decode: None,
            chosen: None,
            charge: Charge::default(),
            peer_batch: false,
            plan: None,
            tenant: Vec::new(),
        })
    }
}

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
    /// Index writes of this stream's decision, made once the response status is 2xx.
    plan: Option<Plan>,
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
                if let Some(action) = self.pd_route(h, &d, body, now) {
                    return action;
                }
                // Owned by the stream before any host call: whatever happens next (a panic the
                // native guard catches included), its end releases the charge.
                self.decision = Some(d);
                self.charge = Charge {
                    routed: Some(d),
                    decode: None,
                };
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
            // not a JSON object: no worker could use it; undo the prefill charge
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
        self.charge = Charge {
            routed: Some(*d),
            decode: Some(dec),
        };
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
        for d in parts.iter().flatten() {
            // Borrowed only if a callback re-entered the glue: the gauges still move.
            if let Ok(mut r) = s.router.try_borrow_mut() {
                r.release(h, d);
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
            plan.worker = r.worker_id(mi, to);
        }
    }

    /// Writes the decision's index records if the response status is 2xx (one `:status` read).
    fn commit(&mut self, h: &impl Host, plan: &Plan) {
        let status = host::status(h, Map::ResponseHeaders).unwrap_or(0);
        let Ok(mut r) = self.state.router.try_borrow_mut() else {
            return;
        };
        // Stamped with the decision's time: no clock read (a host call) for it.
        let w = r.commit(h, plan, status, plan.at);
        self.state.metrics.index_writes(&w);
    }

    /// `proxy_on_delete` (Envoy calls it right after `on_done`, not exported): the stream ended,
    /// whichever way (response complete, client reset, local reply). Releases the charge.
    pub fn on_done(&mut self, h: &impl Host) {
        self.release(h, Due::End);
    }
}
