//! A small proxy-wasm ABI 0.2.1 host on wasmtime: enough of Envoy to load the real
//! `prefix_router.wasm` and drive it like Envoy's worker threads do.
//!
//! * [`Host`]: one "Envoy process": the compiled module, ONE shared-data store (Envoy semantics:
//!   a get returns value + CAS token; `cas == 0` sets unconditionally; a stale token fails with
//!   `CasMismatch`; a CAS on a missing key inserts; no deletes) and one stats registry, shared by
//!   every VM created from it, across threads.
//! * [`Vm`]: one Wasm VM (one Envoy worker thread): root context configured with the plugin
//!   configuration; [`Vm::request`] runs a stream's request callbacks and returns what the filter
//!   did; [`Vm::finish`] ends the stream (`on_response_headers`, `on_done`, `on_log`,
//!   `on_delete`, in Envoy's order); [`Vm::roundtrip`] does both.
//!
//! Host functions implemented: header maps (get/set/add/replace/remove/pairs), buffers (request
//! body, plugin and VM configuration), shared data, properties (a settable map), metrics
//! (define/increment/record/get), log, tick period, current time (settable clock),
//! send_local_response, set_effective_context, continue/close stream, done; WASI
//! `environ_get`, `environ_sizes_get`, `fd_write` (captured as logs), `proc_exit` (trap). Any other
//! import the module declares answers `Unimplemented` (status 12).
//!
//! Files: [`shared`] (shared data, stats), [`wasm_file`] (locating and building the `.wasm`,
//! its export list), [`vm`] (the VM driver), `memory` (ABI memory helpers), `hostfns` (the host
//! functions).
//!
//! Fuel: with [`Options::fuel`] each call's wasmtime fuel (≈ Wasm instructions) is counted and
//! reported in [`Response::fuel`].

mod hostfns;
mod memory;
pub mod shared;
pub mod vm;
pub mod wasm_file;

pub use shared::{LoadLease, SharedData, Stats};
pub use vm::Host;
pub use vm::{HttpCall, LocalResponse, Options, Response, State, Vm};
pub use wasm_file::{default_wasm_path, filter_wasm, wasm_exports};

/// proxy-wasm status codes.
pub mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const CAS_MISMATCH: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
}

pub(crate) const MAP_REQUEST_HEADERS: i32 = 0;
pub(crate) const MAP_RESPONSE_HEADERS: i32 = 2;
pub(crate) const MAP_HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
pub(crate) const BUFFER_REQUEST_BODY: i32 = 0;
pub(crate) const BUFFER_HTTP_CALL_RESPONSE_BODY: i32 = 4;
pub(crate) const BUFFER_VM_CONFIGURATION: i32 = 6;
pub(crate) const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;
pub(crate) const ROOT_CONTEXT: i32 = 1;
