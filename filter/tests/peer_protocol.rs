//! The peer protocol end to end over `host::FakeHost`: one replica's root sends its record batch
//! (captured from its `http_call`), another replica's peer listener receives it, as Envoy would
//! deliver it. A batch is authenticated without revealing the secret, fresh (sender's wall-clock
//! timestamp within the window), never applied twice, and each sender has a record budget.

mod common;
use common::{configured, request};
use prefix_router::glue::{Action, Root};
use prefix_router::host::FakeHost;

const SECRET: &str = "0123456789abcdef-peer-secret";
const MS: u64 = 1_000_000;

fn config_with(extra: &str, root: &str) -> String {
    format!(
        r#"{{"models":{{"llama":{{"workers":["w0","w1","w2"]}}}},
            "peers":{{"clusters":["peer0"],"secret":"{SECRET}","flush_ms":100{extra}}}{root}}}"#
    )
}

fn config(extra: &str) -> String {
    config_with(extra, "")
}

fn listener_config(extra: &str) -> String {
    config_with(extra, r#","peer_listener":true"#)
}

fn chat(user: &str) -> String {
    format!(r#"{{"model":"llama","messages":[{{"role":"user","content":"{user}"}}]}}"#)
}

/// A captured peer batch: its request headers and body.
#[derive(Clone)]
struct Batch {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// A sending replica: routes one chat request (its index records go to the outbox) and ticks
/// until its root has flushed a batch to `peer0`; returns the batches sent since `from`.
fn send_one(h: &FakeHost, root: &mut Root, user: &str) -> Batch {
    let before = h.state.borrow().calls.len();
    let body = chat(&format!(
        "{user} {}",
        "a prompt long enough for a few blocks. ".repeat(40)
    ));
    let (mut st, _) = request(h, root, "POST", "/v1/chat/completions", &[], &body);
    h.state.borrow_mut().response_headers = vec![(":status".into(), "200".into())];
    st.on_response_headers(h);
    st.on_done(h);
    for _ in 0..4 {
        h.state.borrow_mut().now_nanos += 60 * MS;
        root.on_tick(h);
    }
    let s = h.state.borrow();
    let sent: Vec<_> = s.calls[before..]
        .iter()
        .filter(|c| c.upstream == "peer0")
        .collect();
    assert_eq!(sent.len(), 1, "one batch to the peer");
    let (token, b) = (
        sent[0].token,
        Batch {
            headers: sent[0].headers.clone(),
            body: sent[0].body.clone().unwrap_or_default(),
        },
    );
    drop(s);
    // The peer answers (the sender keeps at most a few batches in flight).
    h.state.borrow_mut().call_headers = vec![(":status".into(), "204".into())];
    root.on_http_call_response(h, token, 0);
    b
}

/// Delivers `b` to the receiving replica's peer listener; returns the reply status.
fn deliver(h: &FakeHost, root: &Root, b: &Batch) -> u32 {
    let n = h.state.borrow().replies.len();
    {
        let mut s = h.state.borrow_mut();
        s.request_headers = b.headers.clone();
        s.request_body = b.body.clone();
    }
    let mut st = root.new_stream().expect("configured");
    if st.on_request_headers(h, b.body.is_empty()) == Action::Pause
        && h.state.borrow().replies.len() == n
    {
        st.on_request_body(h, b.body.len(), true);
    }
    st.on_done(h);
    let s = h.state.borrow();
    assert_eq!(
        s.replies.len(),
        n + 1,
        "the peer listener answers every request itself"
    );
    s.replies[n].0
}

/// The receiver's counters, after its metric flush.
fn counter(h: &FakeHost, root: &mut Root, name: &str) -> i64 {
    for _ in 0..4 {
        root.on_tick(h);
    }
    h.metric(&format!("prefix_router.peers.{name}"))
        .unwrap_or_default()
}

fn pair(extra: &str) -> ((FakeHost, Root), (FakeHost, Root)) {
    (
        configured(&config(extra)),
        configured(&listener_config(extra)),
    )
}

#[test]
fn a_valid_batch_is_accepted_and_the_secret_never_travels() {
    let ((sh, mut sender), (rh, mut rx)) = pair("");
    let b = send_one(&sh, &mut sender, "valid");
    for (k, v) in &b.headers {
        assert!(
            !v.contains(SECRET) && !k.contains("secret"),
            "the secret is sent in header {k}"
        );
    }
    assert!(
        !b.body.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
        "the secret is in the body"
    );
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    assert_eq!(deliver(&rh, &rx, &b), 204);
    assert!(counter(&rh, &mut rx, "records_received") > 0);
    assert_eq!(counter(&rh, &mut rx, "requests_rejected"), 0);
}

#[test]
fn a_batch_with_a_wrong_mac_is_refused() {
    let ((sh, mut sender), (rh, mut rx)) = pair("");
    let b = send_one(&sh, &mut sender, "mac");
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    // Any single flipped bit (a record, the tail, the middle) is refused.
    for at in [b.body.len() - 1, b.body.len() / 2, b.body.len() - 40] {
        let mut bad = b.clone();
        bad.body[at] ^= 0x01;
        assert_eq!(deliver(&rh, &rx, &bad), 403, "bit flipped at {at}");
    }
    // Signed with another secret: refused too.
    let ((oh, mut other), _) = (
        configured(&config("").replace(SECRET, "another-secret-of-16+chars")),
        (),
    );
    let forged = send_one(&oh, &mut other, "mac");
    assert_eq!(deliver(&rh, &rx, &forged), 403);
    assert_eq!(
        rh.state.borrow().reply_details.last().map(String::as_str),
        Some("prefix_router_peer_bad_mac"),
        "the access log says why"
    );
    assert_eq!(counter(&rh, &mut rx, "records_received"), 0);
    assert_eq!(counter(&rh, &mut rx, "requests_rejected"), 4);
    // The genuine batch still goes through.
    assert_eq!(deliver(&rh, &rx, &b), 204);
}

#[test]
fn a_replayed_batch_is_refused_inside_and_after_the_window() {
    let ((sh, mut sender), (rh, mut rx)) = pair(r#","window_s":5"#);
    let b1 = send_one(&sh, &mut sender, "replay-1");
    let now = sh.state.borrow().now_nanos;
    rh.state.borrow_mut().now_nanos = now;
    assert_eq!(deliver(&rh, &rx, &b1), 204);
    let got = counter(&rh, &mut rx, "records_received");
    // Inside the window: already seen.
    assert_eq!(deliver(&rh, &rx, &b1), 403, "replayed at once");
    assert_eq!(
        rh.state.borrow().reply_details.last().map(String::as_str),
        Some("prefix_router_peer_replay")
    );
    // The sender's next batch is fresh.
    let b2 = send_one(&sh, &mut sender, "replay-2");
    assert_eq!(deliver(&rh, &rx, &b2), 204);
    assert_eq!(deliver(&rh, &rx, &b2), 403);
    // After the window (5 s): stale, whatever the receiver remembers.
    rh.state.borrow_mut().now_nanos = now + 6_000 * MS;
    assert_eq!(deliver(&rh, &rx, &b1), 403, "replayed after the window");
    assert_eq!(deliver(&rh, &rx, &b2), 403, "replayed after the window");
    // A batch from the future (beyond the window) is refused as well.
    rh.state.borrow_mut().now_nanos = now - 6_000 * MS;
    let b3 = send_one(&sh, &mut sender, "replay-3");
    assert_eq!(deliver(&rh, &rx, &b3), 403, "from the future");
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    let after = counter(&rh, &mut rx, "records_received");
    assert!(after > got, "b2 was applied");
    assert_eq!(counter(&rh, &mut rx, "requests_rejected"), 5);
    assert_eq!(counter(&rh, &mut rx, "batches_replayed"), 2);
    assert_eq!(counter(&rh, &mut rx, "batches_stale"), 3);
}

#[test]
fn a_flood_from_one_sender_is_cut_at_its_budget() {
    // 10 records per second per sender; each batch carries several records, one every 240 ms.
    let ((sh, mut sender), (rh, mut rx)) = pair(r#","max_records_per_s":10"#);
    let mut statuses = Vec::new();
    let mut sent = 0usize;
    let start = sh.state.borrow().now_nanos;
    for i in 0..40 {
        let b = send_one(&sh, &mut sender, &format!("flood-{i}"));
        sent += (b.body.len() - 28 - 32) / 16;
        rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
        statuses.push(deliver(&rh, &rx, &b));
    }
    let elapsed_s = (sh.state.borrow().now_nanos - start) as f64 / 1e9;
    // Index records and new prompts' placements share the sender's budget.
    let got = (counter(&rh, &mut rx, "records_received")
        + counter(&rh, &mut rx, "placements_received")) as f64;
    let cut = counter(&rh, &mut rx, "records_over_budget") as f64;
    assert!(
        sent as f64 > 2.0 * (10.0 + 10.0 * elapsed_s),
        "the test floods: {sent} records in {elapsed_s} s"
    );
    assert!(
        got <= 10.0 + 10.0 * elapsed_s + 1.0 && got >= 10.0 * elapsed_s - 10.0,
        "{got} records applied in {elapsed_s} s at 10/s"
    );
    assert_eq!(
        got + cut,
        sent as f64,
        "every record is applied or counted as cut"
    );
    assert_eq!(statuses[0], 204, "the first batch is within the budget");
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 204 || *s == 429),
        "{statuses:?}"
    );
}

#[test]
fn a_request_without_a_batch_is_refused() {
    let (_, (rh, rx)) = pair("");
    let get = Batch {
        headers: vec![
            (":method".into(), "GET".into()),
            (":path".into(), "/prefix-router/v1/records".into()),
        ],
        body: Vec::new(),
    };
    assert_eq!(deliver(&rh, &rx, &get), 403);
    // An old-protocol batch (plain secret header, PRr1 body) is refused.
    let mut old = b"PRr1".to_vec();
    old.extend_from_slice(&[0u8; 16]);
    let legacy = Batch {
        headers: vec![
            (":method".into(), "POST".into()),
            (":path".into(), "/prefix-router/v1/records".into()),
            ("x-prefix-router-peer-secret".into(), SECRET.into()),
        ],
        body: old,
    };
    assert_eq!(deliver(&rh, &rx, &legacy), 403);
    // Garbage of every short length never panics.
    for n in 0..100 {
        let b = Batch {
            body: vec![0x5a; n],
            ..legacy.clone()
        };
        let st = deliver(&rh, &rx, &b);
        assert!(st == 400 || st == 403, "{n}: {st}");
    }
}

#[test]
fn a_stepped_clock_does_not_stop_replication_for_good() {
    let ((sh, mut sender), (rh, mut rx)) = pair(r#","window_s":5"#);
    let b1 = send_one(&sh, &mut sender, "step-1");
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    assert_eq!(deliver(&rh, &rx, &b1), 204);
    // The receiver's clock steps back an hour: the sender's batches look like the future and
    // are refused (counted), not applied.
    let b2 = send_one(&sh, &mut sender, "step-2");
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos - 3_600_000 * MS;
    assert_eq!(deliver(&rh, &rx, &b2), 403);
    assert_eq!(counter(&rh, &mut rx, "batches_stale"), 1);
    // NTP steps it back into agreement: the sender's sequence has gone on, its batches are
    // fresh again and accepted.
    for i in 0..5 {
        let b = send_one(&sh, &mut sender, &format!("step-3-{i}"));
        rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
        assert_eq!(deliver(&rh, &rx, &b), 204, "batch {i} after the step");
    }
}

/// A sender that restarts (a new Envoy, the same replica) is a new sender to its peers: its
/// first batches are accepted, not counted as replays of the old process's, and the old
/// process's batches are still refused when replayed.
#[test]
fn a_restarted_sender_is_a_new_sender_not_a_replay() {
    let ((sh, mut sender), (rh, mut rx)) = pair("");
    let b1 = send_one(&sh, &mut sender, "before-restart");
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    assert_eq!(deliver(&rh, &rx, &b1), 204);
    // The same replica, restarted a second later: a fresh process (empty shared data).
    let restarted = FakeHost::new();
    {
        let mut s = restarted.state.borrow_mut();
        s.plugin_config = config("").into_bytes();
        s.now_nanos = sh.state.borrow().now_nanos + 1_000 * MS;
    }
    let mut again = Root::new();
    assert!(again.on_configure(&restarted, config("").len()));
    for i in 0..3 {
        let b = send_one(&restarted, &mut again, &format!("after-restart-{i}"));
        rh.state.borrow_mut().now_nanos = restarted.state.borrow().now_nanos;
        assert_eq!(deliver(&rh, &rx, &b), 204, "batch {i} after the restart");
    }
    assert_eq!(
        deliver(&rh, &rx, &b1),
        403,
        "the old batch is still a replay"
    );
    assert_eq!(counter(&rh, &mut rx, "batches_replayed"), 1);
}

/// A receiver that restarts (a new Envoy: its sender table is gone) does not take a batch it
/// accepted before the restart a second time: batches sent before it started are refused as
/// stale (issue 36 #9e). The sender's batches after the restart are accepted.
#[test]
fn a_restarted_receiver_refuses_batches_from_before_its_start() {
    let ((sh, mut sender), (rh, rx)) = pair("");
    let b1 = send_one(&sh, &mut sender, "before-receiver-restart");
    rh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    assert_eq!(deliver(&rh, &rx, &b1), 204);
    // The receiving replica restarts a second later: a fresh process, empty shared data.
    let fresh = FakeHost::new();
    {
        let mut s = fresh.state.borrow_mut();
        s.plugin_config = listener_config("").into_bytes();
        s.now_nanos = sh.state.borrow().now_nanos + 1_000 * MS;
    }
    let mut again = Root::new();
    assert!(again.on_configure(&fresh, listener_config("").len()));
    assert_eq!(
        deliver(&fresh, &again, &b1),
        403,
        "replayed into the restarted receiver"
    );
    assert_eq!(
        fresh
            .state
            .borrow()
            .reply_details
            .last()
            .map(String::as_str),
        Some("prefix_router_peer_stale")
    );
    sh.state.borrow_mut().now_nanos = fresh.state.borrow().now_nanos + 100 * MS;
    let b2 = send_one(&sh, &mut sender, "after-receiver-restart");
    fresh.state.borrow_mut().now_nanos = sh.state.borrow().now_nanos;
    assert_eq!(deliver(&fresh, &again, &b2), 204);
    assert_eq!(counter(&fresh, &mut again, "batches_replayed"), 0);
}
