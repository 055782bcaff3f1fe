"""docker-compose.yml, checked without a Docker engine: tools/composecheck loads it with the real
Compose loader (compose-spec/compose-go, what `docker compose` uses) for every profile set, checks
that every referenced file exists, and the Envoy config it mounts passes `envoy --mode validate`."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from prkit.build import envoy_binary
from prkit.envoy import check_config
from prkit.paths import REPO_ROOT as REPO

from .conftest import with_local_wasm, yaml_doc

COMPOSE = REPO / "docker-compose.yml"


def load(composecheck, profiles: str = "*", file=COMPOSE) -> tuple[int, dict, str]:
    r = subprocess.run(
        [str(composecheck), "check", "-profiles", profiles, str(file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


@pytest.fixture(scope="module")
def project(composecheck) -> dict:
    rc, out, err = load(composecheck)
    assert rc == 0 and out["missing"] == [], f"{err}\n{out.get('missing')}"
    return out["project"]


def test_all_profiles_load_and_every_referenced_file_exists(project):
    services = project["services"]
    # the checker really resolved the build files (absolute paths inside this repo), so the
    # fixture's missing-file check covered them
    assert services["w0"]["build"]["dockerfile"] == "docker/sim.Dockerfile"
    assert services["w0"]["build"]["context"] == str(REPO)
    assert services["filter"]["build"]["target"] == "export"


@pytest.mark.parametrize(
    "profiles,expected",
    [
        ("sim", {"filter", "envoy", "w0", "w1", "w2", "w3"}),
        ("sim,load", {"filter", "envoy", "w0", "w1", "w2", "w3", "k6"}),
        ("gpu", {"filter", "envoy", "sglang-w0", "sglang-w1", "sglang-w2", "sglang-w3"}),
        ("gpu,load", {"filter", "envoy", "sglang-w0", "sglang-w1", "sglang-w2", "sglang-w3", "k6"}),
        ("sim,monitoring", {"filter", "envoy", "w0", "w1", "w2", "w3", "prometheus", "grafana"}),
    ],
)
def test_profiles_select_one_worker_set(composecheck, profiles, expected):
    rc, out, err = load(composecheck, profiles)
    assert rc == 0, err
    assert set(out["enabled"]) == expected


def test_default_profile_is_sim():
    assert "COMPOSE_PROFILES=sim" in (REPO / ".env").read_text().splitlines()


def test_checker_reports_missing_files(composecheck, tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(
        "services:\n"
        "  a:\n"
        "    build: { context: ., dockerfile: nope.Dockerfile }\n"
        "    volumes: [./missing.yaml:/etc/x.yaml:ro]\n"
    )
    rc, out, _ = load(composecheck, "*", bad)
    assert rc == 1
    assert any("nope.Dockerfile" in m for m in out["missing"])
    assert any("missing.yaml" in m for m in out["missing"])


def test_envoy_service(project):
    """Envoy starts after the filter service wrote the .wasm into the volume it reads, on the
    config this repository generates, and is published on the host's loopback only."""
    envoy = project["services"]["envoy"]
    deps = envoy["depends_on"]
    assert deps["filter"] == {"condition": "service_completed_successfully", "required": True}
    for w in ("w0", "w1", "w2", "w3", "sglang-w0", "sglang-w1", "sglang-w2", "sglang-w3"):
        assert deps[w] == {"condition": "service_healthy", "required": False}, w
    mounts = {v["target"]: v for v in envoy["volumes"]}
    assert mounts["/etc/envoy/envoy.yaml"]["source"] == str(REPO / "envoy" / "compose.yaml")
    assert mounts["/etc/prefix-router"]["type"] == "volume" and mounts["/etc/prefix-router"]["source"] == "wasm"
    # the filter service writes the .wasm into the same volume
    assert {v["target"]: v["source"] for v in project["services"]["filter"]["volumes"]} == {"/out": "wasm"}
    assert "/ready" in " ".join(envoy["healthcheck"]["test"])
    ports = {(p.get("host_ip", ""), p["published"], p["target"]) for p in envoy["ports"]}
    # published on the host's loopback only
    assert ports == {("127.0.0.1", "10000", 10000), ("127.0.0.1", "9902", 9902)}


def test_envoy_config_matches_services(project, composecheck, tmp_path):
    """The mounted config names the wasm where the volume puts it and the workers by DNS name."""
    text = (REPO / "envoy" / "compose.yaml").read_text()
    doc = yaml_doc(composecheck, text, tmp_path)
    assert "/out/prefix_router.wasm" in (REPO / "docker" / "filter.Dockerfile").read_text()
    hosts = {(ep["endpoint"]["address"]["socket_address"]["address"],
              ep["endpoint"]["address"]["socket_address"]["port_value"])
             for c in doc["static_resources"]["clusters"] if c["name"] != "admin"
             for g in c["load_assignment"]["endpoints"] for ep in g["lb_endpoints"]}
    assert hosts == {("w0", 30000), ("w1", 30000), ("w2", 30000), ("w3", 30000)}
    listeners = {li["name"]: li for li in doc["static_resources"]["listeners"]}
    # inside the container: all interfaces (what the host publishes is decided by `ports`)
    assert listeners["ingress"]["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 10000}
    assert listeners["stats"]["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9902}
    assert doc["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    (hcm,) = listeners["ingress"]["filter_chains"][0]["filters"]
    (wasm,) = [f for f in hcm["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    assert wasm["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] == "/etc/prefix-router/prefix_router.wasm"
    for i in range(4):
        aliases = project["services"][f"sglang-w{i}"]["networks"]["default"]["aliases"]
        assert aliases == [f"w{i}"]


def test_every_mounted_envoy_config_validates(project, tmp_path):
    configs = sorted(
        {
            v["source"]
            for s in project["services"].values()
            for v in s.get("volumes", [])
            if v["type"] == "bind" and v["source"].startswith(str(REPO / "envoy") + "/")
        }
    )
    assert configs == [str(REPO / "envoy" / "compose.yaml")]
    for c in configs:
        text = open(c).read()
        # validate mode does not resolve the STRICT_DNS names (w0..w3 exist only in the compose network)
        check_config(with_local_wasm(text, "/etc/prefix-router/prefix_router.wasm")
                     .replace('"hash_key": "__HASH_KEY__"', '"hash_key": "' + "k" * 32 + '"'), tmp_path, "compose.yaml")


def run_envoy_command(project, tmp_path, *envoy_args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The envoy service's command, run here: container paths mapped to the mounted files (the
    config with the local .wasm), `envoy_args` appended (e.g. --mode validate). Returns the result
    and the rendered config."""
    envoy = project["services"]["envoy"]
    mounts = {v["target"]: v["source"] for v in envoy["volumes"] if v["type"] == "bind"}
    template = tmp_path / "template.yaml"
    template.write_text(with_local_wasm(Path(mounts["/etc/envoy/envoy.yaml"]).read_text(),
                                        "/etc/prefix-router/prefix_router.wasm"))
    rendered = tmp_path / "rendered.yaml"
    paths = {"/etc/envoy/envoy.yaml": str(template), "/tmp/envoy.yaml": str(rendered),
             **{t: s for t, s in mounts.items() if t != "/etc/envoy/envoy.yaml"}}
    cmd = [paths.get(a, a) for a in envoy["command"]]
    assert cmd[0] == "sh" and cmd[1] == str(REPO / "docker" / "envoy-start.sh"), cmd
    r = subprocess.run([*cmd, *envoy_args, "--log-level", "warn"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "ENVOY": str(envoy_binary())})
    return r, rendered


def test_envoy_command_starts_with_a_fresh_hash_key(project, tmp_path):
    """envoy/compose.yaml holds the hash_key placeholder; the service's command writes a random key
    into a private copy and starts Envoy on it (here: --mode validate, which runs the filter's
    config check), a new key each start."""
    keys = []
    for i in range(2):
        d = tmp_path / str(i)
        d.mkdir()
        r, rendered = run_envoy_command(project, d, "--mode", "validate")
        assert r.returncode == 0 and " OK" in r.stdout + r.stderr, r.stdout + r.stderr
        (key,) = re.findall(r'"hash_key": "([^"]*)"', rendered.read_text())[:1]
        assert re.fullmatch(r"[0-9a-f]{64}", key), key
        assert rendered.stat().st_mode & 0o077 == 0  # owner only: it holds the key
        keys.append(key)
    assert keys[0] != keys[1]
    assert '"hash_key": "__HASH_KEY__"' not in rendered.read_text()


def compose_config(composecheck, tmp_path) -> tuple[dict, dict, set]:
    """envoy/compose.yaml: ({worker host: port} its worker clusters send to, the Wasm plugin's
    configuration, the models it routes)."""
    doc = yaml_doc(composecheck, (REPO / "envoy" / "compose.yaml").read_text(), tmp_path)
    hosts = {ep["endpoint"]["address"]["socket_address"]["address"]:
             ep["endpoint"]["address"]["socket_address"]["port_value"]
             for c in doc["static_resources"]["clusters"] if c["name"] != "admin"
             for g in c["load_assignment"]["endpoints"] for ep in g["lb_endpoints"]}
    (wasm,) = [f for li in doc["static_resources"]["listeners"] for f in li["filter_chains"][0]["filters"][0]
               ["typed_config"].get("http_filters", []) if f["name"] == "envoy.filters.http.wasm"]
    plugin = json.loads(wasm["typed_config"]["config"]["configuration"]["value"])
    return hosts, plugin, set(plugin["models"])


def dockerfile_exec(text: str, instruction: str) -> list:
    """The exec-form (JSON) arguments of a Dockerfile's last ENTRYPOINT or CMD."""
    (line,) = re.findall(rf"^{instruction} (\[.*\])$", text, re.M)[-1:]
    return json.loads(line)


def flag(cmd: list, name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sim_workers_serve_what_the_envoy_config_routes(project, composecheck, tmp_path):
    """Each sim worker (image entrypoint + service command) listens on all interfaces at the port
    Envoy sends its traffic to, serves a model the config routes, and its health check asks that
    port."""
    hosts, _, models = compose_config(composecheck, tmp_path)
    entrypoint = dockerfile_exec((REPO / "docker" / "sim.Dockerfile").read_text(), "ENTRYPOINT")
    for i in range(4):
        s = project["services"][f"w{i}"]
        assert s["build"]["dockerfile"] == "docker/sim.Dockerfile"
        cmd = entrypoint + s["command"]
        assert flag(cmd, "--host") == "0.0.0.0"
        port = int(flag(cmd, "--port"))
        assert port == hosts[f"w{i}"], (cmd, hosts)
        assert flag(cmd, "--model") in models, (cmd, models)
        assert s["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"


def test_gpu_workers_serve_what_the_envoy_config_routes(project, composecheck, tmp_path):
    """Each SGLang worker answers under the name Envoy sends to (its alias), on all interfaces at
    that port, serves a model the config routes, exposes the /metrics the filter's index
    self-check reads, and gets a GPU of its own."""
    hosts, plugin, models = compose_config(composecheck, tmp_path)
    assert plugin["load_poll"].get("metrics_interval_ms", 2000) > 0  # the self-check is on
    devices = []
    for i in range(4):
        s = project["services"][f"sglang-w{i}"]
        (alias,) = s["networks"]["default"]["aliases"]
        cmd = s["command"]
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
        assert "--enable-metrics" in cmd  # sglang:prompt_tokens_total / cached_tokens_total
        assert flag(cmd, "--host") == "0.0.0.0"
        port = int(flag(cmd, "--port"))
        assert port == hosts[alias], (cmd, hosts)
        assert flag(cmd, "--served-model-name") in models, (cmd, models)
        assert flag(cmd, "--model-path")  # from SGLANG_MODEL_PATH (default set)
        assert s["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"]
        devices += dev["device_ids"]
    assert len(set(devices)) == len(devices) == 4, devices  # one GPU per worker, none shared


def test_k6_load_targets_the_envoy_service(project, composecheck, tmp_path):
    """k6 sends to the envoy service's listener, a model the config routes, a script it mounts."""
    _, _, models = compose_config(composecheck, tmp_path)
    k6 = project["services"]["k6"]
    assert k6["depends_on"]["envoy"]["condition"] == "service_healthy"
    published = {p["target"] for p in project["services"]["envoy"]["ports"]}
    target = k6["environment"]["TARGET"]
    m = re.fullmatch(r"http://envoy:(\d+)", target)
    assert m and int(m.group(1)) in published, (target, published)
    assert k6["environment"]["MODEL"] in models
    mounts = {v["target"]: Path(v["source"]) for v in k6["volumes"]}
    (script,) = [a for a in k6["command"] if a.endswith(".js")]
    mount = next(t for t in mounts if script.startswith(t + "/"))
    assert (mounts[mount] / script[len(mount) + 1:]).is_file(), script


def test_monitoring_profile(project):
    """Prometheus + Grafana (tests/deploy/test_dashboard.py checks the dashboard's queries): the
    home dashboard Grafana is told to open is one it mounts, and neither is published beyond the
    host's loopback."""
    prom, graf = project["services"]["prometheus"], project["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in graf["volumes"]}
    home = Path(graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    (mount,) = [t for t in mounts if home.is_relative_to(t)]
    assert (mounts[mount] / home.relative_to(mount)).is_file(), home
    for s in (prom, graf):
        assert all(p.get("host_ip") == "127.0.0.1" for p in s["ports"]), s["ports"]


def test_filter_image_targets_exist(project):
    """Every build target used for docker/filter.Dockerfile (the compose filter service, the
    commands envoy/k8s/README.md gives) is a stage of it."""
    text = (REPO / "docker" / "filter.Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    used = {project["services"]["filter"]["build"]["target"]}
    used |= set(re.findall(r"docker build -f docker/filter\.Dockerfile --target (\S+)",
                           (REPO / "envoy" / "k8s" / "README.md").read_text()))
    assert used and used <= stages, (used, stages)
