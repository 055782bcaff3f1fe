//! sglang-sim: a simulated SGLang worker for routing tests (see `sim/README.md`).

pub mod api;
pub mod config;
pub mod metrics;
pub mod radix;
pub mod sched;
pub mod server;
pub mod tokenizer;
