//! Continuous-batching scheduler: one tokio task that advances the model step by step.
//!
//! Each iteration (like SGLang's `event_loop_normal`):
//! 1. take new requests into the waiting queue (FCFS);
//! 2. if some waiting requests can be admitted (running < `max_running_requests`, new prompt
//!    tokens of the batch <= `max_prefill_tokens`, KV room after LRU eviction), run a **prefill**
//!    batch: it takes `prefill_overhead_ms + uncached_tokens / prefill_tokens_per_sec`; then the
//!    prompts are inserted into the radix cache and every request of the batch gets its first
//!    token (TTFT = queue wait + prefill of uncached tokens);
//! 3. otherwise run one **decode** step for the running batch:
//!    `decode_base_ms * (1 + decode_batch_factor * (batch - 1))`, one token per request;
//!    finished requests insert prompt + output (minus the last token, whose KV was never
//!    computed) into the cache and unlock their path.
//!
//! Durations are multiplied by `time_scale`. The scheduler keeps a virtual clock (each step ends
//! at `previous end + duration`) so that coarse timer resolution does not inflate the simulated
//! rate; it never runs more than a few milliseconds ahead of real time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::config::Config;
use crate::metrics::Stats;
use crate::radix::{NodeId, RadixCache};

/// Progress of one request, sent by the scheduler (cumulative values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Index of the request within its HTTP request (batches).
    pub index: usize,
    /// Prompt tokens served from the cache.
    pub cached: usize,
    /// Output tokens produced so far.
    pub generated: usize,
    /// Generation is complete.
    pub finished: bool,
}

/// A request handed to the scheduler.
#[derive(Debug)]
pub struct SimRequest {
    pub index: usize,
    pub prompt: Vec<u32>,
    /// The full planned output (the scheduler only decides *when* tokens appear).
    pub output: Vec<u32>,
    pub tx: mpsc::UnboundedSender<Progress>,
    pub arrival: Instant,
    /// PD decode: the prompt's KV came from a prefill worker (no prefill compute here);
    /// the value is the prefill worker's cached prompt tokens, reported instead of ours.
    pub prefilled: Option<usize>,
}

/// Commands to the scheduler task.
#[derive(Debug)]
pub enum Cmd {
    Submit(SimRequest),
    /// Flush the cache; answers `false` (and does nothing) while requests run or wait.
    Flush(oneshot::Sender<bool>),
}

/// A request in the waiting queue with its uncached prompt tokens (estimated when it arrives,
/// refreshed when admission looks at it: SGLang's `num_matched_prefix_tokens` works the same way).
struct Waiting {
    req: SimRequest,
    uncached: usize,
}

struct Running {
    req: SimRequest,
    /// Locked cache node.
    node: NodeId,
    cached: usize,
    generated: usize,
    last_token: Instant,
}

/// Scheduler state (public for direct unit testing of the latency model).
pub struct Scheduler {
    cfg: Config,
    pub cache: RadixCache,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    /// KV tokens reserved for the outputs of running requests.
    reserved: usize,
    clock: Instant,
    stats: Arc<Mutex<Stats>>,
    decode_steps: u64,
    tput_mark: (Instant, u64),
}

impl Scheduler {
    pub fn new(cfg: Config, stats: Arc<Mutex<Stats>>) -> Self {
        let now = Instant::now();
        Scheduler {
            cfg,
            cache: RadixCache::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            clock: now,
            stats,
            decode_steps: 0,
            tput_mark: (now, 0),
        }
    }

    fn idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Submit(req) => {
                let uncached = req.prompt.len() - self.cache.peek_prefix(&req.prompt);
                self.waiting.push_back(Waiting { req, uncached });
            }
            Cmd::Flush(reply) => {
                let ok = self.idle();
                if ok {
                    self.cache.reset();
                    self.publish();
                }
                let _ = reply.send(ok);
            }
        }
    }

    /// Simulated time passes: sleep until the virtual clock reaches `ms` later.
    async fn advance(&mut self, ms: f64) {
        let d = ms * self.cfg.time_scale;
        let now = Instant::now();
        if d > 0.0 {
            self.clock += Duration::from_secs_f64(d / 1000.0);
        }
        // never build up more than 5 ms of debt (the process was busy or idle)
        if self.clock + Duration::from_millis(5) < now {
            self.clock = now;
        }
        if self.clock > now {
            tokio::time::sleep_until(self.clock.into()).await;
        } else {
            tokio::task::yield_now().await;
        }
    }

    /// Admits waiting requests into a prefill batch: (requests with their match, new tokens).
    fn form_prefill_batch(&mut self) -> (Vec<Running>, usize) {
        let mut batch = Vec::new();
        let mut new_tokens = 0usize;
        // requests whose client went away before being scheduled are dropped
        self.waiting.retain(|w| !w.req.tx.is_closed());
        while let Some(w) = self.waiting.front_mut() {
            if self.running.len() + batch.len() >= self.cfg.max_running_requests {
                break;
            }
            let (matched, node) = self.cache.match_prefix(&w.req.prompt);
            let uncached = w.req.prompt.len() - matched;
            w.uncached = uncached;
            let need = uncached + w.req.output.len();
            // KV transferred from a prefill worker costs no prefill compute here
            let compute = if w.req.prefilled.is_some() {
                0
            } else {
                uncached
            };
            if !batch.is_empty() && new_tokens + compute > self.cfg.max_prefill_tokens {
                break;
            }
            self.cache.inc_lock(node);
            let used = self.cache.total_size() + self.reserved;
            let avail = self.cfg.max_total_tokens.saturating_sub(used);
            if need > avail {
                self.cache.evict(need - avail);
                let used = self.cache.total_size() + self.reserved;
                if need > self.cfg.max_total_tokens.saturating_sub(used) {
                    self.cache.dec_lock(node);
                    break;
                }
            }
            // room for the uncached prompt tokens comes from the cache insert after prefill;
            // reserve it now together with the output.
            self.reserved += need;
            new_tokens += compute;
            let Some(Waiting { req, .. }) = self.waiting.pop_front() else {
                break;
            };
            batch.push(Running {
                req,
                node,
                cached: matched,
                generated: 0,
                last_token: Instant::now(),
            });
        }
        (batch, new_tokens)
    }

    /// Releases a request: unlock, release its reservation, optionally insert its tokens.
    fn release(&mut self, r: &Running, insert: bool) {
        if insert {
            let n = r.generated.min(r.req.output.len()).saturating_sub(1);
            let mut all = Vec::with_capacity(r.req.prompt.len() + n);
            all.extend_from_slice(&r.req.prompt);
            all.extend_from_slice(&r.req.output[..n]);
            self.cache.insert(&all);
        }
        self.cache.dec_lock(r.node);
        self.reserved = self.reserved.saturating_sub(r.req.output.len());
    }

    fn publish(&mut self) {
        let generated: usize = self.running.iter().map(|r| r.generated).sum();
        if let Ok(mut s) = self.stats.lock() {
            s.num_running = self.running.len();
            s.num_waiting = self.waiting.len();
            s.waiting_uncached_tokens = self.waiting.iter().map(|w| w.uncached).sum();
            s.waiting_tokens = self.waiting.iter().map(|w| w.req.prompt.len()).sum();
            s.used_tokens = self.cache.protected_size() + generated;
            s.cache_tokens = self.cache.total_size();
            s.evictable_tokens = self.cache.evictable_size();
        }
    }

    /// Runs one scheduling iteration. Returns false when there was nothing to do.
    pub async fn step(&mut self) -> bool {
        let (mut batch, new_tokens) = self.form_prefill_batch();
        if !batch.is_empty() {
            self.publish();
            let ms = if batch.iter().all(|r| r.req.prefilled.is_some()) {
                0.0
            } else {
                self.cfg.prefill_overhead_ms
                    + new_tokens as f64 * 1000.0 / self.cfg.prefill_tokens_per_sec
            };
            self.advance(ms).await;
            let now = Instant::now();
            let mut hit = 0usize;
            let mut total = 0usize;
            let mut finished = Vec::new();
            {
                for r in batch.iter_mut() {
                    // prompt KV is now computed: the reservation for it moves into the tree
                    let (_, node) = self.cache.insert(&r.req.prompt);
                    self.cache.inc_lock(node);
                    self.cache.dec_lock(r.node);
                    self.reserved = self.reserved.saturating_sub(r.req.prompt.len() - r.cached);
                    r.node = node;
                    r.generated = r.req.output.len().min(1);
                    r.last_token = now;
                    hit += r.cached;
                    total += r.req.prompt.len();
                }
            }
            let mut stats = self.stats.lock().ok();
            for r in batch {
                let done = r.generated >= r.req.output.len();
                let sent = r
                    .req
                    .tx
                    .send(Progress {
                        index: r.req.index,
                        cached: r.req.prefilled.unwrap_or(r.cached),
                        generated: r.generated,
                        finished: done,
                    })
                    .is_ok();
                if let Some(s) = stats.as_mut() {
                    s.ttft.observe((now - r.req.arrival).as_secs_f64());
                    s.prompt_tokens_total += r.req.prompt.len() as u64;
                    s.cached_tokens_total += r.cached as u64;
                    s.generation_tokens_total += r.generated as u64;
                    if done {
                        s.num_requests_total += 1;
                        s.e2e.observe((now - r.req.arrival).as_secs_f64());
                    }
                }
                if done || !sent {
                    finished.push((r, sent));
                } else {
                    self.running.push(r);
                }
            }
            if let Some(s) = stats.as_mut() {
                s.cache_hit_rate = if total > 0 {
                    hit as f64 / total as f64
                } else {
                    0.0
                };
            }
            drop(stats);
            for (r, _) in finished {
                self.release(&r, true);
            }
            self.publish();
            return true;
        }
        if self.running.is_empty() {
            return false;
        }
        let b = self.running.len() as f64;
        let ms = self.cfg.decode_base_ms * (1.0 + self.cfg.decode_batch_factor * (b - 1.0));
        self.advance(ms).await;
        let now = Instant::now();
        let running = std::mem::take(&mut self.running);
        let mut finished = Vec::new();
        let mut stats = self.stats.lock().ok();
        let mut produced = 0u64;
        for mut r in running {
            r.generated += 1;
            produced += 1;
            let done = r.generated >= r.req.output.len();
            let sent = r
                .req
                .tx
                .send(Progress {
                    index: r.req.index,
                    cached: r.req.prefilled.unwrap_or(r.cached),
                    generated: r.generated,
                    finished: done,
                })
                .is_ok();
            if let Some(s) = stats.as_mut() {
                s.itl.observe((now - r.last_token).as_secs_f64());
                if done {
                    s.num_requests_total += 1;
                    s.e2e.observe((now - r.req.arrival).as_secs_f64());
                }
            }
            r.last_token = now;
            if done || !sent {
                finished.push(r);
            } else {
                self.running.push(r);
            }
        }
        self.decode_steps += 1;
        if let Some(s) = stats.as_mut() {
            s.generation_tokens_total += produced;
            if self.decode_steps >= 40 {
                self.decode_steps = 0;
                let el = (now - self.tput_mark.0).as_secs_f64();
                let toks = s.generation_tokens_total - self.tput_mark.1;
                if el > 0.0 {
                    s.gen_throughput = toks as f64 / el;
                }
                self.tput_mark = (now, s.generation_tokens_total);
            }
        }
        drop(stats);
        for r in finished {
            self.release(&r, true);
        }
        self.publish();
        true
    }

    /// The scheduler task: runs until the command channel closes and no work is left.
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        loop {
            if self.idle() {
                match rx.recv().await {
                    Some(cmd) => {
                        self.clock = Instant::now();
                        self.tput_mark.0 = self.clock;
                        self.handle(cmd)
                    }
                    None => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            if !self.step().await {
                // waiting requests that cannot be admitted with nothing running cannot
                // happen (requests larger than the KV capacity are rejected up front);
                // guard against spinning anyway.
                if !self.waiting.is_empty() {
                    match rx.recv().await {
                        Some(cmd) => self.handle(cmd),
                        None => return,
                    }
                }
            }
        }
    }
}

/// Starts the scheduler task on the current runtime; returns its command sender.
pub fn spawn(cfg: Config, stats: Arc<Mutex<Stats>>) -> mpsc::UnboundedSender<Cmd> {
    let (tx, rx) = mpsc::unbounded_channel();
    let s = Scheduler::new(cfg, stats);
    tokio::spawn(s.run(rx));
    tx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer;

    fn cfg() -> Config {
        Config {
            time_scale: 0.0,
            ..Config::default()
        }
    }

    fn req(prompt: Vec<u32>, out: usize) -> (SimRequest, mpsc::UnboundedReceiver<Progress>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (output, _) = tokenizer::plan_output(&prompt, out, true);
        (
            SimRequest {
                index: 0,
                prompt,
                output,
                tx,
                arrival: Instant::now(),
                prefilled: None,
            },
            rx,
        )
    }

    async fn drain(s: &mut Scheduler) {
        while s.step().await {}
    }

    #[tokio::test(flavor = "current_thread")]
    async fn running_request_locks_its_prefix_and_finish_inserts_output() {
        let stats = Arc::new(Mutex::new(Stats::new(1000)));
        let mut s = Scheduler::new(cfg(), stats.clone());
        let prompt: Vec<u32> = (0..100).collect();
        let (r, mut rx) = req(prompt.clone(), 3);
        s.handle(Cmd::Submit(r));
        assert!(s.step().await); // prefill
        let p = rx.recv().await.unwrap();
        assert_eq!((p.cached, p.generated, p.finished), (0, 1, false));
        assert_eq!(s.cache.protected_size(), 100);
        assert_eq!(
            s.cache.evict(usize::MAX),
            0,
            "running request's prefix is locked"
        );
        drain(&mut s).await;
        assert_eq!(s.cache.protected_size(), 0);
        // prompt + 2 of 3 output tokens inserted
        assert_eq!(s.cache.total_size(), 102);
        let st = stats.lock().unwrap().clone();
        assert_eq!(st.num_requests_total, 1);
        assert_eq!(st.generation_tokens_total, 3);
        assert_eq!(st.prompt_tokens_total, 100);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn second_request_hits_cache() {
        let stats = Arc::new(Mutex::new(Stats::new(1000)));
        let mut s = Scheduler::new(cfg(), stats.clone());
        let prompt: Vec<u32> = (0..100).collect();
        let (r, _rx) = req(prompt.clone(), 2);
        s.handle(Cmd::Submit(r));
        drain(&mut s).await;
        let (r, mut rx) = req(prompt, 2);
        s.handle(Cmd::Submit(r));
        drain(&mut s).await;
        assert_eq!(rx.recv().await.unwrap().cached, 100);
        assert_eq!(stats.lock().unwrap().cached_tokens_total, 100);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn capacity_limits_admission_and_evicts_lru() {
        let stats = Arc::new(Mutex::new(Stats::new(300)));
        let c = Config {
            max_total_tokens: 300,
            ..cfg()
        };
        let mut s = Scheduler::new(c, stats);
        // two requests of 100 prompt + 50 output fit; a third must wait
        let mut rxs = Vec::new();
        for k in 0..3u32 {
            let (r, rx) = req((k * 1000..k * 1000 + 100).collect(), 50);
            s.handle(Cmd::Submit(r));
            rxs.push(rx);
        }
        assert!(s.step().await);
        assert_eq!(s.running.len(), 2);
        assert_eq!(s.waiting.len(), 1);
        drain(&mut s).await;
        assert!(s.idle());
        assert!(s.cache.total_size() <= 300);
        // the third ran after evicting the oldest finished request
        assert!(rxs[2].recv().await.is_some());
        let first: Vec<u32> = (0..100).collect();
        assert_eq!(s.cache.match_prefix(&first).0, 0, "oldest entry evicted");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn max_running_requests_is_respected() {
        let stats = Arc::new(Mutex::new(Stats::new(100_000)));
        let c = Config {
            max_running_requests: 2,
            ..cfg()
        };
        let mut s = Scheduler::new(c, stats);
        let mut rxs = Vec::new();
        for k in 0..5u32 {
            let (r, rx) = req(vec![k + 1; 10], 4);
            s.handle(Cmd::Submit(r));
            rxs.push(rx);
        }
        assert!(s.step().await);
        assert_eq!(s.running.len(), 2);
        assert_eq!(s.waiting.len(), 3);
        drain(&mut s).await;
        assert!(s.idle());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn flush_refused_while_busy() {
        let stats = Arc::new(Mutex::new(Stats::new(1000)));
        let mut s = Scheduler::new(cfg(), stats);
        let (r, _rx) = req((0..10).collect(), 5);
        s.handle(Cmd::Submit(r));
        let (tx, rx) = oneshot::channel();
        s.handle(Cmd::Flush(tx));
        assert!(!rx.await.unwrap());
        drain(&mut s).await;
        let (tx, rx) = oneshot::channel();
        s.handle(Cmd::Flush(tx));
        assert!(rx.await.unwrap());
        assert_eq!(s.cache.total_size(), 0);
    }
}
