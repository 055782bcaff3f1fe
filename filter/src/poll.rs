//! Polled worker load: what each worker says about its own queue, shared by every VM of an
//! Envoy, merged with this Envoy's own in-flight counts.
//!
//! Why: an Envoy's load vector (`load.rs`) counts only the requests *this* Envoy routed. With N
//! replicas each sees about 1/N of a worker's queue, so N load bounds together admit N times the
//! intended load; traffic that bypasses Envoy is invisible. Each worker knows its real queue, so
//! one VM per Envoy (the holder of a lease in shared data, see
//! [`PollLease`](crate::poll_lease::PollLease)) asks every worker for it every
//! `load_poll.interval_ms` (`GET /v1/loads`; `GET /get_load` for a worker that answers 404) and
//! publishes the answers in one shared-data value per model ([`publish`]). `/get_load`
//! reports no capacity, so a worker whose answers lack one is also asked once for its server
//! information (`GET /get_server_info`, else `/server_info`), and again after a failed load
//! poll (a restart may change it): its `max_running_requests` then goes with every load answer,
//! and "saturated" means the worker's own capacity whichever endpoint it has: its running batch
//! full, the requests waiting for prefill left out ([`capacity`]). The counters it reads for the
//! index's self-check (`hits.rs`) also teach it each worker's prefill rate and how fast a full
//! batch frees a slot ([`Poller::rate_sample`]).
//!
//! **Merge.** A published record carries the worker's polled `(requests, tokens)` `P` and this
//! Envoy's own in-flight counts `S` at the moment the answer arrived. A decision then uses, per
//! worker, `max(L, P + L − S)` with `L` the own counts now: the polled load plus this Envoy's
//! changes since the poll, and never less than what this Envoy alone has in flight there. A single
//! Envoy without other traffic sees `P ≈ S`, i.e. exactly its own counts, as without polling.
//!
//! **Unknown is not idle.** A worker whose last poll failed, or whose last good answer is older
//! than `load_poll.stale_ms`, counts as `max(L, mean of the known workers)`: neither a magnet for
//! new work (an unreachable load endpoint must not look idle) nor excluded (it may well serve).
//! When no worker is known, the decision uses the own counts alone (polling off, or all down).
//!
//! Costs: the poller makes one HTTP call per worker per interval (per `no_traffic_interval_ms`
//! for a model without traffic, see [`Poller`], and at most that often to a worker whose polls
//! keep failing, see [`Pace`]) and one CAS per answer that changes what was published; every VM re-reads each
//! model's published value once per tick (50 ms), so a decision pays no host call for polled
//! load. Staleness: at most interval + tick + the worker's answer time (the no-traffic interval
//! instead of the interval for a model's first request after a quiet spell).

use crate::config::LoadPollConfig;
pub use crate::load_answer::Load;
use crate::records::{rd, wr, ById};
use crate::schedule::Calls;
use crate::store::Store;

/// Published record: worker id, polled requests, polled tokens, own requests at the poll, own
/// tokens at the poll, time of the last good answer (100 ms units; 0 = unknown), the worker's
/// running-request capacity (0 = not reported), its requests waiting to start. Little-endian.
const REC: usize = 32;

/// One worker's polled state as read by a VM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Polled {
    pub reqs: u32,
    pub tokens: u32,
    pub snap_reqs: u32,
    pub snap_tokens: u32,
    /// Time of the last good answer, 100 ms units; 0 = never or failed.
    pub at: u32,
    /// Requests the worker runs at once (`max_running_requests`); 0: not reported.
    pub capacity: u32,
    /// Of `reqs`, those waiting to start (`num_waiting_reqs`): no running slot holds them.
    pub waiting: u32,
}

/// Reads a published value into one [`Polled`] per configured worker (`n` workers, `ids` their
/// id map; unknown when missing). O(m log n) for m records, whatever their order.
pub fn decode(b: &[u8], ids: &ById, n: usize, out: &mut Vec<Polled>) {
    out.clear();
    out.resize(n, Polled::default());
    ids.each(b, REC, |p, o| {
        if let Some(slot) = out.get_mut(p) {
            *slot = Polled {
                reqs: rd(b, o + 4),
                tokens: rd(b, o + 8),
                snap_reqs: rd(b, o + 12),
                snap_tokens: rd(b, o + 16),
                at: rd(b, o + 20),
                capacity: rd(b, o + 24),
                waiting: rd(b, o + 28),
            };
        }
    });
}

/// Writes one worker's fields into its record at offset `o` of a published value.
fn fill(b: &mut [u8], o: usize, p: &Polled) {
    for (k, v) in [
        p.reqs,
        p.tokens,
        p.snap_reqs,
        p.snap_tokens,
        p.at,
        p.capacity,
        p.waiting,
    ]
    .into_iter()
    .enumerate()
    {
        wr(b, o + 4 + 4 * k, v);
    }
}

/// Publishes one answer (or a failure: `p.at == 0`) with a CAS read-modify-write. Only the lease
/// holder writes, so conflicts are rare (a lease hand-over); returns false if all tries lost.
pub fn publish<S: Store>(
    store: &S,
    key: &str,
    id: u32,
    hint: usize,
    p: &Polled,
    buf: &mut Vec<u8>,
) -> bool {
    crate::records::publish(store, key, REC, id, hint, buf, |b, o| fill(b, o, p))
}

/// Whether `p` is a good answer at most `stale` (100 ms units) old at `now`.
fn fresh(p: &Polled, now: u32, stale: u32) -> bool {
    p.at != 0 && now.wrapping_sub(p.at) <= stale
}

/// Replaces the own counts `reqs`/`tokens` (one per worker) by the merged view (module docs).
/// `polled` is indexed like the workers (empty when polling is off). Returns how many workers
/// were unknown while at least one other was known.
pub fn merge(polled: &[Polled], now: u32, stale: u32, reqs: &mut [u32], tokens: &mut [u32]) -> u32 {
    if polled.len() != reqs.len() || polled.len() != tokens.len() {
        return 0;
    }
    let (mut known, mut sum_r, mut sum_t) = (0u64, 0u64, 0u64);
    for ((p, r), t) in polled.iter().zip(reqs.iter_mut()).zip(tokens.iter_mut()) {
        if fresh(p, now, stale) {
            *r = own_plus_polled(*r, p.reqs, p.snap_reqs);
            *t = own_plus_polled(*t, p.tokens, p.snap_tokens);
            known += 1;
            sum_r += u64::from(*r);
            sum_t += u64::from(*t);
        }
    }
    if known == 0 || known == polled.len() as u64 {
        return 0;
    }
    let (mean_r, mean_t) = ((sum_r / known) as u32, (sum_t / known) as u32);
    let mut unknown = 0;
    for ((p, r), t) in polled.iter().zip(reqs.iter_mut()).zip(tokens.iter_mut()) {
        if !fresh(p, now, stale) {
            *r = (*r).max(mean_r);
            *t = (*t).max(mean_t);
            unknown += 1;
        }
    }
    unknown
}

/// Each worker's admission limit from a fresh answer into `out` (one per record of `polled`, 0
/// for a worker not known or not reporting its capacity): the merged in-flight count (`merge`)
/// at which its running batch is full, `max_running_requests` plus the requests that were
/// waiting to start at the poll. Those hold no running slot: a new request waits for them
/// through their queued prefill, which the polled tokens carry, not for a slot. Compared with
/// `max_running_requests` alone, a worker with prefill queued would count as saturated while
/// its batch has room, and a holder would lose its follow-ups for a queue the cost prices.
pub fn capacity(polled: &[Polled], now: u32, stale: u32, out: &mut Vec<u32>) {
    out.clear();
    out.extend(polled.iter().map(|p| {
        if fresh(p, now, stale) && p.capacity > 0 {
            p.capacity.saturating_add(p.waiting)
        } else {
            0
        }
    }));
}

/// What a worker that must not be chosen counts as (far above any load bound).
pub const UNAVAILABLE: u32 = u32::MAX / 4;

/// PD prefill workers: a worker whose last poll failed or is stale while another answered is
/// marked [`UNAVAILABLE`] in `reqs` (the load bound then skips it, and so does the least loaded
/// fallback). A mirror cannot be retried or cancel its decode request, so a prefill sent to a
/// dead worker costs the client the whole bootstrap timeout; a worker that cannot answer a load
/// poll is not worth that risk. Returns how many were marked. With no worker known (polling off,
/// or before the first answers) nothing changes.
pub fn exclude_unknown(polled: &[Polled], now: u32, stale: u32, reqs: &mut [u32]) -> u32 {
    if polled.len() != reqs.len() {
        return 0;
    }
    if !polled.iter().any(|p| fresh(p, now, stale)) {
        return 0;
    }
    let mut n = 0;
    for (p, r) in polled.iter().zip(reqs.iter_mut()) {
        if !fresh(p, now, stale) {
            *r = UNAVAILABLE;
            n += 1;
        }
    }
    n
}

/// `max(own, polled + own − own_at_poll)`, saturating.
fn own_plus_polled(own: u32, polled: u32, own_at_poll: u32) -> u32 {
    let v = i64::from(polled) + i64::from(own) - i64::from(own_at_poll);
    v.clamp(i64::from(own), i64::from(u32::MAX)) as u32
}

/// A worker's answer: in-flight requests (running + waiting), queued prompt tokens and capacity,
/// summed over data-parallel ranks; `None` for anything that is not a load answer (read in one
/// pass without a JSON tree: [`crate::load_answer`]).
pub fn parse_load(body: &[u8]) -> Option<Load> {
    crate::load_answer::parse(body)
}

/// One poll in flight: which worker, whether it asks for the worker's server info (capacity)
/// instead of its load, and whether it asked the fallback path of the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub model: u16,
    pub worker: u16,
    pub fallback: bool,
    pub info: bool,
}

/// Older SGLang's server information (capacity settings), and its newer name.
pub const SERVER_INFO_PATH: &str = "/get_server_info";
pub const SERVER_INFO_FALLBACK_PATH: &str = "/server_info";

impl Target {
    /// The path this call asks.
    pub fn path<'a>(&self, lp: &'a LoadPollConfig) -> &'a str {
        match (self.info, self.fallback) {
            (false, false) => &lp.path,
            (false, true) => &lp.fallback_path,
            (true, false) => SERVER_INFO_PATH,
            (true, true) => SERVER_INFO_FALLBACK_PATH,
        }
    }
}

/// Bytes per worker of a schedule handed over with the lease ([`Poller::write_pace`]).
pub const PACE_REC: usize = 14;

/// The doublings of a failing worker's poll period are capped here (the period is capped by
/// [`Pace::bound_ms`] or [`NO_LOAD_ENDPOINT_MS`] long before).
const MAX_BACKOFF: u8 = 16;

/// The longest poll period of a worker whose polls are *answered*, but not with a load answer
/// (a 2xx that is not one, a 4xx on the last path tried: an engine without SGLang's load
/// endpoints, an auth or routing layer in front of it). Unlike an outage (no answer, a 5xx),
/// nothing suggests it will answer next time: it is asked again after a doubling period up to
/// this (~7 polls a minute for four such workers instead of eight a second), and a good
/// answer brings it back to every round.
pub const NO_LOAD_ENDPOINT_MS: u32 = 30_000;

/// How often each worker of a model in a round is asked: every round (`interval_ms`) while its
/// load polls succeed, or once its last one succeeded; after failures in a row its period
/// doubles per further failure up to `bound_ms` (an outage: no answer, or a 5xx), or up to
/// [`NO_LOAD_ENDPOINT_MS`] when the worker answered with something that is not a load answer.
///
/// Why: a worker that is down, restarting or answering something that is not a load answer
/// stays unknown (`merge`) whatever the poll rate, and asking it ten times a second costs this
/// Envoy an HTTP call, a body read and a publish each time (~0.2 M instructions, see
/// docs/performance.md) and the worker's endpoint a request. The first failure after a good
/// answer is asked again at the next round (one lost answer is not an outage); a worker back
/// after an outage is seen within `bound_ms` plus the answer's time, one that starts serving
/// load answers where it answered something else within [`NO_LOAD_ENDPOINT_MS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    pub interval_ms: u32,
    /// `no_traffic_interval_ms`, at least `interval_ms` (the no-traffic period: the schedule's
    /// slowest).
    pub bound_ms: u32,
}

impl Pace {
    pub fn new(lp: &LoadPollConfig) -> Pace {
        Pace {
            interval_ms: lp.interval_ms,
            bound_ms: lp.no_traffic_interval_ms.max(lp.interval_ms),
        }
    }

    /// The poll period after `backoff` doublings (ms), capped by `bound_ms`, or by
    /// [`NO_LOAD_ENDPOINT_MS`] when the last failure was an answer (`answered`).
    fn period_ms(&self, backoff: u8, answered: bool) -> u64 {
        let cap = if answered {
            self.bound_ms.max(NO_LOAD_ENDPOINT_MS)
        } else {
            self.bound_ms
        };
        (u64::from(self.interval_ms) << backoff.min(MAX_BACKOFF)).min(u64::from(cap))
    }

    /// Whether a worker asked at `asked_ms`, `backoff` doublings in, is due in a round at
    /// `now_ms`. Rounds come on 50 ms ticks at least `interval_ms` apart, so a period is met
    /// within half an interval (a round a few ms early must not wait a whole interval more).
    fn due(&self, asked_ms: Option<u64>, backoff: u8, answered: bool, now_ms: u64) -> bool {
        match asked_ms {
            Some(at) if backoff > 0 => {
                let since = crate::schedule::since(at, now_ms);
                since.saturating_add(u64::from(self.interval_ms / 2))
                    >= self.period_ms(backoff, answered)
            }
            _ => true,
        }
    }
}

/// What the poller knows of one worker's endpoints.
#[derive(Debug, Clone, Copy, Default)]
struct Endpoint {
    /// It answered 404 on the primary load path: use the fallback.
    fallback: bool,
    /// Its load answers report no capacity: read it from its server info.
    wants_info: bool,
    /// Its server info was read (or cannot be: both paths refused); read again after a failed
    /// load poll (a restart may change it).
    info_done: bool,
    /// `/get_server_info` answered 404: ask `/server_info`.
    info_fallback: bool,
    /// The last load poll failed.
    down: bool,
    /// ... and it has answered with something that is not a load answer since its last good
    /// one (not an outage: see [`NO_LOAD_ENDPOINT_MS`]).
    answered_wrong: bool,
    /// Failed load polls in a row, less one: each doubles the worker's poll period (up to
    /// [`Pace::bound_ms`]); a good answer resets it.
    backoff: u8,
    /// When its last load poll was sent (ms); `None` before the first.
    asked_ms: Option<u64>,
    /// `max_running_requests` from the server info; 0: unknown.
    capacity: u32,
    /// Whether every load answer since the last counter sample showed requests waiting (`None`:
    /// no answer since): the worker was busy throughout, so its counters show its rate.
    backlogged: Option<bool>,
    /// The last counter sample and when it was read (ms).
    counted: Option<(crate::hits::Counters, u64)>,
    /// Learned prefill rate, uncached prompt tokens per busy second; 0: not yet.
    rate: f64,
    /// The running requests its load answers reported since the last counter sample.
    running: Running,
    /// Learned seconds between two requests finishing while its batch is full; 0: not yet.
    slot: f64,
    /// Learned prefill utilisation (0..1; 0: not yet): 1 for a window with requests waiting
    /// at every poll, else its uncached prompt tokens per second over the learned rate;
    /// averaged like the rate.
    util: f64,
}

/// The running requests (requests less those waiting) a worker's load answers reported over a
/// counter window: their sum, how many answers, and the last capacity they carried.
#[derive(Debug, Default, Clone, Copy)]
struct Running {
    sum: u64,
    answers: u32,
    capacity: u32,
}

/// `old` with a new window's `sample` averaged in (weight [`RATE_WEIGHT`]); the first sample
/// (`old` 0: nothing learned) is taken as it is.
fn average_in(old: f64, sample: f64) -> f64 {
    if old > 0.0 {
        old + RATE_WEIGHT * (sample - old)
    } else {
        sample
    }
}

/// What the poller learned from a worker's counters ([`Poller::rate_sample`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Learned {
    /// Prefill rate, uncached prompt tokens per busy second; 0: not learned.
    pub rate: u32,
    /// Microseconds between two requests finishing while the running batch is full; 0: not
    /// learned.
    pub slot_us: u32,
    /// Prefill utilisation in parts per million: 1 for a window in which every load answer
    /// showed requests waiting (its prefill never idle), else the uncached prompt tokens it
    /// prefilled per second over its learned rate; averaged like the rate; 0: not learned.
    pub util_ppm: u32,
}

/// A window needs this many finished requests to say how long a request runs.
const SLOT_MIN_REQUESTS: u64 = 4;

/// A busy window shorter than this (ms) says too little about a rate.
const RATE_MIN_WINDOW_MS: u64 = 1000;
/// ... and one that prefilled fewer uncached tokens than this.
const RATE_MIN_TOKENS: u64 = 512;
/// Weight of a new busy window in the learned rate (an exponential average: SGLang counts a
/// request's tokens when it finishes, so single windows are noisy).
const RATE_WEIGHT: f64 = 0.25;

/// What a model's load value (`load.rs`) says about its traffic, read by the poller: its
/// stamp (the CAS token, which every decision and every written release changes; `None` when
/// the value is missing) and whether a request is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    pub stamp: Option<u32>,
    pub busy: bool,
}

/// The poller's schedule and in-flight calls (kept by the lease holder's VM).
///
/// **Schedule.** Each model is polled every `interval_ms` while it has traffic: a request in
/// flight, or a decision or release since its last round (its load value's stamp moved). A
/// model without traffic is polled every `no_traffic_ms` instead (as Envoy's health checks use
/// `no_traffic_interval`): its view stays fresh for the next request (answers younger than
/// `stale_ms` when `no_traffic_ms + timeout_ms < stale_ms`) while an idle Envoy stops costing
/// its own CPU and every worker's load endpoint ten calls a second. Within a round, a worker
/// whose polls keep failing is skipped until its [`Pace`] period passed. Cost: one shared-data get
/// per model per tick between the two periods. A round that lies in the future (the wall clock
/// stepped back) makes the next one due at once ([`crate::schedule`]).
#[derive(Default)]
pub struct Poller {
    /// Per model: when its last round started (ms) and its load value's stamp then; `None`
    /// before the first round.
    last_round: Vec<Option<(u64, Option<u32>)>>,
    /// Per model, per worker: its endpoints ([`Endpoint`]).
    endpoints: Vec<Vec<Endpoint>>,
    /// Calls awaiting an answer (expiring, see [`Poller::expire`]).
    inflight: Calls<Target>,
    pub failures: u64,
    pub answers: u64,
}

impl Poller {
    pub fn new(workers_per_model: impl Iterator<Item = usize>) -> Poller {
        let endpoints: Vec<Vec<Endpoint>> = workers_per_model
            .map(|n| vec![Endpoint::default(); n])
            .collect();
        Poller {
            last_round: vec![None; endpoints.len()],
            endpoints,
            ..Poller::default()
        }
    }

    /// Whether model `mi`'s round is due at `now_ms` (the schedule in the type's docs);
    /// `activity` is read only once `interval_ms` has passed. Starts the round when due.
    pub fn due(
        &mut self,
        mi: usize,
        now_ms: u64,
        interval_ms: u32,
        no_traffic_ms: u32,
        activity: impl FnOnce() -> Activity,
    ) -> bool {
        let Some(last) = self.last_round.get_mut(mi) else {
            return false;
        };
        let since = last.map(|(at, _)| crate::schedule::since(at, now_ms));
        if interval_ms == 0 || since.is_some_and(|s| s < u64::from(interval_ms)) {
            return false;
        }
        let a = activity();
        let traffic = a.busy || a.stamp.is_none() || last.is_none_or(|(_, s)| s != a.stamp);
        let quiet_due = since.is_none_or(|s| s >= u64::from(no_traffic_ms.max(interval_ms)));
        if !traffic && !quiet_due {
            return false;
        }
        *last = Some((now_ms, a.stamp));
        true
    }

    /// Targets of model `mi`'s round at `now_ms`, skipping workers whose previous call is still
    /// in flight (a slow worker is asked at most once at a time; the call's timeout bounds it,
    /// and [`Poller::expire`] a call whose answer never comes) and failing workers whose period
    /// ([`Pace`]) has not passed. A worker whose load answers report no capacity (an older
    /// SGLang's `/get_load`) is also asked for its server info, once, and again after a failed
    /// load poll.
    pub fn round(&self, mi: usize, now_ms: u64, pace: Pace) -> impl Iterator<Item = Target> + '_ {
        self.endpoints
            .get(mi)
            .into_iter()
            .flat_map(move |ws| {
                ws.iter().enumerate().flat_map(move |(w, e)| {
                    let load = Target {
                        model: mi as u16,
                        worker: w as u16,
                        fallback: e.fallback,
                        info: false,
                    };
                    let due = pace.due(e.asked_ms, e.backoff, e.answered_wrong, now_ms);
                    let load = due.then_some(load);
                    let info = (e.wants_info && !e.info_done).then_some(Target {
                        model: mi as u16,
                        worker: w as u16,
                        fallback: e.info_fallback,
                        info: true,
                    });
                    load.into_iter().chain(info)
                })
            })
            .filter(|t| {
                !self
                    .inflight
                    .iter()
                    .any(|i| i.model == t.model && i.worker == t.worker && i.info == t.info)
            })
    }

    fn endpoint(&mut self, t: Target) -> Option<&mut Endpoint> {
        self.endpoints
            .get_mut(usize::from(t.model))
            .and_then(|m| m.get_mut(usize::from(t.worker)))
    }

    /// A call dispatched at `now_ms` (wall clock).
    pub fn sent(&mut self, token: u32, t: Target, now_ms: u64) {
        if !t.info {
            if let Some(e) = self.endpoint(t) {
                e.asked_ms = Some(now_ms);
            }
        }
        self.inflight.push(token, now_ms, t);
    }

    /// Forgets calls without an answer `timeout_ms` plus a margin after they were sent (see
    /// [`crate::schedule`]): each is a failed poll, and its worker is asked again in the next
    /// round. Returns how many expired.
    pub fn expire(&mut self, now_ms: u64, timeout_ms: u32) -> u64 {
        let mut n = 0;
        self.inflight.expire(now_ms, timeout_ms, |_| n += 1);
        self.failures += n;
        n
    }

    /// Whether no call to a worker of model `mi` awaits an answer (its round is complete).
    pub fn settled(&self, mi: u16) -> bool {
        !self.inflight.iter().any(|t| t.model == mi)
    }

    /// Appends each worker's schedule to a lease value
    /// ([`PollLease::hold_until`](crate::poll_lease::PollLease::hold_until)): per model
    /// its worker count, per worker [`PACE_REC`] bytes (its id from `ids`, when it was last
    /// asked, its back-off, whether it is down, answered without a load endpoint, or uses the
    /// fallback path).
    pub fn write_pace(&self, ids: &[Vec<u32>], out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.endpoints.len() as u16).to_le_bytes());
        for (mi, ws) in self.endpoints.iter().enumerate() {
            out.extend_from_slice(&(ws.len() as u16).to_le_bytes());
            for (wi, e) in ws.iter().enumerate() {
                let id = ids.get(mi).and_then(|m| m.get(wi)).copied().unwrap_or(0);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&e.asked_ms.unwrap_or(u64::MAX).to_le_bytes());
                out.push(e.backoff);
                out.push(
                    u8::from(e.down) | u8::from(e.answered_wrong) << 1 | u8::from(e.fallback) << 2,
                );
            }
        }
    }

    /// Takes over the schedule another lease holder wrote ([`Poller::write_pace`]), so that a
    /// lease changing hands does not ask at once every worker the last holder was backing off
    /// from: each worker whose position holds the same id (`ids`, as in `write_pace`) adopts its
    /// record, and `matched` says which did, in order over all models. Returns the bytes after
    /// the schedule; `None` (nothing adopted): no schedule, or one for other worker counts.
    pub fn adopt_pace<'b>(
        &mut self,
        ids: &[Vec<u32>],
        b: &'b [u8],
        matched: &mut Vec<bool>,
    ) -> Option<&'b [u8]> {
        let count = |b: &'b [u8]| -> Option<(usize, &'b [u8])> {
            let (n, rest) = b.split_first_chunk::<2>()?;
            Some((usize::from(u16::from_le_bytes(*n)), rest))
        };
        let (models, mut rest) = count(b)?;
        if models != self.endpoints.len() {
            return None;
        }
        let mut check = rest;
        for ws in &self.endpoints {
            let (n, r) = count(check)?;
            if n != ws.len() {
                return None;
            }
            check = r.get(n * PACE_REC..)?;
        }
        matched.clear();
        for (mi, ws) in self.endpoints.iter_mut().enumerate() {
            rest = count(rest)?.1;
            for (wi, e) in ws.iter_mut().enumerate() {
                let (rec, r) = rest.split_first_chunk::<PACE_REC>()?;
                rest = r;
                let id = ids.get(mi).and_then(|m| m.get(wi)).copied().unwrap_or(0);
                let (Some(their), Some(asked), Some(&[backoff, flags])) = (
                    rec.first_chunk::<4>(),
                    rec.get(4..12).and_then(|a| <[u8; 8]>::try_from(a).ok()),
                    rec.last_chunk::<2>(),
                ) else {
                    matched.push(false);
                    continue;
                };
                let same = id != 0 && u32::from_le_bytes(*their) == id;
                matched.push(same);
                if !same {
                    continue; // another worker at this position: its own schedule
                }
                let asked = u64::from_le_bytes(asked);
                e.asked_ms = (asked != u64::MAX).then_some(asked);
                e.backoff = backoff.min(MAX_BACKOFF);
                e.down = flags & 1 != 0;
                e.answered_wrong = flags & 2 != 0;
                e.fallback = flags & 4 != 0;
            }
        }
        Some(rest)
    }

    /// A dispatch that failed at once (unknown cluster, ...).
    pub fn not_sent(&mut self) {
        self.failures += 1;
    }

    /// Handles an answer: returns the target and the parsed load (`None` = failed poll). A 404
    /// on the primary path switches that worker to the fallback path for the next round and is
    /// not a failure (an older SGLang): it returns `None` like an unknown token. A load answer
    /// without a capacity carries the one the worker's server info reported. A server-info
    /// answer is kept here and returns `None` (nothing to publish until the next load answer).
    pub fn answer(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &[u8],
    ) -> Option<(Target, Option<Load>)> {
        let t = self.inflight.take(token)?;
        let e = self
            .endpoints
            .get_mut(usize::from(t.model))
            .and_then(|m| m.get_mut(usize::from(t.worker)))?;
        if t.info {
            match status {
                Some(404) if !t.fallback => e.info_fallback = true,
                _ => {
                    let info = match status {
                        Some(200) => crate::load_answer::parse_server_info(body),
                        _ => None,
                    };
                    e.capacity = info.map_or(0, |i| i.max_running_requests);
                    // Read or refused: asked again only after a failed load poll.
                    e.info_done = true;
                }
            }
            return None;
        }
        let parsed = match status {
            Some(200) => parse_load(body),
            Some(404) if !t.fallback => {
                e.fallback = true;
                return None;
            }
            _ => None,
        };
        match parsed {
            Some(mut l) => {
                self.answers += 1;
                e.backlogged = Some(e.backlogged.unwrap_or(true) && l.waiting > 0);
                if e.down {
                    // Back after a failure (maybe a restart): read its capacity again.
                    e.info_done = false;
                    e.info_fallback = false;
                }
                e.down = false;
                e.answered_wrong = false;
                e.backoff = 0;
                if l.capacity == 0 {
                    e.wants_info = true;
                    l.capacity = e.capacity;
                }
                let r = &mut e.running;
                r.sum = r
                    .sum
                    .saturating_add(u64::from(l.reqs.saturating_sub(l.waiting)));
                r.answers = r.answers.saturating_add(1);
                r.capacity = l.capacity;
                Some((t, Some(l)))
            }
            None => {
                // The first failure after a good answer is asked again next round; each
                // further one doubles the period ([`Pace`]).
                if e.down {
                    e.backoff = e.backoff.saturating_add(1).min(MAX_BACKOFF);
                }
                self.failures += 1;
                e.down = true;
                // An answer (2xx-4xx) that is no load answer: the endpoint is not there, which
                // no retry soon will change; no answer or a 5xx: an outage, soon over, unless
                // the worker answered without a load endpoint before (a call that timed out
                // says nothing new about it). Only a good answer clears it.
                e.answered_wrong |= status.is_some_and(|s| (200..500).contains(&s));
                e.backlogged = Some(false);
                Some((t, None))
            }
        }
    }

    /// Worker `w` of model `mi` reported its cumulative counters `c` at `now_ms` (`hits.rs`).
    ///
    /// **Rate.** When every load answer since its previous sample showed requests waiting, the
    /// uncached tokens it counted per second of that window are its prefill rate while busy,
    /// averaged into the rate it returns (tokens/s; 0: not learned yet). Counters that went
    /// backwards (a restart) forget it. A worker never busy keeps the configured rate
    /// (`policy.cost.prefill_tokens_per_second`): a rate measured while idle would be its
    /// traffic, not its speed.
    ///
    /// **Slot.** By Little's law a request holds a running slot for `T = N / X` seconds, `N`
    /// the mean running requests its load answers reported over the window and `X` the
    /// requests it finished per second; with its batch full (`C` = `max_running_requests`
    /// running) one finishes every `T / C` seconds: the wait for a slot per request ahead
    /// (`policy/cost.rs`). Averaged like the rate; a window needs a known capacity and
    /// [`SLOT_MIN_REQUESTS`] finished requests, and a worker whose counter does not grow keeps
    /// what it had.
    pub fn rate_sample(
        &mut self,
        mi: usize,
        w: usize,
        c: crate::hits::Counters,
        now_ms: u64,
    ) -> Learned {
        let Some(e) = self.endpoints.get_mut(mi).and_then(|m| m.get_mut(w)) else {
            return Learned::default();
        };
        let run = std::mem::take(&mut e.running);
        let busy = e.backlogged.take() == Some(true);
        if let Some((c0, t0)) = e.counted.replace((c, now_ms)) {
            let dt = now_ms.saturating_sub(t0);
            if c.requests < c0.requests {
                e.slot = 0.0;
            } else if run.answers > 0
                && run.capacity > 0
                && c.requests - c0.requests >= SLOT_MIN_REQUESTS
                && dt > 0
            {
                // T / C = (N / X) / C, X = finished / dt.
                let mean_running = run.sum as f64 / f64::from(run.answers);
                let per_second = (c.requests - c0.requests) as f64 * 1000.0 / dt as f64;
                e.slot = average_in(e.slot, mean_running / per_second / f64::from(run.capacity));
            }
            if c.prompt < c0.prompt || c.cached < c0.cached {
                e.rate = 0.0;
                e.util = 0.0;
            } else {
                let done = (c.prompt - c0.prompt).saturating_sub(c.cached - c0.cached);
                let per_second = done as f64 * 1000.0 / dt.max(1) as f64;
                if busy && dt >= RATE_MIN_WINDOW_MS && done >= RATE_MIN_TOKENS {
                    e.rate = average_in(e.rate, per_second);
                }
                if e.rate > 0.0 && dt >= RATE_MIN_WINDOW_MS {
                    // A window with requests waiting at every poll had its prefill busy
                    // throughout: 1, whatever its counters' noise says. Otherwise throughput
                    // over rate; an idle window is a sample of 0, not "nothing learned".
                    let u = if busy {
                        1.0
                    } else {
                        (per_second / e.rate).clamp(0.0, 1.0)
                    };
                    e.util += RATE_WEIGHT * (u - e.util);
                }
            }
        }
        Learned {
            rate: e.rate.min(f64::from(u32::MAX)) as u32,
            slot_us: (e.slot * 1e6).min(f64::from(u32::MAX)) as u32,
            util_ppm: (e.util * 1e6) as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{worker_id, Worker};
    use crate::store::MemStore;

    fn workers(n: usize) -> Vec<Worker> {
        (0..n)
            .map(|i| {
                let c = format!("w{i}");
                Worker {
                    id: worker_id(&c),
                    cluster: c,
                    weight: 1.0,
                    address: None,
                }
            })
            .collect()
    }

    /// Every worker asked in every round (no back-off).
    const EVERY: Pace = Pace {
        interval_ms: 100,
        bound_ms: 100,
    };

    fn known(reqs: u32, snap: u32, at: u32) -> Polled {
        Polled {
            reqs,
            tokens: reqs * 100,
            snap_reqs: snap,
            snap_tokens: snap * 100,
            at,
            capacity: 0,
            waiting: 0,
        }
    }

    #[test]
    fn requests_waiting_to_start_hold_no_running_slot() {
        // 16 slots; 20 requests, 12 of them waiting for prefill: 8 run, the batch has room.
        let p = |waiting| Polled {
            reqs: 20,
            at: 5,
            capacity: 16,
            waiting,
            ..Polled::default()
        };
        let mut out = Vec::new();
        capacity(&[p(12), p(4), p(0)], 5, 10, &mut out);
        assert_eq!(out, [28, 20, 16]);
        let room = |cap: u32| 20 < cap;
        assert!(room(out[0]), "8 running of 16: room");
        assert!(!room(out[1]), "16 running: full");
        assert!(!room(out[2]), "none waiting: all 20 hold slots, full");
        // Unknown capacity, or a stale answer: 0 (unknown), whatever waits.
        let unknown = Polled {
            capacity: 0,
            ..p(12)
        };
        capacity(&[unknown, p(12)], 50, 10, &mut out);
        assert_eq!(out, [0, 0]);
        // The field survives publication.
        let s = crate::store::MemStore::new();
        let mut buf = Vec::new();
        assert!(publish(&s, "k", 7, 0, &p(12), &mut buf));
        let ids = ById::new([7u32].into_iter());
        let mut got = Vec::new();
        assert!(s.get("k", &mut buf).is_some());
        decode(&buf, &ids, 1, &mut got);
        assert_eq!(got, [p(12)]);
    }

    #[test]
    fn parses_both_sglang_load_endpoints() {
        let v1 = br#"{"timestamp":1.0,"loads":[
            {"dp_rank":0,"num_running_reqs":3,"num_waiting_reqs":2,"num_waiting_uncached_tokens":700},
            {"dp_rank":1,"num_running_reqs":1,"num_waiting_reqs":0,"num_waiting_uncached_tokens":5}]}"#;
        let load = |reqs, tokens, capacity, waiting| {
            Some(Load {
                reqs,
                tokens,
                capacity,
                waiting,
            })
        };
        assert_eq!(parse_load(v1), load(6, 705, 0, 2));
        let bare = br#"[{"dp_rank":0,"num_running_reqs":4,"num_waiting_reqs":1,"max_running_requests":16}]"#;
        assert_eq!(parse_load(bare), load(5, 0, 16, 1));
        let old = br#"[{"dp_rank":0,"num_reqs":7,"num_waiting_reqs":4,"num_tokens":900}]"#;
        assert_eq!(parse_load(old), load(7, 0, 0, 4));
        for bad in [
            &b"not json"[..],
            b"{}",
            b"[]",
            b"[1,2]",
            b"\"x\"",
            b"{\"loads\":7}",
        ] {
            assert_eq!(parse_load(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn merge_adds_other_replicas_and_keeps_own_changes() {
        // Worker 0: 10 in flight at the poll, 2 of them ours; since then we added 1 (L = 3).
        // Worker 1: polled 1, ours 1 at the poll, ours finished since (L = 0): nobody else's.
        // Worker 2: the poll saw fewer than ours (ours still in transit): ours count.
        let p = [known(10, 2, 50), known(1, 1, 50), known(0, 2, 50)];
        let (mut r, mut t) = (vec![3, 0, 2], vec![300, 0, 200]);
        assert_eq!(merge(&p, 52, 10, &mut r, &mut t), 0);
        assert_eq!(r, vec![11, 0, 2]);
        assert_eq!(t, vec![1100, 0, 200]);
    }

    #[test]
    fn prefill_workers_that_stopped_answering_are_unavailable_while_another_answers() {
        let p = [known(3, 1, 50), Polled::default(), known(1, 1, 30)];
        let mut r = [1, 0, 0];
        // Worker 1 failed (at 0), worker 2 is stale (30 + 10 < 55).
        assert_eq!(exclude_unknown(&p, 55, 10, &mut r), 2);
        assert_eq!(r, [1, UNAVAILABLE, UNAVAILABLE]);
        // Nobody known: unchanged (polling off, or before the first answers).
        let mut r = [1, 0, 0];
        assert_eq!(exclude_unknown(&[Polled::default(); 3], 55, 10, &mut r), 0);
        assert_eq!(r, [1, 0, 0]);
        assert_eq!(exclude_unknown(&[], 55, 10, &mut r), 0);
    }

    #[test]
    fn stale_or_failed_workers_count_as_average_not_idle() {
        // Worker 2 failed (at 0), worker 3 is stale: both count as the known mean (10).
        let p = [
            known(12, 0, 50),
            known(8, 0, 50),
            Polled::default(),
            known(0, 0, 10),
        ];
        let (mut r, mut t) = (vec![0, 0, 0, 15], vec![0; 4]);
        assert_eq!(merge(&p, 55, 10, &mut r, &mut t), 2);
        assert_eq!(r, vec![12, 8, 10, 15], "unknown = max(own, mean)");
        // Nothing known: own counts unchanged (as with polling off).
        let (mut r, mut t) = (vec![1, 2, 3, 4], vec![0; 4]);
        let none = [Polled::default(); 4];
        assert_eq!(merge(&none, 55, 10, &mut r, &mut t), 0);
        assert_eq!(r, vec![1, 2, 3, 4]);
        assert_eq!(merge(&[], 55, 10, &mut r, &mut t), 0);
    }

    #[test]
    fn published_records_round_trip_by_worker_id() {
        let ws = workers(3);
        let s = MemStore::new();
        let mut buf = Vec::new();
        assert!(publish(&s, "p", ws[2].id, 2, &known(5, 1, 9), &mut buf));
        assert!(publish(&s, "p", ws[0].id, 0, &known(7, 0, 9), &mut buf));
        assert!(publish(&s, "p", ws[2].id, 2, &known(6, 1, 10), &mut buf));
        s.get("p", &mut buf);
        let mut out = Vec::new();
        let ids = ById::new(ws.iter().map(|w| w.id));
        decode(&buf, &ids, 3, &mut out);
        assert_eq!(
            out,
            vec![known(7, 0, 9), Polled::default(), known(6, 1, 10)]
        );
        decode(b"garbage", &ids, 3, &mut out);
        assert_eq!(out, vec![Polled::default(); 3]);
        // A failure after a failure leaves the record as it is: no write (the CAS stays).
        assert!(publish(&s, "p", ws[1].id, 1, &Polled::default(), &mut buf));
        let cas = s.get("p", &mut buf);
        assert!(publish(&s, "p", ws[1].id, 1, &Polled::default(), &mut buf));
        assert_eq!(s.get("p", &mut buf), cas, "unchanged: not written");
        assert!(publish(&s, "p", ws[1].id, 1, &known(1, 0, 11), &mut buf));
        assert_ne!(s.get("p", &mut buf), cas);
        decode(&buf, &ids, 3, &mut out);
        assert_eq!(out[1], known(1, 0, 11));
    }

    #[test]
    fn a_model_without_traffic_is_polled_at_the_no_traffic_interval() {
        // Two models; model 0 has traffic throughout, model 1 none after its first round.
        let mut p = Poller::new([1usize, 1].into_iter());
        let at = |stamp, busy| move || Activity { stamp, busy };
        let quiet = at(Some(7), false);
        let mut rounds = [Vec::new(), Vec::new()];
        for now in (0..=2000).step_by(50) {
            if p.due(0, now, 100, 500, at(Some(now as u32), false)) {
                rounds[0].push(now);
            }
            if p.due(1, now, 100, 500, quiet) {
                rounds[1].push(now);
            }
        }
        assert_eq!(rounds[0], (0..=2000).step_by(100).collect::<Vec<u64>>());
        assert_eq!(rounds[1], vec![0, 500, 1000, 1500, 2000]);
        // Traffic again: the stamp moves (a decision) or a request is in flight.
        assert!(
            !p.due(1, 2050, 100, 500, at(Some(8), false)),
            "interval not yet passed"
        );
        assert!(
            p.due(1, 2100, 100, 500, at(Some(8), false)),
            "a decision since the round"
        );
        assert!(
            p.due(1, 2200, 100, 500, at(Some(8), true)),
            "a request in flight"
        );
        assert!(!p.due(1, 2300, 100, 500, at(Some(8), false)), "quiet again");
        assert!(
            p.due(1, 2300 + 400, 100, 500, at(None, false)),
            "no value: as traffic"
        );
        // Off, a no-traffic interval below the interval, an unknown model.
        assert!(!p.due(0, 9000, 0, 500, quiet));
        let mut q = Poller::new([1usize].into_iter());
        assert!(q.due(0, 0, 300, 100, quiet) && !q.due(0, 200, 300, 100, quiet));
        assert!(q.due(0, 300, 300, 100, quiet));
        assert!(!q.due(5, 0, 100, 500, quiet));
        assert_eq!(q.round(5, 0, EVERY).count(), 0);
    }

    #[test]
    fn poller_falls_back_on_404_and_never_stacks_calls() {
        let mut p = Poller::new([2usize].into_iter());
        let busy = || Activity {
            stamp: Some(1),
            busy: true,
        };
        assert!(p.due(0, 0, 100, 500, busy));
        assert!(!p.due(0, 50, 100, 500, busy));
        let ts: Vec<Target> = p.round(0, 0, EVERY).collect();
        assert_eq!(ts.len(), 2);
        p.sent(7, ts[0], 0);
        p.sent(8, ts[1], 0);
        assert_eq!(p.round(0, 0, EVERY).count(), 0, "both still in flight");
        assert!(!p.settled(0) && p.settled(1));
        assert!(
            p.answer(7, Some(404), b"").is_none(),
            "switches, not a failure"
        );
        let (_, l) = p
            .answer(8, Some(200), br#"[{"num_reqs":3,"num_tokens":1}]"#)
            .unwrap();
        assert_eq!(l.map(|l| (l.reqs, l.tokens)), Some((3, 0)));
        assert!(p.answer(8, Some(200), b"").is_none(), "unknown token");
        assert!(p.settled(0), "both answered");
        let next: Vec<Target> = p.round(0, 0, EVERY).filter(|t| !t.info).collect();
        assert!(next[0].fallback && !next[1].fallback);
        assert_eq!((p.answers, p.failures), (1, 0));
        p.sent(9, next[1], 0);
        let (_, l) = p.answer(9, Some(503), b"").unwrap();
        assert_eq!(l, None);
        assert_eq!(p.failures, 1);
    }

    #[test]
    fn a_failing_worker_is_asked_less_often_and_every_round_again_once_it_answers() {
        let lp = LoadPollConfig::default();
        let pace = Pace::new(&lp);
        assert_eq!((pace.interval_ms, pace.bound_ms), (100, 500));
        let mut p = Poller::new([2usize].into_iter());
        let ok = br#"[{"num_running_reqs":3,"num_waiting_reqs":0,"max_running_requests":8}]"#;
        let mut token = 0u32;
        // Rounds every 100 ms (on 50 ms ticks, one a tick late); worker 0 fails from 1000 ms
        // (a 503: an outage) to 3000 ms, worker 1 always answers.
        let mut asked: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        let mut now = 0;
        while now <= 4000 {
            let ts: Vec<Target> = p.round(0, now, pace).collect();
            for t in ts {
                token += 1;
                p.sent(token, t, now);
                asked[usize::from(t.worker)].push(now);
                let bad = t.worker == 0 && (1000..3000).contains(&now);
                let (status, body) = if bad { (503, &b""[..]) } else { (200, &ok[..]) };
                let got = p.answer(token, Some(status), body);
                assert_eq!(got.map(|(_, l)| l.is_some()), Some(!bad), "{now} {t:?}");
            }
            now += if now == 2000 { 150 } else { 100 };
        }
        let between = |v: &[u64], a, b| {
            v.iter()
                .filter(|&&t| a <= t && t < b)
                .copied()
                .collect::<Vec<_>>()
        };
        assert_eq!(asked[1].len(), 40, "the answering worker: every round");
        assert_eq!(
            between(&asked[0], 0, 1000).len(),
            10,
            "every round while it answers"
        );
        // First failure at 1000, asked again at once (1100), then after 200, 400, 500 ms (the
        // round at 2150 is 450 ms after 1700: within half an interval of the period).
        assert_eq!(
            between(&asked[0], 1000, 3000),
            [1000, 1100, 1300, 1700, 2150, 2650]
        );
        // Back at the first poll after 3000: every round from its first good answer.
        let back = between(&asked[0], 3000, 4001);
        assert_eq!(back[0], 3150);
        assert_eq!(back.windows(2).filter(|w| w[1] - w[0] != 100).count(), 0);
        assert_eq!(p.failures, 6);
        // A clock stepped back: the failing worker is due at once (`schedule::since`).
        let t = p.round(0, 4050, pace).find(|t| t.worker == 0).unwrap();
        token += 1;
        p.sent(token, t, 9000);
        p.answer(token, Some(503), b"");
        token += 1;
        p.sent(token, t, 9000);
        p.answer(token, Some(503), b"");
        assert_eq!(
            p.round(0, 9100, pace).filter(|t| t.worker == 0).count(),
            0,
            "backing off"
        );
        assert_eq!(
            p.round(0, 5000, pace).filter(|t| t.worker == 0).count(),
            1,
            "stepped back"
        );
    }

    /// A worker that answers, but never with a load answer (a 200 of something else, a 404 on
    /// both load paths, a 401), backs off up to [`NO_LOAD_ENDPOINT_MS`], not to the outage
    /// bound; an outage after it (no answer, a 5xx) is bounded by `bound_ms` again, and a good
    /// answer brings it back to every round.
    #[test]
    fn a_worker_answering_without_a_load_endpoint_is_asked_at_most_every_30_s() {
        let pace = Pace::new(&LoadPollConfig::default());
        let ok = br#"[{"num_running_reqs":1,"num_waiting_reqs":0,"max_running_requests":8}]"#;
        let chat = br#"{"id":"x","object":"chat.completion","choices":[]}"#;
        // (status, body) of worker 0's answers over time; every 50 ms tick is a round.
        let run = |answer: &dyn Fn(u64) -> (Option<u32>, &'static [u8])| {
            let mut p = Poller::new([1usize].into_iter());
            let (mut token, mut now, mut asked) = (0u32, 0u64, Vec::new());
            while now <= 240_000 {
                let ts: Vec<Target> = p.round(0, now, pace).collect();
                for t in ts {
                    token += 1;
                    p.sent(token, t, now);
                    asked.push((now, t.fallback));
                    let (status, body) = answer(now);
                    p.answer(token, status, body);
                }
                now += 100;
            }
            asked
        };
        let gaps = |asked: &[(u64, bool)], from: u64, to: u64| {
            let at: Vec<u64> = asked
                .iter()
                .map(|a| a.0)
                .filter(|t| (from..to).contains(t))
                .collect();
            at.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        };
        for (what, answer) in [
            ("a 200 that is no load answer", (Some(200), &chat[..])),
            ("a 404 on both paths", (Some(404), &b""[..])),
            ("a 401", (Some(401), &b""[..])),
        ] {
            let asked = run(&|_| answer);
            let g = gaps(&asked, 0, 240_000);
            assert_eq!(g.iter().max(), Some(&30_000), "{what}: {g:?}");
            assert!(asked.len() < 20, "{what}: {} polls in 240 s", asked.len());
            // Doubling: 100 ms, 200, 400, ... (the first failure asked again at once).
            assert!(g.windows(2).all(|w| w[1] >= w[0]), "{what}: {g:?}");
        }
        // The same worker as an outage (503, then no answer at all): the 500 ms bound.
        for status in [Some(503), None] {
            let asked = run(&|_| (status, &b""[..]));
            assert_eq!(gaps(&asked, 10_000, 240_000).iter().max(), Some(&500));
        }
        // Answering something else, and now and then no answer in time (a timeout says nothing
        // new about it): still the 30 s bound.
        let asked = run(&|now| {
            if now % 3 == 0 {
                (None, &b""[..])
            } else {
                (Some(200), &chat[..])
            }
        });
        let g = gaps(&asked, 60_000, 240_000);
        assert!(g.iter().all(|&g| g >= 25_000), "{g:?}");
        // Answering something else until 100 s, then load answers: back to every round within
        // 30 s, then every 100 ms.
        let asked = run(&|now| {
            if now < 100_000 {
                (Some(200), &chat[..])
            } else {
                (Some(200), &ok[..])
            }
        });
        let back = asked.iter().map(|a| a.0).find(|&t| t >= 100_000).unwrap();
        assert!(back < 130_000, "{back}");
        assert!(gaps(&asked, back, 240_000).iter().all(|&g| g == 100));
    }

    #[test]
    fn a_call_without_an_answer_expires_and_its_worker_is_asked_again() {
        let mut p = Poller::new([2usize].into_iter());
        let ts: Vec<Target> = p.round(0, 0, EVERY).collect();
        p.sent(1, ts[0], 10_000);
        p.sent(2, ts[1], 10_000);
        assert!(p.answer(2, Some(503), b"").is_some());
        let limit = 250 + crate::schedule::EXPIRY_MARGIN_MS;
        assert_eq!(p.expire(10_000 + limit, 250), 0);
        assert_eq!(
            p.round(0, 0, EVERY).map(|t| t.worker).collect::<Vec<_>>(),
            [1]
        );
        assert_eq!(p.expire(10_000 + limit + 1, 250), 1);
        assert_eq!(p.round(0, 0, EVERY).count(), 2, "asked again");
        assert!(p.settled(0));
        assert_eq!(p.failures, 2);
        // Its answer, late: ignored, counted nowhere.
        let ok = br#"[{"num_reqs":3,"num_tokens":1}]"#;
        assert!(p.answer(1, Some(200), ok).is_none());
        assert_eq!((p.answers, p.failures), (0, 2));
    }

    #[test]
    fn a_worker_without_v1_loads_is_bound_by_its_server_info_capacity() {
        use crate::config::Config;
        use crate::policy::{cache_aware, Inputs, Reason};
        let mut p = Poller::new([2usize].into_iter());
        let lp = LoadPollConfig::default();
        let mut token = 0u32;
        let mut ask = |p: &mut Poller, t: Target, status: u32, body: &[u8]| {
            token += 1;
            p.sent(token, t, 0);
            p.answer(token, Some(status), body)
        };
        let old = br#"[{"dp_rank":0,"num_reqs":20,"num_waiting_reqs":0,"num_tokens":0}]"#;
        // Worker 0: no /v1/loads, then /get_load without a capacity.
        let t = p.round(0, 0, EVERY).next().unwrap();
        assert!(ask(&mut p, t, 404, b"").is_none());
        let t = p.round(0, 0, EVERY).next().unwrap();
        assert_eq!(t.path(&lp), "/get_load");
        let (_, l) = ask(&mut p, t, 200, old).unwrap();
        assert_eq!(l.map(|l| l.capacity), Some(0));
        // Its server info is asked next round: /get_server_info, else /server_info.
        let info: Vec<Target> = p.round(0, 0, EVERY).filter(|t| t.info).collect();
        assert_eq!(info.len(), 1);
        assert_eq!(info[0].path(&lp), "/get_server_info");
        assert!(ask(&mut p, info[0], 404, b"").is_none());
        let t = p.round(0, 0, EVERY).find(|t| t.info).unwrap();
        assert_eq!(t.path(&lp), "/server_info");
        let body = br#"{"max_running_requests":32,"max_total_num_tokens":100000}"#;
        assert!(ask(&mut p, t, 200, body).is_none());
        assert_eq!(
            p.round(0, 0, EVERY).filter(|t| t.info).count(),
            0,
            "read once"
        );
        let t = p.round(0, 0, EVERY).next().unwrap();
        let (_, l) = ask(&mut p, t, 200, old).unwrap();
        let l = l.unwrap();
        assert_eq!(l.capacity, 32);
        // The policy: 20 requests on the holder of 90% of a 4000-token prompt, others idle; far
        // over the fleet-relative bound, under the capacity the server info gave: it stays.
        let m = Config::from_json(
            br#"{"models":{"m":{"workers":["w0","w1","w2","w3","w4","w5","w6","w7"]}}}"#,
        )
        .unwrap()
        .models
        .remove(0);
        let polled = [
            Polled {
                reqs: l.reqs,
                tokens: l.tokens,
                at: 1,
                capacity: l.capacity,
                ..Polled::default()
            },
            Polled {
                at: 1,
                ..Polled::default()
            },
        ];
        let mut cap = Vec::new();
        capacity(&polled, 1, 10, &mut cap);
        let pc = crate::config::PolicyConfig::default();
        let mut reqs = [20u32, 0];
        // Eight workers: the two polled above, six more without a reported capacity.
        let inp = |reqs: &[u32; 2], cap: &[u32]| {
            let mut matched = [0u32; 8];
            matched[0] = 90;
            let mut c = vec![0u32; 8];
            c[..cap.len()].copy_from_slice(cap);
            let mut r = vec![0u32; 8];
            r[..2].copy_from_slice(reqs);
            let inp = Inputs {
                model: &m,
                reqs: &r,
                tokens: &[0; 8],
                capacity: &c,
                matched: &matched,
                deepest: 90,
                total_blocks: 100,
                prompt_tokens: 4000,
                affinity: 1,
                group: 1,
                conversation_blocks: 0,
                head_blocks: 0,
                busy: &[],
                rate: &[],
                slot: &[],
                util: &[],
                placed: &[],
                recent: None,
                sharers: 0.0,
            };
            cache_aware::choose(&pc, &inp)
        };
        assert_eq!(inp(&reqs, &cap), (0, Reason::PrefixHit));
        // Without it (capacity unknown) the fleet-relative bound spills the holder.
        assert_eq!(inp(&reqs, &[]).1, Reason::LoadSpill);
        // At the capacity it reported: saturated, not eligible.
        reqs[0] = 32;
        assert_eq!(inp(&reqs, &cap).1, Reason::LoadSpill);
        // A failed poll (a restart?) and a good answer: the server info is read again.
        let t = p.round(0, 0, EVERY).next().unwrap();
        assert_eq!(ask(&mut p, t, 503, b"").map(|(_, l)| l), Some(None));
        assert_eq!(p.round(0, 0, EVERY).filter(|t| t.info).count(), 0);
        let t = p.round(0, 0, EVERY).next().unwrap();
        ask(&mut p, t, 200, old).unwrap();
        let t = p.round(0, 0, EVERY).find(|t| t.info).unwrap();
        assert_eq!(t.path(&lp), "/get_server_info");
        // Answers that are not server info leave the capacity unknown.
        assert!(ask(&mut p, t, 200, b"{}").is_none());
        let t = p.round(0, 0, EVERY).next().unwrap();
        assert_eq!(ask(&mut p, t, 200, old).unwrap().1.unwrap().capacity, 0);
    }

    /// Worker 0 of model 0 answers its next load poll with `running`, `waiting` and `cap`.
    fn answer_load(p: &mut Poller, token: &mut u32, running: u32, waiting: u32, cap: u32) {
        let t = p.round(0, 0, EVERY).find(|t| !t.info).unwrap();
        *token += 1;
        p.sent(*token, t, 0);
        let body = format!(
            r#"[{{"num_running_reqs":{running},"num_waiting_reqs":{waiting},"max_running_requests":{cap}}}]"#
        );
        p.answer(*token, Some(200), body.as_bytes()).unwrap();
    }

    #[test]
    fn the_prefill_rate_is_learned_from_busy_windows_only() {
        let mut p = Poller::new([1usize].into_iter());
        let mut token = 0;
        let mut answer = |p: &mut Poller, waiting: u32| answer_load(p, &mut token, 4, waiting, 8);
        let rate = |p: &mut Poller, mi: usize, prompt: u64, cached: u64, now: u64| {
            let c = crate::hits::Counters {
                prompt,
                cached,
                requests: 0,
            };
            p.rate_sample(mi, 0, c, now).rate
        };
        // First sample: nothing to compare with.
        assert_eq!(rate(&mut p, 0, 0, 0, 0), 0);
        // An idle window (nothing waiting): throughput is traffic, not speed.
        answer(&mut p, 0);
        assert_eq!(rate(&mut p, 0, 10_000, 0, 2000), 0);
        // A busy window: 30k prompt tokens, 6k of them cached, in 2 s: 12k tokens/s.
        answer(&mut p, 3);
        answer(&mut p, 1);
        assert_eq!(rate(&mut p, 0, 40_000, 6_000, 4000), 12_000);
        // One answer with nothing waiting makes the window idle.
        answer(&mut p, 3);
        answer(&mut p, 0);
        assert_eq!(rate(&mut p, 0, 80_000, 6_000, 6000), 12_000);
        // No answer at all since the last sample: not known to be busy.
        assert_eq!(rate(&mut p, 0, 90_000, 6_000, 8000), 12_000);
        // Busy again at 20k tokens/s: averaged in (weight 1/4).
        answer(&mut p, 2);
        assert_eq!(rate(&mut p, 0, 130_000, 6_000, 10_000), 14_000);
        // Too short a window, or too few tokens: ignored.
        answer(&mut p, 2);
        assert_eq!(rate(&mut p, 0, 140_000, 6_000, 10_500), 14_000);
        // Counters went backwards (a restart): forgotten.
        answer(&mut p, 2);
        assert_eq!(rate(&mut p, 0, 5, 0, 12_000), 0);
        // Unknown workers: 0.
        assert_eq!(rate(&mut p, 3, 5, 0, 12_000), 0);
    }

    #[test]
    fn the_utilisation_is_prefill_throughput_over_the_learned_rate_in_every_window() {
        let mut p = Poller::new([1usize].into_iter());
        let mut token = 0;
        let mut answer = |p: &mut Poller, waiting: u32| answer_load(p, &mut token, 4, waiting, 8);
        let util = |p: &mut Poller, prompt: u64, now: u64| {
            let c = crate::hits::Counters {
                prompt,
                cached: 0,
                requests: 0,
            };
            p.rate_sample(0, 0, c, now).util_ppm
        };
        assert_eq!(
            util(&mut p, 0, 0),
            0,
            "first sample: nothing to compare with"
        );
        // Before a rate is learned there is nothing to divide by.
        answer(&mut p, 0);
        assert_eq!(util(&mut p, 5_000, 1000), 0);
        // A busy window learns 10k tokens/s and is itself busy throughout: u = 1, averaged in
        // from nothing (weight 1/4), so one busy window does not make a fleet saturated.
        answer(&mut p, 3);
        assert_eq!(util(&mut p, 15_000, 2000), 250_000);
        // An idle window at 5k tokens/s: u = 1/2.
        answer(&mut p, 0);
        assert_eq!(util(&mut p, 20_000, 3000), 312_500);
        // A window with nothing prefilled: u = 0, averaged in.
        answer(&mut p, 0);
        assert_eq!(util(&mut p, 20_000, 4000), 234_375);
        // A busy window counts 1 even when its counters show less than the rate (they count a
        // request's tokens when it finishes): 6k tokens/s here.
        answer(&mut p, 3);
        assert_eq!(util(&mut p, 26_000, 5000), 425_781);
        // Busy throughout for long: towards 1.
        let mut last = 0;
        for k in 1..=40u64 {
            answer(&mut p, 3);
            last = util(&mut p, 26_000 + 10_000 * k, 5000 + 1000 * k);
        }
        assert!(last > 990_000, "{last}");
        // Counters went backwards (a restart): forgotten.
        answer(&mut p, 3);
        assert_eq!(util(&mut p, 5, 60_000), 0);
    }

    #[test]
    fn the_slot_interval_is_running_over_finished_per_second_over_capacity() {
        let mut p = Poller::new([1usize].into_iter());
        let mut token = 0;
        let mut answer = |p: &mut Poller, running: u32, waiting: u32, cap: u32| {
            answer_load(p, &mut token, running, waiting, cap)
        };
        let slot = |p: &mut Poller, requests: u64, now: u64| {
            let c = crate::hits::Counters {
                prompt: 1000,
                cached: 0,
                requests,
            };
            p.rate_sample(0, 0, c, now).slot_us
        };
        assert_eq!(
            slot(&mut p, 0, 0),
            0,
            "first sample: nothing to compare with"
        );
        // 6 and 10 running (mean 8; waiting requests hold no slot), 40 finished in 2 s: a
        // request runs 8 / 20 = 0.4 s, so with 16 slots one frees every 25 ms.
        answer(&mut p, 6, 5, 16);
        answer(&mut p, 10, 0, 16);
        assert_eq!(slot(&mut p, 40, 2000), 25_000);
        // Averaged in (weight 1/4): 8 running, 80 finished in 2 s: 0.2 s / 16 = 12.5 ms.
        answer(&mut p, 8, 0, 16);
        assert_eq!(slot(&mut p, 120, 4000), 21_875);
        // Too few finished, no answer, or no capacity known: kept.
        answer(&mut p, 8, 0, 16);
        assert_eq!(slot(&mut p, 122, 6000), 21_875);
        assert_eq!(slot(&mut p, 200, 8000), 21_875);
        answer(&mut p, 8, 0, 0);
        assert_eq!(slot(&mut p, 300, 10_000), 21_875);
        // The counter went backwards (a restart): forgotten.
        answer(&mut p, 8, 0, 16);
        assert_eq!(slot(&mut p, 3, 12_000), 0);
        // Unknown workers: nothing.
        let c = crate::hits::Counters::default();
        assert_eq!(p.rate_sample(3, 0, c, 12_000), Learned::default());
    }
}
