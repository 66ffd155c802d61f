"""Integration test: the filter polls an engine's Prometheus /metrics instead of the seed JSON.

The mock node serves vLLM-named metrics at /metrics; the filter, configured per node with
`health_path` and `format`, must take them as health reports and route on them.
"""

from __future__ import annotations

import pytest

from harness import (Envoy, MockCluster, chat, envoy_config, free_port, node_stat, wait_until,
                     with_node_settings)

TICK_MS = 100
STALE_MS = 600


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", "gpu=h100,kv_tokens=20000"),
                     ("node-b", "gpu=h100,kv_tokens=20000"),
                     ("node-c", "gpu=h100,kv_tokens=20000")])
    yield c
    c.stop()


def test_engine_metrics_are_read_as_health_and_a_misconfigured_node_is_not_used(cluster):
    nodes = cluster.nodes
    cfg = envoy_config([n.address for n in nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS})
    cfg = with_node_settings(cfg, [
        {"health_path": "/metrics", "format": "vllm"},
        {"health_path": "/metrics"},  # auto: detected from the vllm: prefix
        # Metrics read as the seed JSON: every answer is unparsable, the node never fresh.
        {"health_path": "/metrics", "format": "seed"},
    ])
    envoy = Envoy(cfg)
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 10
                   and envoy.counter("token_balancer.health.unparsable") >= 5,
                   10, "health polls of /metrics")
        ok_before = envoy.counter("token_balancer.health.ok")
        routed_before = envoy.counter("token_balancer.routed")
        fallback_before = envoy.counter("token_balancer.fallback.no_fresh_nodes")
        served = []
        for i in range(12):
            r = envoy.post("/v1/chat/completions", chat(f"hello {i}", 4))
            assert r.status == 200, (r.status, r.body[:200])
            assert r.headers["x-token-balancer"].startswith("node=127.0.0.1:"), r.headers
            served.append(r.headers["x-mock-node"])
        assert envoy.counter("token_balancer.routed") == routed_before + 12
        assert envoy.counter("token_balancer.fallback.no_fresh_nodes") == fallback_before
        # Only the two nodes whose metrics were read as metrics are chosen.
        assert set(served) <= {"node-a", "node-b"}, served
        assert "node-c" not in served
        # Both keep answering good reports; the misconfigured one keeps failing, counted.
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= ok_before + 6, 10,
                   "more good polls")
        assert envoy.counter(node_stat(nodes[2].address, "health_failures")) >= 5
        assert envoy.counter(node_stat(nodes[2].address, "picks")) == 0
    finally:
        envoy.stop()


def test_engines_that_filter_by_name_are_asked_for_the_metrics_read_alone():
    """Nodes configured by address only: vLLM's and SGLang's pages are asked for with
    `name[]` filters once found (a few hundred bytes instead of tens of kilobytes), llama.cpp's
    small hand-written page is asked whole, and a node with `filter_metrics: false` is asked
    whole too; every one of them still routes."""
    c = MockCluster([("vllm", "metrics=vllm"), ("sglang", "metrics=sglang"),
                     ("llamacpp", "metrics=llamacpp,kv_tokens=20000"),
                     ("vllm-whole", "metrics=vllm")])
    try:
        cfg = envoy_config([n.address for n in c.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS})
        cfg = with_node_settings(cfg, [{}, {}, {}, {"filter_metrics": False}])
        envoy = Envoy(cfg)
        try:
            wait_until(lambda: envoy.counter("token_balancer.telemetry.discovered") >= 4, 15,
                       "every node's metrics found")
            # Polls after discovery: from here on, each node's answers are measured.
            wait_until(lambda: all(n.stats()["metrics_requests_total"] >= 3 for n in c.nodes), 10,
                       "polls of every node's metrics")
            before = {n.name: n.stats() for n in c.nodes}
            wait_until(lambda: all(n.stats()["metrics_requests_total"]
                                   >= before[n.name]["metrics_requests_total"] + 5 for n in c.nodes),
                       10, "five more polls of every node")
            per_poll = {}
            for n in c.nodes:
                s, b = n.stats(), before[n.name]
                per_poll[n.name] = ((s["metrics_bytes_total"] - b["metrics_bytes_total"])
                                    / (s["metrics_requests_total"] - b["metrics_requests_total"]))
            assert per_poll["vllm"] < 2_000, per_poll
            assert per_poll["sglang"] < 2_000, per_poll
            assert per_poll["vllm-whole"] > 25_000, per_poll
            assert per_poll["llamacpp"] > 1_500, per_poll
            assert envoy.counter("token_balancer.telemetry.unfiltered") == 0
            # The filtered answers are reports like any: no node fails its polls, and the
            # filter routes by its own choice.
            for n in c.nodes:
                assert envoy.counter(node_stat(n.address, "health_failures")) == 0, n.name
            routed = envoy.counter("token_balancer.routed")
            for i in range(12):
                r = envoy.post("/v1/chat/completions", chat(f"hello {i}", 4))
                assert r.status == 200, (r.status, r.body[:200])
                assert r.headers["x-token-balancer"].startswith("node=127.0.0.1:"), r.headers
            assert envoy.counter("token_balancer.routed") == routed + 12
        finally:
            envoy.stop()
    finally:
        c.stop()
