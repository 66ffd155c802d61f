"""Hostile clients (docs/RELIABILITY.md, "hostile clients").

A client cannot pick its node, cannot read the filter's decisions unless the operator turns the
debug header on, cannot make the filter (or Envoy's health cluster) call a host of its choosing,
and what it sends in a body never reaches the logs, even at debug level.
"""

from __future__ import annotations

import socket
import threading

from harness import Envoy, MockCluster, chat, envoy_config, free_port, request, wait_until

MARKER = "SECRET-BODY-MARKER-7f3a9c"


class Canary:
    """A listener nobody should ever connect to."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.connections += 1
                conn.close()
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.sock.close()


def test_hostile_clients():
    cluster = MockCluster([("node-a", "gpu=h100"), ("node-b", "gpu=h100")])
    canary = Canary()
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": 100, "debug_header": None})
    envoy = Envoy(cfg, log_level="debug")
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 4, 10, "first reports")
        routed = envoy.counter("token_balancer.routed")
        # Headers that steer the filter's health callouts or Envoy's routing, set by a client.
        evil = {"x-token-balancer-health-target": canary.address,
                "x-gateway-destination-endpoint": canary.address,
                "x-token-balancer": "node=" + canary.address,
                "host": canary.address}
        for path, body in [("/v1/chat/completions", chat(MARKER, 2)), ("/health", None),
                           ("/v1/chat/completions", MARKER + " is not JSON")]:
            r = request(envoy.port, "POST" if body is not None else "GET", path, body=body, headers=evil)
            # The node's own answer (the mock rejects the body that is not JSON with a 400).
            assert r.headers.get("x-mock-node") in ("node-a", "node-b"), (path, r.status, r.headers)
            assert r.status == (400 if "not JSON" in str(body) else 200), (path, r.status, r.body[:200])
            # Debug header off (the shipped default): nothing about the decision leaks back.
            assert "x-token-balancer" not in r.headers, r.headers
        assert envoy.counter("token_balancer.routed") == routed + 1
        # Polls go on as configured; none ever went to the canary.
        polls = envoy.counter("token_balancer.health.ok")
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= polls + 4, 10, "more polls")
        assert canary.connections == 0
        log = envoy.log_text()
        assert MARKER not in log, "a request body reached the log"
        assert "token-balancer configured" in log  # the log is the filter's, at debug level
    finally:
        envoy.stop()
        canary.close()
        cluster.stop()
