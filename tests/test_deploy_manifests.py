"""The Kubernetes manifests in deploy/, checked without a cluster (there is none here):

1. every manifest against its API (tests/manifest_schema.py, written from the published CRDs of
   Envoy Gateway v1.9, Istio 1.32 and Gateway API v1);
2. the manifests agree with each other (the filter's configuration is the same in the filter and
   in the singleton poller; the Envoy names they use are the names Envoy Gateway and Istio give
   the objects they declare);
3. the Envoy configuration each set stands for, rendered here as Envoy Gateway's and Istio's
   translation would produce it, is accepted by `envoy --mode validate`;
4. that configuration, run in a real Envoy in front of mock nodes, routes requests through the
   filter.

What this cannot show: that Envoy Gateway's and Istio's controllers translate the manifests
exactly as rendered here (the rendering follows their documented translation and source, but
no controller runs here), that istio-agent and Envoy Gateway pull the image from a registry
(the image's format is tested in test_wasm_image.py), and the mTLS handshake with a sidecar."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest
import yaml

import manifest_schema
from harness import ENVOY, ROOT, WASM, Envoy, MockCluster, chat, free_port, request, wait_until

DEPLOY = ROOT / "deploy"
OVERRIDE_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
LEAST_REQUEST_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def docs(rel: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / rel).read_text()) if d]


def find(rel: str, kind: str, name: str | None = None) -> dict:
    return next(d for d in docs(rel) if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def manifest_files() -> list:
    return sorted(p for p in DEPLOY.rglob("*.yaml"))


# ---- 1. the APIs -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_matches_its_api(path):
    errors = [e for d in yaml.safe_load_all(path.read_text()) if d for e in manifest_schema.check(d)]
    assert not errors, errors


def test_the_checker_catches_misspelt_misplaced_and_mistyped_fields():
    eep = find("envoy-gateway/token-balancer.yaml", "EnvoyExtensionPolicy")
    assert manifest_schema.check(eep) == []
    bad = copy.deepcopy(eep)
    bad["spec"]["wasm"][0]["failopen"] = True                      # misspelt
    assert any("unknown field `failopen`" in e for e in manifest_schema.check(bad))
    bad = copy.deepcopy(eep)
    bad["spec"]["wasm"][0]["code"]["type"] = "OCI"                 # not in the enum
    assert any("'OCI' is not one of" in e for e in manifest_schema.check(bad))
    btp = find("envoy-gateway/gateway.yaml", "BackendTrafficPolicy")
    bad = copy.deepcopy(btp)
    bad["spec"]["endpointOverride"] = bad["spec"]["loadBalancer"].pop("endpointOverride")  # misplaced
    assert any("unknown field `endpointOverride`" in e for e in manifest_schema.check(bad))
    ef = find("istio/token-balancer.yaml", "EnvoyFilter")
    bad = copy.deepcopy(ef)
    bad["spec"]["configPatches"][0]["applyTo"] = "EXTENSION_CONFIGS"
    assert manifest_schema.check(bad)
    bad = copy.deepcopy(ef)
    bad["spec"]["configPatches"][1]["match"]["listener"]["filterChain"]["filter"]["subfilter"] = {}
    assert any("unknown field `subfilter`" in e for e in manifest_schema.check(bad))
    bad = copy.deepcopy(find("istio/gateway.yaml", "VirtualService"))
    bad["spec"]["http"][0]["retries"]["attempts"] = "2"
    assert any("expected an integer" in e for e in manifest_schema.check(bad))
    assert manifest_schema.check({"apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin",
                                  "metadata": {"name": "x"}})  # kinds without a schema are not waved through


# ---- 2. the manifests agree -------------------------------------------------------------------

def eg_filter_config() -> dict:
    return find("envoy-gateway/token-balancer.yaml", "EnvoyExtensionPolicy")["spec"]["wasm"][0]["config"]


def eg_poller() -> dict:
    proxy = find("envoy-gateway/singleton-poller.yaml", "EnvoyProxy")
    return yaml.safe_load(proxy["spec"]["bootstrap"]["value"])["bootstrap_extensions"][0]["typed_config"]


def istio_extension() -> dict:
    ef = find("istio/token-balancer.yaml", "EnvoyFilter")
    return next(p for p in ef["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG")["patch"]["value"]


def istio_poller() -> dict:
    cm = find("istio/singleton-poller.yaml", "ConfigMap")
    return json.loads(cm["data"]["custom_bootstrap.json"])["bootstrap_extensions"][0]["typed_config"]


def eg_names() -> dict:
    """The names Envoy Gateway v1.9 gives the Envoy objects made from gateway.yaml and the policy:
    listener `<namespace>/<gateway>/<listener>`, route cluster `httproute/<ns>/<route>/rule/<i>`,
    Wasm filter `envoy.filters.http.wasm/envoyextensionpolicy/<ns>/<policy>/wasm/<i>`."""
    gw = find("envoy-gateway/gateway.yaml", "Gateway")
    route = find("envoy-gateway/gateway.yaml", "HTTPRoute")
    eep = find("envoy-gateway/token-balancer.yaml", "EnvoyExtensionPolicy")
    ns = gw["metadata"]["namespace"]
    return {
        "listener": f"{ns}/{gw['metadata']['name']}/{gw['spec']['listeners'][0]['name']}",
        "cluster": f"httproute/{route['metadata']['namespace']}/{route['metadata']['name']}/rule/0",
        "filter": f"envoy.filters.http.wasm/envoyextensionpolicy/{eep['metadata']['namespace']}/"
                  f"{eep['metadata']['name']}/wasm/0",
    }


def istio_cluster_name() -> str:
    vs = find("istio/gateway.yaml", "VirtualService")
    dest = vs["spec"]["http"][0]["route"][0]["destination"]
    return f"outbound|{dest['port']['number']}||{dest['host']}"


def test_envoy_gateway_manifests_agree():
    names = eg_names()
    conf = eg_filter_config()
    poller = eg_poller()
    assert json.loads(poller["config"]["configuration"]["value"]) == conf
    assert poller["singleton"] is True and poller["config"]["root_id"] == "token_balancer_poller"
    assert conf["poller"] == "singleton"
    assert conf["membership"]["cluster"] == names["cluster"]
    epp = find("envoy-gateway/token-balancer.yaml", "EnvoyPatchPolicy")
    patches = epp["spec"]["jsonPatches"]
    filter_patches = {p["operation"]["path"]: p for p in patches if "jsonPath" in p["operation"]}
    for p in filter_patches.values():
        assert p["name"] == names["listener"]
        assert p["operation"]["jsonPath"] == f"..http_filters[?(@.name=='{names['filter']}')]"
    assert filter_patches["/typed_config/config/allow_on_headers_stop_iteration"]["operation"]["value"] is True
    assert filter_patches["/typed_config/config/vm_config/vm_id"]["operation"]["value"] == \
        poller["config"]["vm_config"]["vm_id"]
    added = {p["operation"]["value"]["name"]: p["operation"]["value"] for p in patches if p["operation"]["path"] == ""}
    assert conf["health_cluster"] in added and conf["membership"]["admin_cluster"] in added
    assert added[conf["health_cluster"]]["original_dst_lb_config"]["http_header_name"] == "x-token-balancer-health-target"
    # The Gateway uses the EnvoyProxy that carries the poller, and the poller's file is mounted.
    gw = find("envoy-gateway/gateway.yaml", "Gateway")
    proxy = find("envoy-gateway/singleton-poller.yaml", "EnvoyProxy")
    assert gw["spec"]["infrastructure"]["parametersRef"]["name"] == proxy["metadata"]["name"]
    mount = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]["volumeMounts"][0]["mountPath"]
    assert poller["config"]["vm_config"]["code"]["local"]["filename"].startswith(mount + "/")
    eep = find("envoy-gateway/token-balancer.yaml", "EnvoyExtensionPolicy")
    assert eep["spec"]["wasm"][0]["failOpen"] is True
    assert eep["spec"]["wasm"][0]["rootID"] == "token_balancer"


def test_istio_manifests_agree():
    ext = istio_extension()
    conf = json.loads(ext["typed_config"]["config"]["configuration"]["value"])
    poller = istio_poller()
    assert json.loads(poller["config"]["configuration"]["value"]) == conf
    assert poller["config"]["vm_config"]["vm_id"] == ext["typed_config"]["config"]["vm_config"]["vm_id"]
    assert ext["typed_config"]["config"]["allow_on_headers_stop_iteration"] is True
    assert ext["typed_config"]["config"]["failure_policy"] == "FAIL_OPEN"
    assert conf["membership"]["cluster"] == istio_cluster_name()
    ef = find("istio/token-balancer.yaml", "EnvoyFilter")
    http_filter = next(p for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER")["patch"]["value"]
    assert http_filter["name"] == ext["name"]
    merge = next(p for p in ef["spec"]["configPatches"] if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE")
    dest = find("istio/gateway.yaml", "VirtualService")["spec"]["http"][0]["route"][0]["destination"]
    assert merge["match"]["cluster"] == {"service": dest["host"], "portNumber": dest["port"]["number"]}
    for variant in ("istio/health-cluster.yaml", "istio/health-cluster-mtls.yaml"):
        cluster = find(variant, "EnvoyFilter")["spec"]["configPatches"][0]["patch"]["value"]
        assert cluster["name"] == conf["health_cluster"]
    # Both variants are one object under one name: applying one replaces the other.
    assert find("istio/health-cluster.yaml", "EnvoyFilter")["metadata"] == \
        find("istio/health-cluster-mtls.yaml", "EnvoyFilter")["metadata"]


# ---- 3. the Envoy configuration they stand for --------------------------------------------------

def deep_merge(base, patch):
    """Protobuf merge semantics on JSON: objects merge, lists append, scalars replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = deep_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        return base + copy.deepcopy(patch)
    return copy.deepcopy(patch)


def json_path_targets(doc, expr: str) -> list[list]:
    """The JSON pointers (as lists) an Envoy Gateway jsonPath of the form
    `..key[?(@.name=='value')]` selects: every element named `value` of every `key` list."""
    m = re.fullmatch(r"\$?\.\.(\w+)\[\?\(@\.name\s*==\s*'([^']+)'\)\]", expr)
    assert m, f"unsupported jsonPath {expr!r}"
    key, value = m.groups()
    out = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key and isinstance(v, list):
                    out.extend(path + [k, i] for i, e in enumerate(v) if isinstance(e, dict) and e.get("name") == value)
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])

    walk(doc, [])
    return out


def json_patch_add(doc, pointer: list, value):
    """RFC 6902 add, creating missing objects on the way (Envoy Gateway applies its patches with
    EnsurePathExistsOnAdd)."""
    node = doc
    for k in pointer[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(k, {})
        else:
            node = node[k]
    node[pointer[-1]] = copy.deepcopy(value)


def quantity(q) -> int:
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi)?", str(q))
    return int(m.group(1)) * {None: 1, "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3}[m.group(2)]


def hcm(stat_prefix: str, routes: list, filters: list) -> dict:
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": HCM_TYPE, "stat_prefix": stat_prefix,
        "route_config": {"name": stat_prefix, "virtual_hosts": [{"name": stat_prefix, "domains": ["*"],
                                                                 "routes": routes}]},
        "http_filters": filters}}


def static_endpoints(name: str, addresses: list[str]) -> dict:
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": a.rsplit(":", 1)[0],
                                                     "port_value": int(a.rsplit(":", 1)[1])}}}}
        for a in addresses]}]}


def override_host(header: str) -> dict:
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {"@type": OVERRIDE_TYPE, "override_host_sources": [{"header": header}],
                         "fallback_policy": {"policies": [{"typed_extension_config": {
                             "name": "envoy.load_balancing_policies.least_request",
                             "typed_config": {"@type": LEAST_REQUEST_TYPE}}}]}}}}]}


def render_envoy_gateway(wasm: str, poller_wasm: str, nodes: list[str]) -> dict:
    """The bootstrap and resources Envoy Gateway v1.9 makes of deploy/envoy-gateway/, with the
    .wasm as a local file where Envoy Gateway serves it from its own HTTP server, static
    endpoints where it sends EDS, and an inline route table where it sends RDS."""
    names = eg_names()
    gw_docs = {d["kind"]: d for d in docs("envoy-gateway/gateway.yaml")}
    route, btp, ctp = gw_docs["HTTPRoute"], gw_docs["BackendTrafficPolicy"]["spec"], gw_docs["ClientTrafficPolicy"]["spec"]
    wasm_spec = find("envoy-gateway/token-balancer.yaml", "EnvoyExtensionPolicy")["spec"]["wasm"][0]
    vm_id = names["filter"].split("/", 1)[1]  # Envoy Gateway's own vm_id: the IR name
    wasm_filter = {"name": names["filter"], "disabled": True, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        "config": {"name": wasm_spec["name"], "root_id": wasm_spec["rootID"],
                   "vm_config": {"vm_id": vm_id, "runtime": "envoy.wasm.runtime.v8",
                                 "code": {"local": {"filename": wasm}}},
                   "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                     "value": json.dumps(wasm_spec["config"])},
                   "fail_open": wasm_spec["failOpen"]}}}
    rule = route["spec"]["rules"][0]
    retry = btp["retry"]
    routes = [{"match": {"prefix": rule["matches"][0]["path"]["value"]},
               "route": {"cluster": names["cluster"], "timeout": rule["timeouts"]["request"],
                         "retry_policy": {"retry_on": ",".join(retry["retryOn"]["triggers"]),
                                          "num_retries": retry["numRetries"]}},
               "typed_per_filter_config": {names["filter"]: {
                   "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}}}]
    cb = btp["circuitBreaker"]
    assert btp["loadBalancer"]["type"] == "LeastRequest"
    cfg = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 19000}}},
        "static_resources": {
            "listeners": [{"name": names["listener"],
                           "address": {"socket_address": {"address": "0.0.0.0", "port_value": 10080}},
                           "per_connection_buffer_limit_bytes": quantity(ctp["connection"]["bufferLimit"]),
                           "default_filter_chain": {"filters": [hcm("http-10080", routes, [wasm_filter, ROUTER])]}}],
            "clusters": [{"name": names["cluster"], "type": "STATIC", "connect_timeout": "10s",
                          "per_connection_buffer_limit_bytes": quantity(btp["connection"]["bufferLimit"]),
                          "load_balancing_policy": override_host(btp["loadBalancer"]["endpointOverride"]["extractFrom"][0]["header"]),
                          "circuit_breakers": {"thresholds": [{"max_connections": cb["maxConnections"],
                                                               "max_pending_requests": cb["maxPendingRequests"],
                                                               "max_requests": cb["maxParallelRequests"],
                                                               "max_retries": cb["maxParallelRetries"]}]},
                          "load_assignment": static_endpoints(names["cluster"], nodes)}],
        },
    }
    # The EnvoyPatchPolicy, as Envoy Gateway applies it.
    resources = cfg["static_resources"]
    for p in find("envoy-gateway/token-balancer.yaml", "EnvoyPatchPolicy")["spec"]["jsonPatches"]:
        op = p["operation"]
        assert op["op"] == "add"
        if op["path"] == "":
            assert p["type"].endswith("Cluster")
            resources["clusters"].append(copy.deepcopy(op["value"]))
            continue
        listener = next(li for li in resources["listeners"] if li["name"] == p["name"])
        targets = json_path_targets(listener, op["jsonPath"])
        assert targets, f"the patch's jsonPath selects nothing: {op['jsonPath']}"
        for t in targets:
            json_patch_add(listener, t + [s for s in op["path"].split("/")[1:]], op["value"])
    # The EnvoyProxy's bootstrap, merged.
    proxy = find("envoy-gateway/singleton-poller.yaml", "EnvoyProxy")
    assert proxy["spec"]["bootstrap"]["type"] == "Merge"
    boot = yaml.safe_load(proxy["spec"]["bootstrap"]["value"])
    boot["bootstrap_extensions"][0]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = poller_wasm
    return deep_merge(cfg, boot)


def render_istio(wasm: str, poller_wasm: str, nodes: list[str], health_variant: str) -> dict:
    """What an Istio 1.32 ingress gateway runs with deploy/istio/: its listener and the outbound
    cluster of the route's Service (static endpoints where Istio sends EDS), the EnvoyFilter
    patches applied, the extension config inlined where Envoy receives it over ECDS (with the
    local file istio-agent puts in place of the image), and the bootstrap override merged."""
    gw = {d["kind"]: d for d in docs("istio/gateway.yaml")}
    http = gw["VirtualService"]["spec"]["http"][0]
    cluster_name = istio_cluster_name()
    pool = gw["DestinationRule"]["spec"]["trafficPolicy"]["connectionPool"]
    routes = [{"match": {"prefix": http["match"][0]["uri"]["prefix"]},
               "route": {"cluster": cluster_name, "timeout": http["timeout"],
                         "retry_policy": {"retry_on": http["retries"]["retryOn"],
                                          "num_retries": http["retries"]["attempts"]}}}]
    listener = {"name": "0.0.0.0_8080", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
                "filter_chains": [{"filters": [hcm("outbound_0.0.0.0_8080", routes, [copy.deepcopy(ROUTER)])]}]}
    cluster = {"name": cluster_name, "type": "STATIC", "connect_timeout": "10s",
               "lb_policy": gw["DestinationRule"]["spec"]["trafficPolicy"]["loadBalancer"]["simple"],
               "circuit_breakers": {"thresholds": [{"max_connections": pool["tcp"]["maxConnections"],
                                                    "max_pending_requests": pool["http"]["http1MaxPendingRequests"],
                                                    "max_requests": pool["http"]["http2MaxRequests"],
                                                    "max_retries": pool["http"]["maxRetries"]}]},
               "load_assignment": static_endpoints(cluster_name, nodes)}
    # istio-agent's bootstrap has the SDS cluster that Istio's (and our mTLS) clusters use.
    sds = {"name": "sds-grpc", "type": "STATIC", "connect_timeout": "1s",
           "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
               "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
               "explicit_http_config": {"http2_protocol_options": {}}}},
           "load_assignment": {"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
               "address": {"pipe": {"path": "./var/run/secrets/workload-spiffe-uds/socket"}}}}]}]}}
    cfg = {"node": {"id": "router~10.0.0.2~istio-ingressgateway.istio-system~istio-system.svc.cluster.local",
                    "cluster": "istio-ingressgateway.istio-system"},
           "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
           "static_resources": {"listeners": [listener], "clusters": [cluster, sds]}}
    extensions = {}
    patches = find("istio/token-balancer.yaml", "EnvoyFilter")["spec"]["configPatches"]
    patches = patches + find(health_variant, "EnvoyFilter")["spec"]["configPatches"]
    for p in patches:
        kind, op, value = p["applyTo"], p["patch"]["operation"], p["patch"].get("value")
        if kind == "EXTENSION_CONFIG":
            assert op == "ADD"
            ext = copy.deepcopy(value)
            remote = ext["typed_config"]["config"]["vm_config"]["code"].pop("remote")
            assert remote["http_uri"]["uri"].startswith("oci://") and re.fullmatch(r"[0-9a-f]{64}", remote["sha256"])
            ext["typed_config"]["config"]["vm_config"]["code"]["local"] = {"filename": wasm}
            extensions[ext["name"]] = ext["typed_config"]
        elif kind == "HTTP_FILTER":
            assert op == "INSERT_BEFORE" and p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER["name"]
            for li in cfg["static_resources"]["listeners"]:
                filters = li["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
                i = next(i for i, f in enumerate(filters) if f["name"] == ROUTER["name"])
                filters.insert(i, copy.deepcopy(value))
        elif kind == "CLUSTER" and op == "ADD":
            cfg["static_resources"]["clusters"].append(copy.deepcopy(value))
        elif kind == "CLUSTER" and op == "MERGE":
            m = p["match"]["cluster"]
            target = next(c for c in cfg["static_resources"]["clusters"]
                          if c["name"] == f"outbound|{m['portNumber']}||{m['service']}")
            target.update(deep_merge(target, value))
        elif kind == "LISTENER" and op == "MERGE":
            for li in cfg["static_resources"]["listeners"]:
                li.update(deep_merge(li, value))
        else:
            raise AssertionError(f"no rendering for {kind} {op}")
    # ECDS: the filter's configuration arrives in place of its config_discovery.
    for li in cfg["static_resources"]["listeners"]:
        filters = li["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        for f in filters:
            if "config_discovery" in f:
                urls = f.pop("config_discovery")["type_urls"]
                f["typed_config"] = extensions[f["name"]]
                assert f["typed_config"]["@type"] in urls
    boot = json.loads(find("istio/singleton-poller.yaml", "ConfigMap")["data"]["custom_bootstrap.json"])
    boot["bootstrap_extensions"][0]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = poller_wasm
    return deep_merge(cfg, boot)


RENDERS = {
    "envoy-gateway": lambda w, p, n: render_envoy_gateway(w, p, n),
    "istio": lambda w, p, n: render_istio(w, p, n, "istio/health-cluster.yaml"),
    "istio-mtls-health": lambda w, p, n: render_istio(w, p, n, "istio/health-cluster-mtls.yaml"),
}


@pytest.mark.parametrize("name", sorted(RENDERS))
def test_rendered_envoy_configuration_validates(name, tmp_path):
    cfg = RENDERS[name](str(WASM), str(WASM), ["10.0.0.11:8000", "10.0.0.12:8000"])
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])


def test_a_broken_patch_fails_validation(tmp_path):
    """Validation is not a formality: the same rendering with a misspelt Envoy field fails."""
    cfg = render_envoy_gateway(str(WASM), str(WASM), ["10.0.0.11:8000"])
    health = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "token_balancer_health")
    health["original_dst_lb_config"]["http_header"] = health["original_dst_lb_config"].pop("http_header_name")
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


# ---- 4. a routed request --------------------------------------------------------------------

def with_custom_section(wasm: bytes, name: bytes) -> bytes:
    """The same module with one more custom section: other bytes (another digest, as a .wasm
    from another source would have), the same code."""
    payload = bytes([len(name)]) + name
    size, out = len(payload), bytearray()
    while True:
        b = size & 0x7F
        size >>= 7
        out.append(b | (0x80 if size else 0))
        if not size:
            break
    return wasm + b"\x00" + bytes(out) + payload


@pytest.mark.parametrize("name", ["envoy-gateway", "istio"])
def test_rendered_configuration_routes_requests_through_the_filter(name, tmp_path):
    """The rendered configuration in a real Envoy with two workers, in front of two mock nodes:
    the poller (loaded from its own file, as the ConfigMap mount gives it) finds the nodes in
    the route's cluster through the admin, polls them, and the filter routes requests."""
    poller_wasm = tmp_path / "poller.wasm"
    poller_wasm.write_bytes(with_custom_section(WASM.read_bytes(), b"poller-copy"))
    mocks = MockCluster([("fast", "gpu=h100"), ("slow", "gpu=l4")])
    envoy = None
    try:
        cfg = RENDERS[name](str(WASM), str(poller_wasm), [n.address for n in mocks.nodes])
        admin_port, listener_port = free_port(), free_port()
        old_admin = cfg["admin"]["address"]["socket_address"]["port_value"]
        cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
        cfg["static_resources"]["listeners"][0]["address"]["socket_address"].update(
            {"address": "127.0.0.1", "port_value": listener_port})
        admin_cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "token_balancer_admin")
        sa = admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert sa["port_value"] == old_admin  # the manifest's admin cluster points at that gateway's admin
        sa["port_value"] = admin_port
        envoy = Envoy(cfg, concurrency=2)
        assert "invalid token-balancer configuration" not in envoy.log_text()

        def routed():
            r = request(listener_port, "POST", "/v1/chat/completions", body=chat("hello"), timeout=10)
            return r.status == 200 and envoy.counter("token_balancer.routed") > 0

        wait_until(routed, 30, lambda: f"a request routed by the filter (log: {envoy.tail()})", interval=0.2)
        before = envoy.counter("token_balancer.routed")
        for i in range(6):
            r = request(listener_port, "POST", "/v1/chat/completions", body=chat(f"prompt {i}"), timeout=10)
            assert r.status == 200, r
        assert envoy.counter("token_balancer.routed") == before + 6
        # The nodes came from the cluster's members, polled by the one poller.
        assert envoy.counter("token_balancer.members.ok") > 0
        picks = sum(envoy.counter(f"token_balancer.node.{n.address}.picks") for n in mocks.nodes)
        assert picks >= 7
    finally:
        if envoy:
            envoy.stop()
        mocks.stop()


def test_release_layout_is_what_the_manifests_reference():
    """The manifests name the image by tag and digest; the digest is the one release.sh prints
    (a placeholder of zeros until you put yours)."""
    eep = find("envoy-gateway/token-balancer.yaml", "EnvoyExtensionPolicy")["spec"]["wasm"][0]["code"]
    assert eep["type"] == "Image" and ":" in eep["image"]["url"] and "://" not in eep["image"]["url"]
    remote = istio_extension()["typed_config"]["config"]["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"] == "oci://" + eep["image"]["url"]
    assert remote["sha256"] == eep["image"]["sha256"]
    version = re.search(r'^version = "(.*)"$', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert eep["image"]["url"].endswith(":" + version)


def test_mock_engine_pods_start_with_their_arguments():
    """The example engines' arguments are ones the mock node takes: run each pod's command
    here (on 127.0.0.1 and a free port) and read its vLLM metrics, as the filter will."""
    from harness import MOCK
    service = find("examples/mock-engines.yaml", "Service")
    for dep in [d for d in docs("examples/mock-engines.yaml") if d["kind"] == "Deployment"]:
        assert set(service["spec"]["selector"].items()) <= set(dep["spec"]["template"]["metadata"]["labels"].items())
        container = dep["spec"]["template"]["spec"]["containers"][0]
        port = free_port()
        target = service["spec"]["ports"][0]["targetPort"]
        args = [a.replace("0.0.0.0", "127.0.0.1").replace(f"{target},", f"{port},") for a in container["args"]]
        proc = subprocess.Popen([str(MOCK), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = wait_until(lambda: request(port, "GET", "/metrics", timeout=2), 15, "the mock engine to answer")
            assert r.status == 200 and b"vllm:" in r.body
            assert request(port, "GET", "/health", timeout=2).status == 200
        finally:
            proc.terminate()
            proc.wait(10)
