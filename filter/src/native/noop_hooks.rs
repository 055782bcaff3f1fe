// The HTTP-filter hooks Envoy 1.40 requires of every dynamic module and that neither
// prefix-router nor `benches/dm-floor` uses, written once: a missing export fails the filter
// config ("Failed to resolve symbol"), so both must export all of them.
//
// This file is a `macro_rules!` only, with no `use` and no crate paths, so that
// `benches/dm-floor` can `include!` it without depending on the filter crate. The expansion
// names `EnvoyFilter`, `ModuleFilter`, `Buf` and `CONTINUE`, resolved where the macro is
// invoked (macro_rules paths are not hygienic), so each crate supplies its own ABI types.
//
// Cost: a response body chunk (and a trailer, a watermark event) still enters the module, as
// one native call that returns at once. The hooks cannot panic, so they need no panic guard.

/// Exports the unused hooks: request and response trailers, response body, the stream-level
/// callout and HTTP-stream hooks, the stream scheduler and the downstream watermarks.
macro_rules! envoy_noop_hooks {
    () => {
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
            _headers: *const ::std::ffi::c_void,
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
            _headers: *const ::std::ffi::c_void,
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
            _trailers: *const ::std::ffi::c_void,
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
    };
}
