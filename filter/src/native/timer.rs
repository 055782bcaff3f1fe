//! The main thread's clock. Envoy has no timer for HTTP-filter modules: a thread of ours sleeps a
//! tick and commits an event to the config's scheduler, which Envoy runs as
//! `on_http_filter_config_scheduled` on its main thread (committing is safe from any thread; an
//! HTTP call is not, so load polls and peer batches start there, from that event).
//!
//! Invariants: the scheduler outlives the thread (the thread is stopped and joined before the
//! scheduler is deleted, in `Drop`), and the thread only ever commits, so it never touches the
//! config or any root. Cost: one sleeping thread per config that needs calls (load polls, pool
//! memberships, peer batches), one commit (an
//! Envoy dispatcher post) per tick; nothing on a stream's path.

use super::ffi::Abi;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The tick: what the Wasm build's timer does every 50 ms. Worker threads, which have no timer,
/// tick lazily at stream starts at least this far apart (`roots::with_root`).
pub(crate) const TICK: Duration = Duration::from_millis(50);

/// A running timer thread and its scheduler; dropping it stops both.
pub(crate) struct Timer {
    scheduler: SendPtr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The table's delete (the timer is not generic, so a config stores it without naming the
    /// table).
    delete: unsafe fn(*mut c_void),
}

/// Envoy's scheduler handle, which Envoy lets any thread commit to.
#[derive(Clone, Copy)]
struct SendPtr(*mut c_void);
// SAFETY: the scheduler is only committed to (thread-safe in Envoy) and deleted after the timer
// thread has been joined.
unsafe impl Send for SendPtr {}

impl Timer {
    /// Starts ticking `config`'s scheduler every `period`; `None` when Envoy gives no scheduler.
    /// A thread that cannot be spawned leaves a timer that never ticks (as before the split:
    /// polls then never run, and routing goes on without them).
    ///
    /// # Safety
    /// `config` is Envoy's config pointer during `on_http_filter_config_new`.
    pub(crate) unsafe fn start<A: Abi>(config: *mut c_void, period: Duration) -> Option<Timer> {
        let scheduler = A::scheduler_new(config);
        if scheduler.is_null() {
            return None;
        }
        let ptr = SendPtr(scheduler);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("prefix-router-tick".into())
            .spawn(move || {
                let p = ptr;
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(period);
                    // SAFETY: the scheduler outlives this thread (joined before the delete).
                    unsafe { A::scheduler_commit(p.0, 1) };
                }
            })
            .ok();
        Some(Timer {
            scheduler: ptr,
            stop,
            thread,
            delete: A::scheduler_delete,
        })
    }
}

impl Drop for Timer {
    /// Waits up to one tick for the thread's last commit (the config is being destroyed on the
    /// main thread, which is therefore not running a scheduled event meanwhile).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // SAFETY: no commit can follow: the only committer has been joined.
        unsafe { (self.delete)(self.scheduler.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeEnvoy;
    use super::*;

    #[test]
    fn the_timer_commits_every_tick_and_stops_before_its_scheduler_is_deleted() {
        let fake = FakeEnvoy::new();
        // SAFETY: the fake outlives the timer (dropped below).
        let t = unsafe { Timer::start::<FakeEnvoy>(fake.ptr(), Duration::from_millis(5)) };
        let t = t.expect("a scheduler");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while fake.commits.load(Ordering::Relaxed) < 3 {
            assert!(std::time::Instant::now() < deadline, "no commits");
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(t);
        let after = fake.commits.load(Ordering::Relaxed);
        assert_eq!(fake.state().schedulers_deleted, 1);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(fake.commits.load(Ordering::Relaxed), after, "joined");
    }

    #[test]
    fn no_scheduler_no_timer() {
        let fake = FakeEnvoy::new();
        fake.state().no_scheduler = true;
        // SAFETY: the fake is alive; no timer is made.
        assert!(unsafe { Timer::start::<FakeEnvoy>(fake.ptr(), TICK) }.is_none());
        assert_eq!(fake.state().schedulers_deleted, 0);
    }
}
