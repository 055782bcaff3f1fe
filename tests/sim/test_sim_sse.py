"""SSE framing of the simulator, checked with a real SSE parser (httpx-sse)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
from httpx_sse import connect_sse

from prkit.wait import wait_until

from .conftest import MODEL


def events(client: httpx.Client, url: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with connect_sse(client, "POST", url, json=body) as es:
        resp = es.response
        data = [sse.data for sse in es.iter_sse()]
    return resp, data


def test_chat_stream_frames(sim):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=10) as c:
        resp, data = events(c, sim.base + "/v1/chat/completions", body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-worker-id"] == "sim-test"
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [ch for ch in chunks[1:] if ch["choices"] and ch["choices"][0]["delta"].get("content")]
    assert len(content) == 5
    assert all(ch["object"] == "chat.completion.chunk" and ch["model"] == MODEL for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    finish = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_completion_and_generate_streams(sim):
    with httpx.Client(timeout=10) as c:
        _, data = events(c, sim.base + "/v1/completions",
                         {"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True, "stream": True})
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, "length"]
        assert all(ch["object"] == "text_completion" for ch in chunks)

        _, data = events(c, sim.base + "/generate",
                         {"text": "Once upon a time", "stream": True,
                          "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert [ch["meta_info"]["completion_tokens"] for ch in chunks] == [1, 2, 3]
        # cumulative text, the prompt was cached by the completion request above
        assert chunks[-1]["text"].startswith(chunks[0]["text"])
        assert chunks[-1]["meta_info"]["cached_tokens"] > 0
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stream_headers_arrive_with_first_token(sim_factory):
    # uncached prefill of ~4000 tokens at 2k tokens/s = ~2 s before the first byte; the same
    # prompt again is cached (prefill of the last token only). The bounds are relative and wide:
    # a loaded machine only makes the cold wait longer, and the cached one has a second of slack.
    s = sim_factory("--prefill-tokens-per-sec", "2000")
    body = {"messages": [{"role": "user", "content": "lorem ipsum " * 1334}], "max_tokens": 2, "stream": True}
    with httpx.Client(timeout=30) as c:
        t0 = time.monotonic()
        with c.stream("POST", s.base + "/v1/chat/completions", json=body) as r:
            head = time.monotonic() - t0
            r.read()
        assert r.status_code == 200
        assert head > 1.5, head  # the headers waited for the prefill
        t0 = time.monotonic()
        with c.stream("POST", s.base + "/v1/chat/completions", json=body) as r:
            head2 = time.monotonic() - t0
            r.read()
        assert head2 < head / 2, (head2, head)


def test_sigterm_drains_and_exits_zero(sim_factory):
    s = sim_factory("--time-scale", "1")
    result = {}

    def long_request():
        # 300 output tokens at 8 ms: ~2.4 s, running while the test signals and probes
        r = httpx.post(s.base + "/v1/completions",
                       json={"prompt": "x", "max_tokens": 300, "ignore_eos": True}, timeout=60)
        result["status"] = r.status_code

    t = threading.Thread(target=long_request)
    t.start()
    wait_until(lambda: httpx.get(s.base + "/get_load", timeout=5).json()[0]["num_reqs"] == 1,
               "the long request running", timeout_s=30)
    s.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(s.base + "/health", timeout=2).status_code == 503, "/health 503 while draining")
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "y"}, timeout=2)
    assert r.status_code == 503 and r.json()["code"] == 503
    t.join(timeout=60)
    assert result.get("status") == 200
    assert s.proc.wait(timeout=30) == 0
