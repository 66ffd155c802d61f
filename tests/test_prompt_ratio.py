"""Integration test: through a real Envoy, the filter learns how the engines count prompts from
their answers' `usage.prompt_tokens` and scales its own estimates by it. The mock engines count
1.3 tokens a word; the filter's rule (about 4 characters a token) counts the words sent here,
7 characters each with their space, at about 1.75: a ratio near 0.75."""

from __future__ import annotations

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
