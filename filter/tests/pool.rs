//! Pool models (`membership.rs`), natively over `host::FakeHost`: the workers are the healthy
//! hosts of one Envoy cluster, read from the admin `/clusters` answer by the poll lease holder
//! and applied by every VM; requests name the chosen host (and its fallbacks) in the
//! destination header; a host that leaves and comes back is not trusted with its old entries;
//! a request a fallback served credits that worker.

mod common;
use common::{
    answer, configured, request, request_header, respond, response_header, set_request,
    shared_load, step, ticks,
};
use prefix_router::config::Config;
use prefix_router::glue::{Root, Stream};
use prefix_router::host::FakeHost;
use prefix_router::served::SAMPLE_EVERY;

const POOL: &str = r#"{"models":{"m":{"pool":{"cluster":"m","load_cluster":"m_load","fallbacks":1}}},
    "debug_header":"x-debug","load_poll":{"metrics_interval_ms":0}}"#;
const DEST: &str = "x-gateway-destination-endpoint";

fn admin_answer(hosts: &[(&str, &str)]) -> String {
    let mut a = String::from("m::observability_name::m\nm_load::observability_name::m_load\n");
    for (addr, flags) in hosts {
        a.push_str(&format!(
            "m::{addr}::rq_total::0\nm::{addr}::health_flags::{flags}\nm::{addr}::weight::1\n"
        ));
    }
    a
}

/// Ticks `ms` in 50 ms steps; the admin read is answered with `hosts`, load polls with an idle
/// load; returns the load polls sent (upstream, destination header).
fn tick(h: &FakeHost, root: &mut Root, ms: u64, hosts: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut polls = Vec::new();
    for _ in 0..ms / 50 {
        for c in step(h, root) {
            let path = c.headers.iter().find(|(k, _)| k == ":path");
            if path.is_some_and(|(_, p)| p == "/clusters") {
                assert_eq!(c.upstream, "admin");
                answer(h, root, c.token, "200", admin_answer(hosts).as_bytes());
            } else {
                let dest = c.headers.iter().find(|(k, _)| k == DEST);
                polls.push((
                    c.upstream.clone(),
                    dest.map_or(String::new(), |d| d.1.clone()),
                ));
                let idle = br#"{"loads":[{"num_running_reqs":0,"num_waiting_reqs":0}]}"#;
                answer(h, root, c.token, "200", idle);
            }
        }
    }
    polls
}

/// A chat completion request's stream, its request callbacks run.
fn post(h: &FakeHost, root: &Root, body: &str) -> Stream {
    request(h, root, "POST", "/v1/chat/completions", &[], body).0
}

fn chat(user: &str) -> String {
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{user}"}}]}}"#)
}

fn long_chat(user: &str) -> String {
    chat(&format!("{user}: a prompt long enough for a few blocks. ").repeat(40))
}

/// Sends `body`, answers 200 from `served` (the chosen host when `None`), ends the stream;
/// returns (destination header, debug header).
fn served(h: &FakeHost, root: &Root, body: &str, served: Option<&str>) -> (String, String) {
    let mut s = post(h, root, body);
    let dest = request_header(h, DEST).unwrap_or_default();
    let first = dest.split(',').next().unwrap_or_default().to_string();
    respond(h, "200", Some(served.unwrap_or(&first)));
    s.on_response_headers(h);
    let debug = response_header(h, "x-debug").unwrap_or_default();
    s.on_done(h);
    (dest, debug)
}

#[test]
fn a_pool_routes_to_its_healthy_hosts_through_the_destination_header() {
    let (h, mut root) = configured(POOL);
    // No host known yet: the pool cluster's own fallback policy picks, nothing is named.
    let mut s = post(&h, &root, &chat("a"));
    assert_eq!(
        request_header(&h, "x-prefix-router-cluster").as_deref(),
        Some("m")
    );
    assert_eq!(request_header(&h, DEST), None);
    s.on_done(&h);

    let hosts = [
        ("10.0.0.1:30000", "healthy"),
        ("10.0.0.2:30000", "healthy"),
        ("10.0.0.3:30000", "/failed_active_hc"),
    ];
    let polls = tick(&h, &mut root, 2000, &hosts);
    // Load polls go through the load cluster, one per healthy host, naming it.
    assert!(polls.iter().all(|(u, _)| u == "m_load"), "{polls:?}");
    for a in ["10.0.0.1:30000", "10.0.0.2:30000"] {
        assert!(polls.iter().any(|(_, d)| d == a), "{a} never polled");
    }
    assert!(!polls.iter().any(|(_, d)| d.starts_with("10.0.0.3")));
    let mut seen = Vec::new();
    for i in 0..40 {
        let mut s = post(&h, &root, &chat(&i.to_string()));
        assert_eq!(
            request_header(&h, "x-prefix-router-cluster").as_deref(),
            Some("m")
        );
        let dest = request_header(&h, DEST).expect("a pool request names its host");
        let named: Vec<&str> = dest.split(',').collect();
        assert_eq!(named.len(), 2, "the chosen host and one fallback: {dest}");
        assert_ne!(named[0], named[1]);
        assert!(named
            .iter()
            .all(|a| *a == "10.0.0.1:30000" || *a == "10.0.0.2:30000"));
        seen.push(named[0].to_string());
        s.on_done(&h);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 2, "conversations spread over both hosts");
    assert_eq!(
        h.metric("prefix_router.membership.answers").map(|v| v > 0),
        Some(true)
    );

    // A client's own destination header never reaches Envoy.
    let (mut s, _) = request(
        &h,
        &root,
        "POST",
        "/v1/chat/completions",
        &[(DEST, "10.9.9.9:1")],
        &chat("spoof"),
    );
    let dest = request_header(&h, DEST).expect("ours");
    assert!(!dest.contains("10.9.9.9"), "{dest}");
    s.on_done(&h);
}

#[test]
fn a_conversation_keeps_its_host_and_a_host_that_left_and_came_back_loses_its_old_entries() {
    let (h, mut root) = configured(POOL);
    let both = [("10.0.0.1:30000", "healthy"), ("10.0.0.2:30000", "healthy")];
    tick(&h, &mut root, 2000, &both);
    let body = long_chat("conv");
    let (dest, _) = served(&h, &root, &body, None);
    let holder = dest.split(',').next().unwrap().to_string();
    let (dest, debug) = served(&h, &root, &body, None);
    assert!(dest.starts_with(&holder), "{dest} / {holder}");
    assert!(debug.contains("reason=prefix_hit"), "{debug}");

    // The holder leaves: the other host serves; the holder comes back (a restarted pod at the
    // same address): its entries from before it left are not trusted.
    let other = both.iter().find(|h| h.0 != holder).unwrap().0;
    tick(&h, &mut root, 2000, &[(other, "healthy")]);
    let mut s = post(&h, &root, &body);
    assert_eq!(request_header(&h, DEST).as_deref(), Some(other));
    s.on_done(&h);
    tick(&h, &mut root, 2000, &both);
    let mut s = post(&h, &root, &body);
    respond(&h, "200", None);
    s.on_response_headers(&h);
    let debug = response_header(&h, "x-debug").unwrap();
    assert!(
        !debug.contains("reason=prefix_hit") && !debug.contains("holder="),
        "the returned host was trusted with its old entries: {debug}"
    );
    s.on_done(&h);
    assert!(h.metric("prefix_router.membership.rebuilds").unwrap_or(0) >= 3);
}

/// Every worker's in-flight requests in shared data (all leases), by the given config.
fn loads(h: &FakeHost, cfg: &Config) -> Vec<u32> {
    shared_load(h, cfg, 0).0
}

#[test]
fn a_request_a_fallback_served_credits_the_fallback_with_its_load_and_records() {
    let cfg = r#"{"models":{"m":{"workers":[
        {"cluster":"w0","address":"10.0.0.1:30000"},
        {"cluster":"w1","address":"10.0.0.2:30000"}]}},
        "debug_header":"x-debug","load_poll":{"interval_ms":0,"metrics_interval_ms":0}}"#;
    let parsed = Config::from_json(cfg.as_bytes()).unwrap();
    let (h, mut root) = configured(cfg);
    let body = long_chat("fallback");
    let mut s = post(&h, &root, &body);
    let chosen = request_header(&h, "x-prefix-router-cluster").unwrap();
    let (ci, fi) = if chosen == "w0" { (0, 1) } else { (1, 0) };
    let fallback_addr = ["10.0.0.1:30000", "10.0.0.2:30000"][fi];
    respond(&h, "200", Some(fallback_addr));
    s.on_response_headers(&h);
    let debug = response_header(&h, "x-debug").unwrap();
    assert!(debug.starts_with(&format!("worker=w{fi};")), "{debug}");
    assert!(debug.ends_with(&format!("; chosen=w{ci}")), "{debug}");
    let l = loads(&h, &parsed);
    assert_eq!(
        (l[ci], l[fi]),
        (0, 1),
        "the request in flight is the fallback's"
    );
    s.on_done(&h);
    assert_eq!(loads(&h, &parsed), vec![0, 0]);
    // The prompt's records name the fallback: the next turn goes there, as a prefix hit.
    h.state.borrow_mut().upstream_address = None;
    let mut s = post(&h, &root, &body);
    assert_eq!(
        request_header(&h, "x-prefix-router-cluster").as_deref(),
        Some(["w0", "w1"][fi])
    );
    respond(&h, "200", None);
    s.on_response_headers(&h);
    assert!(response_header(&h, "x-debug")
        .unwrap()
        .contains("reason=prefix_hit"));
    s.on_done(&h);
    // Batched counters reach Envoy at the timer's next metrics flush.
    ticks(&h, &mut root, 200);
    assert_eq!(h.metric("prefix_router.served_by_fallback"), Some(1));
    // A follow-up goes to the holder and writes its new records at the decision; the other
    // host serves it: those records are taken back from the holder, and the answer records
    // the follow-up for the host that served, where its repeat then goes.
    let first = "fallback: a prompt long enough for a few blocks. ".repeat(40);
    let follow_up = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{first}"}},{{"role":"assistant","content":"{}"}},{{"role":"user","content":"and then?"}}]}}"#,
        "an answer of a few blocks. ".repeat(30)
    );
    let mut s = post(&h, &root, &follow_up);
    assert_eq!(
        request_header(&h, "x-prefix-router-cluster").as_deref(),
        Some(["w0", "w1"][fi])
    );
    respond(&h, "200", Some(["10.0.0.1:30000", "10.0.0.2:30000"][ci]));
    s.on_response_headers(&h);
    s.on_done(&h);
    ticks(&h, &mut root, 200);
    assert!(h.metric("prefix_router.index.retracted").unwrap_or(0) >= 1);
    h.state.borrow_mut().upstream_address = None;
    let mut s = post(&h, &root, &follow_up);
    assert_eq!(
        request_header(&h, "x-prefix-router-cluster").as_deref(),
        Some(["w0", "w1"][ci]),
        "the follow-up's records name the host that served it"
    );
    respond(&h, "200", None);
    s.on_response_headers(&h);
    s.on_done(&h);
}

#[test]
fn a_pool_learns_its_hosts_with_load_polls_off() {
    let cfg = POOL.replace(
        r#""metrics_interval_ms":0"#,
        r#""metrics_interval_ms":0,"interval_ms":0"#,
    );
    let (h, mut root) = configured(&cfg);
    let polls = tick(&h, &mut root, 2000, &[("10.0.0.1:30000", "healthy")]);
    assert!(polls.is_empty(), "no load polls: {polls:?}");
    let mut s = post(&h, &root, &chat("off"));
    assert_eq!(request_header(&h, DEST).as_deref(), Some("10.0.0.1:30000"));
    s.on_done(&h);
}

/// Two workers at one address (a test or bench fleet): the worker that answered from it is the
/// chosen one, never moved to the other.
#[test]
fn workers_sharing_an_address_keep_their_requests() {
    let cfg = r#"{"models":{"m":{"workers":[
        {"cluster":"w0","address":"10.0.0.1:30000"},
        {"cluster":"w1","address":"10.0.0.1:30000"}]}},
        "debug_header":"x-debug","load_poll":{"interval_ms":0,"metrics_interval_ms":0}}"#;
    let (h, root) = configured(cfg);
    for i in 0..8 {
        let mut s = post(&h, &root, &chat(&i.to_string()));
        let chosen = request_header(&h, "x-prefix-router-cluster").unwrap();
        respond(&h, "200", Some("10.0.0.1:30000"));
        s.on_response_headers(&h);
        let debug = response_header(&h, "x-debug").unwrap();
        assert!(
            debug.starts_with(&format!("worker={chosen};")) && !debug.contains("chosen="),
            "{debug}"
        );
        s.on_done(&h);
    }
}

/// Delivers a captured peer batch to `root`'s peer listener; returns the reply status and its
/// details.
fn deliver(h: &FakeHost, root: &Root, body: &[u8]) -> (u32, String) {
    let n = h.state.borrow().replies.len();
    set_request(h, "POST", "/prefix-router/v1/records", &[], body);
    let mut st = root.new_stream().expect("configured");
    st.on_request_headers(h, false);
    st.on_request_body(h, body.len(), true);
    st.on_done(h);
    let s = h.state.borrow();
    assert_eq!(s.replies.len(), n + 1, "the listener answers");
    (
        s.replies[n].0,
        s.reply_details.last().cloned().unwrap_or_default(),
    )
}

/// Index records reach the peers across membership changes: a rebuild keeps the VM's sender
/// and its sequence, so the peers never take the batches after it for replays (issue 36 #3).
#[test]
fn peer_batches_are_accepted_across_membership_changes() {
    let cfg = r#"{"models":{"m":{"pool":{"cluster":"m","load_cluster":"m_load","fallbacks":1}}},
        "debug_header":"x-debug","load_poll":{"metrics_interval_ms":0},
        "peers":{"clusters":["peer0"],"secret":"0123456789abcdef-peer","flush_ms":100}}"#;
    let (h, mut root) = configured(cfg);
    let listener = cfg.replacen('{', r#"{"peer_listener":true,"#, 1);
    let (rh, rx) = configured(&listener);
    let sets: [&[(&str, &str)]; 2] = [
        &[("10.0.0.1:30000", "healthy"), ("10.0.0.2:30000", "healthy")],
        &[("10.0.0.1:30000", "healthy")],
    ];
    let rebuilds = |h: &FakeHost| h.metric("prefix_router.membership.rebuilds").unwrap_or(0);
    for change in 0..10 {
        let before = rebuilds(&h);
        tick(&h, &mut root, 2000, sets[change % 2]);
        assert!(rebuilds(&h) > before, "change {change}: membership rebuilt");
        let seen = h.state.borrow().calls.len();
        served(&h, &root, &long_chat(&format!("turn {change}")), None);
        tick(&h, &mut root, 300, sets[change % 2]);
        let batches: Vec<Vec<u8>> = h.state.borrow().calls[seen..]
            .iter()
            .filter(|c| c.upstream == "peer0")
            .map(|c| c.body.clone().unwrap_or_default())
            .collect();
        assert!(!batches.is_empty(), "change {change}: a batch was sent");
        rh.state.borrow_mut().now_nanos = h.state.borrow().now_nanos;
        for b in batches {
            assert_eq!(
                deliver(&rh, &rx, &b),
                (204, String::new()),
                "change {change}"
            );
            // ... and the same batch again is still a replay.
            assert_eq!(deliver(&rh, &rx, &b).1, "prefix_router_peer_replay");
        }
    }
}

/// Conversations started before the first membership read (Envoy just started: the pool's own
/// load balancer picked their host) are recorded under the host that served, once membership
/// names it, so their next turn goes back to it (issue 36 #6). Also when membership arrives
/// while the first turn is still in flight.
#[test]
fn a_conversation_started_before_membership_keeps_its_host() {
    let (h, mut root) = configured(POOL);
    let both = [("10.0.0.1:30000", "healthy"), ("10.0.0.2:30000", "healthy")];
    let mut convs = Vec::new();
    for i in 0..8 {
        let host = both[i % 2].0;
        let body = long_chat(&format!("early {i}"));
        let (dest, _) = served(&h, &root, &body, Some(host));
        assert_eq!(dest, "", "unplaced: no host named yet");
        convs.push((body, host));
    }
    // One more whose answer comes after membership is known.
    let late = long_chat("in flight across the first read");
    let mut s = post(&h, &root, &late);
    assert_eq!(request_header(&h, DEST), None);
    tick(&h, &mut root, 2000, &both);
    respond(&h, "200", Some(both[1].0));
    s.on_response_headers(&h);
    s.on_done(&h);
    convs.push((late, both[1].0));
    for (i, (body, host)) in convs.into_iter().enumerate() {
        let (dest, debug) = served(&h, &root, &body, None);
        assert!(dest.starts_with(host), "{i}: {dest} / {host}");
        assert!(debug.contains("reason=prefix_hit"), "{i}: {debug}");
    }
}

/// A stream in flight across membership changes keeps counting in the shared load (load polls
/// off: nothing else would show it) until it ends: the replaced router's lease keeps beating
/// while its streams run (issue 36 #9b).
#[test]
fn a_long_stream_keeps_its_load_across_membership_changes() {
    let cfg = POOL.replace(
        r#""metrics_interval_ms":0"#,
        r#""metrics_interval_ms":0,"interval_ms":0"#,
    );
    let (h, mut root) = configured(&cfg);
    let two = [("10.0.0.1:30000", "healthy"), ("10.0.0.2:30000", "healthy")];
    let three = [two[0], two[1], ("10.0.0.3:30000", "healthy")];
    tick(&h, &mut root, 2000, &two);
    let mut s = post(&h, &root, &chat("long"));
    let load = |h: &FakeHost| h.metric("prefix_router.load.requests").unwrap_or(-1);
    tick(&h, &mut root, 500, &two);
    assert_eq!(load(&h), 1);
    let rebuilds = h.metric("prefix_router.membership.rebuilds").unwrap_or(0);
    for hosts in [&three[..], &two[..], &three[..]] {
        tick(&h, &mut root, 3000, hosts);
        assert_eq!(load(&h), 1, "the stream's load after a change");
    }
    assert!(h.metric("prefix_router.membership.rebuilds").unwrap_or(0) >= rebuilds + 3);
    s.on_done(&h);
    tick(&h, &mut root, 500, &three);
    assert_eq!(load(&h), 0, "released at its end");
}

/// Without the debug header a response that writes no index records reads the served address
/// only as the VM's sample (one in `served::SAMPLE_EVERY`) or for a worker seen falling back:
/// a worker whose traffic goes to a fallback is caught within a sample, then every response
/// of it is credited until it serves again.
#[test]
fn the_served_address_is_read_when_records_or_a_fallback_are_at_stake() {
    let cfg = r#"{"models":{"m":{"workers":[
        {"cluster":"w0","address":"10.0.0.1:30000"},
        {"cluster":"w1","address":"10.0.0.2:30000"}]}},
        "load_poll":{"interval_ms":0,"metrics_interval_ms":0}}"#;
    let (h, mut root) = configured(cfg);
    let body = long_chat("sampled");
    let addr = ["10.0.0.1:30000", "10.0.0.2:30000"];
    // One request served by its chosen worker or the other: (chosen, address reads made).
    let run = |by_other: bool| {
        let mut s = post(&h, &root, &body);
        let ci = usize::from(request_header(&h, "x-prefix-router-cluster").unwrap() == "w1");
        let before = h.state.borrow().address_reads;
        respond(&h, "200", Some(addr[ci ^ usize::from(by_other)]));
        s.on_response_headers(&h);
        s.on_done(&h);
        (ci, h.state.borrow().address_reads - before)
    };
    let every = u64::from(SAMPLE_EVERY);
    // The first response writes the prompt's records: read. Then prefix hits: samples only.
    let (first, read) = run(false);
    assert_eq!(read, 1, "a response that writes records reads");
    let reads: u64 = (1..4 * every).map(|_| run(false).1).sum();
    assert!(
        (3..=4).contains(&reads),
        "{reads} reads in {} hits",
        4 * every - 1
    );
    // The chosen worker's responses now come from the other: within one sample it is caught,
    // after that every response is read (and credited).
    let mut caught = None;
    for i in 0..every {
        let (ci, read) = run(true);
        assert_eq!(ci, first, "the prefix stays with its holder");
        if read == 1 {
            caught = Some(i);
            break;
        }
    }
    assert!(caught.is_some(), "no read in {every} fallbacks");
    for _ in 0..2 * every {
        assert_eq!(run(true).1, 1, "a worker in doubt is read every time");
    }
    // It serves again: one read clears the doubt, then samples only.
    assert_eq!(run(false).1, 1);
    let reads: u64 = (0..2 * every).map(|_| run(false).1).sum();
    assert!((1..=2).contains(&reads), "{reads}");
    ticks(&h, &mut root, 200);
    assert_eq!(
        h.metric("prefix_router.served_by_fallback"),
        Some(1 + 2 * every as i64)
    );
}
