"""Integration test: with `choices: auto` (the default) the number of candidates follows how
many routers share the fleet. One Envoy whose requests are all the engines report compares
every node of a small fleet; when the engines report far more requests than it sent (other
routers' traffic), it goes back to two choices. The explanation of one request says which."""

from __future__ import annotations

import threading

import pytest

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until

TICK_MS = 100
EXPLAIN = "x-token-balancer-explain"
STREAMS = 9


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([(f"node-{x}", "gpu=l4") for x in "abc"])
    yield c
    c.stop()


def choices_now(envoy: Envoy) -> int:
    r = envoy.post("/v1/chat/completions", chat("which choice?", 2), headers={EXPLAIN: "1"})
    assert r.status == 200, r.body
    f = dict(x.split("=", 1) for x in r.headers[EXPLAIN].split("; "))
    return int(f["choices"])


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_auto_choices_follow_the_share_of_reported_requests(cluster, poller):
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(), poller=poller,
                       plugin={"tick_ms": TICK_MS, "explain": {"sources": ["127.0.0.1/32"]}})
    # One worker: with `poller: vm` every worker is a router of its own.
    envoy = Envoy(cfg)
    stop = threading.Event()

    def keep_streaming():
        while not stop.is_set():
            try:
                envoy.post("/v1/chat/completions", chat("a long answer, please", 400), timeout=120)
            except OSError:
                return  # Envoy stopped at the end of the test

    threads = [threading.Thread(target=keep_streaming, daemon=True) for _ in range(STREAMS)]
    try:
        wait_until(lambda: envoy.post("/v1/chat/completions", chat("warm up", 2)).status == 200,
                   15, "a routed request")
        # Before the engines have reported any of its requests, two choices: safe for any
        # number of routers.
        assert choices_now(envoy) == 2
        for t in threads:
            t.start()
        # Every request the engines report is this Envoy's: it compares every node.
        wait_until(lambda: choices_now(envoy) == 16, 60, "choices 16 with one router", interval=0.5)
        # The engines now report 60 requests each, most of them another router's.
        for n in cluster.nodes:
            n.set_health(running_requests=60)
        wait_until(lambda: choices_now(envoy) == 2, 60, "choices 2 behind many routers", interval=0.5)
    finally:
        stop.set()
        envoy.stop()
        for t in threads:
            t.join(timeout=130)
        for n in cluster.nodes:
            n.reset_health()


def test_a_configured_number_is_kept(cluster):
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "choices": 0,
                               "explain": {"sources": ["127.0.0.1/32"]}})
    envoy = Envoy(cfg)
    try:
        wait_until(lambda: envoy.post("/v1/chat/completions", chat("warm up", 2)).status == 200,
                   15, "a routed request")
        assert choices_now(envoy) == 0
    finally:
        envoy.stop()
