//! The poll lease holder's HTTP calls: load polls (`poll.rs`) and the index self-check's
//! counter reads (`hits.rs`), sent from the root context's tick, and their answers.
//!
//! Invariants:
//! - Only the holder of the poll lease ([`PollLease`](crate::poll_lease::PollLease), one VM per
//!   Envoy) sends; a root that cannot make calls (a native worker thread) or a peer listener
//!   never takes the lease, so it never takes it from one that can.
//! - A worker has at most one load poll and one counter read in flight; a call whose answer
//!   never comes expires after its timeout plus a margin (`schedule::Calls`) and counts as a
//!   failure, so a lost answer never stops a worker's polls.
//! - Every answer, good or failed, is published to shared data for every VM: a failed poll
//!   publishes "unknown" (never idle, see `poll.rs`).
//! - The schedule (back-offs, when each worker was last asked) goes with the lease: each lease
//!   write carries it and a VM taking the lease over from another adopts it (`write_pace`), so
//!   a stalled holder's thread does not make the next holder ask every backed-off worker at
//!   once.
//!
//! Costs: every VM that may call reads the lease about once per half ttl or per expiry it saw, not
//! every tick (`poll_lease::LeaseView`; the holder renews it with a CAS then). The holder makes one
//! HTTP call per worker per round (fewer to a failing worker, see `poll::Pace`, and to one whose
//! counter reads fail, see [`METRICS_BACKOFF_MS`]); per good answer one body read, one own-load
//! read and the publish (a read and a CAS); per failed one the body read and a read (the CAS too
//! when it was known before); at a round's last answer two gauge writes. Nothing here runs on a
//! request's path.

use crate::config::{Config, Worker};
use crate::hits;
use crate::host::{now_ticks, Buffer, CallRefused, Host};
use crate::membership;
use crate::metrics::{Counter, Gauge, Metrics};
use crate::poll::{self, Pace, Polled, Poller, Target};
use crate::poll_lease::LeaseView;
use crate::router::Router;
use crate::schedule::{since, Calls};
use std::cell::RefCell;

/// A root context's polls (lease holder or not: the lease can move between VMs).
#[derive(Default)]
pub struct Polls {
    /// This root context's identity in the poller lease (set at each configuration).
    pub me: u64,
    /// What this root last learned of the poll lease (most ticks read nothing).
    lease: LeaseView,
    /// Per model, its workers' ids: a schedule handed over with the lease is adopted only for
    /// the same worker at the same position (`write_pace`).
    ids: Vec<Vec<u32>>,
    poller: Poller,
    /// Counter reads for the index's self-check: `(model, worker)` per call awaiting an answer
    /// (expiring, see `schedule`), and when the last round started (ms; `None` before the
    /// first).
    hit_calls: Calls<(u16, u16)>,
    last_hit_round_ms: Option<u64>,
    /// Per model, per worker: how its counter reads fail ([`HitPace`]).
    hit_pace: Vec<Vec<HitPace>>,
    /// The admin read of pool models' hosts (`membership.rs`): at most one in flight.
    member_calls: Calls<()>,
    last_member_read_ms: Option<u64>,
}

impl Polls {
    /// A new configuration: fresh schedules for its workers. Calls in flight are forgotten (their
    /// answers are then ignored as unknown tokens): they name worker positions of the old
    /// worker list, which may be other workers now.
    pub fn configure(&mut self, cfg: &Config, me: u64) {
        self.me = me;
        self.lease = LeaseView::default();
        self.ids = cfg
            .models
            .iter()
            .map(|m| m.workers.iter().map(|w| w.id).collect())
            .collect();
        self.poller = Poller::new(cfg.models.iter().map(|m| m.workers.len()));
        self.hit_calls = Calls::default();
        self.last_hit_round_ms = None;
        self.hit_pace = cfg
            .models
            .iter()
            .map(|m| vec![HitPace::default(); m.workers.len()])
            .collect();
        self.member_calls = Calls::default();
        self.last_member_read_ms = None;
    }

    /// The root's tick: expires lost calls and, holding the lease, asks every worker of each
    /// model whose round is due for its load, then reads the counters when due. `lease_ttl_ms`
    /// must outlast a few ticks, or the lease would change hands between two of its holder's
    /// ticks.
    pub fn tick(
        &mut self,
        h: &impl Host,
        router: &RefCell<Router>,
        m: &Metrics,
        now_ms: u64,
        tick_ms: u32,
    ) {
        let Ok(mut guard) = router.try_borrow_mut() else {
            return;
        };
        let r = &mut *guard;
        let lp = &r.cfg().load_poll;
        let lost = self.poller.expire(now_ms, lp.timeout_ms);
        m.add(Counter::PollFailures, lost as i64);
        // The lease holder also reads pool memberships, which go on with load polls off.
        let cfg = r.cfg();
        let members = cfg.membership.interval_ms > 0 && cfg.models.iter().any(|m| m.pool.is_some());
        if (lp.interval_ms == 0 && !members) || cfg.peer_listener || !h.can_call() {
            return;
        }
        let (interval_ms, no_traffic_ms) = (lp.interval_ms, lp.no_traffic_interval_ms);
        let ttl = 3 * u64::from(interval_ms.max(tick_ms));
        let mut buf = Vec::new();
        let (poller, ids, hits) = (&self.poller, &self.ids, &self.hit_pace);
        let last_hits = self.last_hit_round_ms;
        let hold = self
            .lease
            .hold_with(h, self.me, now_ms, ttl, &mut buf, |out| {
                write_pace(poller, ids, hits, last_hits, out)
            });
        if !hold.held {
            return;
        }
        if hold.taken {
            self.adopt_pace(buf.get(16..).unwrap_or_default());
        }
        if interval_ms == 0 {
            self.read_members(h, r, m, now_ms);
            return; // no load polls, and the self-check's reads go with them
        }
        let pace = Pace::new(lp);
        let mut targets: Vec<Target> = Vec::new();
        for mi in 0..r.cfg().models.len() {
            let activity = || r.activity(h, mi);
            if self
                .poller
                .due(mi, now_ms, interval_ms, no_traffic_ms, activity)
            {
                targets.extend(self.poller.round(mi, now_ms, pace));
            }
        }
        let lp = &r.cfg().load_poll;
        for t in targets {
            let Some((w, upstream)) = r.cfg().models.get(usize::from(t.model)).and_then(|m| {
                let i = usize::from(t.worker);
                Some((m.workers.get(i)?, m.poll_clusters.get(i)?))
            }) else {
                continue;
            };
            let path = t.path(lp);
            let pooled = r
                .cfg()
                .models
                .get(usize::from(t.model))
                .is_some_and(|m| m.pool.is_some());
            match get_from(h, r.cfg(), upstream, w, pooled, path) {
                Ok(token) => self.poller.sent(token, t, now_ms),
                Err(_) => {
                    // Unknown cluster, or Envoy refused the call: a failed poll like any other.
                    self.poller.not_sent();
                    m.add(Counter::PollFailures, 1);
                }
            }
        }
        self.read_counters(h, r, m, now_ms);
        self.read_members(h, r, m, now_ms);
    }

    /// Takes over the schedule of the lease's last holder (`write_pace`): its load polls' and
    /// counter reads' back-offs and when it last asked, where it polled the same workers.
    fn adopt_pace(&mut self, b: &[u8]) {
        let mut matched = Vec::new();
        let Some(rest) = self.poller.adopt_pace(&self.ids, b, &mut matched) else {
            return;
        };
        let hits = self.hit_pace.iter().map(Vec::len).sum::<usize>();
        let Some((recs, last)) = rest.split_at_checked(hits * HIT_PACE_REC) else {
            return;
        };
        let Some(last) = last.first_chunk::<8>() else {
            return;
        };
        for ((p, rec), same) in self
            .hit_pace
            .iter_mut()
            .flatten()
            .zip(recs.chunks_exact(HIT_PACE_REC))
            .zip(matched)
        {
            let Some((&fails, skip)) = rec.split_first() else {
                continue;
            };
            if same {
                p.fails = fails;
                p.skip = u32::from_le_bytes(skip.try_into().unwrap_or([0; 4]));
            }
        }
        let last = u64::from_le_bytes(*last);
        self.last_hit_round_ms = (last != u64::MAX).then_some(last);
    }

    /// Reads Envoy's admin `/clusters` each `membership.interval_ms` when a model is a pool
    /// (`membership.rs`); one read in flight at most.
    fn read_members(&mut self, h: &impl Host, r: &Router, m: &Metrics, now_ms: u64) {
        let mc = &r.cfg().membership;
        if mc.interval_ms == 0 || !r.cfg().models.iter().any(|m| m.pool.is_some()) {
            return;
        }
        self.member_calls.expire(now_ms, mc.timeout_ms, |_| {
            m.add(Counter::MembershipFailures, 1)
        });
        let due = self
            .last_member_read_ms
            .is_none_or(|at| since(at, now_ms) >= u64::from(mc.interval_ms));
        if !due || self.member_calls.iter().next().is_some() {
            return;
        }
        self.last_member_read_ms = Some(now_ms);
        let headers = [
            (":method", "GET"),
            (":path", mc.path.as_str()),
            (":authority", "prefix-router"),
        ];
        match h.http_call(&mc.cluster, &headers, None, mc.timeout_ms) {
            Ok(token) => self.member_calls.push(token, now_ms, ()),
            Err(_) => m.add(Counter::MembershipFailures, 1),
        }
    }

    /// The admin read's answer, when `token` is one (`false`: not ours): each pool model's
    /// healthy hosts, stamped with their join times, published for every VM.
    pub fn members_answer(
        &mut self,
        h: &impl Host,
        router: &RefCell<Router>,
        m: &Metrics,
        token: u32,
        status: Option<u32>,
        body_size: usize,
    ) -> bool {
        if self.member_calls.take(token).is_none() {
            return false;
        }
        if status != Some(200) || body_size > membership::MAX_ANSWER {
            m.add(Counter::MembershipFailures, 1);
            return true;
        }
        let body = h.buffer(Buffer::HttpCallResponseBody, body_size);
        let Ok(r) = router.try_borrow() else {
            return true;
        };
        let (now, _) = now_ticks(h);
        let (mut buf, mut previous) = (Vec::new(), Vec::new());
        let mut read = false;
        for model in &r.cfg().models {
            let Some(pool) = &model.pool else {
                continue;
            };
            let Some(mut scan) = membership::scan(&body, &pool.cluster, pool.max_workers) else {
                continue; // the cluster is not in the answer: keep what was published
            };
            read = true;
            m.add(Counter::MembershipDropped, scan.dropped as i64);
            previous.clear();
            if h.get(&pool.members_key, &mut buf).is_some() {
                membership::decode(&buf, pool.max_workers, &mut previous);
            }
            membership::stamp(&mut scan.members, &previous, now);
            membership::publish(h, &pool.members_key, &scan.members, &mut buf);
        }
        m.add(
            if read {
                Counter::MembershipAnswers
            } else {
                Counter::MembershipFailures
            },
            1,
        );
        true
    }

    /// Reads every worker's token counters each `metrics_interval_ms` (`hits.rs`); a clock
    /// step starts a round (`schedule::since`).
    fn read_counters(&mut self, h: &impl Host, r: &Router, m: &Metrics, now_ms: u64) {
        let lp = &r.cfg().load_poll;
        if lp.metrics_interval_ms == 0 {
            return;
        }
        let max_skip = HitPace::max_skip(lp.metrics_interval_ms);
        let pace = &mut self.hit_pace;
        self.hit_calls.expire(now_ms, lp.timeout_ms, |&(mi, wi)| {
            m.add(Counter::HitFailures, 1);
            if let Some(p) = pace_of(pace, mi, wi) {
                p.failed(max_skip);
            }
        });
        if self
            .last_hit_round_ms
            .is_some_and(|at| since(at, now_ms) < u64::from(lp.metrics_interval_ms))
        {
            return;
        }
        self.last_hit_round_ms = Some(now_ms);
        for (mi, model) in r.cfg().models.iter().enumerate() {
            let pooled = model.pool.is_some();
            for (wi, (w, upstream)) in model.workers.iter().zip(&model.poll_clusters).enumerate() {
                let (mi, wi) = (mi as u16, wi as u16);
                if self.hit_calls.iter().any(|&c| c == (mi, wi)) {
                    continue;
                }
                if pace_of(&mut self.hit_pace, mi, wi).is_some_and(HitPace::skip_round) {
                    continue;
                }
                match get_from(h, r.cfg(), upstream, w, pooled, &lp.metrics_path) {
                    Ok(token) => self.hit_calls.push(token, now_ms, (mi, wi)),
                    Err(_) => {
                        m.add(Counter::HitFailures, 1);
                        if let Some(p) = pace_of(&mut self.hit_pace, mi, wi) {
                            p.failed(max_skip);
                        }
                    }
                }
            }
        }
    }

    /// A counter read's answer, when `token` is one (`false`: not ours, nothing read): the
    /// sample is published for every VM's check (`hits.rs`).
    pub fn counters_answer(
        &mut self,
        h: &impl Host,
        router: &RefCell<Router>,
        m: &Metrics,
        token: u32,
        status: Option<u32>,
        body_size: usize,
    ) -> bool {
        let Some((mi, wi)) = self.hit_calls.take(token) else {
            return false;
        };
        let counters = if status == Some(200) {
            hits::parse(&h.buffer(Buffer::HttpCallResponseBody, body_size))
        } else {
            None
        };
        let max_skip = HitPace::max_skip(
            router
                .try_borrow()
                .map_or(0, |r| r.cfg().load_poll.metrics_interval_ms),
        );
        let Some(p) = pace_of(&mut self.hit_pace, mi, wi) else {
            return true; // a worker of an earlier configuration
        };
        let Some(counters) = counters else {
            m.add(Counter::HitFailures, 1);
            p.failed(max_skip);
            return true;
        };
        *p = HitPace::default();
        let Ok(r) = router.try_borrow() else {
            return true;
        };
        let (mi, wi) = (usize::from(mi), usize::from(wi));
        let Some((model, w)) = r
            .cfg()
            .models
            .get(mi)
            .and_then(|model| Some((model, model.workers.get(wi)?)))
        else {
            return true;
        };
        let (at, nanos) = now_ticks(h);
        let learned = self.poller.rate_sample(mi, wi, counters, nanos / 1_000_000);
        let sample = hits::Sample {
            counters,
            at: at.max(1),
            rate: learned.rate,
            slot_us: learned.slot_us,
            util_ppm: learned.util_ppm,
        };
        let mut buf = Vec::new();
        hits::publish(h, &model.hits_key, w.id, wi, &sample, &mut buf);
        true
    }

    /// A load poll's answer (any token that is not a counter read's or a peer batch's: the
    /// body is read before the token is looked up, as always). Publishes the worker's load
    /// with this Envoy's own load at the answer (`poll.rs`, "Merge"), and the poll gauges at a
    /// round's last answer.
    pub fn load_answer(
        &mut self,
        h: &impl Host,
        router: &RefCell<Router>,
        m: &Metrics,
        token: u32,
        status: Option<u32>,
        body_size: usize,
    ) {
        let body = h.buffer(Buffer::HttpCallResponseBody, body_size);
        let Some((t, load)) = self.poller.answer(token, status, &body) else {
            return;
        };
        let counter = if load.is_some() {
            Counter::PollAnswers
        } else {
            Counter::PollFailures
        };
        m.add(counter, 1);
        let (now, _) = now_ticks(h);
        let Ok(mut r) = router.try_borrow_mut() else {
            return;
        };
        let (mi, w) = (usize::from(t.model), usize::from(t.worker));
        let p = match load {
            Some(l) => {
                let (snap_reqs, snap_tokens) = r.own_load(h, mi, w);
                Polled {
                    reqs: l.reqs,
                    tokens: l.tokens,
                    snap_reqs,
                    snap_tokens,
                    at: now.max(1),
                    capacity: l.capacity,
                    waiting: l.waiting,
                }
            }
            None => Polled::default(), // failed: unknown until the next good answer
        };
        let Some(model) = r.cfg().models.get(mi) else {
            return;
        };
        let mut buf = Vec::new();
        poll::publish(h, &model.poll_key, model.workers[w].id, w, &p, &mut buf);
        if !self.poller.settled(t.model) {
            return; // the gauges once per round, at its last answer
        }
        let mut all = Vec::new();
        if let Some(ids) = r.worker_ids(mi) {
            poll::decode(&buf, ids, model.workers.len(), &mut all);
        }
        let (oldest, unknown) = round_gauges(&all, now, r.cfg().load_poll.stale_ms / 100);
        m.set(h, Gauge::PollAgeMs, u64::from(oldest) * 100);
        m.set(h, Gauge::PollUnknown, unknown as u64);
    }
}

/// The longest period of a worker's counter reads while they fail (ms): a worker without
/// `--enable-metrics` answers 404 for as long as it runs, and each read costs this Envoy an HTTP
/// call. A worker whose reads start to succeed is read every round again within this.
pub const METRICS_BACKOFF_MS: u32 = 60_000;

/// How a worker's counter reads fail: after `fails` failures in a row it skips 1, 3, 7, ...
/// rounds (the first failure after a good read skips none), at most [`HitPace::max_skip`]; a
/// good read resets it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct HitPace {
    fails: u8,
    skip: u32,
}

impl HitPace {
    /// Rounds skipped at most, so that the period stays within [`METRICS_BACKOFF_MS`].
    fn max_skip(interval_ms: u32) -> u32 {
        (METRICS_BACKOFF_MS / interval_ms.max(1)).saturating_sub(1)
    }
    fn failed(&mut self, max_skip: u32) {
        self.fails = self.fails.saturating_add(1);
        let doublings = u32::from(self.fails - 1).min(31);
        self.skip = ((1u64 << doublings) - 1).min(u64::from(max_skip)) as u32;
    }
    /// Whether this round skips the worker (counting the round off when it does).
    fn skip_round(&mut self) -> bool {
        if self.skip == 0 {
            return false;
        }
        self.skip -= 1;
        true
    }
}

/// Bytes per worker of the counter reads' schedule in a lease value (`write_pace`); adopted
/// where the load polls' record at the same position named the same worker.
const HIT_PACE_REC: usize = 5;

/// The lease holder's schedule, written with each lease it writes (`poll_lease::PollLease`):
/// the load polls' ([`Poller::write_pace`]), then per worker its counter reads' failures and rounds
/// still skipped, then when the last round of them started (`u64::MAX`: none yet). The next
/// holder adopts it (`Polls::adopt_pace`).
fn write_pace(
    poller: &Poller,
    ids: &[Vec<u32>],
    hits: &[Vec<HitPace>],
    last: Option<u64>,
    out: &mut Vec<u8>,
) {
    poller.write_pace(ids, out);
    for p in hits.iter().flatten() {
        out.push(p.fails);
        out.extend_from_slice(&p.skip.to_le_bytes());
    }
    out.extend_from_slice(&last.unwrap_or(u64::MAX).to_le_bytes());
}

fn pace_of(pace: &mut [Vec<HitPace>], mi: u16, wi: u16) -> Option<&mut HitPace> {
    pace.get_mut(usize::from(mi))?.get_mut(usize::from(wi))
}

/// `GET path` from worker `w` through `upstream` (its poll cluster): a pool worker is named in
/// the destination header, since its poll cluster is the whole pool.
fn get_from(
    h: &impl Host,
    cfg: &Config,
    upstream: &str,
    w: &Worker,
    pooled: bool,
    path: &str,
) -> Result<u32, CallRefused> {
    let headers = [
        (":method", "GET"),
        (":path", path),
        (":authority", w.cluster.as_str()),
        (cfg.destination_header.as_str(), w.cluster.as_str()),
    ];
    let headers = if pooled { &headers[..] } else { &headers[..3] };
    h.http_call(upstream, headers, None, cfg.load_poll.timeout_ms)
}

/// A model's published loads at clock `now` (100 ms units): the oldest good answer's age, and
/// the workers without a fresh one (never answered, failed, or older than `stale`).
fn round_gauges(all: &[Polled], now: u32, stale: u32) -> (u32, usize) {
    let unknown = all
        .iter()
        .filter(|p| p.at == 0 || now.wrapping_sub(p.at) > stale)
        .count();
    let oldest = all
        .iter()
        .filter(|p| p.at != 0)
        .map(|p| now.wrapping_sub(p.at))
        .max()
        .unwrap_or(0);
    (oldest, unknown)
}
