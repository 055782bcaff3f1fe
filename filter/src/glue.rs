//! The proxy-wasm glue: moves data between Envoy and the pure core, nothing else.
//!
//! Host calls per inference request (steady state, cache-aware): 1 header removal, 2 header
//! reads (`:method`, `:path`), 1 clock read, 1 body read, 1 load read + 1 load CAS, the index
//! probes (O(log log n), see `index.rs`), index writes for new checkpoints only, 1 header add,
//! a few metric increments; at stream end 1 load read + 1 load CAS.

use crate::config::Config;
use crate::policy::Reason;
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
}

fn now_ticks() -> (u32, u64) {
    let t = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .unwrap_or_default();
    ((t.as_millis() / 100) as u32, t.as_nanos() as u64)
}

impl Context for Root {
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
            if self.ticks % METRICS_EVERY == 0 {
                s.metrics.flush();
            }
            if let Ok(mut r) = s.router.try_borrow_mut() {
                r.tick(&EnvoyStore, TICK_MS);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Stream {
            shared,
            endpoint: None,
            decision: None,
            charged: false,
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
    /// True while this stream holds a load charge that must be released exactly once.
    charged: bool,
}

fn header(name: &str) -> Vec<u8> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl Stream {
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
                let _ = hostcalls::send_http_response(
                    status,
                    vec![("content-type", "application/json")],
                    Some(body.as_bytes()),
                );
                Action::Pause
            }
            Outcome::Route(d) => {
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

    fn release(&mut self) {
        if !std::mem::take(&mut self.charged) {
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
            if let Some(h) = &r.cfg.debug_header {
                let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, h);
            }
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
