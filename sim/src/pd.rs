//! Prefill/decode disaggregation (SGLang's `--disaggregation-mode prefill|decode`).
//!
//! A router sends the same body to one prefill and one decode worker with three added fields:
//! `bootstrap_host` / `bootstrap_port` (the prefill worker's bootstrap server as the decode
//! worker reaches it) and `bootstrap_room` (an integer naming the KV transfer).
//!
//! - **Prefill worker**: runs the request through its scheduler (prefix cache + prefill time)
//!   with the output cut to one token, then marks the room *ready* (with the cached prompt
//!   tokens of each prompt) and answers the caller normally (the router discards that answer).
//!   It serves a bootstrap server on `--disaggregation-bootstrap-port`: `GET /kv/<room>`
//!   long-polls (up to `wait_ms`, at most 1 s) until the room is ready (200, and the room is
//!   handed over: removed), failed (500) or still unknown (404: the decode worker asks again).
//! - **Decode worker**: before scheduling, asks the named prefill worker for the room until it
//!   is ready or `--disaggregation-timeout-s` passes (a refused connection, a prefill worker
//!   that is down, is retried every 20 ms until then). Timeout or a failed room: SGLang-style
//!   500 error, counted in `sglang:num_bootstrap_failed_reqs_total` /
//!   `sglang:num_transfer_failed_reqs_total`. Ready: the prompt's KV is there, so the
//!   scheduler charges no prefill time; the first token follows right away, then decode steps;
//!   `cached_tokens` reported to the client are the prefill worker's.
//!
//! Memory bound: a room that is never fetched (the decode worker died or never came) is
//! dropped after the disaggregation timeout; sweeping runs on insert, O(rooms) at most once
//! per second.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::sync::Notify;

use crate::api::ApiError;
pub use crate::api::{fields, Fields};
pub use crate::config::Mode;

/// What the prefill worker hands over for a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// Cached prompt tokens at the prefill worker, per prompt of the request.
    pub cached: Vec<usize>,
}

#[derive(Debug)]
enum Room {
    Prefilling,
    Ready(Kv),
    Failed,
}

/// Disaggregation state of one worker: the prefill side's rooms and both sides' counters.
pub struct Disagg {
    rooms: Mutex<HashMap<u64, (Room, Instant)>>,
    changed: Notify,
    last_sweep: Mutex<Instant>,
    ttl: Duration,
    /// Decode: requests waiting for their KV.
    pub transfer_queue: AtomicUsize,
    /// Decode: requests that gave up waiting (prefill unreachable or too slow).
    pub bootstrap_failed: AtomicU64,
    /// Decode: requests whose prefill failed.
    pub transfer_failed: AtomicU64,
    /// Prefill: rooms handed over to a decode worker.
    pub transferred: AtomicU64,
}

impl Disagg {
    pub fn new(ttl: Duration) -> Self {
        Disagg {
            rooms: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            last_sweep: Mutex::new(Instant::now()),
            ttl,
            transfer_queue: AtomicUsize::new(0),
            bootstrap_failed: AtomicU64::new(0),
            transfer_failed: AtomicU64::new(0),
            transferred: AtomicU64::new(0),
        }
    }

    fn set(&self, room: u64, state: Room) {
        let now = Instant::now();
        if let Ok(mut m) = self.rooms.lock() {
            let sweep = self
                .last_sweep
                .lock()
                .map(|mut t| {
                    let due = now.duration_since(*t) >= Duration::from_secs(1);
                    if due {
                        *t = now;
                    }
                    due
                })
                .unwrap_or(false);
            if sweep {
                let ttl = self.ttl;
                m.retain(|_, (_, at)| now.duration_since(*at) < ttl);
            }
            m.insert(room, (state, now));
        }
        self.changed.notify_waiters();
    }

    /// Prefill: a request for `room` was accepted.
    pub fn prefilling(&self, room: u64) {
        self.set(room, Room::Prefilling);
    }

    /// Prefill: the room's KV is computed.
    pub fn ready(&self, room: u64, kv: Kv) {
        self.set(room, Room::Ready(kv));
    }

    /// Prefill: the request failed before its KV was computed.
    pub fn failed(&self, room: u64) {
        self.set(room, Room::Failed);
    }

    /// Prefill: rooms computed and not yet fetched (SGLang's inflight queue).
    pub fn ready_rooms(&self) -> usize {
        self.rooms
            .lock()
            .map(|m| {
                m.values()
                    .filter(|(r, _)| matches!(r, Room::Ready(_)))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Bootstrap server: waits up to `wait` for `room` to be ready (taken) or failed.
    pub(crate) async fn take(&self, room: u64, wait: Duration) -> Option<Result<Kv, ()>> {
        let deadline = Instant::now() + wait;
        loop {
            // register interest before looking, so a change in between is not missed
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Ok(mut m) = self.rooms.lock() {
                match m.get(&room) {
                    Some((Room::Ready(_), _)) => {
                        if let Some((Room::Ready(kv), _)) = m.remove(&room) {
                            self.transferred.fetch_add(1, Ordering::Relaxed);
                            return Some(Ok(kv));
                        }
                    }
                    Some((Room::Failed, _)) => {
                        m.remove(&room);
                        return Some(Err(()));
                    }
                    _ => {}
                }
            }
            if tokio::time::timeout_at(deadline.into(), notified)
                .await
                .is_err()
            {
                return None;
            }
        }
    }

    /// Prometheus lines (SGLang's disaggregation metric names).
    pub fn render(&self, mode: Mode, model: &str) -> String {
        let labels = format!(
            "model_name=\"{}\"",
            model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        let mut o = String::new();
        let g = |o: &mut String, n: &str, help: &str, v: u64, kind: &str| {
            o.push_str(&format!(
                "# HELP sglang:{n} {help}\n# TYPE sglang:{n} {kind}\nsglang:{n}{{{labels}}} {v}\n"
            ));
        };
        match mode {
            Mode::Null => {}
            Mode::Prefill => {
                g(
                    &mut o,
                    "num_prefill_inflight_queue_reqs",
                    "Prefilled requests whose KV waits for its decode worker.",
                    self.ready_rooms() as u64,
                    "gauge",
                );
                g(
                    &mut o,
                    "kv_transfer_total",
                    "Rooms handed over to decode workers.",
                    self.transferred.load(Ordering::Relaxed),
                    "counter",
                );
            }
            Mode::Decode => {
                g(
                    &mut o,
                    "num_decode_transfer_queue_reqs",
                    "Requests waiting for their KV from a prefill worker.",
                    self.transfer_queue.load(Ordering::Relaxed) as u64,
                    "gauge",
                );
                g(
                    &mut o,
                    "num_bootstrap_failed_reqs_total",
                    "Requests that timed out waiting for their prefill worker.",
                    self.bootstrap_failed.load(Ordering::Relaxed),
                    "counter",
                );
                g(
                    &mut o,
                    "num_transfer_failed_reqs_total",
                    "Requests whose prefill failed.",
                    self.transfer_failed.load(Ordering::Relaxed),
                    "counter",
                );
            }
        }
        o
    }
}

/// Prefill: a room being computed; dropped before [`Pending::ready`], it marks the room failed
/// and says so on stderr.
pub struct Pending<'a> {
    d: &'a Disagg,
    room: u64,
    worker: &'a str,
    done: bool,
}

impl<'a> Pending<'a> {
    pub fn new(d: &'a Disagg, room: u64, worker: &'a str) -> Self {
        Pending {
            d,
            room,
            worker,
            done: false,
        }
    }

    /// The room's KV is computed.
    pub fn ready(&mut self, kv: Kv) {
        self.done = true;
        self.d.ready(self.room, kv);
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            eprintln!(
                "sglang-sim {}: prefill of bootstrap_room={} abandoned (client gone or generation aborted)",
                self.worker, self.room
            );
            self.d.failed(self.room);
        }
    }
}

/// Counts a decode request in the transfer queue while it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::SeqCst);
        Waiting(c)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One long-poll to a prefill worker's bootstrap server. `Ok(None)`: not ready yet.
async fn poll_once(host: &str, port: u16, room: u64, wait_ms: u64) -> Result<Option<Kv>, String> {
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("cannot reach bootstrap server {host}:{port}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(Method::GET)
        .uri(format!("/kv/{room}?wait_ms={wait_ms}"))
        .header("host", format!("{host}:{port}"))
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    match status {
        StatusCode::OK => {
            let v: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
            let cached = v
                .get("cached_tokens")
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect())
                .unwrap_or_default();
            Ok(Some(Kv { cached }))
        }
        StatusCode::NOT_FOUND => Ok(None),
        s => Err(format!("prefill failed (bootstrap server answered {s})")),
    }
}

/// Why a decode request got no KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchError {
    /// The deadline passed (prefill worker down, slow, or never received the request).
    Timeout(String),
    /// The prefill worker reported the room failed.
    Failed(String),
}

/// Decode: waits for `room`'s KV from `host:port` until `timeout`.
pub async fn fetch(
    d: &Disagg,
    host: &str,
    port: u16,
    room: u64,
    timeout: Duration,
) -> Result<Kv, FetchError> {
    let _w = Waiting::new(&d.transfer_queue);
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no answer");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(FetchError::Timeout(last));
        }
        let wait_ms = left.as_millis().min(1000) as u64;
        let once = poll_once(host, port, room, wait_ms);
        match tokio::time::timeout(left + Duration::from_millis(200), once).await {
            Ok(Ok(Some(kv))) => return Ok(kv),
            Ok(Ok(None)) => last = "room not prefilled yet".into(),
            Ok(Err(e)) if e.starts_with("prefill failed") => return Err(FetchError::Failed(e)),
            Ok(Err(e)) => {
                last = e;
                let pause = Duration::from_millis(20).min(left);
                tokio::time::sleep(pause).await;
            }
            Err(_) => last = "bootstrap server did not answer".into(),
        }
    }
}

/// Decode: the answer when no KV came (SGLang aborts the request with a 500).
pub fn fetch_error(d: &Disagg, e: &FetchError, room: u64, timeout: Duration) -> ApiError {
    match e {
        FetchError::Timeout(why) => {
            d.bootstrap_failed.fetch_add(1, Ordering::Relaxed);
            eprintln!("decode bootstrap_room={room}: no KV within {timeout:?} ({why})");
            ApiError::internal(format!(
                "Decode bootstrap failed for request bootstrap_room={room}: timed out after \
                 {:.1}s waiting for KV ({why})",
                timeout.as_secs_f64()
            ))
        }
        FetchError::Failed(why) => {
            d.transfer_failed.fetch_add(1, Ordering::Relaxed);
            ApiError::internal(format!(
                "KV transfer failed for request bootstrap_room={room}: {why}"
            ))
        }
    }
}
