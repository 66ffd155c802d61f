"""Integration tests with real inference engines: the real Envoy and the filter in front of real
llama.cpp `llama-server` processes (CPU, SmolLM2-135M; scripts/llama-server.sh builds and fetches
them once into a cache outside the repository, tests/real_engines.py runs them).

The servers are unequal (slots and context size). Most tests configure each node explicitly
(`health_path: /metrics`, `format: llamacpp`, the server started with `--metrics`, and `models`
naming what the clients send); one gives the addresses alone. Then:
- the filter routes by its own choice (`routed` grows, no `fallback.*`);
- the official openai client gets completions and streams (with the usage chunk when asked);
- OpenAI's Responses API, Anthropic's Messages API, token-id prompts, `/tokenize` and
  `/v1/messages/count_tokens` (booked at nothing), and llama.cpp's native `/completion` are
  priced and routed;
- a server killed under load costs no failed non-streaming request (Envoy retries on the
  filter's next pick, the filter ejects the node) and is taken back when it returns;
- the README's minimal configuration (node addresses only) routes too: the filter finds the
  servers' load at /metrics and routes whatever model name the client sends;
- a prompt longer than a server's per-slot context (from its /v1/models, since llama.cpp
  b11434 publishes no KV metric) goes to a server where it fits.

Without the binary or the model these tests skip, saying why; with TB_REAL_ENGINES=1 a missing
engine fails them. Facts about what llama-server answers: tests/REAL_ENGINES.md.
"""

from __future__ import annotations

import collections
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import real_engines
from harness import Envoy, envoy_config, free_port, node_stat, wait_until, with_node_settings
from real_engines import Fleet, Spec, chat

MODEL = "smollm2"
TICK_MS = 100
# A real server answers /metrics through its task queue, between decode steps: slower than the
# mock under load, so reports are trusted a little longer than in the mock tests.
STALE_MS = 2_000

SPECS = [
    Spec("big", parallel=4, ctx_size=4096, aliases=(MODEL,)),
    Spec("mid", parallel=2, ctx_size=2048, aliases=(MODEL,)),
    Spec("small", parallel=1, ctx_size=1024, aliases=(MODEL,)),
]


def llamacpp_node(**extra) -> dict:
    """The per-node settings a llama.cpp node needs today."""
    return {"health_path": "/metrics", "format": "llamacpp", "models": [MODEL], **extra}


def fallbacks(envoy) -> dict[str, int]:
    return {k: v for k, v in envoy.counters().items() if k.startswith("token_balancer.fallback.")}


def picked(r) -> str:
    """The node the filter chose for a response (the first entry of its routing header)."""
    header = r.headers.get("x-token-balancer", "")
    assert header.startswith("node="), (r.status, header, r.body[:200])
    return header.removeprefix("node=").split(";")[0].split(",")[0]


def start_envoy(fleet: Fleet, settings: list[dict], plugin: dict | None = None) -> Envoy:
    cfg = envoy_config([s.address for s in fleet], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS, **(plugin or {})})
    return Envoy(with_node_settings(cfg, settings))


def fresh_reports(envoy, nodes: int, rounds: int = 3):
    """Waits for `rounds` more good polls of every node (the worker's VM and the main thread's
    both poll, so a round is 2 x nodes answers)."""
    start = envoy.counter("token_balancer.health.ok")
    wait_until(lambda: envoy.counter("token_balancer.health.ok") >= start + 2 * nodes * rounds, 20,
               lambda: f"{rounds} rounds of good health polls: {envoy.counters()}")


def test_a_real_engine_is_available():
    """Skips (or, with TB_REAL_ENGINES=1, fails) when the engine is missing, saying why: the
    one place a fresh machine learns what to run."""
    real_engines.require()
    binary, model = real_engines.paths()
    assert binary.stat().st_size > 1_000_000 and model.stat().st_size > 50_000_000


@pytest.fixture
def engine():
    """The engine is there (else skipped, or failed with TB_REAL_ENGINES=1). A fixture, not a
    call in the test: a missing engine must not count as the expected failure of an xfail."""
    real_engines.require()


@pytest.fixture(scope="module")
def fleet():
    real_engines.require()
    with Fleet(SPECS) as f:
        yield f


@pytest.fixture(scope="module")
def envoy(fleet):
    # The third node leaves `format` out: `auto` tells llama.cpp by its metric prefix.
    settings = [llamacpp_node(), llamacpp_node(), {k: v for k, v in llamacpp_node().items() if k != "format"}]
    e = start_envoy(fleet, settings)
    try:
        fresh_reports(e, len(SPECS))
        yield e
    finally:
        e.stop()


def test_the_filter_routes_real_servers_by_its_own_choice(fleet, envoy):
    before = envoy.counters()
    fell_back = fallbacks(envoy)
    n = 24

    def ask(i):
        return envoy.post("/v1/chat/completions", chat(f"Question {i}: what is {i} plus {i}?", 8), timeout=120)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(ask, range(n)))
    for r in responses:
        assert r.status == 200, (r.status, r.body[:300])
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"], body
        assert 1 <= body["usage"]["completion_tokens"] <= 8, body["usage"]
    choices = collections.Counter(picked(r) for r in responses)
    assert set(choices) <= set(fleet.by_address()), choices
    after = envoy.counters()
    assert after.get("token_balancer.routed", 0) == before.get("token_balancer.routed", 0) + n
    assert fallbacks(envoy) == fell_back, "no request fell back to Envoy's balancer"
    assert after.get("token_balancer.health.unparsable", 0) == 0, "every /metrics answer was read"
    # With six clients at once the requests in flight spread the choice over the servers.
    assert len(choices) >= 2, choices
    picks = {s.name: after.get(node_stat(s.address, "picks"), 0) for s in fleet}
    assert sum(picks.values()) >= n and sum(1 for v in picks.values() if v) >= 2, picks
    # The servers did the work: their own counters saw it.
    served = 0
    for s in fleet:
        text = s.get("/metrics").body.decode()
        served += int(float(next(line.split()[1] for line in text.splitlines()
                                 if line.startswith("llamacpp:tokens_predicted_total "))))
    assert served >= n, served


def test_the_openai_client_through_envoy(envoy):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{envoy.port}/v1", api_key="not-needed", max_retries=0,
                           timeout=120)
    routed = envoy.counter("token_balancer.routed")
    fell_back = fallbacks(envoy)
    messages = [{"role": "user", "content": "Name a colour."}]

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                           temperature=0)
    assert raw.headers["x-token-balancer"].startswith("node=127.0.0.1:")
    r = raw.parse()
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # Streamed, with the usage chunk asked for: the last chunk has no choices and the usage.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert 1 <= chunks[-1].usage.completion_tokens <= 12
    assert sum(1 for c in chunks if c.usage) == 1
    # Without stream_options no chunk carries usage (as OpenAI's API says).
    plain = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices)
    assert not any(c.usage for c in plain), [c.usage for c in plain if c.usage]

    # The legacy completions API, plain and streamed.
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert c.choices[0].text and 1 <= c.usage.completion_tokens <= 6
    streamed = "".join(x.choices[0].text for x in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True) if x.choices)
    assert streamed == c.choices[0].text, "greedy decoding: the same text streamed or not"

    assert envoy.counter("token_balancer.routed") == routed + 5
    assert fallbacks(envoy) == fell_back


def test_the_responses_api_through_envoy(envoy):
    """OpenAI's Responses API (llama-server serves /v1/responses): OpenAI's own client, whole
    and streamed, routed by the filter's choice and priced from the instructions and input at
    `max_output_tokens` (the debug header says what it booked)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{envoy.port}/v1", api_key="not-needed", max_retries=0,
                           timeout=120)
    routed = envoy.counter("token_balancer.routed")
    fell_back = fallbacks(envoy)
    raw = client.responses.with_raw_response.create(model=MODEL, instructions="Answer briefly.",
                                                    input="Name a colour.", max_output_tokens=16, temperature=0)
    booked = dict(kv.split("=", 1) for kv in raw.headers["x-token-balancer"].split("; "))
    assert booked["node"].startswith("127.0.0.1:"), booked
    # A generation (an embedding would book no output): at its cap, or below it at the output
    # the filter has learned from the answers of this module's earlier tests.
    assert 1 <= int(booked["output_tokens"]) <= 16 and int(booked["prompt_tokens"]) > 8, booked
    r = raw.parse()
    assert r.object == "response" and r.output_text, r
    assert 1 <= r.usage.output_tokens <= 16 and r.usage.input_tokens > 0, r.usage

    # Streamed: `response.output_text.delta` events, then `response.completed` with the usage.
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Name a colour."}],
                                          max_output_tokens=12, temperature=0, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(e.delta for e in deltas), [e.type for e in events]
    assert events[-1].type == "response.completed", [e.type for e in events]
    assert 1 <= events[-1].response.usage.output_tokens <= 12

    assert envoy.counter("token_balancer.routed") == routed + 2
    assert fallbacks(envoy) == fell_back


def test_token_ids_counting_and_the_native_endpoint_through_envoy(envoy):
    """What clients with their own tokenizer and llama.cpp's own clients send: `/tokenize`
    (routed at no cost: it books nothing), a completion whose prompt is those token ids (booked
    at exactly as many prompt tokens), and llama.cpp's native `/completion`, capped by
    `n_predict`, whole and streamed. Every one routed by the filter's choice."""
    routed = envoy.counter("token_balancer.routed")
    fell_back = fallbacks(envoy)

    def booked(r) -> dict:
        return dict(kv.split("=", 1) for kv in r.headers["x-token-balancer"].split("; "))

    r = envoy.post("/tokenize", {"content": "Once upon a time, in a land far away, there lived"}, timeout=60)
    assert r.status == 200, r.body[:200]
    assert (booked(r)["prompt_tokens"], booked(r)["output_tokens"]) == ("0", "0"), booked(r)
    ids = r.json()["tokens"]
    assert len(ids) >= 8 and all(isinstance(i, int) for i in ids), ids

    r = envoy.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0},
                   timeout=120)
    assert r.status == 200, r.body[:200]
    assert booked(r)["prompt_tokens"] == str(len(ids)), (booked(r), len(ids))
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ids) and 1 <= usage["completion_tokens"] <= 6, usage

    r = envoy.post("/completion", {"prompt": "Once upon a time", "n_predict": 5, "temperature": 0}, timeout=120)
    assert r.status == 200, r.body[:200]
    assert 1 <= int(booked(r)["output_tokens"]) <= 5, booked(r)
    whole = r.json()
    assert whole["content"] and 1 <= whole["tokens_predicted"] <= 5, whole
    r = envoy.post("/completion", {"prompt": "Once upon a time", "n_predict": 5, "temperature": 0,
                                   "stream": True}, timeout=120)
    assert r.status == 200, r.body[:200]
    events = [json.loads(line.removeprefix("data: ")) for line in r.body.decode().splitlines()
              if line.startswith("data: ")]
    assert "".join(e.get("content", "") for e in events) == whole["content"], events
    assert events[-1]["stop"] is True, events[-1]

    assert envoy.counter("token_balancer.routed") == routed + 4
    assert fallbacks(envoy) == fell_back


def test_anthropics_messages_api_through_envoy(envoy):
    """Anthropic's Messages API (llama-server serves /v1/messages and /v1/messages/count_tokens):
    priced from `system` and the content blocks at `max_tokens`, whole and streamed; counting
    the same conversation's tokens is routed at no cost."""
    routed = envoy.counter("token_balancer.routed")
    fell_back = fallbacks(envoy)

    def booked(r) -> dict:
        return dict(kv.split("=", 1) for kv in r.headers["x-token-balancer"].split("; "))

    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "system": "Answer briefly.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}
    r = envoy.post("/v1/messages", body, timeout=120)
    assert r.status == 200, r.body[:200]
    assert int(booked(r)["prompt_tokens"]) > 8 and 1 <= int(booked(r)["output_tokens"]) <= 12, booked(r)
    whole = r.json()
    assert whole["type"] == "message" and whole["content"][0]["text"], whole
    assert 1 <= whole["usage"]["output_tokens"] <= 12, whole["usage"]

    r = envoy.post("/v1/messages", {**body, "stream": True}, timeout=120)
    assert r.status == 200, r.body[:200]
    events = [json.loads(line.removeprefix("data: ")) for line in r.body.decode().splitlines()
              if line.startswith("data: ")]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"], (text, whole)
    assert events[-1]["type"] == "message_stop", events[-1]

    r = envoy.post("/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"}, timeout=60)
    assert r.status == 200, r.body[:200]
    assert (booked(r)["prompt_tokens"], booked(r)["output_tokens"]) == ("0", "0"), booked(r)
    assert r.json()["input_tokens"] > 8, r.json()

    assert envoy.counter("token_balancer.routed") == routed + 3
    assert fallbacks(envoy) == fell_back


def test_streams_that_ask_no_usage_still_count_the_prompt(fleet):
    """llama-server sends a stream's usage only when the client asks for it
    (`stream_options.include_usage`), as OpenAI's API says, but puts its `timings` on the last
    event of every stream: the prompt tokens it computed (`prompt_n`) and found cached
    (`cache_n`). The filter learns how the server counts prompts from those, so streams that
    ask for nothing calibrate its estimates too. The same prompt each time: after the first,
    almost all of it is cached, and the two parts still add up to the server's count."""
    envoy = start_envoy(fleet, [llamacpp_node() for _ in SPECS])
    ratio = "token_balancer.prompt_ratio_permille"
    try:
        fresh_reports(envoy, len(SPECS))
        text = "In one word, what is this about? " + " ".join(
            "the model server request token cluster latency memory answer question".split() * 8)
        # The server's own count of this prompt, asked directly.
        counted = fleet[0].post("/v1/chat/completions", chat(text, 1)).json()["usage"]["prompt_tokens"]

        def stream():
            r = envoy.post("/v1/chat/completions", chat(text, 2, stream=True), timeout=120)
            assert r.status == 200, (r.status, r.body[:300])
            events = real_engines.sse_events(r.body)
            assert not [e for e in events if isinstance(e, dict) and e.get("usage")], "no usage was asked for"
            assert any(isinstance(e, dict) and "timings" in e for e in events), events[-2:]
            return r

        booked = dict(kv.split("=", 1) for kv in stream().headers["x-token-balancer"].split("; "))
        estimate = int(booked["prompt_tokens"])
        assert envoy.counter(ratio) in (0, 1000), "not learned from one answer"
        for _ in range(24):
            stream()
        wait_until(lambda: envoy.counter(ratio) not in (0, 1000), 10,
                   lambda: f"the ratio learned (gauge {envoy.counter(ratio)})")
        expected = 1000 * counted / estimate
        assert abs(envoy.counter(ratio) - expected) <= 0.05 * expected + 10, (envoy.counter(ratio), counted, estimate)
    finally:
        envoy.stop()


def test_a_real_server_killed_under_load_costs_no_failed_request(engine):
    specs = [Spec("a", parallel=2, ctx_size=2048, aliases=(MODEL,)),
             Spec("b", parallel=2, ctx_size=2048, aliases=(MODEL,)),
             Spec("victim", parallel=2, ctx_size=2048, aliases=(MODEL,))]
    fleet = Fleet(specs)
    envoy = None
    stop = threading.Event()
    results: list[tuple[int, str]] = []
    clients: list[threading.Thread] = []
    try:
        victim = fleet[2]
        envoy = start_envoy(fleet, [llamacpp_node()] * 3)
        fresh_reports(envoy, 3)
        victim_picks = node_stat(victim.address, "picks")

        def client(i):
            k = 0
            while not stop.is_set():
                k += 1
                try:
                    r = envoy.post("/v1/chat/completions", chat(f"Client {i}, question {k}: say a word.", 12),
                                   timeout=120)
                    results.append((r.status, r.body[:160].decode("utf-8", "replace") if r.status != 200 else ""))
                except (OSError, http.client.HTTPException) as e:
                    results.append((0, repr(e)))

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in clients:
            t.start()
        wait_until(lambda: envoy.counter(victim_picks) >= 3, 60, "the victim to serve")

        # Killed while it generates: a request in flight there must be retried elsewhere.
        def generating():
            text = victim.get("/metrics", timeout=2).body.decode()
            return any(line.startswith("llamacpp:requests_processing ") and float(line.split()[1]) >= 1
                       for line in text.splitlines())
        wait_until(generating, 60, "a request in flight on the victim", interval=0.01)
        victim.kill()
        killed_at = time.monotonic()
        victim.stop()
        wait_until(lambda: envoy.counter("token_balancer.nodes_ejected") >= 1, 10,
                   lambda: f"the dead server to be ejected: {envoy.counters()}")
        ejected_after = time.monotonic() - killed_at
        assert ejected_after < 2 * TICK_MS / 1000 + 1.0, ejected_after
        # The VMs' picks settle once every VM ejected it; none lands there afterwards.
        done = len(results)
        wait_until(lambda: len(results) >= done + 4, 60, "4 more requests")
        picks = envoy.counter(victim_picks)
        done = len(results)
        wait_until(lambda: len(results) >= done + 12, 60, "12 more requests")
        assert envoy.counter(victim_picks) == picks, "a request was routed to the dead server"

        # Back on the same port: readmitted after good polls, and chosen again.
        fleet.servers[2] = real_engines.start(victim.spec, port=victim.port, log_dir=fleet.log_dir)
        wait_until(lambda: envoy.counter("token_balancer.nodes_readmitted") >= 1, 20, "readmission")
        wait_until(lambda: envoy.counter(victim_picks) > picks, 60, "the returned server to be chosen again")
        stop.set()
        for t in clients:
            t.join(130)

        failed = [r for r in results if r[0] != 200]
        retries = envoy.stats("cluster.gpu_nodes.upstream_rq_retry")
        assert not failed, (len(failed), failed[:3], retries)
        # (Killed mid-generation, the victim nearly always leaves a request to retry: 1 to 4 here.)
        assert retries.get("cluster.gpu_nodes.upstream_rq_retry_limit_exceeded", 0) == 0, retries
        assert retries.get("cluster.gpu_nodes.upstream_rq_retry_overflow", 0) == 0, retries
        assert len(results) >= 20, len(results)
    finally:
        stop.set()
        for t in clients:
            t.join(130)
        if envoy is not None:
            envoy.stop()
        fleet.stop()


def test_zero_config_routes_to_llamacpp(engine):
    """The README's minimal configuration (node addresses only) in front of llama-servers as
    they are usually started (the model file, --metrics, no alias): the filter finds their
    load at /metrics (their /health says only {"status":"ok"}), says so once per node, and
    routes by its own choice, whatever model name the client sends (llama.cpp serves any)."""
    with Fleet([Spec("plain-a", parallel=2, ctx_size=2048), Spec("plain-b", parallel=1, ctx_size=1024)]) as fleet:
        listed = fleet[0].get("/v1/models").json()["data"][0]["id"]
        assert listed.endswith(".gguf"), listed
        # Nothing but the addresses (the harness adds its ports, the debug header and the poller mode).
        envoy = Envoy(envoy_config([s.address for s in fleet], free_port(), free_port()))
        try:
            wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 8, 20,
                       lambda: f"good polls of both servers' /metrics: {envoy.counters()}")
            assert envoy.counter("token_balancer.telemetry.discovered") >= 2
            assert envoy.counter("token_balancer.telemetry.not_found") == 0
            for s in fleet:
                line = (f"node {s.address}: /health is not telemetry (JSON that is not the health format); "
                        "reading /metrics (llama.cpp metrics) instead")
                assert line in envoy.log_text(), line
            # The model lists come with the first rounds; until then any name is a candidate.
            wait_until(lambda: envoy.counter("token_balancer.models.ok") >= 4, 20, "both model lists")
            fell_back = fallbacks(envoy)
            routed = envoy.counter("token_balancer.routed")
            names = [listed, MODEL, "gpt-4o", None]
            for i in range(8):
                r = envoy.post("/v1/chat/completions", chat(f"Hello {i}.", 4, model=names[i % 4]), timeout=120)
                assert r.status == 200, (r.status, r.body[:300])
                assert picked(r) in fleet.by_address(), r.headers
            assert envoy.counter("token_balancer.routed") == routed + 8
            assert fallbacks(envoy) == fell_back, (fell_back, fallbacks(envoy))
            assert envoy.counter("token_balancer.health.unparsable") == 0
        finally:
            envoy.stop()


def test_a_prompt_longer_than_a_servers_context_goes_to_a_server_it_fits(engine):
    """llama.cpp b11434 publishes no KV metric, but its /v1/models gives each slot's context
    (`meta.n_ctx`): a prompt longer than that is not sent there (it would be refused with 400
    exceed_context_size_error), even to the server the ranking prefers, and even with the
    model names configured (the list is asked for the context alone)."""
    # One slot each: the whole context is the slot's. The cramped server is the one the
    # ranking prefers (ten times the configured capacity): only a context check can avoid it.
    roomy = Spec("roomy", parallel=1, ctx_size=4096, aliases=(MODEL,))
    cramped = Spec("cramped", parallel=1, ctx_size=512, aliases=(MODEL,))
    with Fleet([roomy, cramped]) as fleet:
        envoy = start_envoy(fleet, [
            llamacpp_node(capacity_tokens_per_sec=1_000),
            llamacpp_node(capacity_tokens_per_sec=10_000),
        ], plugin={"choices": 0})
        try:
            fresh_reports(envoy, 2)
            wait_until(lambda: envoy.counter("token_balancer.models.ok") >= 4, 20, "both servers' contexts")
            r = envoy.post("/v1/chat/completions", chat("Hi.", 4), timeout=120)
            assert r.status == 200 and picked(r) == fleet[1].address, (r.status, r.headers)
            # About 1,350 tokens by the filter's estimate (2,000 by llama.cpp's count): over the
            # cramped server's 512, well inside the roomy one's 4,096.
            long_prompt = "lorem ipsum dolor sit amet " * 200
            for _ in range(4):
                r = envoy.post("/v1/chat/completions", chat(long_prompt, 8), timeout=120)
                assert r.status == 200, (r.status, r.headers.get("x-token-balancer"), r.body[:300])
                assert picked(r) == fleet[0].address
            # Short prompts still go to the preferred server.
            r = envoy.post("/v1/chat/completions", chat("Hi again.", 4), timeout=120)
            assert r.status == 200 and picked(r) == fleet[1].address, (r.status, r.headers)
        finally:
            envoy.stop()
