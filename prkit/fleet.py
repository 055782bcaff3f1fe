"""Simulated SGLang workers (`sglang-sim`): one process (`SimWorker`), a fleet (`SimFleet`), and
the `scripts/fleet` command line (`python -m prkit.fleet start|stop|status`).

A worker runs in its own session (signals to the test process do not reach it), logs to
`<workdir>/<name>.log` (appended across restarts) and is up when GET /health answers 200.
`stop()` is SIGTERM (the simulator drains its running requests and exits 0) with SIGKILL after a
deadline; `kill()` is a crash (SIGKILL: connections reset, the port refuses).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from .build import sim_binary
from .ports import free_port
from .prom import sum_by_name
from .wait import Timeout, http_ok, wait_until


class SimWorker:
    def __init__(self, name: str, args: list[str] | None = None, *, port: int | None = None,
                 model: str | None = "llama", workdir: Path | None = None, host: str = "127.0.0.1"):
        self.name = name
        self.args = list(args or [])
        self.port = port if port is not None else free_port()
        self.model = model
        self.host = host
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"sglang-sim-{name}-"))
        self.log_path = self.workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    base = url

    def command(self) -> list[str]:
        cmd = [str(sim_binary()), "--host", self.host, "--port", str(self.port), "--worker-id", self.name]
        if self.model is not None:
            cmd += ["--model", self.model]
        return cmd + self.args

    def launch(self) -> "SimWorker":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def healthy(self) -> bool:
        return http_ok(self.url + "/health")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 30.0) -> "SimWorker":
        def up():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"sglang-sim {self.name} exited during start-up:\n{self.log_tail()}")
            return self.healthy()

        try:
            wait_until(up, f"sglang-sim {self.name} healthy", timeout_s, 0.05)
        except AssertionError:
            raise RuntimeError(f"sglang-sim {self.name} not healthy in {timeout_s}s:\n{self.log_tail()}") from None
        return self

    def start(self, timeout_s: float = 30.0) -> "SimWorker":
        return self.launch().wait_healthy(timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (drain, exit 0), SIGKILL after `timeout_s`; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """sglang:* and other samples summed over labels, per metric name."""
        return sum_by_name(self.metrics_text())


class SimFleet:
    """N workers w0..w(N-1) (or the given names) on free loopback ports. `models`: one model for
    all, or one per worker (disjoint worker sets for several models); `per_worker`: extra flags."""

    def __init__(self, n_or_names, workdir: Path | None = None, args: list[str] | None = None, *,
                 models: str | list[str] = "llama", per_worker: dict | None = None):
        self.names = [f"w{i}" for i in range(n_or_names)] if isinstance(n_or_names, int) else list(n_or_names)
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="sglang-sim-fleet-"))
        per_worker = per_worker or {}
        self.models = {n: (models if isinstance(models, str) else models[i]) for i, n in enumerate(self.names)}
        self.workers = {n: SimWorker(n, [*(args or []), *per_worker.get(n, [])], model=self.models[n],
                                     workdir=self.workdir) for n in self.names}

    @property
    def ports(self) -> dict[str, int]:
        return {n: w.port for n, w in self.workers.items()}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {n: w.proc for n, w in self.workers.items() if w.proc is not None}

    def url(self, name: str) -> str:
        return self.workers[name].url

    def start(self, name: str | None = None, timeout_s: float = 30.0) -> "SimFleet":
        """Starts every worker (all launched, then waited for) or the one named."""
        ws = [self.workers[name]] if name else list(self.workers.values())
        try:
            for w in ws:
                w.launch()
            for w in ws:
                w.wait_healthy(timeout_s)
        except Exception:
            if name is None:
                self.stop()
            raise
        return self

    def healthy(self, name: str) -> bool:
        return self.workers[name].healthy()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.workers[name].kill(sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        live = [w for w in self.workers.values() if w.alive()]
        for w in live:
            w.proc.send_signal(signal.SIGTERM)
        for w in live:
            w.stop(timeout_s)

    def metrics(self) -> dict[str, dict[str, float]]:
        return {n: w.metrics() for n, w in self.workers.items()}


# --------------------------------------------------------------------------------------------
# scripts/fleet: detached workers that outlive this process, tracked in a state directory
# --------------------------------------------------------------------------------------------

USAGE = """\
Start / stop a fleet of simulated SGLang workers (sglang-sim) on consecutive ports.

  scripts/fleet start N BASE_PORT [extra sglang-sim args...]
      starts workers w0..w(N-1) on BASE_PORT..BASE_PORT+N-1 (worker id = ${FLEET_WORKER_PREFIX:-w}<i>),
      writes "<pid> <port> <worker-id>" lines to $STATE/pids, logs to $STATE/<worker-id>.log,
      and waits until every worker answers GET /health with 200.
  scripts/fleet stop
      SIGTERM to every worker (graceful drain), waits up to ${FLEET_STOP_TIMEOUT:-30} s, then SIGKILL.
  scripts/fleet status
      prints each worker and whether it is alive.

Environment: FLEET_STATE_DIR (default /tmp/prefix-router-fleet-$UID), SGLANG_SIM_BIN (binary to
use; default: the release build, built fresh by cargo), FLEET_HOST (default 127.0.0.1),
FLEET_HEALTH_TIMEOUT (seconds, default 30).
"""


def _state_dir() -> Path:
    return Path(os.environ.get("FLEET_STATE_DIR") or f"/tmp/prefix-router-fleet-{os.getuid()}")


def _alive(pid: int) -> bool:
    """Running and not a zombie (an exited worker whose new parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _entries(state: Path) -> list[tuple[int, int, str]]:
    try:
        lines = (state / "pids").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), int(parts[1]), parts[2]))
    return out


def _status_code(host: str, port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError:
        return "000"


def cli_start(n: int, base: int, extra: list[str]) -> int:
    state, host = _state_dir(), os.environ.get("FLEET_HOST", "127.0.0.1")
    prefix = os.environ.get("FLEET_WORKER_PREFIX", "w")
    if n < 1:
        return _die("N must be a positive integer")
    if not 1 <= base or base + n - 1 > 65535:
        return _die("bad BASE_PORT")
    state.mkdir(parents=True, exist_ok=True)
    if any(_alive(pid) for pid, _, _ in _entries(state)):
        return _die(f"a fleet is already running (see {state}/pids); run: scripts/fleet stop")
    workers = [SimWorker(f"{prefix}{i}", extra, port=base + i, model=None, workdir=state, host=host)
               for i in range(n)]
    for w in workers:
        w.log_path.unlink(missing_ok=True)
    try:
        with open(state / "pids", "w") as f:
            for w in workers:
                w.launch()
                f.write(f"{w.proc.pid} {w.port} {w.name}\n")
        timeout = float(os.environ.get("FLEET_HEALTH_TIMEOUT", "30"))
        for w in workers:
            w.wait_healthy(timeout)
    except Exception as e:  # noqa: BLE001 - report, stop what started, fail
        print(f"fleet: {e}", file=sys.stderr)
        cli_stop(quiet=True)
        return 1
    print(f"fleet: {n} workers healthy on {host}:{base}..{base + n - 1} (state: {state}, "
          f"binary: {sim_binary()})")
    return 0


def cli_stop(quiet: bool = False) -> int:
    state = _state_dir()
    entries = _entries(state)
    if not entries:
        print("fleet: nothing to stop")
        return 0
    for pid, _, _ in entries:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
    timeout = float(os.environ.get("FLEET_STOP_TIMEOUT", "30"))
    try:
        wait_until(lambda: not any(_alive(pid) for pid, _, _ in entries), "workers stopped", timeout, 0.1)
    except Timeout:
        left = [pid for pid, _, _ in entries if _alive(pid)]
        print(f"fleet: {len(left)} worker(s) still running after {timeout:g} s, sending SIGKILL",
              file=sys.stderr)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    (state / "pids").unlink(missing_ok=True)
    if not quiet:
        print(f"fleet: stopped {len(entries)} worker(s)")
    return 0


def cli_status() -> int:
    entries = _entries(_state_dir())
    host = os.environ.get("FLEET_HOST", "127.0.0.1")
    if not entries:
        print("fleet: not running")
    for pid, port, name in entries:
        if _alive(pid):
            print(f"{name} port={port} pid={pid} health={_status_code(host, port)}")
        else:
            print(f"{name} port={port} pid={pid} dead")
    return 0


def _die(msg: str) -> int:
    print(f"fleet: {msg}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "start":
        if len(rest) < 2 or not rest[0].isdigit() or not rest[1].isdigit():
            print(USAGE, end="", file=sys.stderr)
            return 2
        return cli_start(int(rest[0]), int(rest[1]), rest[2:])
    if cmd == "stop":
        return cli_stop()
    if cmd == "status":
        return cli_status()
    print(USAGE, end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
