"""Streaming responses, aborted streams and dead workers: responses are not buffered and the
filter's in-flight accounting is released exactly once whatever way a stream ends."""

from __future__ import annotations

import http.client
import json
import socket

from prkit.prom import inflight_requests
from prkit.wait import poll

from . import workload as wl
from prkit.envoy import wait_inflight_zero

MODEL = "llama"


def test_sse_stream_is_forwarded_incrementally(env):
    """The worker sends the first event, then holds the rest of the stream until the test lets it
    go: the client reading that first event proves Envoy + filter forward events as they come
    (a buffered response would only arrive after the release)."""
    events = 10
    body = {"model": MODEL, "messages": [{"role": "user", "content": wl.text(wl.rng("sse"), 2000)}],
            "stream": True, "x_events": events, "x_interval": 0.01, "x_hold_after": 1}
    env.pool.hold()
    conn = http.client.HTTPConnection("127.0.0.1", env.envoy.listener_port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        assert r.getheader("content-type") == "text/event-stream"
        first = r.readline()  # arrives while the worker holds the rest of the stream
        assert first.startswith(b"data: "), first
        # Mid-stream, the filter counts the request as in flight on its worker.
        seen = poll(lambda: inflight_requests(env.envoy.stats_now()), lambda n: n == 1, timeout_s=30)
        assert seen == 1, seen
        env.pool.release()
        rest = r.read()
    finally:
        env.pool.release()
        conn.close()
    frames = [line for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert len(frames) == events + 1 and frames[-1] == b"data: [DONE]", frames[-3:]
    gauges = wait_inflight_zero(env.envoy)
    assert all(v == 0 for v in gauges.values()), gauges


def test_client_abort_mid_stream_releases_load(env):
    body = {"model": MODEL, "prompt": wl.text(wl.rng("abort"), 2000), "stream": True,
            "x_events": 40, "x_interval": 0.1}
    payload = json.dumps(body).encode()
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", env.envoy.listener_port), timeout=10)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        assert b" 200 " in got.split(b"\r\n", 1)[0], got[:200]
        s.close()  # abort while the worker is still streaming
    gauges = wait_inflight_zero(env.envoy)
    assert gauges and all(v == 0 for v in gauges.values()), gauges


def test_dead_worker_gives_503_and_releases_load(env, client):
    """A worker that refuses connections: Envoy answers 503 for requests routed to it and the
    filter still releases their load (no retries are configured; routing stays deterministic)."""
    env.pool.workers["w2"].close()
    try:
        r = wl.rng("dead")
        statuses = []
        for _ in range(24):
            rep = client.post("/v1/completions", {"model": MODEL, "prompt": wl.text(r, 1000)})
            statuses.append((rep.status, rep.decision.get("worker")))
        assert all(st == 200 for st, w in statuses if w != "w2"), statuses
        assert all(st == 503 for st, w in statuses if w == "w2"), statuses
        assert any(w == "w2" for _, w in statuses), "no request was routed to w2; pick more prompts"
        gauges = wait_inflight_zero(env.envoy)
        assert all(v == 0 for v in gauges.values()), gauges
    finally:
        env.pool.restart("w2")
