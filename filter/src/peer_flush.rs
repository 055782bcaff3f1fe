//! The peer protocol's orchestration (`peers.rs` has the protocol): the sending root's flush
//! and its answers, and the peer listener's batch requests.
//!
//! Invariants:
//! - A batch leaves only from a root that can call, every `peers.flush_ms`; a root that cannot
//!   (a native worker thread) hands its records to that one through shared data instead
//!   (`peers::Outbox::hand_off`), and a peer listener never sends.
//! - At most 4 batches per peer are in flight: a peer whose answers are overdue is skipped (a
//!   send failure) rather than piled up on; a batch whose answer never comes expires
//!   (`schedule::Calls`) and counts as a send failure.
//! - Nothing waits on a peer: a failure costs the peer freshness, never a request.
//! - The listener answers every request itself (a local reply): a batch is never forwarded.
//!
//! Costs: per flush with records, one seal (HMAC) and one HTTP call per peer; on a VM that
//! cannot call, one relay read-modify-write instead. The listener pays one body read, the
//! sender table read and CAS, and the record writes per batch (`peers::receive`).

use crate::config::PEER_PATH;
use crate::host::{now_ticks, Host};
use crate::metrics::{Counter, Metrics};
use crate::peers::{self, Refused};
use crate::router::Router;
use crate::schedule::{since, Calls};
use std::cell::RefCell;

/// A root context's peer batches.
#[derive(Default)]
pub struct PeerSender {
    /// Batches awaiting an answer (bounded, see the module docs; expiring, see `schedule`).
    calls: Calls<()>,
    last_flush_ms: u64,
    /// This VM's identity in its batches (`glue::Root::install`).
    sender: u64,
    /// Sequence number of the last batch sealed. Kept here, in the root, not in the router's
    /// outbox: a membership rebuild makes a new router but the same sender, and a sequence
    /// that started again would be refused as replays by every peer for `window_s`.
    seq: u64,
}

impl PeerSender {
    /// Names this VM's batches' sender. A new sender's sequence starts at 1; the same sender
    /// (a membership rebuild) goes on with its sequence.
    pub fn set_sender(&mut self, sender: u64) {
        if sender != self.sender {
            self.sender = sender;
            self.seq = 0;
        }
    }

    /// The root's tick: expires lost batches and, every `peers.flush_ms`, sends this VM's new
    /// index records (and those relayed to it) to every peer.
    pub fn tick(&mut self, h: &impl Host, router: &RefCell<Router>, m: &Metrics, now_ms: u64) {
        let Ok(mut guard) = router.try_borrow_mut() else {
            return;
        };
        let r = &mut *guard;
        let listener = r.cfg().peer_listener;
        let Some((p, ob)) = r.outbox() else {
            return;
        };
        self.calls.expire(now_ms, p.timeout_ms, |_| {
            m.add(Counter::PeerSendFailures, 1)
        });
        let since = since(self.last_flush_ms, now_ms);
        if listener || since < u64::from(p.flush_ms) {
            return;
        }
        self.last_flush_ms = now_ms;
        if h.can_call() {
            ob.take_relayed(h);
        } else {
            ob.hand_off(h);
        }
        m.add(
            Counter::PeerRecordsDropped,
            std::mem::take(&mut ob.dropped) as i64,
        );
        if ob.is_empty() {
            return;
        }
        let n = ob.len() as i64;
        self.seq += 1;
        let batch = ob.seal(&p.secret, self.sender, self.seq, now_ms);
        for c in &p.clusters {
            if self.calls.len() >= 4 * p.clusters.len().max(1) {
                // Answers are overdue (timeouts pending): skip rather than pile up calls.
                m.add(Counter::PeerSendFailures, 1);
                continue;
            }
            let headers = [
                (":method", "POST"),
                (":path", PEER_PATH),
                (":authority", c.as_str()),
                ("content-type", "application/octet-stream"),
            ];
            match h.http_call(c, &headers, Some(batch), p.timeout_ms) {
                Ok(token) => {
                    self.calls.push(token, now_ms, ());
                    m.add(Counter::PeerBatchesSent, 1);
                    m.add(Counter::PeerRecordsSent, n);
                }
                Err(_) => m.add(Counter::PeerSendFailures, 1),
            }
        }
        ob.clear();
    }

    /// A batch's answer, when `token` is one (`false`: not ours). Anything but 204 (or 200)
    /// is a send failure; the batch is not sent again (nothing waits on a peer).
    pub fn answer(&mut self, m: &Metrics, token: u32, status: Option<u32>) -> bool {
        if self.calls.take(token).is_none() {
            return false;
        }
        if status != Some(204) && status != Some(200) {
            m.add(Counter::PeerSendFailures, 1);
        }
        true
    }
}

/// The peer listener's request headers: only `POST /prefix-router/v1/records` with a body may
/// be a batch (`true`: read its body); anything else is refused here (403) and answered.
pub fn batch_headers(
    h: &impl Host,
    m: &Metrics,
    method: Option<&[u8]>,
    path: Option<&[u8]>,
    end_of_stream: bool,
) -> bool {
    let ok = method == Some(b"POST") && path == Some(PEER_PATH.as_bytes());
    if !ok || end_of_stream {
        m.add(Counter::PeerRequestsRejected, 1);
        reply(h, 403, "prefix_router_peer_forbidden", "forbidden");
        return false;
    }
    true
}

/// A complete batch at the peer listener: applies it (`peers::receive`), counts the outcome
/// and answers (204; 429 when cut at the sender's budget; the refusal's status otherwise).
pub fn receive_batch(h: &impl Host, router: &RefCell<Router>, m: &Metrics, body: &[u8]) {
    let (now, nanos) = now_ticks(h);
    let res = {
        router
            .borrow_mut()
            .receive_peer_batch(h, body, nanos / 1_000_000, now)
    };
    match res {
        Ok(a) => {
            m.add(Counter::PeerRecordsReceived, i64::from(a.records));
            m.add(Counter::PeerPlacementsReceived, i64::from(a.placements));
            m.add(Counter::PeerRecordsIgnored, i64::from(a.ignored));
            m.index_writes(&a.writes);
            if a.over_budget > 0 {
                // Applied in part: the sender counts a failure, the log says why.
                m.add(Counter::PeerRecordsOverBudget, i64::from(a.over_budget));
                let msg = "sender over its record budget";
                reply(h, 429, peers::OVER_BUDGET_DETAILS, msg);
            } else {
                h.local_reply(204, &[], &[]);
            }
        }
        Err(e) => {
            m.add(Counter::PeerRequestsRejected, 1);
            match e {
                Refused::Stale => m.add(Counter::PeerBatchesStale, 1),
                Refused::Replay => m.add(Counter::PeerBatchesReplayed, 1),
                Refused::BadMac | Refused::Legacy => m.add(Counter::PeerBatchesBadMac, 1),
                _ => {}
            }
            let msg = match e.status() {
                400 => "bad record batch",
                403 => "forbidden",
                429 => "too many peer senders",
                _ => "busy",
            };
            reply(h, e.status(), e.details(), msg);
        }
    }
    m.maybe_flush(h, now);
}

/// The peer listener's refusal: an error body and the reason as response code details (the
/// peer listener's access log records them).
fn reply(h: &impl Host, status: u32, details: &str, message: &str) {
    let kind = match status {
        400 => "BadRequestError",
        403 => "PermissionDenied",
        429 => "RateLimitError",
        _ => "ServiceUnavailable",
    };
    let body =
        format!(r#"{{"object":"error","message":"{message}","type":"{kind}","code":{status}}}"#);
    h.local_reply_details(
        status,
        details,
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
}
