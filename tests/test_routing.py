"""Integration tests: the real Envoy, the built token_balancer.wasm, mock GPU nodes.

Each test states the behaviour it guards; each assertion fails when that behaviour breaks.
"""

from __future__ import annotations

import collections
import http.client
import json
import time

import pytest

import harness
from harness import (KV_BYTES_PER_TOKEN, Envoy, MockCluster, chat, envoy_config, free_port,
                     node_stat, request, wait_until)

TICK_MS = 100
STALE_MS = 600
KV_TOKENS = 20_000


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", f"gpu=h100,kv_tokens={KV_TOKENS}"),
                     ("node-b", f"gpu=h100,kv_tokens={KV_TOKENS}"),
                     ("node-c", f"gpu=h100,kv_tokens={KV_TOKENS}")])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def envoy(cluster):
    # Every node compared (choices 0): these tests name the node the ranking must pick.
    # test_two_choices_* run power-of-two choices.
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS, "choices": 0})
    e = Envoy(cfg)
    yield e
    e.stop()


def polls_seen(cluster, rounds: int = 4):
    harness.polls_seen(cluster, TICK_MS, rounds)


@pytest.fixture(autouse=True)
def clean_health(cluster, envoy):
    for n in cluster.nodes:
        n.reset_health()
    polls_seen(cluster)
    yield


def served_by(r) -> str:
    assert r.status == 200, (r.status, r.body[:200])
    return r.headers["x-mock-node"]


def spread(envoy, n: int, body, headers=None) -> collections.Counter:
    return collections.Counter(served_by(envoy.post("/v1/chat/completions", body, headers))
                               for _ in range(n))


def test_requests_are_routed_by_the_filter(envoy):
    before = envoy.counter("token_balancer.routed")
    r = envoy.post("/v1/chat/completions", chat("hello there", 4))
    assert r.status == 200
    assert r.headers["x-token-balancer"].startswith("node=127.0.0.1:")
    assert envoy.counter("token_balancer.routed") == before + 1


def test_a_node_reporting_high_load_gets_no_new_requests(cluster, envoy):
    """A node whose tokens_per_sec_load is near its capacity is passed over while others
    are free."""
    # Control: idle and equal, every node gets a share.
    assert set(spread(envoy, 30, chat("hi", 2))) == {"node-a", "node-b", "node-c"}
    capacity = cluster[0].health()["tokens_per_sec_capacity"]
    cluster[0].set_health(tokens_per_sec_load=capacity * 0.99)
    polls_seen(cluster)
    got = spread(envoy, 30, chat("hi", 2))
    assert got["node-a"] == 0, got
    assert got["node-b"] > 0 and got["node-c"] > 0, got


def test_a_long_prompt_avoids_a_node_whose_vram_would_overflow(cluster, envoy):
    """node-a is the least loaded but its KV cache is 85% full: a short request still goes
    there, a long one (whose KV would pass the 0.9 ceiling) goes elsewhere."""
    capacity = cluster[0].health()["tokens_per_sec_capacity"]
    total = KV_TOKENS * KV_BYTES_PER_TOKEN
    cluster[0].set_health(tokens_per_sec_load=0, vram_used_bytes=int(total * 0.85), vram_total_bytes=total)
    for n in cluster.nodes[1:]:
        n.set_health(tokens_per_sec_load=capacity * 0.5)
    polls_seen(cluster)
    short = chat("a short question", 16)
    assert spread(envoy, 5, short) == {"node-a": 5}
    # 0.05 * 20000 = 1000 tokens of headroom; this prompt is ~3000 tokens.
    long = chat("lorem ipsum dolor sit amet " * 450, 16)
    got = spread(envoy, 5, long)
    assert got["node-a"] == 0 and sum(got.values()) == 5, got


def test_a_client_supplied_routing_header_is_ignored(cluster, envoy):
    """A client naming a node in x-gateway-destination-endpoint does not get it."""
    capacity = cluster[0].health()["tokens_per_sec_capacity"]
    cluster[0].set_health(tokens_per_sec_load=capacity * 0.99)
    polls_seen(cluster)
    before = envoy.counter("token_balancer.client_routing_header_removed")
    got = spread(envoy, 10, chat("hi", 2), headers={"x-gateway-destination-endpoint": cluster[0].address})
    assert got["node-a"] == 0, got
    assert envoy.counter("token_balancer.client_routing_header_removed") == before + 10
    # Also for requests the filter cannot route (no body): the header is still removed, so
    # Envoy's fallback spreads them instead of obeying the client.
    fallback = collections.Counter(
        served_by(request(envoy.port, "GET", "/v1/models",
                          headers={"x-gateway-destination-endpoint": cluster[0].address}))
        for _ in range(12))
    assert fallback["node-a"] < 12, fallback


def test_with_every_health_endpoint_down_requests_still_succeed(cluster, envoy):
    """Health down everywhere: once the data is stale the filter sets no routing header and
    Envoy's least_request fallback serves every request."""
    for n in cluster.nodes:
        n.set_health(fail=True)
    before = envoy.counter("token_balancer.fallback.no_fresh_nodes")
    wait_until(lambda: envoy.post("/v1/chat/completions", chat("hi", 1)).headers.get("x-token-balancer")
               == "fallback=no_fresh_nodes", 5, "reports to go stale")
    got = spread(envoy, 20, chat("hi", 2))
    assert sum(got.values()) == 20 and len(got) >= 2, got
    assert envoy.counter("token_balancer.fallback.no_fresh_nodes") >= before + 21
    assert envoy.counter("token_balancer.health.failed") > 0


def test_health_endpoints_unreachable_still_fail_open(cluster):
    """The same with the health endpoints refusing connections from the start."""
    dead = {n.address: f"127.0.0.1:{free_port()}" for n in cluster.nodes}
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS}, health_addresses=dead)
    e = Envoy(cfg)
    try:
        got = spread(e, 12, chat("hi", 2))
        assert sum(got.values()) == 12
        wait_until(lambda: e.counter("token_balancer.health.failed") >= 3, 5, "failed polls to be counted")
        assert e.counter("token_balancer.routed") == 0
        assert e.counter("token_balancer.fallback.no_fresh_nodes") == 12
    finally:
        e.stop()


def test_streaming_responses_arrive_intact_chunk_by_chunk(envoy):
    """SSE events pass through Envoy as the node emits them, not buffered, none lost (the usage
    asked for included)."""
    n_tokens = 40
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=30)
    body = json.dumps(chat("tell me a story", n_tokens, stream=True, stream_options={"include_usage": True}))
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.getheader("content-type", "").startswith("text/event-stream")
    events, arrivals, buf = [], [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            events.append(event.decode())
            arrivals.append(time.monotonic() - t0)
    conn.close()
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["delta"].get("content", "") for p in payloads for c in p["choices"])
    assert text == "".join(f"tok{i} " for i in range(n_tokens))
    usage = payloads[-1]["usage"]
    assert usage["completion_tokens"] == n_tokens
    # Chunk by chunk: the first token arrived long before the last one.
    assert arrivals[0] < 0.5 * arrivals[-1], (arrivals[0], arrivals[-1])
    assert len(set(round(a, 3) for a in arrivals)) > n_tokens // 2


def test_bodies_the_filter_cannot_read_still_reach_a_node(envoy):
    """Fail-open paths: no body, junk body, compressed body each reach a node untouched."""
    for path, body, headers, counter in [
        ("/v1/models", None, {}, "token_balancer.fallback.no_body"),
        ("/v1/chat/completions", b"{not json", {"content-type": "application/json"},
         "token_balancer.fallback.body_unusable"),
        ("/v1/chat/completions", b"\x1f\x8b\x08\x00junk", {"content-encoding": "gzip"},
         "token_balancer.fallback.encoded_body"),
    ]:
        before = envoy.counter(counter)
        r = request(envoy.port, "GET" if body is None else "POST", path, body=body, headers=headers)
        assert "x-mock-node" in r.headers, (path, r.status)
        assert envoy.counter(counter) == before + 1, counter


def test_a_bad_configuration_refuses_to_start_naming_the_field(cluster):
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"vram_ceiling": 7})
    e = Envoy(cfg, expect_ready=False)
    try:
        wait_until(lambda: "`vram_ceiling` must be in (0, 1]" in e.log_text(), 20, "the config error log line")
        wait_until(lambda: e.proc.poll() is not None, 20, "envoy to refuse the configuration")
    finally:
        e.stop()


def debug_fields(r) -> dict:
    return dict(kv.split("=", 1) for kv in r.headers["x-token-balancer"].split("; "))


def test_inflight_bookings_are_released_whatever_the_outcome(cluster, envoy):
    """Every routed request is booked in flight on its node until its stream ends, whether it
    completes, is aborted by the client mid-stream, or fails at the node."""
    import socket

    # Streams the client abandons after the first event.
    aborted = []
    for _ in range(9):
        s = socket.create_connection(("127.0.0.1", envoy.port))
        body = json.dumps(chat("tell me a long story", 500, stream=True)).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        s.settimeout(10)
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        aborted.append(s)
    # While those streams run, the filter counts them: requests now see them in flight.
    seen = [int(debug_fields(envoy.post("/v1/chat/completions", chat("hi", 1)))["inflight"]) for _ in range(6)]
    assert max(seen) >= 1, seen
    for s in aborted:
        s.close()
    # Requests the node rejects after the filter routed them (a chat body without messages).
    for _ in range(3):
        r = envoy.post("/v1/chat/completions", {"prompt": "not a chat body", "max_tokens": 3})
        assert r.status == 400 and "x-mock-node" in r.headers
    # Completed requests, streaming and not.
    for stream in (False, True):
        assert envoy.post("/v1/chat/completions", chat("hi", 3, stream=stream)).status == 200
    # Once everything has ended, no node has anything booked.
    wait_until(lambda: all(int(debug_fields(envoy.post("/v1/chat/completions", chat("hi", 1)))["inflight"]) == 0
                           for _ in range(9)), 10, "in-flight bookings to drop to zero")


def test_stats_count_picks_per_node(cluster, envoy):
    before = envoy.counters()
    got = spread(envoy, 9, chat("hi", 1))
    after = envoy.counters()
    for n in cluster.nodes:
        key = node_stat(n.address, "picks")
        assert after.get(key, 0) - before.get(key, 0) == got[n.name], (key, got)
    assert after["token_balancer.routed"] - before["token_balancer.routed"] == 9


def test_output_lengths_are_learned_from_responses(cluster):
    """Clients cap max_tokens far above what is generated; the filter learns the real output
    length from the responses it passes (streamed events, or the reported usage) and books
    that instead of the cap."""
    e = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS}))
    try:
        # Requests that fall back (no report yet in this worker) teach nothing; the first
        # routed one is booked at its cap.
        first = wait_until(lambda: debug_fields(e.post("/v1/chat/completions", chat("hi", 400),
                                                       headers={"x-mock-output-tokens": "6"})).get("output_tokens"),
                           10, "a routed request")
        assert first == "400", "before any sample the cap stands"
        for i in range(24):
            r = e.post("/v1/chat/completions", chat("hi", 400, stream=i % 2 == 0),
                       headers={"x-mock-output-tokens": "6"})
            assert r.status == 200
        learned = debug_fields(e.post("/v1/chat/completions", chat("hi", 400)))
        assert int(learned["output_tokens"]) == 6, learned
    finally:
        e.stop()


def test_responses_api_requests_are_priced_and_their_output_learned(cluster):
    """OpenAI's Responses API (POST /v1/responses, as vLLM and llama.cpp's server serve it):
    the request is priced from its instructions and input at its max_output_tokens, and its
    answers, streamed as `response.*.delta` events or whole, teach the real output length."""
    e = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS}))

    def body(stream: bool) -> dict:
        return {"model": "mock-model", "instructions": "Answer in one line. " * 50,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi there"}]}],
                "max_output_tokens": 400, "stream": stream}

    def routed():
        d = debug_fields(e.post("/v1/responses", body(False), headers={"x-mock-output-tokens": "6"}))
        return d if "output_tokens" in d else None

    try:
        first = wait_until(routed, 10, "a routed request")
        assert first["output_tokens"] == "400", first
        # 1,000 characters of instructions and two messages' overhead: about 260 tokens.
        assert 250 <= int(first["prompt_tokens"]) <= 270, first
        for i in range(24):
            r = e.post("/v1/responses", body(i % 2 == 0), headers={"x-mock-output-tokens": "6"})
            assert r.status == 200, r.body[:200]
        learned = debug_fields(e.post("/v1/responses", body(False)))
        assert int(learned["output_tokens"]) == 6, learned
    finally:
        e.stop()


def created_id(r) -> str:
    """The id of a streamed Responses answer, from its `response.created` event."""
    return next(json.loads(line[len("data: "):])["response"]["id"]
                for line in r.body.decode().splitlines()
                if line.startswith("data: ") and "response.created" in line)


def stored_conversation(cluster, envoy, topic: str) -> tuple[dict, str, str]:
    """A conversation's first turn, streamed through `envoy` and stored by the node that
    answered it, which is then made the busiest: its body, that node and the answer's id."""
    first = {"model": "mock-model", "input": topic * 40, "max_output_tokens": 64, "stream": True}
    r = envoy.post("/v1/responses", first, headers={"x-mock-output-tokens": "40"})
    home = served_by(r)
    node = next(n for n in cluster.nodes if n.name == home)
    node.set_health(tokens_per_sec_load=node.health()["tokens_per_sec_capacity"] * 0.99)
    polls_seen(cluster)
    return first, home, created_id(r)


def test_a_stored_conversation_goes_back_to_the_node_that_stores_it(cluster, envoy):
    """A Responses answer stored by its node (as vLLM keeps it, in each server's memory): the
    turns that continue it (previous_response_id), streamed or whole, and its poll
    (GET /v1/responses/{id}) go to that node even when the others are freer, and are priced
    with the stored conversation. Another node would answer 404."""
    names = {n.name: n for n in cluster.nodes}
    first, home, rid = stored_conversation(cluster, envoy, "Tell me about lighthouses. ")
    # The home node is now the busiest: a new conversation goes elsewhere.
    fresh = {**first, "input": "Another topic entirely: tides. " * 40, "stream": False}
    assert served_by(envoy.post("/v1/responses", fresh)) != home
    found = envoy.counter("token_balancer.stored.found")
    for turn in range(4):
        nxt = {"model": "mock-model", "input": f"And then, part {turn}?", "max_output_tokens": 64,
               "previous_response_id": rid, "stream": turn % 2 == 0}
        r = envoy.post("/v1/responses", nxt, headers={"x-mock-output-tokens": "20"})
        assert served_by(r) == home, turn
        # Priced with the stored turns: about 300 tokens of the first prompt and its answer.
        assert int(debug_fields(r)["prompt_tokens"]) > 300, debug_fields(r)
        rid = created_id(r) if turn % 2 == 0 else r.json()["id"]
    poll = request(envoy.port, "GET", f"/v1/responses/{rid}")
    assert served_by(poll) == home
    assert poll.json()["id"] == rid
    assert envoy.counter("token_balancer.stored.found") == found + 5
    # Sent to another node, the same turn is refused: the pin is what makes it work.
    other = next(n for name, n in names.items() if name != home)
    refused = request(other.port, "POST", "/v1/responses", body={**nxt, "previous_response_id": rid})
    assert refused.status == 404, refused


def test_a_conversation_continued_through_another_replica_goes_to_the_node_that_stores_it(cluster, envoy):
    """Two Envoy replicas behind one load balancer: a conversation's first answer passes one,
    its next turn the other, which never saw it stored. That replica asks the nodes where the
    response is (GET /v1/responses/{id}), sends the turn to the one that has it, and notes it:
    its next turn and poll go there without asking. A replica that does not ask sends the turn
    where the ranking says, and the node there answers 404."""
    plugin = {"tick_ms": TICK_MS, "stale_after_ms": STALE_MS, "choices": 0}
    other = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(), plugin=plugin))
    blind = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               plugin={**plugin, "stored_responses": {"ask_nodes": 0}}))
    try:
        # The home node is now the busiest: the ranking alone would send a turn elsewhere.
        _, home, rid = stored_conversation(cluster, envoy, "Tell me about harbours. ")
        nxt = {"model": "mock-model", "input": "And then?", "max_output_tokens": 64,
               "previous_response_id": rid, "stream": False}
        wait_until(lambda: other.counter("token_balancer.health.ok") >= 3, 10, "the other replica's reports")
        r = other.post("/v1/responses", nxt, headers={"x-mock-output-tokens": "20"})
        assert served_by(r) == home
        assert (other.counter("token_balancer.stored.asked"),
                other.counter("token_balancer.stored.asked_found")) == (1, 1)
        # Priced with the stored conversation the node's answer counted (its first prompt
        # and answer, about 290 of the engine's tokens), believed cached there.
        assert int(debug_fields(r)["cached_tokens"]) > 250, debug_fields(r)
        rid2 = r.json()["id"]
        r = other.post("/v1/responses", {**nxt, "previous_response_id": rid2},
                       headers={"x-mock-output-tokens": "20"})
        assert served_by(r) == home
        poll = request(other.port, "GET", f"/v1/responses/{rid}")
        assert served_by(poll) == home
        assert other.counter("token_balancer.stored.asked") == 1, "found here since"
        # A response no node has: asked, found nowhere, sent on (the node answers 404).
        gone = other.post("/v1/responses", {**nxt, "previous_response_id": "resp_nowhere"})
        assert gone.status == 404, gone
        assert other.counter("token_balancer.stored.asked") == 2
        # Without asking, the turn goes where the ranking says, and fails there.
        wait_until(lambda: blind.counter("token_balancer.health.ok") >= 3, 10, "the blind replica's reports")
        refused = blind.post("/v1/responses", {**nxt, "previous_response_id": rid2})
        assert refused.status == 404, refused
        assert blind.counter("token_balancer.stored.asked") == 0
    finally:
        other.stop()
        blind.stop()


def test_anthropic_messages_are_priced_and_their_output_learned(cluster):
    """Anthropic's Messages API (POST /v1/messages, as vLLM and llama.cpp's server serve it):
    priced from `system`, the content blocks and the tools at `max_tokens`, and its answers,
    streamed as Anthropic's events (thinking first) or whole, teach the real output length."""
    e = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS}))

    def body(stream: bool) -> dict:
        return {"model": "mock-model", "system": "Answer in one line. " * 50, "max_tokens": 400, "stream": stream,
                "tools": [{"name": "lookup", "description": "Look a word up.",
                           "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]}

    def routed():
        d = debug_fields(e.post("/v1/messages", body(False), headers={"x-mock-output-tokens": "6"}))
        return d if "output_tokens" in d else None

    try:
        first = wait_until(routed, 10, "a routed request")
        assert first["output_tokens"] == "400", first
        # 1,000 characters of system prompt, the tool's JSON and a message: about 280 tokens.
        assert 265 <= int(first["prompt_tokens"]) <= 295, first
        for i in range(24):
            r = e.post("/v1/messages", body(i % 2 == 0), headers={"x-mock-output-tokens": "6"})
            assert r.status == 200, r.body[:200]
        learned = debug_fields(e.post("/v1/messages", body(False)))
        assert int(learned["output_tokens"]) == 6, learned
    finally:
        e.stop()


def test_native_generate_and_token_id_requests_are_priced_and_their_output_learned(cluster):
    """SGLang's native /generate (the prompt as `text` or `input_ids`, the cap in
    `sampling_params`) and completions whose prompt is token ids: priced (ids exactly, one token
    an id; a batch decoded once per prompt) at the body's own cap, and the native answers,
    streamed or whole, teach the real output length from their `meta_info`."""
    e = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS}))
    ids = list(range(1000, 1300))

    def generate(stream: bool, **prompt) -> dict:
        return {"model": "mock-model", **prompt, "sampling_params": {"max_new_tokens": 400}, "stream": stream}

    def routed():
        d = debug_fields(e.post("/generate", generate(False, input_ids=ids), headers={"x-mock-output-tokens": "6"}))
        return d if "output_tokens" in d else None

    try:
        first = wait_until(routed, 10, "a routed request")
        assert (first["prompt_tokens"], first["output_tokens"]) == ("300", "400"), first
        text = debug_fields(e.post("/generate", generate(False, text="word " * 400),
                                   headers={"x-mock-output-tokens": "6"}))
        assert text["prompt_tokens"] == "500", text
        batch = debug_fields(e.post("/v1/completions", {"model": "mock-model", "prompt": [ids[:100], ids[:50]],
                                                        "max_tokens": 30},
                                   headers={"x-mock-output-tokens": "6"}))
        assert (batch["prompt_tokens"], batch["output_tokens"]) == ("150", "60"), batch
        for i in range(24):
            r = e.post("/generate", generate(i % 2 == 0, input_ids=ids), headers={"x-mock-output-tokens": "6"})
            assert r.status == 200, r.body[:200]
        learned = debug_fields(e.post("/generate", generate(False, input_ids=ids)))
        assert int(learned["output_tokens"]) == 6, learned
    finally:
        e.stop()


def test_images_are_priced_as_prompt_when_asked(envoy, cluster):
    """An image in a chat message is prompt for a vision model. With `images.enabled` it is
    priced from the size in its PNG header (1024 x 768: 1,004 tokens at the default 784 pixels
    a token), or, given as a link, at the default 1,024; by default images count nothing."""
    png = "iVBORw0KGgoAAAANSUhEUgAABAAAAAMACAIAAAA="

    def with_image(url: str) -> dict:
        return {**chat("Describe it.", 8), "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}]}

    def added(e, url: str) -> int:
        plain = int(debug_fields(e.post("/v1/chat/completions", chat("Describe it.", 8)))["prompt_tokens"])
        return int(debug_fields(e.post("/v1/chat/completions", with_image(url)))["prompt_tokens"]) - plain

    sent, linked = f"data:image/png;base64,{png}", "https://example.com/cat.png"
    assert (added(envoy, sent), added(envoy, linked)) == (0, 0)
    e = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                           plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS, "images": {"enabled": True}}))
    try:
        wait_until(lambda: "prompt_tokens" in debug_fields(e.post("/v1/chat/completions", chat("hi", 2))), 10,
                   "a routed request")
        assert (added(e, sent), added(e, linked)) == (1004, 1024)
    finally:
        e.stop()


def test_an_agents_tools_are_priced_as_its_prompt(envoy):
    """The tools a chat request offers are rendered into its prompt by the engine: the filter
    prices them (an agent's tool list is often thousands of tokens no message shows), in the
    engines' tokens once their answers have taught it how they count (this module's Envoy has
    served the earlier tests' requests: `prompt_ratio_permille`)."""
    tool = {"type": "function", "function": {
        "name": "read_file", "description": "Read one file of the repository and return it. " * 10,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    plain = debug_fields(envoy.post("/v1/chat/completions", chat("What does main.rs do?", 8)))
    agent = debug_fields(envoy.post("/v1/chat/completions",
                                    {**chat("What does main.rs do?", 8), "tools": [tool] * 8}))
    # Eight tools of about 500 characters each: about 1,100 tokens more by the filter's rule,
    # scaled by the ratio learned (its gauge moves in steps of 0.01: 2% of slack).
    permille = envoy.counter("token_balancer.prompt_ratio_permille")
    ratio = permille / 1000 if permille else 1.0
    added = int(agent["prompt_tokens"]) - int(plain["prompt_tokens"])
    assert 1000 * ratio * 0.98 <= added <= 1300 * ratio * 1.02, (plain, agent, ratio)


def test_two_choices_spread_and_keep_the_rules(cluster):
    """Power-of-two choices (what `choices: auto` uses behind many routers): equal idle nodes
    share the requests, the most loaded of three nodes never wins a draw, and a long prompt
    still avoids a node whose VRAM it would overflow."""
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS, "choices": 2})
    e = Envoy(cfg)
    try:
        for n in cluster.nodes:
            n.reset_health()
        polls_seen(cluster)
        assert set(spread(e, 30, chat("hi", 2))) == {"node-a", "node-b", "node-c"}
        capacity = cluster[0].health()["tokens_per_sec_capacity"]
        cluster[0].set_health(tokens_per_sec_load=capacity * 0.99)
        polls_seen(cluster)
        got = spread(e, 30, chat("hi", 2))
        assert got["node-a"] == 0 and got["node-b"] > 0 and got["node-c"] > 0, got
        total = KV_TOKENS * KV_BYTES_PER_TOKEN
        cluster[0].set_health(tokens_per_sec_load=0, vram_used_bytes=int(total * 0.85),
                              vram_total_bytes=total)
        polls_seen(cluster)
        got = spread(e, 10, chat("lorem ipsum dolor sit amet " * 450, 16))
        assert got["node-a"] == 0 and sum(got.values()) == 10, got
    finally:
        e.stop()
        for n in cluster.nodes:
            n.reset_health()
