"""The public route through the real Envoy with the compiled filter, on configs `envoy/gen` writes
(static workers in the production and test shapes, an EDS pool): a client reaches the inference
API and the read-only paths it needs, nothing else. SGLang's admin endpoints (cache flush, weight
loading, profiling, ...) get Envoy's own 404, counted in `http.ingress_http.no_route`, and the
workers (fake workers recording every request) never see them; `--allow-path` opens one more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.client import Client
from prkit.eds import write_local_eds
from prkit.envoy import Envoy
from prkit.fake_workers import Worker
from prkit.ports import free_port
from prkit.wait import wait_until

# SGLang's HTTP server endpoints that change or inspect a worker's state (issue 36): none may be
# reachable through the client listener.
ADMIN_PATHS = [
    "/flush_cache", "/update_weights_from_disk", "/load_lora_adapter", "/unload_lora_adapter",
    "/abort_request", "/start_profile", "/stop_profile", "/release_memory_occupation",
    "/resume_memory_occupation", "/set_internal_state", "/configure_logging", "/pause_generation",
]
NO_ROUTE = "http.ingress_http.no_route"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4}
COMPLETION = {"model": "m", "prompt": "hello " * 40, "max_tokens": 4}
GENERATE = {"model": "m", "text": "hello " * 40, "sampling_params": {"max_new_tokens": 4}}
# What a client may do (PUBLIC_PATHS): each answered by a worker.
ALLOWED = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
           ("POST", "/generate", GENERATE), ("PUT", "/generate", GENERATE), ("GET", "/v1/models", None),
           ("GET", "/health", None), ("GET", "/v1/models?limit=1", None)]
# Near misses of the public paths: another method, case, suffix, a query smuggling a public path.
NEAR_MISSES = [("GET", "/v1/chat/completions"), ("POST", "/v1/models"), ("DELETE", "/generate"),
               ("POST", "/V1/chat/completions"), ("POST", "/v1/chat/completions/x"), ("GET", "/health_generate"),
               ("GET", "/get_model_info"), ("GET", "/get_server_info"), ("GET", "/metrics"),
               ("POST", "/flush_cache?/v1/chat/completions"), ("POST", "/flush%5Fcache"), ("GET", "/")]


class Fleet:
    """Two fake workers and a real Envoy on `envoy/gen ARGS` for them: `kind` static (one cluster
    per worker, production shape), test (the test profile's simple shape) or pool (an EDS pool)."""

    def __init__(self, tmp: Path, kind: str, extra: list[str] = ()):
        # named as their clusters: the filter's own load polls and /metrics reads (the test profile
        # polls through the worker clusters) are told apart from client requests by that name
        self.workers = [Worker("m_0"), Worker("m_1")]
        self.listen, self.admin = free_port(), free_port()
        ports = [w.port for w in self.workers]
        if kind == "pool":
            eds = tmp / "eds" / "m.yaml"
            eds.parent.mkdir()
            write_local_eds(eds, "m", ports, 1)
            model = f"m=eds:{eds}"
        else:
            model = "m=" + ",".join(f"127.0.0.1:{p}" for p in ports)
        args = ["--model", model, "--listen", f"127.0.0.1:{self.listen}", "--admin", f"127.0.0.1:{self.admin}",
                "--wasm", str(wasm_path()), "--debug-header", *extra]
        if kind == "test":
            args += ["--profile", "test"]
        else:
            args += ["--stats-listen", "none", "--rate-limit", "0", "--load-poll-ms", "0", "--hash-key", "k" * 32,
                     "--health-interval", "1s"]
        self.text = ec.run_gen(*args)
        self.envoy = Envoy(self.text, listener_port=self.listen, admin_port=self.admin, workdir=tmp,
                           concurrency=1).start()
        self.client = Client(self.listen)
        # every worker takes requests (a pool: after the filter's first membership read)
        wait_until(lambda: self.client.post("/v1/chat/completions", CHAT).status == 200, "a first chat answered", 30)

    def seen(self) -> list[tuple[str, str]]:
        """(method, path) of every request a worker received (health checks included)."""
        return [(r["method"], r["path"]) for w in self.workers for r in w.stats.requests]

    def no_route(self) -> int:
        return self.envoy.counters(NO_ROUTE.replace(".", r"\.")).get(NO_ROUTE, 0)

    def close(self):
        self.client.close()
        self.envoy.stop()
        for w in self.workers:
            w.close()


@pytest.fixture(params=["static", "test", "pool"])
def fleet(request, tmp_path):
    f = Fleet(tmp_path, request.param)
    yield f
    f.close()


def _refused(fleet: Fleet, method: str, path: str) -> None:
    rep = fleet.client.request(method, path, b"{}" if method in ("POST", "PUT") else None,
                               {"content-type": "application/json"} if method in ("POST", "PUT") else None)
    assert rep.status == 404, (method, path, rep.status, rep.body[:200])
    err = rep.json()  # Envoy's own 404, rewritten as an OpenAI-style JSON error
    assert err["object"] == "error" and err["code"] == 404, err
    assert rep.worker is None, (method, path, rep.headers)


def test_admin_paths_never_reach_a_worker(fleet):
    before = fleet.no_route()
    sent = [(m, p) for p in ADMIN_PATHS for m in ("POST", "GET")] + NEAR_MISSES
    for method, path in sent:
        _refused(fleet, method, path)
    assert fleet.no_route() == before + len(sent)  # each refusal counted
    reached = [(m, p) for m, p in fleet.seen() if p.split("?")[0] not in ("/health", "/v1/chat/completions")]
    assert reached == [], f"workers received non-public requests: {reached}"
    # ... while every public path is still answered by a worker
    for method, path, body in ALLOWED:
        rep = fleet.client.request(method, path, body)
        assert rep.status == 200 and rep.worker in ("m_0", "m_1"), (method, path, rep.status, rep.body[:200])
        assert rep.json()["path"] == path and rep.json()["method"] == method
    assert fleet.no_route() == before + len(sent)


@pytest.mark.parametrize("kind", ["static", "pool"])
def test_allow_path_opens_exactly_that_path(tmp_path, kind):
    f = Fleet(tmp_path, kind, ["--allow-path", "POST:/flush_cache", "--allow-path", "/get_model_info"])
    try:
        for method, path in (("POST", "/flush_cache"), ("GET", "/get_model_info")):
            rep = f.client.request(method, path, b"{}" if method == "POST" else None)
            assert rep.status == 200 and rep.worker in ("m_0", "m_1"), (method, path, rep.status, rep.body[:200])
            assert (method, path) in f.seen()
        # only those methods, and the rest of the admin API stays closed
        _refused(f, "GET", "/flush_cache")
        _refused(f, "POST", "/get_model_info")
        for path in ADMIN_PATHS[1:]:
            _refused(f, "POST", path)
        assert not [p for _, p in f.seen() if p in ADMIN_PATHS[1:]]
    finally:
        f.close()
