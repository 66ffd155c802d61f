"""Node membership follows the Envoy cluster.

The inference cluster's endpoints come from a file-based EDS source, the way a control plane
pushes them. The filter reads the cluster's members from Envoy's admin (`membership`): a node
added to the cluster is picked up and served without restarting Envoy, a node removed is no
longer chosen, and a node the configuration lists but the cluster does not have is never
chosen, although it is up and looks the best.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import time

import pytest
import yaml

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until

TICK_MS = 100
WORKERS = 4


def eds_file(addresses: list[str]) -> str:
    return yaml.safe_dump({"version_info": os.urandom(4).hex(), "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": "gpu_nodes",
        "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": a.rsplit(":", 1)[0],
                                                         "port_value": int(a.rsplit(":", 1)[1])}}}}
            for a in addresses]}]}]})


def push(path, content: str):
    # Envoy watches for the file being moved into place: write aside, then rename.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)


def following_envoy(tmp_path, members: list[str], plugin: dict, poller: str, concurrency: int):
    """Envoy whose gpu_nodes cluster comes from a file-based EDS source (returned, to push new
    members to) and whose filter follows it through the admin cluster."""
    admin_port = free_port()
    cfg = envoy_config(members, free_port(), admin_port, poller=poller, plugin={
        "tick_ms": TICK_MS,
        "stale_after_ms": 1000,
        # Every member polled every tick, quiet or not: these tests count polls per tick.
        "quiet_poll_ms": TICK_MS,
        "membership": {"cluster": "gpu_nodes", "admin_cluster": "envoy_admin", "poll_ms": 200},
        **plugin,
    })
    eds = tmp_path / "eds.yaml"
    push(eds, eds_file(members))
    gpu = next(cl for cl in cfg["static_resources"]["clusters"] if cl["name"] == "gpu_nodes")
    del gpu["load_assignment"]
    gpu["type"] = "EDS"
    gpu["eds_cluster_config"] = {"eds_config": {"path_config_source": {"path": str(eds)},
                                                "resource_api_version": "V3"}}
    cfg["static_resources"]["clusters"].append({
        "name": "envoy_admin", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "envoy_admin", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": admin_port}}}}]}]}})
    cfg["node"] = {"id": "token-balancer-test", "cluster": "token-balancer-test"}
    return Envoy(cfg, concurrency=concurrency), eds


# With the poller service, one poller per process follows the cluster and the four workers'
# filter VMs follow the poller's fleet: the same behaviour, seen from every worker.
@pytest.mark.parametrize("poller,concurrency", [("vm", 1), ("singleton", WORKERS)])
def test_nodes_follow_the_cluster_members(tmp_path, poller, concurrency):
    nodes = MockCluster([("node-a", "gpu=h100"), ("node-b", "gpu=h100"), ("node-c", "gpu=h100")])
    a, b, c = (n.address for n in nodes.nodes)
    # node-c is listed (with its settings) but not a member until the cluster says so.
    envoy, eds = following_envoy(tmp_path, [a, b], {
        "nodes": [{"address": c, "kv_cache_tokens": 100000}],
    }, poller, concurrency)
    # node-c looks the best: the others report most of their capacity in use.
    for n in nodes.nodes[:2]:
        n.set_health(tokens_per_sec_load=n.health()["tokens_per_sec_capacity"] * 0.7)

    def served(count: int) -> collections.Counter:
        got = collections.Counter()
        for _ in range(count):
            r = envoy.post("/v1/chat/completions", chat("which node", 2))
            assert r.status == 200, (r.status, r.body[:200])
            assert r.headers["x-token-balancer"].startswith("node="), r.headers
            got[r.headers["x-mock-node"]] += 1
        return got

    def members_read(more: int = 2):
        start = envoy.counter("token_balancer.members.ok")
        wait_until(lambda: envoy.counter("token_balancer.members.ok") >= start + more, 10,
                   lambda: f"{more} more member lists: {envoy.counters()}")

    try:
        wait_until(lambda: envoy.counter("token_balancer.members.ok") >= 1, 10,
                   lambda: f"the first member list: {envoy.log_text()[-2000:]}")
        members_read()
        got = served(30)
        assert got["node-c"] == 0 and got["node-a"] > 0 and got["node-b"] > 0, got
        # The listed non-member is not even polled (over several ticks).
        polls_c = nodes.nodes[2].stats()["health_requests_total"]
        members_read()
        assert nodes.nodes[2].stats()["health_requests_total"] == polls_c

        # node-c is added to the cluster: it is followed, polled, and takes most of the load.
        push(eds, eds_file([a, b, c]))
        wait_until(lambda: envoy.counter("token_balancer.nodes_joined") >= 1, 10,
                   lambda: f"node-c to join: {envoy.counters()}")
        wait_until(lambda: nodes.nodes[2].stats()["health_requests_total"] > polls_c + 2, 10,
                   "node-c to be polled")
        wait_until(lambda: served(10)["node-c"] >= 5, 10, "node-c to serve")

        # node-a is removed: never chosen again, while it is still up and answering.
        push(eds, eds_file([b, c]))
        wait_until(lambda: envoy.counter("token_balancer.nodes_left") >= 1, 10,
                   lambda: f"node-a to leave: {envoy.counters()}")
        members_read()
        got = served(30)
        assert got["node-a"] == 0 and got["node-b"] + got["node-c"] == 30, got
        assert envoy.counter("token_balancer.members_now") == 2
    finally:
        envoy.stop()
        nodes.stop()


def open_stream(envoy, prompt: str, max_tokens: int):
    """A streaming request on a new connection (so they spread over the workers), returned
    once its headers are in, with the node the filter chose."""
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(chat(prompt, max_tokens, stream=True)),
                 headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.status
    debug = dict(p.split("=", 1) for p in r.getheader("x-token-balancer").split("; "))
    return conn, r, debug["node"].split(",")[0]


def finish(streams):
    for conn, r, _ in streams:
        assert b"[DONE]" in r.read()
        conn.close()


def shared_inflight(envoy) -> int:
    return envoy.counters().get("token_balancer.shared.inflight_requests", -1)


def books_hold(envoy, n: int, what: str):
    """Waits for the shared books, summed by the service each tick, to hold `n` requests."""
    wait_until(lambda: shared_inflight(envoy) == n, 5,
               lambda: f"{what}: the shared books hold {shared_inflight(envoy)}, not {n}")


def test_one_poller_follows_churn_and_the_shared_books_stay_exact(tmp_path):
    """Singleton mode, four workers, pods replaced under new addresses: one health poll per
    member per tick; a node that leaves with requests in flight keeps their books until they
    end (its slot is not given away); a new node then takes the freed slot; and the shared
    books, summed over every slot, equal the streams open at each step and end at zero."""
    # 30 ms a token: a 100-token stream stays open for about 3 s, a 300-token one 9 s.
    nodes = MockCluster([(f"node-{x}", "gpu=h100,floor_ms=30,kv_tokens=200000") for x in "abcd"])
    a, b, c, d = (n.address for n in nodes.nodes)
    by_address = {n.address: n for n in nodes.nodes}
    envoy, eds = following_envoy(tmp_path, [a, b], {"nodes": []}, "singleton", WORKERS)

    def routed_to(address: str) -> bool:
        r = envoy.post("/v1/chat/completions", chat("hi", 2))
        return r.headers.get("x-token-balancer", "").startswith(f"node={address}")

    def polls_per_tick(members: list[str], polls: int = 10) -> dict[str, float]:
        start = {m: by_address[m].stats()["health_requests_total"] for m in members}
        t0 = time.monotonic()
        first = members[0]
        wait_until(lambda: by_address[first].stats()["health_requests_total"] >= start[first] + polls,
                   20, f"{polls} polls at {first}")
        ticks = (time.monotonic() - t0) * 1000 / TICK_MS
        return {m: (by_address[m].stats()["health_requests_total"] - start[m]) / ticks for m in members}

    streams = []
    try:
        wait_until(lambda: routed_to(a) or routed_to(b), 10,
                   lambda: f"routing from the poller's fleet: {envoy.tail()}")
        rates = polls_per_tick([a, b])
        assert all(0.8 <= r <= 1.25 for r in rates.values()), rates
        assert by_address[c].stats()["health_requests_total"] == 0, "not a member: not polled"

        # 300 tokens at 30 ms: open for about 9 s, well past node-c's joining.
        streams = [open_stream(envoy, f"request {i} " + "word " * i, 300) for i in range(12)]
        on_a = sum(1 for *_, node in streams if node == a)
        assert 0 < on_a < 12, [node for *_, node in streams]
        books_hold(envoy, 12, "12 streams open")

        # node-a is replaced by node-c while its streams run: both are followed at once, and
        # node-a's books still hold its streams (the gauge sums every slot).
        joined = envoy.counter("token_balancer.nodes_joined")
        push(eds, eds_file([b, c]))
        wait_until(lambda: envoy.counter("token_balancer.nodes_joined") > joined, 10, "node-c to join")
        wait_until(lambda: routed_to(c), 10, "node-c to be chosen")
        polls_a = by_address[a].stats()["health_requests_total"]
        # The gauge is the service's sum at its last tick: the probes above may still be in it.
        books_hold(envoy, 12, "node-a's streams still open")
        finish(streams)
        streams = []
        books_hold(envoy, 0, "every stream ended")

        # node-d joins when node-a's books are empty: it takes node-a's slot (the slot count
        # stays at three: a, b, c), and its books count from zero.
        push(eds, eds_file([b, c, d]))
        wait_until(lambda: routed_to(d), 10, "node-d to be chosen")
        rates = polls_per_tick([b, c, d])
        assert all(0.8 <= r <= 1.25 for r in rates.values()), rates
        # node-a, gone, is no longer polled (one poll may have been on its way as it left).
        assert by_address[a].stats()["health_requests_total"] <= polls_a + 1
        log = envoy.log_text()
        assert f'node {c} joined cluster "gpu_nodes" (slot 2)' in log, log[-3000:]
        assert f'node {d} joined cluster "gpu_nodes" (slot 0)' in log, log[-3000:]
        streams = [open_stream(envoy, f"again {i} " + "word " * i, 100) for i in range(12)]
        assert {node for *_, node in streams} <= {b, c, d}
        books_hold(envoy, 12, "12 streams open")
        finish(streams)
        streams = []
        books_hold(envoy, 0, "every stream ended")
        c_ = envoy.counters()
        assert c_.get("token_balancer.fallback.no_fleet", 0) == 0, c_
        assert c_.get("token_balancer.shared.cas_exhausted", 0) == 0, c_
        assert c_.get("token_balancer.members_now") == 3, c_
    finally:
        for conn, _, _ in streams:
            conn.close()
        envoy.stop()
        nodes.stop()
