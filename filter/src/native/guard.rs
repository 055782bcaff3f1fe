//! The panic guard: every hook that runs module code runs it under [`catch`], so a panic fails
//! the request (or the tick, or the config) instead of unwinding into Envoy, which would abort
//! the whole process (a Rust panic cannot cross an `extern "C"` boundary; there is no sandbox).
//!
//! What each hook does after a caught panic (exports.rs): a config that fails to load is
//! refused (NULL); a stream's request hooks fail closed with a local 500 (unless the glue had
//! already answered) and stop iteration, and its later request hooks stop too; its response
//! headers continue (the response is the worker's, or our 500); its end still releases its
//! load charge (the glue's `on_done`, guarded again); a tick or a callout answer is dropped (the
//! next tick retries). Each panic is counted: [`CAUGHT`] in the process, and the config's Envoy
//! counter [`PANICS_METRIC`] (`dynamicmodulescustom.prefix_router.native.panics`), and logged
//! to Envoy's stderr with the hook's name.
//!
//! Invariants after a panic: `RefCell` borrows are released by the unwind, the process store's
//! mutex tolerates poisoning (`process_store.rs`), and the thread's root is kept (a panic
//! part-way through a root call may leave its batched metrics or a peer batch incomplete; the
//! shared load is what the glue wrote, and a panicking stream's end still releases it). A panic
//! in a stream's `on_done` itself leaves that stream's charge in the shared load: native leases
//! never expire (see `process_store.rs`).
//!
//! The guard needs unwinding: a module built with `panic = "abort"` would abort at the panic,
//! guard or not, so the module refuses to build that way (`mod.rs`) and the workspace's release
//! profile unwinds (the `.wasm` target aborts by default whatever the profile says).
//!
//! Cost: `catch_unwind` is a call through a landing pad; when nothing panics it does no work
//! (no allocation, no atomic, no thread-local), so a hook pays nothing measurable for it.

use std::any::Any;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

/// Panics caught since the module was loaded, in every config and on every thread.
pub(crate) static CAUGHT: AtomicU64 = AtomicU64::new(0);

/// The module's own counter of caught panics (per config), defined next to the glue's metrics.
pub(crate) const PANICS_METRIC: &str = "prefix_router.native.panics";

/// Runs `f`; `None` when it panicked (counted in [`CAUGHT`] and logged with `hook`).
///
/// `AssertUnwindSafe`: what `f` mutates is either rebuilt by the caller on `None` (the stream is
/// marked failed) or stays consistent on its own (see the module docs).
#[inline(always)]
pub(crate) fn catch<R>(hook: &'static str, f: impl FnOnce() -> R) -> Option<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => Some(r),
        Err(payload) => {
            caught(hook, payload);
            None
        }
    }
}

#[cold]
#[inline(never)]
fn caught(hook: &'static str, payload: Box<dyn Any + Send>) {
    CAUGHT.fetch_add(1, Ordering::Relaxed);
    let msg = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string payload");
    // Not `eprintln!`, which panics when stderr cannot be written: nothing here may panic.
    let _ = writeln!(
        std::io::stderr(),
        "prefix-router: a panic in {hook} was caught ({msg}); the request fails closed"
    );
    // Dropping the payload runs its `Drop`, which could panic too.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_caught_counted_and_a_value_is_returned_otherwise() {
        let before = CAUGHT.load(Ordering::Relaxed);
        assert_eq!(catch("test", || 7), Some(7));
        assert_eq!(catch::<u32>("test", || panic!("boom")), None);
        assert_eq!(catch::<()>("test", || std::panic::panic_any(42u8)), None);
        // Other tests may panic meanwhile (on purpose): at least ours counted.
        assert!(CAUGHT.load(Ordering::Relaxed) >= before + 2);
    }
}
