//! The floor of a body-routing filter built as an Envoy dynamic module (a native shared library
//! loaded by `envoy.filters.http.dynamic_modules`), next to `benches/wasm-floor`'s Wasm floor:
//! the same stop / buffer pattern, the body read once and the cluster header set, with no
//! parsing, hashing or state. `benches/overhead` runs it as kind `dm_floor`, so the Wasm floor
//! minus this is what the V8 boundary costs, and this minus Envoy's buffer filter is what any
//! native body router must pay.
//!
//! The ABI (Envoy 1.40.0, dynamic modules ABI `v0.2.0`) is written by hand: Envoy's Rust SDK is
//! not on crates.io. Facts it relies on, each checked against the shipped `envoy` binary (its
//! dynamic symbols, the hook pointer types in its strings, and the callbacks' disassembly; see
//! docs/design.md):
//! - `on_program_init` returns the ABI version string; NULL refuses the module, any other
//!   string than Envoy's own only logs a warning, so a layout mistake is never caught by Envoy.
//! - Every HTTP-filter hook below must be exported, used or not: a missing one fails the filter
//!   config ("Failed to resolve symbol").
//! - `{ptr, len}` buffers are passed by value; C enums are `int`. Body types: 0 received request
//!   chunk, 1 buffered request body, 2 and 3 the response's. Header status: 0 Continue, 1 Stop
//!   iteration; body status: 0 Continue, 1 Stop iteration and buffer.
//! - Setting a request header does not clear the route cache (the Wasm host does): the module
//!   must, or the route chosen before the filter ran stays.
//! - Hooks of a config run on the main thread; per-stream hooks on the worker threads, and one
//!   copy of every `static` is shared by all of them.
//!
//! Every hook is panic-free (a panic in a module aborts Envoy: there is no sandbox).

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The header prefix-router sets; the bench's route picks the cluster it names.
const CLUSTER_HEADER: &[u8] = b"x-prefix-router-cluster";

/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of Envoy 1.40.0, NUL-terminated.
const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `envoy_dynamic_module_type_envoy_buffer` and `..._module_buffer`: `{ptr, len}`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buf {
    ptr: *const u8,
    len: usize,
}

impl Buf {
    const EMPTY: Buf = Buf {
        ptr: std::ptr::null(),
        len: 0,
    };
    fn of(s: &[u8]) -> Buf {
        Buf {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }
}

type EnvoyFilter = *mut c_void;
type ModuleFilter = *const c_void;

const REQUEST_HEADER: u32 = 0;
const RECEIVED_REQUEST_BODY: u32 = 0;
const BUFFERED_REQUEST_BODY: u32 = 1;
const CONTINUE: u32 = 0;
const STOP_ITERATION: u32 = 1;
const STOP_ITERATION_AND_BUFFER: u32 = 1;

extern "C" {
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(f: EnvoyFilter, body: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        f: EnvoyFilter,
        body: u32,
        out: *mut Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        f: EnvoyFilter,
        header: u32,
        key: Buf,
        value: Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(f: EnvoyFilter);
}

/// Round robin over the bench's 4 clusters, as the Wasm floor does (here one counter for the
/// whole process, shared by every worker thread).
fn next_cluster() -> &'static [u8] {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    const CLUSTERS: [&[u8]; 4] = [b"w0", b"w1", b"w2", b"w3"];
    let i = NEXT.fetch_add(1, Ordering::Relaxed) % CLUSTERS.len();
    CLUSTERS.get(i).copied().unwrap_or(b"w0")
}

fn route(f: EnvoyFilter, cluster: &[u8]) {
    // SAFETY: `f` is the stream of the hook being run; Envoy copies key and value.
    unsafe {
        envoy_dynamic_module_callback_http_set_header(
            f,
            REQUEST_HEADER,
            Buf::of(CLUSTER_HEADER),
            Buf::of(cluster),
        );
        envoy_dynamic_module_callback_http_clear_route_cache(f);
    }
}

/// Bytes in one body buffer, every byte read (as a parser would), or `None` when it is empty.
fn read_body(f: EnvoyFilter, which: u32) -> Option<usize> {
    // SAFETY: `f` is the live stream; the array gets exactly `n` entries, which stay valid for
    // the hook.
    unsafe {
        let n = envoy_dynamic_module_callback_http_get_body_chunks_size(f, which);
        if n == 0 {
            return None;
        }
        let mut inline = [Buf::EMPTY; 16];
        let mut heap = Vec::new();
        let out = if n <= inline.len() {
            inline.as_mut_ptr()
        } else {
            heap.resize(n, Buf::EMPTY);
            heap.as_mut_ptr()
        };
        if !envoy_dynamic_module_callback_http_get_body_chunks(f, which, out) {
            return None;
        }
        let mut len = 0;
        let mut sum = 0u8;
        for c in std::slice::from_raw_parts(out, n) {
            if !c.ptr.is_null() {
                let bytes = std::slice::from_raw_parts(c.ptr, c.len);
                sum = bytes.iter().fold(sum, |a, &b| a.wrapping_add(b));
                len += c.len;
            }
        }
        std::hint::black_box(sum);
        Some(len)
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}

/// The config pointer only has to be non-NULL: the floor has no configuration.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config: *mut c_void,
    _name: Buf,
    _value: Buf,
) -> *const c_void {
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(_config: *const c_void) {}

/// No per-stream state; the stream pointer only has to be non-NULL.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    _f: EnvoyFilter,
) -> ModuleFilter {
    config
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_m: ModuleFilter) {}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    f: EnvoyFilter,
    _m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    if end_of_stream {
        route(f, b"w0"); // no body to route on
        return CONTINUE;
    }
    STOP_ITERATION // until the whole body is here
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    f: EnvoyFilter,
    _m: ModuleFilter,
    end_of_stream: bool,
) -> u32 {
    if !end_of_stream {
        return STOP_ITERATION_AND_BUFFER;
    }
    // At the end, Envoy has appended the last chunk to the buffered body when earlier chunks
    // were buffered; a body that came in one chunk is only in the received chunk.
    let len = read_body(f, BUFFERED_REQUEST_BODY).or_else(|| read_body(f, RECEIVED_REQUEST_BODY));
    route(
        f,
        if len.unwrap_or(0) == 0 {
            b"w0"
        } else {
            next_cluster()
        },
    );
    CONTINUE
}

// The hooks Envoy 1.40 requires of every HTTP filter module; the floor does nothing there.
// Response headers and stream completion are used by prefix-router, so they are written here;
// the rest are prefix-router's own no-op hooks (filter/src/native/noop_hooks.rs), the same
// source in both modules so the floor's export surface stays prefix-router's.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _f: EnvoyFilter,
    _m: ModuleFilter,
    _end_of_stream: bool,
) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _f: EnvoyFilter,
    _m: ModuleFilter,
) {
}

include!("../../../filter/src/native/noop_hooks.rs");
envoy_noop_hooks!();
