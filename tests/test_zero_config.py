"""Integration tests: the README's minimal configuration (node addresses only) in front of mock
nodes that answer as real engines do (`metrics=FLAVOUR`: /health an empty 200, llama.cpp's
{"status":"ok"}; trtllm-serve's Prometheus text at /prometheus/metrics; llama.cpp lists its
model file's path with its per-slot context and serves any model name).

(i) For each engine, and with both pollers, the filter finds every node's metrics, says so once
per node, and routes (`routed` grows, nothing falls back); a model name only engines that serve
any name would take goes to them, never to vLLM, which would answer 404.
(ii) A node whose telemetry cannot be found (llama.cpp without --metrics) is reported: a stat,
a gauge and a warning saying what was tried and what to do; a node that is down is not.
(iii) A llama.cpp node is not sent a prompt longer than its per-slot context.
"""

from __future__ import annotations

import collections
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until

TICK_MS = 100
PLUGIN = {"tick_ms": TICK_MS, "stale_after_ms": 1000, "models_poll_ms": 500}
FLAVOURS = ["vllm", "sglang", "tgi", "trtllm", "llamacpp"]
# What each engine's /health is, in the filter's words, and where its metrics are found.
FOUND = {
    "vllm": ("an empty 200", "/metrics", "vLLM"),
    "sglang": ("an empty 200", "/metrics", "SGLang"),
    "tgi": ("an empty 200", "/metrics", "TGI"),
    "trtllm": ("an empty 200", "/prometheus/metrics", "trtllm-serve"),
    "llamacpp": ("JSON that is not the health format", "/metrics", "llama.cpp"),
}
PROMPT = "lorem ipsum dolor sit amet " * 20


def fallbacks(envoy) -> dict[str, int]:
    return {k: v for k, v in envoy.counters().items() if k.startswith("token_balancer.fallback.")}


def served_by(r) -> str:
    assert r.status == 200, (r.status, r.body[:300])
    assert r.headers["x-token-balancer"].startswith("node="), r.headers.get("x-token-balancer")
    return r.headers["x-mock-node"]


def spread(envoy, n: int, body, clients: int = 8, own: bool = True) -> collections.Counter:
    """`n` requests from `clients` clients at once; with `own`, each opens with its own words,
    so no two share a cached prefix (prefix affinity is tested in test_prefix.py)."""
    with ThreadPoolExecutor(clients) as pool:
        return collections.Counter(pool.map(
            lambda i: served_by(envoy.post("/v1/chat/completions", own_opening(body, i) if own else body)),
            range(n)))


def own_opening(body: dict, i: int) -> dict:
    """`body` with its first message opening with request `i`'s own words."""
    body = copy.deepcopy(body)
    first = body["messages"][0]
    first["content"] = f"Request {i}. " + first["content"]
    return body


@pytest.fixture(scope="module")
def engines():
    cluster = MockCluster([(f, f"metrics={f}") for f in FLAVOURS])
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_the_minimal_configuration_routes_in_front_of_each_engine(engines, poller):
    envoy = Envoy(envoy_config([n.address for n in engines.nodes], free_port(), free_port(), plugin=PLUGIN,
                               poller=poller))
    try:
        wait_until(lambda: envoy.counter("token_balancer.telemetry.discovered") >= len(FLAVOURS), 10,
                   lambda: f"every node's telemetry found: {envoy.counters()}")
        for node in engines.nodes:
            said, path, engine = FOUND[node.name]
            line = (f"node {node.address}: /health is not telemetry ({said}); reading {path} ({engine} metrics) "
                    f"instead; set its health_path to \"{path}\" to silence this")
            wait_until(lambda: line in envoy.log_text(), 5, line)
        # Every node's model list is known: a name only some serve is placed by the rule.
        wait_until(lambda: envoy.counter("token_balancer.models.ok") >= 2 * len(FLAVOURS), 10, "model lists")
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 4 * len(FLAVOURS), 10, "reports")
        routed = envoy.counter("token_balancer.routed")
        fell_back = fallbacks(envoy)
        # mock-model is what the vLLM, SGLang, TGI and trtllm-serve nodes list; llama.cpp lists
        # its file's path, so it takes names nobody lists, which vLLM would refuse.
        named = spread(envoy, 40, chat(PROMPT, 2))
        assert set(named) <= {"vllm", "sglang", "tgi", "trtllm"} and len(named) >= 2, named
        anonymous = spread(envoy, 40, chat(PROMPT, 2, model="gpt-4o"))
        assert set(anonymous) <= {"sglang", "tgi", "trtllm", "llamacpp"} and len(anonymous) >= 2, anonymous
        assert envoy.counter("token_balancer.routed") == routed + 80
        assert fallbacks(envoy) == fell_back
        c = envoy.counters()
        assert c.get("token_balancer.health.unparsable", 0) == 0, c
        assert c.get("token_balancer.telemetry.not_found", 0) == 0, c
        if poller == "singleton":
            # One poller: each node's discovery said once.
            assert c["token_balancer.telemetry.discovered"] == len(FLAVOURS), c
    finally:
        envoy.stop()


def payload(model: str) -> dict:
    body = chat(PROMPT, 2)
    body["model"] = model
    return body


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_a_node_without_telemetry_is_reported_and_a_dead_one_is_not(poller):
    cluster = MockCluster([("ok", "metrics=vllm"), ("dark", "metrics=llamacpp,metrics_off=1")])
    ok, dark = cluster.nodes
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    envoy = Envoy(envoy_config([ok.address, dark.address, dead], free_port(), free_port(), plugin=PLUGIN,
                               poller=poller))
    try:
        wait_until(lambda: envoy.counter("token_balancer.telemetry.not_found") >= 1, 10,
                   lambda: f"the node without telemetry reported: {envoy.counters()}")
        line = (f"node {dark.address}: no telemetry found (/health: JSON that is not the health format; "
                "/metrics: status 501; /prometheus/metrics: status 404), so it is never chosen: start llama-server "
                "with --metrics")
        wait_until(lambda: line in envoy.log_text(), 5, line)
        wait_until(lambda: envoy.counter("token_balancer.telemetry.not_found_now") == 1, 5, "the gauge")
        # The dead node is a failed poll, taken out, and never called a node without telemetry.
        wait_until(lambda: envoy.counter("token_balancer.health.bad_status") >= 4, 10, "failed polls")
        assert f"node {dead}: no telemetry" not in envoy.log_text()
        assert f"node {dead}: /health is not telemetry" not in envoy.log_text()
        # Only the node with telemetry is chosen; nothing falls back.
        routed = envoy.counter("token_balancer.routed")
        got = spread(envoy, 20, chat(PROMPT, 2))
        assert got == {"ok": 20}, got
        assert envoy.counter("token_balancer.routed") == routed + 20
        if poller == "singleton":
            assert envoy.counter("token_balancer.telemetry.not_found") == 1
    finally:
        envoy.stop()
        cluster.stop()


def test_a_llamacpp_node_gets_no_prompt_longer_than_its_context():
    cluster = MockCluster([("cramped", "metrics=llamacpp,n_ctx=256"), ("roomy", "metrics=llamacpp,n_ctx=8192")])
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(), plugin=PLUGIN))
    try:
        wait_until(lambda: envoy.counter("token_balancer.models.ok") >= 4, 10, "both contexts")
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 8, 10, "reports")
        # About 1,000 tokens: over the cramped node's 256 (it would answer 400), inside 8,192.
        long = chat("lorem ipsum dolor sit amet " * 150, 2)
        # The same long prompt each time: with twenty different ones, the short requests below
        # all went to the cramped node (the roomy one still reporting the long ones' load).
        assert spread(envoy, 20, long, own=False) == {"roomy": 20}
        # Short prompts still go to the cramped node, and any model name is served. (Whether
        # some go to the roomy one too depends on when its report shows the KV cache the long
        # prompts left there: not what this test is about.)
        served = spread(envoy, 30, chat("Say hi.", 2, model="whatever"))
        assert sum(served.values()) == 30 and served["cramped"] > 0, served
    finally:
        envoy.stop()
        cluster.stop()
