"""Integration tests: the filter's beliefs, served as JSON on the shipped operator listener only,
for both poller modes; the same path on the public listener is never answered by the filter."""

from __future__ import annotations

import json

import pytest
import yaml

from harness import (ENVOY_YAML, Envoy, MockCluster, chat, envoy_config, free_port,
                     operator_plugin, request, wait_until)

TICK_MS = 100
NODE_FIELDS = {"address", "slot", "member", "ejected", "failures_in_row", "failed_request_since_report",
               "telemetry", "report",
               "in_flight", "models", "time_per_token", "predicted_typical"}
REPORT_FIELDS = {"age_ms", "fresh", "load_tokens_per_sec", "capacity_tokens_per_sec",
                 "sustained_tokens_per_sec", "forecast_tokens_per_sec",
                 "capacity_used_tokens_per_sec", "kv_cache_usage", "kv_cache_tokens",
                 "vram_used_bytes", "vram_total_bytes", "queue_depth", "running_requests"}
IN_FLIGHT_FIELDS = {"requests", "tokens", "sent_since_report_requests", "sent_since_report_tokens",
                    "sent_since_report_prompt_tokens", "ended_since_report_requests",
                    "kv_growth_to_come_tokens",
                    "prefill_to_come_tokens", "tightest_tpot_budget_ms"}


def beliefs_path() -> str:
    return json.loads(operator_plugin(yaml.safe_load(ENVOY_YAML.read_text()))
                      ["configuration"]["value"])["beliefs_path"]


def test_the_shipped_public_listener_never_sets_beliefs_path():
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    public = cfg["static_resources"]["listeners"][0]
    assert public["name"] == "inference"
    hcm = public["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]
    assert "beliefs_path" not in json.loads(wasm["configuration"]["value"])
    operator = next(li for li in cfg["static_resources"]["listeners"] if li["name"] == "operator")
    assert operator["address"]["socket_address"]["address"] == "127.0.0.1"
    assert beliefs_path().startswith("/")


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", ""), ("node-b", ""), ("node-c", "")])
    yield c
    c.stop()


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_beliefs_on_the_operator_listener_only(cluster, poller):
    addresses = [n.address for n in cluster.nodes]
    operator_port = free_port()
    envoy = Envoy(envoy_config(addresses, free_port(), free_port(), poller=poller,
                               plugin={"tick_ms": TICK_MS}, beliefs_port=operator_port), concurrency=2)
    path = beliefs_path()
    try:
        def routed() -> bool:
            r = envoy.post("/v1/chat/completions", chat("hello beliefs", 4))
            return r.status == 200 and r.headers.get("x-token-balancer", "").startswith("node=")

        wait_until(routed, 15, "a routed request")
        for i in range(6):
            assert envoy.post("/v1/chat/completions", chat(f"request {i}", 4)).status == 200

        def beliefs() -> dict:
            r = request(operator_port, "GET", path)
            assert r.status == 200, r.status
            assert r.headers["content-type"] == "application/json"
            assert "x-mock-node" not in r.headers, "forwarded to a node"
            return r.json()

        # Every node has a fresh report in the operator listener's view.
        wait_until(lambda: all(n["report"] and n["report"]["fresh"] for n in beliefs()["nodes"]),
                   10, "fresh reports in the beliefs")
        b = beliefs()
        assert sorted(n["address"] for n in b["nodes"]) == sorted(addresses)
        for n in b["nodes"]:
            assert NODE_FIELDS <= set(n), set(n) ^ NODE_FIELDS
            assert REPORT_FIELDS <= set(n["report"]), n["report"]
            assert IN_FLIGHT_FIELDS <= set(n["in_flight"]), n["in_flight"]
            assert n["member"] is True and n["ejected"] is False
            assert n["report"]["age_ms"] >= 0
            assert n["report"]["capacity_used_tokens_per_sec"] > 0
            assert n["telemetry"]["path"] == "/health"
            assert n["predicted_typical"]["seconds"] > 0
            # Every request has ended: nothing is in flight.
            assert n["in_flight"]["requests"] == 0
        fleet = b["fleet"]
        assert fleet["nodes"] == len(addresses)
        assert fleet["held_requests"] == 0
        assert fleet["typical_request"]["source"] in ("mean", "default")
        assert {"mean_request_tokens", "learned_output", "assumed_capacity_tokens_per_sec"} <= set(fleet)
        assert b["now_ms"] > 0

        # The operator listener answers that path only: another path or method is its 404.
        assert request(operator_port, "GET", path + "/x").status == 404
        assert request(operator_port, "POST", path, body={"x": 1}).status == 404
        assert request(operator_port, "GET", path + "?x=1").status == 404

        # On the public listener the filter does not answer the path: it goes on to a node
        # (Envoy's own balancer, as any request without a body), never with the beliefs.
        before = envoy.counter("token_balancer.fallback.no_body")
        r = request(envoy.port, "GET", path)
        assert "x-mock-node" in r.headers, (r.status, r.headers)
        assert b'"in_flight"' not in r.body and b'"predicted_typical"' not in r.body
        assert r.headers.get("content-type") != "application/json" or "nodes" not in r.json()
        wait_until(lambda: envoy.counter("token_balancer.fallback.no_body") == before + 1, 5,
                   "the public request counted as an ordinary one without a body")
    finally:
        envoy.stop()
