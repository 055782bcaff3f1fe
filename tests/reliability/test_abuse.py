"""Abusive input at the edge, through the real Envoy + filter: oversize bodies get an OpenAI-style
JSON 413 (Envoy's own buffer-limit reply, rewritten by local_reply_config) in both the demo config
and envoy/gen's output; other methods on inference paths get Envoy's own 404 (outside the public
route: tests/integration/test_public_route.py) and never reach a worker. (Spoofed routing headers: tests/integration/test_headers.py; unknown models, reject
and default: tests/integration/test_config_variants.py and test_robustness.py.)
"""

from __future__ import annotations

import http.client
import json
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from prkit.stack import Stack

from .common import MODEL, chat_body, gen_stack, one_request, vm_failures

LIMIT = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def gen():
    s = gen_stack(Path(tempfile.mkdtemp(prefix="prefix-router-abuse-")), 2, ["--time-scale", "0"])
    yield s
    s.close()


def post_oversize(port: int, size: int) -> tuple[bytes, bytes]:
    """POSTs a `size`-byte JSON body while reading the reply concurrently (Envoy answers 413 as
    soon as its buffer limit is crossed and closes; a client that only reads after sending
    everything would lose the reply to the reset). Returns (head, body)."""
    filler = size - 64
    payload = (b'{"model":"llama","prompt":"' + b"x" * filler + b'"}')
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.settimeout(30)

    def send():
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(payload))
            view = memoryview(payload)
            for i in range(0, len(view), 1 << 16):
                s.sendall(view[i:i + (1 << 16)])
        except OSError:
            pass  # Envoy stopped reading: expected

    t = threading.Thread(target=send, daemon=True)
    t.start()
    resp = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            resp += chunk
            head, sep, body = resp.partition(b"\r\n\r\n")
            if sep:
                cl = [int(l.split(b":", 1)[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
                if cl and len(body) >= cl[0]:
                    break
    except OSError:
        pass
    finally:
        s.close()
        t.join(timeout=30)
    head, _, body = resp.partition(b"\r\n\r\n")
    return head, body


def check_413(head: bytes, body: bytes):
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)
    assert err["object"] == "error" and err["code"] == 413 and err["type"] == "BadRequestError", err
    assert "too large" in err["message"], err


def test_oversize_body_gets_json_413_generated_config(gen):
    head, body = post_oversize(gen.envoy.listener_port, LIMIT + (1 << 20))
    check_413(head, body)
    # and a normal request right after is fine; nothing charged, no VM failure
    r = one_request(gen.envoy.listener_port, chat_body(1, 1, False))
    assert r.ok, r
    assert not vm_failures(gen.envoy)


def test_oversize_body_gets_json_413_demo_config():
    s = Stack().start()
    try:
        head, body = post_oversize(s.envoy.listener_port, LIMIT + (1 << 20))
        check_413(head, body)
    finally:
        s.close()


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/chat/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/completions"),
     ("PATCH", "/v1/completions"), ("GET", "/generate"), ("DELETE", "/generate")],
)
def test_non_post_methods_on_inference_paths_never_reach_a_worker(gen, method, path):
    """Not in the public route (POST, and PUT for /generate, only): Envoy answers 404 itself, as
    JSON, counted in http.ingress_http.no_route; the client's routing header changes nothing."""
    body = chat_body(2, 2, False) if method != "GET" else None
    no_route = r"http\.ingress_http\.no_route"
    before = sum(gen.envoy.counters(no_route).values())

    c = http.client.HTTPConnection("127.0.0.1", gen.envoy.listener_port, timeout=30)
    try:
        c.request(method, path, body=json.dumps(body) if body else None,
                  headers={"content-type": "application/json", "x-prefix-router-cluster": "admin"})
        r = c.getresponse()
        data = r.read()
    finally:
        c.close()
    assert r.status == 404, (r.status, data[:200])
    assert json.loads(data)["code"] == 404, data[:200]
    assert r.getheader("x-worker-id") is None  # no worker answered
    assert sum(gen.envoy.counters(no_route).values()) == before + 1
    assert MODEL  # model name shared with the generated config
