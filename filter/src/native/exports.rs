//! The hooks Envoy calls: every `envoy_dynamic_module_on_*` symbol the module exports.
//!
//! Each used hook is a thin `#[no_mangle]` wrapper over a function generic in the [`Abi`] table
//! (so the tests drive the very same code over a fake Envoy); the unused ones come from
//! [`envoy_noop_hooks!`], shared with `benches/dm-floor`.
//!
//! Invariants Envoy gives (and the hooks rely on): a config's hooks run on the main thread; a
//! stream's hooks run on one worker thread, never two at once; `on_http_filter_destroy` comes
//! once per stream after its other hooks; `on_http_filter_config_destroy` once per config, after
//! its last stream. Buffers Envoy passes in are valid during the hook only.
//!
//! Costs per routed request: `on_http_filter_new` (a root lookup, the lazy tick, one `Box`),
//! request headers, request body, response headers, stream complete and destroy: six native
//! calls, each one pointer check and a [`Native`] on the stack before the glue runs.

use super::ffi::{Abi, Buf, Envoy, EnvoyFilter, ModuleFilter, Pair, ABI_VERSION, CONTINUE, STOP};
use super::guard;
use super::host::{define, Native};
use super::roots::{self, with_root, ModuleConfig};
use super::timer::{Timer, TICK};
use crate::config::Config;
use crate::glue::{Action, Root, Stream};
use crate::host::{Host, MetricKind};
use std::cell::RefCell;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

/// One stream: its glue state and its config.
pub(crate) struct Filter {
    config: *const ModuleConfig,
    stream: Option<Stream>,
    /// A hook of this stream panicked (or its creation did): its request hooks fail closed
    /// without entering the glue again.
    failed: bool,
    /// Envoy has been asked to answer this stream locally (by the glue or by the guard).
    answered: bool,
}

/// The answer of a stream whose hook panicked (OpenAI-style, as the glue's own errors).
const FAILED_BODY: &[u8] =
    br#"{"object":"error","message":"prefix-router failed on this request","type":"InternalServerError","code":500}"#;

/// Its response code details (`%RESPONSE_CODE_DETAILS%` in access logs).
const FAILED_DETAILS: &str = "prefix_router_panic";

/// Counts a caught panic on the config's Envoy counter (the process count is the guard's).
fn count_panic<A: Abi>(c: &ModuleConfig) {
    if c.panics != 0 && !c.envoy.is_null() {
        // SAFETY: Envoy's live config pointer; metric updates are allowed from any thread.
        unsafe { A::increment_counter(c.envoy, c.panics, std::ptr::null(), 0, 1) };
    }
}

/// Which request hook runs (a failed stream's answer differs only in what it stops).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Request,
    Response,
}

/// Runs `f` on the stream behind `m` with a host over `envoy`, under the panic guard: a stream
/// without glue state (unconfigured root) continues; a failed stream, or one whose `f` panics,
/// fails closed in the request phase (a local 500 unless one was sent, then stop) and continues
/// in the response phase (the answer, the worker's or ours, must get out).
///
/// # Safety
/// `m` is a pointer [`envoy_dynamic_module_on_http_filter_new`] returned and Envoy has not
/// destroyed yet; Envoy never runs two hooks of one stream at once.
unsafe fn on_stream<A: Abi>(
    hook: &'static str,
    phase: Phase,
    envoy: EnvoyFilter,
    m: ModuleFilter,
    f: impl FnOnce(&mut Stream, &Native<A>) -> Action,
) -> u32 {
    let Some(filter) = (m as *mut Filter).as_mut() else {
        return CONTINUE;
    };
    let Some(config) = filter.config.as_ref() else {
        return CONTINUE;
    };
    let h = Native::new(envoy, config);
    if !filter.failed {
        let Some(stream) = filter.stream.as_mut() else {
            return CONTINUE;
        };
        if let Some(a) = guard::catch(hook, || f(stream, &h)) {
            filter.answered |= h.replied.get();
            return status(a);
        }
        count_panic::<A>(config);
        filter.failed = true;
        filter.answered |= h.replied.get();
    }
    if phase == Phase::Response {
        return CONTINUE;
    }
    if !filter.answered {
        filter.answered = true;
        // Outside the guard: `local_reply` only copies into Envoy (its one allocation, the
        // header array, is on this failure path only).
        h.local_reply_details(
            500,
            FAILED_DETAILS,
            &[("content-type", "application/json")],
            FAILED_BODY,
        );
    }
    STOP
}

/// Ends the stream behind `m` (its load charge released, once: the stream is taken), under the
/// panic guard; a failed stream is ended too, so that what it charged is released.
unsafe fn end_stream<A: Abi>(hook: &'static str, envoy: EnvoyFilter, filter: &mut Filter) {
    if let (Some(mut s), Some(config)) = (filter.stream.take(), filter.config.as_ref()) {
        let h = Native::<A>::new(envoy, config);
        if guard::catch(hook, || s.on_done(&h)).is_none() {
            count_panic::<A>(config);
        }
    }
}

fn status(a: Action) -> u32 {
    match a {
        Action::Continue => CONTINUE,
        Action::Pause => STOP,
    }
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

/// See [`envoy_dynamic_module_on_http_filter_config_new`]. A panic refuses the config (NULL).
pub(crate) unsafe fn config_new<A: Abi>(envoy: *mut c_void, value: Buf) -> *const c_void {
    guard::catch("on_http_filter_config_new", || {
        load_config::<A>(envoy, value)
    })
    .unwrap_or(std::ptr::null())
}

unsafe fn load_config<A: Abi>(envoy: *mut c_void, value: Buf) -> *const c_void {
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
    let h = Native::<A>::defining(envoy, &json, &defined);
    if !Root::new().on_configure(&h, json.len()) {
        return std::ptr::null();
    }
    let panics = define::<A>(envoy, MetricKind::Counter, guard::PANICS_METRIC);
    let timer = if needs_timer(&cfg) {
        match Timer::start::<A>(envoy, TICK) {
            Some(t) => Some(t),
            None => {
                eprintln!("prefix-router: Envoy gave no scheduler for the main thread's timer");
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
        panics,
    };
    Box::into_raw(Box::new(c)) as *const c_void
}

/// Whether `cfg` needs the main thread's timer: only that thread can start calls, and these
/// start from its tick: load polls, pool membership reads (which go on with load polls off) and
/// peer batches (the worker threads' records are relayed to it). A config with none of them
/// costs no thread.
fn needs_timer(cfg: &Config) -> bool {
    let members = cfg.membership.interval_ms > 0 && cfg.models.iter().any(|m| m.pool.is_some());
    let peers = cfg.peers.is_some() && !cfg.peer_listener;
    cfg.load_poll.interval_ms > 0 || members || peers
}

/// See [`envoy_dynamic_module_on_http_filter_config_destroy`]. A panic (in a root's or the
/// timer's drop) leaves what was not freed yet.
pub(crate) unsafe fn config_destroy(config: *const c_void) {
    if !config.is_null() {
        let c = Box::from_raw(config as *mut ModuleConfig);
        guard::catch("on_http_filter_config_destroy", move || {
            // The main thread's root of this config (the timer's and the calls'): gone with it.
            roots::forget(c.id);
            drop(c); // stops and joins the timer thread, then deletes the scheduler
        });
    }
}

/// See [`envoy_dynamic_module_on_http_filter_new`]. A panic gives a failed stream, which
/// answers 500 at its request headers.
pub(crate) unsafe fn filter_new<A: Abi>(config: *const c_void, envoy: EnvoyFilter) -> ModuleFilter {
    let c = config as *const ModuleConfig;
    let (stream, failed) = match c.as_ref() {
        Some(cfg) => {
            let h = Native::<A>::new(envoy, cfg);
            let made = guard::catch("on_http_filter_new", || {
                with_root(cfg, &h, false, |r| r.new_stream())
            });
            let failed = made.is_none();
            if failed {
                count_panic::<A>(cfg);
            }
            (made.flatten(), failed)
        }
        None => (None, false),
    };
    let filter = Filter {
        config: c,
        stream,
        failed,
        answered: false,
    };
    Box::into_raw(Box::new(filter)) as ModuleFilter
}

/// See [`envoy_dynamic_module_on_http_filter_destroy`].
pub(crate) unsafe fn filter_destroy<A: Abi>(m: ModuleFilter) {
    if m.is_null() {
        return;
    }
    let mut filter = Box::from_raw(m as *mut Filter);
    // Released at stream completion; a stream destroyed without it releases here.
    end_stream::<A>("on_http_filter_destroy", std::ptr::null_mut(), &mut filter);
}

pub(crate) unsafe fn request_headers<A: Abi>(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    on_stream::<A>(
        "on_http_filter_request_headers",
        Phase::Request,
        f,
        m,
        |s, h| s.on_request_headers(h, end_of_stream),
    )
}

pub(crate) unsafe fn request_body<A: Abi>(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    on_stream::<A>(
        "on_http_filter_request_body",
        Phase::Request,
        f,
        m,
        // The glue reads the body through `Host::buffer`, which gathers Envoy's chunks up to
        // this bound (the body itself is bounded by the listener's buffer limit).
        |s, h| s.on_request_body(h, usize::MAX, end_of_stream),
    )
}

pub(crate) unsafe fn response_headers<A: Abi>(f: EnvoyFilter, m: ModuleFilter) -> u32 {
    on_stream::<A>(
        "on_http_filter_response_headers",
        Phase::Response,
        f,
        m,
        |s, h| s.on_response_headers(h),
    )
}

pub(crate) unsafe fn stream_complete<A: Abi>(f: EnvoyFilter, m: ModuleFilter) {
    if let Some(filter) = (m as *mut Filter).as_mut() {
        end_stream::<A>("on_http_filter_stream_complete", f, filter);
    }
}

/// A panic drops this tick (the next one comes a tick later).
pub(crate) unsafe fn config_scheduled<A: Abi>(config: *const c_void) {
    if let Some(c) = (config as *const ModuleConfig).as_ref() {
        let h = Native::<A> {
            main: true,
            ..Native::new(std::ptr::null_mut(), c)
        };
        if guard::catch("on_http_filter_config_scheduled", || {
            with_root(c, &h, true, |_| ())
        })
        .is_none()
        {
            count_panic::<A>(c);
        }
    }
}

/// A panic drops this answer (the glue's poll or peer batch then times out as a failed call).
pub(crate) unsafe fn config_callout_done<A: Abi>(
    config: *const c_void,
    id: u64,
    headers: *const Pair,
    headers_len: usize,
    chunks: *const Buf,
    chunks_len: usize,
) {
    let Some(c) = (config as *const ModuleConfig).as_ref() else {
        return;
    };
    let (headers, body) = (parts(headers, headers_len), parts(chunks, chunks_len));
    let h = Native::<A> {
        main: true,
        call_headers: headers,
        call_body: body,
        ..Native::new(std::ptr::null_mut(), c)
    };
    // A failed call (reset) has no headers: the glue counts it as a failed poll.
    let size = body.iter().map(|b| b.len).sum();
    if guard::catch("on_http_filter_config_http_callout_done", || {
        with_root(c, &h, false, |r| {
            r.on_http_call_response(&h, id as u32, size)
        })
    })
    .is_none()
    {
        count_panic::<A>(c);
    }
}

// ---- The exported symbols --------------------------------------------------------------------

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
    config_new::<Envoy>(envoy, value)
}

/// # Safety
/// `config` came from [`envoy_dynamic_module_on_http_filter_config_new`]; Envoy destroys it once,
/// after its last stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    config_destroy(config)
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
    filter_new::<Envoy>(config, envoy)
}

/// # Safety
/// `m` came from [`envoy_dynamic_module_on_http_filter_new`]; Envoy destroys it once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(m: ModuleFilter) {
    filter_destroy::<Envoy>(m)
}

/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    request_headers::<Envoy>(f, m, end_of_stream)
}

/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    request_body::<Envoy>(f, m, end_of_stream)
}

/// # Safety
/// See [`with_stream`].
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    f: EnvoyFilter,
    m: ModuleFilter,
    _end_of_stream: bool,
) -> u32 {
    response_headers::<Envoy>(f, m)
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
    stream_complete::<Envoy>(f, m)
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
    config_scheduled::<Envoy>(config)
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
    config_callout_done::<Envoy>(config, id, headers, headers_len, chunks, chunks_len)
}

envoy_noop_hooks!();

#[cfg(test)]
mod tests {
    use super::super::fake::FakeEnvoy;
    use super::*;

    const WORKERS: [&str; 3] = ["w0", "w1", "w2"];

    /// A config of one model (named per test: the process store is shared by every test).
    fn json(model: &str, extra: &str) -> String {
        format!(
            r#"{{"models":{{"{model}":{{"workers":["w0","w1","w2"]}}}},"load_poll":{{"interval_ms":0}}{extra}}}"#
        )
    }

    fn chat(model: &str, user: &str) -> Vec<u8> {
        format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{user}"}}]}}"#)
            .into_bytes()
    }

    /// A fake Envoy and a config the module made on it; destroys the config (stopping any
    /// timer thread) before the fake goes.
    struct Loaded {
        fake: Box<FakeEnvoy>,
        config: *const c_void,
    }

    impl Loaded {
        fn new(json: &str) -> Loaded {
            let fake = Box::new(FakeEnvoy::new());
            // SAFETY: the fake outlives the config (`Drop`).
            let config = unsafe { config_new::<FakeEnvoy>(fake.ptr(), Buf::of(json.as_bytes())) };
            assert!(!config.is_null(), "refused: {json}");
            Loaded { fake, config }
        }
        fn stream(&self) -> ModuleFilter {
            // SAFETY: a live config.
            unsafe { filter_new::<FakeEnvoy>(self.config, self.fake.ptr()) }
        }
        fn f(&self) -> EnvoyFilter {
            self.fake.ptr()
        }
        /// The sum of metrics whose names start with `prefix`.
        fn sum(&self, prefix: &str) -> i64 {
            let s = self.fake.state();
            let ids = s.defined.iter().enumerate();
            ids.filter(|(_, (n, _))| n.starts_with(prefix))
                .map(|(i, _)| s.values.get(&(i + 1)).copied().unwrap_or(0))
                .sum()
        }
    }

    impl Drop for Loaded {
        fn drop(&mut self) {
            // SAFETY: made by `config_new`, destroyed once.
            unsafe { config_destroy(self.config) };
        }
    }

    #[test]
    fn a_bad_config_fails_the_load_and_a_good_one_defines_every_metric_then() {
        let fake = FakeEnvoy::new();
        for bad in [&b"{"[..], br#"{"models":{},"nope":1}"#, b""] {
            // SAFETY: the fake is alive; no config is made.
            let c = unsafe { config_new::<FakeEnvoy>(fake.ptr(), Buf::of(bad)) };
            assert!(c.is_null());
        }
        assert!(fake.state().defined.is_empty());
        let l = Loaded::new(&json("m-load", ""));
        let defined = l.fake.state().defined.clone();
        let names: Vec<&str> = defined.iter().map(|d| d.0.as_str()).collect();
        assert!(
            names.contains(&"prefix_router.requests.prefix_hit"),
            "{names:?}"
        );
        for w in WORKERS {
            assert!(names.contains(&format!("prefix_router.inflight_requests.{w}").as_str()));
        }
        // SAFETY: a live config.
        let c = unsafe { &*(l.config as *const ModuleConfig) };
        // The glue's metrics, then the module's panic counter (not the glue's to update).
        assert_eq!(c.metrics.len() + 1, defined.len());
        assert_eq!(names.last(), Some(&guard::PANICS_METRIC));
        assert_eq!(c.panics, defined.len());
        assert!(c._timer.is_none(), "polling off: no timer thread");
        assert_eq!(l.fake.count("scheduler_new"), 0);
    }

    #[test]
    fn a_request_is_routed_through_the_hooks_and_released_once_at_its_end() {
        let l = Loaded::new(&json("m-route", ""));
        let body = chat("m-route", "hello");
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[("x-prefix-router-cluster", "spoofed")],
            &body,
        );
        let m = l.stream();
        assert!(!m.is_null());
        let f = l.f();
        // SAFETY: `m` is a live stream of the fake, hooks in Envoy's order.
        unsafe {
            assert_eq!(request_headers::<FakeEnvoy>(f, m, false), STOP);
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), CONTINUE);
        }
        let cluster = l.fake.request_header("x-prefix-router-cluster");
        assert_eq!(cluster.len(), 1, "{cluster:?}");
        assert!(WORKERS.contains(&cluster[0].as_str()), "{cluster:?}");
        assert!(l.fake.count("clear_route_cache") >= 1);
        assert_eq!(l.sum("prefix_router.inflight_requests."), 1);
        // SAFETY: as above.
        unsafe {
            l.fake.state().response_headers = vec![(b":status".to_vec(), b"200".to_vec())];
            assert_eq!(response_headers::<FakeEnvoy>(f, m), CONTINUE);
            stream_complete::<FakeEnvoy>(f, m);
            assert_eq!(l.sum("prefix_router.inflight_requests."), 0);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(
            l.sum("prefix_router.inflight_requests."),
            0,
            "released once"
        );
        assert_eq!(l.sum("prefix_router.requests."), 1);
        assert!(l.fake.state().replies.is_empty());
    }

    #[test]
    fn a_stream_destroyed_without_completing_is_released_at_destroy() {
        let l = Loaded::new(&json("m-destroy", ""));
        l.fake
            .request("POST", "/v1/chat/completions", &[], &chat("m-destroy", "x"));
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream of the fake.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            request_body::<FakeEnvoy>(f, m, true);
            assert_eq!(l.sum("prefix_router.inflight_requests."), 1);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(l.sum("prefix_router.inflight_requests."), 0);
    }

    #[test]
    fn a_filter_answers_locally_through_envoys_send_response() {
        let l = Loaded::new(&json("m-reply", r#","unknown_model":"reject""#));
        l.fake
            .request("POST", "/v1/chat/completions", &[], &chat("nobody", "x"));
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream of the fake.
        let st = unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            let st = request_body::<FakeEnvoy>(f, m, true);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
            st
        };
        assert_eq!(st, STOP);
        let replies = l.fake.state().replies.clone();
        assert_eq!(replies.len(), 1, "{replies:?}");
        let (status, headers, body, details) = &replies[0];
        assert_eq!(*status, 404);
        assert!(
            headers.iter().any(|(k, _)| k == "content-type"),
            "{headers:?}"
        );
        assert!(body.starts_with(b"{"), "{body:?}");
        assert_eq!(details, "prefix_router");
        assert!(l.fake.request_header("x-prefix-router-cluster").is_empty());
    }

    #[test]
    fn hooks_with_null_pointers_continue_and_touch_nothing() {
        let fake = FakeEnvoy::new();
        // SAFETY: NULL is what the hooks guard against.
        unsafe {
            let null = std::ptr::null();
            let m = filter_new::<FakeEnvoy>(null, fake.ptr());
            assert!(!m.is_null(), "never NULL: Envoy would close the stream");
            assert_eq!(request_headers::<FakeEnvoy>(fake.ptr(), m, false), CONTINUE);
            assert_eq!(request_body::<FakeEnvoy>(fake.ptr(), m, true), CONTINUE);
            assert_eq!(response_headers::<FakeEnvoy>(fake.ptr(), m), CONTINUE);
            stream_complete::<FakeEnvoy>(fake.ptr(), m);
            filter_destroy::<FakeEnvoy>(m);
            assert_eq!(
                request_headers::<FakeEnvoy>(fake.ptr(), null, true),
                CONTINUE
            );
            stream_complete::<FakeEnvoy>(fake.ptr(), null);
            filter_destroy::<FakeEnvoy>(null);
            config_scheduled::<FakeEnvoy>(null);
            config_callout_done::<FakeEnvoy>(null, 1, std::ptr::null(), 3, std::ptr::null(), 2);
            config_destroy(null);
        }
        assert!(fake.state().log.is_empty());
    }

    /// The module's own panic counter of `l`'s config, as Envoy holds it.
    fn panics(l: &Loaded) -> i64 {
        l.fake.metric(guard::PANICS_METRIC).unwrap_or(0)
    }

    #[test]
    fn a_panic_in_a_glue_call_at_request_headers_fails_the_request_closed() {
        let l = Loaded::new(&json("m-panic-headers", ""));
        assert!(l
            .fake
            .state()
            .defined
            .iter()
            .any(|d| d.0 == guard::PANICS_METRIC));
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-headers", "x"),
        );
        let (f, m) = (l.f(), l.stream());
        // The glue's first act at request headers is reading the header map: it panics there.
        l.fake.state().panic_in = Some("get_headers_size");
        let before = guard::CAUGHT.load(Ordering::Relaxed);
        // SAFETY: a live stream of the fake.
        unsafe {
            assert_eq!(request_headers::<FakeEnvoy>(f, m, false), STOP);
            assert!(guard::CAUGHT.load(Ordering::Relaxed) > before);
            assert_eq!(panics(&l), 1);
            let replies = l.fake.state().replies.clone();
            assert_eq!(replies.len(), 1);
            assert_eq!(replies[0].0, 500);
            assert_eq!(replies[0].2, FAILED_BODY);
            assert_eq!(replies[0].3, FAILED_DETAILS);
            // The stream stays failed once Envoy behaves again: no glue, no second answer.
            let calls = l.fake.state().log.len();
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), STOP);
            assert_eq!(l.fake.state().replies.len(), 1);
            // Our 500 goes out through the response hooks untouched.
            assert_eq!(response_headers::<FakeEnvoy>(f, m), CONTINUE);
            assert_eq!(l.fake.state().log.len(), calls, "no glue after the panic");
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert!(l.fake.request_header("x-prefix-router-cluster").is_empty());
        assert_eq!(panics(&l), 1);
        assert_eq!(l.sum("prefix_router.inflight_requests."), 0);
    }

    #[test]
    fn a_panic_while_the_body_is_read_fails_the_request_closed_and_charges_nothing() {
        let l = Loaded::new(&json("m-panic-body", ""));
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-body", "x"),
        );
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream of the fake.
        unsafe {
            assert_eq!(request_headers::<FakeEnvoy>(f, m, false), STOP);
            l.fake.state().panic_in = Some("get_body_chunks");
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), STOP);
            assert_eq!(l.fake.state().replies.len(), 1);
            assert_eq!(l.fake.state().replies[0].0, 500);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(panics(&l), 1);
        assert!(l.fake.request_header("x-prefix-router-cluster").is_empty());
        assert_eq!(l.sum("prefix_router.inflight_requests."), 0);
        assert_eq!(l.sum("prefix_router.requests."), 0, "no decision was made");
    }

    #[test]
    fn a_panic_after_the_glue_answered_sends_no_second_answer() {
        let l = Loaded::new(&json("m-panic-reply", r#","unknown_model":"reject""#));
        l.fake
            .request("POST", "/v1/chat/completions", &[], &chat("nobody", "x"));
        let (f, m) = (l.f(), l.stream());
        // The glue answers 404; the panic comes right after Envoy took the answer.
        // SAFETY: a live stream of the fake.
        unsafe {
            assert_eq!(request_headers::<FakeEnvoy>(f, m, false), STOP);
            l.fake.state().panic_after_reply = true;
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), STOP);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        let replies = l.fake.state().replies.clone();
        assert_eq!(replies.len(), 1, "{replies:?}");
        assert_eq!(replies[0].0, 404);
        assert_eq!(panics(&l), 1);
    }

    #[test]
    fn a_panic_at_the_response_lets_the_response_through_and_the_end_releases() {
        let l = Loaded::new(&json("m-panic-response", r#","debug_header":"x-debug""#));
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-response", "x"),
        );
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream of the fake.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), CONTINUE);
            l.fake.state().response_headers = vec![(b":status".to_vec(), b"200".to_vec())];
            // The debug header is added to the response headers: that call panics.
            l.fake.state().panic_in = Some("add_header");
            assert_eq!(response_headers::<FakeEnvoy>(f, m), CONTINUE);
            assert!(
                l.fake.state().replies.is_empty(),
                "no answer over the worker's"
            );
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(panics(&l), 1);
        assert_eq!(l.sum("prefix_router.inflight_requests."), 0);
    }

    #[test]
    fn a_panic_after_the_charge_leaves_it_to_the_stream_end() {
        let l = Loaded::new(&json("m-panic-charged", ""));
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-charged", "x"),
        );
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream of the fake.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            // The decision is charged, then the cluster header is added: that call panics.
            l.fake.state().panic_in = Some("add_header");
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), STOP);
            assert_eq!(l.fake.state().replies.len(), 1);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(panics(&l), 1);
        assert_eq!(l.sum("prefix_router.requests."), 1, "a decision was made");
        assert_eq!(
            l.sum("prefix_router.inflight_requests."),
            0,
            "the stream's end released what the decision charged"
        );
    }

    #[test]
    fn a_panic_at_the_stream_end_and_in_main_thread_hooks_is_caught() {
        let cfg = r#"{"models":{"m-panic-main":{"workers":["w0","w1","w2"]}},"load_poll":{"interval_ms":100}}"#;
        let l = Loaded::new(cfg);
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-main", "x"),
        );
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream, then the config's main-thread hooks.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            request_body::<FakeEnvoy>(f, m, true);
            // The end flushes the in-flight gauge at once (eager flush): that call panics.
            l.fake.state().panic_in = Some("decrement_gauge");
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m); // the stream was taken: nothing runs twice
            assert_eq!(panics(&l), 1);
            // The main thread's tick starts polls: the callout panics, the tick is dropped.
            l.fake.state().panic_in = Some("http_callout");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while l.fake.count("http_callout") == 0 {
                assert!(std::time::Instant::now() < deadline, "no poll started");
                config_scheduled::<FakeEnvoy>(l.config);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            assert!(panics(&l) >= 2);
            // An answer to a call the root never made (its handling touches no callback).
            config_callout_done::<FakeEnvoy>(
                l.config,
                99,
                std::ptr::null(),
                0,
                std::ptr::null(),
                0,
            );
        }
        // Envoy is still "alive": a new stream on this thread routes normally.
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-main", "y"),
        );
        let m = l.stream();
        // SAFETY: as above.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            assert_eq!(request_body::<FakeEnvoy>(f, m, true), CONTINUE);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(l.fake.request_header("x-prefix-router-cluster").len(), 1);
    }

    #[test]
    fn a_panic_while_a_stream_is_made_fails_that_stream_closed() {
        let l = Loaded::new(&json("m-panic-new", ""));
        // A worker thread's root ticks lazily at stream starts: a stream made when a tick is
        // due runs it inside `on_http_filter_new`. A routed request first, so the root exists.
        l.fake.request(
            "POST",
            "/v1/chat/completions",
            &[],
            &chat("m-panic-new", "x"),
        );
        let (f, m) = (l.f(), l.stream());
        // SAFETY: live streams of the fake.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, false);
            request_body::<FakeEnvoy>(f, m, true);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        // The next gauge set panics: the sampled load gauges of a due tick (lazy, at a stream
        // start) hit it.
        std::thread::sleep(TICK * 5);
        l.fake.state().panic_in = Some("set_gauge");
        let mut failed = None;
        for _ in 0..8 {
            std::thread::sleep(TICK);
            let m = l.stream();
            // SAFETY: as above.
            let filter = unsafe { &*(m as *const Filter) };
            if filter.failed {
                failed = Some(m);
                break;
            }
            // SAFETY: as above.
            unsafe { filter_destroy::<FakeEnvoy>(m) };
        }
        let m = failed.expect("a tick at stream start panicked in set_gauge");
        // SAFETY: as above.
        unsafe {
            assert_eq!(request_headers::<FakeEnvoy>(f, m, false), STOP);
            assert_eq!(l.fake.state().replies.last().map(|r| r.0), Some(500));
            assert_eq!(response_headers::<FakeEnvoy>(f, m), CONTINUE);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert!(panics(&l) >= 1);
    }

    /// Load polls off (`gen --native --load-poll-ms 0`): a pool still learns its hosts and a
    /// replica still sends its peer batches, both from the main thread's tick (issue 36 #5).
    #[test]
    fn with_load_polls_off_pools_and_peers_still_tick_the_main_thread() {
        let pool = r#"{"models":{"m-pool-nopoll":{"pool":{"cluster":"m","load_cluster":"m_load"}}},
            "load_poll":{"interval_ms":0,"metrics_interval_ms":0}}"#;
        let l = Loaded::new(pool);
        assert_eq!(l.fake.state().schedulers, 1, "a pool needs the timer");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while l.fake.count("http_callout") == 0 {
            assert!(std::time::Instant::now() < deadline, "no membership read");
            // SAFETY: the config is alive; this test thread plays Envoy's main thread.
            unsafe { config_scheduled::<FakeEnvoy>(l.config) };
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let call = l.fake.state().callouts[0].clone();
        assert_eq!(call.1, "admin", "the membership read: {call:?}");
        drop(l);
        let peers = json(
            "m-peers-nopoll",
            r#","peers":{"clusters":["p0"],"secret":"0123456789abcdef-peer"}"#,
        );
        let l = Loaded::new(&peers);
        assert_eq!(
            l.fake.state().schedulers,
            1,
            "a peer sender needs the timer"
        );
        drop(l);
        let listener = json(
            "m-listener-nopoll",
            r#","peers":{"secret":"0123456789abcdef-peer"},"peer_listener":true"#,
        );
        let l = Loaded::new(&listener);
        assert_eq!(l.fake.state().schedulers, 0, "a peer listener never sends");
    }

    #[test]
    fn with_polls_the_timer_ticks_the_main_thread_which_makes_the_calls() {
        let cfg =
            r#"{"models":{"m-poll":{"workers":["w0","w1","w2"]}},"load_poll":{"interval_ms":100}}"#;
        let l = Loaded::new(cfg);
        assert_eq!(l.fake.state().schedulers, 1);
        // Streams on worker threads never call.
        l.fake.request("GET", "/v1/models", &[], b"");
        let (f, m) = (l.f(), l.stream());
        // SAFETY: a live stream, then the config's main-thread hooks.
        unsafe {
            request_headers::<FakeEnvoy>(f, m, true);
            stream_complete::<FakeEnvoy>(f, m);
            filter_destroy::<FakeEnvoy>(m);
        }
        assert_eq!(l.fake.count("http_callout"), 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while l.fake.count("http_callout") == 0 {
            assert!(std::time::Instant::now() < deadline, "no poll started");
            // SAFETY: the config is alive; this test thread plays Envoy's main thread.
            unsafe { config_scheduled::<FakeEnvoy>(l.config) };
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let call = l.fake.state().callouts[0].clone();
        assert!(WORKERS.contains(&call.1.as_str()), "{call:?}");
        // The answer (headers and chunks in the hook's arguments) goes to the main root.
        let (k, v) = (b":status".to_vec(), b"200".to_vec());
        let headers = [Pair {
            key: Buf::of(&k),
            value: Buf::of(&v),
        }];
        let body = br#"[{"dp_rank":0,"num_reqs":2,"num_waiting_reqs":0,"num_tokens":10}]"#;
        let chunks = [Buf::of(body)];
        // SAFETY: as above; the arrays outlive the call.
        unsafe {
            config_callout_done::<FakeEnvoy>(
                l.config,
                call.0,
                headers.as_ptr(),
                1,
                chunks.as_ptr(),
                1,
            )
        };
        // Counted (metrics go out every few ticks).
        for _ in 0..8 {
            // SAFETY: as above.
            unsafe { config_scheduled::<FakeEnvoy>(l.config) };
        }
        assert!(
            l.sum("prefix_router.load_poll.answers") >= 1,
            "the answer was counted"
        );
        drop(l); // joins the timer, deletes the scheduler
    }
}
