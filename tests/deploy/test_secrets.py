"""Placeholders and secrets (issue 36): every placeholder a shipped config holds is refused by the
real filter when left in (`envoy --mode validate` fails naming it); the start script fills every
placeholder from files, refuses to start with one left, and never puts a secret on a command line
(checked with strace on every exec); envoy/gen never writes a secret into its header comment or an
error; a running Envoy shows neither secret in its stats or log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import Envoy, envoy_binary, validate_config
from prkit.paths import REPO_ROOT as REPO
from prkit.ports import free_port

from .conftest import gen_fail, plugin_config, with_local_wasm

START = REPO / "docker" / "envoy-start.sh"
FILL = REPO / "docker" / "fill-secrets.awk"
SHIPPED = ["envoy.yaml", "compose.yaml", "ingress.yaml", "scale-out.yaml", "pool.yaml"]
PLACEHOLDER = re.compile(r'"(__[A-Z0-9_]+__)"')
KEY = "0123456789abcdef0123456789abcdef"
PEER = "peer-secret-7f3a9c1e5b2d4a68"


def _local(name: str) -> str:
    text = (REPO / "envoy" / name).read_text()
    return with_local_wasm(text, ec.CONTAINER_WASM) if ec.CONTAINER_WASM in text else text


def test_shipped_placeholders_are_exactly_the_known_ones():
    """What a start script must fill: the shipped configs hold these placeholders and no other."""
    found = {name: set(PLACEHOLDER.findall((REPO / "envoy" / name).read_text())) for name in SHIPPED}
    assert found == {"envoy.yaml": set(), "compose.yaml": {ec.HASH_KEY_PLACEHOLDER},
                     "ingress.yaml": {ec.HASH_KEY_PLACEHOLDER}, "pool.yaml": {ec.HASH_KEY_PLACEHOLDER},
                     "scale-out.yaml": {ec.HASH_KEY_PLACEHOLDER, ec.PEER_SECRET_PLACEHOLDER}}, found


@pytest.mark.parametrize("name", ["compose.yaml", "ingress.yaml", "pool.yaml", "scale-out.yaml"])
def test_each_placeholder_left_in_fails_validation_naming_it(tmp_path, name):
    """For each placeholder of a shipped config: every other one replaced, this one left in, the
    real Envoy's validation (which runs the filter's config check) fails naming it and its field."""
    text = _local(name)
    values = {ec.HASH_KEY_PLACEHOLDER: KEY, ec.PEER_SECRET_PLACEHOLDER: PEER}
    fields = {ec.HASH_KEY_PLACEHOLDER: "hash_key", ec.PEER_SECRET_PLACEHOLDER: "peers.secret"}
    present = set(PLACEHOLDER.findall(text))
    for left in present:
        t = text
        for ph in present - {left}:
            t = t.replace(f'"{ph}"', f'"{values[ph]}"')
        r = validate_config(t, tmp_path, f"{name}.{left}.yaml")
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-2000:]
        assert left in out and f"`{fields[left]}`" in out, out[-2000:]
    done = text
    for ph in present:
        done = done.replace(f'"{ph}"', f'"{values[ph]}"')
    r = validate_config(done, tmp_path, f"{name}.filled.yaml")
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]


def _traced_start(tmp_path: Path, template: str, env: dict) -> tuple[subprocess.CompletedProcess, str]:
    """docker/envoy-start.sh TEMPLATE RENDERED --mode validate under strace: (the result, every
    execve line, with its argv, of the script and its children)."""
    tpl = tmp_path / "template.yaml"
    tpl.write_text(template)
    trace = tmp_path / "trace"
    r = subprocess.run(["strace", "-f", "-qq", "-s", "65536", "-e", "trace=execve", "-o", str(trace),
                        "sh", str(START), str(tpl), str(tmp_path / "rendered.yaml"), "--mode", "validate",
                        "--log-level", "warn"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "ENVOY": str(envoy_binary()), **env})
    return r, trace.read_text()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_start_script_fills_every_placeholder_and_no_secret_is_on_a_command_line(tmp_path):
    """scale-out.yaml (both placeholders) through docker/envoy-start.sh with the two secrets in
    files: the rendered config validates with the real Envoy, holds both secrets, and no process
    the script started (od, awk, mv, envoy, ...) had either secret in its argv; the generated-key
    case (compose) too."""
    (tmp_path / "key").write_text(KEY + "\n")
    (tmp_path / "peer").write_text(PEER + "\n")
    r, trace = _traced_start(tmp_path, _local("scale-out.yaml"),
                             {"HASH_KEY_FILE": str(tmp_path / "key"), "PEER_SECRET_FILE": str(tmp_path / "peer")})
    assert r.returncode == 0, r.stdout + r.stderr
    rendered = (tmp_path / "rendered.yaml").read_text()
    plugin = plugin_config(rendered)
    assert (plugin["hash_key"], plugin["peers"]["secret"]) == (KEY, PEER)
    assert not PLACEHOLDER.findall(rendered)
    assert (tmp_path / "rendered.yaml").stat().st_mode & 0o077 == 0
    execs = [line for line in trace.splitlines() if "execve(" in line]
    assert any("awk" in line for line in execs) and any("envoy" in line for line in execs), execs
    assert not [line for line in execs if KEY in line or PEER in line]
    # no secret in a comment of the rendered file either
    assert not [line for line in rendered.splitlines() if line.lstrip().startswith("#") and (KEY in line or PEER in line)]

    d = tmp_path / "generated"
    d.mkdir()
    r, trace = _traced_start(d, _local("compose.yaml"), {})
    assert r.returncode == 0, r.stdout + r.stderr
    key = plugin_config((d / "rendered.yaml").read_text())["hash_key"]
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert key not in trace
    assert not list(d.glob("rendered.yaml.*")), "the generated key file and the temporary copy are removed"


def test_start_script_refuses_a_placeholder_it_cannot_fill(tmp_path):
    """scale-out.yaml with only a hash key file: the peer-secret placeholder would stay, so Envoy
    is not started and the error names the placeholder; a secret file holding a placeholder or a
    short secret is refused naming the file, never echoing its content."""
    (tmp_path / "key").write_text(KEY)
    tpl = tmp_path / "t.yaml"
    tpl.write_text(_local("scale-out.yaml"))
    env = {**os.environ, "ENVOY": "/nonexistent/envoy-must-not-run"}

    def start(**files):
        return subprocess.run(["sh", str(START), str(tpl), str(tmp_path / "out.yaml")], capture_output=True,
                              text=True, timeout=60, env={**env, **files})

    r = start(HASH_KEY_FILE=str(tmp_path / "key"))
    assert r.returncode == 1 and ec.PEER_SECRET_PLACEHOLDER in r.stderr and "not started" in r.stderr, r.stderr
    assert not (tmp_path / "out.yaml").exists() and not (tmp_path / "out.yaml.tmp").exists()
    for content, needle in ((ec.PEER_SECRET_PLACEHOLDER, "itself a placeholder"), ("tiny-secret", "16 characters"),
                            ("has a space in it, long", "printable ASCII")):
        (tmp_path / "peer").write_text(content + "\n")
        r = start(HASH_KEY_FILE=str(tmp_path / "key"), PEER_SECRET_FILE=str(tmp_path / "peer"))
        assert r.returncode == 1 and needle in r.stderr and str(tmp_path / "peer") in r.stderr, r.stderr
        if content != ec.PEER_SECRET_PLACEHOLDER:
            assert content not in r.stderr


@pytest.mark.parametrize("form", ["split", "equals"])
def test_gen_writes_no_secret_into_its_header(form):
    """--peer-secret S --hash-key K (as two words or --opt=VALUE; envoy/gen takes no abbreviated
    options, which could escape the redaction): S and K are in the plugin configuration only; the
    header's command line says REDACTED."""
    secrets = [("--peer-secret", PEER), ("--hash-key", KEY)]
    args = ["--model", "m=10.0.0.1:8000", "--peers", "http://10.0.0.2:15100", "--peer-listen", "0.0.0.0:15100"]
    for opt, v in secrets:
        args += [f"{opt}={v}"] if form == "equals" else [opt, v]
    text = ec.run_gen(*args)
    comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert not [line for line in comments if PEER in line or KEY in line], comments[:3]
    assert ec.REDACTED in comments[1]
    plugin = plugin_config(text)
    assert (plugin["peers"]["secret"], plugin["hash_key"]) == (PEER, KEY)


def test_gen_errors_never_echo_a_secret():
    for opt in ("--hash-key", "--peer-secret"):
        bad = "bad secret with spaces 12345"
        extra = ["--peers", "http://10.0.0.2:15100", "--hash-key", KEY] if opt == "--peer-secret" else []
        err = gen_fail("--model", "m=10.0.0.1:8000", *extra, opt, bad)
        assert opt in err and bad not in err and "printable" in err, err
    err = gen_fail("--model", "m=10.0.0.1:8000", "--peers", "http://10.0.0.2:15100", "--hash-key", KEY,
                   "--peer-secret", ec.PEER_SECRET_PLACEHOLDER)
    assert "placeholder" in err and "--peer-secret-placeholder" in err, err


@pytest.mark.parametrize("args, named", [
    (["--peer-secrt", PEER], "--peer-secrt"),  # a mistyped secret option, then the secret
    ([f"--hash-ky={KEY}"], "--hash-ky"),
    (["--hash-key-file", "/dev/null", "--peer-secret-fil", f"-{PEER}"], "--peer-secret-fil"),
    (["--hash-key-placeholder", KEY], None),  # a flag takes no value: the secret is left over
    (["--profile", KEY], "--profile"),  # argparse quotes an invalid choice
    (["--help=" + KEY], "--help"),
])
def test_gen_argument_errors_never_echo_a_value(args, named):
    """A secret typed where the parser does not expect it (after a mistyped option, after a flag,
    as an option's bad value) is refused in one line that names the option and never the value."""
    err = gen_fail("--model", "m=10.0.0.1:8000", *args)
    assert KEY not in err and PEER not in err and PEER[-12:] not in err, err
    if named:
        assert named in err, err
    assert "not shown" in err, err


def test_no_secret_in_a_running_envoys_stats_or_log(tmp_path):
    """A real Envoy with a hash key and a peer secret, after some requests: neither value in its
    stats (text and Prometheus) or its log."""
    listen, admin, peer = free_port(), free_port(), free_port()
    text = ec.run_gen("--profile", "test", "--model", "m=127.0.0.1:9", "--listen", f"127.0.0.1:{listen}",
                      "--admin", f"127.0.0.1:{admin}", "--wasm", str(wasm_path()), "--hash-key", KEY,
                      "--peers", f"http://127.0.0.1:{peer}", "--peer-listen", f"127.0.0.1:{peer}", "--peer-secret", PEER)
    envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=tmp_path, concurrency=1).start()
    try:
        import urllib.request

        for path in ("/v1/models", "/flush_cache"):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{listen}{path}", timeout=10).read()
            except Exception:
                pass  # 404 / 503: only the side effects matter here
        stats = envoy.admin_get("/stats")[1] + envoy.prometheus_text()
        assert "prefix_router" in stats
        assert KEY not in stats and PEER not in stats
    finally:
        envoy.stop()
    log = Path(envoy.log_path).read_text(errors="replace")
    assert KEY not in log and PEER not in log


def test_a_secret_given_where_its_file_belongs_is_not_echoed():
    """`--hash-key-file KEY` / `--peer-secret-file SECRET` (the value pasted instead of a path):
    the error names the option, never what was given."""
    for opt, value in (("--hash-key-file", KEY), ("--peer-secret-file", PEER)):
        err = gen_fail("--model", "m=10.0.0.1:8000", opt, value)
        assert opt in err, err
        assert KEY not in err and PEER not in err, err
