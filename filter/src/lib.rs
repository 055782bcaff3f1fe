//! prefix-router: cache-aware routing of LLM inference requests inside Envoy.
//!
//! The pure core (everything but `glue`) is plain Rust over the [`store::Store`] trait, tested
//! natively; `glue` is the thin proxy-wasm layer compiled only for Wasm.

pub mod blocks;
pub mod busy;
pub mod config;
mod config_path;
pub mod index;
pub mod load;
pub mod pd;
pub mod peers;
pub mod policy;
pub mod poll;
pub mod records;
pub mod request;
pub mod router;
pub mod store;

#[cfg(target_arch = "wasm32")]
mod glue;
