//! A fake Envoy for the native layer's unit tests: an [`Abi`] table whose stream, config and
//! scheduler pointers all point at one [`FakeEnvoy`], holding a stream's header maps and body
//! buffers, the config's metrics, callouts and scheduler, and a record of what the module did.
//!
//! Like Envoy, it hands out pointers into its own memory (valid until the map or body changes)
//! and copies whatever the module passes in. `panic_in` makes one callback panic, to test the
//! hooks' panic guard with a panic raised inside a glue call (once: the guard's own
//! counter update and local reply then go through).

use super::ffi::{Abi, Buf, EnvoyFilter, Pair};
use crate::host::MetricKind;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One header map: (key, value) bytes in order.
pub(crate) type Headers = Vec<(Vec<u8>, Vec<u8>)>;

#[derive(Default)]
pub(crate) struct FakeEnvoy {
    pub(crate) state: Mutex<FakeState>,
    /// Scheduler commits (the timer thread's only call).
    pub(crate) commits: AtomicU64,
}

/// A local reply: status, headers, body, details.
pub(crate) type Sent = (u32, Vec<(String, String)>, Vec<u8>, String);

/// A callout: Envoy's id, cluster, headers, body, timeout.
pub(crate) type Callout = (u64, String, Vec<(String, String)>, Vec<u8>, u64);

#[derive(Default)]
pub(crate) struct FakeState {
    pub(crate) request_headers: Headers,
    pub(crate) response_headers: Headers,
    /// Body types 0 (the chunk just received) and 1 (the buffered body), as chunks.
    pub(crate) received: Vec<Vec<u8>>,
    pub(crate) buffered: Vec<Vec<u8>>,
    /// Every callback made, by name, in order.
    pub(crate) log: Vec<&'static str>,
    pub(crate) replies: Vec<Sent>,
    /// Defined metrics (Envoy's id is the position plus one) and their values by id.
    pub(crate) defined: Vec<(String, MetricKind)>,
    pub(crate) values: HashMap<usize, i64>,
    pub(crate) callouts: Vec<Callout>,
    /// What the callout and define callbacks answer (0: ok).
    pub(crate) callout_rc: u32,
    pub(crate) define_rc: u32,
    /// `get_headers` / `append_body` answer false; `scheduler_new` answers NULL.
    pub(crate) headers_fail: bool,
    pub(crate) append_fails: bool,
    /// String attributes by ABI id (`get_attribute_string`).
    pub(crate) attributes: Vec<(u32, Vec<u8>)>,
    pub(crate) no_scheduler: bool,
    pub(crate) schedulers: u32,
    pub(crate) schedulers_deleted: u32,
    /// `send_response` panics after it took the reply (once).
    pub(crate) panic_after_reply: bool,
    /// The callback (by name) whose next call panics (once).
    pub(crate) panic_in: Option<&'static str>,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn owned_pairs(p: *const Pair, n: usize) -> Vec<(String, String)> {
    if p.is_null() || n == 0 {
        return Vec::new();
    }
    // SAFETY: the module passes `n` pairs of readable buffers for the call.
    unsafe { std::slice::from_raw_parts(p, n) }
        .iter()
        .map(|p| unsafe { (text(p.key.bytes()), text(p.value.bytes())) })
        .collect()
}

impl FakeEnvoy {
    pub(crate) fn new() -> Self {
        Self::default()
    }
    /// The pointer Envoy would pass as the stream, the config and the scheduler.
    pub(crate) fn ptr(&self) -> *mut c_void {
        self as *const FakeEnvoy as *mut c_void
    }
    pub(crate) fn state(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// A request (`:method`, `:path`, then `extra`) and its body in one received chunk.
    pub(crate) fn request(&self, method: &str, path: &str, extra: &[(&str, &str)], body: &[u8]) {
        let mut s = self.state();
        s.request_headers = [(":method", method), (":path", path)]
            .iter()
            .chain(extra)
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect();
        s.received = if body.is_empty() {
            Vec::new()
        } else {
            vec![body.to_vec()]
        };
        s.buffered.clear();
    }
    /// Every value of request header `name`.
    pub(crate) fn request_header(&self, name: &str) -> Vec<String> {
        let s = self.state();
        s.request_headers
            .iter()
            .filter(|(k, _)| k == name.as_bytes())
            .map(|(_, v)| text(v))
            .collect()
    }
    /// A metric's value by its defined name (None: never defined or never updated).
    pub(crate) fn metric(&self, name: &str) -> Option<i64> {
        let s = self.state();
        let id = s.defined.iter().position(|(n, _)| n == name)? + 1;
        s.values.get(&id).copied()
    }
    /// How often callback `name` was made.
    pub(crate) fn count(&self, name: &str) -> usize {
        self.state().log.iter().filter(|n| **n == name).count()
    }

    /// Logs the callback, then panics if it is the one chosen (once; the lock released first, so
    /// the fake stays readable after the panic).
    fn enter<'a>(p: *mut c_void, name: &'static str) -> MutexGuard<'a, FakeState> {
        // SAFETY: every pointer the module passes back is a `FakeEnvoy::ptr` of a live fake.
        let me = unsafe { &*(p as *const FakeEnvoy) };
        let mut s = me.state();
        s.log.push(name);
        if s.panic_in == Some(name) {
            s.panic_in = None;
            drop(s);
            panic!("fake Envoy: a panic in {name}");
        }
        s
    }
}

impl FakeState {
    fn map(&mut self, map: u32) -> &mut Headers {
        match map {
            0 => &mut self.request_headers,
            2 => &mut self.response_headers,
            m => panic!("fake Envoy: header map {m} is not one the module uses"),
        }
    }
    fn body(&mut self, body: u32) -> &mut Vec<Vec<u8>> {
        match body {
            0 => &mut self.received,
            1 => &mut self.buffered,
            b => panic!("fake Envoy: body {b} is not one the module uses"),
        }
    }
    fn update(&mut self, id: usize, f: impl FnOnce(&mut i64)) -> u32 {
        if id == 0 || id > self.defined.len() {
            return 1;
        }
        f(self.values.entry(id).or_default());
        0
    }
    fn define(&mut self, name: Buf, kind: MetricKind, id: *mut usize) -> u32 {
        if self.define_rc != 0 {
            return self.define_rc;
        }
        // SAFETY: the module's name buffer, readable for the call.
        self.defined.push((text(unsafe { name.bytes() }), kind));
        // SAFETY: the module's out-pointer.
        unsafe { *id = self.defined.len() };
        0
    }
}

impl Abi for FakeEnvoy {
    unsafe fn get_headers_size(f: EnvoyFilter, map: u32) -> usize {
        FakeEnvoy::enter(f, "get_headers_size").map(map).len()
    }
    unsafe fn get_headers(f: EnvoyFilter, map: u32, out: *mut Pair) -> bool {
        let mut s = FakeEnvoy::enter(f, "get_headers");
        if s.headers_fail {
            return false;
        }
        for (i, (k, v)) in s.map(map).iter().enumerate() {
            *out.add(i) = Pair {
                key: Buf::of(k),
                value: Buf::of(v),
            };
        }
        true
    }
    unsafe fn set_header(f: EnvoyFilter, map: u32, key: Buf, value: Buf) -> bool {
        let mut s = FakeEnvoy::enter(f, "set_header");
        let (k, v) = (key.bytes().to_vec(), value.bytes());
        let m = s.map(map);
        m.retain(|(n, _)| *n != k);
        if !v.is_empty() {
            m.push((k, v.to_vec()));
        }
        true
    }
    unsafe fn add_header(f: EnvoyFilter, map: u32, key: Buf, value: Buf) -> bool {
        let mut s = FakeEnvoy::enter(f, "add_header");
        let kv = (key.bytes().to_vec(), value.bytes().to_vec());
        s.map(map).push(kv);
        true
    }
    unsafe fn clear_route_cache(f: EnvoyFilter) {
        drop(FakeEnvoy::enter(f, "clear_route_cache"));
    }
    unsafe fn get_attribute_string(f: EnvoyFilter, attribute: u32, out: *mut Buf) -> bool {
        let s = FakeEnvoy::enter(f, "get_attribute_string");
        match s.attributes.iter().find(|(id, _)| *id == attribute) {
            // The fake's state outlives the hook, as Envoy's bytes do.
            Some((_, v)) => {
                *out = Buf::of(v);
                true
            }
            None => false,
        }
    }
    unsafe fn get_body_chunks_size(f: EnvoyFilter, body: u32) -> usize {
        FakeEnvoy::enter(f, "get_body_chunks_size").body(body).len()
    }
    unsafe fn get_body_chunks(f: EnvoyFilter, body: u32, out: *mut Buf) -> bool {
        let mut s = FakeEnvoy::enter(f, "get_body_chunks");
        for (i, c) in s.body(body).iter().enumerate() {
            *out.add(i) = Buf::of(c);
        }
        true
    }
    unsafe fn append_body(f: EnvoyFilter, body: u32, data: Buf) -> bool {
        let mut s = FakeEnvoy::enter(f, "append_body");
        if s.append_fails {
            return false;
        }
        s.body(body).push(data.bytes().to_vec());
        true
    }
    unsafe fn drain_body(f: EnvoyFilter, body: u32, n: usize) -> bool {
        let mut s = FakeEnvoy::enter(f, "drain_body");
        let chunks = s.body(body);
        let mut left = n;
        while left > 0 && !chunks.is_empty() {
            let c = &mut chunks[0];
            let k = left.min(c.len());
            c.drain(..k);
            left -= k;
            if c.is_empty() {
                chunks.remove(0);
            }
        }
        true
    }
    unsafe fn send_response(
        f: EnvoyFilter,
        status: u32,
        headers: *const Pair,
        headers_len: usize,
        body: Buf,
        details: Buf,
    ) {
        let mut s = FakeEnvoy::enter(f, "send_response");
        let h = owned_pairs(headers, headers_len);
        s.replies
            .push((status, h, body.bytes().to_vec(), text(details.bytes())));
        if std::mem::take(&mut s.panic_after_reply) {
            drop(s);
            panic!("fake Envoy: a panic after send_response");
        }
    }
    unsafe fn define_counter(
        config: *mut c_void,
        name: Buf,
        _labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 {
        assert_eq!(labels_len, 0);
        FakeEnvoy::enter(config, "define_counter").define(name, MetricKind::Counter, id)
    }
    unsafe fn define_gauge(
        config: *mut c_void,
        name: Buf,
        _labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 {
        assert_eq!(labels_len, 0);
        FakeEnvoy::enter(config, "define_gauge").define(name, MetricKind::Gauge, id)
    }
    unsafe fn increment_counter(
        config: *mut c_void,
        id: usize,
        _labels: *const Buf,
        _labels_len: usize,
        by: u64,
    ) -> u32 {
        FakeEnvoy::enter(config, "increment_counter").update(id, |v| *v += by as i64)
    }
    unsafe fn increment_gauge(
        config: *mut c_void,
        id: usize,
        _labels: *const Buf,
        _labels_len: usize,
        by: u64,
    ) -> u32 {
        FakeEnvoy::enter(config, "increment_gauge").update(id, |v| *v += by as i64)
    }
    unsafe fn decrement_gauge(
        config: *mut c_void,
        id: usize,
        _labels: *const Buf,
        _labels_len: usize,
        by: u64,
    ) -> u32 {
        FakeEnvoy::enter(config, "decrement_gauge").update(id, |v| *v -= by as i64)
    }
    unsafe fn set_gauge(
        config: *mut c_void,
        id: usize,
        _labels: *const Buf,
        _labels_len: usize,
        value: u64,
    ) -> u32 {
        FakeEnvoy::enter(config, "set_gauge").update(id, |v| *v = value as i64)
    }
    unsafe fn scheduler_new(config: *mut c_void) -> *mut c_void {
        let mut s = FakeEnvoy::enter(config, "scheduler_new");
        if s.no_scheduler {
            return std::ptr::null_mut();
        }
        s.schedulers += 1;
        config
    }
    /// From the timer thread: touches only the atomic counter (no log, no lock).
    unsafe fn scheduler_commit(scheduler: *mut c_void, _event: u64) {
        let me = &*(scheduler as *const FakeEnvoy);
        me.commits.fetch_add(1, Ordering::Relaxed);
    }
    unsafe fn scheduler_delete(scheduler: *mut c_void) {
        FakeEnvoy::enter(scheduler, "scheduler_delete").schedulers_deleted += 1;
    }
    unsafe fn http_callout(
        config: *mut c_void,
        id: *mut u64,
        cluster: Buf,
        headers: *const Pair,
        headers_len: usize,
        body: Buf,
        timeout_ms: u64,
    ) -> u32 {
        let mut s = FakeEnvoy::enter(config, "http_callout");
        if s.callout_rc != 0 {
            return s.callout_rc;
        }
        let next = s.callouts.len() as u64 + 1;
        *id = next;
        let h = owned_pairs(headers, headers_len);
        s.callouts.push((
            next,
            text(cluster.bytes()),
            h,
            body.bytes().to_vec(),
            timeout_ms,
        ));
        0
    }
}
