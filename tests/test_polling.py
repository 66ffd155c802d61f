"""Integration test: how often the real Envoy polls nodes whose reports do not move.

With `tick_ms` 100 and `stale_after_ms` 1000 (one poller per Envoy), an idle node's reports move nothing, so it is
polled once per `quiet_poll_ms` (500 ms by default here) instead of ten times a second; its
report never goes stale, so requests are still routed by the filter; and a node whose report
moves is polled every tick again (the cadence itself is unit-tested in the glue's tests)."""

from __future__ import annotations

import time

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until


def test_idle_nodes_are_polled_at_the_quiet_period_and_stay_fresh():
    c = MockCluster([("node-a", ""), ("node-b", ""), ("node-c", "")])
    try:
        cfg = envoy_config([n.address for n in c.nodes], free_port(), free_port(),
                           plugin={"tick_ms": 100, "stale_after_ms": 1000}, poller="singleton")
        envoy = Envoy(cfg)
        try:
            gauge = "token_balancer.health.quiet_nodes"
            wait_until(lambda: envoy.counter(gauge) == 3, 10, "every idle node quiet")
            before = [n.stats()["health_requests_total"] for n in c.nodes]
            t0 = time.monotonic()
            # Requests routed meanwhile: every node stays a candidate (fresh), none falls back.
            routed = envoy.counter("token_balancer.routed")
            deadline = t0 + 3.0
            sent = 0
            while time.monotonic() < deadline:
                r = envoy.post("/v1/chat/completions", chat(f"hi {sent}", 1))
                assert r.status == 200, r
                sent += 1
                wait_until(lambda: time.monotonic() >= t0 + sent * 0.25 or time.monotonic() >= deadline,
                           2, "the next send time")
            elapsed = time.monotonic() - t0
            rates = [(n.stats()["health_requests_total"] - b) / elapsed for n, b in zip(c.nodes, before)]
            assert envoy.counter("token_balancer.routed") == routed + sent
            assert envoy.counter("token_balancer.fallback.no_fresh_nodes") == 0
            # Ten a second at the tick; about two at the quiet period (a request can move a
            # node's report and bring it back to the tick for a while).
            assert all(r <= 5.0 for r in rates), rates
            assert sum(rates) / len(rates) <= 4.0, rates
        finally:
            envoy.stop()
    finally:
        c.stop()
