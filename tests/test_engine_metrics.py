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
