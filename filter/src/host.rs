//! Everything the filter asks of Envoy, as one trait: the [`Store`] (shared data) plus headers,
//! bodies, the clock, metrics, local replies, HTTP calls, the timer and logs.
//!
//! `glue` is written against [`Host`] only, so the whole stream lifecycle (metric batching, load
//! charged and released exactly once, passthrough, debug header, peer batches, polls) runs
//! natively against [`FakeHost`] in tests; in the `.wasm`, `abi::Envoy` implements it with one
//! proxy-wasm host call per method call, in the native build `native::host::Native` with one
//! dynamic-module ABI call. Costs in Envoy: in the `.wasm` every method is one host call (a V8
//! boundary crossing), and the ones returning bytes also make Envoy call back into the module to
//! allocate the copy; natively a method is a plain function call into Envoy.

use crate::store::{CasMismatch, MemStore, Store};
use std::cell::RefCell;

/// Which header map (proxy-wasm `MapType`; the values are the ABI's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Map {
    RequestHeaders = 0,
    ResponseHeaders = 2,
    HttpCallResponseHeaders = 6,
}

/// Which buffer (proxy-wasm `BufferType`; the values are the ABI's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    RequestBody = 0,
    HttpCallResponseBody = 4,
    PluginConfiguration = 7,
}

/// Metric kinds (proxy-wasm `MetricType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
}

/// An HTTP call Envoy refused to dispatch (unknown cluster, bad headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRefused;

pub trait Host: Store {
    /// A header's value, or `None` when the map has no such header.
    fn header(&self, map: Map, name: &str) -> Option<Vec<u8>>;
    /// A whole header map in one call, serialized as [`crate::header_pairs`] describes.
    fn header_pairs(&self, map: Map) -> Vec<u8>;
    fn add_header(&self, map: Map, name: &str, value: &str);
    fn remove_header(&self, map: Map, name: &str);
    /// Sets a header, replacing every value it had.
    fn replace_header(&self, map: Map, name: &str, value: &str);
    /// Up to `max` bytes of a buffer from its start (empty when there is none).
    fn buffer(&self, which: Buffer, max: usize) -> Vec<u8>;
    /// Replaces the first `len` bytes of a buffer with `data` (the request body: PD rewrite).
    fn set_buffer(&self, which: Buffer, len: usize, data: &[u8]);
    /// Wall-clock nanoseconds since the Unix epoch.
    fn now_nanos(&self) -> u64;
    /// Defines (or finds) a metric by name; 0 when Envoy refused (increments to 0 are skipped).
    fn define_metric(&self, kind: MetricKind, name: &str) -> u32;
    fn increment_metric(&self, id: u32, by: i64);
    fn record_metric(&self, id: u32, value: u64);
    /// Answers the current stream locally (Envoy sends it after the callback returns).
    fn local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// A local reply with Envoy response code details (`%RESPONSE_CODE_DETAILS%` in access
    /// logs: why the filter answered); no spaces.
    fn local_reply_details(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        let _ = details;
        self.local_reply(status, headers, body);
    }
    /// Dispatches an HTTP call from the root context; the answer arrives as an
    /// `on_http_call_response` with the returned token.
    fn http_call(
        &self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u32,
    ) -> Result<u32, CallRefused>;
    fn set_tick_period_ms(&self, ms: u32);
    fn log_error(&self, msg: &str);
    /// Whether the filter should send batched state (metric increments, parked load releases)
    /// at once instead of at its next tick or decision: true where host calls are cheap and no
    /// timer runs while a thread is idle (the native build); the Wasm host batches.
    fn eager_flush(&self) -> bool {
        false
    }
    /// The address (`IP:PORT`) of the upstream host that answered the current stream (Envoy's
    /// `upstream.address` attribute, once the response headers came); `None` before, without an
    /// upstream, or where the host cannot tell (the native build).
    fn upstream_address(&self) -> Option<Vec<u8>> {
        None
    }
    /// Whether this root may make HTTP calls at all (load polls, peer batches). The native
    /// build answers false on Envoy's worker threads: its calls must all start on one thread.
    fn can_call(&self) -> bool {
        true
    }
}

/// A response's `:status` (`map`: the stream's response or an HTTP call's answer), one header
/// read; `None` when absent or not a number (Envoy answers a call that timed out or failed
/// without headers).
pub fn status(h: &impl Host, map: Map) -> Option<u32> {
    let v = h.header(map, ":status")?;
    std::str::from_utf8(&v).ok()?.parse().ok()
}

/// The clock, one host call: (100 ms units, the core's clock; nanoseconds since the epoch).
pub fn now_ticks(h: &impl Host) -> (u32, u64) {
    let nanos = h.now_nanos();
    ((nanos / 100_000_000) as u32, nanos)
}

/// A local reply the filter sent: (status, headers, body).
pub type Reply = (u32, Vec<(String, String)>, Vec<u8>);

/// An HTTP call the filter dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub token: u32,
    pub upstream: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u32,
}

/// In-memory Envoy for native tests: a [`MemStore`], settable header maps and buffers, a
/// settable clock, metrics by name, and a record of local replies and HTTP calls. Every
/// method counts as one host call in [`FakeHost::calls`], as it would be one in Envoy.
#[derive(Default)]
pub struct FakeHost {
    pub store: MemStore,
    pub state: RefCell<FakeState>,
}

#[derive(Default)]
pub struct FakeState {
    pub request_headers: Vec<(String, String)>,
    pub response_headers: Vec<(String, String)>,
    pub call_headers: Vec<(String, String)>,
    pub request_body: Vec<u8>,
    pub call_body: Vec<u8>,
    pub plugin_config: Vec<u8>,
    pub now_nanos: u64,
    /// (name, kind, value); a metric's id is its position plus one.
    pub metrics: Vec<(String, MetricKind, i64)>,
    pub replies: Vec<Reply>,
    /// Response code details of each reply in `replies` (empty: none given).
    pub reply_details: Vec<String>,
    pub calls: Vec<Call>,
    pub next_token: u32,
    /// Names of upstreams `http_call` refuses.
    pub refuse_calls_to: Vec<String>,
    pub tick_period_ms: u32,
    pub errors: Vec<String>,
    /// Host calls made (shared-data calls are counted by the store).
    pub host_calls: u64,
    /// What [`Host::eager_flush`] answers (false: batch, as the Wasm host does).
    pub eager_flush: bool,
    /// Makes [`Host::can_call`] answer false (a native worker thread).
    pub cannot_call: bool,
    /// What [`Host::upstream_address`] answers.
    pub upstream_address: Option<String>,
    /// Calls of [`Host::upstream_address`] (one of the host calls in `host_calls`).
    pub address_reads: u64,
}

impl FakeState {
    fn map(&mut self, map: Map) -> &mut Vec<(String, String)> {
        match map {
            Map::RequestHeaders => &mut self.request_headers,
            Map::ResponseHeaders => &mut self.response_headers,
            Map::HttpCallResponseHeaders => &mut self.call_headers,
        }
    }
}

impl FakeHost {
    pub fn new() -> Self {
        Self::default()
    }
    /// A metric's value by its defined name.
    pub fn metric(&self, name: &str) -> Option<i64> {
        let s = self.state.borrow();
        s.metrics.iter().find(|m| m.0 == name).map(|m| m.2)
    }
    /// Host calls made so far, shared-data gets and sets included.
    pub fn calls(&self) -> u64 {
        let (g, s) = self.store.calls();
        self.state.borrow().host_calls + g + s
    }
    fn count(&self) -> std::cell::RefMut<'_, FakeState> {
        let mut s = self.state.borrow_mut();
        s.host_calls += 1;
        s
    }
}

impl Store for FakeHost {
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32> {
        self.store.get(key, out)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch> {
        self.store.set(key, value, cas)
    }
    fn leases_expire(&self) -> bool {
        self.store.leases_expire()
    }
}

impl Host for FakeHost {
    fn header(&self, map: Map, name: &str) -> Option<Vec<u8>> {
        let mut s = self.count();
        let m = s.map(map);
        m.iter()
            .find(|e| e.0 == name)
            .map(|e| e.1.as_bytes().to_vec())
    }
    fn header_pairs(&self, map: Map) -> Vec<u8> {
        let mut s = self.count();
        crate::header_pairs::encode(s.map(map))
    }
    fn add_header(&self, map: Map, name: &str, value: &str) {
        self.count().map(map).push((name.into(), value.into()));
    }
    fn remove_header(&self, map: Map, name: &str) {
        self.count().map(map).retain(|e| e.0 != name);
    }
    fn replace_header(&self, map: Map, name: &str, value: &str) {
        let mut s = self.count();
        let m = s.map(map);
        m.retain(|e| e.0 != name);
        m.push((name.into(), value.into()));
    }
    fn set_buffer(&self, which: Buffer, len: usize, data: &[u8]) {
        let mut s = self.count();
        let b = match which {
            Buffer::RequestBody => &mut s.request_body,
            Buffer::HttpCallResponseBody => &mut s.call_body,
            Buffer::PluginConfiguration => &mut s.plugin_config,
        };
        let end = len.min(b.len());
        b.splice(..end, data.iter().copied());
    }
    fn buffer(&self, which: Buffer, max: usize) -> Vec<u8> {
        let s = self.count();
        let b = match which {
            Buffer::RequestBody => &s.request_body,
            Buffer::HttpCallResponseBody => &s.call_body,
            Buffer::PluginConfiguration => &s.plugin_config,
        };
        b[..b.len().min(max)].to_vec()
    }
    fn now_nanos(&self) -> u64 {
        self.count().now_nanos
    }
    fn define_metric(&self, kind: MetricKind, name: &str) -> u32 {
        let mut s = self.count();
        if let Some(i) = s.metrics.iter().position(|m| m.0 == name) {
            return i as u32 + 1;
        }
        s.metrics.push((name.into(), kind, 0));
        s.metrics.len() as u32
    }
    fn increment_metric(&self, id: u32, by: i64) {
        let mut s = self.count();
        if let Some(m) = s.metrics.get_mut((id as usize).wrapping_sub(1)) {
            m.2 += by;
        }
    }
    fn record_metric(&self, id: u32, value: u64) {
        let mut s = self.count();
        if let Some(m) = s.metrics.get_mut((id as usize).wrapping_sub(1)) {
            m.2 = value as i64;
        }
    }
    fn local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let h = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut s = self.count();
        s.replies.push((status, h, body.to_vec()));
        s.reply_details.push(String::new());
    }
    fn local_reply_details(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        self.local_reply(status, headers, body);
        if let Some(d) = self.state.borrow_mut().reply_details.last_mut() {
            *d = details.into();
        }
    }
    fn http_call(
        &self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u32,
    ) -> Result<u32, CallRefused> {
        let mut s = self.count();
        if s.refuse_calls_to.iter().any(|u| u == upstream) {
            return Err(CallRefused);
        }
        s.next_token = s.next_token.wrapping_add(1).max(1);
        let token = s.next_token;
        s.calls.push(Call {
            token,
            upstream: upstream.into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.map(<[u8]>::to_vec),
            timeout_ms,
        });
        Ok(token)
    }
    fn set_tick_period_ms(&self, ms: u32) {
        self.count().tick_period_ms = ms;
    }
    fn log_error(&self, msg: &str) {
        self.count().errors.push(msg.into());
    }
    fn eager_flush(&self) -> bool {
        self.state.borrow().eager_flush
    }
    fn can_call(&self) -> bool {
        !self.state.borrow().cannot_call
    }
    fn upstream_address(&self) -> Option<Vec<u8>> {
        let mut s = self.count();
        s.address_reads += 1;
        s.upstream_address.as_ref().map(|a| a.as_bytes().to_vec())
    }
}
