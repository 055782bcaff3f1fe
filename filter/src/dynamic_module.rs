//! The native build: the same core and `glue` as the `.wasm`, loaded into Envoy 1.40 as a
//! dynamic module (`envoy.filters.http.dynamic_modules`, ABI `v0.2.0`) through this hand-written
//! `extern "C"` layer (`cargo build -p prefix-router --release --features dynamic-module` gives
//! `target/release/libprefix_router.so`). docs/design.md, "Next design: a native module", says
//! why (the V8 boundary is most of the Wasm build's per-request cost) and how every ABI fact
//! used here was checked against the shipped binary.
//!
//! Status: experimental, opt-in (`envoy/gen --native`); the `.wasm` stays the default. It runs
//! every feature of the Wasm build:
//! - load polls and peer batches go out from Envoy's main thread (a timer thread of ours commits
//!   to the config's scheduler; the calls are config-level callouts, which must all start on one
//!   thread): worker threads hand their peer records to it through the process store
//!   (`peers::Outbox::hand_off`, at each stream end);
//! - prefill/decode's body rewrite drains Envoy's request body and appends the new one
//!   (`drain_body` / `append_body`, on the buffered body when there is one);
//! - metrics are Envoy stats named `dynamicmodulescustom.<name>` (the Wasm build's names carry no
//!   prefix), defined while the config is created (the only time Envoy allows it);
//! - a panic or a crash here takes Envoy down (no Wasm sandbox, no `FAIL_RELOAD`).
//!
//! Threads: Envoy calls the config hooks on its main thread and the stream hooks on its worker
//! threads. Each worker thread keeps its own [`Root`] per filter config (what a Wasm VM is per
//! thread), created at the thread's first stream and ticked lazily at stream starts; the
//! [`ProcessStore`] is the process-wide shared data every thread reads and writes.

use crate::config::Config;
use crate::glue::{Action, Root, Stream};
use crate::host::{Buffer, CallRefused, Host, Map, MetricKind};
use crate::process_store::ProcessStore;
use crate::store::{CasMismatch, Store};
use std::cell::RefCell;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of Envoy 1.40.0, NUL-terminated.
const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `{ptr, len}`, passed by value (`envoy_dynamic_module_type_{envoy,module}_buffer`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buf {
    ptr: *const u8,
    len: usize,
}

impl Buf {
    const NULL: Buf = Buf {
        ptr: std::ptr::null(),
        len: 0,
    };
    fn of(s: &[u8]) -> Buf {
        Buf {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }
    /// The bytes, valid for the current hook (Envoy's buffers) or the call (ours).
    ///
    /// # Safety
    /// `ptr` is NULL or points at `len` readable bytes for the lifetime the caller picks.
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr, self.len)
        }
    }
}

/// One header as Envoy hands it out and as `send_response` takes it (key, then value).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Pair {
    key: Buf,
    value: Buf,
}

impl Pair {
    /// The module's headers as the ABI takes them (pointing into `headers`).
    fn all(headers: &[(&str, &str)]) -> Vec<Pair> {
        headers
            .iter()
            .map(|(k, v)| Pair {
                key: Buf::of(k.as_bytes()),
                value: Buf::of(v.as_bytes()),
            })
            .collect()
    }
}

type EnvoyFilter = *mut c_void;
type ModuleFilter = *const c_void;

const REQUEST_HEADERS: u32 = 0;
const RESPONSE_HEADERS: u32 = 2;
const RECEIVED_REQUEST_BODY: u32 = 0;
const BUFFERED_REQUEST_BODY: u32 = 1;
const CONTINUE: u32 = 0;
/// Headers: stop iteration; body: stop iteration and buffer (both 1).
const STOP: u32 = 1;

mod raw {
    use super::{Buf, EnvoyFilter, Pair};
    use std::ffi::c_void;
    extern "C" {
        pub fn envoy_dynamic_module_callback_http_get_headers_size(
            f: EnvoyFilter,
            map: u32,
        ) -> usize;
        pub fn envoy_dynamic_module_callback_http_get_headers(
            f: EnvoyFilter,
            map: u32,
            out: *mut Pair,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_http_set_header(
            f: EnvoyFilter,
            map: u32,
            key: Buf,
            value: Buf,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_http_add_header(
            f: EnvoyFilter,
            map: u32,
            key: Buf,
            value: Buf,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_http_clear_route_cache(f: EnvoyFilter);
        pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
            f: EnvoyFilter,
            body: u32,
        ) -> usize;
        pub fn envoy_dynamic_module_callback_http_get_body_chunks(
            f: EnvoyFilter,
            body: u32,
            out: *mut Buf,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
            config: *mut c_void,
            name: Buf,
            labels: *const Buf,
            labels_len: usize,
            id: *mut usize,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
            config: *mut c_void,
            name: Buf,
            labels: *const Buf,
            labels_len: usize,
            id: *mut usize,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
            config: *mut c_void,
            id: usize,
            labels: *const Buf,
            labels_len: usize,
            by: u64,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
            config: *mut c_void,
            id: usize,
            labels: *const Buf,
            labels_len: usize,
            by: u64,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
            config: *mut c_void,
            id: usize,
            labels: *const Buf,
            labels_len: usize,
            by: u64,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
            config: *mut c_void,
            id: usize,
            labels: *const Buf,
            labels_len: usize,
            value: u64,
        ) -> u32;
        pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
            config: *mut c_void,
        ) -> *mut c_void;
        pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
            scheduler: *mut c_void,
            event: u64,
        );
        pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
            scheduler: *mut c_void,
        );
        pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
            config: *mut c_void,
            id: *mut u64,
            cluster: Buf,
            headers: *const Pair,
            headers_len: usize,
            body: Buf,
            timeout_ms: u64,
        ) -> u32;
        /// Appends `data` to the body `body` (0 received / 1 buffered request body); false
        /// when that body does not exist.
        pub fn envoy_dynamic_module_callback_http_append_body(
            f: EnvoyFilter,
            body: u32,
            data: Buf,
        ) -> bool;
        /// Drains up to `n` bytes from the front of the body `body`.
        pub fn envoy_dynamic_module_callback_http_drain_body(
            f: EnvoyFilter,
            body: u32,
            n: usize,
        ) -> bool;
        pub fn envoy_dynamic_module_callback_http_send_response(
            f: EnvoyFilter,
            status: u32,
            headers: *const Pair,
            headers_len: usize,
            body: Buf,
            details: Buf,
        );
    }
}

/// Envoy has no timer for HTTP-filter modules: a thread of ours sleeps a tick and commits an
/// event to the config's scheduler, which Envoy runs as `on_http_filter_config_scheduled` on its
/// main thread (committing is safe from any thread; an HTTP call is not, so the calls start
/// there).
struct Timer {
    scheduler: SendPtr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Envoy's scheduler handle, which Envoy lets any thread commit to.
#[derive(Clone, Copy)]
struct SendPtr(*mut c_void);
// SAFETY: the scheduler is only committed to (thread-safe in Envoy) and deleted after the timer
// thread has been joined.
unsafe impl Send for SendPtr {}

impl Timer {
    fn start(config: *mut c_void) -> Option<Timer> {
        // SAFETY: Envoy's config pointer during `on_http_filter_config_new`.
        let scheduler =
            unsafe { raw::envoy_dynamic_module_callback_http_filter_config_scheduler_new(config) };
        if scheduler.is_null() {
            return None;
        }
        let ptr = SendPtr(scheduler);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("prefix-router-tick".into())
            .spawn(move || {
                let p = ptr;
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    // SAFETY: the scheduler outlives this thread (joined before the delete).
                    unsafe {
                        raw::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                            p.0, 1,
                        )
                    };
                }
            })
            .ok();
        Some(Timer {
            scheduler: ptr,
            stop,
            thread,
        })
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // SAFETY: no commit can follow: the only committer has been joined.
        unsafe {
            raw::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.scheduler.0)
        };
    }
}

/// A metric defined for a config: its name, kind and Envoy's id (0: Envoy refused it).
type Defined = (String, MetricKind, usize);

/// A filter config: its JSON (every thread's [`Root`] parses it again, as each Wasm VM does), a
/// process-unique id naming it in the threads' root lists (a freed config's address can be
/// reused by the next one; its id cannot), Envoy's config pointer and the metrics defined for
/// it.
struct ModuleConfig {
    id: u64,
    json: Vec<u8>,
    envoy: *mut c_void,
    /// The main thread's timer (load polls need one; absent when polling is off). Only held:
    /// dropping it with the config stops it.
    _timer: Option<Timer>,
    /// (name, kind, Envoy's id); a metric's id in [`Host`] is its position plus one. Written
    /// only in `on_http_filter_config_new` (Envoy allows defining metrics only there), read
    /// from every worker thread afterwards.
    metrics: Vec<Defined>,
}

/// The config-level metric calls: define (name, no labels, id out) and update (id, no labels,
/// amount).
type DefineFn = unsafe extern "C" fn(*mut c_void, Buf, *const Buf, usize, *mut usize) -> u32;
type UpdateFn = unsafe extern "C" fn(*mut c_void, usize, *const Buf, usize, u64) -> u32;

/// Defines a metric while the config is being created (main thread); 0 when Envoy refused.
fn define(envoy: *mut c_void, kind: MetricKind, name: &str) -> usize {
    let f: DefineFn = match kind {
        MetricKind::Counter => raw::envoy_dynamic_module_callback_http_filter_config_define_counter,
        MetricKind::Gauge => raw::envoy_dynamic_module_callback_http_filter_config_define_gauge,
    };
    let mut id = 0usize;
    // SAFETY: Envoy's config pointer during `on_http_filter_config_new`; no labels.
    let rc = unsafe {
        f(
            envoy,
            Buf::of(name.as_bytes()),
            std::ptr::null(),
            0,
            &mut id,
        )
    };
    if rc == 0 {
        id
    } else {
        0
    }
}

/// Ticks of a thread's root are run lazily, at stream starts at least this far apart (what the
/// Wasm build's timer does every 50 ms).
const TICK: Duration = Duration::from_millis(50);
/// Roots a thread keeps (configs replaced by updates leave theirs behind; the oldest goes).
const ROOTS_PER_THREAD: usize = 4;

struct ThreadRoot {
    config: u64,
    root: Root,
    last_tick: Instant,
}

thread_local! {
    static ROOTS: RefCell<Vec<ThreadRoot>> = const { RefCell::new(Vec::new()) };
}

/// [`Host`] over one stream's Envoy pointer (NULL outside a stream) and its config.
struct Native<'a> {
    filter: EnvoyFilter,
    json: &'a [u8],
    /// Envoy's config pointer (metrics are incremented on the config, from any thread).
    config: *mut c_void,
    metrics: &'a [Defined],
    /// Set only while the config is created: metric definitions go to Envoy and land here.
    defining: Option<&'a RefCell<Vec<Defined>>>,
    /// On Envoy's main thread (the timer and call hooks): the only place HTTP calls start.
    main: bool,
    /// The answer of the HTTP call being delivered: its headers and body chunks.
    call_headers: &'a [Pair],
    call_body: &'a [Buf],
}

impl<'a> Native<'a> {
    fn new(filter: EnvoyFilter, c: &'a ModuleConfig) -> Native<'a> {
        Native {
            filter,
            json: &c.json,
            config: c.envoy,
            metrics: &c.metrics,
            defining: None,
            main: false,
            call_headers: &[],
            call_body: &[],
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
}

impl Native<'_> {
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
            let n = raw::envoy_dynamic_module_callback_http_get_headers_size(self.filter, m);
            let mut pairs = vec![
                Pair {
                    key: Buf::NULL,
                    value: Buf::NULL
                };
                n
            ];
            if n == 0
                || !raw::envoy_dynamic_module_callback_http_get_headers(
                    self.filter,
                    m,
                    pairs.as_mut_ptr(),
                )
            {
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
                raw::envoy_dynamic_module_callback_http_add_header(self.filter, m, key, value);
            } else {
                raw::envoy_dynamic_module_callback_http_set_header(self.filter, m, key, value);
            }
            if m == REQUEST_HEADERS {
                // The route may match on this header, and Envoy keeps the route it picked
                // before the filter ran unless told otherwise.
                raw::envoy_dynamic_module_callback_http_clear_route_cache(self.filter);
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
                let n = raw::envoy_dynamic_module_callback_http_get_body_chunks_size(
                    self.filter,
                    which,
                );
                if n == 0 {
                    continue;
                }
                let mut chunks = vec![Buf::NULL; n];
                if !raw::envoy_dynamic_module_callback_http_get_body_chunks(
                    self.filter,
                    which,
                    chunks.as_mut_ptr(),
                ) {
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

impl Store for Native<'_> {
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

impl Host for Native<'_> {
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
            let buffered = raw::envoy_dynamic_module_callback_http_get_body_chunks_size(
                self.filter,
                BUFFERED_REQUEST_BODY,
            ) > 0;
            for b in [BUFFERED_REQUEST_BODY, RECEIVED_REQUEST_BODY] {
                raw::envoy_dynamic_module_callback_http_drain_body(self.filter, b, usize::MAX);
            }
            let target = if buffered {
                BUFFERED_REQUEST_BODY
            } else {
                RECEIVED_REQUEST_BODY
            };
            if !raw::envoy_dynamic_module_callback_http_append_body(
                self.filter,
                target,
                Buf::of(data),
            ) {
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
        m.push((name.to_string(), kind, define(self.config, kind, name)));
        m.len() as u32
    }
    fn increment_metric(&self, id: u32, by: i64) {
        self.metric(id, |kind, envoy_id| {
            let f: UpdateFn = match (kind, by >= 0) {
                (MetricKind::Counter, true) => {
                    raw::envoy_dynamic_module_callback_http_filter_config_increment_counter
                }
                (MetricKind::Counter, false) => return, // counters only go up
                (MetricKind::Gauge, true) => {
                    raw::envoy_dynamic_module_callback_http_filter_config_increment_gauge
                }
                (MetricKind::Gauge, false) => {
                    raw::envoy_dynamic_module_callback_http_filter_config_decrement_gauge
                }
            };
            self.update(f, envoy_id, by.unsigned_abs());
        });
    }
    fn record_metric(&self, id: u32, value: u64) {
        self.metric(id, |kind, envoy_id| {
            if kind == MetricKind::Gauge {
                self.update(
                    raw::envoy_dynamic_module_callback_http_filter_config_set_gauge,
                    envoy_id,
                    value,
                );
            }
        });
    }
    fn local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.local_reply_details(status, "prefix_router", headers, body);
    }
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
        // SAFETY: a live stream pointer; every buffer outlives the call (Envoy copies them).
        unsafe {
            raw::envoy_dynamic_module_callback_http_send_response(
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
            raw::envoy_dynamic_module_callback_http_filter_config_http_callout(
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

/// Runs `f` with this thread's root of `config` (created, configured and ticked as needed;
/// `tick` forces a tick: the timer's event).
fn with_root<R>(
    config: &ModuleConfig,
    h: &Native,
    tick: bool,
    f: impl FnOnce(&mut Root) -> R,
) -> R {
    ROOTS.with(|roots| {
        let mut roots = roots.borrow_mut();
        let i = match roots.iter().position(|r| r.config == config.id) {
            Some(i) => i,
            None => {
                if roots.len() >= ROOTS_PER_THREAD {
                    roots.remove(0);
                }
                let mut root = Root::new();
                root.on_configure(h, config.json.len());
                roots.push(ThreadRoot {
                    config: config.id,
                    root,
                    last_tick: Instant::now(),
                });
                roots.len() - 1
            }
        };
        let Some(tr) = roots.get_mut(i) else {
            let mut root = Root::new();
            return f(&mut root);
        };
        if tick || tr.last_tick.elapsed() >= TICK {
            tr.last_tick = Instant::now();
            tr.root.on_tick(h);
        }
        f(&mut tr.root)
    })
}

/// One stream: its glue state and its config.
struct Filter {
    config: *const ModuleConfig,
    stream: Option<Stream>,
}

/// Runs `f` on the stream behind `m` with a host over `envoy`.
///
/// # Safety
/// `m` is a pointer [`envoy_dynamic_module_on_http_filter_new`] returned and Envoy has not
/// destroyed yet; Envoy never runs two hooks of one stream at once.
unsafe fn with_stream<R>(
    envoy: EnvoyFilter,
    m: ModuleFilter,
    default: R,
    f: impl FnOnce(&mut Stream, &Native) -> R,
) -> R {
    let Some(filter) = (m as *mut Filter).as_mut() else {
        return default;
    };
    let Some(config) = filter.config.as_ref() else {
        return default;
    };
    let h = Native::new(envoy, config);
    match filter.stream.as_mut() {
        Some(s) => f(s, &h),
        None => default,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}

/// A new filter config (main thread): validated here, so a bad one fails Envoy's config load
/// (NULL) instead of every stream.
///
/// # Safety
/// `value` is Envoy's buffer, valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: *mut c_void,
    _name: Buf,
    value: Buf,
) -> *const c_void {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let json = value.bytes().to_vec();
    let cfg = match Config::from_json(&json) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("prefix-router: {e}");
            return std::ptr::null();
        }
    };
    // The glue defines its metrics when a root is configured; Envoy allows that only now, so a
    // root configured here defines them all, and the worker threads' roots find them by name.
    let defined = RefCell::new(Vec::new());
    let h = Native {
        filter: std::ptr::null_mut(),
        json: &json,
        config: envoy,
        metrics: &[],
        defining: Some(&defined),
        main: true,
        call_headers: &[],
        call_body: &[],
    };
    if !Root::new().on_configure(&h, json.len()) {
        return std::ptr::null();
    }
    let timer = if cfg.load_poll.interval_ms > 0 {
        match Timer::start(envoy) {
            Some(t) => Some(t),
            None => {
                eprintln!("prefix-router: load_poll: Envoy gave no scheduler for the poll timer");
                return std::ptr::null();
            }
        }
    } else {
        None
    };
    let c = ModuleConfig {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        json,
        envoy,
        _timer: timer,
        metrics: defined.into_inner(),
    };
    Box::into_raw(Box::new(c)) as *const c_void
}

/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`]; Envoy destroys it once,
/// after its last stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    if !config.is_null() {
        let c = Box::from_raw(config as *mut ModuleConfig);
        // The main thread's root of this config (the timer's and the calls'): gone with it.
        ROOTS.with(|r| r.borrow_mut().retain(|t| t.config != c.id));
        drop(c); // stops and joins the timer thread, then deletes the scheduler
    }
}

/// A new stream (worker thread). Never NULL: Envoy would close the stream.
///
/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`] and is alive.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    envoy: EnvoyFilter,
) -> ModuleFilter {
    let c = config as *const ModuleConfig;
    let stream = match c.as_ref() {
        Some(cfg) => with_root(cfg, &Native::new(envoy, cfg), false, |r| r.new_stream()),
        None => None,
    };
    Box::into_raw(Box::new(Filter { config: c, stream })) as ModuleFilter
}

/// # Safety
/// `m` came from [`envoy_dynamic_module_on_http_filter_new`]; Envoy destroys it once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(m: ModuleFilter) {
    if m.is_null() {
        return;
    }
    let mut filter = Box::from_raw(m as *mut Filter);
    // Released at stream completion; a stream destroyed without it releases here (once: the
    // stream is taken).
    if let (Some(mut s), Some(config)) = (filter.stream.take(), filter.config.as_ref()) {
        s.on_done(&Native::new(std::ptr::null_mut(), config));
    }
}

/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    status(with_stream(f, m, Action::Continue, |s, h| {
        s.on_request_headers(h, end_of_stream)
    }))
}

/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    status(with_stream(f, m, Action::Continue, |s, h| {
        // The glue reads the body through `Host::buffer`, which gathers Envoy's chunks up to
        // this bound (the body itself is bounded by the listener's buffer limit).
        s.on_request_body(h, usize::MAX, end_of_stream)
    }))
}

/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    f: EnvoyFilter,
    m: ModuleFilter,
    _end_of_stream: bool,
) -> u32 {
    status(with_stream(f, m, Action::Continue, |s, h| {
        s.on_response_headers(h)
    }))
}

/// The stream ended, whichever way: its charge is released (once: the stream is taken).
///
/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    f: EnvoyFilter,
    m: ModuleFilter,
) {
    let Some(filter) = (m as *mut Filter).as_mut() else {
        return;
    };
    if let (Some(mut s), Some(config)) = (filter.stream.take(), filter.config.as_ref()) {
        s.on_done(&Native::new(f, config));
    }
}

/// The timer's event (main thread): this thread's root ticks (load polls start here).
///
/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`] and is alive.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: *mut c_void,
    config: *const c_void,
    _event: u64,
) {
    if let Some(c) = (config as *const ModuleConfig).as_ref() {
        let h = Native {
            main: true,
            ..Native::new(std::ptr::null_mut(), c)
        };
        with_root(c, &h, true, |_| ());
    }
}

/// The answer to a call the main thread's root made (main thread).
///
/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`] and is alive; the
/// arrays hold the given numbers of entries (or are NULL), valid during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _envoy: *mut c_void,
    config: *const c_void,
    id: u64,
    _result: u32,
    headers: *const Pair,
    headers_len: usize,
    chunks: *const Buf,
    chunks_len: usize,
) {
    let Some(c) = (config as *const ModuleConfig).as_ref() else {
        return;
    };
    let (headers, body) = (parts(headers, headers_len), parts(chunks, chunks_len));
    let h = Native {
        main: true,
        call_headers: headers,
        call_body: body,
        ..Native::new(std::ptr::null_mut(), c)
    };
    // A failed call (reset) has no headers: the glue counts it as a failed poll.
    let size = body.iter().map(|b| b.len).sum();
    with_root(c, &h, false, |r| {
        r.on_http_call_response(&h, id as u32, size)
    });
}

/// `n` entries at `p` (none when NULL).
///
/// # Safety
/// `p` is NULL or points at `n` initialized entries that outlive `'a`.
unsafe fn parts<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 || p.is_null() {
        &[]
    } else {
        std::slice::from_raw_parts(p, n)
    }
}

fn status(a: Action) -> u32 {
    match a {
        Action::Continue => CONTINUE,
        Action::Pause => STOP,
    }
}

// Hooks Envoy 1.40 requires of every HTTP filter module; nothing to do there (a response body
// chunk costs one native call that returns at once).

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _f: EnvoyFilter,
    _m: ModuleFilter,
) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _end_of_stream: bool,
) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _f: EnvoyFilter,
    _m: ModuleFilter,
) -> u32 {
    CONTINUE
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _id: u64,
    _result: u32,
    _headers: *const c_void,
    _headers_len: usize,
    _chunks: *const Buf,
    _chunks_len: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _stream: u64,
    _headers: *const c_void,
    _headers_len: usize,
    _end_of_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _stream: u64,
    _data: *const Buf,
    _data_len: usize,
    _end_of_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _stream: u64,
    _trailers: *const c_void,
    _trailers_len: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _stream: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _stream: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _event: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _f: EnvoyFilter,
    _m: ModuleFilter,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _f: EnvoyFilter,
    _m: ModuleFilter,
) {
}
