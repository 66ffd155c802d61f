"""Bad request bodies through the real Envoy (docs/RELIABILITY.md, "bad request bodies").

Behind Envoy sit two echo nodes: they answer the seed health JSON and reply to any request
with the length and SHA-256 of the body they received, so each case checks three things: the
client gets the node's answer (never a 5xx made by the filter), the body reached the node
byte for byte, and the filter took the outcome the table in RELIABILITY.md names. After every
case the VM must still be routing (a crashed VM would fail open silently).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness import Envoy, envoy_config, free_port, wait_until

HEALTH = json.dumps({"tokens_per_sec_load": 10, "tokens_per_sec_capacity": 10000,
                     "kv_cache_usage": 0.1, "queue_depth": 0, "running_requests": 0}).encode()


class EchoHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, body: bytes, ctype: str = "application/json"):
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.send_header("x-mock-node", f"echo-{self.server.server_address[1]}")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(HEALTH)

    def do_POST(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers.get("content-length", "0")))
        self._reply(json.dumps({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}).encode())


@pytest.fixture(scope="module")
def echo_nodes():
    servers = []
    for _ in range(2):
        s = ThreadingHTTPServer(("127.0.0.1", free_port()), EchoHandler)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    yield [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()


@pytest.fixture(scope="module")
def envoy(echo_nodes):
    e = Envoy(envoy_config(echo_nodes, free_port(), free_port(), plugin={"tick_ms": 100}))
    wait_until(lambda: e.counter("token_balancer.health.ok") >= 4, 10, "first reports")
    yield e
    e.stop()


def send(envoy, body: bytes | None, headers: dict | None = None, chunked: bool = False):
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=30)
    try:
        hdrs = {"content-type": "application/json", **(headers or {})}
        if chunked:
            pieces = [body[i:i + 7000] for i in range(0, len(body), 7000)]
            conn.request("POST", "/v1/chat/completions", body=iter(pieces), headers=hdrs, encode_chunked=True)
        else:
            conn.request("POST", "/v1/chat/completions", body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()
    finally:
        conn.close()


def chat_body(prompt: str = "hello", **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], **extra}).encode()


deep = b'{"messages":[{"role":"user","content":' + b"[" * 5000 + b"]" * 5000 + b"}]}"
ten_mib = chat_body("x" * (10 << 20))

# (case, body, extra headers, chunked, the filter's outcome: the counter it bumps or "routed")
CASES = [
    ("invalid JSON", b'{"messages": [', {}, False, "fallback.body_unusable"),
    ("wrong types", b'{"messages": "hi", "max_tokens": "many"}', {}, False, "fallback.body_unusable"),
    ("JSON nested past serde's depth limit", deep, {}, False, "fallback.body_unusable"),
    ("binary data", bytes(range(256)) * 64, {}, False, "fallback.body_unusable"),
    ("NaN literal", b'{"messages":[{"role":"user","content":"a"}],"max_tokens":NaN}', {}, False,
     "fallback.body_unusable"),
    ("gzip content-encoding", gzip.compress(chat_body()), {"content-encoding": "gzip"}, False,
     "fallback.encoded_body"),
    ("deflate content-encoding", b"x\x9c" + b"\x00" * 20, {"content-encoding": "deflate"}, False,
     "fallback.encoded_body"),
    ("10 MiB body", ten_mib, {}, False, "fallback.body_over_limit"),
    ("10 MiB body, chunked", ten_mib, {}, True, "fallback.body_over_limit"),
    ("chunked body", chat_body("hello " * 3000), {}, True, "routed"),
    ("absurd n and max_tokens", chat_body(n=10**30, max_tokens=10**30), {}, False, "routed"),
    ("negative n and max_tokens", chat_body(n=-3, max_tokens=-1), {}, False, "routed"),
]


@pytest.mark.parametrize("case,body,headers,chunked,outcome", CASES, ids=[c[0] for c in CASES])
def test_bad_body_reaches_the_node_intact(envoy, case, body, headers, chunked, outcome):
    name = f"token_balancer.{outcome}"
    before = envoy.counter(name)
    status, hdrs, reply = send(envoy, body, headers, chunked)
    assert status == 200, (case, status, reply[:200])
    echoed = json.loads(reply)
    assert echoed == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}, case
    assert envoy.counter(name) == before + 1, (case, name)
    if outcome == "routed":
        assert hdrs["x-token-balancer"].startswith("node="), hdrs
    else:
        assert hdrs["x-token-balancer"].startswith("fallback="), hdrs
    # The VM is alive and routing.
    status, hdrs, _ = send(envoy, chat_body())
    assert status == 200 and hdrs["x-token-balancer"].startswith("node="), hdrs


def test_no_body(envoy):
    before = envoy.counter("token_balancer.fallback.no_body")
    status, hdrs, reply = send(envoy, None, {"content-length": "0"})
    assert status == 200 and json.loads(reply) == {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    assert envoy.counter("token_balancer.fallback.no_body") == before + 1
