"""The official openai client against the simulator."""

from __future__ import annotations

import openai
import pytest

from .conftest import MODEL


def test_openai_client_streams_chat(sim):
    client = openai.OpenAI(base_url=sim.base + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = ""
    usage = None
    finish = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert len(text) == 24
    assert finish == "length"
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_openai_client_non_stream_and_errors(sim):
    client = openai.OpenAI(base_url=sim.base + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    r2 = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
