//! Shared placement across Envoy replicas: each replica sends the index records it makes to
//! every peer, so a conversation placed through one replica is found through any other.
//!
//! **Sending.** Every index write a decision makes (a checkpoint or a chat prompt's end, see
//! `index.rs`) is also appended to the VM's [`Outbox`] as a 16-byte record `(model key, worker
//! id, block hash)`; so is every new or changed placement of a prompt nobody held
//! (`placements.rs`), as `(the model's placed_peer_key, worker id, sibling key)`: a sibling that
//! reaches another replica before the first prompt's answer is indexed follows it there. Each
//! `peers.flush_ms` the VM's timer POSTs the batch to every peer cluster
//! (`dispatch_http_call`, fire-and-forget with `peers.timeout_ms`). The outbox holds at most
//! `peers.max_batch` records; beyond that records are dropped and counted. Nothing waits on a
//! peer: a down or slow peer costs freshness (its index misses what it was not told), never a
//! request. In the native build only Envoy's main thread can start calls: the worker threads
//! hand their records to it through shared data ([`RELAY_KEY`], bounded by `max_batch` too) and
//! it sends them with its own batch.
//!
//! **Wire format (v2).** One batch is `"PRr2"`, the sender (u64), its sequence number (u64,
//! +1 per batch), the sender's wall clock in ms (u64), the records, then HMAC-SHA256 of all of
//! that keyed by `peers.secret` (32 bytes); integers little-endian. The secret itself never
//! travels: a captured batch proves nothing about it and cannot be altered. The sender is unique
//! per VM and configuration (its lease id in this Envoy and the clock in nanoseconds when the
//! configuration arrived), so a restarted or reconfigured VM is a new sender, never a replay of
//! the old one. Its sequence starts at 1 and goes on across membership rebuilds of the pool
//! models (`glue::Root::install` keeps the sender, `peer_flush::PeerSender` its sequence): a
//! rebuild is not a new sender to the peers, and its batches are not replays.
//!
//! **Receiving.** Only the filter on the peer listener (`peer_listener: true`) accepts batches, at
//! `POST /prefix-router/v1/records`. [`open`] checks the form and size (at most `max_batch`
//! records), the MAC (constant time) and the timestamp (within `peers.window_s` of the
//! receiver's wall clock, either way: replicas' clocks must agree within it, which NTP does);
//! [`admit`] then refuses a (sender, sequence) already accepted (a 64-wide window below the
//! sender's highest, RFC 4303 style, so batches reordered on the way still count once) and cuts
//! the batch at the sender's record budget (`peers.max_records_per_s`, a token bucket one second
//! deep). Both live in one shared-data sender table (all VMs of this Envoy, one read and one CAS
//! per batch, at most [`MAX_SENDERS`] live senders; a sender whose newest batch left the window is
//! forgotten, safely: its batches are stale from then on). A replayed batch is refused inside the
//! window by the table and after it by its timestamp. The table also holds when this receiver
//! started (its process's first configuration, [`init_table`]), and a batch sent before then is
//! refused as stale: a restarted receiver has lost the table, but every batch it had accepted
//! was sent before it started, so none is taken twice (a sender whose clock runs ahead of the
//! receiver's by `d` could replay what it sent in the last `d` before the restart; NTP keeps `d`
//! to milliseconds). Refusals answer 400 (not a batch), 403
//! (old protocol, wrong MAC, stale, replay), 429 (over budget: the records within it are applied;
//! table full) or 503 (table contention), each counted and named in the response code details.
//! Each accepted record is applied as a holder write with the receiver's own
//! clock, exactly as a local decision would write it, and each placement to the receiver's
//! placement table one clock step back; records naming a model or worker this replica does not
//! have are ignored (a replica that predates placements ignores them so: no new wire version).
//! Received records are not forwarded again.
//!
//! **Clocks.** The window compares wall clocks of two machines: a replica whose clock is off by
//! more than `window_s` has its batches refused (and counted as stale) until NTP brings it back;
//! nothing is lost for good, the sender's sequence goes on. The budget runs on the receiver's
//! clock and restarts from a clock that stepped back.
//!
//! **Staleness.** A record reaches a peer's shared data within `flush_ms` (default 100 ms) plus
//! one round trip; the peer's VMs see it at their next probe, or after their probe cache entry
//! for that hash expires (`index.local_cache_ms`) if they probed the very same prefix just before.

use crate::config::{Config, PeersConfig};
use crate::index::{Index, IndexBuffers, WriteStats};
use crate::placements::Placements;
use crate::store::Store;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Batch header: format magic and version (2: authenticated, see the module docs).
pub const MAGIC: &[u8; 4] = b"PRr2";
/// The first protocol's magic (plain secret header, no MAC): refused with its own reason.
pub const LEGACY_MAGIC: &[u8; 4] = b"PRr1";
/// Header bytes: magic, sender, sequence number, sender's wall clock (ms), all u64 LE.
pub const HEADER: usize = 28;
/// Trailer bytes: HMAC-SHA256 of everything before it, keyed by `peers.secret`.
pub const MAC_LEN: usize = 32;
/// Bytes per record: model key (u32), worker id (u32), block hash (u64), all LE.
pub const REC: usize = 16;

type HmacSha256 = Hmac<Sha256>;

/// The MAC of `data` under `secret`; `None` only if the HMAC refused the key (it takes any).
fn mac(secret: &str, data: &[u8]) -> Option<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret.as_bytes()).ok()?;
    m.update(data);
    Some(m)
}

/// A sealed batch: header, `records` (whole 16-byte records) and MAC. For senders and tests;
/// [`Outbox::seal`] builds the same bytes without allocating.
pub fn seal(secret: &str, sender: u64, seq: u64, sent_ms: u64, records: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + records.len() + MAC_LEN);
    seal_into(&mut out, secret, sender, seq, sent_ms, records);
    out
}

fn seal_into(out: &mut Vec<u8>, secret: &str, sender: u64, seq: u64, sent_ms: u64, recs: &[u8]) {
    out.clear();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&sender.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&sent_ms.to_le_bytes());
    out.extend_from_slice(recs);
    let tag = mac(secret, out).map(|m| m.finalize().into_bytes());
    match tag {
        Some(t) => out.extend_from_slice(&t),
        None => out.extend_from_slice(&[0u8; MAC_LEN]), // refused by every receiver
    }
}

/// Records made by this VM since its last batch.
pub struct Outbox {
    /// Whole 16-byte records, no header.
    buf: Vec<u8>,
    max: usize,
    /// Records dropped because the outbox was full (metric).
    pub dropped: u64,
    /// The relay's value, read back ([`Outbox::hand_off`], [`Outbox::take_relayed`]).
    relay: Vec<u8>,
    /// The last sealed batch ([`Outbox::seal`]); its capacity is kept between flushes.
    wire: Vec<u8>,
}

impl Outbox {
    pub fn new(max_records: usize) -> Outbox {
        Outbox {
            buf: Vec::with_capacity(REC * max_records),
            max: max_records,
            dropped: 0,
            relay: Vec::new(),
            wire: Vec::new(),
        }
    }

    pub fn push(&mut self, model_key: u32, worker: u32, hash: u64) {
        if self.len() >= self.max {
            self.dropped += 1;
            return;
        }
        self.buf.extend_from_slice(&model_key.to_le_bytes());
        self.buf.extend_from_slice(&worker.to_le_bytes());
        self.buf.extend_from_slice(&hash.to_le_bytes());
    }

    pub fn len(&self) -> usize {
        self.buf.len() / REC
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The records (no header).
    pub fn records(&self) -> &[u8] {
        &self.buf
    }

    /// The batch to send now: header (`sender`, its sequence number `seq`, `now_ms`), the
    /// records and the MAC. One HMAC-SHA256 over the batch per flush, not per peer.
    pub fn seal(&mut self, secret: &str, sender: u64, seq: u64, now_ms: u64) -> &[u8] {
        seal_into(&mut self.wire, secret, sender, seq, now_ms, &self.buf);
        &self.wire
    }

    /// Empties the outbox after its batch was handed to every peer.
    pub fn clear(&mut self) {
        self.buf.clear();
    }

    /// Hands this outbox's records to the thread that sends for everyone, through shared data
    /// ([`RELAY_KEY`]), and empties it. For a thread that cannot start calls (the native build's
    /// worker threads; Envoy's main thread sends for them). The relay holds at most `max`
    /// records in all: the rest are dropped and counted in `dropped`, as a full outbox does.
    pub fn hand_off<S: Store>(&mut self, store: &S) {
        let buf = &mut self.relay;
        let mine = &self.buf;
        if mine.is_empty() {
            return;
        }
        for _ in 0..RELAY_TRIES {
            let cas = match store.get(RELAY_KEY, buf) {
                Some(c) => c,
                None => {
                    // Create it empty first: a set on a missing key ignores its CAS token, so
                    // two first appends could each overwrite the other; two empty creates can't.
                    let _ = store.set(RELAY_KEY, &[], 0);
                    continue;
                }
            };
            let room = (self.max * REC).saturating_sub(buf.len()) / REC * REC;
            let take = mine.len().min(room);
            buf.extend_from_slice(mine.get(..take).unwrap_or_default());
            if store.set(RELAY_KEY, buf, cas).is_ok() {
                self.dropped += ((mine.len() - take) / REC) as u64;
                self.clear();
                return;
            }
        }
        // Lost the race every time: these records are dropped like an overflow.
        self.dropped += (mine.len() / REC) as u64;
        self.clear();
    }

    /// Takes the records other threads handed off ([`Outbox::hand_off`]) into this outbox, up
    /// to its capacity (the rest dropped and counted), leaving the relay empty.
    pub fn take_relayed<S: Store>(&mut self, store: &S) {
        let buf = &mut self.relay;
        let mut taken = false;
        for _ in 0..RELAY_TRIES {
            match store.get(RELAY_KEY, buf) {
                Some(cas) if !buf.is_empty() => {
                    if store.set(RELAY_KEY, &[], cas).is_ok() {
                        taken = true;
                        break;
                    }
                    // Lost to an append: read again.
                }
                _ => return,
            }
        }
        if !taken {
            return; // still in the relay: the next flush takes them
        }
        let room = (self.max * REC).saturating_sub(self.buf.len());
        let whole = buf.len() / REC * REC;
        let take = whole.min(room);
        self.buf
            .extend_from_slice(buf.get(..take).unwrap_or_default());
        self.dropped += ((whole - take) / REC) as u64;
    }
}

/// Shared-data key of the records that threads which cannot call hand to the one that can
/// (see [`Outbox::hand_off`]): whole 16-byte records, no header. Unused by the Wasm build, where
/// every VM sends its own batches.
pub const RELAY_KEY: &str = "pr/peer-relay";
/// CAS attempts of a relay append or drain before giving up for this flush.
const RELAY_TRIES: usize = 4;

/// Shared-data key of the receiver's sender table ([`admit`]): when this receiver started
/// (u64 LE ms, [`init_table`]), then what each sender sent lately.
pub const SENDERS_KEY: &str = "pr/peer-senders";
/// Bytes before the table's entries: the receiver's start (ms).
const TABLE_HEAD: usize = 8;
/// Senders the table remembers at once (48 bytes each). A sender is forgotten once its newest
/// batch is older than the window (its batches are refused as stale from then on anyway).
pub const MAX_SENDERS: usize = 256;
/// Bytes per sender table entry: sender, top sequence, seen bitmap, newest sent_ms,
/// refill time (receiver ms), tokens (milli-records); all u64 LE.
const ENTRY: usize = 48;
/// Sequence numbers below a sender's highest accepted that are still accepted once (batches
/// reordered on the way: they travel on separate connections).
const SEQ_WINDOW: u64 = 64;
/// CAS attempts on the sender table before a batch is refused as busy.
const ADMIT_TRIES: usize = 8;

/// What applying a batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Index records (holder writes).
    pub records: u32,
    /// Placements of new prompts (`placements.rs`), remembered in this replica's table.
    pub placements: u32,
    /// Records naming a model or worker this replica does not have.
    pub ignored: u32,
    /// Records beyond the sender's budget, not applied.
    pub over_budget: u32,
    pub writes: WriteStats,
}

/// Why a batch was refused; nothing of it was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not a batch: bad magic, length, or no record.
    Format,
    /// More than `peers.max_batch` records.
    TooLarge,
    /// The first protocol (`PRr1`, plain secret header): the sender must be upgraded.
    Legacy,
    /// The MAC does not match (wrong secret or altered bytes).
    BadMac,
    /// The sender's timestamp is outside the window around the receiver's clock.
    Stale,
    /// This sender's batch with this sequence number was already accepted.
    Replay,
    /// The sender table is full of live senders.
    TooManySenders,
    /// The sender table kept changing under this batch (shared data CAS).
    Busy,
}

impl Refused {
    /// The HTTP status the peer listener answers.
    pub fn status(self) -> u32 {
        match self {
            Refused::Format | Refused::TooLarge => 400,
            Refused::Legacy | Refused::BadMac | Refused::Stale | Refused::Replay => 403,
            Refused::TooManySenders => 429,
            Refused::Busy => 503,
        }
    }

    /// Envoy response code details (`%RESPONSE_CODE_DETAILS%` in the peer listener's log).
    pub fn details(self) -> &'static str {
        match self {
            Refused::Format => "prefix_router_peer_bad_batch",
            Refused::TooLarge => "prefix_router_peer_batch_too_large",
            Refused::Legacy => "prefix_router_peer_old_protocol",
            Refused::BadMac => "prefix_router_peer_bad_mac",
            Refused::Stale => "prefix_router_peer_stale",
            Refused::Replay => "prefix_router_peer_replay",
            Refused::TooManySenders => "prefix_router_peer_too_many_senders",
            Refused::Busy => "prefix_router_peer_busy",
        }
    }
}

/// Details of a batch applied only in part (its sender's budget ran out).
pub const OVER_BUDGET_DETAILS: &str = "prefix_router_peer_over_budget";

/// An authenticated, fresh batch ([`open`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened<'a> {
    pub sender: u64,
    pub seq: u64,
    pub sent_ms: u64,
    /// Whole 16-byte records, at least one.
    pub records: &'a [u8],
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        x.copy_from_slice(s);
    }
    u64::from_le_bytes(x)
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    if let Some(s) = b.get_mut(at..at + 8) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

/// Checks a batch's form, size, MAC (constant time) and timestamp (within `window_s` of
/// `now_ms`, either way), in that order: nothing about the secret or the table is touched for
/// a body that is not even a batch, and the timestamp is trusted only once authenticated.
pub fn open<'a>(p: &PeersConfig, body: &'a [u8], now_ms: u64) -> Result<Opened<'a>, Refused> {
    if body.get(..4) == Some(LEGACY_MAGIC.as_slice()) {
        return Err(Refused::Legacy);
    }
    if body.get(..4) != Some(MAGIC.as_slice()) || body.len() < HEADER + REC + MAC_LEN {
        return Err(Refused::Format);
    }
    let (signed, tag) = body.split_at(body.len() - MAC_LEN);
    let records = signed.get(HEADER..).unwrap_or_default();
    if records.len() % REC != 0 {
        return Err(Refused::Format);
    }
    if records.len() / REC > p.max_batch {
        return Err(Refused::TooLarge);
    }
    if mac(&p.secret, signed).is_none_or(|m| m.verify_slice(tag).is_err()) {
        return Err(Refused::BadMac);
    }
    let sent_ms = u64_at(signed, 20);
    let w = u64::from(p.window_s) * 1000;
    if sent_ms.saturating_add(w) < now_ms || sent_ms > now_ms.saturating_add(w) {
        return Err(Refused::Stale);
    }
    Ok(Opened {
        sender: u64_at(signed, 4),
        seq: u64_at(signed, 12),
        sent_ms,
        records,
    })
}

/// Marks `seq` seen in a (top, bitmap) replay window; false when it was seen already or is
/// too far below the top to tell (RFC 4303's anti-replay window, 64 wide).
fn mark_seen(top: &mut u64, bits: &mut u64, seq: u64) -> bool {
    if seq > *top {
        let shift = seq - *top;
        *bits = if shift >= SEQ_WINDOW {
            0
        } else {
            *bits << shift
        };
        *bits |= 1;
        *top = seq;
        return true;
    }
    let d = *top - seq;
    if d >= SEQ_WINDOW || *bits & (1 << d) != 0 {
        return false;
    }
    *bits |= 1 << d;
    true
}

/// Creates the sender table of a receiver that starts at `now_ms` (its first configuration in
/// this process: shared data lives as long as the process), unless it exists: batches sent
/// before then are refused as stale ([`admit`]). A restarted receiver has lost the table of
/// batches it accepted, but every one of them was sent before it started, so none is taken
/// twice. A configuration update or membership rebuild keeps the table and its start.
pub fn init_table<S: Store>(store: &S, now_ms: u64) {
    let mut buf = Vec::new();
    if store.get(SENDERS_KEY, &mut buf).is_none() {
        let _ = store.set(SENDERS_KEY, &now_ms.to_le_bytes(), 0);
    }
}

/// Admits an opened batch against the receiver's sender table (shared data, one read and one
/// CAS write per batch, all VMs of this Envoy together): refused when this sender's sequence
/// number was already accepted; otherwise returns how many of its records the sender's budget
/// (`peers.max_records_per_s`, a token bucket one second deep) lets through, the rest to be
/// dropped. The bucket runs on the receiver's clock and starts again from a clock that stepped
/// back (it never waits for the old time to come back). `buf` is scratch.
pub fn admit<S: Store>(
    store: &S,
    p: &PeersConfig,
    o: &Opened,
    now_ms: u64,
    buf: &mut Vec<u8>,
) -> Result<u32, Refused> {
    let n = (o.records.len() / REC) as u64;
    let rate = u64::from(p.max_records_per_s);
    let cap = rate * 1000;
    let window = u64::from(p.window_s) * 1000;
    for _ in 0..ADMIT_TRIES {
        let cas = match store.get(SENDERS_KEY, buf) {
            Some(c) => c,
            None => {
                // Not made at configure (`init_table`): no start known. As the relay: create
                // it first, then read-modify-write.
                let _ = store.set(SENDERS_KEY, &[0u8; TABLE_HEAD], 0);
                continue;
            }
        };
        if buf.len() < TABLE_HEAD {
            buf.resize(TABLE_HEAD, 0);
        }
        if o.sent_ms < u64_at(buf, 0) {
            return Err(Refused::Stale); // sent before this receiver started
        }
        let whole = TABLE_HEAD + (buf.len() - TABLE_HEAD) / ENTRY * ENTRY;
        buf.truncate(whole);
        // Forget the senders whose newest batch is out of the window (their batches are stale
        // from now on): the table holds live senders only, and its copy stays small.
        let mut i = TABLE_HEAD;
        while i + ENTRY <= buf.len() {
            let sender = u64_at(buf, i);
            if sender != o.sender && u64_at(buf, i + 24).saturating_add(window) < now_ms {
                buf.drain(i..i + ENTRY);
            } else {
                i += ENTRY;
            }
        }
        let entries = (buf.len() - TABLE_HEAD) / ENTRY;
        let at = match (0..entries).find(|k| u64_at(buf, TABLE_HEAD + k * ENTRY) == o.sender) {
            Some(k) => TABLE_HEAD + k * ENTRY,
            None if entries >= MAX_SENDERS => return Err(Refused::TooManySenders),
            None => {
                let at = buf.len();
                buf.resize(at + ENTRY, 0);
                put_u64(buf, at, o.sender);
                put_u64(buf, at + 8, o.seq.saturating_sub(1));
                put_u64(buf, at + 16, 0);
                put_u64(buf, at + 24, o.sent_ms);
                put_u64(buf, at + 32, now_ms);
                put_u64(buf, at + 40, cap);
                at
            }
        };
        let (mut top, mut bits) = (u64_at(buf, at + 8), u64_at(buf, at + 16));
        if !mark_seen(&mut top, &mut bits, o.seq) {
            return Err(Refused::Replay);
        }
        // Refill: whole milliseconds since the last refill, at `rate` records per second.
        let last = u64_at(buf, at + 32);
        let mut tokens = u64_at(buf, at + 40);
        if now_ms > last {
            tokens = tokens
                .saturating_add((now_ms - last).saturating_mul(rate))
                .min(cap);
        }
        let allowed = n.min(tokens / 1000);
        tokens -= allowed * 1000;
        put_u64(buf, at + 8, top);
        put_u64(buf, at + 16, bits);
        let newest = u64_at(buf, at + 24).max(o.sent_ms);
        put_u64(buf, at + 24, newest);
        put_u64(buf, at + 32, now_ms);
        put_u64(buf, at + 40, tokens);
        if store.set(SENDERS_KEY, buf, cas).is_ok() {
            return Ok(allowed as u32);
        }
    }
    Err(Refused::Busy)
}

/// Receives a peer's batch at wall-clock `now_ms` ([`open`], [`admit`]), and applies the
/// records its sender's budget allows to this replica's index at `now` (100 ms units).
pub fn receive<S: Store>(
    store: &S,
    cfg: &Config,
    body: &[u8],
    now_ms: u64,
    now: u32,
    sc: &mut IndexBuffers,
    placed: &mut Placements,
) -> Result<Applied, Refused> {
    let Some(p) = cfg.peers.as_ref() else {
        return Err(Refused::BadMac); // no secret: nothing authenticates
    };
    let o = open(p, body, now_ms)?;
    let mut table = std::mem::take(&mut sc.peer_table);
    let admitted = admit(store, p, &o, now_ms, &mut table);
    sc.peer_table = table;
    let allowed = admitted? as usize;
    let take = o.records.len().min(allowed * REC);
    let mut out = apply(
        store,
        cfg,
        o.records.get(..take).unwrap_or_default(),
        now,
        sc,
        placed,
    );
    out.over_budget = ((o.records.len() - take) / REC) as u32;
    Ok(out)
}

/// Applies whole 16-byte records (a batch already received) at time `now` (100 ms units): index
/// records to this replica's index, placement records (a model's `placed_peer_key`, the
/// sibling key in the hash's place) to its placement table one step back (made at least a
/// flush before).
pub fn apply<S: Store>(
    store: &S,
    cfg: &Config,
    records: &[u8],
    now: u32,
    sc: &mut IndexBuffers,
    placed: &mut Placements,
) -> Applied {
    let mut out = Applied::default();
    for r in records.chunks_exact(REC) {
        let (key, worker, hash) = (
            u64_at(r, 0) as u32,
            (u64_at(r, 0) >> 32) as u32,
            u64_at(r, 8),
        );
        let found = cfg.models.iter().find_map(|m| {
            if m.peer_key == key {
                Some((m, false))
            } else if m.placed_peer_key == key {
                Some((m, true))
            } else {
                None
            }
        });
        let Some((model, placement)) = found else {
            out.records += 1;
            out.ignored += 1;
            continue;
        };
        if placement {
            out.placements += 1;
        } else {
            out.records += 1;
        }
        if !model.workers.iter().any(|x| x.id == worker) {
            out.ignored += 1;
            continue;
        }
        if placement {
            placed.remember(
                store,
                &model.placed_key,
                hash,
                worker,
                now.saturating_sub(1),
            );
            continue;
        }
        let ix = Index::for_model(cfg, model);
        let st = ix.add(store, hash, worker, now, sc);
        out.writes.writes += st.writes;
        out.writes.conflicts += st.conflicts;
        out.writes.dropped += st.dropped;
    }
    sc.written.clear(); // received records are never forwarded again
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Matches;
    use crate::store::MemStore;

    fn cfg() -> Config {
        Config::from_json(
            br#"{"models":{"m":{"workers":["a","b"]}},
                 "peers":{"clusters":["p0"],"secret":"0123456789abcdef","max_batch":4}}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_relay_carries_records_once_and_stays_bounded() {
        let s = MemStore::new();
        let rec = |o: &mut Outbox, n: u64| (0..n).for_each(|i| o.push(7, 1, i));
        // Two threads hand off 3 records each; the relay holds at most 4 (max_batch).
        let (mut a, mut b) = (Outbox::new(4), Outbox::new(4));
        rec(&mut a, 3);
        a.hand_off(&s);
        rec(&mut b, 3);
        b.hand_off(&s);
        assert!(a.is_empty() && b.is_empty());
        assert_eq!(
            (a.dropped, b.dropped),
            (0, 2),
            "the relay's bound drops the excess"
        );
        // The sender already holds 1 record of its own: it takes 3 of the relay's 4.
        let mut main = Outbox::new(4);
        rec(&mut main, 1);
        main.take_relayed(&s);
        assert_eq!((main.len(), main.dropped), (4, 1));
        let mut v = Vec::new();
        s.get(RELAY_KEY, &mut v);
        assert!(v.is_empty(), "drained");
        main.clear();
        main.take_relayed(&s);
        assert!(main.is_empty(), "nothing is taken twice");
        // A relay that keeps losing its CAS race gives up without taking anything.
        let busy = MemStore::with_conflicts(1);
        busy.put(RELAY_KEY, &[0u8; 16]);
        main.take_relayed(&busy);
        assert!(main.is_empty());
        busy.get(RELAY_KEY, &mut v);
        assert_eq!(v.len(), 16, "still there for the next flush");
    }

    const NOW: u64 = 1_700_000_000_000;
    const SECRET: &str = "0123456789abcdef";

    fn peers(c: &Config) -> &PeersConfig {
        c.peers.as_ref().unwrap()
    }

    #[test]
    fn a_batch_from_a_peer_becomes_local_holders() {
        let c = cfg();
        let m = &c.models[0];
        let mut ob = Outbox::new(4);
        ob.push(m.peer_key, m.workers[1].id, 0xABCD);
        ob.push(m.peer_key, 12345, 0xBEEF); // unknown worker
        ob.push(77, m.workers[0].id, 0xF00D); // unknown model
        assert_eq!(ob.len(), 3);
        let s = MemStore::new();
        let mut sc = IndexBuffers::default();
        let batch = ob.seal(SECRET, 42, 1, NOW).to_vec();
        assert_eq!(batch.len(), HEADER + 3 * REC + MAC_LEN);
        assert_eq!(batch, seal(SECRET, 42, 1, NOW, ob.records()));
        let a = receive(&s, &c, &batch, NOW, 10, &mut sc, &mut Placements::default()).unwrap();
        assert_eq!((a.records, a.ignored, a.writes.writes), (3, 2, 1));
        // The lookup for a one-block prompt with that hash finds worker b.
        let ix = Index::for_model(&c, m);
        let mut out = Matches::default();
        ix.lookup(&s, &[0xABCD], 11, &mut sc, &mut out);
        assert_eq!(out.blocks_for(m.workers[1].id), 1);
        assert!(sc.written.is_empty(), "not forwarded again");
        ob.clear();
        assert!(ob.is_empty());
        // The next batch carries the sequence number it is given.
        ob.push(m.peer_key, m.workers[1].id, 0xABCE);
        let next = ob.seal(SECRET, 42, 2, NOW + 5).to_vec();
        assert_eq!(open(peers(&c), &next, NOW).unwrap().seq, 2);
    }

    #[test]
    fn a_placement_from_a_peer_is_remembered_here_one_step_back() {
        let c = cfg();
        let m = &c.models[0];
        let mut ob = Outbox::new(4);
        ob.push(m.placed_peer_key, m.workers[1].id, 0x5151);
        ob.push(m.placed_peer_key, 12345, 0x5152); // unknown worker
        ob.push(m.peer_key, m.workers[0].id, 0xABCD); // an index record beside it
        let (s, mut sc, mut placed) = (
            MemStore::new(),
            IndexBuffers::default(),
            Placements::default(),
        );
        let batch = ob.seal(SECRET, 42, 1, NOW).to_vec();
        let a = receive(&s, &c, &batch, NOW, 10, &mut sc, &mut placed).unwrap();
        assert_eq!(
            (a.records, a.placements, a.ignored, a.writes.writes),
            (1, 2, 1, 1)
        );
        let mut other = Placements::default();
        assert_eq!(
            other.recent(&s, &m.placed_key, 0x5151, 10),
            Some((m.workers[1].id, 9)),
            "the sibling key names the peer's worker, stamped a step back"
        );
        assert_eq!(other.recent(&s, &m.placed_key, 0x5152, 10), None);
        let ix = Index::for_model(&c, m);
        let mut out = Matches::default();
        ix.lookup(&s, &[0x5151], 11, &mut sc, &mut out);
        assert_eq!(
            out.blocks_for(m.workers[1].id),
            0,
            "a placement is no holder"
        );
    }

    #[test]
    fn bounded_outbox_and_malformed_batches() {
        let c = cfg();
        let mut ob = Outbox::new(2);
        for i in 0..5 {
            ob.push(1, 2, i);
        }
        assert_eq!((ob.len(), ob.dropped), (2, 3));
        let s = MemStore::new();
        let mut sc = IndexBuffers::default();
        let mut pl = Placements::default();
        let rec = [0u8; REC];
        let short = seal(SECRET, 1, 1, NOW, &[]); // no record
        let ragged = seal(SECRET, 1, 1, NOW, &rec[..15]);
        let legacy = [&LEGACY_MAGIC[..], &rec].concat();
        for (bad, why) in [
            (&b""[..], Refused::Format),
            (b"PRr0", Refused::Format),
            (b"PRr2abc", Refused::Format),
            (b"\x00\x01", Refused::Format),
            (&short, Refused::Format),
            (&ragged, Refused::Format),
            (&legacy, Refused::Legacy),
        ] {
            assert_eq!(receive(&s, &c, bad, NOW, 1, &mut sc, &mut pl), Err(why));
        }
        let big = seal(SECRET, 1, 1, NOW, &[0u8; REC * 5]);
        assert_eq!(
            receive(&s, &c, &big, NOW, 1, &mut sc, &mut pl),
            Err(Refused::TooLarge)
        );
        assert_eq!(s.len(), 0, "nothing written");
        // Every prefix of a valid batch is refused without a panic.
        let ok = seal(SECRET, 1, 1, NOW, &[0u8; REC * 2]);
        for n in 0..ok.len() {
            assert!(
                receive(&s, &c, &ok[..n], NOW, 1, &mut sc, &mut pl).is_err(),
                "{n}"
            );
        }
    }

    #[test]
    fn the_mac_covers_every_byte_and_needs_the_secret() {
        let c = cfg();
        let p = peers(&c);
        let ok = seal(SECRET, 9, 3, NOW, &[7u8; REC * 2]);
        assert!(open(p, &ok, NOW).is_ok());
        for i in 0..ok.len() {
            let mut bad = ok.clone();
            bad[i] ^= 0x80;
            let r = open(p, &bad, NOW);
            assert!(
                matches!(r, Err(Refused::BadMac | Refused::Format)),
                "byte {i}: {r:?}"
            );
        }
        let forged = seal("another-secret-16chars", 9, 3, NOW, &[7u8; REC * 2]);
        assert_eq!(open(p, &forged, NOW), Err(Refused::BadMac));
        assert!(!ok.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()));
    }

    #[test]
    fn the_window_and_the_sequence_refuse_replays() {
        let c = cfg();
        let p = peers(&c); // window_s 30 (default)
        let b = |seq: u64, at: u64| seal(SECRET, 5, seq, at, &[0u8; REC]);
        assert!(open(p, &b(1, NOW - 30_000), NOW).is_ok(), "at the edge");
        assert!(open(p, &b(1, NOW + 30_000), NOW).is_ok(), "at the edge");
        assert_eq!(open(p, &b(1, NOW - 30_001), NOW), Err(Refused::Stale));
        assert_eq!(open(p, &b(1, NOW + 30_001), NOW), Err(Refused::Stale));
        assert_eq!(
            open(p, &b(1, 0), u64::MAX),
            Err(Refused::Stale),
            "no overflow"
        );
        assert_eq!(
            open(p, &b(1, u64::MAX), 0),
            Err(Refused::Stale),
            "no overflow"
        );

        let s = MemStore::new();
        let mut t = Vec::new();
        let adm = |seq: u64, t: &mut Vec<u8>| {
            let body = b(seq, NOW);
            let o = open(p, &body, NOW).unwrap();
            admit(&s, p, &o, NOW, t)
        };
        assert_eq!(adm(10, &mut t), Ok(1));
        assert_eq!(adm(10, &mut t), Err(Refused::Replay));
        assert_eq!(adm(12, &mut t), Ok(1));
        assert_eq!(
            adm(11, &mut t),
            Ok(1),
            "reordered on the way: still accepted once"
        );
        assert_eq!(adm(11, &mut t), Err(Refused::Replay));
        assert_eq!(adm(200, &mut t), Ok(1));
        assert_eq!(adm(136, &mut t), Err(Refused::Replay), "too old to tell");
        assert_eq!(adm(137, &mut t), Ok(1));
        // Another sender has its own sequence.
        let other = seal(SECRET, 6, 10, NOW, &[0u8; REC]);
        let o = open(p, &other, NOW).unwrap();
        assert_eq!(admit(&s, p, &o, NOW, &mut t), Ok(1));
        let mut v = Vec::new();
        s.get(SENDERS_KEY, &mut v);
        assert_eq!(v.len(), TABLE_HEAD + 2 * ENTRY);
        // Once sender 5's newest batch is out of the window, a batch of sender 6 forgets it.
        let later = NOW + 31_000;
        let o = seal(SECRET, 6, 11, later, &[0u8; REC]);
        let o = open(p, &o, later).unwrap();
        assert_eq!(admit(&s, p, &o, later, &mut t), Ok(1));
        s.get(SENDERS_KEY, &mut v);
        assert_eq!(v.len(), TABLE_HEAD + ENTRY);
    }

    #[test]
    fn the_sender_table_is_bounded() {
        let c = cfg();
        let p = peers(&c);
        let s = MemStore::new();
        let mut t = Vec::new();
        for sender in 0..MAX_SENDERS as u64 {
            let body = seal(SECRET, sender, 1, NOW, &[0u8; REC]);
            let o = open(p, &body, NOW).unwrap();
            assert_eq!(admit(&s, p, &o, NOW, &mut t), Ok(1));
        }
        let body = seal(SECRET, 999_999, 1, NOW, &[0u8; REC]);
        let o = open(p, &body, NOW).unwrap();
        assert_eq!(admit(&s, p, &o, NOW, &mut t), Err(Refused::TooManySenders));
        // After the window every old sender is forgotten and a new one is welcome.
        let later = NOW + 31_000;
        let body = seal(SECRET, 999_999, 1, later, &[0u8; REC]);
        let o = open(p, &body, later).unwrap();
        assert_eq!(admit(&s, p, &o, later, &mut t), Ok(1));
        // A table that keeps changing under the batch: refused as busy, not applied.
        let busy = MemStore::with_conflicts(1);
        busy.put(SENDERS_KEY, &[]);
        assert_eq!(admit(&busy, p, &o, later, &mut t), Err(Refused::Busy));
    }

    #[test]
    fn each_sender_has_a_record_budget_that_survives_a_stepped_clock() {
        let c = Config::from_json(
            br#"{"models":{"m":{"workers":["a","b"]}},
                 "peers":{"secret":"0123456789abcdef","max_batch":100,"max_records_per_s":10}}"#,
        )
        .unwrap();
        let p = peers(&c);
        let s = MemStore::new();
        let mut t = Vec::new();
        let mut seq = 0;
        let mut adm = |n: usize, now: u64| {
            seq += 1;
            let body = seal(SECRET, 1, seq, now, &vec![0u8; REC * n]);
            let o = open(p, &body, now).unwrap();
            admit(&s, p, &o, now, &mut t)
        };
        assert_eq!(adm(8, NOW), Ok(8), "one second's worth to start with");
        assert_eq!(adm(8, NOW), Ok(2), "cut at the budget");
        assert_eq!(adm(8, NOW), Ok(0));
        assert_eq!(adm(8, NOW + 500), Ok(5), "refilled at 10/s");
        assert_eq!(adm(50, NOW + 60_000), Ok(10), "one second deep");
        // The receiver's clock steps back a minute: the bucket goes on from the new time
        // instead of waiting for the old one to come back.
        let back = NOW;
        assert_eq!(adm(1, back), Ok(0));
        assert_eq!(adm(10, back + 1_000), Ok(10));
    }
}
