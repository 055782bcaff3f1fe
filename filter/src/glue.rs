//! The proxy-wasm glue: moves data between Envoy and the pure core, nothing else.
//!
//! Host calls per inference request (steady state, cache-aware): 1 header removal, 2 header
//! reads (`:method`, `:path`), 1 clock read, 1 body read, 1 load read + 1 load CAS, the index
//! probes (O(log log n), see `index.rs`), index writes for new checkpoints only, 1 header add,
//! a few metric increments; at stream end 1 load read + 1 load CAS.

use crate::config::{Config, PEER_PATH, PEER_SECRET_HEADER};
use crate::peers;
use crate::policy::Reason;
use crate::poll::{self, Lease, Polled, Poller};
use crate::request::Endpoint;
use crate::router::{Decision, Outcome, Router};
use crate::store::{CasMismatch, Store};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::fmt::Write;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

/// The root context's timer: flushes batched metrics and parked load releases, and re-measures
/// whether this VM is busy enough to park releases at all. Short, because a parked release is
/// phantom load for the other threads until then; an idle tick makes no host call.
const TICK_MS: u32 = 50;
/// Ticks between metric flushes from the timer (200 ms).
const METRICS_EVERY: u32 = 4;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root {
        shared: None,
        ticks: 0,
        me: 0,
        poller: Poller::default(),
        peer_calls: Vec::new(),
        last_peer_flush_ms: 0,
    }) });
}}

/// Envoy shared data behind the core's `Store` trait.
struct EnvoyStore;

impl Store for EnvoyStore {
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(v), cas)) => {
                *out = v;
                Some(cas.unwrap_or(0))
            }
            Ok((None, Some(cas))) => {
                out.clear();
                Some(cas)
            }
            _ => {
                out.clear();
                None
            }
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch> {
        let cas = if cas == 0 { None } else { Some(cas) };
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|_| CasMismatch)
    }
}

/// Metric ids plus VM-local pending increments.
///
/// Increments are summed locally and sent to Envoy at most once per 100 ms (at the next decision)
/// and every 200 ms from the tick, instead of 6-8 `increment_metric` host calls per request. Counters
/// and gauges therefore lag by at most one tick; the routing state itself (shared data) never
/// lags.
struct Metrics {
    ids: Vec<u32>,
    pending: RefCell<Vec<i64>>,
    last_flush: Cell<u32>,
    reasons: [usize; Reason::ALL.len()],
    blocks_prompt: usize,
    blocks_matched: usize,
    index_writes: usize,
    index_conflicts: usize,
    index_dropped: usize,
    index_probes: usize,
    truncated: usize,
    poll_answers: usize,
    poll_failures: usize,
    peer_batches_sent: usize,
    peer_records_sent: usize,
    peer_send_failures: usize,
    peer_records_dropped: usize,
    peer_records_received: usize,
    peer_records_ignored: usize,
    peer_requests_rejected: usize,
    load_underflows: usize,
    /// PD: requests sent to a prefill + decode pair, bodies refused, client bootstrap fields
    /// dropped.
    pd_requests: usize,
    pd_bad_body: usize,
    pd_client_fields: usize,
    /// Gauges set (not added) by the poller: oldest answer's age, workers without a fresh one.
    poll_age_ms: u32,
    poll_unknown: u32,
    /// Per model, per worker: (in-flight requests, in-flight tokens) gauge slots.
    inflight: Vec<Vec<(usize, usize)>>,
}

impl Metrics {
    fn define(cfg: &Config) -> Metrics {
        let mut ids = Vec::new();
        let mut def = |t: MetricType, name: &str| {
            ids.push(hostcalls::define_metric(t, name).unwrap_or(0));
            ids.len() - 1
        };
        let mut reasons = [0usize; Reason::ALL.len()];
        for r in Reason::ALL {
            reasons[r.index()] = def(
                MetricType::Counter,
                &format!("prefix_router.requests.{}", r.as_str()),
            );
        }
        let blocks_prompt = def(MetricType::Counter, "prefix_router.blocks.prompt");
        let blocks_matched = def(MetricType::Counter, "prefix_router.blocks.matched");
        let index_writes = def(MetricType::Counter, "prefix_router.index.writes");
        let index_conflicts = def(MetricType::Counter, "prefix_router.index.cas_conflicts");
        let index_dropped = def(MetricType::Counter, "prefix_router.index.dropped_updates");
        let index_probes = def(MetricType::Counter, "prefix_router.index.probes");
        let truncated = def(MetricType::Counter, "prefix_router.prompts.truncated");
        let poll_answers = def(MetricType::Counter, "prefix_router.load_poll.answers");
        let poll_failures = def(MetricType::Counter, "prefix_router.load_poll.failures");
        let peer_batches_sent = def(MetricType::Counter, "prefix_router.peers.batches_sent");
        let peer_records_sent = def(MetricType::Counter, "prefix_router.peers.records_sent");
        let peer_send_failures = def(MetricType::Counter, "prefix_router.peers.send_failures");
        let peer_records_dropped = def(MetricType::Counter, "prefix_router.peers.records_dropped");
        let peer_records_received =
            def(MetricType::Counter, "prefix_router.peers.records_received");
        let peer_records_ignored = def(MetricType::Counter, "prefix_router.peers.records_ignored");
        let peer_requests_rejected =
            def(MetricType::Counter, "prefix_router.peers.requests_rejected");
        let load_underflows = def(MetricType::Counter, "prefix_router.load.underflows");
        let pd_requests = def(MetricType::Counter, "prefix_router.pd.requests");
        let pd_bad_body = def(MetricType::Counter, "prefix_router.pd.bad_body");
        let pd_client_fields = def(
            MetricType::Counter,
            "prefix_router.pd.client_bootstrap_fields",
        );
        let gauge = |name: &str| hostcalls::define_metric(MetricType::Gauge, name).unwrap_or(0);
        let poll_age_ms = gauge("prefix_router.load_poll.age_ms");
        let poll_unknown = gauge("prefix_router.load_poll.unknown_workers");
        let inflight = cfg
            .models
            .iter()
            .map(|m| {
                m.workers
                    .iter()
                    .map(|w| {
                        (
                            def(
                                MetricType::Gauge,
                                &format!("prefix_router.inflight_requests.{}", w.cluster),
                            ),
                            def(
                                MetricType::Gauge,
                                &format!("prefix_router.inflight_tokens.{}", w.cluster),
                            ),
                        )
                    })
                    .collect()
            })
            .collect();
        let n = ids.len();
        Metrics {
            ids,
            pending: RefCell::new(vec![0; n]),
            last_flush: Cell::new(0),
            reasons,
            blocks_prompt,
            blocks_matched,
            index_writes,
            index_conflicts,
            index_dropped,
            index_probes,
            truncated,
            poll_answers,
            poll_failures,
            peer_batches_sent,
            peer_records_sent,
            peer_send_failures,
            peer_records_dropped,
            peer_records_received,
            peer_records_ignored,
            peer_requests_rejected,
            load_underflows,
            pd_requests,
            pd_bad_body,
            pd_client_fields,
            poll_age_ms,
            poll_unknown,
            inflight,
        }
    }

    fn add(&self, slot: usize, by: i64) {
        if let Some(p) = self.pending.borrow_mut().get_mut(slot) {
            *p += by;
        }
    }

    fn inflight(&self, d: &Decision, sign: i64) {
        if let Some(&(r, t)) = self
            .inflight
            .get(usize::from(d.model))
            .and_then(|m| m.get(usize::from(d.worker)))
        {
            self.add(r, sign * i64::from(d.charged_reqs));
            self.add(t, sign * i64::from(d.charged_tokens));
        }
    }

    /// Sends pending increments to Envoy (gauges take signed deltas).
    fn flush(&self) {
        let mut pending = self.pending.borrow_mut();
        for (&id, p) in self.ids.iter().zip(pending.iter_mut()) {
            if *p != 0 && id != 0 {
                let _ = hostcalls::increment_metric(id, *p);
            }
            *p = 0;
        }
    }

    /// Flushes when at least one clock unit (100 ms) passed since the last flush.
    fn maybe_flush(&self, now: u32) {
        if now != self.last_flush.get() {
            self.last_flush.set(now);
            self.flush();
        }
    }
}

struct Shared {
    router: RefCell<Router>,
    metrics: Metrics,
    /// Set when the root context is done (plugin removed: a config update drained its filter
    /// chain, or shutdown) or replaced: no tick will flush this VM's batched metrics any more,
    /// so streams still ending flush at once.
    closing: Cell<bool>,
}

impl Shared {
    /// Sends everything this VM still holds: parked load deltas and batched metric increments.
    fn flush_all(&self) {
        if let Ok(mut r) = self.router.try_borrow_mut() {
            r.flush_pending(&EnvoyStore);
        }
        self.metrics.flush();
    }
}

struct Root {
    shared: Option<Rc<Shared>>,
    ticks: u32,
    /// This root context's identity in the poller lease.
    me: u64,
    poller: Poller,
    /// Tokens of peer batches awaiting an answer (bounded: at most one per peer per flush).
    peer_calls: Vec<u32>,
    last_peer_flush_ms: u64,
}

fn now_ticks() -> (u32, u64) {
    let t = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default();
    ((t.as_millis() / 100) as u32, t.as_nanos() as u64)
}

impl Root {
    /// The lease holder asks every worker for its load when a round is due.
    fn poll_workers(&mut self, s: &Shared, now_ms: u64) {
        let r = s.router.borrow();
        let lp = &r.cfg.load_poll;
        if lp.interval_ms == 0 || r.cfg.peer_listener {
            return;
        }
        let ttl = 3 * u64::from(lp.interval_ms.max(TICK_MS));
        let mut buf = Vec::new();
        if !Lease::hold(&EnvoyStore, self.me, now_ms, ttl, &mut buf) {
            return;
        }
        if !self.poller.due(now_ms, lp.interval_ms) {
            return;
        }
        let targets: Vec<poll::Target> = self.poller.round().collect();
        let timeout = Duration::from_millis(u64::from(lp.timeout_ms));
        for t in targets {
            let Some((w, upstream)) = r.cfg.models.get(usize::from(t.model)).and_then(|m| {
                let i = usize::from(t.worker);
                Some((m.workers.get(i)?, m.poll_clusters.get(i)?))
            }) else {
                continue;
            };
            let path = if t.fallback {
                lp.fallback_path.as_str()
            } else {
                lp.path.as_str()
            };
            let headers = vec![
                (":method", "GET"),
                (":path", path),
                (":authority", w.cluster.as_str()),
            ];
            match self.dispatch_http_call(upstream, headers, None, vec![], timeout) {
                Ok(token) => self.poller.sent(token, t),
                Err(_) => {
                    // Unknown cluster, or Envoy refused the call: a failed poll like any other.
                    self.poller.not_sent();
                    s.metrics.add(s.metrics.poll_failures, 1);
                }
            }
        }
    }

    /// Sends this VM's new index records to every peer, every `peers.flush_ms`.
    fn flush_peers(&mut self, s: &Shared, now_ms: u64) {
        let mut guard = s.router.borrow_mut();
        let r = &mut *guard;
        let Some(p) = &r.cfg.peers else {
            return;
        };
        if r.cfg.peer_listener
            || now_ms < self.last_peer_flush_ms + u64::from(p.flush_ms)
            || r.outbox.as_ref().is_none_or(|o| o.is_empty())
        {
            return;
        }
        self.last_peer_flush_ms = now_ms;
        let Some(ob) = r.outbox.as_mut() else {
            return;
        };
        let m = &s.metrics;
        m.add(
            m.peer_records_dropped,
            std::mem::take(&mut ob.dropped) as i64,
        );
        let n = ob.len() as i64;
        let timeout = Duration::from_millis(u64::from(p.timeout_ms));
        for c in &p.clusters {
            if self.peer_calls.len() >= 4 * p.clusters.len().max(1) {
                // Answers are overdue (timeouts pending): skip rather than pile up calls.
                m.add(m.peer_send_failures, 1);
                continue;
            }
            let headers = vec![
                (":method", "POST"),
                (":path", PEER_PATH),
                (":authority", c.as_str()),
                ("content-type", "application/octet-stream"),
                (PEER_SECRET_HEADER, p.secret.as_str()),
            ];
            match self.dispatch_http_call(c, headers, Some(ob.batch()), vec![], timeout) {
                Ok(token) => {
                    self.peer_calls.push(token);
                    m.add(m.peer_batches_sent, 1);
                    m.add(m.peer_records_sent, n);
                }
                Err(_) => m.add(m.peer_send_failures, 1),
            }
        }
        ob.clear();
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _nh: usize, body_size: usize, _nt: usize) {
        let Some(s) = self.shared.clone() else {
            return;
        };
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|v| v.parse::<u32>().ok());
        let m = &s.metrics;
        if let Some(k) = self.peer_calls.iter().position(|&t| t == token) {
            self.peer_calls.swap_remove(k);
            if status != Some(204) && status != Some(200) {
                m.add(m.peer_send_failures, 1);
            }
            return;
        }
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let Some((t, load)) = self.poller.answer(token, status, &body) else {
            return;
        };
        m.add(
            if load.is_some() {
                m.poll_answers
            } else {
                m.poll_failures
            },
            1,
        );
        let (now, _) = now_ticks();
        let Ok(mut r) = s.router.try_borrow_mut() else {
            return;
        };
        let (mi, w) = (usize::from(t.model), usize::from(t.worker));
        let r = &mut *r;
        let (snap_reqs, snap_tokens) = r.ledger.own_of(&EnvoyStore, &r.cfg, mi, w);
        let p = match load {
            Some((reqs, tokens)) => Polled {
                reqs,
                tokens,
                snap_reqs,
                snap_tokens,
                at: now.max(1),
            },
            None => Polled::default(), // failed: unknown until the next good answer
        };
        let Some(model) = r.cfg.models.get(mi) else {
            return;
        };
        let mut buf = Vec::new();
        poll::publish(
            &EnvoyStore,
            &model.poll_key,
            model.workers[w].id,
            w,
            &p,
            &mut buf,
        );
        // Gauges: the oldest answer's age and the workers without a fresh one.
        let mut all = Vec::new();
        if let Some(ids) = r.ledger.ids(mi) {
            poll::decode(&buf, ids, model.workers.len(), &mut all);
        }
        let stale = r.cfg.load_poll.stale_ms / 100;
        let unknown = all
            .iter()
            .filter(|p| p.at == 0 || now.wrapping_sub(p.at) > stale)
            .count();
        let oldest = all
            .iter()
            .filter(|p| p.at != 0)
            .map(|p| now.wrapping_sub(p.at))
            .max()
            .unwrap_or(0);
        let _ = hostcalls::record_metric(m.poll_age_ms, u64::from(oldest) * 100);
        let _ = hostcalls::record_metric(m.poll_unknown, unknown as u64);
    }

    fn on_done(&mut self) -> bool {
        // Envoy is removing this plugin (its filter chain drained after a config update, or
        // shutdown). Without this, the in-flight gauge decrements of the last streams (batched
        // until the next tick, which never comes) and any parked load deltas would be lost, and
        // the gauges would stay above zero for good.
        if let Some(s) = &self.shared {
            s.closing.set(true);
            s.flush_all();
        }
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let cfg = match Config::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                let _ = hostcalls::log(LogLevel::Error, &format!("prefix-router: {e}"));
                return false;
            }
        };
        let (_, nanos) = now_ticks();
        let metrics = Metrics::define(&cfg);
        self.me = nanos | 1;
        self.poller = Poller::new(cfg.models.iter().map(|m| m.workers.len()));
        let mut router = Router::new(cfg, nanos);
        router.init_store(&EnvoyStore);
        if let Some(old) = &self.shared {
            // Reconfigured in place: streams of the old configuration release into the old
            // state, which no tick flushes any more.
            old.closing.set(true);
            old.flush_all();
        }
        self.shared = Some(Rc::new(Shared {
            router: RefCell::new(router),
            metrics,
            closing: Cell::new(false),
        }));
        let _ = hostcalls::set_tick_period(Duration::from_millis(u64::from(TICK_MS)));
        true
    }

    fn on_tick(&mut self) {
        self.ticks = self.ticks.wrapping_add(1);
        if let Some(s) = &self.shared {
            // Metrics every METRICS_EVERY ticks (200 ms): a busy thread also flushes them at a
            // decision every 100 ms, so flushing on each 50 ms tick would only add host calls.
            if self.ticks.is_multiple_of(METRICS_EVERY) {
                s.metrics.flush();
            }
            if let Ok(mut r) = s.router.try_borrow_mut() {
                r.tick(&EnvoyStore, TICK_MS);
                let u = r.ledger.take_underflows();
                s.metrics.add(s.metrics.load_underflows, u as i64);
            }
            let s = s.clone();
            let (_, nanos) = now_ticks();
            let now_ms = nanos / 1_000_000;
            self.poll_workers(&s, now_ms);
            self.flush_peers(&s, now_ms);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Stream {
            shared,
            endpoint: None,
            decision: None,
            decode: None,
            prefill_held: false,
            charged: false,
            peer_batch: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    shared: Rc<Shared>,
    endpoint: Option<Endpoint>,
    decision: Option<Decision>,
    /// PD models: the decode half (released when the stream ends).
    decode: Option<Decision>,
    /// PD models: the prefill half (`decision`) is still charged; released at the first response
    /// headers (the decode worker answers only once it has the prefill's KV) or at stream end.
    prefill_held: bool,
    /// True while this stream holds a load charge that must be released exactly once.
    charged: bool,
    /// A peer's record batch (peer listener only), applied when its body is complete.
    peer_batch: bool,
}

fn header(name: &str) -> Vec<u8> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
        .unwrap_or_default()
}

fn local_reply(status: u32, body: &str) -> Action {
    let _ = hostcalls::send_http_response(
        status,
        vec![("content-type", "application/json")],
        Some(body.as_bytes()),
    );
    Action::Pause
}

impl Stream {
    /// Peer listener: only `POST /prefix-router/v1/records` with the shared secret is accepted.
    fn peer_headers(&mut self, end_of_stream: bool) -> Action {
        let ok = {
            let r = self.shared.router.borrow();
            let secret = r.cfg.peers.as_ref().map_or("", |p| p.secret.as_str());
            header(":method") == b"POST"
                && header(":path") == PEER_PATH.as_bytes()
                && peers::secret_ok(&header(PEER_SECRET_HEADER), secret)
        };
        if !ok || end_of_stream {
            let m = &self.shared.metrics;
            m.add(m.peer_requests_rejected, 1);
            return local_reply(
                403,
                r#"{"object":"error","message":"forbidden","type":"PermissionDenied","code":403}"#,
            );
        }
        self.peer_batch = true;
        Action::Pause
    }

    fn peer_body(&mut self, body: &[u8]) -> Action {
        let (now, _) = now_ticks();
        let res = {
            let mut guard = self.shared.router.borrow_mut();
            let r = &mut *guard;
            peers::apply(&EnvoyStore, &r.cfg, body, now, &mut r.sc)
        };
        let m = &self.shared.metrics;
        match res {
            Ok(a) => {
                m.add(m.peer_records_received, i64::from(a.records));
                m.add(m.peer_records_ignored, i64::from(a.ignored));
                m.add(m.index_writes, i64::from(a.writes.writes));
                m.add(m.index_conflicts, i64::from(a.writes.conflicts));
                m.add(m.index_dropped, i64::from(a.writes.dropped));
                m.maybe_flush(now);
                let _ = hostcalls::send_http_response(204, vec![], None);
                Action::Pause
            }
            Err(_) => {
                m.add(m.peer_requests_rejected, 1);
                m.maybe_flush(now);
                local_reply(
                    400,
                    r#"{"object":"error","message":"bad record batch","type":"BadRequestError","code":400}"#,
                )
            }
        }
    }

    fn decide(&mut self, body: &[u8]) -> Action {
        let Some(ep) = self.endpoint.take() else {
            return Action::Continue;
        };
        let (now, _) = now_ticks();
        let outcome = {
            let mut r = self.shared.router.borrow_mut();
            r.route(&EnvoyStore, ep, body, now)
        };
        let m = &self.shared.metrics;
        match outcome {
            Outcome::Reject { status, body } => {
                m.add(m.reasons[Reason::Rejected.index()], 1);
                m.maybe_flush(now);
                local_reply(status, &body)
            }
            Outcome::Route(d) => {
                if let Some(action) = self.pd_route(&d, body, now) {
                    return action;
                }
                let m = &self.shared.metrics;
                m.add(m.reasons[d.reason.index()], 1);
                m.add(m.blocks_prompt, i64::from(d.total_blocks));
                m.add(m.blocks_matched, i64::from(d.matched_blocks));
                m.add(m.index_writes, i64::from(d.index.writes));
                m.add(m.index_conflicts, i64::from(d.index.conflicts));
                m.add(m.index_dropped, i64::from(d.index.dropped));
                m.add(m.index_probes, i64::from(d.probes));
                m.add(m.truncated, i64::from(d.truncated));
                m.inflight(&d, 1);
                m.maybe_flush(now);
                self.charged = true;
                let r = self.shared.router.borrow();
                let _ = hostcalls::add_map_value(
                    MapType::HttpRequestHeaders,
                    &r.cfg.cluster_header,
                    r.cluster(&d),
                );
                self.decision = Some(d);
                Action::Continue
            }
        }
    }

    /// PD model: rewrites the body for the prefill worker `d` chose, picks and charges a decode
    /// worker, and points the cluster header at it and the prefill header at `d`'s worker (the
    /// route mirrors the body there). `None`: not a PD model, route as usual.
    fn pd_route(&mut self, d: &Decision, body: &[u8], now: u32) -> Option<Action> {
        let mut guard = self.shared.router.borrow_mut();
        let r = &mut *guard;
        let rewritten = crate::pd::rewrite_for(r, d, body)?;
        let m = &self.shared.metrics;
        if rewritten.is_err() {
            // not a JSON object: no worker could use it; undo the prefill charge
            r.release(&EnvoyStore, d);
            m.add(m.pd_bad_body, 1);
            m.add(m.reasons[Reason::Rejected.index()], 1);
            m.maybe_flush(now);
            return Some(local_reply(
                400,
                r#"{"object":"error","message":"request body must be a JSON object","type":"BadRequestError","code":400}"#,
            ));
        }
        let tokens = (body.len() / r.cfg.policy.chars_per_token.max(1) as usize) as u32;
        let dec = crate::pd::decode_decision(r, &EnvoyStore, d, tokens, now)?;
        let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, body.len(), &r.pd.out);
        if !header("content-length").is_empty() {
            let len = r.pd.out.len().to_string();
            let _ = hostcalls::set_map_value(
                MapType::HttpRequestHeaders,
                "content-length",
                Some(len.as_str()),
            );
        }
        let _ = hostcalls::add_map_value(
            MapType::HttpRequestHeaders,
            &r.cfg.cluster_header,
            r.cluster(&dec),
        );
        let _ = hostcalls::add_map_value(
            MapType::HttpRequestHeaders,
            &r.cfg.prefill_cluster_header,
            r.cluster(d),
        );
        m.add(m.reasons[d.reason.index()], 1);
        m.add(m.blocks_prompt, i64::from(d.total_blocks));
        m.add(m.blocks_matched, i64::from(d.matched_blocks));
        m.add(m.index_writes, i64::from(d.index.writes));
        m.add(m.index_conflicts, i64::from(d.index.conflicts));
        m.add(m.index_dropped, i64::from(d.index.dropped));
        m.add(m.index_probes, i64::from(d.probes));
        m.add(m.truncated, i64::from(d.truncated));
        m.add(m.pd_requests, 1);
        m.add(m.pd_client_fields, i64::from(r.pd.dropped));
        m.inflight(d, 1);
        m.inflight(&dec, 1);
        m.maybe_flush(now);
        self.charged = true;
        self.decision = Some(*d);
        self.decode = Some(dec);
        self.prefill_held = true;
        Some(Action::Continue)
    }

    /// PD: releases the prefill worker's charge once (its work ends when the decode worker
    /// answers, long before the decode stream does).
    fn release_prefill(&mut self) {
        if !std::mem::take(&mut self.prefill_held) {
            return;
        }
        if let Some(d) = &self.decision {
            if let Ok(mut r) = self.shared.router.try_borrow_mut() {
                r.release(&EnvoyStore, d);
            }
            self.shared.metrics.inflight(d, -1);
        }
    }

    fn release(&mut self) {
        if !std::mem::take(&mut self.charged) {
            return;
        }
        if let Some(d) = self.decode.take() {
            if let Ok(mut r) = self.shared.router.try_borrow_mut() {
                r.release(&EnvoyStore, &d);
            }
            self.shared.metrics.inflight(&d, -1);
            self.release_prefill();
            if self.shared.closing.get() {
                self.shared.flush_all();
            }
            return;
        }
        if let Some(d) = &self.decision {
            if let Ok(mut r) = self.shared.router.try_borrow_mut() {
                r.release(&EnvoyStore, d);
            }
            self.shared.metrics.inflight(d, -1);
            if self.shared.closing.get() {
                self.shared.flush_all();
            }
        }
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        {
            // Whatever the client sent under our header names is never trusted or forwarded.
            let r = self.shared.router.borrow();
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, &r.cfg.cluster_header);
            let _ = hostcalls::remove_map_value(
                MapType::HttpRequestHeaders,
                &r.cfg.prefill_cluster_header,
            );
            if let Some(h) = &r.cfg.debug_header {
                let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, h);
            }
        }
        if self.shared.router.borrow().cfg.peer_listener {
            return self.peer_headers(end_of_stream);
        }
        let method = header(":method");
        let path = header(":path");
        if let Some(ep) = Endpoint::classify(&method, &path) {
            self.endpoint = Some(ep);
            if end_of_stream {
                return self.decide(&[]);
            }
            return Action::Pause;
        }
        let m = &self.shared.metrics;
        m.add(m.reasons[Reason::Passthrough.index()], 1);
        let mut r = self.shared.router.borrow_mut();
        let d = r.passthrough();
        let cluster = match (&d, &r.cfg.passthrough_cluster) {
            (Some(d), _) => r.cluster(d),
            (None, Some(c)) => c.as_str(),
            (None, None) => "",
        };
        let _ =
            hostcalls::add_map_value(MapType::HttpRequestHeaders, &r.cfg.cluster_header, cluster);
        self.decision = d;
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.peer_batch {
            if !end_of_stream {
                return Action::Pause;
            }
            self.peer_batch = false;
            let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            return self.peer_body(&body);
        }
        if self.endpoint.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause; // Envoy buffers until the whole body is here
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.decide(&body)
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        if self.endpoint.is_none() {
            return Action::Continue;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.decide(&body)
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        self.release_prefill();
        let r = self.shared.router.borrow();
        if let (Some(h), Some(d)) = (&r.cfg.debug_header, &self.decision) {
            let mut v = String::with_capacity(96);
            let _ = write!(
                v,
                "worker={}; reason={}; matched={}; total={}",
                r.cluster(d),
                d.reason.as_str(),
                d.matched_blocks,
                d.total_blocks
            );
            if let Some(dec) = &self.decode {
                let _ = write!(v, "; decode={}", r.cluster(dec));
            }
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, h, &v);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Streams that end without an access-log callback still release their charge.
        self.release();
    }
}
