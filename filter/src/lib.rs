//! prefix-router: cache-aware routing of LLM inference requests inside Envoy.
//!
//! The pure core is plain Rust over the [`store::Store`] trait; [`glue`] drives it from a
//! stream's callbacks over the [`host::Host`] trait; both are tested natively (`host::FakeHost`).
//! Two layers implement `Host` for Envoy: `abi`, the shipped `.wasm`'s exported proxy-wasm
//! callbacks (only the ones the filter needs) and host-call imports, and `native` (feature
//! `dynamic-module`, experimental), the same as an Envoy dynamic module. Besides `abi`, only the
//! Wasm SIMD steps are Wasm-specific (`xxh3.rs`, `id_chunks.rs`, `blocks.rs`: `simd128`, with a
//! portable path for every other build; `harness/tests` checks the `.wasm`'s results against it).

pub mod block_memo;
pub mod blocks;
pub mod busy;
pub mod charge;
pub mod config;
mod config_path;
pub mod decay;
pub mod footprint;
pub mod glue;
pub mod header_pairs;
pub mod hits;
pub mod host;
pub mod id_chunks;
pub mod ids;
pub mod index;
pub mod load;
pub mod load_answer;
pub mod membership;
pub mod metrics;
pub mod pd_body;
pub mod peer_flush;
pub mod peers;
pub mod placements;
pub mod policy;
pub mod poll;
pub mod poll_lease;
pub mod poller;
#[cfg(not(target_arch = "wasm32"))]
pub mod process_store;
pub mod records;
pub mod request;
pub mod router;
pub mod schedule;
pub mod served;
pub mod sharers;
pub mod store;
pub mod xxh3;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(all(feature = "dynamic-module", not(target_arch = "wasm32")))]
mod native;
