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
    Abi, Buf, Pair, ATTRIBUTE_UPSTREAM_ADDRESS, BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY,
    REQUEST_HEADERS, RESPONSE_HEADERS,
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
    fn upstream_address(&self) -> Option<Vec<u8>> {
        if self.filter.is_null() {
            return None;
        }
        let mut out = Buf::of(&[]);
        // SAFETY: a live stream pointer; on success `out` points at Envoy's bytes, valid during
        // this hook, copied at once.
        unsafe {
            A::get_attribute_string(self.filter, ATTRIBUTE_UPSTREAM_ADDRESS, &mut out)
                .then(|| out.bytes().to_vec())
        }
    }
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
        self.local_reply_details(status, "prefix_router", headers, body);
    }
    /// `details` is Envoy's response code details (`%RESPONSE_CODE_DETAILS%`).
    fn local_reply_details(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        if self.filter.is_null() {
            return;
        }
        let pairs = Pair::all(headers);
        // Before the call: once Envoy has been asked, the stream is answered, whatever follows.
        self.replied.set(true);
        // SAFETY: a live stream pointer; every buffer outlives the call (Envoy copies them).
        unsafe {
            A::send_response(
                self.filter,
                status,
                pairs.as_ptr(),
                pairs.len(),
                Buf::of(body),
                Buf::of(details.as_bytes()),
            );
        }
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

#[cfg(test)]
mod tests {
    use super::super::fake::FakeEnvoy;
    use super::*;

    /// A config on `fake` with `metrics` already defined (Envoy ids as given).
    fn config(fake: &FakeEnvoy, json: &str, metrics: Vec<Defined>) -> ModuleConfig {
        ModuleConfig {
            id: 0,
            json: json.as_bytes().to_vec(),
            envoy: fake.ptr(),
            _timer: None,
            metrics,
            panics: 0,
        }
    }

    fn stream<'a>(fake: &FakeEnvoy, c: &'a ModuleConfig) -> Native<'a, FakeEnvoy> {
        Native::new(fake.ptr(), c)
    }

    #[test]
    fn headers_are_read_from_envoys_pairs_and_none_without_a_stream() {
        let fake = FakeEnvoy::new();
        fake.request("POST", "/v1/completions", &[("x-a", "1"), ("x-b", "")], b"");
        fake.state().response_headers = vec![(b":status".to_vec(), b"200".to_vec())];
        let c = config(&fake, "{}", vec![]);
        let h = stream(&fake, &c);
        assert_eq!(
            h.header(Map::RequestHeaders, "x-a").as_deref(),
            Some(&b"1"[..])
        );
        assert_eq!(
            h.header(Map::RequestHeaders, "x-b").as_deref(),
            Some(&b""[..])
        );
        assert_eq!(h.header(Map::RequestHeaders, "x-c"), None);
        assert_eq!(
            h.header(Map::ResponseHeaders, ":status").as_deref(),
            Some(&b"200"[..])
        );
        // Two callbacks per read: the size, then the pairs.
        assert_eq!(fake.count("get_headers_size"), 4);
        assert_eq!(fake.count("get_headers"), 4);
        // No stream (a config hook): nothing is asked of Envoy.
        let none = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        assert_eq!(none.header(Map::RequestHeaders, "x-a"), None);
        assert_eq!(fake.count("get_headers_size"), 4);
    }

    #[test]
    fn header_pairs_encode_the_whole_map_and_an_empty_one_on_failure() {
        let fake = FakeEnvoy::new();
        fake.request("GET", "/", &[("x-a", "1")], b"");
        let c = config(&fake, "{}", vec![]);
        let h = stream(&fake, &c);
        let want = crate::header_pairs::encode(&[
            (&b":method"[..], &b"GET"[..]),
            (b":path", b"/"),
            (b"x-a", b"1"),
        ]);
        assert_eq!(h.header_pairs(Map::RequestHeaders), want);
        let empty = crate::header_pairs::encode::<&[u8], &[u8]>(&[]);
        // Envoy refusing the copy, an empty map, a map the ABI has no number for, no stream.
        fake.state().headers_fail = true;
        assert_eq!(h.header_pairs(Map::RequestHeaders), empty);
        assert_eq!(h.header(Map::RequestHeaders, "x-a"), None);
        assert_eq!(h.header_pairs(Map::ResponseHeaders), empty);
        assert_eq!(h.header_pairs(Map::HttpCallResponseHeaders), empty);
        let none = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        assert_eq!(none.header_pairs(Map::RequestHeaders), empty);
    }

    #[test]
    fn request_header_changes_clear_the_route_cache_and_response_ones_do_not() {
        let fake = FakeEnvoy::new();
        fake.request(
            "POST",
            "/v1/completions",
            &[("x-c", "a"), ("x-c", "b")],
            b"",
        );
        let c = config(&fake, "{}", vec![]);
        let h = stream(&fake, &c);
        h.add_header(Map::RequestHeaders, "x-c", "c");
        assert_eq!(fake.request_header("x-c"), ["a", "b", "c"]);
        h.replace_header(Map::RequestHeaders, "x-c", "d");
        assert_eq!(fake.request_header("x-c"), ["d"]);
        h.remove_header(Map::RequestHeaders, "x-c");
        assert!(fake.request_header("x-c").is_empty());
        assert_eq!(
            fake.state().log[..],
            [
                "add_header",
                "clear_route_cache",
                "set_header",
                "clear_route_cache",
                "set_header",
                "clear_route_cache"
            ]
        );
        h.add_header(Map::ResponseHeaders, "x-d", "1");
        h.replace_header(Map::ResponseHeaders, "x-d", "2");
        assert_eq!(fake.count("clear_route_cache"), 3);
        assert_eq!(
            fake.state().response_headers,
            [(b"x-d".to_vec(), b"2".to_vec())]
        );
        // Call answers' headers are read-only, and no stream means no change.
        h.add_header(Map::HttpCallResponseHeaders, "x-e", "1");
        Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c).add_header(
            Map::RequestHeaders,
            "x-e",
            "1",
        );
        assert_eq!(fake.state().log.len(), 8);
    }

    #[test]
    fn the_body_is_the_buffered_one_when_there_is_one_and_is_cut_at_max() {
        let fake = FakeEnvoy::new();
        let c = config(&fake, r#"{"json":1}"#, vec![]);
        let h = stream(&fake, &c);
        assert!(h.buffer(Buffer::RequestBody, usize::MAX).is_empty());
        fake.state().received = vec![b"last".to_vec()];
        assert_eq!(h.buffer(Buffer::RequestBody, usize::MAX), b"last");
        // Envoy has appended the last chunk to the buffered body: the received one is not
        // read again.
        fake.state().buffered = vec![b"abc".to_vec(), b"def".to_vec(), b"last".to_vec()];
        assert_eq!(h.buffer(Buffer::RequestBody, usize::MAX), b"abcdeflast");
        assert_eq!(h.buffer(Buffer::RequestBody, 4), b"abcd");
        assert_eq!(h.buffer(Buffer::RequestBody, 0), b"");
        assert_eq!(h.buffer(Buffer::PluginConfiguration, 100), br#"{"json":1}"#);
        assert_eq!(h.buffer(Buffer::PluginConfiguration, 3), br#"{"j"#);
        let none = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        assert!(none.buffer(Buffer::RequestBody, 100).is_empty());
    }

    #[test]
    fn a_call_answer_is_read_from_the_hooks_headers_and_chunks() {
        let fake = FakeEnvoy::new();
        let c = config(&fake, "{}", vec![]);
        let (k, v) = (b":status".to_vec(), b"200".to_vec());
        let headers = [Pair {
            key: Buf::of(&k),
            value: Buf::of(&v),
        }];
        let chunks = [Buf::of(b"[{\"a\""), Buf::NULL, Buf::of(b":1}]")];
        let h = Native::<FakeEnvoy> {
            main: true,
            call_headers: &headers,
            call_body: &chunks,
            ..Native::new(std::ptr::null_mut(), &c)
        };
        assert_eq!(
            h.header(Map::HttpCallResponseHeaders, ":status").as_deref(),
            Some(&b"200"[..])
        );
        assert_eq!(h.header(Map::HttpCallResponseHeaders, "x"), None);
        assert_eq!(
            h.buffer(Buffer::HttpCallResponseBody, usize::MAX),
            b"[{\"a\":1}]"
        );
        assert_eq!(h.buffer(Buffer::HttpCallResponseBody, 6), b"[{\"a\":");
        assert!(fake.state().log.is_empty(), "all in the hook's arguments");
    }

    #[test]
    fn a_rewritten_body_replaces_the_buffered_body_or_else_the_received_chunk() {
        let fake = FakeEnvoy::new();
        let c = config(&fake, "{}", vec![]);
        let h = stream(&fake, &c);
        fake.state().buffered = vec![b"ab".to_vec(), b"cd".to_vec()];
        fake.state().received = vec![b"cd".to_vec()];
        h.set_buffer(Buffer::RequestBody, 4, b"new");
        assert_eq!(fake.state().buffered, [b"new".to_vec()]);
        assert!(fake.state().received.is_empty());
        fake.state().buffered.clear();
        fake.state().received = vec![b"one".to_vec()];
        h.set_buffer(Buffer::RequestBody, 3, b"two");
        assert_eq!(fake.state().received, [b"two".to_vec()]);
        assert!(fake.state().buffered.is_empty());
        // Envoy refusing the append is logged, not fatal; other buffers are not written.
        fake.state().append_fails = true;
        h.set_buffer(Buffer::RequestBody, 3, b"three");
        let before = fake.state().log.len();
        h.set_buffer(Buffer::HttpCallResponseBody, 3, b"x");
        Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c).set_buffer(Buffer::RequestBody, 3, b"x");
        assert_eq!(fake.state().log.len(), before);
    }

    #[test]
    fn metrics_are_defined_only_while_the_config_is_created_and_found_by_name_after() {
        let fake = FakeEnvoy::new();
        let defined = RefCell::new(Vec::new());
        let h = Native::<FakeEnvoy>::defining(fake.ptr(), b"{}", &defined);
        assert_eq!(h.define_metric(MetricKind::Counter, "a"), 1);
        assert_eq!(h.define_metric(MetricKind::Gauge, "b"), 2);
        assert_eq!(h.define_metric(MetricKind::Counter, "a"), 1, "defined once");
        fake.state().define_rc = 1; // Envoy refuses: the glue's id exists, Envoy's is 0
        assert_eq!(h.define_metric(MetricKind::Counter, "c"), 3);
        assert_eq!(fake.count("define_counter"), 2);
        assert_eq!(fake.count("define_gauge"), 1);
        let metrics = defined.into_inner();
        assert_eq!(
            metrics,
            [
                ("a".to_string(), MetricKind::Counter, 1),
                ("b".to_string(), MetricKind::Gauge, 2),
                ("c".to_string(), MetricKind::Counter, 0),
            ]
        );
        // A worker thread's root: ids by name, never a define call.
        let c = config(&fake, "{}", metrics);
        let w = stream(&fake, &c);
        assert_eq!(w.define_metric(MetricKind::Gauge, "b"), 2);
        assert_eq!(w.define_metric(MetricKind::Counter, "zzz"), 0);
        assert_eq!(fake.count("define_counter") + fake.count("define_gauge"), 3);
    }

    #[test]
    fn metric_updates_go_to_the_config_and_skip_what_envoy_cannot_take() {
        let fake = FakeEnvoy::new();
        fake.state().defined = vec![
            ("a".into(), MetricKind::Counter),
            ("b".into(), MetricKind::Gauge),
        ];
        let metrics = vec![
            ("a".to_string(), MetricKind::Counter, 1),
            ("b".to_string(), MetricKind::Gauge, 2),
            ("c".to_string(), MetricKind::Counter, 0), // refused by Envoy
        ];
        let c = config(&fake, "{}", metrics);
        // Metrics are the config's: a hook without a stream updates them too.
        let h = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        h.increment_metric(1, 3);
        h.increment_metric(1, -1); // counters only go up
        h.increment_metric(2, 5);
        h.increment_metric(2, -2);
        assert_eq!(fake.metric("a"), Some(3));
        assert_eq!(fake.metric("b"), Some(3));
        h.record_metric(2, 7);
        h.record_metric(1, 9); // a counter is never set
        assert_eq!(fake.metric("b"), Some(7));
        assert_eq!(fake.metric("a"), Some(3));
        let before = fake.state().log.len();
        for id in [0, 3, 4, u32::MAX] {
            h.increment_metric(id, 1);
            h.record_metric(id, 1);
        }
        assert_eq!(fake.state().log.len(), before, "unknown or refused ids");
        assert_eq!(
            fake.state().log[..],
            [
                "increment_counter",
                "increment_gauge",
                "decrement_gauge",
                "set_gauge"
            ]
        );
        // A config without Envoy's pointer never calls.
        let mut orphan = config(&fake, "{}", c.metrics.clone());
        orphan.envoy = std::ptr::null_mut();
        Native::<FakeEnvoy>::new(std::ptr::null_mut(), &orphan).increment_metric(1, 1);
        assert_eq!(fake.state().log.len(), before);
    }

    #[test]
    fn a_local_reply_is_sent_with_its_headers_body_and_details() {
        let fake = FakeEnvoy::new();
        let c = config(&fake, "{}", vec![]);
        let h = stream(&fake, &c);
        assert!(!h.replied.get());
        h.local_reply(404, &[("content-type", "application/json")], b"{}");
        assert!(h.replied.get());
        assert_eq!(
            fake.state().replies,
            [(
                404,
                vec![("content-type".to_string(), "application/json".to_string())],
                b"{}".to_vec(),
                "prefix_router".to_string()
            )]
        );
        h.local_reply_details(403, "prefix_router_peer_bad_mac", &[], b"");
        assert_eq!(fake.state().replies[1].3, "prefix_router_peer_bad_mac");
        let none = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        none.local_reply(500, &[], b"");
        assert!(!none.replied.get());
        assert_eq!(fake.state().replies.len(), 2);
    }

    #[test]
    fn calls_start_only_on_the_main_thread_and_envoys_refusal_is_an_error() {
        let fake = FakeEnvoy::new();
        let c = config(&fake, "{}", vec![]);
        let worker = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        assert!(!worker.can_call());
        let headers = [(":method", "GET"), (":path", "/v1/loads")];
        assert_eq!(
            worker.http_call("w0", &headers, None, 250),
            Err(CallRefused)
        );
        assert_eq!(fake.count("http_callout"), 0);
        let main = Native::<FakeEnvoy> {
            main: true,
            ..Native::new(std::ptr::null_mut(), &c)
        };
        assert!(main.can_call());
        assert_eq!(main.http_call("w0", &headers, None, 250), Ok(1));
        assert_eq!(main.http_call("w1", &[], Some(b"{}"), 100), Ok(2));
        let calls = fake.state().callouts.clone();
        assert_eq!(
            calls[0],
            (
                1,
                "w0".to_string(),
                vec![
                    (":method".to_string(), "GET".to_string()),
                    (":path".to_string(), "/v1/loads".to_string())
                ],
                vec![],
                250
            )
        );
        assert_eq!(calls[1].3, b"{}");
        fake.state().callout_rc = 2; // unknown cluster
        assert_eq!(
            main.http_call("nope", &headers, None, 250),
            Err(CallRefused)
        );
        assert_eq!(fake.state().callouts.len(), 2);
    }

    #[test]
    fn shared_data_is_the_process_store_and_keeps_its_cas_contract() {
        let fake = FakeEnvoy::new();
        let c = config(&fake, "{}", vec![]);
        let a = stream(&fake, &c);
        let b = Native::<FakeEnvoy>::new(std::ptr::null_mut(), &c);
        let mut out = Vec::new();
        assert_eq!(a.get("native-host-test-k", &mut out), None);
        a.set("native-host-test-k", b"1", 0).unwrap();
        let cas = b.get("native-host-test-k", &mut out).unwrap();
        assert_eq!(out, b"1", "one store for every host of the process");
        b.set("native-host-test-k", b"2", cas).unwrap();
        assert_eq!(a.set("native-host-test-k", b"3", cas), Err(CasMismatch));
        assert!(!a.leases_expire());
        assert!(fake.state().log.is_empty(), "never an Envoy call");
        assert!(a.eager_flush());
    }
}
