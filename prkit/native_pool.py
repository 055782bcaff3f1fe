"""A pool model on the native build in the real Envoy, its load balancer override_host (envoy/gen's
default) or the native module (`--native-lb`, filter/src/native/lb/): fake workers as the hosts of
one EDS cluster, the filter's debug header on, Envoy's access log read back per request. Used by
tests/integration/test_native_lb.py and benches/lb-retry."""

from __future__ import annotations

import json
import random
import string
import uuid
from pathlib import Path

from . import envoy_config as ec
from .build import cargo_build
from .client import Client
from .eds import write_eds
from .envoy import Envoy
from .fake_workers import Worker
from .paths import target_dir
from .ports import free_port
from .wait import wait_until

MODEL = "m"
LB_STAT = "prefix_router.lb."
PATH = "/v1/chat/completions"


def prompt_text(r: random.Random, n: int) -> str:
    return "".join(r.choice(string.ascii_letters + "     .,") for _ in range(n))


def opening(system: str | None = None) -> list[dict]:
    """A new conversation: its own system prompt (or `system`, shared) and a user turn."""
    r = random.Random(uuid.uuid4().hex)
    return [{"role": "system", "content": system or f"{uuid.uuid4().hex} " + prompt_text(r, 2000)},
            {"role": "user", "content": prompt_text(r, 200)}]


def next_turn(msgs: list[dict]) -> list[dict]:
    r = random.Random(len(msgs))
    return msgs + [{"role": "assistant", "content": prompt_text(r, 100)},
                   {"role": "user", "content": prompt_text(r, 100)}]


class NativePool:
    """`n` fake workers p0.. as one EDS pool behind the native filter (`--fallbacks`
    `fallbacks`), the pool's load balancer the native module (`native_lb`) or override_host.
    `membership_ms`: how often the filter reads the pool's healthy hosts from Envoy's admin;
    `health_interval`: Envoy's active health checks; `listed`: how many of the workers the EDS
    file lists at the start (all by default; `listen` changes it)."""

    def __init__(self, tmp: Path, native_lb: bool, *, n: int = 3, fallbacks: int = 1, membership_ms: int = 200,
                 health_interval: str = "1s", listed: int | None = None):
        cargo_build("prefix-router", release=True, features=["dynamic-module"])
        so = target_dir() / "release" / "libprefix_router.so"
        self.workers = [Worker(f"p{i}") for i in range(n)]
        self.addr = {f"127.0.0.1:{w.port}": w.name for w in self.workers}
        path = tmp / "eds" / "m.yaml"
        path.parent.mkdir(parents=True)
        self.eds, self.version = path, 0
        names = [w.name for w in self.workers][:listed]
        self.listen(names)
        listen, admin = free_port(), free_port()
        args = ["--model", f"{MODEL}=eds:{path}", "--listen", f"127.0.0.1:{listen}", "--admin",
                f"127.0.0.1:{admin}", "--stats-listen", "none", "--rate-limit", "0", "--hash-key", "k" * 32,
                "--native", "--membership-ms", str(membership_ms), "--health-interval", health_interval,
                "--debug-header", "--fallbacks", str(fallbacks)]
        text = ec.run_gen(*args, *(["--native-lb"] if native_lb else []))
        if ("envoy.load_balancing_policies.dynamic_modules" in text) != native_lb:
            raise AssertionError("envoy/gen --native-lb did not choose the pool's load balancer")
        self.envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=tmp,
                           env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(so.parent)}).start()
        self.client = Client(listen)
        wait_until(lambda: self.healthy() == set(names), lambda: f"healthy: {self.healthy()}", 30)
        # The filter names hosts once it has read the pool's membership (Envoy's admin).
        wait_until(lambda: "worker" in self.chat(opening())[1], "the filter naming pool hosts", 30, 0.1)

    def listen(self, names: list[str]):
        """The EDS file lists the workers `names` from now on (Envoy follows the rename)."""
        self.version += 1
        write_eds(self.eds, MODEL, [("127.0.0.1", w.port) for w in self.workers if w.name in names], self.version)

    def worker(self, name: str) -> Worker:
        return next(w for w in self.workers if w.name == name)

    def healthy(self) -> set[str]:
        """The pool's hosts Envoy's admin shows healthy."""
        return {self.addr.get(a, a) for a in self.envoy.healthy_hosts(MODEL)}

    def lb_stats(self) -> dict[str, int]:
        """The native LB's counters (`<namespace>.prefix_router.lb.<name>`) by name."""
        _, body = self.envoy.admin_get("/stats?filter=prefix_router\\.lb\\.")
        out = {}
        for line in body.splitlines():
            name, _, v = line.partition(": ")
            if LB_STAT in name and v.strip().isdigit():
                out[name.split(LB_STAT, 1)[1]] = int(v)
        return out

    def chat(self, msgs: list[dict], tag: str = "") -> tuple[str | None, dict, int]:
        """(the worker that served, the debug header with worker names, Envoy's attempts) of one
        chat turn; `tag` goes into the query string, to find the request in the access log."""
        path = PATH + (f"?t={tag}" if tag else "")
        rep = self.client.post(path, {"model": MODEL, "messages": msgs, "max_tokens": 4})
        if rep.status != 200:
            raise AssertionError(f"status {rep.status}: {rep.body[:300]!r}")
        d = {k: self.addr.get(v, v) if isinstance(v, str) else v for k, v in rep.decision.items()}
        attempts = int((rep.headers.get("x-envoy-attempt-count") or ["1"])[0])
        return rep.worker, d, attempts

    def listed(self, tag: str) -> list[str]:
        """The hosts the filter listed (the destination header, in order) for the request tagged
        `tag`, from Envoy's access log (written within its 1 s flush)."""
        want = f"{PATH}?t={tag}"

        def find():
            for line in self.envoy.log_text().splitlines():
                if line.startswith("{") and want in line:
                    rec = json.loads(line)
                    if rec.get("path") == want:
                        return ([self.addr.get(a, a) for a in (rec.get("destination") or "").split(",") if a],)
            return None

        return wait_until(find, f"the access log line of {want}", 10, 0.1)[0]

    def close(self):
        self.envoy.stop()
        for w in self.workers:
            w.close()
