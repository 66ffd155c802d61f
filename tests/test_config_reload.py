"""A configuration pushed to a running Envoy (docs/RELIABILITY.md, "bad configuration reload").

The listener, with the filter and its configuration, comes from a file-based LDS source, the
way a control plane pushes it. A bad plugin configuration is rejected with one log line that
names the field, and the previous configuration keeps serving; a good one afterwards is taken.
"""

from __future__ import annotations

import copy
import json
import os

import yaml

from harness import Envoy, MockCluster, chat, envoy_config, free_port, request, wait_until


def lds_file(listener: dict) -> str:
    return yaml.safe_dump({"version_info": str(os.urandom(4).hex()), "resources": [
        {"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}]})


def plugin_of(listener: dict) -> dict:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]


def with_plugin(listener: dict, **changes) -> dict:
    listener = copy.deepcopy(listener)
    wasm = plugin_of(listener)
    conf = json.loads(wasm["configuration"]["value"])
    conf.update(changes)
    wasm["configuration"]["value"] = json.dumps(conf)
    return listener


def push(path, content: str):
    # Envoy watches for the file being moved into place: write aside, then rename.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)


def lds_stat(envoy, name: str) -> int:
    r = request(envoy.admin_port, "GET", f"/stats?format=json&filter=listener_manager.lds.{name}$")
    return sum(s.get("value", 0) for s in r.json().get("stats", []))


def test_a_bad_configuration_pushed_at_runtime_is_rejected_and_the_old_one_serves(tmp_path):
    cluster = MockCluster([("node-a", "gpu=h100"), ("node-b", "gpu=h100")])
    cfg = envoy_config([n.address for n in cluster.nodes], free_port(), free_port(), plugin={"tick_ms": 100})
    listener = cfg["static_resources"].pop("listeners")[0]
    lds = tmp_path / "lds.yaml"
    push(lds, lds_file(listener))
    cfg["node"] = {"id": "token-balancer-test", "cluster": "token-balancer-test"}
    cfg["dynamic_resources"] = {"lds_config": {"path_config_source": {"path": str(lds)},
                                               "resource_api_version": "V3"}}
    envoy = Envoy(cfg, expect_ready=False)
    envoy.port = listener["address"]["socket_address"]["port_value"]
    try:
        def routed(header: str = "x-token-balancer") -> bool:
            r = envoy.post("/v1/chat/completions", chat("hi", 2), timeout=5)
            return r.status == 200 and r.headers.get(header, "").startswith("node=")

        wait_until(lambda: lds_stat(envoy, "update_success") >= 1, 30, "the first LDS update")
        wait_until(routed, 15, "the filter to route")

        push(lds, lds_file(with_plugin(listener, vram_ceiling=7)))
        wait_until(lambda: lds_stat(envoy, "update_rejected") >= 1, 15, "the bad update to be rejected")
        assert "vram_ceiling" in envoy.log_text()
        assert routed(), "the previous configuration stopped serving"

        # A good configuration afterwards is taken: the debug header moves to its new name.
        push(lds, lds_file(with_plugin(listener, debug_header="x-tb-reloaded")))
        wait_until(lambda: routed("x-tb-reloaded"), 15, "the new configuration to serve")
    finally:
        envoy.stop()
        cluster.stop()
