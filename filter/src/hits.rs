//! The index's self-check: the prefix hits the index predicted for each worker against the hits
//! the worker reports, and the worker's entries aged out when reality falls short.
//!
//! Why: the index learns what a worker holds only from what it was sent. It cannot see an
//! eviction the worker made under KV pressure sooner than `index.ttl_seconds`, a `/flush_cache`,
//! or a restart that emptied the cache; it would keep sending conversations to a worker that
//! recomputes them. SGLang counts what it actually reused (`sglang:cached_tokens_total` against
//! `sglang:prompt_tokens_total` on `/metrics`), and the poller already talks to every worker.
//!
//! **Samples.** The poll lease holder (`poll.rs`) reads each worker's Prometheus page every
//! `load_poll.metrics_interval_ms` ([`parse`]: the two counters and the finished requests, each
//! summed over every series, `sglang:` or `sglang_` prefix) and publishes them with the time of
//! the answer in one shared-data value per model (`pr/h3/<model>`, [`publish`]), with what the
//! poller learned from them (`poll.rs`: the prefill rate, and how fast running slots free).
//!
//! **Check.** Each VM sums, per worker, the prompt blocks of the requests it routed there that
//! were served and have ended, and the blocks the index predicted the worker held
//! (`Decision::matched_blocks`, [`Verifier::observe`]): SGLang counts a request's tokens when it
//! finishes, so a prediction joins when the worker counts it, and a window only holds requests
//! its closing sample was taken after. Once a window has at least [`MIN_BLOCKS`] predicted-on
//! blocks and [`MIN_WINDOW`] of samples, it compares the worker's reused share over the window
//! (cached / prompt token deltas) with the predicted share ([`Verifier::check`]):
//! - counters that went backwards: the worker restarted; every entry recorded before now is
//!   ignored (the cutoff moves to now);
//! - reused share below [`SHORTFALL`] of the predicted one (the index predicts hits the cache
//!   no longer has): the worker evicts sooner than the index assumes, and LRU evicts the oldest
//!   first, so the trusted age span of its entries is halved (the cutoff moves half way to now);
//! - otherwise the cutoff stays, and the trusted span grows with time.
//!
//! The predicted share is biased low (a lookup matches checkpoint blocks, never more than the
//! worker received), and the reported share also counts hits the index never predicted (shared
//! prefixes below checkpoint granularity, other replicas' traffic): a shortfall means the index
//! is wrong, not noise. Decisions then ignore a holder whose oldest matched record is older than
//! its cutoff ([`Verifier::stale`]); its next request rewrites the path with fresh stamps. A
//! worker with a cutoff has its paths rewritten once a record is a quarter of its trusted span
//! old ([`Verifier::refresh_due`]), as the TTL's quarter otherwise: a prefix it keeps receiving
//! never falls behind the cutoff.
//!
//! Costs: one HTTP call per worker per `metrics_interval_ms` and one scan of its page (no
//! allocation beyond Envoy's copy of the body); per VM one shared-data get per model per second;
//! per decision a pass over the (at most a few) matched holders; per served request one addition
//! at its end. Per VM: each Envoy thread checks the requests it routed (the counters are the
//! worker's, whoever sent).

use crate::index::age;
use crate::records::{rd, wr, ById};
use crate::store::Store;

/// A worker's cumulative prompt tokens, the share of them served from its cache, and the
/// requests it finished (`sglang:num_requests_total`; 0 where not reported).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub prompt: u64,
    pub cached: u64,
    pub requests: u64,
}

/// One published sample: the counters and when they were read (100 ms units; 0 = none), and what
/// the poller learned from them (`poll.rs`): the worker's prefill rate (uncached tokens per busy
/// second) and the microseconds between two of its requests finishing while its running batch
/// is full (0: not learned).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    pub counters: Counters,
    pub at: u32,
    pub rate: u32,
    pub slot_us: u32,
    /// Prefill utilisation, parts per million (`poll::Learned::util_ppm`).
    pub util_ppm: u32,
}

/// Published record: worker id, prompt (u64), cached (u64), time, rate, slot interval,
/// utilisation. Little-endian.
const REC: usize = 36;

/// A window needs this many prompt blocks sent to the worker with a predicted hit.
pub const MIN_BLOCKS: u64 = 256;
/// ... and samples at least this far apart (100 ms units): requests finish (and are counted)
/// a generation's length after they were routed.
pub const MIN_WINDOW: u32 = 50;
/// The reported share below this fraction of the predicted share is a shortfall (3/4).
pub const SHORTFALL: (u64, u64) = (3, 4);

/// Shared-data reads of the samples are at least this far apart (100 ms units).
const READ_EVERY: u32 = 10;

/// The counters in a Prometheus text page, each summed over all its series; `None` when the
/// page has no prompt-token counter (metrics off, or not SGLang).
pub fn parse(body: &[u8]) -> Option<Counters> {
    let (mut prompt, mut cached, mut requests, mut seen) = (0u64, 0u64, 0u64, false);
    for line in body.split(|&b| b == b'\n') {
        if line.first() == Some(&b'#') {
            continue;
        }
        let name_end = line
            .iter()
            .position(|&b| b == b'{' || b == b' ')
            .unwrap_or(line.len());
        let (name, rest) = line.split_at(name_end);
        let Some(metric) = name
            .strip_prefix(b"sglang:")
            .or_else(|| name.strip_prefix(b"sglang_"))
        else {
            continue;
        };
        let sum = match metric {
            b"prompt_tokens_total" => &mut prompt,
            b"cached_tokens_total" => &mut cached,
            b"num_requests_total" => &mut requests,
            _ => continue,
        };
        let Some(v) = value(rest) else {
            continue;
        };
        *sum = sum.saturating_add(v);
        seen |= metric == b"prompt_tokens_total";
    }
    seen.then_some(Counters {
        prompt,
        cached,
        requests,
    })
}

/// The sample value after a series' optional `{labels}` (quoted values may hold `}`).
fn value(rest: &[u8]) -> Option<u64> {
    let mut i = 0;
    if rest.first() == Some(&b'{') {
        let (mut quoted, mut escaped) = (false, false);
        i = 1;
        loop {
            let &b = rest.get(i)?;
            i += 1;
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b'}' if !quoted => break,
                _ => {}
            }
        }
    }
    let tail = rest.get(i..)?;
    let text = std::str::from_utf8(tail).ok()?.split_whitespace().next()?;
    let v: f64 = text.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v as u64)
}

fn rd64(b: &[u8], at: usize) -> u64 {
    u64::from(rd(b, at)) | (u64::from(rd(b, at + 4)) << 32)
}

fn wr64(b: &mut [u8], at: usize, v: u64) {
    wr(b, at, v as u32);
    wr(b, at + 4, (v >> 32) as u32);
}

/// Publishes worker `id`'s sample with a CAS read-modify-write (only the poll lease holder
/// writes); false if every try lost.
pub fn publish<S: Store>(
    store: &S,
    key: &str,
    id: u32,
    hint: usize,
    s: &Sample,
    buf: &mut Vec<u8>,
) -> bool {
    crate::records::publish(store, key, REC, id, hint, buf, |b, o| {
        wr64(b, o + 4, s.counters.prompt);
        wr64(b, o + 12, s.counters.cached);
        wr(b, o + 20, s.at);
        wr(b, o + 24, s.rate);
        wr(b, o + 28, s.slot_us);
        wr(b, o + 32, s.util_ppm);
    })
}

/// Reads a published value into one [`Sample`] per configured worker (none when missing).
pub fn decode(b: &[u8], ids: &ById, n: usize, out: &mut Vec<Sample>) {
    out.clear();
    out.resize(n, Sample::default());
    ids.each(b, REC, |p, o| {
        if let Some(slot) = out.get_mut(p) {
            *slot = Sample {
                counters: Counters {
                    prompt: rd64(b, o + 4),
                    cached: rd64(b, o + 12),
                    requests: 0,
                },
                at: rd(b, o + 20),
                rate: rd(b, o + 24),
                slot_us: rd(b, o + 28),
                util_ppm: rd(b, o + 32),
            };
        }
    });
}

/// One worker's check window as one VM sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    /// The sample the window started at (`at` 0: not started).
    start: Sample,
    /// The requests in this window: served, ended, and counted by a sample since.
    sum: Tally,
    /// Requests that ended before `staged_at` (a read), waiting for a sample taken after it.
    staged: Tally,
    staged_at: u32,
    /// Requests that ended since the last read.
    fresh: Tally,
    /// Entries of the worker recorded before this (100 ms units) are ignored; 0: none.
    pub cutoff: u32,
    /// When the worker last joined its pool (`membership.rs`; 0: not a pool worker or unknown):
    /// its entries from before are ignored too (a host that left and came back may have been
    /// restarted with an empty cache).
    pub joined: u32,
    /// The last completed window, parts per million of prompt tokens: predicted and reported
    /// reuse.
    pub predicted_ppm: u32,
    pub actual_ppm: u32,
}

/// Prompt blocks of some ended requests, and those the index predicted held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Tally {
    total: u64,
    matched: u64,
}

impl Tally {
    fn add(&mut self, total: u64, matched: u64) {
        self.total = self.total.saturating_add(total);
        self.matched = self.matched.saturating_add(matched);
    }
}

/// What a check found for one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing new (no sample, same sample, window not long enough).
    Wait,
    /// A window closed with the reported reuse in line with the prediction.
    Holds,
    /// A window closed short: the trusted span was halved.
    Short,
    /// The counters went backwards: everything before now is ignored.
    Restarted,
}

/// Each worker's check window, per model, in one VM (module docs).
pub struct Verifier {
    windows: Vec<Vec<Window>>,
    /// Per model, each worker's published prefill rate (tokens/s; 0: not learned): an input of
    /// the policy's cost (`policy/cost.rs`).
    rates: Vec<Vec<f32>>,
    /// Per model, each worker's published seconds between two requests finishing while its
    /// running batch is full (0: not learned): the wait for a slot in the cost.
    slots: Vec<Vec<f32>>,
    /// Per model, each worker's published prefill utilisation (0..1; 0: not learned): the
    /// queue weight's bound in the cost.
    utils: Vec<Vec<f32>>,
    samples: Vec<Sample>,
    buf: Vec<u8>,
    last_read: u32,
    /// Windows closed since [`Verifier::take_changed`] (gauges to update).
    changed: bool,
    /// Workers whose entries were aged out (short or restarted), since the last take.
    aged_out: u64,
}

impl Verifier {
    pub fn new(workers_per_model: impl Iterator<Item = usize>) -> Verifier {
        let windows: Vec<Vec<Window>> = workers_per_model
            .map(|n| vec![Window::default(); n])
            .collect();
        Verifier {
            rates: windows.iter().map(|m| vec![0.0; m.len()]).collect(),
            slots: windows.iter().map(|m| vec![0.0; m.len()]).collect(),
            utils: windows.iter().map(|m| vec![0.0; m.len()]).collect(),
            windows,
            samples: Vec::new(),
            buf: Vec::new(),
            last_read: 0,
            changed: false,
            aged_out: 0,
        }
    }

    /// A request worker `w` of model `mi` served has ended: a prompt of `total` blocks, `matched`
    /// of them predicted held. It joins a window once a sample taken after it is read
    /// ([`Verifier::check`]).
    pub fn observe(&mut self, mi: usize, w: usize, matched: u32, total: u32) {
        if let Some(win) = self.windows.get_mut(mi).and_then(|m| m.get_mut(w)) {
            win.fresh.add(u64::from(total), u64::from(matched));
        }
    }

    /// Whether worker `w`'s record stamped `oldest` is older than its cutoff at `now`.
    pub fn stale(&self, mi: usize, w: usize, oldest: u32, now: u32) -> bool {
        let Some(win) = self.windows.get(mi).and_then(|m| m.get(w)) else {
            return false;
        };
        let before = |t: u32| t != 0 && age(now, oldest) > age(now, t);
        before(win.cutoff) || before(win.joined)
    }

    /// Worker `w` of pool model `mi` joined its pool at `at` (`membership.rs`).
    pub fn joined(&mut self, mi: usize, w: usize, at: u32) {
        if let Some(win) = self.windows.get_mut(mi).and_then(|m| m.get_mut(w)) {
            win.joined = at;
        }
    }

    /// Worker `w` of model `mi` keeps the window it had in another VM state (a rebuild after a
    /// membership change).
    pub fn carry(&mut self, mi: usize, w: usize, from: &Window) {
        if let Some(win) = self.windows.get_mut(mi).and_then(|m| m.get_mut(w)) {
            *win = *from;
        }
    }

    /// Whether worker `w`'s record stamped `oldest` is older than a quarter of its trusted
    /// span (`false` for a worker never cut: the TTL's own refresh rule applies).
    pub fn refresh_due(&self, mi: usize, w: usize, oldest: u32, now: u32) -> bool {
        match self.windows.get(mi).and_then(|m| m.get(w)) {
            Some(win) if win.cutoff != 0 => age(now, oldest) > age(now, win.cutoff) / 4,
            _ => false,
        }
    }

    /// Model `mi`'s workers' learned prefill rates (tokens/s; 0: not learned; empty for an
    /// unknown model).
    pub fn rates(&self, mi: usize) -> &[f32] {
        self.rates.get(mi).map_or(&[], Vec::as_slice)
    }

    /// Model `mi`'s workers' learned seconds between two requests finishing while the running
    /// batch is full (0: not learned; empty for an unknown model).
    pub fn slots(&self, mi: usize) -> &[f32] {
        self.slots.get(mi).map_or(&[], Vec::as_slice)
    }

    /// Model `mi`'s workers' learned prefill utilisation (0..1; 0: not learned; empty for an
    /// unknown model).
    pub fn utils(&self, mi: usize) -> &[f32] {
        self.utils.get(mi).map_or(&[], Vec::as_slice)
    }

    pub fn window(&self, mi: usize, w: usize) -> Option<&Window> {
        self.windows.get(mi)?.get(w)
    }

    /// Whether the samples are due to be read at `now` (once a second; a clock that stepped
    /// back reads at once).
    pub fn due(&mut self, now: u32) -> bool {
        let since = now.wrapping_sub(self.last_read);
        if self.last_read != 0 && since < READ_EVERY {
            return false;
        }
        self.last_read = now.max(1);
        true
    }

    /// Reads model `mi`'s published samples (`ids` its workers' id map) and checks every worker;
    /// `ttl` is the index TTL in 100 ms units (the trusted span of a worker never cut).
    pub fn read<S: Store>(
        &mut self,
        store: &S,
        key: &str,
        ids: &ById,
        mi: usize,
        now: u32,
        ttl: u32,
    ) {
        let Some(n) = self.windows.get(mi).map(Vec::len) else {
            return;
        };
        if store.get(key, &mut self.buf).is_none() {
            return;
        }
        let mut samples = std::mem::take(&mut self.samples);
        decode(&self.buf, ids, n, &mut samples);
        for (w, s) in samples.iter().enumerate() {
            self.check(mi, w, s, now, ttl);
            if let Some(r) = self.rates.get_mut(mi).and_then(|m| m.get_mut(w)) {
                *r = s.rate as f32;
            }
            if let Some(t) = self.slots.get_mut(mi).and_then(|m| m.get_mut(w)) {
                *t = s.slot_us as f32 / 1e6;
            }
            if let Some(u) = self.utils.get_mut(mi).and_then(|m| m.get_mut(w)) {
                *u = (s.util_ppm as f32 / 1e6).min(1.0);
            }
        }
        self.samples = samples;
    }

    /// Checks worker `w` of model `mi` against its sample `s`, read at `now` (module docs).
    ///
    /// A window holds only requests its closing sample has counted: those that ended before a
    /// read (staged at it) join once a sample taken at or after that read arrives. The
    /// samples are up to `metrics_interval_ms` plus a read period old, so without this the
    /// requests of the last seconds would be predicted but not yet counted: when traffic
    /// starts, its first requests (new prompts, nothing reused) are counted and their siblings
    /// (predicted hits) not yet, and a short window reads as a shortfall.
    pub fn check(&mut self, mi: usize, w: usize, s: &Sample, now: u32, ttl: u32) -> Verdict {
        let Some(win) = self.windows.get_mut(mi).and_then(|m| m.get_mut(w)) else {
            return Verdict::Wait;
        };
        if win.staged_at != 0 && s.at != 0 && s.at.wrapping_sub(win.staged_at) < u32::MAX / 2 {
            let staged = std::mem::take(&mut win.staged);
            win.sum.add(staged.total, staged.matched);
            win.staged_at = 0;
        }
        let verdict = self.check_window(mi, w, s, now, ttl);
        if let Some(win) = self.windows.get_mut(mi).and_then(|m| m.get_mut(w)) {
            if win.staged_at == 0 && win.fresh != Tally::default() {
                win.staged = std::mem::take(&mut win.fresh);
                win.staged_at = now.max(1);
            }
        }
        verdict
    }

    fn check_window(&mut self, mi: usize, w: usize, s: &Sample, now: u32, ttl: u32) -> Verdict {
        let Some(win) = self.windows.get_mut(mi).and_then(|m| m.get_mut(w)) else {
            return Verdict::Wait;
        };
        if s.at == 0 || s.at == win.start.at {
            return Verdict::Wait;
        }
        let restart = |win: &mut Window| {
            win.start = *s;
            win.sum = Tally::default();
        };
        if win.start.at == 0 {
            restart(win);
            return Verdict::Wait;
        }
        let (c, c0) = (s.counters, win.start.counters);
        if c.prompt < c0.prompt || c.cached < c0.cached {
            restart(win);
            win.cutoff = now.max(1);
            self.aged_out += 1;
            return Verdict::Restarted;
        }
        let dp = c.prompt - c0.prompt;
        if win.sum.matched < MIN_BLOCKS || age(s.at, win.start.at) < MIN_WINDOW || dp == 0 {
            return Verdict::Wait;
        }
        let ppm = |a: u64, b: u64| (a.min(b) as u128 * 1_000_000 / b.max(1) as u128) as u32;
        win.actual_ppm = ppm(c.cached - c0.cached, dp);
        win.predicted_ppm = ppm(win.sum.matched, win.sum.total);
        self.changed = true;
        let short =
            u64::from(win.actual_ppm) * SHORTFALL.1 < u64::from(win.predicted_ppm) * SHORTFALL.0;
        restart(win);
        if !short {
            return Verdict::Holds;
        }
        let span = if win.cutoff == 0 {
            ttl
        } else {
            age(now, win.cutoff)
        };
        win.cutoff = now.wrapping_sub(span / 2).max(1);
        self.aged_out += 1;
        Verdict::Short
    }

    /// Whether a window closed since the last call (and how many workers were aged out).
    pub fn take_changed(&mut self) -> (bool, u64) {
        let r = (self.changed, self.aged_out);
        self.changed = false;
        self.aged_out = 0;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn reads_both_counters_summed_over_series_and_both_prefixes() {
        let page = br#"# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m",dp_rank="0"} 1200.0
sglang:prompt_tokens_total{model_name="a}b \"q\"",dp_rank="1"} 800
sglang:cached_tokens_total{model_name="m"} 500.0 1700000000000
sglang:cached_tokens_total_created{model_name="m"} 1.7e9
sglang:time_to_first_token_seconds_bucket{le="0.1"} 3.0
sglang:num_requests_total{model_name="m"} 7
sglang:num_requests_total{model_name="m",dp_rank="1"} 5.0
"#;
        assert_eq!(
            parse(page),
            Some(Counters {
                prompt: 2000,
                cached: 500,
                requests: 12,
            })
        );
        let new_prefix = b"sglang_prompt_tokens_total 10\nsglang_cached_tokens_total 4\n";
        assert_eq!(
            parse(new_prefix),
            Some(Counters {
                prompt: 10,
                cached: 4,
                requests: 0,
            })
        );
        // No prompt counter, or values that are not counts: not a sample.
        for bad in [
            &b""[..],
            b"sglang:cached_tokens_total 5\n",
            b"not prometheus at all",
            b"sglang:prompt_tokens_total{unclosed=\"x 5\n",
        ] {
            assert_eq!(parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let junk = b"sglang:prompt_tokens_total NaN\nsglang:prompt_tokens_total -4\nsglang:prompt_tokens_total 7\n";
        assert_eq!(parse(junk).map(|c| c.prompt), Some(7));
    }

    #[test]
    fn published_samples_round_trip_by_worker_id() {
        let ids = ById::new([11u32, 22, 33].into_iter());
        let s = MemStore::new();
        let mut buf = Vec::new();
        let big = Sample {
            counters: Counters {
                prompt: 5 << 33,
                cached: 3,
                requests: 0,
            },
            at: 9,
            rate: 31_000,
            slot_us: 21_000,
            util_ppm: 870_000,
        };
        assert!(publish(&s, "h", 33, 2, &big, &mut buf));
        assert!(publish(&s, "h", 11, 0, &Sample::default(), &mut buf));
        s.get("h", &mut buf);
        let mut out = Vec::new();
        decode(&buf, &ids, 3, &mut out);
        assert_eq!(out, vec![Sample::default(), Sample::default(), big]);
    }

    fn sample(prompt: u64, cached: u64, at: u32) -> Sample {
        Sample {
            counters: Counters {
                prompt,
                cached,
                requests: 0,
            },
            at,
            ..Sample::default()
        }
    }

    /// A read at `now` that brings no new sample: what ended before it waits for the next one.
    fn stage(v: &mut Verifier, now: u32, ttl: u32) {
        assert_eq!(v.check(0, 0, &Sample::default(), now, ttl), Verdict::Wait);
    }

    #[test]
    fn requests_join_a_window_only_once_a_sample_has_counted_them() {
        let mut v = Verifier::new([1usize].into_iter());
        let ttl = 6000;
        v.check(0, 0, &sample(0, 0, 80), 80, ttl);
        // The first requests, new prompts (nothing reused), end; a read at 130 stages them.
        v.observe(0, 0, 0, 300);
        stage(&mut v, 130, ttl);
        // Their siblings, predicted hits, end at 140. The next read brings a sample taken at
        // 135: it counted the first requests, not the siblings, which wait for a later one.
        v.observe(0, 0, 900, 1000);
        assert_eq!(
            v.check(0, 0, &sample(300 * 64, 0, 135), 160, ttl),
            Verdict::Wait,
            "nothing predicted was counted yet"
        );
        // A sample taken after them counts them, reused as predicted.
        assert_eq!(
            v.check(0, 0, &sample(1300 * 64, 900 * 64, 190), 200, ttl),
            Verdict::Holds
        );
        assert_eq!(v.window(0, 0).unwrap().cutoff, 0);
        // Joined at the decision instead, the same requests made a shortfall of the first
        // sample: 69% predicted against 0% counted.
        let mut old = Verifier::new([1usize].into_iter());
        old.check(0, 0, &sample(0, 0, 80), 80, ttl);
        old.observe(0, 0, 900, 1300);
        stage(&mut old, 130, ttl);
        assert_eq!(
            old.check(0, 0, &sample(300 * 64, 0, 135), 160, ttl),
            Verdict::Short
        );
    }

    #[test]
    fn a_worker_whose_reported_hits_fall_short_is_trusted_for_half_the_span() {
        let mut v = Verifier::new([2usize].into_iter());
        let ttl = 6000; // 600 s
        assert_eq!(v.check(0, 0, &sample(0, 0, 100), 100, ttl), Verdict::Wait);
        // Predicted 80% reuse on 1000 blocks; the worker reports 20% over 10 s.
        v.observe(0, 0, 800, 1000);
        stage(&mut v, 120, ttl);
        assert_eq!(
            v.check(0, 0, &sample(1000, 200, 140), 140, ttl),
            Verdict::Wait,
            "5 s is the minimum window"
        );
        assert_eq!(
            v.check(0, 0, &sample(1000, 200, 200), 200, ttl),
            Verdict::Short
        );
        let win = *v.window(0, 0).unwrap();
        assert_eq!((win.predicted_ppm, win.actual_ppm), (800_000, 200_000));
        assert_eq!(
            win.cutoff,
            200u32.wrapping_sub(ttl / 2),
            "half of the TTL span"
        );
        assert!(v.stale(0, 0, 199u32.wrapping_sub(ttl / 2), 200) && !v.stale(0, 0, 150, 200));
        assert!(!v.stale(0, 1, 0, 200), "the other worker keeps its entries");
        // Its paths are rewritten once a record is a quarter of the span old.
        assert!(v.refresh_due(0, 0, 200u32.wrapping_sub(ttl / 8 + 1), 200));
        assert!(!v.refresh_due(0, 0, 200u32.wrapping_sub(ttl / 8), 200));
        assert!(
            !v.refresh_due(0, 1, 0, 200),
            "a worker never cut follows the TTL"
        );
        assert_eq!(v.take_changed(), (true, 1));
        // The next window is short again: half of the remaining span.
        v.observe(0, 0, 500, 1000);
        stage(&mut v, 250, ttl);
        assert_eq!(
            v.check(0, 0, &sample(2000, 300, 300), 300, ttl),
            Verdict::Short
        );
        let span = age(300, v.window(0, 0).unwrap().cutoff);
        assert_eq!(span, (ttl / 2 + 100) / 2);
        // In line with the prediction: the cutoff stays.
        let cut = v.window(0, 0).unwrap().cutoff;
        v.observe(0, 0, 300, 1000);
        stage(&mut v, 350, ttl);
        assert_eq!(
            v.check(0, 0, &sample(3000, 700, 400), 400, ttl),
            Verdict::Holds
        );
        assert_eq!(v.window(0, 0).unwrap().cutoff, cut);
    }

    #[test]
    fn a_restarted_worker_loses_every_entry_before_it() {
        let mut v = Verifier::new([1usize].into_iter());
        v.check(0, 0, &sample(50_000, 30_000, 10), 10, 6000);
        v.observe(0, 0, 10, 10);
        assert_eq!(
            v.check(0, 0, &sample(120, 0, 20), 25, 6000),
            Verdict::Restarted
        );
        assert!(v.stale(0, 0, 24, 25) && !v.stale(0, 0, 25, 25));
        assert_eq!(v.take_changed(), (false, 1));
    }

    #[test]
    fn too_little_traffic_or_no_sample_decides_nothing() {
        let mut v = Verifier::new([1usize].into_iter());
        assert_eq!(v.check(0, 0, &Sample::default(), 10, 6000), Verdict::Wait);
        v.check(0, 0, &sample(0, 0, 10), 10, 6000);
        v.observe(0, 0, 100, 1000); // below MIN_BLOCKS predicted
        assert_eq!(
            v.check(0, 0, &sample(9000, 0, 500), 500, 6000),
            Verdict::Wait
        );
        assert_eq!(v.window(0, 0).unwrap().cutoff, 0);
        assert_eq!(v.check(7, 0, &sample(1, 1, 1), 1, 6000), Verdict::Wait);
        v.observe(7, 9, 1, 1);
        assert!(!v.stale(7, 9, 0, 100));
    }

    #[test]
    fn samples_are_read_once_a_second() {
        let ids = ById::new([11u32].into_iter());
        let s = MemStore::new();
        let mut buf = Vec::new();
        publish(&s, "h", 11, 0, &sample(0, 0, 5), &mut buf);
        let mut v = Verifier::new([1usize].into_iter());
        assert!(v.due(5));
        v.read(&s, "h", &ids, 0, 5, 6000);
        v.observe(0, 0, 1000, 1000);
        assert!(!v.due(8), "read again only after a second");
        assert!(v.due(15));
        v.read(&s, "h", &ids, 0, 15, 6000);
        publish(&s, "h", 11, 0, &sample(10, 0, 60), &mut buf);
        assert!(v.due(60));
        v.read(&s, "h", &ids, 0, 60, 6000);
        assert_ne!(
            v.window(0, 0).unwrap().cutoff,
            0,
            "0% reported vs 100% predicted"
        );
    }
}
