"""Holding under saturation, through the real Envoy: a request that every node would overflow
waits in the filter (late binding) and goes to the first node that reports room; it is never
lost — a request held past max_hold_ms is routed anyway (or, with `admission.when_full:
reject`, answered 429 with Retry-After and never sent), a prompt no node could hold even empty
is not held at all, and one whose client leaves while held leaves the queue."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import random
import socket

import pytest

import harness
from harness import (KV_BYTES_PER_TOKEN, Envoy, MockCluster, chat, envoy_config, free_port,
                     wait_until)

TICK_MS = 100
KV_TOKENS = 20_000
TOTAL = KV_TOKENS * KV_BYTES_PER_TOKEN


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", f"gpu=h100,kv_tokens={KV_TOKENS}"),
                     ("node-b", f"gpu=h100,kv_tokens={KV_TOKENS}")])
    yield c
    c.stop()


def start_envoy(cluster, max_hold_ms: int, **plugin) -> Envoy:
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": 60_000,
                               "max_hold_ms": max_hold_ms, "hold_kv_ceiling": 0.9, **plugin})
    return Envoy(cfg)


def polls_seen(cluster, rounds: int = 3):
    harness.polls_seen(cluster, TICK_MS, rounds)


def served(cluster) -> int:
    return sum(n.stats()["requests_total"] for n in cluster.nodes)


def fill(node, share: float):
    node.set_health(tokens_per_sec_load=0, vram_used_bytes=int(TOTAL * share), vram_total_bytes=TOTAL)


@pytest.fixture(autouse=True)
def clean(cluster):
    for n in cluster.nodes:
        n.reset_health()
    yield


def test_a_request_waits_for_room_and_goes_to_the_node_that_frees(cluster):
    envoy = start_envoy(cluster, max_hold_ms=60_000)
    try:
        fill(cluster[0], 0.99)
        fill(cluster[1], 0.99)
        polls_seen(cluster)
        before = served(cluster)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(envoy.post, "/v1/chat/completions", chat("hello", 4), None, 60)
            wait_until(lambda: envoy.counter("token_balancer.held_now") == 1, 10, "the request to be held")
            assert envoy.counter("token_balancer.held") == 1
            assert not pending.done()
            # Held, not sent: neither node has seen it.
            assert served(cluster) == before
            cluster[1].reset_health()  # node-b drains
            r = pending.result(timeout=20)
        assert r.status == 200, r.body[:200]
        assert r.headers["x-mock-node"] == "node-b"
        debug = r.headers["x-token-balancer"]
        assert "held_ms=" in debug and debug.startswith(f"node={cluster[1].address}"), debug
        assert envoy.counter("token_balancer.held_now") == 0
        assert envoy.counter("token_balancer.held_routed_over_ceiling") == 0
    finally:
        envoy.stop()


def test_a_request_held_past_the_limit_is_routed_anyway(cluster):
    envoy = start_envoy(cluster, max_hold_ms=300)
    try:
        fill(cluster[0], 0.95)
        fill(cluster[1], 0.99)
        polls_seen(cluster)
        r = envoy.post("/v1/chat/completions", chat("hello", 4), timeout=20)
        assert r.status == 200, r.body[:200]
        # Least overflow wins once the wait is over.
        assert r.headers["x-mock-node"] == "node-a"
        held_ms = int(r.headers["x-token-balancer"].split("held_ms=")[1].split(";")[0])
        assert 300 <= held_ms < 300 + 5 * TICK_MS, held_ms
        assert envoy.counter("token_balancer.held_routed_over_ceiling") == 1
        assert envoy.counter("token_balancer.held_now") == 0
    finally:
        envoy.stop()


def test_with_when_full_reject_a_request_held_out_is_answered_429_and_never_sent(cluster):
    envoy = start_envoy(cluster, max_hold_ms=300, admission={"when_full": "reject"})
    try:
        fill(cluster[0], 0.95)
        fill(cluster[1], 0.99)
        polls_seen(cluster)
        before = served(cluster)
        r = envoy.post("/v1/chat/completions", chat("hello", 4), timeout=20)
        assert r.status == 429, r.body[:200]
        assert int(r.headers["retry-after"]) >= 1
        error = json.loads(r.body)["error"]
        assert error["code"] == "rate_limit_exceeded" and "wait no longer" in error["message"], error
        debug = r.headers["x-token-balancer"]
        assert debug.startswith("rejected=full") and "held_ms=" in debug, debug
        assert served(cluster) == before, "no node saw it"
        assert envoy.counter("token_balancer.rejected.full") == 1
        assert envoy.counter("token_balancer.held_routed_over_ceiling") == 0
        assert envoy.counter("token_balancer.held_now") == 0
        # With room, the same request is served.
        cluster[1].reset_health()
        polls_seen(cluster)
        r = envoy.post("/v1/chat/completions", chat("hello", 4), timeout=20)
        assert r.status == 200 and r.headers["x-mock-node"] == "node-b", r.body[:200]
    finally:
        envoy.stop()


@pytest.mark.parametrize("when_full", ["route", "reject"])
def test_a_prompt_no_node_could_hold_even_empty_is_not_held(cluster, when_full):
    # About 25,000 tokens against caches of 20,000: no stream ending makes room for it, so
    # it does not wait out the minute of holding for nothing.
    envoy = start_envoy(cluster, max_hold_ms=60_000, admission={"when_full": when_full})
    try:
        fill(cluster[0], 0.95)
        fill(cluster[1], 0.95)
        polls_seen(cluster)
        before = served(cluster)
        r = envoy.post("/v1/chat/completions", chat("word " * 25_000, 4), timeout=30)
        assert envoy.counter("token_balancer.held") == 0, "never held"
        if when_full == "route":
            assert r.status == 200, r.body[:200]
            assert "held_ms=" not in r.headers["x-token-balancer"]
            assert envoy.counter("token_balancer.routed_over_vram_ceiling") == 1
        else:
            assert r.status == 429, r.body[:200]
            assert int(r.headers["retry-after"]) >= 1
            error = json.loads(r.body)["error"]
            assert "even with nothing else running" in error["message"], error
            assert served(cluster) == before, "no node saw it"
            assert envoy.counter("token_balancer.rejected.full") == 1
    finally:
        envoy.stop()


def test_a_client_that_leaves_while_held_leaves_the_queue(cluster):
    envoy = start_envoy(cluster, max_hold_ms=60_000)
    try:
        fill(cluster[0], 0.99)
        fill(cluster[1], 0.99)
        polls_seen(cluster)
        before = served(cluster)
        body = json.dumps(chat("hello", 4)).encode()
        s = socket.create_connection(("127.0.0.1", envoy.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: envoy.counter("token_balancer.held_now") == 1, 10, "the request to be held")
        s.close()
        wait_until(lambda: envoy.counter("token_balancer.held_now") == 0, 10, "the queue to empty")
        # Nothing was booked for it and nothing is sent once room appears.
        for n in cluster.nodes:
            n.reset_health()
        polls_seen(cluster)
        assert served(cluster) == before
        r = envoy.post("/v1/chat/completions", chat("hello", 4))
        assert r.status == 200 and "held_ms" not in r.headers["x-token-balancer"]
    finally:
        envoy.stop()


@pytest.mark.parametrize("poller", ["vm", "singleton"])
def test_at_a_cold_start_a_request_waits_for_the_first_reports(cluster, poller):
    """A request that comes before any node has reported (a fresh Envoy, nodes not yet polled)
    waits for the first reports instead of going to Envoy's balancer blind, for at most
    stale_after_ms; a fleet that never reports is then routed by Envoy's balancer at once."""
    # Reports the filter cannot read until the nodes are reset: no node has reported.
    for n in cluster.nodes:
        n.set_health(tokens_per_sec_load="not a number")
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(), poller=poller,
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": 3_000, "max_hold_ms": 10_000})
    envoy = Envoy(cfg)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(envoy.post, "/v1/chat/completions", chat("hello", 4), None, 20)
            wait_until(lambda: envoy.counter("token_balancer.held") >= 1, 5, "the request held")
            assert not waiting.done()
            cluster[1].reset_health()
            r = waiting.result(timeout=20)
        assert r.status == 200, r.body[:200]
        debug = r.headers["x-token-balancer"]
        assert debug.startswith(f"node={cluster[1].address}") and "held_ms=" in debug, debug
        assert envoy.counter("token_balancer.fallback.no_fresh_nodes") == 0
        assert envoy.counter("token_balancer.fallback.no_fleet") == 0
    finally:
        envoy.stop()
    # A fleet that never reports: held for at most stale_after_ms from the first request.
    envoy = Envoy(cfg)
    try:
        cluster[1].set_health(tokens_per_sec_load="not a number")
        r = envoy.post("/v1/chat/completions", chat("hello", 4), timeout=20)
        assert r.status == 200, r.body[:200]
        r = envoy.post("/v1/chat/completions", chat("hello", 4), timeout=20)
        assert r.status == 200 and "held_ms" not in r.headers.get("x-token-balancer", ""), r.headers
    finally:
        envoy.stop()


def test_under_refusals_every_request_is_answered():
    """With `when_full: reject`, many held requests are refused while other streams' callbacks
    (a first token, an end) try the queue. Each is answered, 200 or 429, and none stalls: an
    answer sent from another stream's callback would stop that stream inside Envoy."""
    nodes = MockCluster([("l4-a", "gpu=l4,kv_tokens=6000"), ("l4-b", "gpu=l4,kv_tokens=6000")], time_scale=4)
    plugin = {"tick_ms": 50, "stale_after_ms": 500, "max_hold_ms": 300, "admission": {"when_full": "reject"}}
    cfg = envoy_config([n.address for n in nodes.nodes], free_port(), free_port(), plugin=plugin,
                       poller="singleton")
    envoy = Envoy(cfg, concurrency=2)
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 4, 10, "first reports")
        rng = random.Random(1)
        bodies = [chat("w " * rng.choice([300, 1500, 3000]), rng.choice([100, 400, 800])) for _ in range(600)]

        def one(body):
            try:
                return envoy.post("/v1/chat/completions", body, timeout=30).status
            except OSError as e:
                return repr(e)

        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            statuses = collections.Counter(pool.map(one, bodies))
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[429] > 0 and statuses[200] > 0, statuses
        assert envoy.counter("token_balancer.rejected.full") == statuses[429]
        assert envoy.counter("token_balancer.held_now") == 0
    finally:
        envoy.stop()
        nodes.stop()
