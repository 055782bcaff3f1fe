"""Requests the router cannot parse, or that are not inference, are still served; big prompts fit."""

from __future__ import annotations

import json

import pytest

from . import workload as wl

MODEL = "llama"


def _warm_up_blocks(client):
    """A long prompt first, on the same connection (so the same Envoy worker thread and VM): any
    per-request state the filter fails to reset would leak into the next decision."""
    rep = client.post("/v1/completions", {"model": MODEL, "prompt": wl.text(wl.rng("warm"), 3000)})
    assert rep.status == 200 and rep.decision["total"] > 0, rep.decision


@pytest.mark.parametrize("name", sorted(wl.MALFORMED))
def test_malformed_body_is_served(env, client, name):
    path, body = wl.MALFORMED[name]
    _warm_up_blocks(client)
    rep = client.post(path, body)
    assert rep.status == 200, (name, rep.status, rep.body)
    assert rep.worker in env.names
    assert rep.decision["reason"] == "parse_error", rep.decision
    # No prompt was understood: no blocks seen, none matched (they feed the blocks counters).
    assert (rep.decision["matched"], rep.decision["total"]) == (0, 0), rep.decision
    assert rep.json()["body_len"] == len(body)  # forwarded untouched


def test_empty_body_inference_request_is_served(env, client):
    """POST with no body: end of stream arrives with the headers; must not hang."""
    _warm_up_blocks(client)
    rep = client.request("POST", "/v1/chat/completions", b"")
    assert rep.status == 200, rep.body
    assert rep.worker in env.names
    assert rep.decision["reason"] == "parse_error", rep.decision
    assert (rep.decision["matched"], rep.decision["total"]) == (0, 0), rep.decision


def test_empty_prompt_falls_back_with_no_blocks(env, client):
    _warm_up_blocks(client)
    rep = client.post("/v1/chat/completions", {"model": MODEL, "messages": []})
    assert rep.status == 200, rep.body
    assert rep.decision["reason"] == "fallback", rep.decision
    assert (rep.decision["matched"], rep.decision["total"]) == (0, 0), rep.decision


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/health"), ("GET", "/v1/models?x=1")])
def test_non_inference_requests_pass_through(env, client, method, path):
    _warm_up_blocks(client)
    rep = client.request(method, path, b"{}" if method == "POST" else None)
    assert rep.status == 200, rep.body
    assert rep.worker in env.names
    assert rep.decision["reason"] == "passthrough", rep.decision
    assert (rep.decision["matched"], rep.decision["total"]) == (0, 0), rep.decision
    assert rep.json()["path"] == path


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/get_load"), ("POST", "/flush_cache"), ("GET", "/v1/chat/completions"), ("POST", "/v1/embeddings")],
)
def test_requests_outside_the_public_route_get_a_local_404(env, client, method, path):
    """Not inference and not a public read-only path: Envoy's own 404 (the public route;
    tests/integration/test_public_route.py), no worker sees it."""
    env.pool.reset()
    rep = client.request(method, path, b"{}" if method == "POST" else None)
    assert rep.status == 404 and rep.json()["code"] == 404, (rep.status, rep.body[:200])
    assert rep.worker is None
    assert not [r for _, r in env.pool.all_requests() if r["path"] == path]


def test_unknown_model_falls_back_to_default_workers(env, client):
    rep = client.post("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert rep.status == 200, rep.body
    assert rep.worker in env.names
    assert rep.decision["reason"] == "fallback", rep.decision


def _cjk(r, n):
    return "".join(chr(r.randrange(0x4E00, 0x9FFF)) for _ in range(n))


def test_128k_token_prompts_are_not_rejected(env, client):
    """Envoy buffers the whole body for the filter; the default 1 MiB limit would answer 413."""
    r = wl.rng("long")
    # 128k token ids: ~0.9 MiB of JSON.
    body = json.dumps({"input_ids": wl.tokens(r, 131_072)}).encode()
    rep = client.post("/generate", body)
    assert rep.status == 200, (rep.status, rep.body[:200])
    assert rep.json()["body_len"] == len(body)

    # ~128k tokens of CJK chat text: JSON-escaped (\uXXXX) it is well over 1 MiB.
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": _cjk(r, 200_000)}]}).encode()
    assert len(body) > 1 << 20
    rep = client.post("/v1/chat/completions", body)
    assert rep.status == 200, (rep.status, rep.body[:200])
    assert rep.json()["body_len"] == len(body)
    assert rep.decision["reason"] in ("hash_affinity", "prefix_hit", "load_spill"), rep.decision

    # Headroom: a 6 MiB prompt still fits under the configured 16 MiB.
    body = json.dumps({"model": MODEL, "prompt": wl.text(r, 1 << 16) * 96}).encode()
    rep = client.post("/v1/completions", body)
    assert rep.status == 200, (rep.status, rep.body[:200])
    assert rep.json()["body_len"] == len(body)


def test_expect_100_continue_upload(env):
    """curl sends `Expect: 100-continue` for bodies over 1 KiB and waits for the interim response;
    the filter pauses on the headers, so Envoy itself must answer 100 for the body to arrive."""
    import socket

    payload = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": wl.text(wl.rng("expect"), 4000)}]})
    s = socket.create_connection(("127.0.0.1", env.envoy.listener_port), timeout=10)
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(payload)
        )
        interim = s.recv(4096)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        s.sendall(payload.encode())
        resp = b""
        while b"\r\n\r\n" not in resp or not resp.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            resp += chunk
    finally:
        s.close()
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["body_len"] == len(payload)
    assert b"reason=hash_affinity" in head or b"reason=prefix_hit" in head, head


def test_query_string_on_inference_path_is_still_routed(env, client):
    prefix = wl.text(wl.rng("query"), 2000)
    a = client.post("/v1/completions?trace=1", {"model": MODEL, "prompt": prefix + "a"})
    b = client.post("/v1/completions", {"model": MODEL, "prompt": prefix + "b"})
    assert a.status == b.status == 200
    assert a.decision["reason"] in ("hash_affinity", "prefix_hit"), a.decision
    assert b.decision["reason"] == "prefix_hit" and b.worker == a.worker, (a.decision, b.decision)
