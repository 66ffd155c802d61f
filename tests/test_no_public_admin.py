"""No configuration this project ships exposes Envoy's admin interface beyond loopback. The
admin can stop Envoy (/quitquitquit), change its log levels, reset its counters and dump its
whole configuration, so it must never be reachable from another machine.

Every shipped file is read: envoy/*.yaml, docker-compose.yml, everything under deploy/ (Envoy
configuration embedded as text in a ConfigMap or an EnvoyProxy is parsed too), and the YAML and
JSON blocks of README.md and docs/*.md. The rules:

1. An Envoy `admin` address is a loopback address (127.0.0.0/8, ::1) or a unix socket.
2. docker compose publishes no admin port of the Envoy configuration its service mounts (a
   published port reaches the container's network address, where the admin does not listen).
3. No Kubernetes Service exposes an admin port (9901 here, Envoy Gateway's 19000, Istio's 15000).
4. No route sends traffic to a cluster whose endpoint is an admin address (that would publish
   the admin through a listener), in any shipped file, but for a route that matches exactly the
   path /stats/prometheus for GET alone (the stats-only listener of docs/DEPLOY.md)."""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from pathlib import Path

import pytest
import yaml

from harness import ROOT

# Admin ports of the Envoys this project configures: its own files, Envoy Gateway's proxies,
# Istio's proxies.
KNOWN_ADMIN_PORTS = {9901, 19000, 15000}
FENCE = re.compile(r"^```(yaml|yml|json)\s*\n(.*?)^```", re.S | re.M)


def shipped_files() -> list[Path]:
    files = sorted((ROOT / "envoy").glob("*.yaml")) + [ROOT / "docker-compose.yml"]
    files += sorted(p for p in (ROOT / "deploy").rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    files += [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return files


def load_all(text: str) -> list:
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError:
        return []


def documents(path: Path) -> list:
    """Every YAML or JSON document in the file (for Markdown: in its fenced yaml/json blocks)."""
    text = path.read_text()
    if path.suffix == ".md":
        docs = []
        for m in FENCE.finditer(text):
            docs += load_all(m.group(2))
        return docs
    return load_all(text)


def walk(obj):
    """Every mapping inside obj, including those of Envoy configuration embedded as a string
    (a bootstrap in a ConfigMap or in EnvoyProxy.spec.bootstrap.value)."""
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk(v)
    elif isinstance(obj, str) and "\n" in obj:
        for doc in load_all(obj):
            if isinstance(doc, (dict, list)):
                yield from walk(doc)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_addresses(doc) -> list[dict]:
    """The `admin.address` of every Envoy bootstrap in doc."""
    out = []
    for m in walk(doc):
        admin = m.get("admin")
        if isinstance(admin, dict) and isinstance(admin.get("address"), dict):
            out.append(admin["address"])
    return out


def endpoint_addresses(cluster: dict) -> list[tuple[str, int]]:
    out = []
    for m in walk(cluster.get("load_assignment") or {}):
        sa = m.get("socket_address")
        if isinstance(sa, dict) and "address" in sa:
            out.append((str(sa["address"]), int(sa.get("port_value", 0))))
    return out


def stats_only(route_entry: dict) -> bool:
    """A route that matches exactly GET /stats/prometheus and nothing else."""
    match = route_entry.get("match") or {}
    methods = [h for h in match.get("headers") or [] if h.get("name") == ":method"]
    return (match.get("path") == "/stats/prometheus" and set(match) <= {"path", "headers"}
            and len(methods) == 1 and (methods[0].get("string_match") or {}).get("exact") == "GET")


def problems(doc, where: str, admin_ports: set[int], admin_clusters: set[str] = frozenset()) -> list[str]:
    found = []
    # Rule 1.
    for addr in admin_addresses(doc):
        sa = addr.get("socket_address")
        if sa is not None and not is_loopback(str(sa.get("address", ""))):
            found.append(f"{where}: admin listens on {sa.get('address')}:{sa.get('port_value')}")
    # Rule 3.
    for m in walk(doc):
        if m.get("kind") == "Service" and isinstance(m.get("spec"), dict):
            for p in m["spec"].get("ports") or []:
                ports = {p.get("port"), p.get("targetPort")}
                if ports & admin_ports:
                    found.append(f"{where}: Service {m.get('metadata', {}).get('name')} exposes admin port {ports & admin_ports}")
    # Rule 4: the admin clusters of this document and of every other shipped one.
    admin_clusters = set(admin_clusters) | admin_clusters_in(doc, admin_ports)
    for m in walk(doc):
        route = m.get("route")
        if isinstance(route, dict) and route.get("cluster") in admin_clusters and not stats_only(m):
            found.append(f"{where}: a route sends traffic to admin cluster {route['cluster']}")
    return found


def admin_clusters_in(docs, admin_ports=KNOWN_ADMIN_PORTS) -> set[str]:
    """Names of the clusters that point at an admin port on loopback (the membership reads)."""
    out = set()
    for m in walk(docs):
        if "name" in m and "load_assignment" in m:
            if any(is_loopback(h) and p in admin_ports for h, p in endpoint_addresses(m)):
                out.add(m["name"])
    return out


def compose_problems(compose: dict, root: Path) -> list[str]:
    """Rule 2: the Envoy service publishes no admin port of the configuration it mounts."""
    found = []
    for name, svc in (compose.get("services") or {}).items():
        mounts = {}
        for v in svc.get("volumes") or []:
            host, container = str(v).split(":")[:2]
            mounts[container] = host
        cmd = svc.get("command") or []
        if "-c" not in cmd:
            continue
        config_host = mounts.get(cmd[cmd.index("-c") + 1])
        cfg = yaml.safe_load((root / config_host).read_text()) if config_host else {}
        ports = {int(a["socket_address"]["port_value"]) for a in admin_addresses(cfg) if "socket_address" in a}
        for p in svc.get("ports") or []:
            if isinstance(p, dict):
                target = int(p.get("target", 0))
            else:
                target = int(str(p).split("/")[0].rsplit(":", 1)[-1])
            if target in ports:
                found.append(f"docker-compose.yml: service {name} publishes Envoy's admin port {target} ({p})")
    return found


def all_admin_ports() -> set[int]:
    ports = set(KNOWN_ADMIN_PORTS)
    for path in (ROOT / "envoy").glob("*.yaml"):
        for addr in admin_addresses(yaml.safe_load(path.read_text())):
            if "socket_address" in addr:
                ports.add(int(addr["socket_address"]["port_value"]))
    return ports


def test_every_shipped_file_is_read():
    files = shipped_files()
    names = {str(p.relative_to(ROOT)) for p in files}
    assert {"envoy/envoy.yaml", "envoy/envoy-compose.yaml", "docker-compose.yml", "README.md"} <= names
    assert any(n.startswith("deploy/envoy-gateway/") for n in names), names
    assert any(n.startswith("deploy/istio/") for n in names), names
    # Envoy configuration embedded as text is read too (the poller's bootstrap, in an
    # EnvoyProxy's string and in a ConfigMap's JSON).
    for n in ("deploy/envoy-gateway/singleton-poller.yaml", "deploy/istio/singleton-poller.yaml"):
        assert any("bootstrap_extensions" in m for m in walk(documents(ROOT / n))), n
    assert admin_clusters_in(documents(ROOT / "deploy/istio/token-balancer.yaml")) == {"token_balancer_admin"}
    # The parsing finds the admin sections it must judge (not vacuously green).
    assert len(admin_addresses(documents(ROOT / "envoy/envoy.yaml"))) == 1
    assert len(admin_addresses(documents(ROOT / "envoy/envoy-compose.yaml"))) == 1


@pytest.mark.parametrize("path", shipped_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_shipped_file_exposes_the_admin(path):
    admin_ports = all_admin_ports()
    everywhere = set()
    for other in shipped_files():
        everywhere |= admin_clusters_in(documents(other), admin_ports)
    found = []
    for doc in documents(path):
        found += problems(doc, str(path.relative_to(ROOT)), admin_ports, everywhere)
    if path.name == "docker-compose.yml":
        found += compose_problems(yaml.safe_load(path.read_text()), ROOT)
    assert not found, found


def test_the_checks_catch_an_exposed_admin(tmp_path):
    """The configuration this project once shipped in docker compose, and other ways to expose
    the admin, are each caught."""
    bootstrap = {"admin": {"address": {"socket_address": {"address": "0.0.0.0", "port_value": 9901}}}}
    assert problems(bootstrap, "x", {9901})
    # Embedded as text in a ConfigMap.
    cm = {"kind": "ConfigMap", "data": {"custom_bootstrap.json": json.dumps(bootstrap, indent=1)}}
    assert problems(cm, "x", {9901})
    # Published by compose.
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(
        {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}}}))
    compose = {"services": {"envoy": {"command": ["envoy", "-c", "/etc/envoy/envoy.yaml"],
                                      "volumes": ["./envoy.yaml:/etc/envoy/envoy.yaml:ro"],
                                      "ports": ["10000:10000", "127.0.0.1:9901:9901"]}}}
    assert compose_problems(compose, tmp_path)
    # A Service in front of Envoy Gateway's admin.
    svc = {"kind": "Service", "metadata": {"name": "eg-admin"}, "spec": {"ports": [{"port": 80, "targetPort": 19000}]}}
    assert problems(svc, "x", {19000})
    # A route to a cluster that points at the admin.
    routed = {"static_resources": {
        "listeners": [{"name": "l", "filter_chains": [{"filters": [{"typed_config": {"route_config": {
            "virtual_hosts": [{"routes": [{"match": {"prefix": "/"}, "route": {"cluster": "admin"}}]}]}}}]}]}],
        "clusters": [{"name": "admin", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": 9901}}}}]}]}}]}}
    assert problems(routed, "x", {9901})
    # ... also when the admin cluster is declared in another file.
    elsewhere = copy.deepcopy(routed)
    elsewhere["static_resources"]["clusters"] = []
    assert problems(elsewhere, "x", {9901}, {"admin"})
    # A stats-only route is the one exception; a prefix or another method is not.
    vhost = routed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]
    get_only = [{"name": ":method", "string_match": {"exact": "GET"}}]
    vhost["routes"][0]["match"] = {"path": "/stats/prometheus", "headers": get_only}
    assert not problems(routed, "x", {9901})
    vhost["routes"][0]["match"] = {"prefix": "/stats", "headers": get_only}
    assert problems(routed, "x", {9901})
    vhost["routes"][0]["match"] = {"path": "/stats/prometheus"}
    assert problems(routed, "x", {9901})
    # And the safe forms pass.
    assert not problems({"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}}}, "x", {9901})
    assert not problems({"admin": {"address": {"pipe": {"path": "/tmp/admin.sock"}}}}, "x", {9901})


def test_the_stats_only_listener_serves_metrics_and_nothing_else():
    """The stats-only listener of docs/DEPLOY.md, added to the shipped Envoy configuration:
    Prometheus gets /stats/prometheus through it; the admin's other pages and its actions
    (/quitquitquit, /config_dump, a POST) are not reachable through it."""
    from harness import Envoy, envoy_config, free_port, request

    text = (ROOT / "docs/DEPLOY.md").read_text()
    block = next(m.group(2) for m in FENCE.finditer(text) if "name: stats" in m.group(2))
    (listener,) = yaml.safe_load(block)
    admin_port, stats_port = free_port(), free_port()
    cfg = envoy_config([f"127.0.0.1:{free_port()}"], free_port(), admin_port)
    listener["address"]["socket_address"].update({"address": "127.0.0.1", "port_value": stats_port})
    cfg["static_resources"]["listeners"].append(listener)
    cfg["static_resources"]["clusters"].append({
        "name": "envoy_admin", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "envoy_admin", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}}]}]}})
    envoy = Envoy(cfg)
    try:
        r = request(stats_port, "GET", "/stats/prometheus")
        assert r.status == 200 and b"envoy_server_live" in r.body
        for method, path in [("POST", "/quitquitquit"), ("GET", "/config_dump"), ("GET", "/stats"),
                             ("POST", "/stats/prometheus"), ("POST", "/logging?level=trace")]:
            assert request(stats_port, method, path).status == 404, (method, path)
        assert request(admin_port, "GET", "/ready").status == 200  # still running
    finally:
        envoy.stop()
