"""prkit.fake_workers: what a fake worker's load endpoint reports while requests are in flight."""

from __future__ import annotations

import http.client
import json
import threading

from prkit.client import Client
from prkit.fake_workers import Worker
from prkit.wait import wait_until


def running(w: Worker) -> int:
    """`num_running_reqs` of the worker's `/v1/loads`, asked as the filter's poller asks it (Host:
    the worker's name, which prkit.client.Client, sending its own Host, cannot set)."""
    c = http.client.HTTPConnection("127.0.0.1", w.port, timeout=10)
    try:
        c.request("GET", "/v1/loads", headers={"Host": w.name})
        return json.loads(c.getresponse().read())["loads"][0]["num_running_reqs"]
    finally:
        c.close()


def send(w: Worker, method: str, path: str, body: bytes | None = None) -> None:
    c = Client(w.port)
    try:
        c.request(method, path, body)
    finally:
        c.close()


def test_a_health_check_in_flight_is_not_a_running_request():
    w = Worker("w0")
    try:
        w.hold()
        health = threading.Thread(target=send, args=(w, "GET", "/health"))
        health.start()
        wait_until(lambda: w.stats.count == 1, "the health check reached the worker")
        assert running(w) == 0
        post = threading.Thread(target=send, args=(w, "POST", "/v1/completions", b'{"prompt": "x"}'))
        post.start()
        wait_until(lambda: w.stats.count == 2, "the completion reached the worker")
        assert running(w) == 1
        w.release()
        health.join(timeout=30)
        post.join(timeout=30)
        wait_until(lambda: running(w) == 0, "both answered")
    finally:
        w.release()
        w.close()
