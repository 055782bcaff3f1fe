//! [`Native`]: the glue's [`Host`] over Envoy's dynamic-module callbacks, for one hook.
//!
//! A `Native` lives for one hook call: it borrows the stream's Envoy pointer (NULL outside a
//! stream), the config and, in a callout-done hook, the answer's headers and chunks, all of which
//! Envoy keeps valid only for that hook. It takes every Envoy call through the [`Abi`] table `A`
//! ([`Envoy`](super::ffi::Envoy) in the module, a fake in tests).
//!
//! Costs (what a routed request pays here): a header read is two callbacks (size, then the
//! pairs) and one `Vec<Pair>` for the pairs; a body read is two callbacks per body type tried
//! and one `Vec<Buf>`; a header change is one callback, plus `clear_route_cache` on the request
//! map; a metric update is one callback; shared data never reaches Envoy (the process store).
//! Nothing here allocates beyond what the glue asked for, and a `Native` itself is a few
//! pointers on the stack.

use super::ffi::{
    Abi, Buf, Pair, BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY, REQUEST_HEADERS, RESPONSE_HEADERS,
};
use super::roots::ModuleConfig;
use crate::host::{Buffer, CallRefused, Host, Map, MetricKind};
use crate::process_store::ProcessStore;
use crate::store::{CasMismatch, Store};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::time::{SystemTime, UNIX_EPOCH};

/// A metric defined for a config: its name, kind and Envoy's id (0: Envoy refused it).
pub(crate) type Defined = (String, MetricKind, usize);

/// The config-level metric calls: define (name, no labels, id out) and update (id, no labels,
/// amount).
type DefineFn = unsafe fn(*mut c_void, Buf, *const Buf, usize, *mut usize) -> u32;
type UpdateFn = unsafe fn(*mut c_void, usize, *const Buf, usize, u64) -> u32;

/// Defines a metric while the config is being created (main thread); 0 when Envoy refused.
///
/// # Safety
/// `envoy` is Envoy's config pointer during `on_http_filter_config_new`.
pub(crate) unsafe fn define<A: Abi>(envoy: *mut c_void, kind: MetricKind, name: &str) -> usize {
    let f: DefineFn = match kind {
        MetricKind::Counter => A::define_counter,
        MetricKind::Gauge => A::define_gauge,
    };
    let mut id = 0usize;
    let rc = f(
        envoy,
        Buf::of(name.as_bytes()),
        std::ptr::null(),
        0,
        &mut id,
    );
    if rc == 0 {
        id
    } else {
        0
    }
}

/// [`Host`] over one stream's Envoy pointer (NULL outside a stream) and its config.
pub(crate) struct Native<'a, A: Abi> {
    pub(crate) filter: *mut c_void,
    pub(crate) json: &'a [u8],
    /// Envoy's config pointer (metrics are incremented on the config, from any thread).
    pub(crate) config: *mut c_void,
    pub(crate) metrics: &'a [Defined],
    /// Set only while the config is created: metric definitions go to Envoy and land here.
    pub(crate) defining: Option<&'a RefCell<Vec<Defined>>>,
    /// On Envoy's main thread (the timer and call hooks): the only place HTTP calls start.
    pub(crate) main: bool,
    /// The answer of the HTTP call being delivered: its headers and body chunks.
    pub(crate) call_headers: &'a [Pair],
    pub(crate) call_body: &'a [Buf],
    /// Set when this hook sent a local reply (the panic guard sends none after one).
    pub(crate) replied: Cell<bool>,
    pub(crate) abi: PhantomData<A>,
}

impl<'a, A: Abi> Native<'a, A> {
    /// A worker thread's host for stream `filter` (NULL: none) of config `c`.
    pub(crate) fn new(filter: *mut c_void, c: &'a ModuleConfig) -> Native<'a, A> {
        Native {
            filter,
            json: &c.json,
            config: c.envoy,
            metrics: &c.metrics,
            defining: None,
            main: false,
            call_headers: &[],
            call_body: &[],
            replied: Cell::new(false),
            abi: PhantomData,
        }
    }

    /// The host of `on_http_filter_config_new`: no stream, no config of ours yet; metric
    /// definitions go to Envoy and into `defined`.
    pub(crate) fn defining(
        envoy: *mut c_void,
        json: &'a [u8],
        defined: &'a RefCell<Vec<Defined>>,
    ) -> Native<'a, A> {
        Native {
            filter: std::ptr::null_mut(),
            json,
            config: envoy,
            metrics: &[],
            defining: Some(defined),
            main: true,
            call_headers: &[],
            call_body: &[],
            replied: Cell::new(false),
            abi: PhantomData,
        }
    }

    /// One config-level metric call on Envoy's metric `envoy_id`.
    fn update(&self, f: UpdateFn, envoy_id: usize, amount: u64) {
        // SAFETY: Envoy's live config pointer (checked non-null by `metric`); no labels.
        unsafe { f(self.config, envoy_id, std::ptr::null(), 0, amount) };
    }

    /// Updates metric `id` (position plus one) with `op`, when Envoy defined it.
    fn metric(&self, id: u32, op: impl FnOnce(MetricKind, usize)) {
        if let Some((_, kind, envoy_id)) = self.metrics.get((id as usize).wrapping_sub(1)) {
            if *envoy_id != 0 && !self.config.is_null() {
                op(*kind, *envoy_id);
            }
        }
    }

    fn map(map: Map) -> Option<u32> {
        match map {
            Map::RequestHeaders => Some(REQUEST_HEADERS),
            Map::ResponseHeaders => Some(RESPONSE_HEADERS),
            Map::HttpCallResponseHeaders => None,
        }
    }

    /// Calls `f` with the header map's pairs (valid during the call only).
    fn with_pairs<R>(&self, map: Map, f: impl FnOnce(&[Pair]) -> R) -> Option<R> {
        let m = Self::map(map)?;
        if self.filter.is_null() {
            return None;
        }
        // SAFETY: a live stream pointer; the array gets exactly `n` entries.
        unsafe {
            let n = A::get_headers_size(self.filter, m);
            let mut pairs = vec![Pair::NULL; n];
            if n == 0 || !A::get_headers(self.filter, m, pairs.as_mut_ptr()) {
                return Some(f(&[]));
            }
            Some(f(&pairs))
        }
    }

    /// Sets (`add` false: replaces every value; a NULL value removes the header) or adds a
    /// header; a request-header change clears the route cache.
    fn mutate(&self, map: Map, name: &str, value: Buf, add: bool) {
        let Some(m) = Self::map(map) else {
            return;
        };
        if self.filter.is_null() {
            return;
        }
        let key = Buf::of(name.as_bytes());
        // SAFETY: a live stream pointer; Envoy copies key and value.
        unsafe {
            if add {
                A::add_header(self.filter, m, key, value);
            } else {
                A::set_header(self.filter, m, key, value);
            }
            if m == REQUEST_HEADERS {
                // The route may match on this header, and Envoy keeps the route it picked
                // before the filter ran unless told otherwise (the Wasm host clears it itself).
                A::clear_route_cache(self.filter);
            }
        }
    }

    /// The request body's chunks: the buffered body when earlier chunks were buffered (Envoy has
    /// appended the last one to it), else the chunk just received.
    fn body(&self, max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        if self.filter.is_null() {
            return out;
        }
        for which in [BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY] {
            // SAFETY: a live stream pointer; the array gets exactly `n` entries, whose bytes
            // stay valid for this hook.
            unsafe {
                let n = A::get_body_chunks_size(self.filter, which);
                if n == 0 {
                    continue;
                }
                let mut chunks = vec![Buf::NULL; n];
                if !A::get_body_chunks(self.filter, which, chunks.as_mut_ptr()) {
                    continue;
                }
                for c in &chunks {
                    let room = max.saturating_sub(out.len());
                    let b = c.bytes();
                    out.extend_from_slice(b.get(..b.len().min(room)).unwrap_or_default());
                }
                return out;
            }
        }
        out
    }
}

/// Shared data is the process store: every worker thread is in Envoy's address space, so no
/// Envoy call is needed (and none is made).
impl<A: Abi> Store for Native<'_, A> {
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32> {
        ProcessStore.get(key, out)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch> {
        ProcessStore.set(key, value, cas)
    }
    /// False: worker threads have no timer to beat with, and need none (see the store).
    fn leases_expire(&self) -> bool {
        ProcessStore.leases_expire()
    }
}

impl<A: Abi> Host for Native<'_, A> {
    fn header(&self, map: Map, name: &str) -> Option<Vec<u8>> {
        if map == Map::HttpCallResponseHeaders {
            return self.call_headers.iter().find_map(|p| {
                // SAFETY: Envoy's bytes, valid during the callout-done hook.
                let (k, v) = unsafe { (p.key.bytes(), p.value.bytes()) };
                (k == name.as_bytes()).then(|| v.to_vec())
            });
        }
        self.with_pairs(map, |pairs| {
            pairs.iter().find_map(|p| {
                // SAFETY: Envoy's bytes, valid during this hook.
                let (k, v) = unsafe { (p.key.bytes(), p.value.bytes()) };
                (k == name.as_bytes()).then(|| v.to_vec())
            })
        })
        .flatten()
    }
    fn header_pairs(&self, map: Map) -> Vec<u8> {
        self.with_pairs(map, |pairs| {
            // SAFETY: Envoy's bytes, valid during this hook.
            let kv: Vec<(&[u8], &[u8])> = pairs
                .iter()
                .map(|p| unsafe { (p.key.bytes(), p.value.bytes()) })
                .collect();
            crate::header_pairs::encode(&kv)
        })
        .unwrap_or_else(|| crate::header_pairs::encode::<&[u8], &[u8]>(&[]))
    }
    fn add_header(&self, map: Map, name: &str, value: &str) {
        self.mutate(map, name, Buf::of(value.as_bytes()), true);
    }
    /// A NULL value removes every value of the header (ABI `set_header`).
    fn remove_header(&self, map: Map, name: &str) {
        self.mutate(map, name, Buf::NULL, false);
    }
    fn replace_header(&self, map: Map, name: &str, value: &str) {
        self.mutate(map, name, Buf::of(value.as_bytes()), false);
    }
    fn buffer(&self, which: Buffer, max: usize) -> Vec<u8> {
        match which {
            Buffer::RequestBody => self.body(max),
            Buffer::PluginConfiguration => self
                .json
                .get(..max.min(self.json.len()))
                .unwrap_or_default()
                .to_vec(),
            Buffer::HttpCallResponseBody => {
                let mut out = Vec::new();
                for c in self.call_body {
                    // SAFETY: Envoy's chunks, valid during the callout-done hook.
                    let b = unsafe { c.bytes() };
                    let room = max.saturating_sub(out.len());
                    out.extend_from_slice(b.get(..b.len().min(room)).unwrap_or_default());
                }
                out
            }
        }
    }
    /// Replaces the request body (prefill/decode's rewrite, at the end of the body): both
    /// bodies are drained and `data` goes where the body was, the buffered body when earlier
    /// chunks were buffered, else the chunk just received (as [`Native::body`] reads it).
    fn set_buffer(&self, which: Buffer, _len: usize, data: &[u8]) {
        if which != Buffer::RequestBody || self.filter.is_null() {
            return;
        }
        // SAFETY: a live stream pointer in a request-body hook; `data` outlives the calls
        // (Envoy copies it).
        unsafe {
            let buffered = A::get_body_chunks_size(self.filter, BUFFERED_REQUEST_BODY) > 0;
            for b in [BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY] {
                A::drain_body(self.filter, b, usize::MAX);
            }
            let target = if buffered {
                BUFFERED_REQUEST_BODY
            } else {
                RECEIVED_REQUEST_BODY
            };
            if !A::append_body(self.filter, target, Buf::of(data)) {
                self.log_error("prefix-router: Envoy refused the rewritten request body");
            }
        }
    }
    fn now_nanos(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    }
    fn define_metric(&self, kind: MetricKind, name: &str) -> u32 {
        let pos = |m: &[Defined]| m.iter().position(|e| e.0 == name);
        let Some(cell) = self.defining else {
            return pos(self.metrics).map_or(0, |i| i as u32 + 1);
        };
        let mut m = cell.borrow_mut();
        if let Some(i) = pos(&m) {
            return i as u32 + 1;
        }
        // SAFETY: `defining` is set only in `on_http_filter_config_new`, on Envoy's config.
        let envoy_id = unsafe { define::<A>(self.config, kind, name) };
        m.push((name.to_string(), kind, envoy_id));
        m.len() as u32
    }
    fn increment_metric(&self, id: u32, by: i64) {
        self.metric(id, |kind, envoy_id| {
            let f: UpdateFn = match (kind, by >= 0) {
                (MetricKind::Counter, true) => A::increment_counter,
                (MetricKind::Counter, false) => return, // counters only go up
                (MetricKind::Gauge, true) => A::increment_gauge,
                (MetricKind::Gauge, false) => A::decrement_gauge,
            };
            self.update(f, envoy_id, by.unsigned_abs());
        });
    }
    fn record_metric(&self, id: u32, value: u64) {
        self.metric(id, |kind, envoy_id| {
            if kind == MetricKind::Gauge {
                self.update(A::set_gauge, envoy_id, value);
            }
        });
    }
    fn local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        if self.filter.is_null() {
            return;
        }
        let pairs = Pair::all(headers);
        // SAFETY: a live stream pointer; every buffer outlives the call (Envoy copies them).
        unsafe {
            A::send_response(
                self.filter,
                status,
                pairs.as_ptr(),
                pairs.len(),
                Buf::of(body),
                Buf::of(b"prefix_router"),
            );
        }
        self.replied.set(true);
    }
    /// A config-level callout, from the main thread only (Envoy's callout table per config is
    /// not locked, and a call from a foreign thread crashes it); the answer comes back in
    /// `on_http_filter_config_http_callout_done` on the main thread.
    fn http_call(
        &self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u32,
    ) -> Result<u32, CallRefused> {
        if !self.main || self.config.is_null() {
            return Err(CallRefused);
        }
        let pairs = Pair::all(headers);
        let mut id = 0u64;
        // SAFETY: Envoy's live config pointer, on the main thread; the buffers outlive the call
        // (Envoy copies them).
        let rc = unsafe {
            A::http_callout(
                self.config,
                &mut id,
                Buf::of(upstream.as_bytes()),
                pairs.as_ptr(),
                pairs.len(),
                Buf::of(body.unwrap_or_default()),
                u64::from(timeout_ms),
            )
        };
        // Envoy's ids start at 1; the glue's tokens are 32-bit (a wrap needs 2^32 calls).
        if rc == 0 {
            Ok(id as u32)
        } else {
            Err(CallRefused)
        }
    }
    fn set_tick_period_ms(&self, _ms: u32) {}
    fn log_error(&self, msg: &str) {
        eprintln!("{msg}");
    }
    /// No timer runs on an idle worker thread here, and a metric update is a native call: a
    /// stream's end sends what its thread batched (in-flight gauges, parked releases) at once.
    fn eager_flush(&self) -> bool {
        true
    }
    fn can_call(&self) -> bool {
        self.main
    }
}
