"""What one crossing into Envoy costs a Wasm filter, by kind of host call: the floor filter
(examples/wasm-floor) making N extra host calls of one kind per request, beside the same filter
making none, in the same rounds.

    .venv/bin/python examples/host_call_cost.py                     # the documented run
    .venv/bin/python examples/host_call_cost.py --rounds 1 --seconds 2 --kinds shared_get

Why: token-balancer's CPU above the floor filter is its own code in the VM plus its host calls
(docs/BENCHMARKS.md, "Where a request's cost goes"). This tells the two apart: a host call that
returns data (a shared-data value, a header that is there, a property) makes Envoy allocate in
the VM and copy into it; one that does not (a counter, an absent header, the clock) does not.

One Envoy worker pinned to one CPU, wrk and ten instant mock nodes on the other, as in
examples/overhead.py (whose helpers this uses); per kind, a fresh Envoy, 2 s of warm-up, then
`--seconds` of wrk with 32 connections posting a 4 KiB chat body, and Envoy's CPU per request.
The cost of one call is (CPU per request with the calls - without them) / N, taken within each
round, then the median over rounds.

Output: a table on stdout and results/<name>/host_call_cost.json and host_call_cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))

from harness import Envoy, MockCluster, envoy_config, free_port  # noqa: E402
from overhead import FLOOR_WASM, POST, Wrk, body_of, cpu_seconds, ensure_wrk, pin, with_wasm  # noqa: E402

KINDS = ["shared_get", "shared_set", "metric", "header_absent", "header_present", "property", "clock"]
LABELS = {
    "shared_get": "shared data read (96 bytes)",
    "shared_set": "shared data write (96 bytes)",
    "metric": "counter increment",
    "header_absent": "request header lookup, absent",
    "header_present": "request header lookup, present",
    "property": "property read (source.address)",
    "clock": "clock read",
}


def measure(configuration: str, wrk: Wrk, nodes: list[str], body: bytes, seconds: float, cpus) -> float:
    """Envoy CPU per request (us) with the floor filter configured with `configuration`."""
    cfg = envoy_config(nodes, free_port(), free_port(), poller="vm")
    cfg.pop("bootstrap_extensions", None)
    cfg = with_wasm(cfg, FLOOR_WASM, configuration)
    e = Envoy(cfg, concurrency=1)
    pin(e.proc.pid, cpus)
    try:
        r = e.post("/v1/chat/completions", body, headers=POST)
        assert r.status == 200, r
        wrk.run(e.port, 32, 2)
        c0 = cpu_seconds(e.proc.pid)
        t = wrk.run(e.port, 32, seconds)
        return (cpu_seconds(e.proc.pid) - c0) / t["requests"] * 1e6
    finally:
        e.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"host calls to measure (default {','.join(KINDS)})")
    ap.add_argument("--calls", type=int, default=20, help="calls of the kind per request (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--seconds", type=float, default=4, help="length of each wrk run (default 4)")
    ap.add_argument("--name", default="host-call-cost", help="results/<name>/ (default host-call-cost)")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"--kinds: unknown {sorted(unknown)} (known: {', '.join(KINDS)})")
    print("host_call_cost: building the floor filter", flush=True)
    subprocess.run(["cargo", "build", "--release", "--target", "wasm32-wasip1", "-p", "wasm-floor"],
                   cwd=ROOT, check=True)
    cpus = sorted(os.sched_getaffinity(0))
    envoy_cpus, other_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) >= 2 else (None, None)
    body = body_of(4096)
    wrk = Wrk(ensure_wrk(), body, Path(tempfile.mkdtemp()), other_cpus)
    mock = MockCluster([(f"n{i}", "instant=1") for i in range(10)])
    pin(mock.proc.pid, other_cpus)
    # "none" is the same filter with the probe making no call.
    runs: dict[str, list[float]] = {"none": [], **{k: [] for k in kinds}}
    order0 = list(runs)
    try:
        nodes = [n.address for n in mock.nodes]
        for rnd in range(args.rounds):
            order = order0[rnd % len(order0):] + order0[:rnd % len(order0)]
            for kind in order:
                configuration = "probe:clock:0" if kind == "none" else f"probe:{kind}:{args.calls}"
                us = measure(configuration, wrk, nodes, body, args.seconds, envoy_cpus)
                runs[kind].append(us)
                print(f"   round {rnd + 1} {kind:15}: Envoy CPU {us:6.1f} us/request", flush=True)
    finally:
        mock.stop()

    rows = []
    for kind in kinds:
        per_call = [(x - b) / args.calls for x, b in zip(runs[kind], runs["none"])]
        rows.append({"kind": kind, "label": LABELS[kind], "cpu_us_per_request": statistics.median(runs[kind]),
                     "us_per_call": statistics.median(per_call), "us_per_call_by_round": per_call})
    out_dir = ROOT / "results" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["examples/host_call_cost.py", *sys.argv[1:]])
    (out_dir / "host_call_cost.json").write_text(json.dumps(
        {"command": command, "calls": args.calls, "rounds": args.rounds, "runs": runs, "rows": rows}, indent=2))
    lines = [f"Command: `.venv/bin/python {command}`", "",
             f"Floor filter, {args.calls} calls per request of one kind, beside none "
             f"({statistics.median(runs['none']):.1f} us of Envoy CPU a request), {args.rounds} rounds; "
             "per call: the difference within each round over the calls, median over rounds.", "",
             "| host call | Envoy CPU a request | per call (median) | per call, round by round |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['cpu_us_per_request']:.1f} us | {r['us_per_call']:.2f} us | "
                     + ", ".join(f"{x:.2f}" for x in r["us_per_call_by_round"]) + " |")
    table = "\n".join(lines)
    (out_dir / "host_call_cost.md").write_text(table + "\n")
    print()
    print(table)
    print(f"\nwritten: {out_dir / 'host_call_cost.json'}, {out_dir / 'host_call_cost.md'}")


if __name__ == "__main__":
    main()
