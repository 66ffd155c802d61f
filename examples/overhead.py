"""What the filter costs inside Envoy: latency added to one request, requests per second kept,
Envoy CPU per request and the Wasm VMs' memory, for a small and a large fleet, measured side by
side with and without the filter.

    .venv/bin/python examples/overhead.py                    # the documented run (docs/BENCHMARKS.md)
    .venv/bin/python examples/overhead.py --nodes 10 --seconds 2 --rounds 1   # a quick look

Four Envoys, each with one worker (--concurrency 1), in front of the same mock nodes in
`instant` mode (every completion answered at once with one token, no engine: the upstream is as
fast as a real HTTP server gets, so what differs is the proxy):
- no filter, Envoy's least_request: the baseline;
- the floor (examples/wasm-floor): a Wasm filter that only pauses the request, copies the body
  into the VM and writes one header, which any body-based router in Envoy must do: what hosting
  such a filter costs, before any work of token-balancer's (it removes the routing header, so
  least_request picks the node; with --routed-floor the same filter also runs naming each
  request's node in turn, to show what having override_host send it there adds);
- token-balancer exactly as shipped (envoy/envoy.yaml: poller service, `choices: auto`, which
  stays at two here since the instant nodes report no load, debug header off), measured once it
  routes by its own choice;
- the ext_proc peer (examples/extproc-picker): no Wasm filter, Envoy's `ext_proc` filter asking
  an external picker process over gRPC (one stream per request: request headers, the buffered
  request body, response headers; with --extproc-follows-output the response body too, a
  message per chunk, which the picker reads for the output as the filter does), the way the
  Gateway API Inference Extension's endpoint picker
  sits behind Envoy. The picker runs the same decision core on the same configuration and polls
  the nodes itself; it is pinned to Envoy's CPU (the proxy side has one core in every kind), and
  its CPU time is added to Envoy's. It is measured once Envoy sends requests where it says.
The load is wrk (Debian package `wrk`, installed when missing) posting one chat completion with
a 4 KiB body (answered whole with one token; with --stream-tokens K, streamed as K token events,
each its own chunk, --token-gap-us apart, as engines stream: what following a streamed answer
costs, per token): latency with one connection (one request at a time, wrk -c1), p50 and p99;
throughput with --connections connections (wrk -c32): requests per second, and Envoy's CPU time
per request (user + system of the Envoy process over the run, plus the picker's for the ext_proc
peer: the steadiest figure on a shared machine). With two CPUs or more, Envoy (and the picker)
is pinned to one and wrk and the mock nodes to the others. Every measurement starts a fresh
Envoy; the order of the kinds turns every round, and
the added latency, the req/s kept and the CPU added are taken within each round (the same
stretch of machine time) before the median over rounds. The filter's background work (health
polls of every node each tick, by the poller service on Envoy's main thread) is counted against
it. Memory: the filter's `vm_memory_bytes` gauge (every VM's linear memory) with one worker and
with four, and each Envoy's resident set. With --profile, after each measurement Envoy runs the
same load again under perf, and its CPU per request is split by binary: the filter's Wasm code
as V8 compiled it, Envoy's own binary (V8's runtime and the host calls included), the kernel.

Output: a table on stdout and results/<name>/overhead.json and overhead.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import (TARGET, Envoy, MockCluster, envoy_config, free_port,  # noqa: E402
                     request, stop_process, wait_until, without_filter)

FLOOR_WASM = TARGET / "wasm32-wasip1/release/wasm_floor.wasm"
PICKER = TARGET / "release/extproc-picker"

TARGETS = {"p50_added_us": 50.0, "p99_added_us": 250.0, "rps_kept": 0.85}
# token-balancer against the ext_proc picker: at most half its added p50, 1.5 times its req/s.
VS_EXTPROC = {"p50_added_ratio": 0.5, "rps_ratio": 1.5}


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    print("overhead: installing wrk (Debian package)", flush=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True,
                   stdout=subprocess.DEVNULL)
    path = shutil.which("wrk")
    if not path:
        sys.exit("overhead: wrk is not installed and apt-get could not install it")
    return path


def body_of(size: int, stream: bool = False) -> bytes:
    """A chat completion request of exactly `size` bytes (the user message pads it); with
    `stream`, one that asks for its answer as server-sent events."""
    def make(n: int) -> bytes:
        words = ("the quick brown fox jumps over the lazy dog " * (n // 44 + 1))[:n]
        req = {"model": "mock-model", "max_tokens": 16,
               "messages": [{"role": "user", "content": words}]}
        if stream:
            req["stream"] = True
        return json.dumps(req).encode()
    empty = len(make(0))
    b = make(max(0, size - empty))
    assert len(b) == size, (len(b), size)
    return b


UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def parse_wrk(text: str) -> dict:
    """Requests, errors, requests per second and latency percentiles (us) from wrk's output."""
    out = {}
    m = re.search(r"(\d+) requests in", text)
    out["requests"] = int(m.group(1)) if m else 0
    m = re.search(r"Requests/sec:\s+([\d.]+)", text)
    out["rps"] = float(m.group(1)) if m else 0.0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    out["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: (.*)", text)
    out["socket_errors"] = m.group(1).strip() if m else ""
    for pct in ("50", "75", "90", "99"):
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        if m:
            out[f"p{pct}_us"] = float(m.group(1)) * UNITS[m.group(2)]
    return out


class Wrk:
    def __init__(self, wrk: str, body: bytes, workdir: Path, cpus: set[int] | None):
        self.wrk = wrk
        self.cpus = cpus
        body_path = workdir / "body.json"
        body_path.write_bytes(body)
        self.script = workdir / "post.lua"
        self.script.write_text(
            'wrk.method = "POST"\n'
            'wrk.headers["content-type"] = "application/json"\n'
            f'local f = io.open("{body_path}", "rb")\n'
            "wrk.body = f:read(\"*a\")\n"
            "f:close()\n")

    def run(self, port: int, connections: int, seconds: float) -> dict:
        cmd = [self.wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
               "-s", str(self.script), f"http://127.0.0.1:{port}/v1/chat/completions"]
        if self.cpus:
            cmd = ["taskset", "-c", ",".join(map(str, sorted(self.cpus)))] + cmd
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
        if p.returncode != 0:
            raise RuntimeError(f"wrk failed ({p.returncode}): {p.stderr or p.stdout}")
        r = parse_wrk(p.stdout)
        if r["requests"] == 0 or "p99_us" not in r:
            raise RuntimeError(f"wrk printed no result:\n{p.stdout}")
        if r["non_2xx"] or r["socket_errors"]:
            raise RuntimeError(f"failed requests through port {port}:\n{p.stdout}")
        return r


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int] | None):
    """Pins every thread of a process to `cpus` (nothing when None)."""
    if cpus is None:
        return
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:
            pass  # a thread that just ended


def gauge(envoy: Envoy, name: str) -> int:
    full = f"wasmcustom.token_balancer.{name}"
    return envoy.stats(full).get(full, 0)


def with_wasm(cfg: dict, wasm: Path, configuration: str = "") -> dict:
    """The configuration with another .wasm in the filter (the floor), configured with
    `configuration` (the floor: the destinations it names in turn, empty for none)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    config = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]
    config["vm_config"] = {**config["vm_config"], "code": {"local": {"filename": str(wasm)}}}
    config["configuration"] = {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": configuration}
    return cfg


def plugin_of(cfg: dict) -> str:
    """The token_balancer filter's JSON configuration in `cfg` (what the picker is given)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")
    return wasm["typed_config"]["config"]["configuration"]["value"]


def with_ext_proc(cfg: dict, picker_port: int) -> dict:
    """The configuration with the token_balancer filter replaced by Envoy's ext_proc filter,
    asking the picker on 127.0.0.1:`picker_port` over gRPC (HTTP/2); the gpu_nodes cluster is
    unchanged (override_host on x-gateway-destination-endpoint, least_request as the fallback)."""
    cfg = copy.deepcopy(cfg)
    cfg.pop("bootstrap_extensions", None)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    i = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "token_balancer")
    hcm["http_filters"][i] = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "extproc_picker"}},
            # A picker that cannot answer leaves the request to Envoy's fallback balancer.
            "failure_mode_allow": True,
            "message_timeout": "1s",
            # Lets the picker skip the body and response of a request it cannot route.
            "allow_mode_override": True,
            "processing_mode": {
                "request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                "response_header_mode": "SEND",
                # Following the answer's output, as the filter does, takes its body too.
                "response_body_mode": "STREAMED" if FOLLOW_OUTPUT else "NONE",
                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
            },
        },
    }
    cfg["static_resources"]["clusters"].append({
        "name": "extproc_picker",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        },
        "load_assignment": {"cluster_name": "extproc_picker", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": picker_port}}}}]}]},
    })
    return cfg


class Picker:
    """The ext_proc picker process (examples/extproc-picker) with `plugin`, the filter's JSON
    configuration, pinned to `cpus`; ready once its stats endpoint answers."""

    def __init__(self, plugin: str, cpus: set[int] | None):
        self.port, self.stats_port = free_port(), free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="tb-picker-")
        self.log_path = Path(self.dir.name) / "picker.log"
        self.log = open(self.log_path, "w")
        cmd = [str(PICKER), "--listen", f"127.0.0.1:{self.port}",
               "--stats", f"127.0.0.1:{self.stats_port}", "--config", plugin]
        if FOLLOW_OUTPUT:
            cmd.append("--follow-output")
        if cpus:
            # Every thread it starts inherits the affinity.
            cmd = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] + cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_until(self._ready, 15, lambda: f"the picker to serve its stats ({self.tail()})")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"extproc-picker exited with {self.proc.returncode}: {self.tail()}")
        return "routed" in self.stats()

    def tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-10:])
        except OSError:
            return ""

    def stats(self) -> dict:
        return request(self.stats_port, "GET", "/stats", timeout=5).json()

    def stop(self):
        stop_process(self.proc)
        self.log.close()
        self.dir.cleanup()


def routed_count(kind: str, e: Envoy) -> int:
    """Requests routed by the kind's own choice so far: the filter's counter, or the picker's."""
    if kind == "extproc":
        return e.picker.stats()["routed"]
    return e.counter("token_balancer.routed")


POST = {"content-type": "application/json"}
# Settings over the shipped configuration (--plugin), e.g. a longer tick for a large fleet.
PLUGIN: dict = {}
# Settings over those for the `tb_previous` kind only (--previous-plugin): two configurations of
# one build side by side.
PREVIOUS_PLUGIN: dict = {}


def start(kind: str, nodes: list[str], body: bytes, envoy_cpus, concurrency: int = 1,
          by_name: dict[str, str] | None = None) -> Envoy:
    """One Envoy of `kind`, pinned, taking requests. token_balancer: the shipped configuration
    (poller service, debug header off), once it routes by the filter rather than by Envoy's
    fallback; floor: the floor filter; plain: no filter, least_request; extproc: the ext_proc
    filter and its picker (as `e.picker`) with the shipped filter configuration, once Envoy
    sends requests to the nodes the picker names (`by_name`: each mock node's address by the
    name it answers with)."""
    picker = None
    if kind == "extproc":
        cfg = envoy_config(nodes, free_port(), free_port(),
                           plugin={"debug_header": None, **PLUGIN}, poller="singleton")
        picker = Picker(plugin_of(cfg), envoy_cpus)
        cfg = with_ext_proc(cfg, picker.port)
    elif kind == "plain":
        cfg = without_filter(envoy_config(nodes, free_port(), free_port(), poller="vm"), "LEAST_REQUEST")
    elif kind in ("floor", "floor_routed"):
        cfg = envoy_config(nodes, free_port(), free_port(), poller="vm")
        cfg.pop("bootstrap_extensions", None)
        cfg = with_wasm(cfg, FLOOR_WASM, ",".join(nodes) if kind == "floor_routed" else "")
    else:
        previous = kind == "tb_previous"
        cfg = envoy_config(nodes, free_port(), free_port(),
                           plugin={"debug_header": None, **PLUGIN, **(PREVIOUS_PLUGIN if previous else {})},
                           poller="singleton", wasm_file=PREVIOUS_WASM if previous else None)
    try:
        e = Envoy(cfg, concurrency=concurrency)
    except BaseException:
        if picker:
            picker.stop()
        raise
    e.picker = picker
    pin(e.proc.pid, envoy_cpus)
    if kind not in ROUTERS:
        r = e.post("/v1/chat/completions", body, headers=POST)
        assert r.status == 200, r
        return e

    def routes():
        before = routed_count(kind, e)
        r = e.post("/v1/chat/completions", body, headers=POST)
        assert r.status == 200, r
        return routed_count(kind, e) > before

    try:
        # Every node must have reported once (1,000 health polls on the first tick).
        wait_until(routes, 60, f"the {'picker' if picker else 'filter'} to route a request",
                   interval=0.2)
        if picker:
            served_where_picked(e, body, by_name or {})
    except BaseException:
        stop(e)
        raise
    return e


def served_where_picked(e: Envoy, body: bytes, by_name: dict[str, str], n: int = 8):
    """Checks that Envoy applied the picker's header mutation: `n` requests in a row, each
    served by the node the picker named first (the mock node says its name in x-mock-node)."""
    for _ in range(n):
        r = e.post("/v1/chat/completions", body, headers=POST)
        assert r.status == 200, r
        picked = (e.picker.stats()["last_pick"] or "").split(",")[0]
        served = by_name.get(r.headers.get("x-mock-node", ""))
        assert served == picked, f"the picker named {picked}, Envoy sent the request to {served}"


def stop(e: Envoy):
    e.stop()
    if e.picker:
        e.picker.stop()


def cpu_of(e: Envoy) -> float:
    """CPU seconds of the proxy side: Envoy's, plus the picker's for the ext_proc peer."""
    return cpu_seconds(e.proc.pid) + (cpu_seconds(e.picker.proc.pid) if e.picker else 0.0)


def failures(e: Envoy) -> str:
    """What Envoy (and the picker) counted of failed requests: for a failed run's message."""
    words = ("rq_4xx", "rq_5xx", "rx_reset", "connect_fail", "timeout", "ext_proc", "overflow")
    stats = {k: v for k, v in {**e.stats("http.inference."), **e.stats("cluster.")}.items()
             if v and any(w in k for w in words)}
    return json.dumps(stats) + (f" picker: {e.picker.stats()} {e.picker.tail()}" if e.picker else "")


def measure(kind: str, wrk: Wrk, nodes: list[str], body: bytes, args, envoy_cpus,
            by_name: dict[str, str] | None = None) -> dict:
    e = start(kind, nodes, body, envoy_cpus, by_name=by_name)
    try:
        return measured(kind, e, wrk, args)
    except RuntimeError as err:
        raise RuntimeError(f"{kind}: {err}\nEnvoy's counters: {failures(e)}") from err
    finally:
        stop(e)


def measured(kind: str, e: Envoy, wrk: Wrk, args) -> dict:
    """One measurement of a started Envoy: warm-up, latency (1 connection), throughput."""
    # Warm-up, not measured: V8 compiles the hot Wasm functions with its optimizing tier
    # only after they have run a while.
    wrk.run(e.port, args.connections, args.warmup)
    routed0 = routed_count(kind, e) if kind in ROUTERS else 0
    lat = wrk.run(e.port, 1, args.seconds)
    cpu0 = cpu_of(e)
    picker0 = cpu_seconds(e.picker.proc.pid) if e.picker else 0.0
    streams = kind in FILTERS and args.stream_tokens
    unread0 = e.counter("token_balancer.output.chunks_unread") if streams else 0
    routed1 = routed_count(kind, e) if streams else 0
    polls0 = e.counter("token_balancer.health.ok") if kind in FILTERS else 0
    t0 = time.monotonic()
    thr = wrk.run(e.port, args.connections, args.seconds)
    cpu_us = (cpu_of(e) - cpu0) / thr["requests"] * 1e6
    m = {"latency": lat, "throughput": thr, "cpu_us_per_request": cpu_us}
    if kind in FILTERS:
        # The health polls answered while the load ran: the poller's work on Envoy's main
        # thread, which shares the worker's core here.
        m["polls_per_s"] = (e.counter("token_balancer.health.ok") - polls0) / (time.monotonic() - t0)
    if streams:
        # Chunks of the streamed answers the filter counted without reading them, a stream:
        # counted when each ends, over the streams routed in the same stretch (wrk's count
        # leaves out the streams it cut at the end, which the counter has).
        unread = e.counter("token_balancer.output.chunks_unread") - unread0
        m["chunks_unread_per_request"] = unread / max(1, routed_count(kind, e) - routed1)
    if e.picker:
        m["picker_cpu_us_per_request"] = (
            (cpu_seconds(e.picker.proc.pid) - picker0) / thr["requests"] * 1e6)
    if kind in ROUTERS:
        routed = routed_count(kind, e) - routed0
        sent = lat["requests"] + thr["requests"]
        # wrk counts completed requests only; the few cut at the end were routed too.
        m["routed_share"] = min(1.0, routed / sent) if sent else 0.0
    if kind in FILTERS:
        m["vm_memory_bytes"] = gauge(e, "vm_memory_bytes")
    if args.profile:
        m["profile"] = profile(e, wrk, args)
    m["rss_bytes"] = rss_bytes(e.proc.pid) + (rss_bytes(e.picker.proc.pid) if e.picker else 0)
    return m


def profile(e: Envoy, wrk: Wrk, args) -> dict[str, float]:
    """Where Envoy's CPU goes under the throughput load: perf's samples of the Envoy process by
    binary, as shares. `vm` is the filters' Wasm code as V8 compiled it (perf's `[JIT]`);
    `envoy` is Envoy's own binary, V8's runtime included (the host calls, the crossings into
    and out of the VM); `kernel` the kernel's; `other` the C library and the rest."""
    load = threading.Thread(target=wrk.run, args=(e.port, args.connections, args.seconds))
    load.start()
    with tempfile.TemporaryDirectory(prefix="tb-perf-") as d:
        data = Path(d) / "perf.data"
        time.sleep(min(1.0, args.seconds / 4))
        subprocess.run(["perf", "record", "-q", "-F", "999", "-o", str(data), "-p", str(e.proc.pid),
                        "--", "sleep", str(max(1.0, args.seconds - 2))],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        load.join()
        report = subprocess.run(["perf", "report", "-i", str(data), "--sort", "dso", "--stdio", "-q"],
                                capture_output=True, text=True, check=True).stdout
    shares = {"vm": 0.0, "envoy": 0.0, "kernel": 0.0, "other": 0.0}
    for line in report.splitlines():
        parts = line.split(None, 1)
        if len(parts) != 2 or not parts[0].endswith("%"):
            continue
        share, dso = float(parts[0].rstrip("%")) / 100, parts[1].strip()
        key = ("vm" if dso.startswith("[JIT]") else "envoy" if dso == "envoy"
               else "kernel" if dso.startswith("[kernel") else "other")
        shares[key] += share
    return shares


def median(rows: list[dict], *path: str) -> float:
    def get(r):
        for p in path:
            r = r[p]
        return r
    return statistics.median(get(r) for r in rows)


KINDS = ["plain", "floor", "token_balancer", "extproc"]
# The kinds that run token-balancer: this build, and another one (--previous-wasm) beside it.
FILTERS = ("token_balancer", "tb_previous")
# The kinds that route by the core's choice: the filters and the ext_proc picker.
ROUTERS = FILTERS + ("extproc",)
PREVIOUS_WASM: Path | None = None
# The ext_proc picker follows each answer's body (--extproc-follows-output).
FOLLOW_OUTPUT = False


def fleet(n: int, args, wrk: Wrk, body: bytes, envoy_cpus, other_cpus) -> dict:
    print(f"== {n} nodes: starting the mock nodes (instant)", flush=True)
    spec = "instant=1"
    if args.stream_tokens:
        spec += f",instant_tokens={args.stream_tokens},instant_gap_us={args.token_gap_us}"
    mock = MockCluster([(f"n{i}", spec) for i in range(n)])
    pin(mock.proc.pid, other_cpus)
    try:
        nodes = [node.address for node in mock.nodes]
        by_name = {node.name: node.address for node in mock.nodes}
        runs = {k: [] for k in KINDS}
        for rnd in range(args.rounds):
            # The order turns every round, so a slow stretch of the machine hits each in turn.
            order = KINDS[rnd % len(KINDS):] + KINDS[:rnd % len(KINDS)]
            for kind in order:
                m = measure(kind, wrk, nodes, body, args, envoy_cpus, by_name)
                runs[kind].append(m)
                print(f"   round {rnd + 1} {kind:14}: p50 {m['latency']['p50_us']:6.0f} us, "
                      f"p99 {m['latency']['p99_us']:6.0f} us, {m['throughput']['rps']:7.0f} req/s, "
                      f"{'Envoy+picker' if kind == 'extproc' else 'Envoy'} CPU "
                      f"{m['cpu_us_per_request']:5.1f} us/request"
                      + (f", routed by the {'picker' if kind == 'extproc' else 'filter'} "
                         f"{m['routed_share']:.1%}" if "routed_share" in m else ""),
                      flush=True)
        # Memory with four workers: what one more worker's VM costs.
        e = start("token_balancer", nodes, body, envoy_cpus, concurrency=4)
        try:
            one = runs["token_balancer"][-1]["vm_memory_bytes"]
            for _ in range(64):
                e.post("/v1/chat/completions", body, headers=POST)
            four = wait_until(lambda: (g := gauge(e, "vm_memory_bytes")) > one and g, 10,
                              "the four workers' VM memory to show in the gauge")
        finally:
            e.stop()
    finally:
        mock.stop()

    out = {"nodes": n, "runs": runs}
    for kind in KINDS:
        out[kind] = {
            "p50_us": median(runs[kind], "latency", "p50_us"),
            "p99_us": median(runs[kind], "latency", "p99_us"),
            "rps": median(runs[kind], "throughput", "rps"),
            "cpu_us_per_request": median(runs[kind], "cpu_us_per_request"),
            "rss_bytes": median(runs[kind], "rss_bytes"),
        }
        if kind in FILTERS:
            out[kind]["polls_per_s"] = median(runs[kind], "polls_per_s")
        if kind in FILTERS and args.stream_tokens:
            out[kind]["chunks_unread_per_request"] = median(runs[kind], "chunks_unread_per_request")
    tb = runs["token_balancer"]
    out["routed_share"] = min(r["routed_share"] for r in tb)
    if "extproc" in KINDS:
        ext = runs["extproc"]
        out["extproc_routed_share"] = min(r["routed_share"] for r in ext)
        out["extproc"]["picker_cpu_us_per_request"] = median(ext, "picker_cpu_us_per_request")
        # Within each round, then the median: token-balancer's added p50 over the picker's
        # (lower is better) and its req/s over the picker's (higher is better).
        added = [(r["latency"]["p50_us"] - p["latency"]["p50_us"],
                  x["latency"]["p50_us"] - p["latency"]["p50_us"])
                 for r, x, p in zip(tb, ext, runs["plain"])]
        out["vs_extproc"] = {
            "p50_added_ratio": statistics.median(a / b if b > 0 else float("inf") for a, b in added),
            "rps_ratio": statistics.median(
                r["throughput"]["rps"] / x["throughput"]["rps"] for r, x in zip(tb, ext)),
            "cpu_ratio": statistics.median(
                r["cpu_us_per_request"] / x["cpu_us_per_request"] for r, x in zip(tb, ext)),
        }
    out["vm_memory_bytes"] = {"1_worker": one, "4_workers": four, "per_added_worker": (four - one) // 3}
    if args.profile:
        # Each round's shares times its CPU per request, then the median.
        for kind in KINDS:
            out[kind]["cpu_split_us"] = {
                part: statistics.median(r["profile"][part] * r["cpu_us_per_request"] for r in runs[kind])
                for part in ("vm", "envoy", "kernel", "other")}
    # Ratios within each round (the same stretch of machine time), then their median.
    for kind in KINDS[1:]:
        out[kind]["p50_added_us"] = statistics.median(
            r["latency"]["p50_us"] - p["latency"]["p50_us"] for r, p in zip(runs[kind], runs["plain"]))
        out[kind]["p99_added_us"] = statistics.median(
            r["latency"]["p99_us"] - p["latency"]["p99_us"] for r, p in zip(runs[kind], runs["plain"]))
        out[kind]["rps_kept"] = statistics.median(
            r["throughput"]["rps"] / p["throughput"]["rps"] for r, p in zip(runs[kind], runs["plain"]))
        out[kind]["cpu_added_us"] = statistics.median(
            r["cpu_us_per_request"] - p["cpu_us_per_request"] for r, p in zip(runs[kind], runs["plain"]))
    return out


def table(results: list[dict], args, pinned: str) -> str:
    mib = 1024 * 1024
    lines = [
        f"Command: `.venv/bin/python examples/overhead.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"One worker, {args.rounds} rounds of {args.seconds:g} s per measurement after "
        f"{args.warmup:g} s of warm-up (medians; "
        f"differences and ratios taken within each round), {args.body_bytes}-byte chat body, "
        + (f"answers streamed as {args.stream_tokens} token events {args.token_gap_us} us apart "
           f"(each its own chunk) and the SSE closing events, " if args.stream_tokens else
           "answered whole with one token, ")
        + f"one connection for latency, {args.connections} for throughput. {pinned}"
        + (f" Filter settings over the shipped ones: `{json.dumps(PLUGIN)}`." if PLUGIN else "")
        + (f" For tb_previous: `{json.dumps(PREVIOUS_PLUGIN)}`." if PREVIOUS_PLUGIN else ""),
        "",
        "| nodes | Envoy | p50 (us) | p99 (us) | req/s | CPU per request (us; Envoy, + picker for ext_proc) "
        "| p50 added | p99 added | req/s kept | CPU added |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for kind in KINDS:
            k = r[kind]
            added = ("| - | - | - | -" if kind == "plain" else
                     f"| {k['p50_added_us']:.0f} us | {k['p99_added_us']:.0f} us | {k['rps_kept']:.2f} "
                     f"| {k['cpu_added_us']:.0f} us")
            lines.append(f"| {r['nodes']} | {LABELS[kind]} | {k['p50_us']:.0f} | {k['p99_us']:.0f} "
                         f"| {k['rps']:.0f} | {k['cpu_us_per_request']:.0f} {added} |")
    lines += ["", "Health polls answered per second while the throughput load ran (the poller, on "
              "Envoy's main thread): " + "; ".join(
                  f"{r['nodes']} nodes: " + ", ".join(
                      f"{LABELS[kind]} {r[kind]['polls_per_s']:.0f}" for kind in FILTERS if kind in KINDS)
                  for r in results)]
    if args.stream_tokens:
        lines += ["", f"CPU added per token event (CPU added per request / {args.stream_tokens}):"]
        for r in results:
            lines.append(f"- {r['nodes']} nodes: " + ", ".join(
                f"{LABELS[kind]} {r[kind]['cpu_added_us'] / args.stream_tokens:.2f} us"
                for kind in KINDS[1:]))
            lines.append(f"- {r['nodes']} nodes, chunks of an answer the filter counted unread: "
                         + ", ".join(f"{LABELS[kind]} {r[kind]['chunks_unread_per_request']:.1f}"
                                     for kind in FILTERS if kind in KINDS)
                         + f" (of {args.stream_tokens} token events and 3 closing ones)")
    lines += ["", "| nodes | filter VMs' memory, 1 worker (all VMs) | 4 workers | per added worker "
              "| Envoy RSS: no filter / floor / token-balancer / ext_proc (Envoy + picker) "
              "| routed by the filter / by the picker |",
              "|---|---|---|---|---|---|"]
    for r in results:
        m = r["vm_memory_bytes"]
        ext = r.get("extproc")
        lines.append(
            f"| {r['nodes']} | {m['1_worker'] / mib:.2f} MiB | {m['4_workers'] / mib:.2f} MiB "
            f"| {m['per_added_worker'] / mib:.2f} MiB | {r['plain']['rss_bytes'] / mib:.0f} / "
            f"{r['floor']['rss_bytes'] / mib:.0f} / {r['token_balancer']['rss_bytes'] / mib:.0f}"
            + (f" / {ext['rss_bytes'] / mib:.0f}" if ext else "") + " MiB "
            f"| {r['routed_share']:.1%}"
            + (f" / {r['extproc_routed_share']:.1%}" if ext else "") + " |")
    if args.profile:
        lines += ["", "Where Envoy's CPU per request goes (perf's samples of the Envoy process by binary, "
                  "each round's shares times its CPU per request, medians; the picker's process is not "
                  "in it): the filter's Wasm code as V8 compiled it, Envoy's own binary (V8's runtime, "
                  "the host calls and the crossings into the VM included), the kernel, the rest.",
                  "", "| nodes | Envoy | Wasm code (us) | Envoy's binary (us) | kernel (us) | other (us) |",
                  "|---|---|---|---|---|---|"]
        for r in results:
            for kind in KINDS:
                c = r[kind]["cpu_split_us"]
                lines.append(f"| {r['nodes']} | {LABELS[kind]} | {c['vm']:.1f} | {c['envoy']:.1f} "
                             f"| {c['kernel']:.1f} | {c['other']:.1f} |")
    if args.stream_tokens:
        # The targets are for whole answers: a streamed run's latency and req/s are the mock
        # nodes' pacing, the same for every kind; what differs is the CPU.
        if "extproc" in KINDS:
            lines += ["", "CPU per request, token-balancer against the ext_proc picker (medians of "
                      "the rounds' ratios; the targets are for whole answers and are not judged here):"]
            for r in results:
                a, b, v = r["token_balancer"], r["extproc"], r["vs_extproc"]
                lines.append(f"- {r['nodes']} nodes: {a['cpu_us_per_request']:.0f} us vs "
                             f"{b['cpu_us_per_request']:.0f} us (of which the picker's "
                             f"{b['picker_cpu_us_per_request']:.0f} us; {v['cpu_ratio']:.2f}x)")
    else:
        lines += judged(results)
    if "tb_previous" in KINDS:
        lines += ["", "This build against the previous one (--previous-wasm), measured in the same rounds:"]
        for r in results:
            a, b = r["token_balancer"], r["tb_previous"]
            lines.append(
                f"- {r['nodes']} nodes: p50 added {a['p50_added_us']:.0f} us vs {b['p50_added_us']:.0f} us, "
                f"p99 added {a['p99_added_us']:.0f} us vs {b['p99_added_us']:.0f} us, req/s kept "
                f"{a['rps_kept']:.2f} vs {b['rps_kept']:.2f}, CPU added {a['cpu_added_us']:.0f} us vs "
                f"{b['cpu_added_us']:.0f} us")
    return "\n".join(lines) + "\n"


def judged(results: list[dict]) -> list[str]:
    """Whole answers against the targets, and against the picker."""
    lines: list[str] = []
    lines += ["", "Targets for token-balancer: p50 added <= {p50_added_us:.0f} us, p99 added <= "
              "{p99_added_us:.0f} us, req/s kept >= {rps_kept:.2f}.".format(**TARGETS)]
    for r in results:
        tb = r["token_balancer"]
        verdict = [
            ("p50 added", tb["p50_added_us"] <= TARGETS["p50_added_us"]),
            ("p99 added", tb["p99_added_us"] <= TARGETS["p99_added_us"]),
            ("req/s kept", tb["rps_kept"] >= TARGETS["rps_kept"]),
        ]
        lines.append(f"- {r['nodes']} nodes: " + ", ".join(
            f"{name} {'met' if ok else 'MISSED'}" for name, ok in verdict)
            + f" (the floor filter alone: p50 added {r['floor']['p50_added_us']:.0f} us, "
              f"req/s kept {r['floor']['rps_kept']:.2f})")
    if "extproc" in KINDS:
        lines += ["", "token-balancer against the ext_proc picker (the same core behind a gRPC stream "
                  "per request), measured in the same rounds; targets: p50 added at most "
                  "{p50_added_ratio:.1f}x the picker's, req/s at least {rps_ratio:.1f}x:".format(**VS_EXTPROC)]
        for r in results:
            a, b, v = r["token_balancer"], r["extproc"], r["vs_extproc"]
            lines.append(
                f"- {r['nodes']} nodes: p50 added {a['p50_added_us']:.0f} us vs {b['p50_added_us']:.0f} us "
                f"({v['p50_added_ratio']:.2f}x, "
                f"{'met' if v['p50_added_ratio'] <= VS_EXTPROC['p50_added_ratio'] else 'MISSED'}), "
                f"req/s {a['rps']:.0f} vs {b['rps']:.0f} ({v['rps_ratio']:.2f}x, "
                f"{'met' if v['rps_ratio'] >= VS_EXTPROC['rps_ratio'] else 'MISSED'}), "
                f"p99 added {a['p99_added_us']:.0f} us vs {b['p99_added_us']:.0f} us, CPU per request "
                f"{a['cpu_us_per_request']:.0f} us vs {b['cpu_us_per_request']:.0f} us "
                f"(of which the picker's {b['picker_cpu_us_per_request']:.0f} us; {v['cpu_ratio']:.2f}x)")
    return lines


LABELS = {"plain": "no filter (least_request)", "floor": "floor filter (reads the body)",
          "floor_routed": "floor filter naming the node (override_host)",
          "token_balancer": "token-balancer", "tb_previous": "token-balancer, previous build",
          "extproc": "ext_proc picker (same core, gRPC)"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="10,1000", help="fleet sizes, comma-separated (default 10,1000)")
    ap.add_argument("--seconds", type=float, default=5, help="length of each wrk run (default 5)")
    ap.add_argument("--warmup", type=float, default=2,
                    help="seconds of load before each measurement, not measured (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per fleet size (default 3)")
    ap.add_argument("--connections", type=int, default=32,
                    help="connections of the throughput run (default 32)")
    ap.add_argument("--body-bytes", type=int, default=4096, help="request body size (default 4096)")
    ap.add_argument("--stream-tokens", type=int, default=0,
                    help="ask for streamed answers of this many token events, each its own chunk "
                         "(default 0: one whole answer of one token); the table then gives the CPU "
                         "added per token too")
    ap.add_argument("--token-gap-us", type=int, default=1000,
                    help="with --stream-tokens: microseconds between two token events (default 1000)")
    ap.add_argument("--plugin", default="{}",
                    help="JSON object of filter settings over the shipped ones, e.g. "
                         "'{\"tick_ms\": 1000}' (default: as shipped)")
    ap.add_argument("--name", default="overhead", help="results/<name>/ (default overhead)")
    ap.add_argument("--previous-wasm", type=Path, default=None,
                    help="another build of token_balancer.wasm, measured beside this one in every round "
                         "(compare two commits in one run)")
    ap.add_argument("--previous-plugin", default="{}",
                    help="JSON object of filter settings for the --previous-wasm build only, e.g. "
                         "'{\"choices\": 2}' with this build as --previous-wasm: two configurations side by side")
    ap.add_argument("--extproc-follows-output", action="store_true",
                    help="the ext_proc picker follows each answer's output as the filter does: Envoy "
                         "sends it the response body (STREAMED), a message per chunk, and it "
                         "releases the booking at the body's end rather than at the response headers")
    ap.add_argument("--no-extproc", action="store_true",
                    help="leave the ext_proc picker out (a quicker comparison of builds)")
    ap.add_argument("--routed-floor", action="store_true",
                    help="also run the floor filter naming each request's node in turn (override_host "
                         "sends it there), beside the floor that leaves the choice to least_request")
    ap.add_argument("--profile", action="store_true",
                    help="after each measurement, profile Envoy under the same load with perf and "
                         "split its CPU per request by binary: the filter's Wasm code, Envoy's own, "
                         "the kernel (needs perf)")
    args = ap.parse_args()
    if args.profile and not shutil.which("perf"):
        ap.error("--profile needs perf (Debian: apt-get install linux-perf)")
    PLUGIN.update(json.loads(args.plugin))
    PREVIOUS_PLUGIN.update(json.loads(args.previous_plugin))
    if args.no_extproc:
        KINDS.remove("extproc")
    if args.extproc_follows_output:
        global FOLLOW_OUTPUT
        FOLLOW_OUTPUT = True
        LABELS["extproc"] = "ext_proc picker following output (same core, gRPC, body STREAMED)"
    if args.routed_floor:
        KINDS.insert(KINDS.index("floor") + 1, "floor_routed")
    if args.previous_wasm:
        global PREVIOUS_WASM
        if not args.previous_wasm.is_file():
            ap.error(f"--previous-wasm {args.previous_wasm}: no such file")
        PREVIOUS_WASM = args.previous_wasm.resolve()
        KINDS.append("tb_previous")

    wrk_path = ensure_wrk()
    print("overhead: building the floor filter", flush=True)
    subprocess.run(["cargo", "build", "--quiet", "--release", "--target", "wasm32-wasip1",
                    "-p", "wasm-floor"], cwd=ROOT, check=True)
    print("overhead: building the ext_proc picker", flush=True)
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "extproc-picker"],
                   cwd=ROOT, check=True)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        # Envoy alone on one core, wrk and the mock nodes on the others: the load generator
        # never takes Envoy's cycles, and Envoy's CPU per request is what it is.
        envoy_cpus, other_cpus = {cpus[0]}, set(cpus[1:])
        pinned = f"Envoy pinned to CPU {cpus[0]}, wrk and the mock nodes to CPU {','.join(map(str, cpus[1:]))}."
    else:
        envoy_cpus = other_cpus = None
        pinned = "One CPU: nothing pinned."
    if args.stream_tokens < 0 or args.token_gap_us < 0:
        ap.error("--stream-tokens and --token-gap-us cannot be negative")
    body = body_of(args.body_bytes, stream=args.stream_tokens > 0)
    results = []
    with tempfile.TemporaryDirectory(prefix="tb-overhead-") as d:
        wrk = Wrk(wrk_path, body, Path(d), other_cpus)
        for n in [int(x) for x in args.nodes.split(",")]:
            results.append(fleet(n, args, wrk, body, envoy_cpus, other_cpus))
    out = ROOT / "results" / args.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(
        {"command": sys.argv, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results}, indent=1))
    md = table(results, args, pinned)
    (out / "overhead.md").write_text(md)
    print()
    print(md)
    print(f"written: {out}/overhead.json, {out}/overhead.md")


if __name__ == "__main__":
    main()
