//! The floor on its own ABI layer: exports exactly what prefix-router exports, and does only
//! what the floor needs (one body read, one header set per request).

use crate::CLUSTER_HEADER;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_buffer_bytes(
        which: u32,
        start: usize,
        max: usize,
        ret: *mut *mut u8,
        ret_len: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map: u32,
        key: *const u8,
        key_len: usize,
        value: *const u8,
        value_len: usize,
    ) -> u32;
}

const REQUEST_HEADERS: u32 = 0;
const REQUEST_BODY: u32 = 0;
const CONTINUE: u32 = 0;
const PAUSE: u32 = 1;

/// Round robin over the bench's 4 clusters, like plain Envoy over its 4 endpoints, so every
/// variant spreads streams the same way (how many streams one upstream carries changes how its
/// SSE events coalesce into HTTP chunks, and so Envoy's work per response).
fn next_cluster() -> &'static str {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    const CLUSTERS: [&str; 4] = ["w0", "w1", "w2", "w3"];
    CLUSTERS[NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % CLUSTERS.len()]
}

fn set_cluster(c: &str) {
    // SAFETY: valid slices for the duration of the call.
    unsafe {
        proxy_replace_header_map_value(
            REQUEST_HEADERS,
            CLUSTER_HEADER.as_ptr(),
            CLUSTER_HEADER.len(),
            c.as_ptr(),
            c.len(),
        );
    }
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    Box::into_raw(vec![0u8; size].into_boxed_slice()).cast::<u8>()
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(_id: u32, _root: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(_root: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(_r: u32, _t: u32, _h: usize, _b: usize, _tr: usize) {}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_id: u32, _n: usize, end_of_stream: u32) -> u32 {
    if end_of_stream != 0 {
        set_cluster("w0");
        return CONTINUE;
    }
    PAUSE // like prefix-router: hold the headers until the body has been read
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(_id: u32, size: usize, end_of_stream: u32) -> u32 {
    if end_of_stream == 0 {
        return PAUSE; // buffer
    }
    let (mut p, mut n) = (std::ptr::null_mut(), 0usize);
    // SAFETY: out-pointers valid; the host allocates through proxy_on_memory_allocate.
    let st = unsafe { proxy_get_buffer_bytes(REQUEST_BODY, 0, size, &mut p, &mut n) };
    let empty = st != 0 || p.is_null() || n == 0;
    if !p.is_null() {
        // SAFETY: an allocation of exactly n bytes from proxy_on_memory_allocate.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) });
    }
    set_cluster(if empty { "w0" } else { next_cluster() });
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(_id: u32, _n: usize, _eos: u32) -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(_id: u32) {}
