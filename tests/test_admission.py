"""Admission through the real Envoy: who waits, who goes first, who is told to come back.

Under saturation a higher-priority request leaves the hold queue before a lower one that came
first; a tenant's short requests are not stuck behind another tenant's burst of long prompts;
a request whose time-to-first-token budget no node can meet is answered at once with 429, a
`Retry-After` and an OpenAI error; a sheddable request is shed instead of held; a client that
leaves while held is counted."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest

import harness
from harness import (KV_BYTES_PER_TOKEN, Envoy, MockCluster, chat, envoy_config, free_port,
                     wait_until)

TICK_MS = 100
KV_TOKENS = 20_000
TOTAL = KV_TOKENS * KV_BYTES_PER_TOKEN
OBJECTIVE = "x-gateway-inference-objective"
TENANT = "x-gateway-inference-fairness-id"


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", f"gpu=h100,kv_tokens={KV_TOKENS}"),
                     ("node-b", f"gpu=h100,kv_tokens={KV_TOKENS}")])
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def clean(cluster):
    for n in cluster.nodes:
        n.reset_health()
    yield
    for n in cluster.nodes:
        n.reset_health()


def start_envoy(cluster, **plugin) -> Envoy:
    settings = {"tick_ms": TICK_MS, "stale_after_ms": 60_000, "max_hold_ms": 60_000,
                "hold_kv_ceiling": 0.9, "choices": 0,
                "admission": {"objectives": {"premium": 100, "standard": 0, "batch": -10}}}
    settings.update(plugin)
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(), plugin=settings)
    return Envoy(cfg)


def polls_seen(cluster, rounds: int = 3):
    harness.polls_seen(cluster, TICK_MS, rounds)


def used(node, tokens: int):
    """The node reports `tokens` of its KV cache in use, and no load."""
    node.set_health(tokens_per_sec_load=0, vram_used_bytes=tokens * KV_BYTES_PER_TOKEN,
                    vram_total_bytes=TOTAL)


def saturate(cluster):
    """Both nodes report a full cache, and the filter has seen it."""
    for n in cluster.nodes:
        used(n, KV_TOKENS)
    polls_seen(cluster)


def long_chat(i: int, words: int = 800, max_tokens: int = 4) -> dict:
    """About `words` x 5 / 4 prompt tokens by the filter's estimate (4 characters a token)."""
    return chat(f"request {i}: " + "word " * words, max_tokens)


def held_ms(r) -> int:
    return int(r.headers["x-token-balancer"].split("held_ms=")[1].split(";")[0])


class Sender:
    """Sends requests one at a time, each only once the previous is held, and records when
    it was sent; `left(i)` is when request i left the queue (sent + held_ms, wall ms)."""

    def __init__(self, envoy: Envoy, pool):
        self.envoy, self.pool = envoy, pool
        self.sent: list[float] = []
        self.futures = []

    def send(self, body: dict, headers: dict):
        held_before = self.envoy.counter("token_balancer.held")
        self.sent.append(time.time() * 1000)
        self.futures.append(self.pool.submit(self.envoy.post, "/v1/chat/completions", body,
                                             headers, 60))
        wait_until(lambda: self.envoy.counter("token_balancer.held") == held_before + 1, 10,
                   "the request to be held")

    def results(self):
        return [f.result(timeout=60) for f in self.futures]

    def left(self, i: int, r) -> float:
        return self.sent[i] + held_ms(r)


def test_a_higher_priority_leaves_the_queue_before_a_lower_one_that_came_first(cluster):
    envoy = start_envoy(cluster)
    try:
        saturate(cluster)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            s = Sender(envoy, pool)
            s.send(long_chat(0), {OBJECTIVE: "standard"})
            s.send(long_chat(1), {OBJECTIVE: "premium"})
            # node-b reports room for one of them (1,500 tokens under the ceiling of 18,000,
            # each asking about 1,010): one leaves per report.
            used(cluster[1], 16_500)
            standard, premium = s.results()
        assert standard.status == premium.status == 200, (standard.body[:200], premium.body[:200])
        assert s.left(1, premium) < s.left(0, standard), (s.sent, held_ms(premium), held_ms(standard))
        assert envoy.counter("token_balancer.held_now") == 0
    finally:
        envoy.stop()


def test_a_tenants_short_requests_go_between_another_tenants_long_prompts(cluster):
    envoy = start_envoy(cluster)
    try:
        saturate(cluster)
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            s = Sender(envoy, pool)
            for i in range(6):
                s.send(long_chat(i), {TENANT: "tenant-b"})
            for i in range(3):
                s.send(chat(f"short {i}", 4), {TENANT: "tenant-a"})
            # Room for one long prompt per report (and short ones beside it).
            used(cluster[1], 16_500)
            results = s.results()
        assert all(r.status == 200 for r in results), [r.status for r in results]
        left = [s.left(i, r) for i, r in enumerate(results)]
        longs, shorts = sorted(left[:6]), left[6:]
        # First in, first out would have kept the short ones behind all six long prompts; fair
        # queuing lets them out with the first long one, well before the last ones.
        assert max(shorts) < longs[3], (longs, shorts)
    finally:
        envoy.stop()


def test_a_budget_no_node_can_meet_is_answered_429_at_once(cluster):
    envoy = start_envoy(cluster, max_hold_ms=0)
    try:
        polls_seen(cluster)
        before = sum(n.stats()["requests_total"] for n in cluster.nodes)
        # About 10,000 prompt tokens: a quarter of a second of prefill on an H100-like node.
        body = long_chat(0, words=8000)
        start = time.monotonic()
        r = envoy.post("/v1/chat/completions", body, {"x-slo-ttft-ms": "20"}, timeout=20)
        elapsed_ms = (time.monotonic() - start) * 1000
        assert r.status == 429, r.body[:200]
        assert int(r.headers["retry-after"]) >= 1
        err = json.loads(r.body)["error"]
        assert err["code"] == "rate_limit_exceeded" and "budget" in err["message"], err
        assert "rejected=ttft_budget" in r.headers["x-token-balancer"]
        assert elapsed_ms < 1000, elapsed_ms
        assert envoy.counter("token_balancer.rejected.ttft_budget") == 1
        assert sum(n.stats()["requests_total"] for n in cluster.nodes) == before, "never sent upstream"
        # A budget it can meet is served.
        r = envoy.post("/v1/chat/completions", body, {"x-slo-ttft-ms": "30000"}, timeout=20)
        assert r.status == 200, r.body[:200]
    finally:
        envoy.stop()


def test_a_sheddable_request_is_shed_under_saturation_and_others_wait(cluster):
    envoy = start_envoy(cluster)
    try:
        saturate(cluster)
        r = envoy.post("/v1/chat/completions", chat("batch job", 4), {OBJECTIVE: "batch"}, timeout=20)
        assert r.status == 429 and int(r.headers["retry-after"]) >= 1, (r.status, r.headers)
        assert envoy.counter("token_balancer.rejected.shed") == 1
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(envoy.post, "/v1/chat/completions", chat("chat", 4), None, 60)
            wait_until(lambda: envoy.counter("token_balancer.held_now") == 1, 10, "the request to be held")
            cluster[1].reset_health()
            assert pending.result(timeout=20).status == 200
    finally:
        envoy.stop()


def test_a_client_that_leaves_while_held_is_counted(cluster):
    envoy = start_envoy(cluster)
    try:
        saturate(cluster)
        body = json.dumps(chat("hello", 4)).encode()
        s = socket.create_connection(("127.0.0.1", envoy.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: envoy.counter("token_balancer.held_now") == 1, 10, "the request to be held")
        s.close()
        wait_until(lambda: envoy.counter("token_balancer.held_client_gone") == 1, 10,
                   "the departure to be counted")
        assert envoy.counter("token_balancer.held_now") == 0
    finally:
        envoy.stop()


def test_prompts_queued_past_the_limit_hold_a_request_until_a_node_drains(cluster):
    envoy = start_envoy(cluster, admission={"max_queued_ms": 200})
    try:
        # About a second of prompts queued at each node (100 requests of this size, at 1,000
        # tokens/s); their caches are empty.
        for n in cluster.nodes:
            n.set_health(tokens_per_sec_load=0, tokens_per_sec_capacity=1000, queue_depth=100)
        polls_seen(cluster)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(envoy.post, "/v1/chat/completions", chat("hello", 4), None, 60)
            wait_until(lambda: envoy.counter("token_balancer.held_now") == 1, 10, "the request to be held")
            cluster[1].set_health(tokens_per_sec_load=0, tokens_per_sec_capacity=1000, queue_depth=0)
            r = pending.result(timeout=20)
        assert r.status == 200, r.body[:200]
        assert r.headers["x-mock-node"] == "node-b"
        assert envoy.counter("token_balancer.routed_over_vram_ceiling") == 0
    finally:
        envoy.stop()


def test_long_prompts_leave_a_node_with_a_short_queue_to_another_tenant(cluster):
    """With `short_lane_ms`, node-a (nothing queued) is the last node whose queue is short:
    tenant docs' long prompt takes it while docs is the only tenant, a short request of tenant
    chat takes it too, and then, with chat active, docs' next long prompt goes to node-b, which
    has more queued, and leaves node-a to chat."""
    envoy = start_envoy(cluster, admission={"max_queued_ms": 600_000, "short_lane_ms": 200})
    try:
        # node-b has 50 requests queued (half a second or more of prompts at 1,000 tokens/s,
        # whatever the mean request the filter has learned), node-a none; caches empty.
        cluster[0].set_health(tokens_per_sec_load=0, tokens_per_sec_capacity=1000, queue_depth=0)
        cluster[1].set_health(tokens_per_sec_load=0, tokens_per_sec_capacity=1000, queue_depth=50)
        polls_seen(cluster)

        def send(body, tenant):
            r = envoy.post("/v1/chat/completions", body, {TENANT: tenant}, 30)
            assert r.status == 200, r.body[:200]
            return r.headers["x-mock-node"]

        # About 1,000 prompt tokens: a second at node-a, longer than the lane's 200 ms.
        assert send(long_chat(0), "docs") == "node-a"
        assert send(chat("short", 4), "chat") == "node-a"
        assert send(long_chat(1), "docs") == "node-b"
        assert send(chat("short again", 4), "chat") == "node-a"
        assert envoy.counter("token_balancer.held") == 0
    finally:
        envoy.stop()


def test_a_time_per_token_budget_avoids_the_node_seen_decoding_slowly():
    """An H100-like node decodes a token in about 8 ms, an L4-like one in about 17: once the
    filter has seen streams complete on both, a request that accepts 12 ms a token goes to the
    H100-like node every time, even while the ranking prefers the other, and one that accepts
    2 ms is answered 429; so is one whose two budgets are each met on one node and together on
    none."""
    c = MockCluster([("fast", "gpu=h100,kv_tokens=20000"), ("slow", "gpu=l4,kv_tokens=20000")])
    envoy = None
    try:
        cfg = envoy_config([n.address for n in c.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": 60_000, "choices": 0})
        envoy = Envoy(cfg)
        polls_seen(c)
        # Streams on both nodes: the fast one made to look busy while the slow one gets two.
        def streams_on(name: str):
            for _ in range(2):
                r = envoy.post("/v1/chat/completions", chat("tell me more", 40, stream=True), timeout=20)
                assert r.status == 200 and r.headers["x-mock-node"] == name, (r.status, r.headers)

        c[0].set_health(tokens_per_sec_load=1e9)
        polls_seen(c)
        streams_on("slow")
        c[0].reset_health()
        polls_seen(c)
        streams_on("fast")
        # The fast node looks busy again, so the ranking alone would pick the slow one.
        c[0].set_health(tokens_per_sec_load=1e9)
        polls_seen(c)
        r = envoy.post("/v1/chat/completions", chat("quick", 4), timeout=20)
        assert r.headers["x-mock-node"] == "slow", r.headers
        budget = {"x-slo-tpot-ms": "12"}
        for _ in range(6):
            r = envoy.post("/v1/chat/completions", chat("quick", 4, stream=True), budget, timeout=20)
            assert r.status == 200 and r.headers["x-mock-node"] == "fast", (r.status, r.headers)
        r = envoy.post("/v1/chat/completions", chat("quick", 4, stream=True), {"x-slo-tpot-ms": "2"}, timeout=20)
        assert r.status == 429 and r.headers["retry-after"] == "1", (r.status, r.headers)
        assert envoy.counter("token_balancer.rejected.ttft_budget") == 1
        # Now the fast node's queue is long too: it decodes in time but starts too late, and
        # the slow node starts in time but decodes too slowly. Each budget alone is met
        # somewhere; both together nowhere, and that is answered 429, not sent to miss one.
        c[0].set_health(tokens_per_sec_load=1e9, queue_depth=1e6)
        polls_seen(c)
        ttft = {"x-slo-ttft-ms": "10000"}
        r = envoy.post("/v1/chat/completions", chat("quick", 4, stream=True), ttft, timeout=20)
        assert r.status == 200 and r.headers["x-mock-node"] == "slow", (r.status, r.headers)
        r = envoy.post("/v1/chat/completions", chat("quick", 4, stream=True), budget, timeout=20)
        assert r.status == 200 and r.headers["x-mock-node"] == "fast", (r.status, r.headers)
        r = envoy.post("/v1/chat/completions", chat("quick", 4, stream=True), {**ttft, **budget}, timeout=20)
        assert r.status == 429 and r.headers["retry-after"] == "1", (r.status, r.headers)
        assert envoy.counter("token_balancer.rejected.ttft_budget") == 2
    finally:
        if envoy:
            envoy.stop()
        c.stop()
