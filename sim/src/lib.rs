//! sglang-sim: a simulated SGLang worker for routing tests (see `sim/README.md`).

mod admin;
pub mod api;
pub mod app;
pub mod bootstrap;
pub mod config;
mod inference;
mod loads;
pub mod metrics;
mod openai;
pub mod pd;
pub mod radix;
pub mod response;
pub mod sched;
mod seq;
pub mod server;
pub mod tokenizer;
