"""Slow and memory-hungry clients, through the real Envoy + filter with configs
from envoy/gen: the filter holds every inference request until its body ends, so a client that
trickles its body (or its headers) would pin its buffered bytes for as long as it likes, and enough
of them would OOM-kill the replica with every generation it carries.

- `--request-timeout` / `--request-headers-timeout` (Envoy's HCM request_timeout and
  request_headers_timeout): a trickled body or header block is cut with a 408 and its buffer freed;
  a streamed answer longer than the timeout is not cut (the timer stops once the request is in).
- `--max-heap-mib` (the overload manager's fixed_heap monitor): at 95% of the heap new requests get
  503 and an HTTP/1 connection that sends more is closed, so held bodies stop growing; once they
  are gone requests are served again.

The tests wait for conditions with generous deadlines; timeouts are configured short (2 s) so the
conditions come quickly.
"""

from __future__ import annotations

import re
import socket
import tempfile
import time
from pathlib import Path

import pytest

from prkit.wait import wait_until

from .common import chat_body, gen_stack, one_request

REQUEST_TIMEOUT_S = 2.0
HEADERS_TIMEOUT_S = 1.0
DEADLINE_S = 30.0  # generous: the machine is shared


@pytest.fixture(scope="module")
def stack():
    # --decode-base-ms 100: a 40-token stream lasts ~4 s, longer than the request timeout
    s = gen_stack(Path(tempfile.mkdtemp(prefix="prefix-router-slow-")), 2,
                  ["--time-scale", "1", "--decode-base-ms", "100"], None,
                  "--request-timeout", f"{REQUEST_TIMEOUT_S:g}s",
                  "--request-headers-timeout", f"{HEADERS_TIMEOUT_S:g}s")
    yield s
    s.close()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    s.settimeout(0.05)
    return s


def _read_some(s: socket.socket) -> tuple[bytes, bool]:
    """What arrived without waiting (a short poll), and whether the peer closed."""
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out, True
            out += chunk
    except socket.timeout:
        return out, False
    except OSError:
        return out, True


def trickle(port: int, head: bytes, first: bytes, drip: bytes, interval_s: float = 0.25) -> dict:
    """Sends `head` + `first`, then one byte of `drip` every interval_s, reading all the while,
    until Envoy answers and closes, the drip is used up, or DEADLINE_S. Returns what happened."""
    s = _connect(port)
    start = time.monotonic()
    resp, closed, sent = b"", False, 0
    try:
        s.sendall(head + first)
        while not closed and sent < len(drip) and time.monotonic() - start < DEADLINE_S:
            got, closed = _read_some(s)
            resp += got
            if closed:
                break
            try:
                s.sendall(drip[sent:sent + 1])
                sent += 1
            except OSError:
                closed = True
                break
            time.sleep(interval_s)
        # the answer may still be on its way once sending failed
        end = time.monotonic() + 5
        while not closed and time.monotonic() < end:
            got, closed = _read_some(s)
            resp += got
    finally:
        s.close()
    return {"response": resp, "closed": closed, "dripped": sent, "elapsed": time.monotonic() - start}


def _post_head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def test_a_trickled_body_is_cut_by_request_timeout(stack):
    body = b'{"model":"llama","messages":[{"role":"user","content":"' + b"x" * 4000 + b'"}]}'
    # the first 1000 bytes at once, then one byte every 0.25 s: 3,000+ bytes would take > 12 min
    r = trickle(stack.envoy.listener_port, _post_head(len(body)), body[:1000], body[1000:])
    assert r["closed"], r
    assert r["response"].startswith(b"HTTP/1.1 408"), r["response"][:300]
    assert 1000 + r["dripped"] < len(body)  # cut while the body was still arriving
    print(f"trickled body: 408 after {r['elapsed']:.1f} s, {1000 + r['dripped']} of {len(body)} bytes sent")
    # Envoy's own count of requests it cut for request_timeout
    assert stack.envoy.counters(r"http\.ingress_http\.downstream_rq_timeout")["http.ingress_http.downstream_rq_timeout"] >= 1
    # and the replica still serves
    assert one_request(stack.envoy.listener_port, chat_body(1, 1, False)).ok


def test_trickled_headers_are_cut_by_request_headers_timeout(stack):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    r = trickle(stack.envoy.listener_port, head, b"x-slow: ", b"y" * 4000)
    assert r["closed"], r
    assert r["dripped"] < 4000  # closed while the headers were still arriving
    print(f"trickled headers: closed after {r['elapsed']:.1f} s ({r['response'][:12]!r})")
    # Envoy answers 408 (or only closes, if the reply cannot be framed): either way the stream is gone
    assert r["response"] == b"" or r["response"].startswith(b"HTTP/1.1 408"), r["response"][:300]
    assert stack.envoy.counters(r"http\.ingress_http\.downstream_rq_header_timeout")[
        "http.ingress_http.downstream_rq_header_timeout"] >= 1


def test_a_stream_longer_than_request_timeout_is_not_cut(stack):
    """request_timeout stops counting once the request is received: an SSE answer that streams
    for twice as long completes."""
    res = one_request(stack.envoy.listener_port, chat_body(2, 1, True, max_tokens=40), timeout=DEADLINE_S)
    assert res.ok, res
    # the precondition of this test: the stream really outlived the request timeout
    assert res.end - res.start > REQUEST_TIMEOUT_S, res


# ---- heap bound -------------------------------------------------------------------------------

HEAP_MIB = 64  # an Envoy with 1 worker thread and the filter reserves ~25 MiB at start
HELD_BODY = 15 << 20  # under the 16 MiB body limit


@pytest.fixture
def small_heap():
    s = gen_stack(Path(tempfile.mkdtemp(prefix="prefix-router-heap-")), 2, ["--time-scale", "0"], None,
                  "--max-heap-mib", str(HEAP_MIB), "--request-timeout", "120s")
    yield s
    s.close()


def _overload(envoy, name: str) -> int:
    key = f"overload.envoy.overload_actions.{name}.active"
    return envoy.counters(re.escape(key))[key]


def _overload_stats(envoy) -> dict:
    return envoy.counters(r"overload\..*")


def test_heap_pressure_sheds_new_requests_and_cuts_held_bodies(small_heap):
    envoy = small_heap.envoy
    port = envoy.listener_port
    assert one_request(port, chat_body(3, 1, False)).ok
    held = []
    try:
        # Bodies held unfinished (Content-Length one byte more than sent) until the heap crosses 95%
        # of HEAP_MIB: each pins HELD_BODY in Envoy's buffers while the filter waits for its end.
        for _ in range(8):
            if _overload(envoy, "stop_accepting_requests") == 1:
                break
            s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
            s.sendall(_post_head(HELD_BODY + 1))
            chunk = b"x" * (1 << 20)
            for _ in range(HELD_BODY >> 20):
                s.sendall(chunk)
            held.append(s)
            time.sleep(0.5)  # > refresh_interval: the monitor samples the heap
        wait_until(lambda: _overload(envoy, "stop_accepting_requests") == 1,
                   lambda: f"stop_accepting_requests active ({len(held)} bodies held): {_overload_stats(envoy)}",
                   DEADLINE_S, 0.2)
        print(f"heap: {len(held)} bodies of {HELD_BODY >> 20} MiB held until stop_accepting_requests "
              f"(pressure {_overload_stats(envoy).get('overload.envoy.resource_monitors.fixed_heap.pressure')}%)")
        # new requests are refused by Envoy itself, no worker sees them: an HTTP/1 request is
        # stopped at its first bytes by the load shed point (500, connection closed), before the
        # HTTP connection manager's stop_accepting_requests would answer 503 (what HTTP/2 gets)
        shed = one_request(port, chat_body(3, 2, False))
        assert shed.status in (500, 503) and not shed.served_by, shed
        # a held connection that sends one more byte is answered and closed (HTTP/1 load shed point)
        for s in held:
            s.settimeout(DEADLINE_S)
            try:
                s.sendall(b"x")
                resp = s.recv(65536)
            except OSError:
                resp = b""
            assert resp == b"" or not resp.startswith(b"HTTP/1.1 200"), resp[:200]
        wait_until(lambda: all(_closed(s) for s in held), "every held connection closed by Envoy", DEADLINE_S, 0.2)
    finally:
        for s in held:
            s.close()
    # the buffers are freed: the pressure falls and requests are served again
    wait_until(lambda: _overload(envoy, "stop_accepting_requests") == 0,
               lambda: f"stop_accepting_requests inactive: {_overload_stats(envoy)}", DEADLINE_S, 0.2)
    wait_until(lambda: one_request(port, chat_body(3, 3, False)).ok, "a request served after the shedding",
               DEADLINE_S, 0.5)
    assert envoy.counters(r"http\.ingress_http\.downstream_rq_overload_close")[
        "http.ingress_http.downstream_rq_overload_close"] >= 1


def _closed(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except socket.timeout:
        return False
    except OSError:
        return True


# --------------------------------------------------------------------------------------------
# The peer listener (issue 36 #9d): the same slow-client limits as the public listener, and a
# body buffer sized to the largest batch, not 4 MiB, so a peer (or anyone who reaches the port)
# cannot make Envoy buffer more than one batch before the filter checks its MAC.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peer_stack():
    import secrets
    from prkit.ports import free_port
    peer = free_port()
    s = gen_stack(Path(tempfile.mkdtemp(prefix="prefix-router-slow-peer-")), 1, [], None,
                  "--request-headers-timeout", f"{HEADERS_TIMEOUT_S:g}s",
                  "--peers", f"http://127.0.0.1:{peer}", "--peer-listen", f"127.0.0.1:{peer}",
                  "--peer-secret", secrets.token_hex(16), "--hash-key", secrets.token_hex(16))
    s.peer_port = peer
    yield s
    s.close()


def test_trickled_headers_are_cut_on_the_peer_listener(peer_stack):
    head = b"POST /prefix-router/v1/records HTTP/1.1\r\nHost: x\r\n"
    r = trickle(peer_stack.peer_port, head, b"x-slow: ", b"y" * 4000)
    assert r["closed"] and r["dripped"] < 4000, r
    # Within the headers timeout (1 s here) and a generous margin, not request_timeout (10 s).
    assert r["elapsed"] < HEADERS_TIMEOUT_S + 5, r
    print(f"peer listener, trickled headers: closed after {r['elapsed']:.1f} s")


def test_a_body_larger_than_a_peer_batch_is_refused_before_it_is_buffered(peer_stack):
    from prkit.client import Client
    # The largest batch (peers.max_batch 4096 records of 16 bytes, header and MAC) is ~64 KiB.
    body = b"\0" * (512 * 1024)
    c = Client(peer_stack.peer_port)
    try:
        r = c.request("POST", "/prefix-router/v1/records", body, {"content-type": "application/octet-stream"})
    finally:
        c.close()
    assert r.status == 413, (r.status, r.body[:200])


def test_the_peer_listener_caps_http2_streams_per_connection():
    from prkit import envoy_config as ec
    doc = ec.config(ec.options_from_args([
        "--model", "m=127.0.0.1:1", "--listen", "127.0.0.1:1", "--admin", "127.0.0.1:2",
        "--stats-listen", "none", "--hash-key", "k" * 32, "--peers", "http://127.0.0.1:3",
        "--peer-listen", "127.0.0.1:3", "--peer-secret", "s" * 32, "--wasm", "/x.wasm"]))
    (peers,) = [x for x in doc["static_resources"]["listeners"] if x["name"] == "peers"]
    hcm = peers["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm.get("http2_protocol_options", {}).get("max_concurrent_streams", 0) > 0, hcm.keys()
    assert hcm.get("request_headers_timeout"), hcm.keys()
    assert peers["per_connection_buffer_limit_bytes"] < 1024 * 1024
