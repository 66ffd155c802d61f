"""The Grafana dashboard (deploy/grafana/token-balancer.json): well-formed as Grafana imports
it, and every series its queries name exists after traffic, in a real Envoy's /stats/prometheus
(the filter's stats, Envoy's cluster stats) or in the mock engines' own /metrics (vLLM names)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness import Envoy, MockCluster, chat, envoy_config, free_port, request, wait_until

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/grafana/token-balancer.json"
# PromQL words that look like identifiers but name no series.
NOT_SERIES = {
    # aggregations and their modifiers
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "and", "or", "unless", "offset",
    # functions (the ones a dashboard might use; anything followed by "(" is skipped anyway)
    "rate", "irate", "increase", "delta", "idelta", "deriv", "label_replace", "label_join",
    "histogram_quantile", "clamp_min", "clamp_max", "abs", "vector", "scalar", "time",
    "sum_over_time", "avg_over_time", "max_over_time", "min_over_time", "absent", "resets",
    "changes", "sort", "sort_desc", "inf", "nan",
}
SAMPLE_NAME = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})? \S+$')


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p.get("targets", [])]


def series_in(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression reads, and the `__name__=~` regexes it matches names with."""
    regexes = set(re.findall(r'__name__\s*=~\s*"((?:[^"\\]|\\.)*)"', expr))
    names = set(re.findall(r'__name__\s*=\s*"((?:[^"\\]|\\.)*)"', expr))
    e = re.sub(r'\{[^}]*\}', ' ', expr)                       # label matchers
    e = re.sub(r'\[[^\]]*\]', ' ', e)                          # ranges
    e = re.sub(r'\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)', ' ', e)
    e = re.sub(r'\$\w+', ' ', e)                               # Grafana variables
    e = re.sub(r'"(?:[^"\\]|\\.)*"', ' ', e)                   # strings
    for m in re.finditer(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?=\s*([{\[)]|\s|$|[-+*/,]))', e):
        word = m.group(1)
        if word.lower() not in NOT_SERIES and not re.fullmatch(r'\d.*', word):
            names.add(word)
    return names, regexes


def test_the_tokenizer_finds_names_and_regexes():
    assert series_in('sum by (node) (rate(token_balancer_node_picks{node=~"$node"}[1m]))') == (
        {"token_balancer_node_picks"}, set())
    assert series_in('sum(rate({__name__=~"token_balancer_fallback_.*"}[1m]))') == (
        set(), {"token_balancer_fallback_.*"})
    assert series_in('vllm:kv_cache_usage_perc{instance=~"$node"}') == ({"vllm:kv_cache_usage_perc"}, set())
    assert series_in("token_balancer_held_now") == ({"token_balancer_held_now"}, set())
    assert series_in("token_balancer_inflight_now - token_balancer_held_now") == (
        {"token_balancer_inflight_now", "token_balancer_held_now"}, set())


def test_the_dashboard_is_well_formed():
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"]
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    node = next(v for v in dash["templating"]["list"] if v["name"] == "node")
    assert node["definition"] == "label_values(token_balancer_node_picks, node)"
    assert node["datasource"] == ds
    ids = [p["id"] for p in panels(dash)]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    graphs = [p for p in panels(dash) if p["type"] != "row"]
    assert len(graphs) >= 8
    for p in graphs:
        assert p["title"] and p["datasource"] == ds, p["title"]
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == ds, (p["title"], t)
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]


def names_in_exposition(text: str) -> set[str]:
    return {m.group(1) for m in map(SAMPLE_NAME.match, text.splitlines()) if m and not m.group(0).startswith("#")}


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_every_series_the_dashboard_queries_exists_after_traffic(poller):
    wanted, regexes = set(), set()
    for e in exprs(dashboard()):
        n, r = series_in(e)
        wanted |= n
        regexes |= r
    assert "token_balancer_routed" in wanted and "vllm:kv_cache_usage_perc" in wanted, wanted

    cluster = MockCluster([("node-a", "metrics=vllm"), ("node-b", "metrics=vllm")])
    addresses = [n.address for n in cluster.nodes]
    envoy = Envoy(envoy_config(addresses, free_port(), free_port(), poller=poller,
                               plugin={"tick_ms": 100}), concurrency=2)
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 2 * len(addresses), 10,
                   "health polls")
        routed = [0]

        def send():
            r = envoy.post("/v1/chat/completions", chat(f"request {routed[0]}", 1))
            assert r.status == 200, r.status
            routed[0] += r.headers.get("x-token-balancer", "").startswith("node=")
            return routed[0] >= 6

        wait_until(send, 10, "6 routed requests")
        r = envoy.post("/v1/chat/completions", b"")
        assert r.headers.get("x-token-balancer") == "fallback=no_body", r.headers

        r = request(envoy.admin_port, "GET", "/stats/prometheus")
        assert r.status == 200, r.status
        present = names_in_exposition(r.body.decode())
        for node in cluster.nodes:
            m = request(node.port, "GET", "/metrics")
            assert m.status == 200, m.status
            present |= names_in_exposition(m.body.decode())
        missing = sorted(wanted - present)
        assert not missing, f"series the dashboard queries that no source has: {missing}"
        for rx in regexes:
            assert any(re.fullmatch(rx, name) for name in present), f"no series matches {rx}"
    finally:
        envoy.stop()
        cluster.stop()
