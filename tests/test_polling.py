"""Integration test: how often the real Envoy polls nodes whose reports do not move, or show
room to spare.

With `tick_ms` 100 (one poller per Envoy), an idle node's reports move nothing, so it is polled
once per `quiet_poll_ms` (800 ms, eight ticks, by default here) instead of ten times a second.
Its report stays fresh until its next poll is late, even with a `stale_after_ms` (400) shorter
than the quiet period, so requests are still routed by the filter. A node decoding
a stream of this Envoy's, with room to spare (nothing waiting, little of its cache in use), is
polled at the quiet period too, though its reports move; once its reports show requests
waiting, every tick again (the cadence itself is unit-tested in the glue's tests)."""

from __future__ import annotations

import threading
import time

from harness import Envoy, MockCluster, chat, envoy_config, free_port, stream_until_closed, wait_until


def test_idle_nodes_are_polled_at_the_quiet_period_and_stay_fresh():
    c = MockCluster([("node-a", ""), ("node-b", ""), ("node-c", "")])
    try:
        cfg = envoy_config([n.address for n in c.nodes], free_port(), free_port(),
                           plugin={"tick_ms": 100, "stale_after_ms": 400}, poller="singleton")
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
            # Ten a second at the tick; about 1.25 at the quiet period (a request can move a
            # node's report and bring it back to the tick for a while).
            assert all(r <= 5.0 for r in rates), rates
            assert sum(rates) / len(rates) <= 3.0, rates
        finally:
            envoy.stop()
    finally:
        c.stop()


def test_a_node_decoding_with_room_to_spare_is_polled_at_the_quiet_period():
    c = MockCluster([("node-a", "gpu=h100"), ("node-b", "gpu=h100")])
    try:
        cfg = envoy_config([n.address for n in c.nodes], free_port(), free_port(),
                           plugin={"tick_ms": 100, "stale_after_ms": 1000}, poller="singleton")
        envoy = Envoy(cfg)
        try:
            wait_until(lambda: envoy.counter("token_balancer.health.quiet_nodes") == 2, 10, "both nodes quiet")
            first_token, out = threading.Event(), {}
            t = threading.Thread(target=stream_until_closed, daemon=True,
                                 args=(envoy.port, chat("tell me a long story", 1500), first_token, out))
            t.start()
            assert first_token.wait(10), "no first token"
            node = next(n for n in c.nodes if n.name == out["node"])

            def rate(seconds: float) -> float:
                before, t0 = node.stats()["health_requests_total"], time.monotonic()
                wait_until(lambda: time.monotonic() >= t0 + seconds, seconds + 2, "the window")
                return (node.stats()["health_requests_total"] - before) / (time.monotonic() - t0)

            # Decoding, its reports moving (its KV use and load grow), with room to spare:
            # about two polls a second, not ten.
            h = node.health()
            assert h["running_requests"] == 1 and h["queue_depth"] == 0 and h["kv_cache_usage"] < 0.1, h
            decoding = rate(2.0)
            assert t.is_alive(), "the stream ended before the window did"
            assert decoding <= 5.0, decoding
            # Its reports now show requests waiting, a queue that moves: every tick again.
            stop = threading.Event()

            def queue_moves():
                depth = 3
                while not stop.wait(0.03):
                    depth += 1
                    node.set_health(queue_depth=depth)

            mover = threading.Thread(target=queue_moves, daemon=True)
            mover.start()
            try:
                rates: list[float] = []
                wait_until(lambda: rates.append(rate(0.5)) or rates[-1] >= 6.0, 5,
                           lambda: f"polls every tick with requests waiting: {rates} a second")
            finally:
                stop.set()
                mover.join(2)
                node.reset_health()
        finally:
            envoy.stop()
    finally:
        c.stop()


def test_a_quiet_node_is_polled_every_tick_while_a_prompt_waits_there():
    """A prompt sent to a node polled every 2 s, which takes seconds to prefill: the worker that
    sent it names the node on the poller's wake list, so the node is polled at the next tick
    and every tick until its first token comes back, and at the quiet period again once the
    stream has ended."""
    slow = "gpu=h100,prefill_chunk=32,floor_ms=100"
    c = MockCluster([("node-a", slow), ("node-b", slow)])
    try:
        cfg = envoy_config([n.address for n in c.nodes], free_port(), free_port(),
                           plugin={"tick_ms": 100, "stale_after_ms": 1000, "quiet_poll_ms": 2000},
                           poller="singleton")
        envoy = Envoy(cfg)
        try:
            def rate(node, seconds: float) -> float:
                b, s = node.stats()["health_requests_total"], time.monotonic()
                wait_until(lambda: time.monotonic() >= s + seconds, seconds + 2, "the window")
                return (node.stats()["health_requests_total"] - b) / (time.monotonic() - s)

            # Both nodes at the whole quiet period: about one poll every 2 s.
            rates: list[float] = []
            wait_until(lambda: rates.append(rate(c.nodes[0], 2.5))
                       or rates[-1] <= 0.8, 20, lambda: f"the whole quiet period: {rates} a second")
            # The prompt goes out just after a poll (both nodes are polled together): without a
            # word from the worker, the node's next poll would be 2 s away.
            polled = c.nodes[0].stats()["health_requests_total"]
            wait_until(lambda: c.nodes[0].stats()["health_requests_total"] > polled, 5, "a poll",
                       interval=0.005)
            first_token, out = threading.Event(), {}
            prompt = " ".join(f"word{i}" for i in range(1200))
            t = threading.Thread(target=stream_until_closed, daemon=True,
                                 args=(envoy.port, chat(prompt, 4), first_token, out))
            t.start()
            wait_until(lambda: "node" in out, 10, "the answer's headers")
            node = next(n for n in c.nodes if n.name == out["node"])
            before, t0 = node.stats()["health_requests_total"], time.monotonic()
            # Polled within a few ticks, not at the end of its 2-s period.
            wait_until(lambda: node.stats()["health_requests_total"] > before, 0.5,
                       "a poll of the node within 0.5 s of the prompt")
            wait_until(lambda: time.monotonic() >= t0 + 1.5 or first_token.is_set(), 4, "the window")
            assert not first_token.is_set(), "the prompt took less than the window to start"
            waiting = (node.stats()["health_requests_total"] - before) / (time.monotonic() - t0)
            # Ten a second at the tick.
            assert waiting >= 6.0, f"{waiting:.1f} polls a second while the prompt waits"
            assert first_token.wait(30), "no first token"
            t.join(30)
            assert out["end"] == "complete", out
            assert envoy.counter("token_balancer.shared.wakes_lost") == 0
            rates = []
            wait_until(lambda: rates.append(rate(node, 2.5)) or rates[-1] <= 1.5, 20,
                       lambda: f"the quiet period again once the stream ended: {rates} a second")
        finally:
            envoy.stop()
    finally:
        c.stop()
