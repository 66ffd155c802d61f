"""Integration tests: a fleet of mixed engines, and model-aware routing, through the real Envoy.

(i) One cluster of four nodes, each read in its own way: vLLM metrics (format vllm), SGLang
metrics (format auto), TGI metrics (format tgi) and the seed JSON. Each node in turn reports a
long queue, then a full KV cache, through the mock's overrides (which reach /metrics in the
engine's own names); it must get no new requests while the others share them.

(ii) Nodes serving m1 (configured), m2 (learned from /v1/models) and LoRA adapters (learned
from /v1/models, vLLM metrics): a request lands only on a node serving its model; an unknown
model is answered 404 model_not_found by the filter (`unknown_model: reject`) or left to
Envoy's balancer (`fallback`).

(iii) A node's /v1/models is learned at runtime: its models are routed to it, the last good list
survives the node going down, and a node back with another list is learned anew.
"""

from __future__ import annotations

import collections
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (KV_BYTES_PER_TOKEN, Envoy, MockCluster, chat, envoy_config, free_port,
                     polls_seen, request, wait_until, with_node_settings)

TICK_MS = 100
STALE_MS = 600
MODELS_POLL_MS = 200
KV_TOKENS = 20_000
# Configured for every node: engines report no capacity and would otherwise be ranked by the
# peak rate this light test traffic reaches, against the seed node's reported capacity. It is
# set well above what the test traffic reaches, so that the reported load (over windows of
# 100 ms to 1 s, noisy at this traffic) shifts the ranking less than the requests in flight do,
# and equal nodes share requests.
CAPACITY = 200_000


def served_by(r) -> str:
    assert r.status == 200, (r.status, r.body[:300])
    assert r.headers["x-token-balancer"].startswith("node="), r.headers.get("x-token-balancer")
    return r.headers["x-mock-node"]


def spread(envoy, n: int, body) -> collections.Counter:
    return collections.Counter(served_by(envoy.post("/v1/chat/completions", body)) for _ in range(n))


def concurrent_spread(envoy, n: int, body, clients: int = 8) -> collections.Counter:
    """`n` requests from `clients` clients at once. Sequential requests would each end before
    the next is placed, so every choice would see no work in flight and follow the reported
    load alone, which lags by its measuring window; with requests in flight, each one counts
    on its node until it ends, as in real traffic. Each request opens with its own words, so no
    two share a cached prefix (prefix affinity is tested in test_prefix.py)."""
    with ThreadPoolExecutor(clients) as pool:
        return collections.Counter(pool.map(
            lambda i: served_by(envoy.post("/v1/chat/completions", own_opening(body, i))), range(n)))


def own_opening(body: dict, i: int) -> dict:
    """`body` with its first message opening with request `i`'s own words."""
    body = copy.deepcopy(body)
    first = body["messages"][0]
    first["content"] = f"Request {i}. " + first["content"]
    return body


# About 200 prompt tokens: each request's own weight, counted on its node while it is in flight,
# moves the node down the ranking by more than the load differences do (see CAPACITY).
PROMPT = "lorem ipsum dolor sit amet " * 30


# --- (i) a mixed fleet --------------------------------------------------------------------------

MIXED = [
    # (node, mock spec, plugin settings, the override that makes its KV full)
    ("vllm", "metrics=vllm", {"health_path": "/metrics", "format": "vllm"}, {"kv_cache_usage": 0.95}),
    ("sglang", "metrics=sglang", {"health_path": "/metrics", "format": "auto"}, {"kv_cache_usage": 0.95}),
    # TGI publishes no cache size: it is configured, as the README says.
    ("tgi", "metrics=tgi", {"health_path": "/metrics", "format": "tgi", "kv_cache_tokens": KV_TOKENS},
     {"kv_cache_usage": 0.95}),
    # The seed JSON reports VRAM in bytes, which wins over its kv_cache_usage.
    ("seed", "", {"health_path": "/health"},
     {"vram_used_bytes": int(0.95 * KV_TOKENS * KV_BYTES_PER_TOKEN)}),
]


@pytest.fixture(scope="module")
def mixed():
    cluster = MockCluster([(name, f"gpu=h100,kv_tokens={KV_TOKENS}" + (f",{spec}" if spec else ""))
                           for name, spec, _, _ in MIXED])
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS})
    cfg = with_node_settings(cfg, [{**settings, "capacity_tokens_per_sec": CAPACITY}
                                   for _, _, settings, _ in MIXED])
    envoy = Envoy(cfg)
    wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 4 * len(MIXED), 10, "first reports")
    yield cluster, envoy
    envoy.stop()
    cluster.stop()


@pytest.mark.parametrize("what", ["queue", "kv"])
@pytest.mark.parametrize("busy", [m[0] for m in MIXED])
def test_each_engine_flavour_steers_requests_away_when_busy(mixed, busy, what):
    cluster, envoy = mixed
    names = [n.name for n in cluster.nodes]
    for n in cluster.nodes:
        n.reset_health()
    polls_seen(cluster, TICK_MS)
    unparsable = envoy.counter("token_balancer.health.unparsable")
    # Control: idle and equal, every node gets a share, whatever its format.
    assert set(concurrent_spread(envoy, 40, chat(PROMPT, 2))) == set(names)
    node = cluster[names.index(busy)]
    kv_full = next(m[3] for m in MIXED if m[0] == busy)
    node.set_health(**({"queue_depth": 500} if what == "queue" else kv_full))
    # Every VM has polled every node since (an idle node is polled once per quiet period).
    polls_seen(cluster, TICK_MS)
    got = concurrent_spread(envoy, 30, chat(PROMPT, 2))
    assert got[busy] == 0, got
    assert all(got[n] > 0 for n in names if n != busy), got
    assert envoy.counter("token_balancer.health.unparsable") == unparsable, "every format read"
    node.reset_health()


# --- (ii) model routing -------------------------------------------------------------------------

MODEL_NODES = [
    # (node, mock spec, plugin settings)
    ("m1-a", "models=m1", {"models": ["m1"]}),
    ("m1-b", "models=m1", {"models": ["m1"]}),
    ("m2", "models=m2", {}),
    ("m2-lora", "models=m2,loras=sql|chat,metrics=vllm", {"health_path": "/metrics", "format": "vllm"}),
]


@pytest.fixture(scope="module")
def model_cluster():
    c = MockCluster([(name, f"gpu=h100,kv_tokens={KV_TOKENS},{spec}") for name, spec, _ in MODEL_NODES])
    yield c
    c.stop()


def model_envoy(cluster, unknown_model: str) -> Envoy:
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS,
                               "models_poll_ms": MODELS_POLL_MS, "unknown_model": unknown_model})
    cfg = with_node_settings(cfg, [{**settings, "capacity_tokens_per_sec": CAPACITY}
                                   for _, _, settings in MODEL_NODES])
    e = Envoy(cfg)
    lists_known(e)
    wait_until(lambda: e.counter("token_balancer.health.ok") >= 16, 10, "reports")
    return e


def lists_known(envoy):
    """Waits until the worker knows every node's model set: only then is a model no node
    serves told apart (rejected, or left to Envoy as unknown). Counters cannot tell: they add
    up the VMs of every Envoy thread, the main thread's too, which polls on its own."""
    def verdict():
        r = envoy.post("/v1/chat/completions", model_body("no-such-model"))
        return r.headers.get("x-token-balancer") in ("rejected=unknown_model", "fallback=unknown_model")
    wait_until(verdict, 10, "every node's model list")


def model_body(model: str | None, prompt: str = "hi") -> dict:
    body = chat(prompt, 2)
    if model is None:
        del body["model"]
    else:
        body["model"] = model
    return body


def not_found(model: str) -> dict:
    return {"error": {"message": f"The model `{model}` does not exist.", "type": "invalid_request_error",
                      "param": "model", "code": "model_not_found"}}


@pytest.fixture(scope="module")
def rejecting(model_cluster):
    e = model_envoy(model_cluster, "reject")
    yield e
    e.stop()


def test_requests_land_only_on_nodes_serving_their_model(rejecting):
    envoy = rejecting
    # Configured m1 nodes share m1; the learned m2 nodes share m2 (the adapter node lists m2).
    assert set(concurrent_spread(envoy, 30, model_body("m1", PROMPT))) == {"m1-a", "m1-b"}
    assert set(concurrent_spread(envoy, 30, model_body("m2", PROMPT))) == {"m2", "m2-lora"}
    # An adapter is served by its node only, each of them.
    for adapter in ("sql", "chat"):
        assert spread(envoy, 10, model_body(adapter)) == {"m2-lora": 10}, adapter
    # No model: not narrowed (each mock serves its first model).
    assert set(concurrent_spread(envoy, 40, model_body(None, PROMPT))) == {n for n, _, _ in MODEL_NODES}


def test_an_unknown_model_is_rejected_by_the_filter(rejecting):
    envoy = rejecting
    before = envoy.counter("token_balancer.rejected.unknown_model")
    for model in ("m9", "M1", 'odd "name"'):
        r = envoy.post("/v1/chat/completions", model_body(model))
        assert r.status == 404, (r.status, r.body[:200])
        assert r.headers["content-type"] == "application/json"
        assert r.json() == not_found(model)
        assert "x-mock-node" not in r.headers, "the filter answered, no node did"
        assert r.headers["x-token-balancer"] == "rejected=unknown_model"
    assert envoy.counter("token_balancer.rejected.unknown_model") == before + 3
    # Streaming requests and the completions API are answered alike.
    r = envoy.post("/v1/completions", {"model": "m9", "prompt": "hi", "max_tokens": 2, "stream": True})
    assert r.status == 404 and r.json() == not_found("m9")
    # The VM goes on routing.
    assert served_by(envoy.post("/v1/chat/completions", model_body("m1"))) in {"m1-a", "m1-b"}


def test_an_unknown_model_falls_back_to_envoys_balancer(model_cluster):
    envoy = model_envoy(model_cluster, "fallback")
    try:
        before = envoy.counter("token_balancer.fallback.unknown_model")
        routed = envoy.counter("token_balancer.routed")
        seen = set()
        for _ in range(8):
            r = envoy.post("/v1/chat/completions", model_body("m9"))
            # A node answered: the mocks do not serve m9 either, and say so themselves.
            assert r.status == 404 and r.json()["error"]["code"] == "model_not_found", r.body[:200]
            assert r.headers["x-token-balancer"] == "fallback=unknown_model"
            seen.add(r.headers["x-mock-node"])
        assert envoy.counter("token_balancer.fallback.unknown_model") == before + 8
        assert envoy.counter("token_balancer.routed") == routed
        assert len(seen) >= 2, f"Envoy's least_request spreads them: {seen}"
        # Known models are still narrowed.
        assert spread(envoy, 10, model_body("sql")) == {"m2-lora": 10}
    finally:
        envoy.stop()


# --- (iii) lists learned at runtime -------------------------------------------------------------

def test_a_model_list_is_learned_at_runtime_and_kept_while_the_node_is_down():
    steady = MockCluster([("m2", f"gpu=h100,kv_tokens={KV_TOKENS},models=m2")])
    late_port = free_port()
    late = MockCluster([("late", f"gpu=h100,kv_tokens={KV_TOKENS},models=m3")], ports=[late_port])
    addresses = [steady[0].address, late[0].address]
    cfg = envoy_config(addresses, free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS,
                               "models_poll_ms": MODELS_POLL_MS, "unknown_model": "reject"})
    # Neither node is configured with models: both are learned from /v1/models.
    cfg = with_node_settings(cfg, [{"capacity_tokens_per_sec": CAPACITY}] * 2)
    envoy = Envoy(cfg)
    try:
        lists_known(envoy)
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 8, 10, "reports")
        assert spread(envoy, 12, model_body("m3")) == {"late": 12}
        assert spread(envoy, 12, model_body("m2")) == {"m2": 12}
        # The node goes down. Once it is out of the choice (the first request it fails takes it
        # out, its failed polls eject it), its last good list still stands, so m3 is no unknown
        # model (no 404 from the filter): with no fresh node serving it, Envoy routes it.
        late.stop()
        wait_until(lambda: envoy.post("/v1/chat/completions", model_body("m3")).headers.get("x-token-balancer")
                   == "fallback=no_fresh_nodes", 10, "the node out, m3 still known")
        wait_until(lambda: envoy.counter("token_balancer.nodes_ejected") >= 1, 10, "the node ejected")
        # Its list polls fail now, and change nothing.
        wait_until(lambda: envoy.counter("token_balancer.models.failed") >= 2, 10, "failed list polls")
        r = envoy.post("/v1/chat/completions", model_body("m3"))
        assert r.headers.get("x-token-balancer") == "fallback=no_fresh_nodes", (r.status, r.headers)
        # Back on the same address with another model: the new list replaces the old one.
        late = MockCluster([("late", f"gpu=h100,kv_tokens={KV_TOKENS},models=m5")], ports=[late_port])
        def routed_m5():
            r = envoy.post("/v1/chat/completions", model_body("m5"))
            return r.status == 200 and r.headers["x-token-balancer"].startswith("node=")
        wait_until(routed_m5, 10, "the node back, readmitted and relisted")
        assert spread(envoy, 12, model_body("m5")) == {"late": 12}
        r = envoy.post("/v1/chat/completions", model_body("m3"))
        assert r.status == 404 and r.json() == not_found("m3"), (r.status, r.body[:200])
        assert envoy.counter("token_balancer.models.unparsable") == 0
    finally:
        envoy.stop()
        late.stop()
        steady.stop()


def test_models_poll_ms_0_never_asks():
    cluster = MockCluster([("only", "gpu=h100,models=m1")])
    cfg = envoy_config([cluster[0].address], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "stale_after_ms": STALE_MS, "models_poll_ms": 0,
                               "unknown_model": "reject"})
    envoy = Envoy(cfg)
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 5, 10, "reports")
        # Its set unknown, the node is a candidate for any model: nothing is rejected.
        r = envoy.post("/v1/chat/completions", model_body("m9"))
        assert r.status == 404 and "x-mock-node" in r.headers, "the node answered for itself"
        assert r.headers["x-token-balancer"].startswith("node=")
        assert envoy.counter("token_balancer.models.ok") == 0
        assert envoy.counter("token_balancer.models.failed") == 0
        assert envoy.counter("token_balancer.rejected.unknown_model") == 0
        assert request(envoy.port, "GET", "/v1/models").status == 200
    finally:
        envoy.stop()
        cluster.stop()
