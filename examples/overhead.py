"""What the filter costs inside Envoy: latency added to one request, requests per second kept,
Envoy CPU per request and the Wasm VMs' memory, for a small and a large fleet, measured side by
side with and without the filter.

    .venv/bin/python examples/overhead.py                    # the documented run (docs/BENCHMARKS.md)
    .venv/bin/python examples/overhead.py --nodes 10 --seconds 2 --rounds 1   # a quick look

Three Envoys, each with one worker (--concurrency 1), in front of the same mock nodes in
`instant` mode (every completion answered at once with one token, no engine: the upstream is as
fast as a real HTTP server gets, so what differs is the proxy):
- no filter, Envoy's least_request: the baseline;
- the floor (examples/wasm-floor): a Wasm filter that only pauses the request, copies the body
  into the VM and writes one header, which any body-based router in Envoy must do: what hosting
  such a filter costs, before any work of token-balancer's;
- token-balancer exactly as shipped (envoy/envoy.yaml: poller service, two choices, debug header
  off), measured once it routes by its own choice.
The load is wrk (Debian package `wrk`, installed when missing) posting one chat completion with
a 4 KiB body: latency with one connection (one request at a time, wrk -c1), p50 and p99;
throughput with --connections connections (wrk -c32): requests per second, and Envoy's CPU time
per request (user + system of the Envoy process over the run: the steadiest figure on a shared
machine). With two CPUs or more, Envoy is pinned to one and wrk and the mock nodes to the
others. Every measurement starts a fresh Envoy; the order of the three turns every round, and
the added latency, the req/s kept and the CPU added are taken within each round (the same
stretch of machine time) before the median over rounds. The filter's background work (health
polls of every node each tick, by the poller service on Envoy's main thread) is counted against
it. Memory: the filter's `vm_memory_bytes` gauge (every VM's linear memory) with one worker and
with four, and each Envoy's resident set.

Output: a table on stdout and results/<name>/overhead.json and overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import (TARGET, Envoy, MockCluster, envoy_config, free_port,  # noqa: E402
                     wait_until, without_filter)

FLOOR_WASM = TARGET / "wasm32-wasip1/release/wasm_floor.wasm"

TARGETS = {"p50_added_us": 50.0, "p99_added_us": 250.0, "rps_kept": 0.85}


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


def body_of(size: int) -> bytes:
    """A chat completion request of exactly `size` bytes (the user message pads it)."""
    def make(n: int) -> bytes:
        words = ("the quick brown fox jumps over the lazy dog " * (n // 44 + 1))[:n]
        return json.dumps({"model": "mock-model", "max_tokens": 16,
                           "messages": [{"role": "user", "content": words}]}).encode()
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


def with_wasm(cfg: dict, wasm: Path) -> dict:
    """The configuration with another .wasm in the filter (the floor)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    config = next(f for f in hcm["http_filters"] if f["name"] == "token_balancer")["typed_config"]["config"]
    config["vm_config"] = {**config["vm_config"], "code": {"local": {"filename": str(wasm)}}}
    config["configuration"] = {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": "{}"}
    return cfg


POST = {"content-type": "application/json"}
# Settings over the shipped configuration (--plugin), e.g. a longer tick for a large fleet.
PLUGIN: dict = {}


def start(kind: str, nodes: list[str], body: bytes, envoy_cpus, concurrency: int = 1) -> Envoy:
    """One Envoy of `kind`, pinned, taking requests. token_balancer: the shipped configuration
    (poller service, debug header off), once it routes by the filter rather than by Envoy's
    fallback; floor: the floor filter; plain: no filter, least_request."""
    if kind == "plain":
        cfg = without_filter(envoy_config(nodes, free_port(), free_port(), poller="vm"), "LEAST_REQUEST")
    elif kind == "floor":
        cfg = envoy_config(nodes, free_port(), free_port(), poller="vm")
        cfg.pop("bootstrap_extensions", None)
        cfg = with_wasm(cfg, FLOOR_WASM)
    else:
        cfg = envoy_config(nodes, free_port(), free_port(),
                           plugin={"debug_header": None, **PLUGIN}, poller="singleton",
                           wasm_file=PREVIOUS_WASM if kind == "tb_previous" else None)
    e = Envoy(cfg, concurrency=concurrency)
    pin(e.proc.pid, envoy_cpus)
    if kind not in FILTERS:
        r = e.post("/v1/chat/completions", body, headers=POST)
        assert r.status == 200, r
        return e

    def routes():
        before = e.counter("token_balancer.routed")
        r = e.post("/v1/chat/completions", body, headers=POST)
        assert r.status == 200, r
        return e.counter("token_balancer.routed") > before

    # Every node must have reported once (1,000 health polls on the first tick).
    wait_until(routes, 60, "the filter to route a request", interval=0.2)
    return e


def measure(kind: str, wrk: Wrk, nodes: list[str], body: bytes, args, envoy_cpus) -> dict:
    e = start(kind, nodes, body, envoy_cpus)
    try:
        # Warm-up, not measured: V8 compiles the hot Wasm functions with its optimizing tier
        # only after they have run a while.
        wrk.run(e.port, args.connections, args.warmup)
        routed0 = e.counter("token_balancer.routed") if kind in FILTERS else 0
        lat = wrk.run(e.port, 1, args.seconds)
        cpu0 = cpu_seconds(e.proc.pid)
        thr = wrk.run(e.port, args.connections, args.seconds)
        cpu_us = (cpu_seconds(e.proc.pid) - cpu0) / thr["requests"] * 1e6
        m = {"latency": lat, "throughput": thr, "cpu_us_per_request": cpu_us}
        if kind in FILTERS:
            routed = e.counter("token_balancer.routed") - routed0
            sent = lat["requests"] + thr["requests"]
            # wrk counts completed requests only; the few cut at the end were routed too.
            m["routed_share"] = min(1.0, routed / sent) if sent else 0.0
            m["vm_memory_bytes"] = gauge(e, "vm_memory_bytes")
        m["rss_bytes"] = rss_bytes(e.proc.pid)
        return m
    finally:
        e.stop()


def median(rows: list[dict], *path: str) -> float:
    def get(r):
        for p in path:
            r = r[p]
        return r
    return statistics.median(get(r) for r in rows)


KINDS = ["plain", "floor", "token_balancer"]
# The kinds that run token-balancer: this build, and another one (--previous-wasm) beside it.
FILTERS = ("token_balancer", "tb_previous")
PREVIOUS_WASM: Path | None = None


def fleet(n: int, args, wrk: Wrk, body: bytes, envoy_cpus, other_cpus) -> dict:
    print(f"== {n} nodes: starting the mock nodes (instant)", flush=True)
    mock = MockCluster([(f"n{i}", "instant=1") for i in range(n)])
    pin(mock.proc.pid, other_cpus)
    try:
        nodes = [node.address for node in mock.nodes]
        runs = {k: [] for k in KINDS}
        for rnd in range(args.rounds):
            # The order turns every round, so a slow stretch of the machine hits each in turn.
            order = KINDS[rnd % len(KINDS):] + KINDS[:rnd % len(KINDS)]
            for kind in order:
                m = measure(kind, wrk, nodes, body, args, envoy_cpus)
                runs[kind].append(m)
                print(f"   round {rnd + 1} {kind:14}: p50 {m['latency']['p50_us']:6.0f} us, "
                      f"p99 {m['latency']['p99_us']:6.0f} us, {m['throughput']['rps']:7.0f} req/s, "
                      f"Envoy CPU {m['cpu_us_per_request']:5.1f} us/request"
                      + (f", routed by the filter {m['routed_share']:.1%}" if "routed_share" in m else ""),
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
    tb = runs["token_balancer"]
    out["routed_share"] = min(r["routed_share"] for r in tb)
    out["vm_memory_bytes"] = {"1_worker": one, "4_workers": four, "per_added_worker": (four - one) // 3}
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
        f"differences and ratios taken within each round), 4 KiB chat body, one connection for "
        f"latency, {args.connections} for throughput. {pinned}"
        + (f" Filter settings over the shipped ones: `{json.dumps(PLUGIN)}`." if PLUGIN else ""),
        "",
        "| nodes | Envoy | p50 (us) | p99 (us) | req/s | Envoy CPU per request (us) "
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
    lines += ["", "| nodes | filter VMs' memory, 1 worker (all VMs) | 4 workers | per added worker "
              "| Envoy RSS: no filter / floor / token-balancer | routed by the filter |",
              "|---|---|---|---|---|---|"]
    for r in results:
        m = r["vm_memory_bytes"]
        lines.append(
            f"| {r['nodes']} | {m['1_worker'] / mib:.2f} MiB | {m['4_workers'] / mib:.2f} MiB "
            f"| {m['per_added_worker'] / mib:.2f} MiB | {r['plain']['rss_bytes'] / mib:.0f} / "
            f"{r['floor']['rss_bytes'] / mib:.0f} / {r['token_balancer']['rss_bytes'] / mib:.0f} MiB "
            f"| {r['routed_share']:.1%} |")
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


LABELS = {"plain": "no filter (least_request)", "floor": "floor filter (reads the body)",
          "token_balancer": "token-balancer", "tb_previous": "token-balancer, previous build"}


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
    ap.add_argument("--plugin", default="{}",
                    help="JSON object of filter settings over the shipped ones, e.g. "
                         "'{\"tick_ms\": 1000}' (default: as shipped)")
    ap.add_argument("--name", default="overhead", help="results/<name>/ (default overhead)")
    ap.add_argument("--previous-wasm", type=Path, default=None,
                    help="another build of token_balancer.wasm, measured beside this one in every round "
                         "(compare two commits in one run)")
    args = ap.parse_args()
    PLUGIN.update(json.loads(args.plugin))
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
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        # Envoy alone on one core, wrk and the mock nodes on the others: the load generator
        # never takes Envoy's cycles, and Envoy's CPU per request is what it is.
        envoy_cpus, other_cpus = {cpus[0]}, set(cpus[1:])
        pinned = f"Envoy pinned to CPU {cpus[0]}, wrk and the mock nodes to CPU {','.join(map(str, cpus[1:]))}."
    else:
        envoy_cpus = other_cpus = None
        pinned = "One CPU: nothing pinned."
    body = body_of(args.body_bytes)
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
