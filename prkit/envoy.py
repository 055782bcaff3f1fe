"""One Envoy process: start, readiness, admin, stats, logs, hot restart.

Base ids: Envoy derives its shared-memory and hot-restart socket names from `--base-id`, so two
Envoys on one machine (parallel test sessions included) must not share one. Every epoch-0 Envoy
here runs with `--use-dynamic-base-id`: Envoy itself takes an id no live Envoy holds (the kernel
arbitrates the socket bind) and writes it to `--base-id-path`; a hot restart (`hot_restart()`,
epoch n + 1) reads it from there and passes the same `--base-id`. No id scheme to collide.

Metrics: the filter batches metric increments per VM and flushes them on its 200 ms tick, so
`stats()` waits one flush period first; `stats_now()` does not (callers poll with a deadline).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from .build import envoy_binary
from .paths import REPO_ROOT
from .procfs import rss_kib
from .prom import SHARED_LOAD, inflight_and_shared_load, inflight_gauges, parse_prometheus, vm_reloads
from .wait import poll, wait_until

# The filter's metric flush period (tick) plus margin.
METRICS_FLUSH_S = 0.3


class Envoy:
    """A real Envoy serving `config_text` (written to `workdir`); its log goes next to it."""

    def __init__(self, config_text: str, *, listener_port: int, admin_port: int, workdir: Path,
                 concurrency: int = 2, epoch: int = 0, base_id: int | None = None, name: str = "envoy",
                 log_level: str = "info", drain_time_s: float = 1, parent_shutdown_s: float = 2,
                 extra_args: list[str] | None = None, prefix_cmd: list[str] | None = None,
                 env: dict | None = None):
        if epoch and base_id is None:
            raise ValueError("a hot restart (epoch > 0) needs the parent's base_id")
        self.listener_port = listener_port
        self.admin_port = admin_port
        self.workdir = Path(workdir)
        self.concurrency = concurrency  # Envoy worker threads (--concurrency)
        self.epoch = epoch
        self.base_id = base_id
        self.log_level = log_level
        self.drain_time_s = drain_time_s
        self.parent_shutdown_s = parent_shutdown_s
        self.extra_args = list(extra_args or [])
        # run through e.g. ["taskset", "-c", "0"] (it must exec Envoy: the pid stays Envoy's)
        self.prefix_cmd = list(prefix_cmd or [])
        # added to this process's environment (e.g. ENVOY_DYNAMIC_MODULES_SEARCH_PATH)
        self.env = dict(env or {})
        stem = name if epoch == 0 else f"{name}-{epoch}"
        self.config_path = self.workdir / f"{stem}.yaml"
        self.config_path.write_text(config_text)
        self.log_path = self.workdir / f"{stem}.log"
        self.base_id_path = self.workdir / f"{stem}.base-id"
        self.proc: subprocess.Popen | None = None

    # -- process ------------------------------------------------------------------------------

    def launch(self) -> "Envoy":
        """Starts the process (not waiting for readiness). Starting again after stop() runs the
        same config in a fresh process (epoch 0: a fresh base id)."""
        args = [envoy_binary(), "-c", str(self.config_path), "--concurrency", str(self.concurrency),
                "--log-level", self.log_level, "--drain-time-s", str(self.drain_time_s),
                "--parent-shutdown-time-s", str(self.parent_shutdown_s), "--restart-epoch", str(self.epoch)]
        if self.epoch == 0:
            self.base_id_path.unlink(missing_ok=True)
            args += ["--use-dynamic-base-id", "--base-id-path", str(self.base_id_path)]
        else:
            args += ["--base-id", str(self.base_id)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.prefix_cmd + args + self.extra_args, cwd=REPO_ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env} if self.env else None)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> "Envoy":
        """Waits until the admin /ready says LIVE; raises with the log tail if Envoy exits first."""
        def ready():
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"envoy exited with {code} during start-up:\n{self.log_tail()}")
            try:
                status, body = self.admin_get("/ready", timeout=1.0)
            except OSError:
                return False
            return status == 200 and body.strip() == "LIVE"

        try:
            wait_until(ready, "envoy ready", timeout_s, 0.1)
        except AssertionError:
            raise RuntimeError(f"envoy not ready after {timeout_s}s:\n{self.log_tail()}") from None
        if self.epoch == 0:
            text = wait_until(lambda: self.base_id_path.is_file() and self.base_id_path.read_text().strip(),
                              f"{self.base_id_path} written", 10)
            self.base_id = int(text)
        return self

    def start(self, timeout_s: float = 60.0) -> "Envoy":
        self.launch()
        return self.wait_ready(timeout_s)

    def hot_restart(self, config_text: str, *, admin_port: int, timeout_s: float = 60.0, **kw) -> "Envoy":
        """Starts the next epoch (same base id) on a new config and waits until it is ready; this
        process then drains and exits by itself (--parent-shutdown-time-s)."""
        if self.base_id is None:
            raise RuntimeError("hot_restart before the parent was ready (no base id yet)")
        opts = dict(concurrency=self.concurrency, log_level=self.log_level, drain_time_s=self.drain_time_s,
                    parent_shutdown_s=self.parent_shutdown_s, extra_args=self.extra_args,
                    prefix_cmd=self.prefix_cmd)
        opts.update(kw)
        nxt = Envoy(config_text, listener_port=self.listener_port, admin_port=admin_port, workdir=self.workdir,
                    epoch=self.epoch + 1, base_id=self.base_id, **opts)
        return nxt.start(timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def rss_kib(self) -> int:
        """Resident memory of the Envoy process (VmRSS), 0 when it is gone."""
        try:
            return rss_kib(self.pid)
        except OSError:
            return 0

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    # -- admin and stats ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def admin_get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def prometheus_text(self) -> str:
        status, text = self.admin_get("/stats/prometheus")
        if status != 200:
            raise AssertionError(f"/stats/prometheus answered {status}: {text[:200]}")
        return text

    def stats_now(self) -> dict:
        """/stats/prometheus as {name: value} ({name{labels}: value} for labelled samples)."""
        return parse_prometheus(self.prometheus_text())

    def stats(self) -> dict:
        """stats_now() after one metric flush period: includes every request already answered."""
        time.sleep(METRICS_FLUSH_S)
        return self.stats_now()

    def counters(self, pattern: str) -> dict:
        """Envoy's own /stats (text form, no flush lag) whose name fully matches `pattern`."""
        status, text = self.admin_get("/stats")
        if status != 200:
            raise AssertionError(f"/stats answered {status}")
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if re.fullmatch(pattern, name) and value.strip().isdigit():
                out[name] = int(value)
        return out

    def host_health(self, cluster: str, address: str) -> str | None:
        """Health flags of one host of a cluster from /clusters ('healthy', '/failed_active_hc',
        ...), None when the cluster does not list that host."""
        status, text = self.admin_get("/clusters")
        if status != 200:
            raise AssertionError(f"/clusters answered {status}")
        for line in text.splitlines():
            if line.startswith(f"{cluster}::{address}::health_flags::"):
                return line.rsplit("::", 1)[1]
        return None

    def healthy_hosts(self, cluster: str) -> set[str]:
        """The addresses (`IP:PORT`) of the cluster's hosts that /clusters lists healthy."""
        _, text = self.admin_get("/clusters")
        out = set()
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags" and parts[3] == "healthy":
                out.add(parts[1])
        return out

    # -- logs ---------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 200) -> str:
        """The last lines of the log without the start-up banner: start-up warnings and errors are
        kept, then everything after the main dispatch loop started."""
        all_lines = self.log_text().splitlines()
        marker = next((i for i, line in enumerate(all_lines) if "starting main dispatch loop" in line), None)
        if marker is None:
            keep = all_lines
        else:
            keep = [x for x in all_lines[:marker] if re.search(r"\]\[(warning|error|critical)\]", x)]
            keep += all_lines[marker:]
        return "\n".join(keep[-lines:])

    def wasm_log_errors(self) -> list[str]:
        """The log's wasm error/critical lines."""
        return [x for x in self.log_text().splitlines()
                if "][wasm]" in x and ("][error]" in x or "][critical]" in x)]

    def wasm_errors(self) -> list[str]:
        """Wasm VM reloads (a trapped filter under FAIL_RELOAD) and wasm error/critical log lines."""
        bad = [f"{k}={v}" for k, v in vm_reloads(self.stats()).items() if v]
        return bad + self.wasm_log_errors()


def validate_config(config_text: str, workdir: Path, name: str = "config.yaml",
                    cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`envoy --mode validate` on `config_text` (written to workdir/name; relative paths in it
    resolve from `cwd`). Validation loads the .wasm and runs the filter's configuration check."""
    path = Path(workdir) / name
    path.write_text(config_text)
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def check_config(config_text: str, workdir: Path, name: str = "config.yaml", cwd: Path | None = None) -> None:
    """validate_config, which must pass: fails naming `name`, with Envoy's error lines."""
    r = validate_config(config_text, workdir, name, cwd)
    out = r.stdout + r.stderr
    if r.returncode == 0 and " OK" in out:
        return
    errors = [line for line in out.splitlines() if "][critical]" in line or "][error]" in line]
    raise AssertionError(f"envoy --mode validate failed for {name}:\n" + ("\n".join(errors) or out[-4000:]))


def wait_inflight_zero(envoy: Envoy, timeout_s: float = 30.0, shared_load: bool = False) -> dict:
    """Polls until every prefix_router_inflight_* gauge reads 0 (or the deadline); returns the last
    reading, for the caller to assert on and show. `shared_load`: the two shared-data load gauges
    (prom.SHARED_LOAD) too, which must then be present as well."""
    if shared_load:
        return poll(lambda: inflight_and_shared_load(envoy.stats()),
                    lambda g: all(k in g for k in SHARED_LOAD) and all(v == 0 for v in g.values()), timeout_s)
    return poll(lambda: inflight_gauges(envoy.stats()), lambda g: bool(g) and all(v == 0 for v in g.values()),
                timeout_s)
