"""A checker of Kubernetes manifests against the part of each API that the files in deploy/ use,
written from the published CRDs and API references:

- Envoy Gateway v1.9 (gateway.envoyproxy.io/v1alpha1): EnvoyExtensionPolicy, EnvoyPatchPolicy,
  BackendTrafficPolicy, ClientTrafficPolicy, EnvoyProxy, from the CRDs Envoy Gateway generates
  from its api/v1alpha1 types;
- Gateway API v1 (gateway.networking.k8s.io/v1): GatewayClass, Gateway, HTTPRoute;
- Istio 1.32 (networking.istio.io): Gateway, VirtualService, DestinationRule (v1), EnvoyFilter
  (v1alpha3);
- Kubernetes core v1 and apps/v1: Namespace, Service, ConfigMap, Deployment.

Only the fields the manifests may use are described, but each described object lists all the
fields its API has at that level, so a misspelt or misplaced field is an error, as the API server
would report it (unknown fields of a structural CRD are pruned, which silently drops a setting:
worse than an error). Free-form parts (`config` of a Wasm extension, `value` of a patch) are
left open, as their CRDs leave them (x-kubernetes-preserve-unknown-fields); what those parts
mean to Envoy is checked by running Envoy on them (test_deploy_manifests.py).

A schema is a Python value: a type (str, int, bool), a set of allowed strings (an enum), an
Obj, an Arr, a Map, ANY, or a Pattern."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Obj:
    fields: dict
    required: tuple = ()


@dataclass(frozen=True)
class Arr:
    item: object
    min_items: int = 0
    max_items: int | None = None


@dataclass(frozen=True)
class Map:
    value: object


@dataclass(frozen=True)
class Pattern:
    regex: str
    what: str = field(default="")


class _Any:
    pass


ANY = _Any()
# Kubernetes resource.Quantity: an integer or a string such as 4Mi.
QUANTITY = Pattern(r"^[0-9]+([EPTGMK]i|[EPTGMk])?$", "a quantity such as 4Mi")
# Gateway API Duration.
GW_DURATION = Pattern(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$", "a Gateway API duration such as 10s")
# Istio (protobuf) Duration.
PB_DURATION = Pattern(r"^[0-9]+(\.[0-9]+)?s$|^([0-9]+(h|m|s|ms))+$", "a duration such as 10s")
DNS_LABEL = Pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "a DNS label")


def validate(value, schema, path: str = "") -> list[str]:
    errs: list[str] = []
    where = path or "(root)"
    if schema is ANY:
        return errs
    if isinstance(schema, Obj):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        for k in value:
            if k not in schema.fields:
                errs.append(f"{where}: unknown field `{k}` (known: {', '.join(sorted(schema.fields))})")
        for k in schema.required:
            if k not in value:
                errs.append(f"{where}: required field `{k}` is missing")
        for k, v in value.items():
            if k in schema.fields:
                errs += validate(v, schema.fields[k], f"{path}.{k}" if path else k)
        return errs
    if isinstance(schema, Arr):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        if len(value) < schema.min_items:
            errs.append(f"{where}: at least {schema.min_items} item(s)")
        if schema.max_items is not None and len(value) > schema.max_items:
            errs.append(f"{where}: at most {schema.max_items} item(s)")
        for i, v in enumerate(value):
            errs += validate(v, schema.item, f"{path}[{i}]")
        return errs
    if isinstance(schema, Map):
        if not isinstance(value, dict):
            return [f"{where}: expected a map, got {type(value).__name__}"]
        for k, v in value.items():
            if not isinstance(k, str):
                errs.append(f"{where}: key {k!r} is not a string")
            errs += validate(v, schema.value, f"{path}[{k}]")
        return errs
    if isinstance(schema, Pattern):
        if isinstance(value, bool) or not isinstance(value, (str, int)) or not re.match(schema.regex, str(value)):
            errs.append(f"{where}: {value!r} is not {schema.what or schema.regex}")
        return errs
    if isinstance(schema, (set, frozenset)):
        if value not in schema:
            errs.append(f"{where}: {value!r} is not one of {sorted(schema)}")
        return errs
    if schema is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errs.append(f"{where}: expected an integer, got {value!r}")
        return errs
    if schema is bool:
        if not isinstance(value, bool):
            errs.append(f"{where}: expected true or false, got {value!r}")
        return errs
    if schema is str:
        if not isinstance(value, str):
            errs.append(f"{where}: expected a string, got {value!r}")
        return errs
    raise TypeError(f"bad schema at {where}: {schema!r}")


# ---- shared pieces -----------------------------------------------------------------------

METADATA = Obj({"name": DNS_LABEL, "namespace": DNS_LABEL, "labels": Map(str), "annotations": Map(str)},
               required=("name",))

# Gateway API LocalPolicyTargetReference(WithSectionName), as Envoy Gateway's policies use it.
TARGET_REF = Obj({"group": str, "kind": str, "name": str, "sectionName": str}, required=("group", "kind", "name"))
TARGET_SELECTOR = Obj({"group": str, "kind": str, "matchLabels": Map(str), "matchExpressions": Arr(ANY),
                       "namespaces": ANY})
SECRET_REF = Obj({"group": str, "kind": str, "name": str, "namespace": str}, required=("name",))

# ---- Kubernetes core v1 --------------------------------------------------------------------

SERVICE_PORT = Obj({"name": str, "port": int, "targetPort": ANY, "protocol": {"TCP", "UDP", "SCTP"},
                    "appProtocol": str, "nodePort": int}, required=("port",))
SERVICE = Obj({"selector": Map(str), "ports": Arr(SERVICE_PORT), "type": {"ClusterIP", "NodePort", "LoadBalancer",
               "ExternalName"}, "clusterIP": str, "clusterIPs": Arr(str), "publishNotReadyAddresses": bool,
               "sessionAffinity": str, "ipFamilies": Arr(str), "ipFamilyPolicy": str, "internalTrafficPolicy": str,
               "externalTrafficPolicy": str, "loadBalancerClass": str, "externalName": str})
VOLUME = Obj({"name": str, "configMap": Obj({"name": str, "items": Arr(ANY), "defaultMode": int, "optional": bool}),
              "secret": ANY, "emptyDir": ANY, "image": ANY, "projected": ANY, "persistentVolumeClaim": ANY},
             required=("name",))
VOLUME_MOUNT = Obj({"name": str, "mountPath": str, "readOnly": bool, "subPath": str, "subPathExpr": str,
                    "mountPropagation": str, "recursiveReadOnly": str}, required=("name", "mountPath"))

CONTAINER = Obj({"name": str, "image": str, "args": Arr(str), "command": Arr(str), "env": Arr(ANY),
                 "ports": Arr(Obj({"name": str, "containerPort": int, "protocol": str, "hostPort": int,
                                   "hostIP": str}, required=("containerPort",))),
                 "resources": ANY, "readinessProbe": ANY, "livenessProbe": ANY, "startupProbe": ANY,
                 "volumeMounts": Arr(VOLUME_MOUNT), "securityContext": ANY, "imagePullPolicy": str,
                 "workingDir": str, "envFrom": Arr(ANY), "lifecycle": ANY},
                required=("name",))
DEPLOYMENT = Obj({
    "replicas": int, "selector": Obj({"matchLabels": Map(str), "matchExpressions": Arr(ANY)}),
    "template": Obj({"metadata": Obj({"labels": Map(str), "annotations": Map(str)}),
                     "spec": Obj({"containers": Arr(CONTAINER, min_items=1), "initContainers": Arr(CONTAINER),
                                  "volumes": Arr(VOLUME), "serviceAccountName": str, "nodeSelector": Map(str),
                                  "tolerations": Arr(ANY), "affinity": ANY, "securityContext": ANY,
                                  "imagePullSecrets": Arr(ANY), "terminationGracePeriodSeconds": int},
                                 required=("containers",))}),
    "strategy": ANY, "minReadySeconds": int, "revisionHistoryLimit": int, "progressDeadlineSeconds": int,
    "paused": bool,
}, required=("selector", "template"))

# ---- Gateway API v1 ------------------------------------------------------------------------

GATEWAY_CLASS = Obj({"controllerName": str, "parametersRef": ANY, "description": str},
                    required=("controllerName",))

PARENT_REF = Obj({"group": str, "kind": str, "namespace": str, "name": str, "sectionName": str, "port": int},
                 required=("name",))
GATEWAY = Obj({
    "gatewayClassName": str,
    "listeners": Arr(Obj({"name": str, "hostname": str, "port": int,
                          "protocol": str, "tls": ANY, "allowedRoutes": ANY},
                         required=("name", "port", "protocol")), min_items=1, max_items=64),
    "addresses": Arr(ANY),
    "infrastructure": Obj({"labels": Map(str), "annotations": Map(str),
                           "parametersRef": Obj({"group": str, "kind": str, "name": str},
                                                required=("group", "kind", "name"))}),
    "backendTLS": ANY,
    "allowedListeners": ANY,
}, required=("gatewayClassName", "listeners"))
HTTP_MATCH = Obj({
    "path": Obj({"type": {"Exact", "PathPrefix", "RegularExpression"}, "value": str}),
    "headers": Arr(Obj({"type": {"Exact", "RegularExpression"}, "name": str, "value": str},
                       required=("name", "value")), max_items=16),
    "queryParams": Arr(ANY, max_items=16),
    "method": {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"},
})
HTTP_BACKEND_REF = Obj({"group": str, "kind": str, "name": str, "namespace": str, "port": int, "weight": int,
                        "filters": Arr(ANY)}, required=("name",))
HTTPROUTE = Obj({
    "parentRefs": Arr(PARENT_REF, max_items=32),
    "hostnames": Arr(str, max_items=16),
    "rules": Arr(Obj({"name": str, "matches": Arr(HTTP_MATCH, max_items=64), "filters": Arr(ANY, max_items=16),
                      "backendRefs": Arr(HTTP_BACKEND_REF, max_items=16),
                      "timeouts": Obj({"request": GW_DURATION, "backendRequest": GW_DURATION}),
                      "retry": ANY, "sessionPersistence": ANY}), max_items=16),
})

# ---- Envoy Gateway v1.9 (gateway.envoyproxy.io/v1alpha1) ---------------------------------

EG_TARGETS = {"targetRef": TARGET_REF, "targetRefs": Arr(TARGET_REF), "targetSelectors": Arr(TARGET_SELECTOR)}
EG_TLS_SOURCE = Obj({"caCertificateRef": SECRET_REF}, required=("caCertificateRef",))
WASM = Obj({
    "name": str,
    "rootID": str,
    "code": Obj({
        "type": {"HTTP", "Image"},
        "http": Obj({"url": Pattern(r"^https?://"), "sha256": Pattern(r"^[a-f0-9]{64}$", "64 hex digits"),
                     "tls": EG_TLS_SOURCE}, required=("url",)),
        "image": Obj({"url": str, "sha256": Pattern(r"^[a-f0-9]{64}$", "64 hex digits"), "pullSecretRef": SECRET_REF,
                      "tls": EG_TLS_SOURCE}, required=("url",)),
        "pullPolicy": {"IfNotPresent", "Always"},
    }, required=("type",)),
    "config": ANY,
    "env": Obj({"hostKeys": Arr(str)}),
    "failOpen": bool,
}, required=("code",))
ENVOY_EXTENSION_POLICY = Obj({**EG_TARGETS, "wasm": Arr(WASM, max_items=16), "extProc": Arr(ANY, max_items=16),
                              "lua": Arr(ANY, max_items=16), "dynamicModule": Arr(ANY, max_items=16),
                              "mergeType": str})
XDS_TYPES = {
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
}
ENVOY_PATCH_POLICY = Obj({
    "type": {"JSONPatch"},
    "targetRef": Obj({"group": str, "kind": str, "name": str}, required=("group", "kind", "name")),
    "targetRefs": Arr(Obj({"group": str, "kind": str, "name": str}, required=("group", "kind", "name"))),
    "priority": int,
    "jsonPatches": Arr(Obj({
        "type": XDS_TYPES,
        "name": str,
        "operation": Obj({"op": {"add", "remove", "replace", "move", "copy", "test"}, "path": str, "jsonPath": str,
                          "from": str, "value": ANY}, required=("op",)),
    }, required=("type", "name", "operation"))),
}, required=("type",))
RETRY_TRIGGERS = {"5xx", "gateway-error", "reset", "connect-failure", "retriable-4xx", "refused-stream",
                  "retriable-status-codes", "cancelled", "deadline-exceeded", "internal", "resource-exhausted",
                  "unavailable"}
BACKEND_TRAFFIC_POLICY = Obj({
    **EG_TARGETS,
    "mergeType": str,
    "loadBalancer": Obj({
        "type": {"ConsistentHash", "LeastRequest", "Random", "RoundRobin"},
        "consistentHash": ANY,
        "endpointOverride": Obj({"extractFrom": Arr(Obj({"header": str}), min_items=1, max_items=10)},
                                required=("extractFrom",)),
        "slowStart": ANY,
        "zoneAware": ANY,
    }, required=("type",)),
    "retry": Obj({"numRetries": int, "retryOn": Obj({"triggers": Arr(RETRY_TRIGGERS), "httpStatusCodes": Arr(int)}),
                  "perRetry": Obj({"timeout": GW_DURATION, "backOff": ANY})}),
    "circuitBreaker": Obj({"maxConnections": int, "maxPendingRequests": int, "maxParallelRequests": int,
                           "maxParallelRetries": int, "maxRequestsPerConnection": int, "perEndpoint": ANY}),
    "connection": Obj({"bufferLimit": QUANTITY, "socketBufferLimit": QUANTITY, "preconnect": ANY}),
    "timeout": ANY, "healthCheck": ANY, "proxyProtocol": ANY, "tcpKeepalive": ANY, "dns": ANY, "http2": ANY,
    "rateLimit": ANY, "faultInjection": ANY, "useClientProtocol": bool, "compression": ANY, "responseOverride": ANY,
    "httpUpgrade": ANY, "requestBuffer": ANY, "telemetry": ANY, "routingType": ANY, "compressor": ANY,
})
CLIENT_TRAFFIC_POLICY = Obj({
    **EG_TARGETS,
    "connection": Obj({"connectionLimit": ANY, "bufferLimit": QUANTITY, "socketBufferLimit": QUANTITY,
                       "maxAcceptPerSocketEvent": int}),
    "tcpKeepalive": ANY, "enableProxyProtocol": bool, "proxyProtocol": ANY, "clientIPDetection": ANY, "tls": ANY,
    "path": ANY, "headers": ANY, "timeout": ANY, "http1": ANY, "http2": ANY, "http3": ANY, "healthCheck": ANY,
    "tracing": ANY, "scheme": ANY,
})
ENVOY_PROXY = Obj({
    "provider": Obj({"type": {"Kubernetes", "Custom"}, "kubernetes": Obj({
        "envoyDeployment": Obj({
            "patch": ANY, "replicas": int, "strategy": ANY, "initContainers": Arr(ANY),
            "pod": Obj({"annotations": Map(str), "labels": Map(str), "securityContext": ANY, "affinity": ANY,
                        "tolerations": Arr(ANY), "volumes": Arr(VOLUME), "imagePullSecrets": Arr(ANY),
                        "nodeSelector": Map(str), "topologySpreadConstraints": Arr(ANY)}),
            "container": Obj({"env": Arr(ANY), "resources": ANY, "securityContext": ANY, "image": str,
                              "imageRepository": str, "volumeMounts": Arr(VOLUME_MOUNT)}),
            "name": str,
        }),
        "envoyDaemonSet": ANY, "envoyService": ANY, "envoyHpa": ANY, "envoyPDB": ANY, "useListenerPortAsContainerPort": bool,
    })}, required=("type",)),
    "bootstrap": Obj({"type": {"Merge", "Replace", "JSONPatch"}, "value": str, "jsonPatches": Arr(ANY)}),
    "logging": ANY, "telemetry": ANY, "concurrency": int, "routingType": ANY, "extraArgs": Arr(str),
    "mergeGateways": bool, "shutdown": ANY, "filterOrder": Arr(ANY), "backendTLS": ANY, "ipFamily": ANY,
    "preserveRouteOrder": bool, "disableLuaValidation": bool, "luaValidation": ANY, "dynamicModules": Arr(ANY),
})

# ---- Istio 1.32 ----------------------------------------------------------------------------

ISTIO_GATEWAY = Obj({
    "selector": Map(str),
    "servers": Arr(Obj({
        "port": Obj({"number": int, "protocol": {"HTTP", "HTTPS", "GRPC", "HTTP2", "MONGO", "TCP", "TLS"},
                     "name": str, "targetPort": int}, required=("number", "protocol", "name")),
        "bind": str, "hosts": Arr(str, min_items=1), "tls": ANY, "defaultEndpoint": str, "name": str,
    }, required=("port", "hosts"))),
})
STRING_MATCH = Obj({"exact": str, "prefix": str, "regex": str})
VIRTUAL_SERVICE = Obj({
    "hosts": Arr(str), "gateways": Arr(str), "exportTo": Arr(str), "tls": Arr(ANY), "tcp": Arr(ANY),
    "http": Arr(Obj({
        "name": str,
        "match": Arr(Obj({"name": str, "uri": STRING_MATCH, "scheme": STRING_MATCH, "method": STRING_MATCH,
                          "authority": STRING_MATCH, "headers": Map(STRING_MATCH), "port": int,
                          "sourceLabels": Map(str), "gateways": Arr(str), "queryParams": Map(STRING_MATCH),
                          "ignoreUriCase": bool, "withoutHeaders": Map(STRING_MATCH), "sourceNamespace": str,
                          "statPrefix": str})),
        "route": Arr(Obj({"destination": Obj({"host": str, "subset": str, "port": Obj({"number": int})},
                                             required=("host",)),
                          "weight": int, "headers": ANY}, required=("destination",))),
        "redirect": ANY, "directResponse": ANY, "delegate": ANY, "rewrite": ANY,
        "timeout": PB_DURATION,
        "retries": Obj({"attempts": int, "perTryTimeout": PB_DURATION, "retryOn": str,
                        "retryRemoteLocalities": bool, "retryIgnorePreviousHosts": bool, "backoff": PB_DURATION}),
        "fault": ANY, "mirror": ANY, "mirrors": Arr(ANY), "mirrorPercentage": ANY, "corsPolicy": ANY, "headers": ANY,
    })),
})
DESTINATION_RULE = Obj({
    "host": str, "exportTo": Arr(str), "workloadSelector": ANY, "subsets": Arr(ANY),
    "trafficPolicy": Obj({
        "loadBalancer": Obj({"simple": {"UNSPECIFIED", "RANDOM", "PASSTHROUGH", "ROUND_ROBIN", "LEAST_REQUEST",
                                        "LEAST_CONN"},
                             "consistentHash": ANY, "localityLbSetting": ANY, "warmup": ANY, "warmupDurationSecs": ANY}),
        "connectionPool": Obj({
            "tcp": Obj({"maxConnections": int, "connectTimeout": PB_DURATION, "tcpKeepalive": ANY,
                        "maxConnectionDuration": PB_DURATION, "idleTimeout": PB_DURATION}),
            "http": Obj({"http1MaxPendingRequests": int, "http2MaxRequests": int, "maxRequestsPerConnection": int,
                         "maxRetries": int, "idleTimeout": PB_DURATION, "h2UpgradePolicy": str,
                         "useClientProtocol": bool, "maxConcurrentStreams": int}),
        }),
        "outlierDetection": ANY, "tls": ANY, "portLevelSettings": Arr(ANY), "tunnel": ANY, "proxyProtocol": ANY,
        "retryBudget": ANY,
    }),
}, required=("host",))
APPLY_TO = {"INVALID", "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
            "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP", "LISTENER_FILTER"}
LISTENER_MATCH = Obj({
    "portNumber": int, "portName": str, "name": str, "listenerFilter": str,
    "filterChain": Obj({"name": str, "sni": str, "transportProtocol": str, "applicationProtocols": str,
                        "destinationPort": int,
                        "filter": Obj({"name": str, "subFilter": Obj({"name": str})})}),
})
ENVOY_FILTER = Obj({
    "workloadSelector": Obj({"labels": Map(str)}),
    "targetRefs": Arr(Obj({"group": str, "kind": str, "name": str}, required=("kind", "name"))),
    "priority": int,
    "configPatches": Arr(Obj({
        "applyTo": APPLY_TO,
        "match": Obj({
            "context": {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"},
            "proxy": Obj({"proxyVersion": str, "metadata": Map(str)}),
            "listener": LISTENER_MATCH,
            "routeConfiguration": ANY,
            "cluster": Obj({"portNumber": int, "service": str, "subset": str, "name": str}),
        }),
        "patch": Obj({"operation": {"INVALID", "MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER",
                                    "INSERT_FIRST", "REPLACE"},
                      "value": ANY, "filterClass": {"UNSPECIFIED", "AUTHN", "AUTHZ", "STATS"}}),
    })),
})

# ---- every kind the manifests use --------------------------------------------------------

SPECS = {
    ("v1", "Namespace"): None,
    ("v1", "Service"): SERVICE,
    ("v1", "ConfigMap"): "configmap",
    ("apps/v1", "Deployment"): DEPLOYMENT,
    ("gateway.networking.k8s.io/v1", "GatewayClass"): GATEWAY_CLASS,
    ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE,
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"): ENVOY_EXTENSION_POLICY,
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"): ENVOY_PATCH_POLICY,
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): BACKEND_TRAFFIC_POLICY,
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"): CLIENT_TRAFFIC_POLICY,
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"): ENVOY_PROXY,
    ("networking.istio.io/v1", "Gateway"): ISTIO_GATEWAY,
    ("networking.istio.io/v1", "VirtualService"): VIRTUAL_SERVICE,
    ("networking.istio.io/v1", "DestinationRule"): DESTINATION_RULE,
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): ENVOY_FILTER,
}


def check(doc: dict) -> list[str]:
    """The errors of one manifest, each with the path of the field."""
    if not isinstance(doc, dict):
        return [f"not an object: {doc!r}"]
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in SPECS:
        return [f"{key[1]} of {key[0]}: no schema here (add one to tests/manifest_schema.py from its API)"]
    name = f"{key[1]}/{(doc.get('metadata') or {}).get('name')}"
    spec = SPECS[key]
    top = {"apiVersion": str, "kind": str, "metadata": METADATA}
    if spec == "configmap":
        top.update({"data": Map(str), "binaryData": Map(str), "immutable": bool})
        return [f"{name}: {e}" for e in validate(doc, Obj(top, required=("apiVersion", "kind", "metadata")))]
    if spec is not None:
        top["spec"] = spec
    errs = validate(doc, Obj(top, required=("apiVersion", "kind", "metadata")))
    return [f"{name}: {e}" for e in errs]
