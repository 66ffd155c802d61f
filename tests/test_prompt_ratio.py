"""Integration test: through a real Envoy, the filter learns how the engines count prompts from
their answers' `usage.prompt_tokens` and scales its own estimates by it. The mock engines count
1.3 tokens a word; the filter's rule (about 4 characters a token) counts the words sent here,
7 characters each with their space, at about 1.75: a ratio near 0.75. A stream carries the
usage only when the client asks for it or the engine is told to send it anyway (vLLM's
`--enable-force-include-usage`, the mock's `force_usage=1`)."""

from __future__ import annotations

import threading

import pytest

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until

WORDS = "the model server request token cluster latency memory answer question".split()
RATIO = "token_balancer.prompt_ratio_permille"


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_the_engines_count_of_a_prompt_is_learned_from_their_answers(poller):
    cluster = MockCluster([("node-a", ""), ("node-b", "")])
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               poller=poller, plugin={"tick_ms": 100}), concurrency=1)
    try:
        text = " ".join(WORDS * 30)

        def routed() -> bool:
            r = envoy.post("/v1/chat/completions", chat(text, 4))
            return r.status == 200 and r.headers.get("x-token-balancer", "").startswith("node=")

        wait_until(routed, 15, "a routed request")
        assert envoy.counter(RATIO) in (0, 1000), "not learned from one answer"
        for i in range(25):
            assert envoy.post("/v1/chat/completions", chat(f"{i} {text}", 4)).status == 200
        wait_until(lambda: envoy.counter(RATIO) not in (0, 1000), 10,
                   lambda: f"the ratio learned (gauge {envoy.counter(RATIO)})")
        assert 650 <= envoy.counter(RATIO) <= 850, envoy.counter(RATIO)
    finally:
        envoy.stop()
        cluster.stop()


@pytest.mark.parametrize("node, asked, learns", [
    ("", False, False),
    ("", True, True),
    ("force_usage=1", False, True),
])
def test_a_stream_teaches_the_ratio_when_it_ends_with_the_count(node, asked, learns):
    cluster = MockCluster([("node-a", node), ("node-b", node)])
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               plugin={"tick_ms": 100}), concurrency=1)
    try:
        text = " ".join(WORDS * 30)
        options = {"stream_options": {"include_usage": True}} if asked else {}

        def stream(i: int) -> bool:
            r = envoy.post("/v1/chat/completions", chat(f"{i} {text}", 4, stream=True, **options))
            assert r.status == 200, r.body[:200]
            assert (b'"usage"' in r.body) == learns, r.body[-300:]
            return r.headers.get("x-token-balancer", "").startswith("node=")

        wait_until(lambda: stream(0), 15, "a routed request")
        for i in range(25):
            stream(i + 1)
        if learns:
            wait_until(lambda: envoy.counter(RATIO) not in (0, 1000), 10,
                       lambda: f"the ratio learned (gauge {envoy.counter(RATIO)})")
            assert 650 <= envoy.counter(RATIO) <= 850, envoy.counter(RATIO)
        else:
            # No stream taught the ratio: the first count comes from a whole answer (which
            # always has its usage), so the gauge shows one sample, not 27.
            assert envoy.counter(RATIO) == 0, envoy.counter(RATIO)
            assert envoy.post("/v1/chat/completions", chat(text, 4)).status == 200
            wait_until(lambda: envoy.counter(RATIO) != 0, 10, "the whole answer counted")
            assert envoy.counter(RATIO) == 1000, envoy.counter(RATIO)
    finally:
        envoy.stop()
        cluster.stop()


def test_each_model_is_scaled_by_its_own_tokenizers_count():
    """Two models whose tokenizers count the same text differently (the mock's `token_scale`:
    model b's counts twice what a's do): once each model's answers have counted 20 prompts,
    each model's next prompt is booked at its own ratio (the debug header says what was
    booked), and the gauge shows the fleet's, between the two."""
    cluster = MockCluster([("node-a", "models=a"), ("node-b", "models=b,token_scale=2")])
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               plugin={"tick_ms": 100}), concurrency=1)
    try:
        # Both nodes reported and listed their models: each model's requests go to its node.
        wait_until(lambda: envoy.counter("token_balancer.models.ok") >= 2
                   and envoy.counter("token_balancer.health.ok") >= 4, 15,
                   lambda: f"both nodes' reports and model lists: {envoy.counters()}")
        text = " ".join(WORDS * 30)

        def booked(model: str) -> int:
            body = {**chat(text, 4), "model": model}
            r = envoy.post("/v1/chat/completions", body)
            assert r.status == 200, r.body[:200]
            header = dict(kv.split("=", 1) for kv in r.headers["x-token-balancer"].split("; "))
            assert header["node"] == cluster.nodes[0 if model == "a" else 1].address, header
            return int(header["prompt_tokens"])

        estimate = booked("a")
        assert booked("b") == estimate, "the same text, the same estimate before any count"
        for _ in range(25):
            booked("a")
            booked("b")
        wait_until(lambda: envoy.counter(RATIO) not in (0, 1000), 10, "the fleet's ratio learned")
        a, b = booked("a") / estimate, booked("b") / estimate
        assert 0.65 <= a <= 0.85, (a, b)
        assert 1.3 <= b <= 1.7, (a, b)
        assert 1000 * a < envoy.counter(RATIO) < 1000 * b, envoy.counter(RATIO)
    finally:
        envoy.stop()
        cluster.stop()


def test_streams_without_usage_teach_the_ratio_through_the_engines_counters():
    """vLLM ends a stream whose client did not ask for usage without the count, and most
    clients do not ask. Its prompt counter still counts every prompt, whole, at its first
    token: the poller service compares the counters' growth with the filter's estimates of the
    prompts that started on those nodes (the shared books), and the workers scale their prompts
    by that ratio until answers count enough prompts themselves."""
    cluster = MockCluster([("node-a", "metrics=vllm"), ("node-b", "metrics=vllm")])
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               poller="singleton", plugin={"tick_ms": 100}), concurrency=1)
    stop = threading.Event()
    errors: list[str] = []
    text = " ".join(WORDS * 30)

    def client(k: int):
        i = 0
        while not stop.is_set():
            r = envoy.post("/v1/chat/completions", chat(f"{k} {i} {text}", 24, stream=True))
            if r.status != 200 or b'"usage"' in r.body:
                errors.append(f"{r.status} {r.body[-200:]!r}")
                return
            i += 1

    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 4, 15, "both nodes' reports")
        for t in clients:
            t.start()
        wait_until(lambda: errors or envoy.counter(RATIO) not in (0, 1000), 90,
                   lambda: f"the ratio learned from the counters (gauge {envoy.counter(RATIO)})")
        assert not errors, errors[:3]
        assert 650 <= envoy.counter(RATIO) <= 850, envoy.counter(RATIO)
    finally:
        stop.set()
        for t in clients:
            if t.is_alive():
                t.join(10)
        envoy.stop()
        cluster.stop()
