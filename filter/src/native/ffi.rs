//! The ABI itself: Envoy 1.40's dynamic-module types, constants and the callbacks the module
//! imports, and [`Abi`], the function table the rest of `native` calls them through.
//!
//! Invariants (each checked against the shipped `envoy` binary; docs/design.md, "The native
//! module", lists how):
//! - buffers are `{ptr, len}` passed by value, a header is two of them (key, then value), C
//!   enums are `int` (`u32` here); a NULL buffer is an empty one;
//! - Envoy copies every buffer the module passes in before the callback returns; the buffers it
//!   hands out stay valid for the current hook only;
//! - stream callbacks take the stream's Envoy pointer and run on that stream's worker thread;
//!   config callbacks take Envoy's config pointer (metrics from any thread, the scheduler commit
//!   from any thread, callouts from the main thread only).
//!
//! Why a trait: the host (`host::Native`), the timer and the hooks are generic over [`Abi`], so
//! the unit tests run them over a fake Envoy (`fake::FakeEnvoy`) with the same pointer plumbing.
//! The production table, [`Envoy`], is a zero-sized type whose methods are the `extern` calls
//! themselves: after monomorphisation the code is what direct calls would give (no vtable, no
//! extra state per call).

use std::ffi::c_void;

/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of Envoy 1.40.0, NUL-terminated.
pub(crate) const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `{ptr, len}`, passed by value (`envoy_dynamic_module_type_{envoy,module}_buffer`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buf {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

impl Buf {
    pub(crate) const NULL: Buf = Buf {
        ptr: std::ptr::null(),
        len: 0,
    };
    pub(crate) fn of(s: &[u8]) -> Buf {
        Buf {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }
    /// The bytes, valid for the current hook (Envoy's buffers) or the call (ours).
    ///
    /// # Safety
    /// `ptr` is NULL or points at `len` readable bytes for the lifetime the caller picks.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
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
    pub(crate) key: Buf,
    pub(crate) value: Buf,
}

impl Pair {
    pub(crate) const NULL: Pair = Pair {
        key: Buf::NULL,
        value: Buf::NULL,
    };
    /// The module's headers as the ABI takes them (pointing into `headers`). Allocates: used
    /// only for local replies and callouts, never on a routed request's path.
    pub(crate) fn all(headers: &[(&str, &str)]) -> Vec<Pair> {
        headers
            .iter()
            .map(|(k, v)| Pair {
                key: Buf::of(k.as_bytes()),
                value: Buf::of(v.as_bytes()),
            })
            .collect()
    }
}

/// Envoy's stream pointer (`envoy_dynamic_module_type_http_filter_envoy_ptr`).
pub type EnvoyFilter = *mut c_void;
/// The module's stream pointer, as `on_http_filter_new` returned it.
pub type ModuleFilter = *const c_void;

/// Header maps (`envoy_dynamic_module_type_http_header_type`).
pub(crate) const REQUEST_HEADERS: u32 = 0;
pub(crate) const RESPONSE_HEADERS: u32 = 2;
/// Body types (`envoy_dynamic_module_type_http_body_type`): the chunk just received, and what
/// Envoy buffered (after a stop-and-buffer; at the end it holds the last chunk too).
pub(crate) const RECEIVED_REQUEST_BODY: u32 = 0;
pub(crate) const BUFFERED_REQUEST_BODY: u32 = 1;
/// Hook status: continue.
pub(crate) const CONTINUE: u32 = 0;
/// Headers: stop iteration; body: stop iteration and buffer (both 1).
pub(crate) const STOP: u32 = 1;

/// Every Envoy callback the module uses, one method per ABI function with the ABI's own
/// signature (so an implementation is a table of functions, not an object: the pointers it is
/// given say which stream or config). Metric define/update calls pass no labels.
///
/// # Safety
/// Every method is as unsafe as the callback: the pointers are Envoy's live stream, config or
/// scheduler pointers of the current hook, out-arrays hold as many entries as the matching
/// `_size` call said, and in-buffers are readable for the call.
/// `envoy_dynamic_module_type_attribute_id_UpstreamAddress` (`upstream.address`, `IP:PORT`).
pub(crate) const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;

pub(crate) trait Abi: 'static {
    unsafe fn get_headers_size(f: EnvoyFilter, map: u32) -> usize;
    unsafe fn get_headers(f: EnvoyFilter, map: u32, out: *mut Pair) -> bool;
    /// Replaces every value of `key`; a NULL `value` removes the header.
    unsafe fn set_header(f: EnvoyFilter, map: u32, key: Buf, value: Buf) -> bool;
    unsafe fn add_header(f: EnvoyFilter, map: u32, key: Buf, value: Buf) -> bool;
    unsafe fn clear_route_cache(f: EnvoyFilter);
    /// A string attribute of the stream (`attribute` is the ABI's attribute id); false when
    /// absent or not a string. `out` then points at Envoy's bytes, valid during the hook.
    unsafe fn get_attribute_string(f: EnvoyFilter, attribute: u32, out: *mut Buf) -> bool;
    unsafe fn get_body_chunks_size(f: EnvoyFilter, body: u32) -> usize;
    unsafe fn get_body_chunks(f: EnvoyFilter, body: u32, out: *mut Buf) -> bool;
    /// Appends `data` to the body `body`; false when that body does not exist.
    unsafe fn append_body(f: EnvoyFilter, body: u32, data: Buf) -> bool;
    /// Drains up to `n` bytes from the front of the body `body`.
    unsafe fn drain_body(f: EnvoyFilter, body: u32, n: usize) -> bool;
    unsafe fn send_response(
        f: EnvoyFilter,
        status: u32,
        headers: *const Pair,
        headers_len: usize,
        body: Buf,
        details: Buf,
    );
    /// 0 when defined (`id` written); only inside `on_http_filter_config_new`.
    unsafe fn define_counter(
        config: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    unsafe fn define_gauge(
        config: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    unsafe fn increment_counter(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        by: u64,
    ) -> u32;
    unsafe fn increment_gauge(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        by: u64,
    ) -> u32;
    unsafe fn decrement_gauge(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        by: u64,
    ) -> u32;
    unsafe fn set_gauge(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32;
    /// NULL when Envoy has none to give.
    unsafe fn scheduler_new(config: *mut c_void) -> *mut c_void;
    /// From any thread: one `on_http_filter_config_scheduled` on the main thread per commit.
    unsafe fn scheduler_commit(scheduler: *mut c_void, event: u64);
    unsafe fn scheduler_delete(scheduler: *mut c_void);
    /// 0 ok (`id` written), 1 missing `:method`/`:path`/`:authority`, 2 unknown cluster.
    unsafe fn http_callout(
        config: *mut c_void,
        id: *mut u64,
        cluster: Buf,
        headers: *const Pair,
        headers_len: usize,
        body: Buf,
        timeout_ms: u64,
    ) -> u32;
}

/// The production table: Envoy's own callbacks, resolved when Envoy loads the module.
pub(crate) struct Envoy;

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
        pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
            f: EnvoyFilter,
            attribute: u32,
            out: *mut Buf,
        ) -> bool;
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
        pub fn envoy_dynamic_module_callback_http_append_body(
            f: EnvoyFilter,
            body: u32,
            data: Buf,
        ) -> bool;
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

impl Abi for Envoy {
    #[inline(always)]
    unsafe fn get_headers_size(f: EnvoyFilter, map: u32) -> usize {
        raw::envoy_dynamic_module_callback_http_get_headers_size(f, map)
    }
    #[inline(always)]
    unsafe fn get_headers(f: EnvoyFilter, map: u32, out: *mut Pair) -> bool {
        raw::envoy_dynamic_module_callback_http_get_headers(f, map, out)
    }
    #[inline(always)]
    unsafe fn set_header(f: EnvoyFilter, map: u32, key: Buf, value: Buf) -> bool {
        raw::envoy_dynamic_module_callback_http_set_header(f, map, key, value)
    }
    #[inline(always)]
    unsafe fn add_header(f: EnvoyFilter, map: u32, key: Buf, value: Buf) -> bool {
        raw::envoy_dynamic_module_callback_http_add_header(f, map, key, value)
    }
    #[inline(always)]
    unsafe fn clear_route_cache(f: EnvoyFilter) {
        raw::envoy_dynamic_module_callback_http_clear_route_cache(f)
    }
    #[inline(always)]
    unsafe fn get_attribute_string(f: EnvoyFilter, attribute: u32, out: *mut Buf) -> bool {
        raw::envoy_dynamic_module_callback_http_filter_get_attribute_string(f, attribute, out)
    }
    #[inline(always)]
    unsafe fn get_body_chunks_size(f: EnvoyFilter, body: u32) -> usize {
        raw::envoy_dynamic_module_callback_http_get_body_chunks_size(f, body)
    }
    #[inline(always)]
    unsafe fn get_body_chunks(f: EnvoyFilter, body: u32, out: *mut Buf) -> bool {
        raw::envoy_dynamic_module_callback_http_get_body_chunks(f, body, out)
    }
    #[inline(always)]
    unsafe fn append_body(f: EnvoyFilter, body: u32, data: Buf) -> bool {
        raw::envoy_dynamic_module_callback_http_append_body(f, body, data)
    }
    #[inline(always)]
    unsafe fn drain_body(f: EnvoyFilter, body: u32, n: usize) -> bool {
        raw::envoy_dynamic_module_callback_http_drain_body(f, body, n)
    }
    #[inline(always)]
    unsafe fn send_response(
        f: EnvoyFilter,
        status: u32,
        headers: *const Pair,
        headers_len: usize,
        body: Buf,
        details: Buf,
    ) {
        raw::envoy_dynamic_module_callback_http_send_response(
            f,
            status,
            headers,
            headers_len,
            body,
            details,
        )
    }
    #[inline(always)]
    unsafe fn define_counter(
        config: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_define_counter(
            config, name, labels, labels_len, id,
        )
    }
    #[inline(always)]
    unsafe fn define_gauge(
        config: *mut c_void,
        name: Buf,
        labels: *const Buf,
        labels_len: usize,
        id: *mut usize,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_define_gauge(
            config, name, labels, labels_len, id,
        )
    }
    #[inline(always)]
    unsafe fn increment_counter(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        by: u64,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_increment_counter(
            config, id, labels, labels_len, by,
        )
    }
    #[inline(always)]
    unsafe fn increment_gauge(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        by: u64,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
            config, id, labels, labels_len, by,
        )
    }
    #[inline(always)]
    unsafe fn decrement_gauge(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        by: u64,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
            config, id, labels, labels_len, by,
        )
    }
    #[inline(always)]
    unsafe fn set_gauge(
        config: *mut c_void,
        id: usize,
        labels: *const Buf,
        labels_len: usize,
        value: u64,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_set_gauge(
            config, id, labels, labels_len, value,
        )
    }
    #[inline(always)]
    unsafe fn scheduler_new(config: *mut c_void) -> *mut c_void {
        raw::envoy_dynamic_module_callback_http_filter_config_scheduler_new(config)
    }
    #[inline(always)]
    unsafe fn scheduler_commit(scheduler: *mut c_void, event: u64) {
        raw::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler, event)
    }
    #[inline(always)]
    unsafe fn scheduler_delete(scheduler: *mut c_void) {
        raw::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler)
    }
    #[inline(always)]
    unsafe fn http_callout(
        config: *mut c_void,
        id: *mut u64,
        cluster: Buf,
        headers: *const Pair,
        headers_len: usize,
        body: Buf,
        timeout_ms: u64,
    ) -> u32 {
        raw::envoy_dynamic_module_callback_http_filter_config_http_callout(
            config,
            id,
            cluster,
            headers,
            headers_len,
            body,
            timeout_ms,
        )
    }
}
