//! Continuous-batching scheduler: one tokio task that advances the model step by step, shaped
//! after SGLang's `Scheduler.event_loop_normal` (`python/sglang/srt/managers/scheduler.py`) and
//! `PrefillAdder` (`schedule_policy.py`). Each iteration:
//!
//! 1. take new requests into the FCFS waiting queue;
//! 2. try to form a **prefill** batch (`get_new_batch_prefill`): first the in-progress chunked
//!    request's next chunk, then waiting requests in order while
//!    running + batch < `max_running_requests`, the new tokens fit the chunk budget
//!    (`chunked_prefill_size`; without chunking `max_prefill_tokens`, the first request always
//!    admitted) and the KV budget: `prompt tokens to compute + min(max_new_tokens, 4096)` must fit
//!    in `capacity - locked tokens - running requests' decode KV - reserved`, where running
//!    requests reserve `min(max_new - generated, 4096) * new_token_ratio` and this batch's
//!    requests their full estimate. A prompt whose uncached part does not fit the remaining chunk
//!    budget is cut: it becomes *the* chunked request and is continued first by the next prefill
//!    batches. A batch takes `prefill_overhead_ms + work / prefill_tokens_per_sec`, where each
//!    request's `work` is its computed tokens times `1 + prefill_context_per_1k_tokens * c / 1000`
//!    for the `c` tokens of its context already in the KV (cached prefix and earlier chunks):
//!    attention to the context makes each new token dearer (the H200 table in `sim/README.md`);
//!    a request whose last chunk was in it gets its first token (TTFT);
//! 3. otherwise run one **decode** step for the running batch (`update_running_batch`): if the
//!    free KV (after evicting) cannot hold one token per request, **retract** requests (fewest
//!    generated tokens first, then longest prompt) back to the waiting queue until 20 tokens per
//!    remaining request fit, and raise `new_token_ratio`; else decay it. The step takes
//!    `decode_base_ms * (1 + decode_batch_factor * (batch - 1))` plus
//!    `decode_kv_ms_per_1k_tokens` per 1000 tokens of context (prompt + generated) of the running
//!    requests; finished requests insert prompt + output (minus the last token, whose KV was
//!    never computed) into the cache and unlock their path.
//!
//! Prefill always goes first (SGLang's default), so a long chunked prompt stalls decoding until
//! its last chunk, unless `enable_mixed_chunk` (the running batch decodes inside each prefill
//! batch) or `max_consecutive_prefill_batches` (a decode turn after N prefill batches) is set.
//!
//! Durations are multiplied by `time_scale`. The scheduler keeps a virtual clock (each step ends
//! at `previous end + duration`) so that coarse timer resolution does not inflate the simulated
//! rate; it never runs more than a few milliseconds ahead of real time.

use std::cmp::Reverse;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::config::Config;
use crate::metrics::Stats;
use crate::radix::RadixCache;
use crate::seq::Seq;
pub use crate::seq::{Cmd, Progress, SimRequest, CLIP_MAX_NEW_TOKENS};

/// SGLang's `SGLANG_RETRACT_DECODE_STEPS`: retraction frees room for this many decode steps.
pub const RETRACT_DECODE_STEPS: usize = 20;
/// SGLang's `SGLANG_INIT_NEW_TOKEN_RATIO` (times `--schedule-conservativeness`, at most 1).
pub const INIT_NEW_TOKEN_RATIO: f64 = 0.7;
/// SGLang's `SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR`: the floor is this fraction of the initial ratio.
pub const MIN_NEW_TOKEN_RATIO_FACTOR: f64 = 0.14;
/// SGLang's `SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS`: decode steps from the initial ratio to the floor.
pub const NEW_TOKEN_RATIO_DECAY_STEPS: f64 = 600.0;
/// SGLang's `--decode-log-interval`: decode steps between two stats points (gen throughput,
/// cache hit rate reset, retraction count).
pub const DECODE_LOG_INTERVAL: u64 = 40;

/// One request of a prefill batch: how many of its tokens this batch computes, and its cached
/// prefix when this is its first chunk (0 for a continued chunk, as SGLang counts it).
struct Item {
    seq: Seq,
    extend: usize,
    hit: usize,
}

struct PrefillBatch {
    items: Vec<Item>,
    /// The running batch decodes one token in this forward (`--enable-mixed-chunk`).
    mixed: bool,
}

/// What the last step was (for tests and `server_info`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepKind {
    Prefill,
    Mixed,
    Decode,
}

/// The last step: kind, simulated duration (ms, before `time_scale`), requests in the forward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepInfo {
    pub kind: StepKind,
    pub ms: f64,
    pub batch: usize,
}

/// Scheduler state (public for direct unit testing of the latency model).
pub struct Scheduler {
    cfg: Config,
    pub cache: RadixCache,
    waiting: VecDeque<Seq>,
    /// The request being prefilled in chunks (SGLang's `chunked_req`): in neither the waiting
    /// queue nor the running batch; continued first by every prefill batch.
    chunked: Option<Seq>,
    running: Vec<Seq>,
    new_token_ratio: f64,
    init_new_token_ratio: f64,
    min_new_token_ratio: f64,
    new_token_ratio_decay: f64,
    /// SGLang's `running_batch.batch_is_full`: admission failed for lack of KV or slots; no
    /// prefill is tried again until a request leaves the running batch.
    batch_is_full: bool,
    consecutive_prefill: usize,
    clock: Instant,
    stats: Arc<Mutex<Stats>>,
    decode_steps: u64,
    /// Tokens produced (all kinds of steps), for the generation throughput.
    produced: u64,
    tput_mark: (Instant, u64),
    retracted_since_log: usize,
    retractions_total: u64,
    last_step: Option<StepInfo>,
}

impl Scheduler {
    pub fn new(cfg: Config, stats: Arc<Mutex<Stats>>) -> Self {
        let now = Instant::now();
        let init = (INIT_NEW_TOKEN_RATIO * cfg.schedule_conservativeness).min(1.0);
        let min = (init * MIN_NEW_TOKEN_RATIO_FACTOR).min(1.0);
        Scheduler {
            cfg,
            cache: RadixCache::new(),
            waiting: VecDeque::new(),
            chunked: None,
            running: Vec::new(),
            new_token_ratio: init,
            init_new_token_ratio: init,
            min_new_token_ratio: min,
            new_token_ratio_decay: (init - min) / NEW_TOKEN_RATIO_DECAY_STEPS,
            batch_is_full: false,
            consecutive_prefill: 0,
            clock: now,
            stats,
            decode_steps: 0,
            produced: 0,
            tput_mark: (now, 0),
            retracted_since_log: 0,
            retractions_total: 0,
            last_step: None,
        }
    }

    fn idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.chunked.is_none()
    }

    /// The last step run (None before the first).
    pub fn last_step(&self) -> Option<StepInfo> {
        self.last_step
    }

    /// The current `new_token_ratio`.
    pub fn new_token_ratio(&self) -> f64 {
        self.new_token_ratio
    }

    /// KV tokens held by running requests outside the tree (their decode tokens).
    fn held_total(&self) -> usize {
        self.running.iter().map(Seq::held).sum()
    }

    /// KV slots in use: the tree (cached, locked or not) plus running requests' decode tokens.
    pub fn kv_in_use(&self) -> usize {
        self.cache.total_size() + self.held_total()
    }

    fn available(&self) -> usize {
        self.cfg.max_total_tokens.saturating_sub(self.kv_in_use())
    }

    /// Evicts until `n` slots are free (or nothing evictable is left); true when they are.
    fn make_room(&mut self, n: usize) -> bool {
        let avail = self.available();
        if avail < n {
            self.cache.evict(n - avail);
        }
        self.available() >= n
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Submit(req) => {
                let uncached = req.prompt.len() - self.cache.peek_prefix(&req.prompt);
                self.waiting.push_back(Seq::new(req, uncached));
            }
            Cmd::Flush(reply) => {
                let ok = self.idle();
                if ok {
                    self.cache.reset();
                    self.publish(0);
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

    /// Decode step time for the running batch: weights + per-request work + KV read.
    fn decode_ms(&self) -> f64 {
        let b = self.running.len() as f64;
        let ctx: usize = self.running.iter().map(Seq::fill_len).sum();
        self.cfg.decode_base_ms * (1.0 + self.cfg.decode_batch_factor * (b - 1.0))
            + self.kv_read_ms(ctx)
    }

    /// Prefill work of `new` tokens that attend to `context` tokens already in the KV, in
    /// zero-context tokens: each costs `1 + prefill_context_per_1k_tokens * context / 1000`.
    pub fn prefill_work(&self, new: usize, context: usize) -> f64 {
        new as f64 * (1.0 + self.cfg.prefill_context_per_1k_tokens * context as f64 / 1000.0)
    }

    fn kv_read_ms(&self, ctx_tokens: usize) -> f64 {
        self.cfg.decode_kv_ms_per_1k_tokens * ctx_tokens as f64 / 1000.0
    }

    /// KV budget left for admission (SGLang's `rem_total_tokens`): free + evictable slots minus
    /// what running requests and this batch are expected to need.
    fn rem_total(&self, held: usize, offset: f64) -> f64 {
        self.cfg.max_total_tokens as f64 - self.cache.protected_size() as f64 - held as f64 - offset
    }

    /// Forms the next prefill batch (SGLang's `get_new_batch_prefill` + `PrefillAdder`).
    fn form_prefill_batch(&mut self) -> Option<PrefillBatch> {
        // requests whose client went away before being scheduled are dropped
        self.waiting.retain(|w| !w.req.tx.is_closed());
        if self.chunked.as_ref().is_some_and(|c| c.req.tx.is_closed()) {
            if let Some(node) = self.chunked.take().and_then(|c| c.node) {
                self.cache.dec_lock(node);
            }
        }
        if self.running.is_empty() {
            self.batch_is_full = false;
        }
        if (self.batch_is_full || self.waiting.is_empty()) && self.chunked.is_none() {
            return None;
        }
        let running_bs = self.running.len();
        let max_running = self.cfg.max_running_requests;
        if running_bs >= max_running {
            self.batch_is_full = true;
            return None;
        }
        // SGLang (FCFS) matches every waiting request against the tree at each prefill attempt
        for w in self.waiting.iter_mut() {
            let fill = w.fill();
            w.uncached = fill.len() - self.cache.peek_prefix(&fill);
        }
        let mixed = self.cfg.enable_mixed_chunk && running_bs > 0;
        let mixed_tokens = if mixed { running_bs } else { 0 };
        let chunking = self.cfg.chunked_prefill_size > 0;
        let mut rem_chunk: i64 = if chunking {
            self.cfg.chunked_prefill_size - mixed_tokens as i64
        } else {
            i64::MAX
        };
        let mut rem_input: i64 = self.cfg.max_prefill_tokens as i64 - mixed_tokens as i64;
        let held = self.held_total();
        let ratio = self.new_token_ratio;
        let mut offset: f64 = mixed_tokens as f64
            + self
                .running
                .iter()
                .map(|r| r.max_new_left() as f64 * ratio)
                .sum::<f64>();
        let mut items: Vec<Item> = Vec::new();
        let mut slots = mixed_tokens;

        // 1. the chunked request's next chunk (SGLang's `add_chunked_req`)
        if let Some(c) = self.chunked.take() {
            let remaining = c.fill_len() - c.done;
            let room = rem_chunk.min(self.rem_total(held, offset).floor() as i64);
            if room <= 0 {
                self.chunked = Some(c);
            } else {
                let ext = remaining.min(room as usize);
                let last = ext == remaining;
                offset += ext as f64 + if last { c.max_new_left() as f64 } else { 0.0 };
                rem_chunk -= ext as i64;
                rem_input -= ext as i64;
                slots += ext;
                items.push(Item {
                    seq: c,
                    extend: ext,
                    hit: 0,
                });
            }
        }

        // 2. waiting requests in order (SGLang's `add_one_req`); a chunked request that could
        //    not continue keeps the chunk slot, so nothing new is admitted this time
        while self.chunked.is_none() {
            let Some(w) = self.waiting.front_mut() else {
                break;
            };
            if running_bs + items.len() >= max_running {
                self.batch_is_full = true;
                break;
            }
            let (matched, node, extend) = {
                let fill = w.fill();
                let (matched, node) = self.cache.match_prefix(&fill);
                (matched, node, fill.len() - matched)
            };
            w.uncached = extend;
            let prefilled = w.req.prefilled.is_some();
            let reserve = w.max_new_left();
            // the candidate's prefix is pinned while it is judged (SGLang's `_lock_node`)
            self.cache.inc_lock(node);
            if (extend + reserve) as f64 > self.rem_total(held, offset) {
                self.cache.dec_lock(node);
                self.batch_is_full = true;
                break;
            }
            // KV transferred from a prefill worker costs no prefill compute here
            let cost = if prefilled { 0 } else { extend };
            if !chunking && !items.is_empty() && cost as i64 > rem_input {
                self.cache.dec_lock(node);
                break;
            }
            let ext = if cost as i64 <= rem_chunk {
                offset += (extend + reserve) as f64;
                extend
            } else {
                // the uncached part does not fit the chunk budget: prefill a first chunk
                if rem_chunk <= 0 {
                    self.cache.dec_lock(node);
                    break;
                }
                offset += rem_chunk as f64;
                rem_chunk as usize
            };
            let charged = if prefilled { 0 } else { ext };
            rem_chunk = rem_chunk.saturating_sub(charged as i64);
            rem_input -= charged as i64;
            slots += ext;
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            seq.node = Some(node);
            seq.done = matched;
            if seq.cached.is_none() {
                seq.cached = Some(matched);
            }
            let truncated = ext < extend;
            items.push(Item {
                seq,
                extend: ext,
                hit: matched,
            });
            if truncated {
                // at most one chunked request at a time
                break;
            }
            if self.rem_total(held, offset) <= 0.0 {
                self.batch_is_full = true;
                break;
            }
            if rem_input <= 0 || rem_chunk <= 0 {
                break;
            }
        }
        if items.is_empty() {
            return None;
        }
        // the batch's KV slots are allocated now (evicting LRU entries as needed); admission
        // guarantees the room exists
        let ok = self.make_room(slots);
        debug_assert!(ok, "prefill batch admitted beyond the KV capacity");
        Some(PrefillBatch { items, mixed })
    }

    /// Releases a request that left the scheduler: inserts its tokens (prompt + output minus
    /// the last token, whose KV was never computed, as SGLang's `cache_finished_req`), unlocks,
    /// and counts it (SGLang's `observe_one_finished_request`: token counters at finish).
    fn release(&mut self, r: Seq, stats: Option<&mut Stats>, now: Instant) {
        let n = r.generated.min(r.req.output.len()).saturating_sub(1);
        let mut all = Vec::with_capacity(r.req.prompt.len() + n);
        all.extend_from_slice(&r.req.prompt);
        all.extend_from_slice(&r.req.output[..n]);
        self.cache.insert(&all);
        if let Some(node) = r.node {
            self.cache.dec_lock(node);
        }
        self.batch_is_full = false;
        if let Some(s) = stats {
            s.prompt_tokens_total += r.req.prompt.len() as u64;
            s.cached_tokens_total += r.reported_cached() as u64;
            s.generation_tokens_total += r.generated as u64;
            if r.generated >= r.req.output.len() {
                s.num_requests_total += 1;
                s.e2e.observe((now - r.req.arrival).as_secs_f64());
            }
        }
    }

    /// One more token for `r`; sends it. Returns whether `r` stays (not finished, client there).
    fn emit(r: &mut Seq, stats: Option<&mut Stats>, now: Instant) -> bool {
        let first = r.generated == 0;
        if r.generated < r.req.output.len() {
            r.generated += 1;
        }
        let done = r.generated >= r.req.output.len();
        let sent = r
            .req
            .tx
            .send(Progress {
                index: r.req.index,
                cached: r.reported_cached(),
                generated: r.generated,
                finished: done,
            })
            .is_ok();
        if let Some(s) = stats {
            if first {
                s.ttft.observe((now - r.req.arrival).as_secs_f64());
            } else {
                s.itl.observe((now - r.last_token).as_secs_f64());
            }
        }
        r.last_token = now;
        !done && sent
    }

    /// Stats points (SGLang logs at every prefill batch and every 40 decode steps).
    fn log_point(&mut self, s: &mut Stats) {
        s.num_retracted_reqs = self.retracted_since_log;
        self.retracted_since_log = 0;
    }

    fn publish(&mut self, inflight_chunk: usize) {
        let held = self.held_total();
        let chunk_left = self.chunked.as_ref().map_or(0, |c| c.fill_len() - c.done);
        if let Ok(mut s) = self.stats.lock() {
            s.num_running = self.running.len();
            s.num_waiting = self.waiting.len();
            // SGLang: waiting requests' unmatched tokens + the chunked request's remainder
            s.waiting_uncached_tokens = self.waiting.iter().map(|w| w.uncached).sum::<usize>()
                + chunk_left
                + inflight_chunk;
            s.waiting_tokens = self.waiting.iter().map(Seq::fill_len).sum();
            s.used_tokens = self.cache.protected_size() + held;
            s.cache_tokens = self.cache.total_size();
            s.evictable_tokens = self.cache.evictable_size();
            s.new_token_ratio = self.new_token_ratio;
            s.retractions_total = self.retractions_total;
        }
    }

    /// Runs a prefill (or mixed) batch.
    async fn run_prefill(&mut self, batch: PrefillBatch) {
        let PrefillBatch { items, mixed } = batch;
        // the request that will still be chunked after this batch counts as waiting work
        let inflight: usize = items
            .iter()
            .filter(|i| i.seq.done + i.extend < i.seq.fill_len())
            .map(|i| i.seq.fill_len() - i.seq.done)
            .sum();
        self.publish(inflight);
        let all_prefilled = items.iter().all(|i| i.seq.req.prefilled.is_some());
        let mut ms = if all_prefilled {
            0.0
        } else {
            let work: f64 = items
                .iter()
                .filter(|i| i.seq.req.prefilled.is_none())
                .map(|i| self.prefill_work(i.extend, i.seq.done))
                .sum();
            self.cfg.prefill_overhead_ms + work * 1000.0 / self.cfg.prefill_tokens_per_sec
        };
        if mixed {
            // the decode tokens ride in the same forward: their own compute plus the KV read
            let ctx: usize = self.running.iter().map(Seq::fill_len).sum();
            ms += self.running.len() as f64 * 1000.0 / self.cfg.prefill_tokens_per_sec
                + self.kv_read_ms(ctx);
        }
        self.last_step = Some(StepInfo {
            kind: if mixed {
                StepKind::Mixed
            } else {
                StepKind::Prefill
            },
            ms,
            batch: items.len() + if mixed { self.running.len() } else { 0 },
        });
        self.advance(ms).await;
        let now = Instant::now();
        let stats_arc = self.stats.clone();
        let mut stats = stats_arc.lock().ok();
        let mut leaving = Vec::new();
        if mixed {
            for mut r in std::mem::take(&mut self.running) {
                self.produced += 1;
                if Self::emit(&mut r, stats.as_deref_mut(), now) {
                    self.running.push(r);
                } else {
                    leaving.push(r);
                }
            }
        }
        let (mut hit, mut input) = (0usize, 0usize);
        for Item {
            mut seq,
            extend,
            hit: h,
        } in items
        {
            // the computed KV goes into the tree; the lock moves to the new end
            let end = seq.done + extend;
            let (_, node) = {
                let fill = seq.fill();
                self.cache.insert(&fill[..end])
            };
            self.cache.inc_lock(node);
            if let Some(old) = seq.node.replace(node) {
                self.cache.dec_lock(old);
            }
            seq.done = end;
            if !seq.retracted {
                hit += h;
                input += extend;
            }
            if end < seq.fill_len() {
                self.chunked = Some(seq);
                continue;
            }
            // prefill complete: the forward samples the next token
            self.produced += 1;
            if Self::emit(&mut seq, stats.as_deref_mut(), now) {
                self.running.push(seq);
            } else {
                leaving.push(seq);
            }
        }
        if let Some(s) = stats.as_mut() {
            s.cache_hit_rate = if hit + input > 0 {
                hit as f64 / (hit + input) as f64
            } else {
                0.0
            };
            self.log_point(s);
        }
        for r in leaving {
            self.release(r, stats.as_deref_mut(), now);
        }
        drop(stats);
        self.publish(0);
    }

    /// Frees one token of KV per running request for the next decode step, retracting requests
    /// when the pool is exhausted (SGLang's `check_decode_mem` + `retract_decode`).
    fn ensure_decode_room(&mut self) {
        let b = self.running.len();
        if self.make_room(b) {
            self.new_token_ratio =
                (self.new_token_ratio - self.new_token_ratio_decay).max(self.min_new_token_ratio);
            return;
        }
        // retraction order: most generated tokens kept, then shortest prompt; retract from the end
        let mut order: Vec<usize> = (0..b).collect();
        order.sort_by_key(|&i| {
            (
                Reverse(self.running[i].generated),
                self.running[i].req.prompt.len(),
            )
        });
        let mut held = self.held_total();
        let cap = self.cfg.max_total_tokens;
        let mut out = Vec::new();
        let mut first = true;
        loop {
            let avail = cap.saturating_sub(self.cache.total_size() + held);
            if !first && avail >= RETRACT_DECODE_STEPS * order.len() {
                break;
            }
            if order.len() <= 1 {
                // SGLang keeps the last request (and aborts it if not even one token fits).
                // Only a chunked prefill holding the rest of the pool gets there; the sim
                // retracts that last request too, to resume once the chunked one runs.
                let need = order.len();
                if need == 0 || avail >= need {
                    break;
                }
                self.cache.evict(need - avail);
                if cap.saturating_sub(self.cache.total_size() + held) >= need {
                    break;
                }
            }
            first = false;
            let Some(i) = order.pop() else { break };
            held -= self.running[i].held();
            if let Some(node) = self.running[i].node.take() {
                self.cache.dec_lock(node);
            }
            out.push(i);
            // use the newly evictable memory at once
            let want = RETRACT_DECODE_STEPS * order.len();
            let avail = cap.saturating_sub(self.cache.total_size() + held);
            if want > avail {
                self.cache.evict(want - avail);
            }
        }
        let mut slots: Vec<Option<Seq>> = std::mem::take(&mut self.running)
            .into_iter()
            .map(Some)
            .collect();
        for &i in &out {
            if let Some(mut r) = slots[i].take() {
                r.done = 0;
                r.retracted = true;
                let fill = r.fill();
                r.uncached = fill.len() - self.cache.peek_prefix(&fill);
                self.waiting.push_back(r);
            }
        }
        self.running = slots.into_iter().flatten().collect();
        self.retracted_since_log += out.len();
        self.retractions_total += out.len() as u64;
        self.batch_is_full = false;
        if !self.running.is_empty() {
            let gen: usize = self.running.iter().map(|r| r.generated).sum();
            let max_new: usize = self.running.iter().map(|r| r.req.max_new).sum();
            self.new_token_ratio = ((gen + RETRACT_DECODE_STEPS * self.running.len()) as f64
                / max_new.max(1) as f64)
                .min(1.0);
        }
        let ok = self.make_room(self.running.len());
        debug_assert!(ok, "no KV room for one decode token after retraction");
    }

    /// Runs one decode step for the running batch.
    async fn run_decode(&mut self) {
        self.ensure_decode_room();
        if self.running.is_empty() {
            // everything was retracted (see `ensure_decode_room`): prefill resumes next
            self.publish(0);
            return;
        }
        let ms = self.decode_ms();
        self.last_step = Some(StepInfo {
            kind: StepKind::Decode,
            ms,
            batch: self.running.len(),
        });
        self.advance(ms).await;
        let now = Instant::now();
        let stats_arc = self.stats.clone();
        let mut stats = stats_arc.lock().ok();
        let mut leaving = Vec::new();
        for mut r in std::mem::take(&mut self.running) {
            self.produced += 1;
            if Self::emit(&mut r, stats.as_deref_mut(), now) {
                self.running.push(r);
            } else {
                leaving.push(r);
            }
        }
        self.decode_steps += 1;
        if let Some(s) = stats.as_mut() {
            if self.decode_steps >= DECODE_LOG_INTERVAL {
                self.decode_steps = 0;
                let el = (now - self.tput_mark.0).as_secs_f64();
                if el > 0.0 {
                    s.gen_throughput = (self.produced - self.tput_mark.1) as f64 / el;
                }
                self.tput_mark = (now, self.produced);
                // SGLang's decode stats point sets the hit rate to 0
                s.cache_hit_rate = 0.0;
                self.log_point(s);
            }
        }
        for r in leaving {
            self.release(r, stats.as_deref_mut(), now);
        }
        drop(stats);
        self.publish(0);
    }

    /// Runs one scheduling iteration. Returns false when there was nothing to do.
    pub async fn step(&mut self) -> bool {
        let limit = self.cfg.max_consecutive_prefill_batches;
        let force_decode =
            limit > 0 && !self.running.is_empty() && self.consecutive_prefill >= limit;
        if !force_decode {
            if let Some(batch) = self.form_prefill_batch() {
                self.consecutive_prefill = (self.consecutive_prefill + 1).min(limit.max(1));
                self.run_prefill(batch).await;
                return true;
            }
        }
        if self.running.is_empty() {
            // idle: SGLang re-initialises the estimate
            self.new_token_ratio = self.init_new_token_ratio;
            self.publish(0);
            return false;
        }
        self.consecutive_prefill = 0;
        self.run_decode().await;
        true
    }

    /// The scheduler task: runs until the command channel closes and no work is left.
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        loop {
            if self.idle() {
                // idle: SGLang re-initialises the estimate
                self.new_token_ratio = self.init_new_token_ratio;
                self.publish(0);
                match rx.recv().await {
                    Some(cmd) => {
                        self.clock = Instant::now();
                        self.tput_mark = (self.clock, self.produced);
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
                if !self.waiting.is_empty() || self.chunked.is_some() {
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
    use tokio::sync::oneshot;

    /// Flat-rate prefill (no context term) keeps the step arithmetic of the batching tests
    /// simple; `prefill_time_grows_with_the_context_it_attends_to` tests the context term.
    fn cfg() -> Config {
        Config {
            time_scale: 0.0,
            prefill_context_per_1k_tokens: 0.0,
            ..Config::default()
        }
    }

    /// A request for `out` output tokens (`ignore_eos`), reserving `max_new` of KV.
    fn req_max(
        prompt: Vec<u32>,
        out: usize,
        max_new: usize,
    ) -> (SimRequest, mpsc::UnboundedReceiver<Progress>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (output, _) = tokenizer::plan_output(&prompt, out, true);
        (
            SimRequest {
                index: 0,
                prompt,
                output,
                max_new,
                tx,
                arrival: Instant::now(),
                prefilled: None,
            },
            rx,
        )
    }

    /// A scheduler over `c` and its stats (KV capacity `kv` tokens).
    fn sched(c: Config, kv: usize) -> (Scheduler, Arc<Mutex<Stats>>) {
        let stats = Arc::new(Mutex::new(Stats::new(kv)));
        (Scheduler::new(c, stats.clone()), stats)
    }

    fn req(prompt: Vec<u32>, out: usize) -> (SimRequest, mpsc::UnboundedReceiver<Progress>) {
        req_max(prompt, out, out)
    }

    /// `n` tokens no other call with another `k` shares.
    fn toks(k: u32, n: u32) -> Vec<u32> {
        (k * 1_000_000..k * 1_000_000 + n).collect()
    }

    fn got(rx: &mut mpsc::UnboundedReceiver<Progress>) -> Vec<Progress> {
        let mut v = Vec::new();
        while let Ok(p) = rx.try_recv() {
            v.push(p);
        }
        v
    }

    fn stats_of(s: &Scheduler) -> Stats {
        s.stats.lock().unwrap().clone()
    }

    async fn drain(s: &mut Scheduler) {
        while s.step().await {}
    }

    fn approx(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn running_request_locks_its_prefix_and_finish_inserts_output() {
        let (mut s, stats) = sched(cfg(), 1000);
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
        // SGLang counts tokens when a request finishes
        assert_eq!(stats.lock().unwrap().prompt_tokens_total, 0);
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
        let (mut s, stats) = sched(cfg(), 1000);
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
        assert_eq!(s.retractions_total, 0);
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
        let (mut s, _) = sched(cfg(), 1000);
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

    #[tokio::test(flavor = "current_thread")]
    async fn decode_step_time_grows_with_the_kv_read() {
        let run = |kv: f64, lens: [u32; 2]| async move {
            let c = Config {
                decode_kv_ms_per_1k_tokens: kv,
                ..cfg()
            };
            let (mut s, _) = sched(c, 800_000);
            let mut rxs = Vec::new();
            for (k, n) in lens.into_iter().enumerate() {
                let (r, rx) = req(toks(k as u32 + 1, n), 5);
                s.handle(Cmd::Submit(r));
                rxs.push(rx);
            }
            assert!(s.step().await);
            let p = s.last_step().unwrap();
            assert_eq!((p.kind, p.batch), (StepKind::Prefill, 2));
            approx(p.ms, 3.0 + (lens[0] + lens[1]) as f64 * 1000.0 / 30_000.0);
            let mut ms = Vec::new();
            for _ in 0..2 {
                assert!(s.step().await);
                let d = s.last_step().unwrap();
                assert_eq!((d.kind, d.batch), (StepKind::Decode, 2));
                ms.push(d.ms);
            }
            ms
        };
        let base = 8.0 * (1.0 + 0.008);
        // no KV term: the old model, independent of the context
        let flat = run(0.0, [3000, 1000]).await;
        approx(flat[0], base);
        approx(flat[1], base);
        // each step reads every running request's prompt + generated tokens
        let long = run(0.035, [3000, 1000]).await;
        approx(long[0], base + 0.035 * (3001.0 + 1001.0) / 1000.0);
        approx(long[1], base + 0.035 * (3002.0 + 1002.0) / 1000.0);
        let short = run(0.035, [30, 10]).await;
        approx(short[0], base + 0.035 * (31.0 + 11.0) / 1000.0);
        assert!(long[0] - short[0] > 0.13, "{long:?} vs {short:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn prefill_time_grows_with_the_context_it_attends_to() {
        let k = crate::config::PREFILL_CONTEXT_PER_1K_TOKENS;
        let c = Config {
            chunked_prefill_size: 4000,
            ..cfg()
        };
        let c = Config {
            prefill_context_per_1k_tokens: k,
            ..c
        };
        let (mut s, _) = sched(c, 800_000);
        let ms = |new: f64, ctx: f64| 3.0 + new * (1.0 + k * ctx / 1000.0) * 1000.0 / 30_000.0;
        // a prompt on nothing: the zero-context rate
        let history = toks(1, 3000);
        let (r, _rx) = req(history.clone(), 1);
        s.handle(Cmd::Submit(r));
        assert!(s.step().await);
        approx(s.last_step().unwrap().ms, ms(3000.0, 0.0));
        drain(&mut s).await;
        // a follow-up of 500 new tokens on the cached 3000: dearer per token than the first 500
        let mut follow = history.clone();
        follow.extend(toks(2, 500));
        let (r, mut rx) = req(follow, 1);
        s.handle(Cmd::Submit(r));
        assert!(s.step().await);
        approx(s.last_step().unwrap().ms, ms(500.0, 3000.0));
        assert!(ms(500.0, 3000.0) > ms(500.0, 0.0) * 1.1);
        assert_eq!(got(&mut rx)[0].cached, 3000);
        drain(&mut s).await;
        // a chunk attends to the chunks before it
        let (r, _rx) = req(toks(3, 6000), 1);
        s.handle(Cmd::Submit(r));
        assert!(s.step().await);
        approx(s.last_step().unwrap().ms, ms(4000.0, 0.0));
        assert!(s.step().await);
        approx(s.last_step().unwrap().ms, ms(2000.0, 4000.0));
        // the H200 shape: 512 new tokens on 32k cached run at about a third of the empty rate
        let slow = ms(512.0, 32768.0) - 3.0;
        let fast = ms(512.0, 0.0) - 3.0;
        assert!((2.5..3.2).contains(&(slow / fast)), "{slow} / {fast}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn long_prompt_is_prefilled_in_chunks() {
        let c = Config {
            chunked_prefill_size: 100,
            ..cfg()
        };
        let (mut s, _) = sched(c, 800_000);
        let (r, mut rx) = req(toks(1, 250), 3);
        s.handle(Cmd::Submit(r));
        for (left, chunk) in [(150usize, 100.0), (50, 100.0)] {
            assert!(s.step().await);
            let st = s.last_step().unwrap();
            assert_eq!((st.kind, st.batch), (StepKind::Prefill, 1));
            approx(st.ms, 3.0 + chunk * 1000.0 / 30_000.0);
            assert!(got(&mut rx).is_empty(), "no token before the last chunk");
            let l = stats_of(&s);
            // the chunked request is neither running nor waiting, its rest is waiting work
            assert_eq!((l.num_running, l.num_waiting), (0, 0));
            assert_eq!(l.waiting_uncached_tokens, left);
            assert_eq!(
                s.cache.protected_size(),
                250 - left,
                "prefilled part locked"
            );
        }
        assert!(s.step().await);
        approx(s.last_step().unwrap().ms, 3.0 + 50.0 * 1000.0 / 30_000.0);
        let p = got(&mut rx);
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].generated, p[0].cached), (1, 0));
        let l = stats_of(&s);
        assert_eq!((l.num_running, l.waiting_uncached_tokens), (1, 0));
        assert!(s.chunked.is_none());
        drain(&mut s).await;
        assert_eq!(stats_of(&s).prompt_tokens_total, 250);

        // without chunking the whole prompt is one prefill
        let c = Config {
            chunked_prefill_size: -1,
            ..cfg()
        };
        let (mut s, _) = sched(c, 800_000);
        let (r, mut rx) = req(toks(1, 250), 3);
        s.handle(Cmd::Submit(r));
        assert!(s.step().await);
        approx(s.last_step().unwrap().ms, 3.0 + 250.0 * 1000.0 / 30_000.0);
        assert_eq!(got(&mut rx).len(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_cuts_the_request_that_overflows_the_chunk_budget() {
        let c = Config {
            chunked_prefill_size: 100,
            ..cfg()
        };
        let (mut s, _) = sched(c, 800_000);
        let (a, mut ra) = req(toks(1, 60), 2);
        let (b, mut rb) = req(toks(2, 60), 2);
        s.handle(Cmd::Submit(a));
        s.handle(Cmd::Submit(b));
        assert!(s.step().await);
        // A whole (60), B's first 40 tokens
        approx(s.last_step().unwrap().ms, 3.0 + 100.0 * 1000.0 / 30_000.0);
        assert_eq!(got(&mut ra).len(), 1);
        assert!(got(&mut rb).is_empty());
        assert_eq!(s.chunked.as_ref().map(|c| c.done), Some(40));
        // B's last 20 tokens come first in the next prefill batch (decode waits)
        assert!(s.step().await);
        let st = s.last_step().unwrap();
        assert_eq!(st.kind, StepKind::Prefill);
        approx(st.ms, 3.0 + 20.0 * 1000.0 / 30_000.0);
        assert!(got(&mut ra).is_empty());
        assert_eq!(got(&mut rb).len(), 1);
    }

    /// A request running, then a 350-token prompt prefilled in chunks of 100.
    async fn chunked_behind_a_running_request(
        c: Config,
    ) -> (
        Scheduler,
        mpsc::UnboundedReceiver<Progress>,
        mpsc::UnboundedReceiver<Progress>,
    ) {
        let (mut s, _) = sched(c, 800_000);
        let (a, mut ra) = req(toks(1, 10), 50);
        s.handle(Cmd::Submit(a));
        assert!(s.step().await);
        assert_eq!(got(&mut ra).len(), 1);
        let (b, rb) = req(toks(2, 350), 50);
        s.handle(Cmd::Submit(b));
        (s, ra, rb)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn chunks_run_back_to_back_and_stall_decoding_by_default() {
        let c = Config {
            chunked_prefill_size: 100,
            ..cfg()
        };
        let (mut s, mut ra, mut rb) = chunked_behind_a_running_request(c).await;
        for (i, chunk) in [100.0, 100.0, 100.0, 50.0].into_iter().enumerate() {
            assert!(s.step().await);
            let st = s.last_step().unwrap();
            assert_eq!(st.kind, StepKind::Prefill, "prefill goes first");
            approx(st.ms, 3.0 + chunk * 1000.0 / 30_000.0);
            assert!(got(&mut ra).is_empty(), "the running request waits");
            // B joins the running batch with its last chunk
            assert_eq!(stats_of(&s).num_running, if i < 3 { 1 } else { 2 });
        }
        assert_eq!(got(&mut rb).len(), 1);
        assert!(s.step().await);
        assert_eq!(s.last_step().unwrap().kind, StepKind::Decode);
        assert_eq!(got(&mut ra)[0].generated, 2);
        assert_eq!(got(&mut rb)[0].generated, 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn mixed_chunk_decodes_the_running_batch_inside_prefill_batches() {
        let c = Config {
            chunked_prefill_size: 100,
            enable_mixed_chunk: true,
            ..cfg()
        };
        let (mut s, mut ra, mut rb) = chunked_behind_a_running_request(c).await;
        // the decode token takes one token of the chunk budget: chunks of 99
        for (i, chunk) in [99.0, 99.0, 99.0, 53.0].into_iter().enumerate() {
            assert!(s.step().await);
            let st = s.last_step().unwrap();
            assert_eq!((st.kind, st.batch), (StepKind::Mixed, 2));
            let ctx = 10.0 + 1.0 + i as f64; // A's prompt + generated before this step
            approx(
                st.ms,
                3.0 + (chunk + 1.0) * 1000.0 / 30_000.0 + 0.035 * ctx / 1000.0,
            );
            let p = got(&mut ra);
            assert_eq!(p.len(), 1);
            assert_eq!(p[0].generated, i + 2, "A decodes in every chunk batch");
        }
        assert_eq!(got(&mut rb).len(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn consecutive_prefill_limit_interleaves_decode_turns() {
        let c = Config {
            chunked_prefill_size: 100,
            max_consecutive_prefill_batches: 1,
            ..cfg()
        };
        let (mut s, mut ra, mut rb) = chunked_behind_a_running_request(c).await;
        let mut kinds = Vec::new();
        for _ in 0..8 {
            assert!(s.step().await);
            kinds.push(s.last_step().unwrap().kind);
        }
        use StepKind::{Decode as D, Prefill as P};
        assert_eq!(kinds, [D, P, D, P, D, P, D, P]);
        assert_eq!(got(&mut ra).len(), 4);
        assert_eq!(got(&mut rb).len(), 1, "B's fourth chunk ended its prefill");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn admission_reserves_expected_output_scaled_by_new_token_ratio() {
        let c = Config {
            max_total_tokens: 1000,
            ..cfg()
        };
        let (mut s, _) = sched(c.clone(), 1000);
        let (a, _ra) = req(toks(1, 100), 600);
        s.handle(Cmd::Submit(a));
        assert!(s.step().await);
        // A running: its prompt locked (100) + 599 more tokens x 0.7 expected
        approx(s.new_token_ratio(), 0.7);
        approx(
            s.rem_total(s.held_total(), 599.0 * 0.7),
            1000.0 - 100.0 - 419.3,
        );
        // 100 + 300 = 400 <= 480.7: admitted (reserving A's whole output would leave 300)
        let (b, mut rb) = req(toks(2, 100), 300);
        s.handle(Cmd::Submit(b));
        assert!(s.step().await);
        assert_eq!(s.last_step().unwrap().kind, StepKind::Prefill);
        assert_eq!(got(&mut rb).len(), 1);

        let (mut s, _) = sched(c, 1000);
        let (a, _ra) = req(toks(1, 100), 600);
        s.handle(Cmd::Submit(a));
        assert!(s.step().await);
        // 100 + 400 = 500 > 480.7: waits, and the batch counts as full
        let (b, mut rb) = req(toks(2, 100), 400);
        s.handle(Cmd::Submit(b));
        assert!(s.step().await);
        assert_eq!(s.last_step().unwrap().kind, StepKind::Decode);
        assert!(s.batch_is_full);
        assert_eq!(stats_of(&s).num_waiting, 1);
        // the ratio decays by (0.7 - 0.098) / 600 per decode step
        for _ in 0..199 {
            assert!(s.step().await);
            assert_eq!(s.last_step().unwrap().kind, StepKind::Decode);
        }
        approx(s.new_token_ratio(), 0.7 - 200.0 * (0.7 - 0.098) / 600.0);
        // the budget now has room, but SGLang retries only once a request leaves the batch
        let a = &s.running[0];
        let offset = a.max_new_left() as f64 * s.new_token_ratio();
        assert!(s.rem_total(s.held_total(), offset) >= 500.0);
        assert!(got(&mut rb).is_empty());
        drain(&mut s).await;
        assert_eq!(got(&mut rb).len(), 400);
        // idle: the estimate starts over
        approx(s.new_token_ratio(), 0.7);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn decode_out_of_kv_retracts_the_newest_request_which_resumes_later() {
        // a low initial ratio admits B although A and B cannot both finish in 400 tokens
        let c = Config {
            max_total_tokens: 400,
            schedule_conservativeness: 0.1,
            ..cfg()
        };
        let (mut s, stats) = sched(c, 400);
        let (a, mut ra) = req(toks(1, 100), 250);
        s.handle(Cmd::Submit(a));
        assert!(s.step().await);
        let (b, mut rb) = req(toks(2, 100), 150);
        s.handle(Cmd::Submit(b));
        assert!(s.step().await);
        assert_eq!(
            s.running.len(),
            2,
            "B admitted: 250 <= 400 - 100 - 249 x 0.07"
        );
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        let mut retracted_at = None;
        for i in 0..1000 {
            if !s.step().await {
                break;
            }
            assert!(s.kv_in_use() <= 400, "KV over capacity at step {i}");
            pa.extend(got(&mut ra));
            pb.extend(got(&mut rb));
            if retracted_at.is_none() && s.retractions_total > 0 {
                retracted_at = Some(i);
                // both had 101 tokens: the tie goes to the newest (B), which keeps its tokens
                assert_eq!(s.running.len(), 1);
                assert_eq!(s.running[0].generated, 102, "A decoded this step");
                let w = &s.waiting[0];
                assert!(w.retracted);
                assert_eq!(w.generated, 101);
                let st = stats_of(&s);
                assert_eq!(st.retractions_total, 1);
                assert_eq!((st.num_running, st.num_waiting), (1, 1));
                // B's prompt is still cached, its 101 generated tokens must be recomputed
                assert_eq!(st.waiting_uncached_tokens, 101);
                assert_eq!(st.waiting_tokens, 201);
                // new_token_ratio = (decoded + 20 per request) / max_new of the rest
                approx(s.new_token_ratio(), (101.0 + 20.0) / 250.0);
            }
        }
        assert!(retracted_at.is_some(), "no retraction");
        assert!(s.idle());
        // both streams are complete and gapless across the retraction
        let gens = |v: &[Progress]| v.iter().map(|p| p.generated).collect::<Vec<_>>();
        assert_eq!(gens(&pa), (1..=250).collect::<Vec<_>>());
        assert_eq!(gens(&pb), (1..=150).collect::<Vec<_>>());
        assert!(pb.last().unwrap().finished);
        let st = stats.lock().unwrap().clone();
        assert_eq!(st.generation_tokens_total, 400);
        assert_eq!(st.num_requests_total, 2);
        assert_eq!(st.retractions_total, 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_chunked_prefill_holding_the_pool_retracts_even_the_last_runner() {
        // A decodes between B's chunks; B's 950-token prompt leaves no slot for A's tokens
        let c = Config {
            max_total_tokens: 1000,
            chunked_prefill_size: 10,
            max_consecutive_prefill_batches: 1,
            schedule_conservativeness: 0.01,
            ..cfg()
        };
        let (mut s, _) = sched(c, 1000);
        let (a, mut ra) = req(toks(1, 10), 500);
        s.handle(Cmd::Submit(a));
        assert!(s.step().await);
        let (b, mut rb) = req(toks(2, 950), 2);
        s.handle(Cmd::Submit(b));
        let (mut pa, mut pb) = (got(&mut ra), Vec::new());
        let mut alone = false;
        for i in 0..5000 {
            if !s.step().await {
                break;
            }
            assert!(s.kv_in_use() <= 1000, "KV over capacity at step {i}");
            if s.running.is_empty() && s.chunked.is_some() && !s.waiting.is_empty() {
                alone = true;
            }
            pa.extend(got(&mut ra));
            pb.extend(got(&mut rb));
        }
        assert!(
            alone,
            "A was never retracted while B's prefill held the pool"
        );
        assert!(s.idle());
        let gens = |v: &[Progress]| v.iter().map(|p| p.generated).collect::<Vec<_>>();
        assert_eq!(gens(&pa), (1..=500).collect::<Vec<_>>());
        assert_eq!(gens(&pb), [1, 2]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn cache_hit_rate_is_the_last_prefill_batch_reset_by_decode_stats() {
        let c = Config {
            chunked_prefill_size: 100,
            ..cfg()
        };
        let (mut s, stats) = sched(c, 800_000);
        let (r, _rx) = req(toks(1, 100), 2);
        s.handle(Cmd::Submit(r));
        drain(&mut s).await;
        // 100 cached + 250 new, chunks of 100: the first chunk has the hit
        let mut p = toks(1, 100);
        p.extend(toks(2, 250));
        let (r, _rx) = req(p, 60);
        s.handle(Cmd::Submit(r));
        let mut rates = Vec::new();
        for _ in 0..3 {
            assert!(s.step().await);
            assert_eq!(s.last_step().unwrap().kind, StepKind::Prefill);
            rates.push(stats_of(&s).cache_hit_rate);
        }
        assert_eq!(rates, [0.5, 0.0, 0.0]);
        // a cached request alone: 350 cached of 360
        let mut p = toks(1, 100);
        p.extend(toks(2, 250));
        p.extend(toks(3, 10));
        let (r, _rx) = req(p, 60);
        s.handle(Cmd::Submit(r));
        assert!(s.step().await);
        approx(stats_of(&s).cache_hit_rate, 350.0 / 360.0);
        // SGLang's decode stats point (every 40 decode steps) sets it to 0
        for i in 1..=DECODE_LOG_INTERVAL {
            assert!(s.step().await);
            assert_eq!(s.last_step().unwrap().kind, StepKind::Decode);
            let r = stats_of(&s).cache_hit_rate;
            if i < DECODE_LOG_INTERVAL - 1 {
                approx(r, 350.0 / 360.0);
            }
        }
        assert_eq!(stats_of(&s).cache_hit_rate, 0.0);
        // the counters keep the cumulative view
        drain(&mut s).await;
        let st = stats.lock().unwrap().clone();
        assert_eq!(st.cache_hit_rate, 0.0);
        assert_eq!(st.prompt_tokens_total, 100 + 350 + 360);
        assert_eq!(st.cached_tokens_total, 100 + 350);
    }
}
