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
//! This file holds the root context and the state it shares with its streams; `glue/stream.rs`
//! one stream's callbacks, with the host calls each request makes.

mod stream;

use crate::config::Config;
use crate::host::{self, now_ticks, Buffer, Host, Map};
use crate::membership::{self, Member};
use crate::metrics::{Counter, Metrics};
use crate::peer_flush::PeerSender;
use crate::poller::Polls;
use crate::router::Router;
use crate::served;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
pub use stream::Stream;

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
    /// Replaced states whose streams still run (at most [`DRAINING`]): their load leases keep
    /// beating from this root's tick until the last of those streams ends, or the in-flight
    /// load of a long stream would drop out of every view 2 s after a membership change.
    draining: Vec<Rc<Installed>>,
}

/// Replaced states a root keeps beating for (the oldest beyond are left to expire).
const DRAINING: usize = 16;

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
        let (now, nanos) = now_ticks(h);
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
        // replicas' VMs would need the same id and the same clock nanoseconds). A membership
        // change keeps it and its sequence (`peer_flush::PeerSender`).
        self.peers.set_sender(me);
        if let Some(old) = &self.state {
            if let (Some(joined), Ok(mut o)) = (change, old.router.try_borrow_mut()) {
                router.adopt(&mut o, joined);
                // Requests served before membership named their host: recorded now it does.
                metrics.index_writes(&router.write_early(h, now));
            }
            old.closing.set(true);
            old.flush_all(h);
            // Streams still hold it (each holds an `Rc`): their charges live in its lease.
            if Rc::strong_count(old) > 1 {
                if self.draining.len() >= DRAINING {
                    self.draining.remove(0);
                }
                self.draining.push(old.clone());
            }
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
        // A replaced state's lease beats while its streams run (one ledger tick each).
        self.draining.retain(|d| Rc::strong_count(d) > 1);
        for d in &self.draining {
            if let Ok(mut r) = d.router.try_borrow_mut() {
                r.keep_load_alive(h, TICK_MS, now);
            }
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
        Some(Stream::new(self.state.clone()?))
    }
}
