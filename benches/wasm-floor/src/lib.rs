//! The floor of any body-routing proxy-wasm filter in Envoy: the same callbacks and stop /
//! buffer pattern as prefix-router, and the two host calls no such filter can skip (read the
//! body, set the cluster header), with no parsing, hashing or shared data. `benches/overhead`
//! runs it as kind `wasm_floor`, so prefix-router's own cost is prefix-router minus this, and
//! Envoy's Wasm plumbing is this minus plain Envoy.
//!
//! Two builds: by default the lean `extern "C"` layer exporting the same callbacks as
//! prefix-router (`lean`); with `--features sdk` the proxy-wasm Rust SDK, whose dispatcher exports
//! every `proxy_on_*` callback, so Envoy also enters the VM for every response body chunk
//! (`sdk`, kind `wasm_floor_sdk`).

#[cfg(all(target_arch = "wasm32", not(feature = "sdk")))]
mod lean;
#[cfg(feature = "sdk")]
mod sdk;

/// The header prefix-router sets; the bench's route picks the cluster it names.
pub const CLUSTER_HEADER: &str = "x-prefix-router-cluster";
