#!/usr/bin/env python3
"""A grid over the cluster simulator: every workload of the load generator's family, Poisson
and bursty arrivals, several loads and replica counts, on two fleets; one build beside another
(or one policy beside others) in every cell, and what moved, summed up.

It is how the decode-heavy holding problem was found and how its fix was checked
(docs/BENCHMARKS.md, "Decode-heavy traffic"): a routing change is shown on every workload at
once, not on the one it was made for.

    .venv/bin/python examples/sim_grid.py                                 # tb beside least-request and gateway
    .venv/bin/python examples/sim_grid.py --previous-sim /tmp/sim-before  # this build's tb beside another build's
    .venv/bin/python examples/sim_grid.py --seed 2 --loads 0.5,0.8,1.0 --name grid-seed2

Each cell is one `sim` run (deterministic for a seed; a few hundred milliseconds). Results go to
results/<name>/: grid.json (every cell, every policy) and grid.md (the cells where the first
policy is behind another, or where the two builds differ, and the summary by load).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "target/release/sim"
# A build from before a workload was added cannot be compared on it: leave it out with
# --workloads (ShareGPT came after 2026-12-06's builds).
WORKLOADS = ["azure", "prefill", "decode", "mixed", "long", "tenants", "hot", "mooncake", "sharegpt"]
FLEETS = {"a100,a100,l4,l4": 4, "mixed": 16}


def run_cell(sim: Path, fleet: str, nodes: int, workload: str, arrivals: str, load: float,
             replicas: int, policies: str, seed: int, duration_s: int) -> dict[str, dict]:
    """One simulator run; its table rows by policy: p50/p99 TTFT and e2e (ms), overflows."""
    cmd = [str(sim), "--fleet", fleet, "--nodes", str(nodes), "--replicas", str(replicas),
           "--workload", workload, "--arrivals", arrivals, "--load", str(load),
           "--duration-s", str(duration_s), "--warmup-s", str(max(1, duration_s // 6)),
           "--policies", policies, "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or "/" not in cells[1] or cells[0] == "policy":
            continue
        try:
            ttft = [float(x) for x in cells[1].split("/")]
            e2e = [float(x) for x in cells[2].split("/")]
            overflows = int(cells[5].split()[0])
        except ValueError:
            continue
        rows[cells[0]] = {"ttft_p50": ttft[0], "ttft_p99": ttft[1], "e2e_p50": e2e[0],
                          "e2e_p99": e2e[1], "overflows": overflows}
    return rows


def same(a: dict, b: dict) -> bool:
    """Two cells' figures are the same (a cell with no completed request has NaN percentiles in
    both builds: the same, not a change)."""
    def eq(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sim", default=str(SIM), help="the simulator binary (built if missing)")
    ap.add_argument("--previous-sim", help="another build's simulator: its tb beside this one's")
    ap.add_argument("--policies", default="tb,least-request,gateway",
                    help="policies of each cell, the first compared with the others "
                         "(without --previous-sim)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--arrivals", default="poisson,bursts")
    ap.add_argument("--loads", default="0.5,0.8,1.0")
    ap.add_argument("--replicas", default="1,4")
    ap.add_argument("--fleets", default=";".join(f"{f}:{n}" for f, n in FLEETS.items()),
                    help="';'-separated fleet:nodes pairs (a fleet as sim's --fleet takes it)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration-s", type=int, default=120)
    ap.add_argument("--name", default="sim-grid")
    args = ap.parse_args()

    sim = Path(args.sim)
    if not sim.exists():
        subprocess.run(["cargo", "build", "--release", "-p", "sim"], cwd=ROOT, check=True)
    fleets = []
    for spec in args.fleets.split(";"):
        fleet, _, nodes = spec.rpartition(":")
        fleets.append((fleet, int(nodes)))

    cells = []
    for fleet, nodes in fleets:
        for workload in args.workloads.split(","):
            for arrivals in args.arrivals.split(","):
                for load in (float(x) for x in args.loads.split(",")):
                    for replicas in (int(x) for x in args.replicas.split(",")):
                        key = dict(fleet=fleet, nodes=nodes, workload=workload,
                                   arrivals=arrivals, load=load, replicas=replicas)
                        if args.previous_sim:
                            now = run_cell(sim, **key, policies="tb", seed=args.seed,
                                           duration_s=args.duration_s).get("tb")
                            before = run_cell(Path(args.previous_sim), **key, policies="tb",
                                              seed=args.seed, duration_s=args.duration_s).get("tb")
                            rows = {"before": before, "now": now}
                        else:
                            rows = run_cell(sim, **key, policies=args.policies, seed=args.seed,
                                            duration_s=args.duration_s)
                        cells.append({**key, "rows": rows})
                        print(f"{fleet} {workload} {arrivals} load {load} replicas {replicas}: "
                              + ", ".join(f"{p} {r['ttft_p99']:.0f}/{r['e2e_p99']:.0f} ms "
                                          f"{r['overflows']} overflows"
                                          for p, r in rows.items() if r), flush=True)

    first, others = ("now", ["before"]) if args.previous_sim else (
        args.policies.split(",")[0], args.policies.split(",")[1:])
    lines = [f"Simulator grid, seed {args.seed}, {len(cells)} cells: `{first}` beside "
             + ", ".join(f"`{o}`" for o in others) + ".", "",
             "| cell | policy | p99 TTFT (ms) | p99 e2e (ms) | overflows |", "|---|---|---|---|---|"]
    summary = {}
    for c in cells:
        a = c["rows"].get(first)
        if not a:
            continue
        label = f"{c['fleet']} {c['workload']} {c['arrivals']} {c['load']} x{c['replicas']}"
        for o in others:
            b = c["rows"].get(o)
            if not b:
                continue
            rt, re_ = ratio(a["ttft_p99"], b["ttft_p99"]), ratio(a["e2e_p99"], b["e2e_p99"])
            band = "up to 0.8" if c["load"] <= 0.8 else ("1.0" if c["load"] <= 1.0 else "past 1.0")
            s = summary.setdefault((o, band), {"cells": 0, "changed": 0, "ttft": [], "e2e": [],
                                               "ours": 0, "theirs": 0})
            s["cells"] += 1
            s["ours"] += a["overflows"]
            s["theirs"] += b["overflows"]
            if not same(a, b):
                s["changed"] += 1
                if rt and re_:
                    s["ttft"].append(math.log(rt))
                    s["e2e"].append(math.log(re_))
            behind = (rt or 1) > 1.1 or (re_ or 1) > 1.05 or a["overflows"] > b["overflows"]
            if behind:
                lines.append(f"| {label} | {first} / {o} | {a['ttft_p99']:.0f} / {b['ttft_p99']:.0f}"
                             f" ({rt or float('nan'):.2f}x) | {a['e2e_p99']:.0f} / {b['e2e_p99']:.0f}"
                             f" ({re_ or float('nan'):.2f}x) | {a['overflows']} / {b['overflows']} |")
    lines += ["", f"| against | loads | cells | cells that differ | p99 TTFT, geometric mean over them"
                  f" | p99 e2e | overflows, {first} / against |", "|---|---|---|---|---|---|---|"]
    for (o, band), s in sorted(summary.items()):
        g = lambda xs: f"{math.exp(sum(xs) / len(xs)):.2f}x" if xs else "-"
        lines.append(f"| {o} | {band} | {s['cells']} | {s['changed']} | {g(s['ttft'])} | {g(s['e2e'])}"
                     f" | {s['ours']} / {s['theirs']} |")
    report = "\n".join(lines) + "\n"
    out = ROOT / "results" / args.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps({"seed": args.seed, "cells": cells}, indent=1))
    (out / "grid.md").write_text(report)
    print()
    print(report)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
