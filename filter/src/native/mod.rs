//! The native build: the same core and `glue` as the `.wasm`, loaded into Envoy 1.40 as a
//! dynamic module (`envoy.filters.http.dynamic_modules`, ABI `v0.2.0`) through a hand-written
//! `extern "C"` layer (`cargo build -p prefix-router --release --features dynamic-module` gives
//! `target/release/libprefix_router.so`). docs/design.md, "The native module", says
//! why (the V8 boundary is most of the Wasm build's per-request cost) and how every ABI fact
//! used here was checked against the shipped binary.
//!
//! Status: experimental, opt-in (`envoy/gen --native`); the `.wasm` stays the default. It runs
//! every feature of the Wasm build:
//! - load polls and peer batches go out from Envoy's main thread (a timer thread of ours commits
//!   to the config's scheduler; the calls are config-level callouts, which must all start on one
//!   thread): worker threads hand their peer records to it through the process store
//!   (`peers::Outbox::hand_off`, at each stream end);
//! - prefill/decode's body rewrite drains Envoy's request body and appends the new one
//!   (`drain_body` / `append_body`, on the buffered body when there is one);
//! - metrics are Envoy stats named `dynamicmodulescustom.<name>` (the Wasm build's names carry no
//!   prefix), defined while the config is created (the only time Envoy allows it);
//! - no sandbox: a crash here takes Envoy down (no Wasm VM, no `FAIL_RELOAD`); a panic does not:
//!   every hook that runs module code is under the panic guard ([`guard`]), which fails that
//!   request closed (a local 500), counts the panic (`prefix_router.native.panics`) and logs it.
//!
//! The rooms, one concept each:
//! - [`ffi`]: the ABI's types, constants and imported callbacks, behind the [`ffi::Abi`]
//!   function table ([`ffi::Envoy`] in production, a fake Envoy in the tests);
//! - [`host`]: [`host::Native`], the glue's `Host` over that table for one hook;
//! - [`roots`]: a filter config as the module keeps it, and each thread's glue root of it;
//! - [`timer`]: the main thread's tick (Envoy has no timer for HTTP-filter modules);
//! - [`guard`]: the panic guard, and what each hook does after a panic;
//! - [`exports`]: the hooks Envoy calls, and `noop_hooks` the ones it requires but the module
//!   does not use (shared with `benches/dm-floor`);
//! - [`lb`]: the same module as a pool cluster's load balancer (opt-in: `envoy/gen --native-lb`).
//!
//! Threads: Envoy calls the config hooks on its main thread and the stream hooks on its worker
//! threads. Each worker thread keeps its own glue root per filter config (what a Wasm VM is per
//! thread), created at the thread's first stream and ticked lazily at stream starts; the
//! process store (`process_store.rs`) is the process-wide shared data every thread reads and
//! writes.

// The panic guard (guard.rs) only works where a panic unwinds: with `panic = "abort"` a panic
// in any hook would abort Envoy, guard or not. Refuse that build rather than ship a guard that
// cannot catch (the workspace's release profile unwinds; the `.wasm` target always aborts).
#[cfg(panic = "abort")]
compile_error!(
    "the native module (feature `dynamic-module`) must be built with panic = \"unwind\" \
     (its panic guard relies on it)"
);

#[macro_use]
mod noop_hooks;

mod exports;
mod ffi;
mod guard;
mod host;
mod lb;
mod roots;
mod timer;

#[cfg(test)]
mod fake;
