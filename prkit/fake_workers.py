"""Fake LLM workers for tests: HTTP servers that answer like SGLang enough for the filter (JSON
naming the worker, SSE streams, the load endpoints the poller reads, /metrics) and record what
they received (every request, concurrency, aborted streams); knobs make one slow, held, loaded or
broken. `WorkerPool`: a set of them by cluster name.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CLUSTER_HEADER = "x-prefix-router-cluster"
DEBUG_HEADER = "x-prefix-router-decision"
# A held request (Worker.hold) is answered after this long even if the test never releases it.
GATE_TIMEOUT_S = 120.0


@dataclass
class WorkerStats:
    count: int = 0
    inflight: int = 0
    max_inflight: int = 0
    aborted: int = 0  # streams the downstream side cut off
    polls: int = 0  # load-endpoint requests (the filter's poller), not in `count`
    metric_reads: int = 0  # /metrics reads (the index's self-check), not in `count`
    # Every request: (method, path, cluster header values seen, debug header seen, body length).
    requests: list = field(default_factory=list)


def _lenient_json(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None


class Worker:
    """One upstream 'LLM worker': answers 200 JSON naming itself, counts requests and concurrency."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0):
        self.name = name
        self.host = host
        self.delay_s = 0.0
        # Requests this worker reports on its load endpoints beyond its own in-flight ones
        # (traffic that bypasses Envoy, or other replicas').
        self.extra_load = 0
        # Prompt tokens waiting for prefill that this worker reports
        # (`num_waiting_uncached_tokens`), and its `max_running_requests` (0: not reported, as
        # an older SGLang).
        self.waiting_tokens = 0
        self.capacity = 0
        # An older SGLang: `/v1/loads` answers 404 (the poller falls back to `/get_load`, which
        # reports no capacity), and `capacity` is reported by `/get_server_info` instead.
        self.old_api = False
        self.server_info_reads = 0
        # Status of the load endpoints' answers: anything but 200 answers that status with an
        # empty JSON error (a worker whose load endpoint is broken while it still serves).
        self.load_status = 200
        # Seconds the load endpoints take to answer (a worker too busy to answer its poll in time).
        self.load_delay_s = 0.0
        # While set (hold()), requests wait for it to be released before answering (and streams
        # with "x_hold_after": n wait after their n-th event): a test sees them in flight for as
        # long as it needs, however slow the machine.
        self.gate: threading.Event | None = None
        self.lock = threading.Lock()
        self.stats = WorkerStats()
        self.conns: set = set()  # open (keep-alive) connections, closed by close()
        self.server = None
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive towards Envoy

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                with worker.lock:
                    worker.conns.add(self.connection)

            def finish(self):
                with worker.lock:
                    worker.conns.discard(self.connection)
                super().finish()

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _reply(self, status: int, content_type: str, payload: bytes):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _route(self) -> str:
                """The request's path without its query."""
                return self.path.split("?")[0]

            def _loads(self) -> bool:
                """SGLang's load endpoints as the filter's poller asks them (authority = the worker's
                cluster name): answered with the worker's load and not counted as client traffic."""
                path = self._route()
                poll = self.headers.get("Host") == worker.name
                if self.command == "GET" and path == "/metrics" and poll:
                    # The index's self-check reads SGLang's token counters; this worker has no
                    # cache, so it reports none reused (constant: no window ever closes).
                    with worker.lock:
                        worker.stats.metric_reads += 1
                    payload = b"sglang:prompt_tokens_total 0.0\nsglang:cached_tokens_total 0.0\n"
                    self._reply(200, "text/plain", payload)
                    return True
                if self.command == "GET" and path in ("/get_server_info", "/server_info") and poll:
                    with worker.lock:
                        worker.server_info_reads += 1
                        info = {"model_path": "fake", "max_total_num_tokens": 100000,
                                "max_running_requests": worker.capacity or None}
                    payload = json.dumps(info).encode()
                    self._reply(200, "application/json", payload)
                    return True
                if self.command != "GET" or path not in ("/v1/loads", "/get_load") or not poll:
                    return False
                if path == "/v1/loads" and worker.old_api:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return True
                with worker.lock:
                    worker.stats.polls += 1
                    running = worker.stats.inflight + worker.extra_load
                    waiting_tokens, capacity = worker.waiting_tokens, worker.capacity
                    status = worker.load_status
                    delay = worker.load_delay_s
                if delay:
                    time.sleep(delay)
                if status != 200:
                    payload = json.dumps({"error": "load endpoint failed"}).encode()
                    self._reply(status, "application/json", payload)
                    return True
                if path == "/v1/loads":
                    rank = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                            "num_waiting_uncached_tokens": waiting_tokens}
                    if capacity:
                        rank["max_running_requests"] = capacity
                    payload = json.dumps({"loads": [rank]}).encode()
                else:
                    payload = json.dumps([{"dp_rank": 0, "num_reqs": running, "num_waiting_reqs": 0,
                                           "num_tokens": 0}]).encode()
                self._reply(200, "application/json", payload)
                return True

            def _handle(self):
                body = self._read_body()
                if self._loads():
                    return
                # Envoy's active health checks are not requests the worker runs: SGLang's load
                # endpoints leave them out, and so does the in-flight count they report here (a
                # poll that met a health check would otherwise show a busy worker).
                running = int(not (self.command == "GET" and self._route() == "/health"))
                with worker.lock:
                    worker.stats.count += 1
                    worker.stats.inflight += running
                    worker.stats.max_inflight = max(worker.stats.max_inflight, worker.stats.inflight)
                    worker.stats.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "cluster_header": self.headers.get_all(CLUSTER_HEADER) or [],
                            "debug_header": self.headers.get_all(DEBUG_HEADER) or [],
                            "body_len": len(body),
                            "body": body,
                        }
                    )
                try:
                    if worker.delay_s:
                        time.sleep(worker.delay_s)
                    req = _lenient_json(body)
                    gate = worker.gate
                    held = isinstance(req, dict) and "x_hold_after" in req
                    if gate is not None and not held:
                        gate.wait(timeout=GATE_TIMEOUT_S)
                    if isinstance(req, dict) and req.get("stream") is True:
                        self._stream(req)
                        return
                    payload = json.dumps(
                        {
                            "worker": worker.name,
                            "method": self.command,
                            "path": self.path,
                            "body_len": len(body),
                            "cluster_header": self.headers.get_all(CLUSTER_HEADER) or [],
                        }
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.send_header("x-worker-id", worker.name)
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                finally:
                    with worker.lock:
                        worker.stats.inflight -= running

            def _stream(self, req: dict):
                """SSE like an LLM server: headers, then `x_events` events `x_interval` s apart."""
                n = int(req.get("x_events", 5))
                hold_after = req.get("x_hold_after")
                gap = float(req.get("x_interval", 0.05))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("x-worker-id", worker.name)
                self.end_headers()
                try:
                    for i in range(n + 1):
                        data = "[DONE]" if i == n else json.dumps({"worker": worker.name, "i": i})
                        frame = f"data: {data}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                        self.wfile.flush()
                        gate = worker.gate
                        if gate is not None and hold_after is not None and i + 1 == int(hold_after):
                            gate.wait(timeout=GATE_TIMEOUT_S)
                        if i < n:
                            time.sleep(gap)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    with worker.lock:
                        worker.stats.aborted += 1
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256

        self._classes = (Server, Handler)
        self._serve(port)

    def _serve(self, port: int):
        Server, Handler = self._classes
        self.server = Server((self.host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"worker-{self.name}", daemon=True)
        self.thread.start()

    def hold(self):
        """Requests from now on wait until release() (see `gate`)."""
        self.gate = threading.Event()

    def release(self):
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.set()

    def restart(self):
        """Serve again on the same port (after close())."""
        self._serve(self.port)

    def reset(self):
        with self.lock:
            self.stats = WorkerStats()

    def close(self):
        """Stop like a dead process: no listener, and every open connection is cut."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        with self.lock:
            conns, self.conns = list(self.conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class WorkerPool:
    def __init__(self, names):
        self.workers = {n: Worker(n) for n in names}

    @property
    def ports(self) -> dict:
        return {n: w.port for n, w in self.workers.items()}

    def set_delay(self, seconds: float):
        for w in self.workers.values():
            w.delay_s = seconds

    def hold(self):
        for w in self.workers.values():
            w.hold()

    def release(self):
        for w in self.workers.values():
            w.release()

    def reset(self):
        for w in self.workers.values():
            w.reset()
            w.release()
        self.set_delay(0.0)

    def counts(self) -> dict:
        return {n: w.stats.count for n, w in self.workers.items()}

    def max_inflight(self) -> dict:
        return {n: w.stats.max_inflight for n, w in self.workers.items()}

    def all_requests(self):
        for n, w in self.workers.items():
            with w.lock:
                reqs = list(w.stats.requests)
            for r in reqs:
                yield n, r

    def restart(self, name: str):
        self.workers[name].restart()

    def close(self):
        for w in self.workers.values():
            w.close()
