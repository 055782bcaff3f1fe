//! The module's proxy-wasm ABI 0.2.1 surface: its own small `extern "C"` layer in place of the
//! SDK's dispatcher, and [`Envoy`], the [`Host`] over the raw host-call imports.
//!
//! Why not the SDK: its dispatcher exports every `proxy_on_*` callback, and Envoy
//! (proxy-wasm-cpp-host) enters the VM for each exported callback: for a streamed LLM response
//! that is one VM entry per token chunk, for nothing. This module exports ONLY what the filter
//! uses (`harness/tests/exports.rs` checks the built `.wasm`):
//!
//! | export | when Envoy calls it |
//! |---|---|
//! | `proxy_abi_version_0_2_1` | marker, never called |
//! | `proxy_on_memory_allocate` | when the host returns bytes (headers, bodies, shared data) |
//! | `proxy_on_context_create` | root context at start, each stream once |
//! | `proxy_on_vm_start`, `proxy_on_configure` | start, config updates |
//! | `proxy_on_tick` | the root's timer |
//! | `proxy_on_http_call_response` | load poll and peer batch answers |
//! | `proxy_on_request_headers`, `proxy_on_request_body` | once per request (body: per chunk until complete) |
//! | `proxy_on_response_headers` | once per response (debug header; the status hook) |
//! | `proxy_on_delete` | once per stream end; root teardown |
//!
//! Not exported, so never entered: response body and trailers, request trailers, `on_log`,
//! `on_done`, network-filter, gRPC, queue and foreign-function callbacks. `on_done` is left out
//! because Envoy calls `on_delete` right after it in every case (a stream's `onDestroy` calls
//! both back to back; a root's shutdown calls `on_delete` once `on_done` answers true, and an
//! absent `on_done` counts as true), so one VM entry per stream end is enough.
//!
//! Contexts: a VM holds its root contexts and its streams in a map by context id. A callback
//! takes its context out of the map for its duration, so a nested call from the host (none is
//! expected) finds no context and does nothing instead of aliasing state. A stream created
//! before any configuration was accepted has no context: its callbacks continue (the SDK
//! panicked there).

use crate::glue::{Action, Root, Stream};
use crate::host::{Buffer, CallRefused, Host, Map, MetricKind};
use crate::store::{CasMismatch, Store};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// proxy-wasm status codes the filter distinguishes.
const OK: u32 = 0;
const CAS_MISMATCH: u32 = 8;
const LOG_ERROR: u32 = 4;

mod raw {
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_log(level: u32, msg: *const u8, len: usize) -> u32;
        pub fn proxy_get_current_time_nanoseconds(ret: *mut u64) -> u32;
        pub fn proxy_set_tick_period_milliseconds(ms: u32) -> u32;
        pub fn proxy_get_buffer_bytes(
            which: u32,
            start: usize,
            max: usize,
            ret: *mut *mut u8,
            ret_len: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_value(
            map: u32,
            key: *const u8,
            key_len: usize,
            ret: *mut *mut u8,
            ret_len: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_pairs(map: u32, ret: *mut *mut u8, ret_len: *mut usize) -> u32;
        pub fn proxy_add_header_map_value(
            map: u32,
            key: *const u8,
            key_len: usize,
            value: *const u8,
            value_len: usize,
        ) -> u32;
        pub fn proxy_remove_header_map_value(map: u32, key: *const u8, key_len: usize) -> u32;
        pub fn proxy_replace_header_map_value(
            map: u32,
            key: *const u8,
            key_len: usize,
            value: *const u8,
            value_len: usize,
        ) -> u32;
        pub fn proxy_set_buffer_bytes(
            which: u32,
            start: usize,
            len: usize,
            data: *const u8,
            data_len: usize,
        ) -> u32;
        pub fn proxy_get_property(
            path: *const u8,
            path_len: usize,
            ret: *mut *mut u8,
            ret_len: *mut usize,
        ) -> u32;
        pub fn proxy_get_shared_data(
            key: *const u8,
            key_len: usize,
            ret: *mut *mut u8,
            ret_len: *mut usize,
            cas: *mut u32,
        ) -> u32;
        pub fn proxy_set_shared_data(
            key: *const u8,
            key_len: usize,
            value: *const u8,
            value_len: usize,
            cas: u32,
        ) -> u32;
        pub fn proxy_define_metric(kind: u32, name: *const u8, len: usize, ret: *mut u32) -> u32;
        pub fn proxy_increment_metric(id: u32, by: i64) -> u32;
        pub fn proxy_record_metric(id: u32, value: u64) -> u32;
        #[allow(clippy::too_many_arguments)]
        pub fn proxy_send_local_response(
            status: u32,
            details: *const u8,
            details_len: usize,
            body: *const u8,
            body_len: usize,
            headers: *const u8,
            headers_len: usize,
            grpc_status: i32,
        ) -> u32;
        #[allow(clippy::too_many_arguments)]
        pub fn proxy_http_call(
            upstream: *const u8,
            upstream_len: usize,
            headers: *const u8,
            headers_len: usize,
            body: *const u8,
            body_len: usize,
            trailers: *const u8,
            trailers_len: usize,
            timeout_ms: u32,
            ret_token: *mut u32,
        ) -> u32;
    }
}

/// Takes ownership of bytes the host wrote into memory from [`proxy_on_memory_allocate`].
///
/// # Safety
/// `ptr`/`len` must be what a host call just returned: an allocation of exactly `len` bytes made
/// by `proxy_on_memory_allocate` (or null / 0).
unsafe fn owned(ptr: *mut u8, len: usize) -> Vec<u8> {
    if ptr.is_null() || len == 0 {
        if !ptr.is_null() {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, 0)));
        }
        return Vec::new();
    }
    Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)).into_vec()
}

/// Envoy, through the proxy-wasm host calls: one host call per method call.
pub struct Envoy;

impl Store for Envoy {
    fn get(&self, key: &str, out: &mut Vec<u8>) -> Option<u32> {
        let (mut p, mut n, mut cas) = (std::ptr::null_mut(), 0usize, 0u32);
        // SAFETY: valid key slice and out-pointers; the host allocates the value through
        // proxy_on_memory_allocate, which `owned` takes back.
        let st = unsafe {
            raw::proxy_get_shared_data(key.as_ptr(), key.len(), &mut p, &mut n, &mut cas)
        };
        if st != OK {
            out.clear();
            return None;
        }
        *out = unsafe { owned(p, n) };
        Some(cas)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), CasMismatch> {
        // SAFETY: valid slices for the duration of the call.
        let st = unsafe {
            raw::proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
        };
        match st {
            OK => Ok(()),
            CAS_MISMATCH => Err(CasMismatch),
            _ => Err(CasMismatch),
        }
    }
}

impl Host for Envoy {
    fn header(&self, map: Map, name: &str) -> Option<Vec<u8>> {
        let (mut p, mut n) = (std::ptr::null_mut(), 0usize);
        // SAFETY: as in `get`.
        let st = unsafe {
            raw::proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut p, &mut n)
        };
        (st == OK).then(|| unsafe { owned(p, n) })
    }
    fn header_pairs(&self, map: Map) -> Vec<u8> {
        let (mut p, mut n) = (std::ptr::null_mut(), 0usize);
        // SAFETY: as in `get`.
        let st = unsafe { raw::proxy_get_header_map_pairs(map as u32, &mut p, &mut n) };
        if st == OK {
            unsafe { owned(p, n) }
        } else {
            Vec::new()
        }
    }
    fn add_header(&self, map: Map, name: &str, value: &str) {
        // SAFETY: valid slices for the duration of the call.
        unsafe {
            raw::proxy_add_header_map_value(
                map as u32,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            );
        }
    }
    fn remove_header(&self, map: Map, name: &str) {
        // SAFETY: valid slice for the duration of the call.
        unsafe {
            raw::proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len());
        }
    }
    fn replace_header(&self, map: Map, name: &str, value: &str) {
        // SAFETY: valid slices for the duration of the call.
        unsafe {
            raw::proxy_replace_header_map_value(
                map as u32,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            );
        }
    }
    fn set_buffer(&self, which: Buffer, len: usize, data: &[u8]) {
        // SAFETY: valid slice for the duration of the call.
        unsafe { raw::proxy_set_buffer_bytes(which as u32, 0, len, data.as_ptr(), data.len()) };
    }
    fn upstream_address(&self) -> Option<Vec<u8>> {
        // A property path is its segments separated by NUL.
        const PATH: &[u8] = b"upstream\0address";
        let (mut p, mut n) = (std::ptr::null_mut(), 0usize);
        // SAFETY: as in `get`.
        let st = unsafe { raw::proxy_get_property(PATH.as_ptr(), PATH.len(), &mut p, &mut n) };
        (st == OK).then(|| unsafe { owned(p, n) })
    }
    fn buffer(&self, which: Buffer, max: usize) -> Vec<u8> {
        let (mut p, mut n) = (std::ptr::null_mut(), 0usize);
        // SAFETY: as in `get`.
        let st = unsafe { raw::proxy_get_buffer_bytes(which as u32, 0, max, &mut p, &mut n) };
        if st == OK {
            unsafe { owned(p, n) }
        } else {
            Vec::new()
        }
    }
    fn now_nanos(&self) -> u64 {
        let mut t = 0u64;
        // SAFETY: valid out-pointer.
        unsafe { raw::proxy_get_current_time_nanoseconds(&mut t) };
        t
    }
    fn define_metric(&self, kind: MetricKind, name: &str) -> u32 {
        let mut id = 0u32;
        // SAFETY: valid slice and out-pointer.
        let st =
            unsafe { raw::proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) };
        if st == OK {
            id
        } else {
            0
        }
    }
    fn increment_metric(&self, id: u32, by: i64) {
        // SAFETY: no pointers.
        unsafe { raw::proxy_increment_metric(id, by) };
    }
    fn record_metric(&self, id: u32, value: u64) {
        // SAFETY: no pointers.
        unsafe { raw::proxy_record_metric(id, value) };
    }
    fn local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.local_reply_details(status, "", headers, body);
    }
    fn local_reply_details(
        &self,
        status: u32,
        details: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) {
        let h = crate::header_pairs::encode(headers);
        // SAFETY: valid slices for the duration of the call; -1: no gRPC status.
        unsafe {
            raw::proxy_send_local_response(
                status,
                details.as_ptr(),
                details.len(),
                body.as_ptr(),
                body.len(),
                h.as_ptr(),
                h.len(),
                -1,
            );
        }
    }
    fn http_call(
        &self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u32,
    ) -> Result<u32, CallRefused> {
        let h = crate::header_pairs::encode(headers);
        let t = crate::header_pairs::encode::<&str, &str>(&[]);
        let body = body.unwrap_or_default();
        let mut token = 0u32;
        // SAFETY: valid slices and out-pointer for the duration of the call.
        let st = unsafe {
            raw::proxy_http_call(
                upstream.as_ptr(),
                upstream.len(),
                h.as_ptr(),
                h.len(),
                body.as_ptr(),
                body.len(),
                t.as_ptr(),
                t.len(),
                timeout_ms,
                &mut token,
            )
        };
        if st == OK {
            Ok(token)
        } else {
            Err(CallRefused)
        }
    }
    fn set_tick_period_ms(&self, ms: u32) {
        // SAFETY: no pointers.
        unsafe { raw::proxy_set_tick_period_milliseconds(ms) };
    }
    fn log_error(&self, msg: &str) {
        // SAFETY: valid slice for the duration of the call.
        unsafe { raw::proxy_log(LOG_ERROR, msg.as_ptr(), msg.len()) };
    }
}

/// One VM's contexts by id (a B-tree: a `HashMap`'s random seed would need WASI `random_get`).
#[derive(Default)]
struct Contexts {
    roots: BTreeMap<u32, Root>,
    streams: BTreeMap<u32, Stream>,
}

thread_local! {
    static CONTEXTS: RefCell<Contexts> = RefCell::default();
}

/// Runs `f` on stream `id`, taken out of the map for the call; `keep` says whether it goes back.
fn with_stream<R>(id: u32, default: R, f: impl FnOnce(&mut Stream) -> (R, bool)) -> R {
    let Some(mut s) = CONTEXTS.with(|c| c.borrow_mut().streams.remove(&id)) else {
        return default;
    };
    let (r, keep) = f(&mut s);
    if keep {
        CONTEXTS.with(|c| c.borrow_mut().streams.insert(id, s));
    }
    r
}

fn with_root<R>(id: u32, default: R, f: impl FnOnce(&mut Root) -> R) -> R {
    let Some(mut root) = CONTEXTS.with(|c| c.borrow_mut().roots.remove(&id)) else {
        return default;
    };
    let r = f(&mut root);
    CONTEXTS.with(|c| c.borrow_mut().roots.insert(id, root));
    r
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// The host allocates in the module to hand it bytes; [`owned`] takes them back. Not zeroed:
/// the host writes every byte before the module reads them (a zero fill would be a memset of
/// each request body for nothing).
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let b: Box<[std::mem::MaybeUninit<u8>]> = Box::new_uninit_slice(size);
    Box::into_raw(b).cast::<u8>()
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(id: u32, root_id: u32) {
    CONTEXTS.with(|c| {
        let mut c = c.borrow_mut();
        if root_id == 0 {
            c.roots.entry(id).or_default();
        } else if let Some(s) = c.roots.get(&root_id).and_then(Root::new_stream) {
            c.streams.insert(id, s);
        }
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_id: u32, _vm_config_size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_id: u32, size: usize) -> u32 {
    u32::from(with_root(root_id, false, |r| r.on_configure(&Envoy, size)))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_id: u32) {
    with_root(root_id, (), |r| r.on_tick(&Envoy));
}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    root_id: u32,
    token: u32,
    _headers: usize,
    body_size: usize,
    _trailers: usize,
) {
    with_root(root_id, (), |r| {
        r.on_http_call_response(&Envoy, token, body_size)
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(id: u32, _headers: usize, end_of_stream: u32) -> u32 {
    with_stream(id, Action::Continue, |s| {
        (s.on_request_headers(&Envoy, end_of_stream != 0), true)
    }) as u32
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(id: u32, size: usize, end_of_stream: u32) -> u32 {
    with_stream(id, Action::Continue, |s| {
        (s.on_request_body(&Envoy, size, end_of_stream != 0), true)
    }) as u32
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(id: u32, _headers: usize, _eos: u32) -> u32 {
    with_stream(id, Action::Continue, |s| {
        (s.on_response_headers(&Envoy), true)
    }) as u32
}

/// A context is gone: a stream's end (its charge is released and its context dropped), or the
/// root's teardown (batched state flushed, then the root dropped).
#[no_mangle]
pub extern "C" fn proxy_on_delete(id: u32) {
    let stream = with_stream(id, false, |s| {
        s.on_done(&Envoy);
        (true, false)
    });
    if !stream {
        if let Some(mut root) = CONTEXTS.with(|c| c.borrow_mut().roots.remove(&id)) {
            root.on_done(&Envoy);
        }
    }
}
