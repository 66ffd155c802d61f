"""Node membership follows the Envoy cluster (issue 4, item 4).

The inference cluster's endpoints come from a file-based EDS source, the way a control plane
pushes them. The filter reads the cluster's members from Envoy's admin (`membership`): a node
added to the cluster is picked up and served without restarting Envoy, a node removed is no
longer chosen, and a node the configuration lists but the cluster does not have is never
chosen, although it is up and looks the best.
"""

from __future__ import annotations

import collections
import os

import yaml

from harness import Envoy, MockCluster, chat, envoy_config, free_port, wait_until

TICK_MS = 100


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


def test_nodes_follow_the_cluster_members(tmp_path):
    nodes = MockCluster([("node-a", "gpu=h100"), ("node-b", "gpu=h100"), ("node-c", "gpu=h100")])
    a, b, c = (n.address for n in nodes.nodes)
    admin_port = free_port()
    cfg = envoy_config([a, b], free_port(), admin_port, plugin={
        "tick_ms": TICK_MS,
        "stale_after_ms": 1000,
        # node-c is listed (with its settings) but not a member until the cluster says so.
        "nodes": [{"address": c, "kv_cache_tokens": 100000}],
        "membership": {"cluster": "gpu_nodes", "admin_cluster": "envoy_admin", "poll_ms": 200},
    })
    eds = tmp_path / "eds.yaml"
    push(eds, eds_file([a, b]))
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
    envoy = Envoy(cfg)
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
