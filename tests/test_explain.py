"""Integration tests: the explanation of one request's decision, with the real Envoy.

A request that carries the explain header from a configured source (here 127.0.0.1, where the
tests connect from) gets the explanation on its response; with only other networks configured
it gets nothing, even when it forges an `x-forwarded-for` inside them; a request without the
header never gets it; the header never goes upstream; the filter's own 404 for an unknown
model carries it once. With `explain.access_log`, Envoy's access
log prints every request's explanation from the filter state.

The listener sets `use_remote_address: true`, as docs/CONFIGURATION.md asks of a listener that
lets sources ask: without it Envoy takes the request's source address from the client's own
`x-forwarded-for`."""

from __future__ import annotations

import http.client
import json
import tempfile
from pathlib import Path

import pytest


from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until, with_node_settings

TICK_MS = 100
EXPLAIN = "x-token-balancer-explain"
DEBUG = "x-token-balancer"  # the harness turns the debug header on
# What the access log prints per request: the explain header as it went upstream (Envoy's "-"
# when absent), then the filter state the filter set.
LOG_FORMAT = f"upstream_explain=%REQ({EXPLAIN.upper()})% %FILTER_STATE(wasm.token_balancer.decision:PLAIN)%\n"


@pytest.fixture(scope="module")
def cluster():
    c = MockCluster([("node-a", ""), ("node-b", ""), ("node-c", "")])
    yield c
    c.stop()


def with_access_log(cfg: dict, path: Path) -> dict:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(path),
            "log_format": {"text_format_source": {"inline_string": LOG_FORMAT}},
        },
    }]
    return cfg


def start(cluster, explain: dict, log: Path | None = None, **plugin) -> Envoy:
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                       plugin={"tick_ms": TICK_MS, "explain": explain, **plugin})
    # The nodes serve mock-model only: another model is the filter's own 404 (unknown_model).
    cfg = with_node_settings(cfg, [{"models": ["mock-model"]} for _ in cluster.nodes])
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["use_remote_address"] = True
    if log is not None:
        cfg = with_access_log(cfg, log)
    return Envoy(cfg)


def fields(value: str) -> dict[str, str]:
    """`key=value; key=value` into a dict."""
    return dict(f.split("=", 1) for f in value.split("; "))


def wait_routed(envoy: Envoy):
    """Polls until the filter routes (every node has reported)."""
    def routed():
        r = envoy.post("/v1/chat/completions", chat("warm up", 4))
        return r.status == 200 and r.headers.get(DEBUG, "").startswith("node=")
    wait_until(routed, 15, "a routed request")


def test_an_allowed_source_gets_the_explanation_and_the_access_log_has_every_decision(cluster):
    with tempfile.TemporaryDirectory(prefix="tb-explain-") as d:
        log = Path(d) / "access.log"
        envoy = start(cluster, {"sources": ["127.0.0.1/32", "fd00::/8"], "access_log": True}, log,
                      unknown_model="reject")
        try:
            wait_routed(envoy)
            names = {n.name: n.address for n in cluster.nodes}

            r = envoy.post("/v1/chat/completions", chat("explain this one", 16), headers={EXPLAIN: "1"})
            assert r.status == 200, r.body
            value = r.headers.get(EXPLAIN)
            assert value, r.headers
            f = fields(value)
            assert (f["decision"], f["why"], f["model"]) == ("routed", "shortest_predicted_time", "mock-model")
            # The node the explanation names is the one that served the request.
            chosen = f["node"].split(",")[0]
            assert chosen == names[r.headers["x-mock-node"]], (value, r.headers["x-mock-node"])
            assert f["output_cap"] == "16"
            assert int(f["weight_tokens"]) == int(f["prompt_tokens"]) + int(f["output_tokens"])
            # Every node of the routing header is listed, in its order, with what it was
            # weighed by (the mock nodes report their KV use) and the prompt tokens it is
            # believed to hold.
            candidates = [c.split(" ") for c in f["candidates"].split(",")]
            assert [c[0] for c in candidates] == f["node"].split(",")
            for c in candidates:
                assert c[1].startswith("predicted_ms=") and float(c[1].split("=")[1]) > 0, value
                assert c[2].startswith("kv=") and 0 <= float(c[2].split("=")[1]) <= 1, value
                assert c[3].startswith("cached=") and int(c[3].split("=")[1]) >= 0, value
                assert c[4].startswith("first_token_ms=") and float(c[4].split("=")[1]) > 0, value
            # The debug header tells the same decision, briefly: the explanation holds it.
            assert f"; {r.headers[DEBUG]}; weight_tokens=" in value, (value, r.headers[DEBUG])
            wait_until(lambda: envoy.counter("token_balancer.explain.granted") == 1, 5,
                       "explain.granted counted")

            # A request without the header never gets it.
            for i in range(3):
                r = envoy.post("/v1/chat/completions", chat(f"plain {i}", 4))
                assert r.status == 200 and EXPLAIN not in r.headers, r.headers
                assert r.headers[DEBUG].startswith("node=")
            # A request the filter leaves to Envoy is explained too, with its reason.
            r = envoy.post("/v1/chat/completions", "not json", headers={EXPLAIN: "1",
                                                                        "content-type": "application/json"})
            assert r.headers.get(EXPLAIN) == "decision=fallback; why=body_unusable", r.headers
            # The filter's own 404 carries the explanation once.
            conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=30)
            try:
                conn.request("POST", "/v1/chat/completions", body=json.dumps(chat("who?", 4) | {"model": "no-such"}),
                             headers={EXPLAIN: "1", "content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                explained = [v for k, v in resp.getheaders() if k.lower() == EXPLAIN]
            finally:
                conn.close()
            assert resp.status == 404
            assert explained == ["decision=rejected; why=unknown_model; model=no-such; "
                                 f"prompt_tokens={fields(explained[0])['prompt_tokens']}; output_cap=4"], explained
            assert envoy.counter("token_balancer.explain.refused") == 0

            # The access log: one line per request (the warm-up ones included), each with its
            # explanation from the filter state, and never the explain header upstream.
            def logged():
                lines = log.read_text().splitlines() if log.exists() else []
                return lines if sum("decision=" in li for li in lines) >= 6 else None
            lines = wait_until(logged, 10, lambda: f"access log lines ({log.read_text() if log.exists() else ''})")
            assert all(li.startswith("upstream_explain=- ") for li in lines), lines
            assert any(" decision=routed; why=shortest_predicted_time; model=mock-model; node=" in li
                       for li in lines), lines
            assert any(li.endswith(" decision=fallback; why=body_unusable") for li in lines), lines
            assert any(" decision=rejected; why=unknown_model; model=no-such; " in li for li in lines), lines
        finally:
            envoy.stop()


def test_another_source_gets_nothing(cluster):
    with tempfile.TemporaryDirectory(prefix="tb-explain-") as d:
        log = Path(d) / "access.log"
        envoy = start(cluster, {"sources": ["10.0.0.0/8", "fd00::/8"]}, log)
        try:
            wait_routed(envoy)
            # A forged x-forwarded-for inside the sources changes nothing: the peer decides.
            for i, forged in enumerate([None, "10.1.2.3", "127.0.0.1, 10.1.2.3"]):
                headers = {EXPLAIN: "1", **({"x-forwarded-for": forged} if forged else {})}
                r = envoy.post("/v1/chat/completions", chat(f"explain me {i}", 4), headers=headers)
                assert r.status == 200
                assert EXPLAIN not in r.headers, r.headers
                # Routed all the same.
                assert r.headers[DEBUG].startswith("node=")
            wait_until(lambda: envoy.counter("token_balancer.explain.refused") == 3, 5,
                       lambda: f"explain.refused at 3 ({envoy.counters()})")
            assert envoy.counter("token_balancer.explain.granted") == 0
            r = envoy.post("/v1/chat/completions", chat("no header", 4))
            assert EXPLAIN not in r.headers
            # The header was removed before the requests went upstream, and without
            # `access_log` the filter state stays empty (Envoy prints "-").
            lines = wait_until(lambda: len(log.read_text().splitlines()) >= 4 and log.read_text().splitlines(),
                               10, "access log lines")
            assert all(li == "upstream_explain=- -" for li in lines), lines
        finally:
            envoy.stop()
