"""The official openai Python client, pointed at Envoy, gets correct completions."""

from __future__ import annotations

import openai
import pytest

from harness import Envoy, MockCluster, envoy_config, free_port


@pytest.fixture(scope="module")
def client():
    cluster = MockCluster([("fast", "gpu=h100"), ("slow", "gpu=a100"), ("slower", "gpu=l4")])
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               plugin={"tick_ms": 100, "stale_after_ms": 600}))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{envoy.port}/v1", api_key="not-needed", max_retries=0)
    envoy.stop()
    cluster.stop()


def expected_text(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def test_chat_completion(client):
    r = client.chat.completions.create(model="mock-model", max_tokens=12,
                                       messages=[{"role": "user", "content": "Say something."}])
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_completion_streaming(client):
    stream = client.chat.completions.create(
        model="mock-model", max_tokens=25, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(25)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 25


def test_completion_and_streaming_completion(client):
    r = client.completions.create(model="mock-model", prompt="Once upon a time", max_tokens=7)
    assert r.choices[0].text == expected_text(7)
    assert r.usage.completion_tokens == 7
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="mock-model", prompt=["Once upon a time"], max_tokens=9, stream=True) if c.choices)
    assert text == expected_text(9)
