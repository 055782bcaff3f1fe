//! A filter config as the module keeps it, and the per-thread [`Root`]s that run it.
//!
//! Envoy calls config hooks on its main thread and stream hooks on its worker threads. Each
//! thread keeps its own [`Root`] per config (what a Wasm VM is per thread: the glue's roots are
//! `Rc`/`RefCell` inside, never shared across threads), created at the thread's first stream of
//! that config and ticked lazily at stream starts; the process store is what every thread
//! reads and writes.
//!
//! Invariants: a root is only ever touched by its own thread (thread-local list); a config is
//! named by a process-unique id, never by its address (a freed config's address can be reused
//! by the next one; its id cannot). Costs: finding a thread's root is a scan of at most
//! [`ROOTS_PER_THREAD`] ids per hook; a root is created (the config parsed again) once per
//! thread and config.

use super::ffi::Abi;
use super::host::{Defined, Native};
use super::timer::{Timer, TICK};
use crate::glue::Root;
use std::cell::RefCell;
use std::ffi::c_void;
use std::time::Instant;

/// Roots a thread keeps (configs replaced by updates leave theirs behind; the oldest goes).
const ROOTS_PER_THREAD: usize = 4;

/// A filter config: its JSON (every thread's [`Root`] parses it again, as each Wasm VM does), a
/// process-unique id naming it in the threads' root lists, Envoy's config pointer and the
/// metrics defined for it.
pub(crate) struct ModuleConfig {
    pub(crate) id: u64,
    pub(crate) json: Vec<u8>,
    pub(crate) envoy: *mut c_void,
    /// The main thread's timer (`exports::needs_timer`: load polls, pool memberships, peer
    /// batches; absent when the config has none of them). Only held:
    /// dropping it with the config stops it.
    pub(crate) _timer: Option<Timer>,
    /// (name, kind, Envoy's id); a metric's id in [`crate::host::Host`] is its position plus
    /// one. Written only in `on_http_filter_config_new` (Envoy allows defining metrics only
    /// there), read from every worker thread afterwards.
    pub(crate) metrics: Vec<Defined>,
    /// Envoy's id of the module's own counter of caught panics (`guard::PANICS_METRIC`; 0:
    /// Envoy refused it), kept apart from the glue's metrics.
    pub(crate) panics: usize,
}

struct ThreadRoot {
    config: u64,
    root: Root,
    last_tick: Instant,
}

thread_local! {
    static ROOTS: RefCell<Vec<ThreadRoot>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's root of `config` (created, configured and ticked as needed;
/// `tick` forces a tick: the timer's event).
pub(crate) fn with_root<A: Abi, R>(
    config: &ModuleConfig,
    h: &Native<A>,
    tick: bool,
    f: impl FnOnce(&mut Root) -> R,
) -> R {
    ROOTS.with(|roots| {
        let mut roots = roots.borrow_mut();
        let i = match roots.iter().position(|r| r.config == config.id) {
            Some(i) => i,
            None => {
                if roots.len() >= ROOTS_PER_THREAD {
                    roots.remove(0);
                }
                let mut root = Root::new();
                root.on_configure(h, config.json.len());
                roots.push(ThreadRoot {
                    config: config.id,
                    root,
                    last_tick: Instant::now(),
                });
                roots.len() - 1
            }
        };
        let Some(tr) = roots.get_mut(i) else {
            let mut root = Root::new();
            return f(&mut root);
        };
        if tick || tr.last_tick.elapsed() >= TICK {
            tr.last_tick = Instant::now();
            tr.root.on_tick(h);
        }
        f(&mut tr.root)
    })
}

/// Drops this thread's root of config `id` (the config is being destroyed).
pub(crate) fn forget(id: u64) {
    ROOTS.with(|r| r.borrow_mut().retain(|t| t.config != id));
}
