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
use super::host::Native;
use super::roots::{self, with_root, ModuleConfig};
use super::timer::{Timer, TICK};
use crate::config::Config;
use crate::glue::{Action, Root, Stream};
use std::cell::RefCell;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

/// One stream: its glue state and its config.
pub(crate) struct Filter {
    config: *const ModuleConfig,
    stream: Option<Stream>,
}

/// Runs `f` on the stream behind `m` with a host over `envoy`.
///
/// # Safety
/// `m` is a pointer [`envoy_dynamic_module_on_http_filter_new`] returned and Envoy has not
/// destroyed yet; Envoy never runs two hooks of one stream at once.
unsafe fn with_stream<A: Abi, R>(
    envoy: EnvoyFilter,
    m: ModuleFilter,
    default: R,
    f: impl FnOnce(&mut Stream, &Native<A>) -> R,
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

/// See [`envoy_dynamic_module_on_http_filter_config_new`].
pub(crate) unsafe fn config_new<A: Abi>(envoy: *mut c_void, value: Buf) -> *const c_void {
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
    let timer = if cfg.load_poll.interval_ms > 0 {
        match Timer::start::<A>(envoy, TICK) {
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

/// See [`envoy_dynamic_module_on_http_filter_config_destroy`].
pub(crate) unsafe fn config_destroy(config: *const c_void) {
    if !config.is_null() {
        let c = Box::from_raw(config as *mut ModuleConfig);
        // The main thread's root of this config (the timer's and the calls'): gone with it.
        roots::forget(c.id);
        drop(c); // stops and joins the timer thread, then deletes the scheduler
    }
}

/// See [`envoy_dynamic_module_on_http_filter_new`].
pub(crate) unsafe fn filter_new<A: Abi>(config: *const c_void, envoy: EnvoyFilter) -> ModuleFilter {
    let c = config as *const ModuleConfig;
    let stream = match c.as_ref() {
        Some(cfg) => with_root(cfg, &Native::<A>::new(envoy, cfg), false, |r| {
            r.new_stream()
        }),
        None => None,
    };
    Box::into_raw(Box::new(Filter { config: c, stream })) as ModuleFilter
}

/// See [`envoy_dynamic_module_on_http_filter_destroy`].
pub(crate) unsafe fn filter_destroy<A: Abi>(m: ModuleFilter) {
    if m.is_null() {
        return;
    }
    let mut filter = Box::from_raw(m as *mut Filter);
    // Released at stream completion; a stream destroyed without it releases here (once: the
    // stream is taken).
    if let (Some(mut s), Some(config)) = (filter.stream.take(), filter.config.as_ref()) {
        s.on_done(&Native::<A>::new(std::ptr::null_mut(), config));
    }
}

pub(crate) unsafe fn request_headers<A: Abi>(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    status(with_stream::<A, _>(f, m, Action::Continue, |s, h| {
        s.on_request_headers(h, end_of_stream)
    }))
}

pub(crate) unsafe fn request_body<A: Abi>(
    f: EnvoyFilter,
    m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    status(with_stream::<A, _>(f, m, Action::Continue, |s, h| {
        // The glue reads the body through `Host::buffer`, which gathers Envoy's chunks up to
        // this bound (the body itself is bounded by the listener's buffer limit).
        s.on_request_body(h, usize::MAX, end_of_stream)
    }))
}

pub(crate) unsafe fn response_headers<A: Abi>(f: EnvoyFilter, m: ModuleFilter) -> u32 {
    status(with_stream::<A, _>(f, m, Action::Continue, |s, h| {
        s.on_response_headers(h)
    }))
}

pub(crate) unsafe fn stream_complete<A: Abi>(f: EnvoyFilter, m: ModuleFilter) {
    let Some(filter) = (m as *mut Filter).as_mut() else {
        return;
    };
    if let (Some(mut s), Some(config)) = (filter.stream.take(), filter.config.as_ref()) {
        s.on_done(&Native::<A>::new(f, config));
    }
}

pub(crate) unsafe fn config_scheduled<A: Abi>(config: *const c_void) {
    if let Some(c) = (config as *const ModuleConfig).as_ref() {
        let h = Native::<A> {
            main: true,
            ..Native::new(std::ptr::null_mut(), c)
        };
        with_root(c, &h, true, |_| ());
    }
}

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
    with_root(c, &h, false, |r| {
        r.on_http_call_response(&h, id as u32, size)
    });
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
