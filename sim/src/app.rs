//! Shared server state: the settings, the scheduler's queue, stats, PD rooms, in-flight count.
//! Every handler module reads it; it knows nothing of HTTP routing (`server` does that).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::header::HeaderValue;
use tokio::sync::mpsc;

use crate::config::Config;
use crate::metrics::Stats;
use crate::pd::Disagg;
use crate::sched::{self, Cmd};
use crate::tokenizer;

/// Request bodies larger than this are refused (400).
pub const MAX_BODY: usize = 64 << 20;

/// Shared server state.
pub struct App {
    pub cfg: Config,
    pub stats: Arc<Mutex<Stats>>,
    pub(crate) sched: mpsc::UnboundedSender<Cmd>,
    pub draining: AtomicBool,
    /// Prefill/decode disaggregation state (rooms, transfer counters).
    pub disagg: Disagg,
    /// Inference requests not yet fully answered (bodies included).
    pub inflight: AtomicUsize,
    pub(crate) req_counter: AtomicU64,
    pub(crate) worker_header: HeaderValue,
    pub(crate) started: u64,
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl App {
    /// Creates the state and spawns the scheduler task (call inside a tokio runtime).
    pub fn new(cfg: Config) -> Arc<App> {
        let disagg = Disagg::new(Duration::from_secs_f64(cfg.disaggregation_timeout_s));
        let stats = Arc::new(Mutex::new(Stats::new(cfg.max_total_tokens)));
        let sched = sched::spawn(cfg.clone(), stats.clone());
        let worker_header = HeaderValue::from_str(&cfg.worker_id)
            .unwrap_or_else(|_| HeaderValue::from_static("invalid-worker-id"));
        Arc::new(App {
            cfg,
            stats,
            sched,
            draining: AtomicBool::new(false),
            disagg,
            inflight: AtomicUsize::new(0),
            req_counter: AtomicU64::new(0),
            worker_header,
            started: unix_now(),
        })
    }

    pub(crate) fn next_id(&self) -> String {
        let n = self.req_counter.fetch_add(1, Ordering::Relaxed);
        format!(
            "{:016x}{:016x}",
            tokenizer::mix(self.cfg.seed ^ self.cfg.port as u64),
            tokenizer::mix(n)
        )
    }

    /// Scheduler queue sizes (running, waiting).
    pub fn load(&self) -> (usize, usize, usize) {
        match self.stats.lock() {
            Ok(s) => (s.num_running, s.num_waiting, s.used_tokens),
            Err(_) => (0, 0, 0),
        }
    }
}

/// Decrements `inflight` when dropped (kept by handlers and by streaming bodies).
pub(crate) struct InflightGuard(Arc<App>);

impl InflightGuard {
    pub(crate) fn new(app: &Arc<App>) -> Self {
        app.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard(app.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}
