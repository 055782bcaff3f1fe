//! The filter's metrics: every name in one table, increments batched per VM, and the per-worker
//! gauge families.
//!
//! **Table.** [`Counter`] and [`Gauge`] list the fixed metrics with their names; the families
//! are `requests.<reason>` (one counter per [`Reason`]), `inflight_{requests,tokens}.<cluster>`
//! and `hit_check.{predicted,actual}_ppm.<cluster>` (one gauge each per configured worker).
//! [`Metrics::define`] defines them all once per configuration, in one pass over the table.
//! Envoy finds a metric by name, so the order of definition means nothing outside this VM.
//!
//! **Batching.** Counters and the in-flight gauges are summed in a VM-local vector and sent to
//! Envoy at most once per 100 ms clock unit from a decision ([`Metrics::maybe_flush`]) and every
//! 200 ms from the tick ([`Metrics::flush`]): one host call per changed metric per flush instead
//! of 6-8 per request. They lag by at most one tick; the routing state itself (shared data)
//! never lags. The in-flight gauges take signed deltas, so a VM adds only its own changes and
//! Envoy sums every VM's. The [`Gauge`]s and the self-check gauges are *set* (absolute values
//! computed from shared data), straight to Envoy when computed: they are not batched.
//!
//! Costs: an increment is an index into the local vector (no host call, no allocation); a flush
//! is one host call per slot that changed. Defining allocates the vectors once per
//! configuration.

use crate::config::Config;
use crate::host::{Host, MetricKind};
use crate::index::WriteStats;
use crate::policy::Reason;
use crate::router::{Decision, Router};
use std::cell::{Cell, RefCell, RefMut};

/// An enum of metrics and its table of names (`prefix_router.` + the name), in one place.
macro_rules! metric_table {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $v:ident = $s:literal,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $v,)*
        }

        impl $name {
            /// Every metric of the kind, in declaration order (the discriminant is the index).
            pub const ALL: &'static [($name, &'static str)] = &[$(($name::$v, $s),)*];

            pub fn name(self) -> &'static str {
                $name::ALL[self as usize].1
            }
        }
    };
}

metric_table! {
    /// Counters (batched increments).
    Counter {
        BlocksPrompt = "prefix_router.blocks.prompt",
        BlocksMatched = "prefix_router.blocks.matched",
        /// Index record writes, CAS conflicts and dropped writes: decisions (a prompt's records
        /// its worker is not known to hold), commits (2xx) and applied peer batches; records
        /// written at a decision and taken back when its request failed.
        IndexWrites = "prefix_router.index.writes",
        IndexConflicts = "prefix_router.index.cas_conflicts",
        IndexDropped = "prefix_router.index.dropped_updates",
        IndexRetracted = "prefix_router.index.retracted",
        IndexProbes = "prefix_router.index.probes",
        Truncated = "prefix_router.prompts.truncated",
        PollAnswers = "prefix_router.load_poll.answers",
        PollFailures = "prefix_router.load_poll.failures",
        PeerBatchesSent = "prefix_router.peers.batches_sent",
        PeerRecordsSent = "prefix_router.peers.records_sent",
        PeerSendFailures = "prefix_router.peers.send_failures",
        PeerRecordsDropped = "prefix_router.peers.records_dropped",
        PeerRecordsReceived = "prefix_router.peers.records_received",
        PeerRecordsIgnored = "prefix_router.peers.records_ignored",
        /// Placements of new prompts received from peers (`placements.rs`).
        PeerPlacementsReceived = "prefix_router.peers.placements_received",
        PeerRequestsRejected = "prefix_router.peers.requests_rejected",
        PeerBatchesStale = "prefix_router.peers.batches_stale",
        PeerBatchesReplayed = "prefix_router.peers.batches_replayed",
        PeerBatchesBadMac = "prefix_router.peers.batches_bad_mac",
        PeerRecordsOverBudget = "prefix_router.peers.records_over_budget",
        LoadUnderflows = "prefix_router.load.underflows",
        /// PD: requests sent to a prefill + decode pair, bodies refused, client bootstrap fields
        /// dropped.
        PdRequests = "prefix_router.pd.requests",
        PdBadBody = "prefix_router.pd.bad_body",
        PdClientFields = "prefix_router.pd.client_bootstrap_fields",
        /// The index's self-check (`hits.rs`): workers aged out, failed counter reads.
        HitAgedOut = "prefix_router.hit_check.aged_out",
        HitFailures = "prefix_router.hit_check.failures",
        /// Pool models (`membership.rs`): admin reads answered and failed, hosts dropped
        /// (malformed or beyond `max_workers`), worker lists rebuilt (per VM), requests left to
        /// the pool's fallback policy (no known worker), requests a fallback was seen to serve
        /// (their record and load went to it; `served.rs` says which responses look).
        MembershipAnswers = "prefix_router.membership.answers",
        MembershipFailures = "prefix_router.membership.failures",
        MembershipDropped = "prefix_router.membership.dropped_hosts",
        MembershipRebuilds = "prefix_router.membership.rebuilds",
        PoolUnplaced = "prefix_router.pool.unplaced",
        ServedByFallback = "prefix_router.served_by_fallback",
    }
}

metric_table! {
    /// Gauges set (not added) from shared data, sent when computed.
    Gauge {
        /// The poller's last round: oldest answer's age, workers without a fresh one.
        PollAgeMs = "prefix_router.load_poll.age_ms",
        PollUnknown = "prefix_router.load_poll.unknown_workers",
        /// In-flight requests / tokens over the live load leases.
        LoadRequests = "prefix_router.load.requests",
        LoadTokens = "prefix_router.load.tokens",
    }
}

/// A worker's name in per-worker metrics: its cluster, or for a pool worker
/// `<pool cluster>_<address>` with the address's dots and colons as underscores (a dot would
/// split the stat name).
fn stat_name(m: &crate::config::Model, w: &crate::config::Worker) -> String {
    match &m.pool {
        Some(p) => {
            let a: String = w
                .cluster
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            format!("{}_{a}", p.cluster)
        }
        None => w.cluster.clone(),
    }
}

/// Batched slots: the counters, then one per reason, then two per worker (in-flight requests,
/// tokens), workers in configuration order.
const REASONS: usize = Counter::ALL.len();
const INFLIGHT: usize = REASONS + Reason::ALL.len();

pub struct Metrics {
    /// Envoy's id of each batched slot (0: Envoy refused the name; its increments are dropped).
    ids: Vec<u32>,
    pending: RefCell<Vec<i64>>,
    /// Clock (100 ms units) of the last flush from a decision.
    last_flush: Cell<u32>,
    /// Per model, the index of its first worker among all workers; one more entry closes the
    /// last model (so `base[m + 1] - base[m]` is model `m`'s worker count).
    base: Vec<usize>,
    gauges: [u32; Gauge::ALL.len()],
    /// Per worker (as `base`): the self-check's (predicted, reported) reuse gauges.
    hit_ppm: Vec<(u32, u32)>,
}

impl Metrics {
    /// Defines every metric of `cfg` (one host call each).
    pub fn define(h: &impl Host, cfg: &Config) -> Metrics {
        let mut base = Vec::with_capacity(cfg.models.len() + 1);
        base.push(0);
        for m in &cfg.models {
            base.push(base.last().copied().unwrap_or(0) + m.workers.len());
        }
        let mut ids = Vec::with_capacity(INFLIGHT + 2 * base.last().copied().unwrap_or(0));
        for &(_, name) in Counter::ALL {
            ids.push(h.define_metric(MetricKind::Counter, name));
        }
        for r in Reason::ALL {
            let name = format!("prefix_router.requests.{}", r.as_str());
            ids.push(h.define_metric(MetricKind::Counter, &name));
        }
        for (m, w) in cfg
            .models
            .iter()
            .flat_map(|m| m.workers.iter().map(move |w| (m, w)))
        {
            let c = stat_name(m, w);
            for family in ["inflight_requests", "inflight_tokens"] {
                let name = format!("prefix_router.{family}.{c}");
                ids.push(h.define_metric(MetricKind::Gauge, &name));
            }
        }
        let mut gauges = [0; Gauge::ALL.len()];
        for (id, &(_, name)) in gauges.iter_mut().zip(Gauge::ALL) {
            *id = h.define_metric(MetricKind::Gauge, name);
        }
        let hit_ppm = cfg
            .models
            .iter()
            .flat_map(|m| m.workers.iter().map(move |w| (m, w)))
            .map(|(m, w)| {
                let c = stat_name(m, w);
                let gauge = |family: &str| {
                    let name = format!("prefix_router.hit_check.{family}.{c}");
                    h.define_metric(MetricKind::Gauge, &name)
                };
                (gauge("predicted_ppm"), gauge("actual_ppm"))
            })
            .collect();
        Metrics {
            pending: RefCell::new(vec![0; ids.len()]),
            ids,
            last_flush: Cell::new(0),
            base,
            gauges,
            hit_ppm,
        }
    }

    fn pending(&self) -> Pending<'_> {
        Pending(self.pending.borrow_mut())
    }

    pub fn add(&self, c: Counter, by: i64) {
        self.pending().add(c, by);
    }

    /// The outcome of index record writes (a commit, an applied peer batch).
    pub fn index_writes(&self, w: &WriteStats) {
        let mut p = self.pending();
        p.add(Counter::IndexWrites, w.writes);
        p.add(Counter::IndexConflicts, w.conflicts);
        p.add(Counter::IndexDropped, w.dropped);
        p.add(Counter::IndexRetracted, w.retracted);
    }

    /// One request answered for `reason` without a routed decision (passthrough, rejected).
    pub fn request(&self, reason: Reason) {
        self.pending().slot(REASONS + reason.index(), 1);
    }

    /// A routed decision's counters and its charge on the in-flight gauges; both decide paths
    /// (plain and PD) count through here.
    pub fn decision(&self, d: &Decision) {
        let mut p = self.pending();
        p.slot(REASONS + d.reason.index(), 1);
        p.add(Counter::BlocksPrompt, d.total_blocks);
        p.add(Counter::BlocksMatched, d.matched_blocks);
        p.add(Counter::IndexProbes, d.probes);
        p.add(Counter::Truncated, d.truncated);
        self.inflight_in(&mut p, d, 1);
    }

    /// Moves the in-flight gauges of `d`'s worker by `sign` times its charge (+1: charged, -1:
    /// released).
    pub fn inflight(&self, d: &Decision, sign: i64) {
        self.inflight_in(&mut self.pending(), d, sign);
    }

    fn inflight_in(&self, p: &mut Pending, d: &Decision, sign: i64) {
        let Some(w) = self.worker(usize::from(d.model), usize::from(d.worker)) else {
            return;
        };
        p.slot(INFLIGHT + 2 * w, sign * i64::from(d.charged_reqs));
        p.slot(INFLIGHT + 2 * w + 1, sign * i64::from(d.charged_tokens));
    }

    /// Worker `w` of model `m` among all workers; `None` when not configured.
    fn worker(&self, m: usize, w: usize) -> Option<usize> {
        let (&start, &end) = (self.base.get(m)?, self.base.get(m + 1)?);
        (start + w < end).then_some(start + w)
    }

    /// Sets a gauge (one host call).
    pub fn set(&self, h: &impl Host, g: Gauge, value: u64) {
        h.record_metric(self.gauges[g as usize], value);
    }

    /// Sets every worker's self-check gauges from `window(model, worker)` = (predicted ppm,
    /// reported ppm); a worker without a window keeps its last values.
    pub fn set_hit_check(
        &self,
        h: &impl Host,
        window: impl Fn(usize, usize) -> Option<(u32, u32)>,
    ) {
        for (mi, pair) in self.base.windows(2).enumerate() {
            for (wi, &(p, a)) in self.hit_ppm[pair[0]..pair[1]].iter().enumerate() {
                if let Some((predicted, actual)) = window(mi, wi) {
                    h.record_metric(p, u64::from(predicted));
                    h.record_metric(a, u64::from(actual));
                }
            }
        }
    }

    /// After the router's tick: its load underflows and the self-check's verdicts, the
    /// self-check gauges when a window closed, and with `sample` the in-flight load as shared
    /// data holds it (live leases), not as this VM counted it: a release that never reached
    /// shared data stays visible.
    pub fn after_tick(&self, h: &impl Host, r: &mut Router, sample: bool) {
        self.add(Counter::LoadUnderflows, r.take_load_underflows() as i64);
        let (closed, aged_out) = r.take_hit_checks();
        self.add(Counter::HitAgedOut, aged_out as i64);
        if closed {
            self.set_hit_check(h, |mi, wi| {
                let win = r.hit_window(mi, wi)?;
                Some((win.predicted_ppm, win.actual_ppm))
            });
        }
        if sample {
            let (q, t) = r.sampled_load();
            self.set(h, Gauge::LoadRequests, q);
            self.set(h, Gauge::LoadTokens, t);
        }
    }

    /// Sends pending increments to Envoy (gauges take signed deltas).
    pub fn flush(&self, h: &impl Host) {
        let mut pending = self.pending.borrow_mut();
        for (&id, p) in self.ids.iter().zip(pending.iter_mut()) {
            if *p != 0 && id != 0 {
                h.increment_metric(id, *p);
            }
            *p = 0;
        }
    }

    /// Flushes when at least one clock unit (100 ms) passed since the last flush.
    pub fn maybe_flush(&self, h: &impl Host, now: u32) {
        if now != self.last_flush.get() {
            self.last_flush.set(now);
            self.flush(h);
        }
    }
}

/// The pending increments, borrowed once for all of a caller's increments.
struct Pending<'a>(RefMut<'a, Vec<i64>>);

impl Pending<'_> {
    /// Batches `by` on `slot` (out of range: ignored).
    fn slot(&mut self, slot: usize, by: i64) {
        if let Some(p) = self.0.get_mut(slot) {
            *p += by;
        }
    }

    fn add(&mut self, c: Counter, by: impl Into<i64>) {
        self.slot(c as usize, by.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::FakeHost;

    #[test]
    fn the_table_names_each_metric_once_and_in_declaration_order() {
        for (i, &(c, _)) in Counter::ALL.iter().enumerate() {
            assert_eq!(c as usize, i);
        }
        for (i, &(g, _)) in Gauge::ALL.iter().enumerate() {
            assert_eq!(g as usize, i);
        }
        let cfg = Config::from_json(
            br#"{"models":{"a":{"workers":["w0","w1"]},"b":{"workers":["w2"]}},"default_model":"a"}"#,
        )
        .unwrap();
        let h = FakeHost::default();
        let m = Metrics::define(&h, &cfg);
        let names: Vec<String> = h
            .state
            .borrow()
            .metrics
            .iter()
            .map(|e| e.0.clone())
            .collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        let n = Counter::ALL.len() + Reason::ALL.len() + 3 * 2 + Gauge::ALL.len() + 3 * 2;
        assert_eq!(names.len(), n);
        // Model b's only worker is the third: its gauges are w2's.
        let d = Decision::uncharged(1, 0, Reason::PrefixHit).with_charge(1, 7);
        m.inflight(&d, 1);
        m.flush(&h);
        assert_eq!(h.metric("prefix_router.inflight_tokens.w2"), Some(7));
        assert_eq!(h.metric("prefix_router.inflight_tokens.w0"), Some(0));
        // A worker that is not configured moves nothing.
        m.inflight(
            &Decision::uncharged(1, 1, Reason::PrefixHit).with_charge(1, 7),
            1,
        );
        m.flush(&h);
        assert_eq!(h.metric("prefix_router.inflight_tokens.w2"), Some(7));
    }
}
