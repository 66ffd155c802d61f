"""One poller per Envoy process and in-flight books shared by every worker ("poller":
"singleton"), through the real Envoy with four workers.

The filter VMs in singleton mode send no callout of their own: that requests are routed at all
shows that the poller service (the bootstrap extension, main thread) and the filter VMs (the
workers) share proxy-wasm shared data under one vm_id. The contrasts with "poller": "vm" show
that each measurement can tell the two modes apart.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until

TICK_MS = 200
WORKERS = 4


@pytest.fixture(scope="module")
def cluster():
    # Slow iterations (40 ms a token) so that a 100-token stream stays open for seconds.
    c = MockCluster([(f"node-{i}", "gpu=h100,floor_ms=40,kv_tokens=200000") for i in range(3)])
    yield c
    c.stop()


def start(nodes, poller: str, **plugin) -> Envoy:
    # Every node polled every tick, quiet or not: these tests count polls per tick.
    cfg = envoy_config([n.address for n in nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": 2000, "quiet_poll_ms": TICK_MS,
                               **plugin}, poller=poller)
    return Envoy(cfg, concurrency=WORKERS)


def health_total(node) -> int:
    return node.stats()["health_requests_total"]


def polls_per_tick(cluster, polls: int) -> list[float]:
    """Health requests each node received per tick, over the time node 0 takes to receive
    `polls` more (the window is measured, not slept)."""
    start = [health_total(n) for n in cluster.nodes]
    t0 = time.monotonic()
    wait_until(lambda: health_total(cluster[0]) >= start[0] + polls, 30, f"{polls} polls at node 0")
    ticks = (time.monotonic() - t0) * 1000 / TICK_MS
    return [(health_total(n) - s) / ticks for n, s in zip(cluster.nodes, start)]


def test_one_poller_per_process_whatever_the_workers(cluster):
    envoy = start(cluster.nodes, "singleton")
    try:
        # Routed from the service's snapshot: the filter VMs poll nothing themselves.
        wait_until(lambda: envoy.post("/v1/chat/completions", chat("hi", 2))
                   .headers.get("x-token-balancer", "").startswith("node="), 10,
                   "a request routed from the shared snapshot")
        # 15 ticks: one poll per node per tick (the edges of the window cost at most one).
        rates = polls_per_tick(cluster, 15)
        assert all(14 / 16 <= r <= 16 / 14 for r in rates), rates
        c = envoy.counters()
        assert c["token_balancer.shared.published"] > 0 and c["token_balancer.shared.imported"] > 0, c
        assert c.get("token_balancer.fallback.no_fleet", 0) == 0, c
    finally:
        envoy.stop()
    # The same Envoy with every VM polling: four workers and the main thread, five a tick.
    envoy = start(cluster.nodes, "vm")
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") > 10, 10, "polls")
        rates = polls_per_tick(cluster, 50)
        assert all(4.5 <= r <= 5.5 for r in rates), rates
    finally:
        envoy.stop()


def open_stream(envoy, prompt: str, max_tokens: int):
    """Sends a streaming request on a new connection and returns it once its headers are in."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=60)
    body = json.dumps(chat(prompt, max_tokens, stream=True))
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.status
    debug = dict(p.split("=", 1) for p in r.getheader("x-token-balancer").split("; "))
    return conn, r, debug


def worker_spread(envoy, before: dict[str, int]) -> dict[str, int]:
    now = envoy.worker_connections()
    return {w: v - before.get(w, 0) for w, v in now.items() if v - before.get(w, 0) > 0}


def shared_gauges(envoy) -> tuple[int, int]:
    c = envoy.counters()
    return (c.get("token_balancer.shared.inflight_requests", -1),
            c.get("token_balancer.shared.inflight_tokens", -1))


def test_shared_books_count_every_worker_and_return_to_zero(cluster):
    envoy = start(cluster.nodes, "singleton")
    streams = []
    try:
        wait_until(lambda: envoy.post("/v1/chat/completions", chat("hi", 2))
                   .headers.get("x-token-balancer", "").startswith("node="), 10, "routing")
        wait_until(lambda: shared_gauges(envoy) == (0, 0), 10, "idle books")
        before = envoy.worker_connections()
        for i in range(24):
            streams.append(open_stream(envoy, f"request {i} " + "word " * (10 * i), 100))
        spread = worker_spread(envoy, before)
        assert len(spread) >= 3, f"connections must spread over the workers: {spread}"
        sent_tokens = sum(int(d["prompt_tokens"]) + int(d["output_tokens"]) for _, _, d in streams)
        assert all(d["node"].startswith("127.0.0.1:") for _, _, d in streams)
        # The service sums the books of every node, written by every worker.
        wait_until(lambda: shared_gauges(envoy) == (24, sent_tokens), 5,
                   lambda: f"shared books {shared_gauges(envoy)} to be (24, {sent_tokens})")
        for conn, r, _ in streams:
            assert b"[DONE]" in r.read()
            conn.close()
        wait_until(lambda: shared_gauges(envoy) == (0, 0), 5,
                   lambda: f"shared books {shared_gauges(envoy)} back to zero")
        c = envoy.counters()
        assert c.get("token_balancer.shared.cas_exhausted", 0) == 0, c
        assert c.get("token_balancer.shared.failed", 0) == 0, c
        assert c.get("token_balancer.inflight_now", -1) == 0, c
    finally:
        for conn, _, _ in streams:
            conn.close()
        envoy.stop()


def inflight_seen(node, poller: str, n: int) -> tuple[list[int], dict[str, int]]:
    """Opens `n` long streams one after the other, each on a new connection, to a single node:
    the in-flight count each request saw on the node before its own dispatch, and how the
    connections spread over the workers."""
    envoy = start([node], poller)
    streams = []
    try:
        wait_until(lambda: envoy.post("/v1/chat/completions", chat("hi", 2))
                   .headers.get("x-token-balancer", "").startswith("node="), 10, "routing")
        before = envoy.worker_connections()
        for i in range(n):
            streams.append(open_stream(envoy, f"stream {i}", 100))
        spread = worker_spread(envoy, before)
        return [int(d["inflight"]) for _, _, d in streams], spread
    finally:
        for conn, _, _ in streams:
            conn.close()
        envoy.stop()


def test_every_worker_sees_the_others_dispatches(cluster):
    n = 12
    seen, spread = inflight_seen(cluster[0], "singleton", n)
    assert len(spread) >= 2, spread
    # Each request saw every stream opened before it, whichever worker dispatched it.
    assert seen == list(range(n)), (seen, spread)
    # With books per VM, a worker sees only its own streams.
    seen, spread = inflight_seen(cluster[0], "vm", n)
    assert len(spread) >= 2, spread
    assert max(seen) < n - 1, (seen, spread)


def test_without_the_poller_service_requests_fall_back(cluster):
    """A filter in singleton mode whose poller service is missing (not configured, or its VM
    crashed: the heartbeat then goes stale) has no fleet: every request goes to Envoy's own
    balancer, counted, and the loss is logged once, not per request. The first request a worker
    sees may wait for a first snapshot (a cold start) for at most stale_after_ms; every later
    one falls back at once."""
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": 2000}, poller="singleton")
    cfg.pop("bootstrap_extensions")
    envoy = Envoy(cfg, concurrency=WORKERS)
    try:
        start = sum(health_total(n) for n in cluster.nodes)
        held = 0
        for _ in range(20):
            r = envoy.post("/v1/chat/completions", chat("hi", 2))
            assert r.status == 200
            debug = r.headers["x-token-balancer"]
            if "held_ms=" in debug:
                held += 1
                assert debug.startswith("fallback=no_fresh_nodes"), debug
                assert int(debug.split("held_ms=")[1].split(";")[0]) <= 2000 + 3 * TICK_MS, debug
            else:
                assert debug == "fallback=no_fleet", debug
        assert held <= WORKERS, held
        assert envoy.counter("token_balancer.fallback.no_fleet") == 20 - held
        assert sum(health_total(n) for n in cluster.nodes) == start, "filter VMs never poll"
        lines = [l for l in envoy.log_text().splitlines() if "no fleet snapshot" in l]
        assert 1 <= len(lines) <= WORKERS + 1, lines
    finally:
        envoy.stop()
