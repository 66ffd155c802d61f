"""Integration tests: the filter's stats in Envoy's Prometheus output, with the shipped YAML's
tag extractor making each node's address a `node` tag, for both poller modes."""

from __future__ import annotations

import collections
import re

import pytest

from harness import Envoy, MockCluster, chat, envoy_config, free_port, node_stat, request, wait_until

TICK_MS = 100
# One Prometheus sample: name, labels (maybe empty), value.
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def prometheus(envoy) -> tuple[dict[tuple[str, frozenset], float], dict[str, str]]:
    """Envoy's /stats/prometheus: the samples by (name, labels) and the type of each family."""
    r = request(envoy.admin_port, "GET", "/stats/prometheus")
    assert r.status == 200, r.status
    samples, types = {}, {}
    for line in r.body.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        m = SAMPLE.match(line)
        if m:
            labels = frozenset(LABEL.findall(m.group(2)))
            samples[(m.group(1), labels)] = float(m.group(3))
    return samples, types


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", ""), ("node-b", ""), ("node-c", "")])
    yield c
    c.stop()


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_prometheus_has_per_node_picks_tagged_with_each_address(cluster, poller):
    addresses = [n.address for n in cluster.nodes]
    envoy = Envoy(envoy_config(addresses, free_port(), free_port(), poller=poller,
                               plugin={"tick_ms": TICK_MS}), concurrency=2)
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 2 * len(addresses), 10,
                   "health polls")
        # Requests until 12 are routed; the debug header says where each went (a worker VM that
        # has no reports yet sends a request to Envoy's own balancer: no_fresh_nodes).
        served: collections.Counter = collections.Counter()
        outcomes: collections.Counter = collections.Counter()

        def send():
            r = envoy.post("/v1/chat/completions", chat(f"request {sum(outcomes.values())}", 1))
            assert r.status == 200, r.status
            debug = r.headers["x-token-balancer"]
            outcomes[debug.split("=")[0] if debug.startswith("node=") else debug] += 1
            if debug.startswith("node="):
                served[debug.removeprefix("node=").split(";")[0].split(",")[0]] += 1
            return sum(served.values()) >= 12

        wait_until(send, 10, lambda: f"12 routed requests: {outcomes}")
        assert set(outcomes) <= {"node", "fallback=no_fresh_nodes"}, outcomes
        # Two fallbacks by reason: no body, and a body that is not JSON (Envoy's own balancer
        # sends them on; the mock node refuses them).
        for body, reason in [(b"", "no_body"), (b'{"messages": [', "body_unusable")]:
            r = envoy.post("/v1/chat/completions", body)
            assert r.headers.get("x-token-balancer") == f"fallback={reason}", r.headers

        samples, types = prometheus(envoy)
        # One family per per-node counter, one series per node, tagged with its address as it is.
        assert types.get("token_balancer_node_picks") == "counter", types
        assert types.get("token_balancer_node_health_failures") == "counter", types
        picks = {dict(labels)["node"]: v for (name, labels), v in samples.items()
                 if name == "token_balancer_node_picks"}
        assert picks == {a: served.get(a, 0) for a in addresses}, (picks, served)
        assert {dict(labels)["node"] for (name, labels) in samples
                if name == "token_balancer_node_health_failures"} == set(addresses)
        # The same counts as the plain /stats names.
        for a in addresses:
            assert envoy.counter(node_stat(a, "picks")) == picks[a]
        # No address is left in a name (the extractor took every one out).
        assert not [name for name, _ in samples if name.startswith("token_balancer_node_1")], samples
        assert not [labels for name, labels in samples
                    if name.startswith("token_balancer_node_") and dict(labels).get("node") == "other"]

        # The main counters, untagged.
        assert samples[("token_balancer_routed", frozenset())] == 12
        assert samples[("token_balancer_fallback_no_body", frozenset())] == 1
        assert samples[("token_balancer_fallback_body_unusable", frozenset())] == 1
        assert (samples[("token_balancer_fallback_no_fresh_nodes", frozenset())]
                == outcomes["fallback=no_fresh_nodes"])
        assert types["token_balancer_routed"] == "counter"
        assert types["token_balancer_inflight_now"] == "gauge"
        assert samples[("token_balancer_health_ok", frozenset())] >= 2 * len(addresses)
    finally:
        envoy.stop()


@pytest.mark.parametrize("poller,concurrency", [("vm", 1), ("singleton", 2)])
def test_a_node_replaced_under_a_new_address_gets_its_own_series(tmp_path, poller, concurrency):
    """Membership churn: node-a leaves the cluster and node-b joins in its place (the way a
    replaced pod comes back under a new address). Each has its own series under its own address,
    equal to the requests routed there; node-a's stops growing once it is gone."""
    from test_membership import eds_file, following_envoy, push

    nodes = MockCluster([("node-a", ""), ("node-b", "")])
    a, b = (n.address for n in nodes.nodes)
    envoy, eds = following_envoy(tmp_path, [a], {}, poller, concurrency)

    routed: collections.Counter = collections.Counter()

    def send(count: int):
        """Sends `count` requests and counts the nodes they were routed to (first in the debug
        header; a fallback, while a worker has not seen the new member yet, counts nowhere)."""
        for i in range(count):
            r = envoy.post("/v1/chat/completions", chat(f"churn {i}", 1))
            assert r.status == 200, r.status
            debug = r.headers["x-token-balancer"]
            if debug.startswith("node="):
                routed[debug.removeprefix("node=").split(";")[0].split(",")[0]] += 1

    def picks() -> dict[str, float]:
        samples, _ = prometheus(envoy)
        return {dict(labels)["node"]: v for (name, labels), v in samples.items()
                if name == "token_balancer_node_picks"}

    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 2, 10,
                   lambda: f"node-a to report: {envoy.log_text()[-2000:]}")
        send(5)
        assert routed == {a: 5} and picks() == {a: 5}, (routed, picks())

        push(eds, eds_file([b]))
        wait_until(lambda: envoy.counter("token_balancer.nodes_left") >= 1
                   and envoy.counter("token_balancer.nodes_joined") >= 1, 10,
                   lambda: f"node-a to leave and node-b to join: {envoy.counters()}")
        # A worker may route a few more to node-a (still up) until it sees the departure.
        wait_until(lambda: send(1) or routed[b] >= 1, 10, "a request routed to node-b")
        send(7)
        assert routed[b] >= 7, routed
        assert picks() == dict(routed), (picks(), routed)
        before_a = routed[a]
        send(5)
        assert routed[a] == before_a and picks() == dict(routed), (picks(), routed)
    finally:
        envoy.stop()
        nodes.stop()
