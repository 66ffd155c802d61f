"""Test harness: runs the real Envoy with the built filter in front of mock GPU nodes.

Everything runs as plain processes on 127.0.0.1 with ports picked free per run. Waits poll
with deadlines; nothing sleeps for a fixed time and hopes.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# CARGO_TARGET_DIR, when set, is where cargo put the builds (as it is for cargo itself).
TARGET = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
WASM = TARGET / "wasm32-wasip1/release/token_balancer.wasm"
MOCK = TARGET / "release/mock-gpu-node"
ENVOY = ROOT / ".venv/bin/envoy"
ENVOY_YAML = ROOT / "envoy/envoy.yaml"
KV_BYTES_PER_TOKEN = 512 * 1024


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before in this process: the kernel may give the
    same ephemeral port to two binds in a row once the first socket is closed, and two of our
    servers must never be told the same port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_until(predicate, timeout: float, what, interval: float = 0.02):
    """Polls `predicate` until it returns a truthy value, or fails the test at the deadline;
    `what` names the wait (a string, or a function giving one, called only on failure)."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, http.client.HTTPException, ValueError) as e:
            last_error = e
        time.sleep(interval)
    if callable(what):
        what = what()
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)


def request(port: int, method: str, path: str, body=None, headers=None, timeout=30.0) -> Response:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body
        hdrs = dict(headers or {})
        if body is not None and not isinstance(body, (bytes, str)):
            data = json.dumps(body)
            hdrs.setdefault("content-type", "application/json")
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


@dataclass
class MockNode:
    name: str
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_health(self, **overrides):
        r = request(self.port, "POST", "/admin/health", body=overrides)
        assert r.status == 200, r

    def reset_health(self):
        self.set_health(reset=True)

    def stats(self) -> dict:
        return request(self.port, "GET", "/admin/stats").json()

    def health(self) -> dict:
        return request(self.port, "GET", "/health").json()

    def report(self) -> dict:
        """The seed report (load, KV, overflows), whatever `/health` serves."""
        return request(self.port, "GET", "/admin/report").json()


class MockCluster:
    """One mock-gpu-node process serving several nodes, each `(name, spec)`: spec is the
    `key=value,...` part of `--node PORT,...`."""

    def __init__(self, specs: list[tuple[str, str]], time_scale: float = 1.0, ports: list[int] | None = None):
        ports = ports or [free_port() for _ in specs]
        self.nodes = [MockNode(name, port) for (name, _), port in zip(specs, ports)]
        args = [str(MOCK), "--time-scale", str(time_scale)]
        for node, (_, spec) in zip(self.nodes, specs):
            extra = f",{spec}" if spec else ""
            args += ["--node", f"{node.port},name={node.name}{extra}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_until(self._listening, 15, "mock nodes to listen")

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            self._reader.join(2)
            raise AssertionError(f"mock-gpu-node exited with {self.proc.returncode}: {self.output[-5:]}")
        return sum("listening" in line for line in self.output) >= len(self.nodes)

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line.rstrip())

    def __getitem__(self, i: int) -> MockNode:
        return self.nodes[i]

    def by_port(self) -> dict[int, MockNode]:
        return {n.port: n for n in self.nodes}

    def by_name(self, name: str) -> MockNode:
        return next(n for n in self.nodes if n.name == name)

    def stop(self):
        stop_process(self.proc)


def polls_seen(cluster: "MockCluster", tick_ms: int, rounds: int = 3):
    """Waits until every VM of the filter has polled every node since the caller's change:
    every node has answered `rounds` more health polls, and a quiet period and a tick have
    passed, since a quiet node is polled once per `quiet_poll_ms`, by default eight ticks (at
    most 2 s), by each VM that polls (with `poller: vm`, every one of them). A poll is of
    `/health` or of an engine's metrics."""
    def polled(n: MockNode) -> int:
        s = n.stats()
        return s["health_requests_total"] + s["metrics_requests_total"]

    start = {n.name: polled(n) for n in cluster.nodes}
    t0 = time.monotonic()
    wait_s = (min(8 * tick_ms, 2000) + tick_ms) / 1000
    wait_until(lambda: all(polled(n) >= start[n.name] + rounds for n in cluster.nodes)
               and time.monotonic() - t0 >= wait_s, 10 + wait_s,
               f"{rounds} health polls per node and five ticks")


def stop_process(proc: subprocess.Popen, grace: float = 5):
    """Terminates `proc` if it still runs, and kills it if it has not exited after `grace`
    seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def node_stat(address: str, what: str) -> str:
    """The name of the filter's per-node counter `what` (`picks`, `health_failures`) of the node
    at `address`, as `Envoy.counters` gives it."""
    return f"token_balancer.node.{address}.{what}"


def envoy_config(node_addresses: list[str], listener_port: int, admin_port: int, plugin: dict | None = None,
                 health_addresses: dict[str, str] | None = None, poller: str | None = None,
                 wasm_file: Path | None = None, beliefs_port: int | None = None) -> dict:
    """The shipped envoy/envoy.yaml with this run's ports, nodes and plugin settings.

    Starting from the shipped file (not a copy kept for tests) means the tests run the same
    listener, clusters, retry policy and filter settings a user runs. `poller` "singleton" keeps
    the shipped poller service (bootstrap_extensions; it shares the filter's vm_config and
    configuration objects through the YAML anchors, so every change below reaches both);
    "vm" drops it and lets every VM poll. Unset, it is $TB_POLLER, else "vm" (the mode of the
    tests written before the service), so `TB_POLLER=singleton pytest ...` runs a test file in
    the other mode. `wasm_file` loads another build of the filter (a benchmark's side-by-side run of
    two commits); unset, the one this tree builds. `beliefs_port` keeps the shipped operator
    listener on that port, its filter configured as the public one plus its beliefs_path;
    unset, the operator listener is dropped (it would poll on its own with `poller` "vm")."""
    poller = poller or os.environ.get("TB_POLLER") or "vm"
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    if poller == "vm":
        cfg.pop("bootstrap_extensions", None)
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listener_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]
    wasm["vm_config"]["code"]["local"]["filename"] = str(wasm_file or WASM)
    conf = json.loads(wasm["configuration"]["value"])
    conf["nodes"] = []
    for a in node_addresses:
        node = {"address": a}
        if health_addresses and a in health_addresses:
            node["health_address"] = health_addresses[a]
        conf["nodes"].append(node)
    # The tests read the filter's decisions from its debug header, off in the shipped file.
    conf["debug_header"] = "x-token-balancer"
    conf["poller"] = poller
    conf.update(plugin or {})
    wasm["configuration"]["value"] = json.dumps(conf)
    listeners = cfg["static_resources"]["listeners"]
    operator = next(li for li in listeners if li["name"] == OPERATOR_LISTENER)
    if beliefs_port is None:
        listeners.remove(operator)
    else:
        operator["address"]["socket_address"]["port_value"] = beliefs_port
        op = operator_plugin(cfg)
        shipped = json.loads(op["configuration"]["value"])
        op["configuration"] = {"@type": op["configuration"]["@type"],
                               "value": json.dumps({**conf, "beliefs_path": shipped["beliefs_path"]})}
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "gpu_nodes")
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": a.rsplit(":", 1)[0],
                                                     "port_value": int(a.rsplit(":", 1)[1])}}}}
        for a in node_addresses
    ]
    return cfg


OPERATOR_LISTENER = "operator"


def operator_plugin(cfg: dict) -> dict:
    """The token_balancer filter's config on the operator listener."""
    li = next(li for li in cfg["static_resources"]["listeners"] if li["name"] == OPERATOR_LISTENER)
    hcm = li["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]


def with_node_settings(cfg: dict, settings: list[dict]) -> dict:
    """Adds per-node plugin settings (health_path, format, models, ...) to an envoy_config
    result, node by node in order."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]
    conf = json.loads(wasm["configuration"]["value"])
    for node, extra in zip(conf["nodes"], settings):
        node.update(extra)
    wasm["configuration"]["value"] = json.dumps(conf)
    return cfg


def without_filter(cfg: dict, lb_policy: str) -> dict:
    """The configuration with the token_balancer filter removed and the inference cluster on one
    of Envoy's own balancers (ROUND_ROBIN, LEAST_REQUEST): the baselines."""
    cfg = copy.deepcopy(cfg)
    cfg.pop("bootstrap_extensions", None)
    # The operator listener's only purpose is the filter's beliefs.
    cfg["static_resources"]["listeners"] = [li for li in cfg["static_resources"]["listeners"]
                                            if li["name"] != OPERATOR_LISTENER]
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "token_balancer"]
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "gpu_nodes")
    cluster.pop("load_balancing_policy", None)
    cluster["lb_policy"] = lb_policy
    return cfg


class Envoy:
    def __init__(self, config: dict, concurrency: int = 1, expect_ready: bool = True, log_level: str = "info"):
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        # A configuration whose listener comes from LDS has none here; its test sets the port.
        listeners = config.get("static_resources", {}).get("listeners") or []
        self.port = listeners[0]["address"]["socket_address"]["port_value"] if listeners else None
        self.dir = tempfile.TemporaryDirectory(prefix="tb-envoy-")
        self.config_path = Path(self.dir.name) / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = Path(self.dir.name) / "envoy.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(ENVOY), "-c", str(self.config_path), "--concurrency", str(concurrency),
             "--base-id", str(self.admin_port), "--disable-hot-restart", "-l", log_level],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        if expect_ready:
            wait_until(self._ready, 30, f"envoy to be ready (log {self.log_path}: {self.tail()})")

    def _ready(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"envoy exited with {self.proc.returncode}: {self.tail()}")
        return request(self.admin_port, "GET", "/ready", timeout=1).status == 200

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text()

    def counters(self) -> dict[str, int]:
        """The filter's counters, without Envoy's `wasmcustom.` prefix."""
        r = request(self.admin_port, "GET", "/stats?format=json&filter=token_balancer")
        out = {}
        for s in r.json().get("stats", []):
            if "name" in s and "value" in s:
                out[s["name"].removeprefix("wasmcustom.")] = s["value"]
        return out

    def counter(self, name: str) -> int:
        return self.counters().get(name, 0)

    def stats(self, prefix: str) -> dict[str, int]:
        """Every Envoy stat whose name starts with `prefix` (counters and gauges)."""
        r = request(self.admin_port, "GET", f"/stats?format=json&filter=^{prefix}")
        return {s["name"]: s["value"] for s in r.json().get("stats", []) if "value" in s}

    def worker_connections(self) -> dict[str, int]:
        """Downstream connections each worker accepted on the inference listener."""
        out = {}
        for name, value in self.stats("listener.").items():
            parts = name.split(".")
            if name.endswith(".downstream_cx_total") and any(p.startswith("worker_") for p in parts):
                worker = next(p for p in parts if p.startswith("worker_"))
                if f"_{self.port}." in name:
                    out[worker] = value
        return out

    def post(self, path: str, body, headers=None, timeout=30.0) -> Response:
        return request(self.port, "POST", path, body=body, headers=headers, timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            try:
                request(self.admin_port, "POST", "/quitquitquit", timeout=2)
                self.proc.wait(10)
            except (OSError, http.client.HTTPException, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def stream_until_closed(port: int, body: dict, started: threading.Event, out: dict):
    """Streams one chat completion through the Envoy on `port` until it closes; sets `started`
    at the first chunk of the answer (the first token), and records in `out` the node that
    served it (`node`), the status, how it ended (`end`: "complete" with its `[DONE]`, else
    "error") and when (`ended_at`, monotonic)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        out["node"] = r.getheader("x-mock-node")
        out["status"] = r.status
        data = b""
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            data += chunk
            started.set()
        out["end"] = "complete" if b"[DONE]" in data else "error"
    except (OSError, http.client.HTTPException):
        out["end"] = "error"
    finally:
        out["ended_at"] = time.monotonic()
        started.set()
        conn.close()


def chat(prompt: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": "mock-model", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, **extra}
