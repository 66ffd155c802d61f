"""What polling the fleet costs Envoy: CPU of the poller with the fleet idle, per kind of page
the nodes serve, side by side.

    .venv/bin/python examples/poll_cost.py                        # the documented run (docs/BENCHMARKS.md)
    .venv/bin/python examples/poll_cost.py --nodes 50 --seconds 3 --rounds 1   # a quick look

One Envoy at a time, one worker (--concurrency 1), pinned to one CPU with the mock nodes on the
others; token-balancer as shipped (envoy/envoy.yaml: the poller service on Envoy's main thread,
tick 250 ms unless --plugin says otherwise), nodes configured by address only, so the filter
finds each node's telemetry itself. No requests are sent: what Envoy spends is the polls
(and Envoy's own idle work, measured by the `plain` Envoy without the filter and taken off).
Kinds, in an order that turns every round:
- plain: no filter, the baseline;
- json, json_every_tick: nodes serving the simple JSON health format at /health (about 200
  bytes), as shipped (idle nodes' reports do not move, so they are polled every
  `quiet_poll_ms`) and polled every tick (`quiet_poll_ms` = `tick_ms`);
- llamacpp: llama.cpp's /metrics (about 2 KB, asked whole: it ignores queries), as shipped;
- vllm_whole_every_tick: vLLM's /metrics, as large as a real v1 page (about 30 KB), asked
  whole (`filter_metrics: false`) every tick: what polling cost before either saving;
- vllm_filtered_every_tick: the same nodes asked for the samples read alone (`name[]`
  filters) every tick: the filter's saving alone;
- vllm: as shipped, filtered and quiet;
- json_previous, vllm_previous (with --previous-wasm FILE): json and vllm with another build
  of the filter, measured in the same rounds, to compare two builds side by side.
Per kind: Envoy CPU over the window as a share of one core (less the plain Envoy's), health
polls per second answered (the `health.ok` counter), Envoy CPU per poll, and bytes per answer
(from the mock nodes' own count of what they served).

Output: a table on stdout and results/<name>/poll_cost.json and poll_cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import (Envoy, MockCluster, envoy_config, free_port, wait_until,  # noqa: E402
                     with_node_settings, without_filter)
from overhead import cpu_seconds, pin  # noqa: E402

KINDS = ["plain", "json_every_tick", "json", "llamacpp", "vllm_whole_every_tick",
         "vllm_filtered_every_tick", "vllm"]
LABELS = {
    "plain": "no filter (Envoy idle)",
    "json_every_tick": "simple JSON health, every tick",
    "json": "simple JSON health, as shipped (quiet nodes less often)",
    "llamacpp": "llama.cpp /metrics (whole), as shipped",
    "vllm_whole_every_tick": "vLLM /metrics, whole page, every tick",
    "vllm_filtered_every_tick": "vLLM /metrics, name[] filtered, every tick",
    "vllm": "vLLM /metrics, as shipped (filtered, quiet nodes less often)",
}
# The mock flavour each kind's nodes serve, and the settings over the shipped ones.
FLAVOUR = {"plain": "json", "json_every_tick": "json", "json": "json", "llamacpp": "llamacpp",
           "vllm_whole_every_tick": "vllm", "vllm_filtered_every_tick": "vllm", "vllm": "vllm",
           "json_previous": "json", "vllm_previous": "vllm"}
# The kinds that run another build (--previous-wasm), and its file.
PREVIOUS = ("json_previous", "vllm_previous")
PREVIOUS_WASM: Path | None = None
EVERY_TICK = ("json_every_tick", "vllm_whole_every_tick", "vllm_filtered_every_tick")
SHIPPED_TICK_MS = 250
SPECS = {"json": "", "llamacpp": "metrics=llamacpp,kv_tokens=20000", "vllm": "metrics=vllm"}


def served(sample) -> tuple[int, int]:
    """(metrics-or-health answers, bytes) the sampled mock nodes served so far."""
    answers = size = 0
    for n in sample:
        s = n.stats()
        answers += s["metrics_requests_total"]
        size += s["metrics_bytes_total"]
    return answers, size


def measure(kind: str, cluster: MockCluster, args, plugin: dict, envoy_cpus) -> dict:
    nodes = [n.address for n in cluster.nodes]
    plugin = {"debug_header": None, **plugin}
    if kind in EVERY_TICK:
        plugin["quiet_poll_ms"] = plugin.get("tick_ms", SHIPPED_TICK_MS)
    cfg = envoy_config(nodes, free_port(), free_port(), plugin=plugin, poller="singleton",
                       wasm_file=PREVIOUS_WASM if kind in PREVIOUS else None)
    if kind == "plain":
        cfg = without_filter(cfg, "LEAST_REQUEST")
    elif kind == "vllm_whole_every_tick":
        cfg = with_node_settings(cfg, [{"filter_metrics": False}] * len(nodes))
    e = Envoy(cfg, concurrency=1)
    pin(e.proc.pid, envoy_cpus)
    try:
        if kind != "plain":
            # Every node found and polled a few times since (discovery's extra polls are not
            # part of the steady state).
            want = 3 * len(nodes)
            wait_until(lambda: e.counter("token_balancer.health.ok") >= want, 120,
                       lambda: f"{want} good polls ({e.counter('token_balancer.health.ok')} so far)",
                       interval=0.5)
        sample = cluster.nodes[:: max(1, len(cluster.nodes) // 20)]
        ok0 = e.counter("token_balancer.health.ok") if kind != "plain" else 0
        answers0, bytes0 = served(sample) if FLAVOUR[kind] != "json" else (0, 0)
        cpu0, t0 = cpu_seconds(e.proc.pid), time.monotonic()
        time.sleep(args.seconds)  # the measured window: Envoy idles but for its polls
        cpu1, t1 = cpu_seconds(e.proc.pid), time.monotonic()
        ok1 = e.counter("token_balancer.health.ok") if kind != "plain" else 0
        answers1, bytes1 = served(sample) if FLAVOUR[kind] != "json" else (0, 0)
        wall = t1 - t0
        m = {"core_share": (cpu1 - cpu0) / wall, "polls_per_s": (ok1 - ok0) / wall}
        m["bytes_per_answer"] = ((bytes1 - bytes0) / (answers1 - answers0)
                                 if answers1 > answers0 else None)
        if kind != "plain":
            m["unfiltered"] = e.counter("token_balancer.telemetry.unfiltered")
        return m
    finally:
        e.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000, help="fleet size (default 1000)")
    ap.add_argument("--seconds", type=float, default=10, help="measured window per kind (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"kinds to run (default {','.join(KINDS)})")
    ap.add_argument("--plugin", default="{}",
                    help="JSON object of filter settings over the shipped ones, e.g. '{\"tick_ms\": 1000}'")
    ap.add_argument("--name", default="poll-cost", help="results/<name>/ (default poll-cost)")
    ap.add_argument("--previous-wasm", type=Path, default=None,
                    help="another build's token_balancer.wasm: adds the kinds json_previous and "
                         "vllm_previous, measured in the same rounds")
    args = ap.parse_args()
    global PREVIOUS_WASM
    if args.previous_wasm:
        if not args.previous_wasm.is_file():
            ap.error(f"--previous-wasm {args.previous_wasm}: no such file")
        PREVIOUS_WASM = args.previous_wasm.resolve()
        KINDS.extend(PREVIOUS)
        LABELS["json_previous"] = f"simple JSON health, as shipped, previous build ({args.previous_wasm})"
        LABELS["vllm_previous"] = f"vLLM /metrics, as shipped, previous build ({args.previous_wasm})"
        if args.kinds == ",".join(KINDS[:-len(PREVIOUS)]):
            args.kinds = ",".join(KINDS)
    plugin = json.loads(args.plugin)
    kinds = args.kinds.split(",")
    if not args.previous_wasm and set(kinds) & set(PREVIOUS):
        ap.error("--kinds: json_previous and vllm_previous need --previous-wasm")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"--kinds: unknown {sorted(unknown)} (known: {', '.join(KINDS)})")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        envoy_cpus, other_cpus = {cpus[0]}, set(cpus[1:])
        pinned = f"Envoy pinned to CPU {cpus[0]}, the mock nodes to CPU {','.join(map(str, cpus[1:]))}."
    else:
        envoy_cpus = other_cpus = None
        pinned = "One CPU: nothing pinned."
    clusters = {}
    try:
        for flavour in sorted({FLAVOUR[k] for k in kinds}):
            print(f"== starting {args.nodes} mock nodes ({flavour})", flush=True)
            c = MockCluster([(f"n{i}", SPECS[flavour]) for i in range(args.nodes)])
            pin(c.proc.pid, other_cpus)
            clusters[flavour] = c
        runs = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
            for kind in order:
                m = measure(kind, clusters[FLAVOUR[kind]], args, plugin, envoy_cpus)
                runs[kind].append(m)
                size = f", {m['bytes_per_answer']:.0f} B per answer" if m["bytes_per_answer"] else ""
                print(f"   round {rnd + 1} {kind:14}: {m['core_share']:6.1%} of a core, "
                      f"{m['polls_per_s']:6.0f} polls/s{size}", flush=True)
    finally:
        for c in clusters.values():
            c.stop()

    idle = statistics.median(m["core_share"] for m in runs["plain"]) if "plain" in runs else 0.0
    out = {"nodes": args.nodes, "plugin": plugin, "runs": runs, "kinds": {}}
    for kind in kinds:
        rs = runs[kind]
        share = statistics.median(m["core_share"] for m in rs)
        polls = statistics.median(m["polls_per_s"] for m in rs)
        sizes = [m["bytes_per_answer"] for m in rs if m["bytes_per_answer"]]
        out["kinds"][kind] = {
            "core_share": share,
            "polling_share": share - idle if kind != "plain" else None,
            "polls_per_s": polls,
            "us_per_poll": (share - idle) / polls * 1e6 if kind != "plain" and polls else None,
            "bytes_per_answer": statistics.median(sizes) if sizes else None,
        }
    tick = plugin.get("tick_ms", SHIPPED_TICK_MS)
    lines = [
        f"Command: `.venv/bin/python examples/poll_cost.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"{args.nodes} nodes, tick {tick} ms, poller service, no requests; {args.rounds} rounds of "
        f"{args.seconds:g} s per kind (medians). {pinned}",
        "",
        "| nodes serve | Envoy CPU (share of a core) | polling (less idle Envoy) | polls/s | "
        "Envoy CPU per poll | bytes per answer |",
        "|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        k = out["kinds"][kind]
        fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
        lines.append(f"| {LABELS[kind]} | {k['core_share']:.1%} | {fmt(k['polling_share'], '{:.1%}')} | "
                     f"{fmt(k['polls_per_s'] if kind != 'plain' else None, '{:.0f}')} | "
                     f"{fmt(k['us_per_poll'], '{:.0f} us')} | {fmt(k['bytes_per_answer'], '{:.0f}')} |")
    md = "\n".join(lines) + "\n"
    dest = ROOT / "results" / args.name
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "poll_cost.json").write_text(json.dumps(
        {"command": sys.argv, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **out}, indent=1))
    (dest / "poll_cost.md").write_text(md)
    print()
    print(md)
    print(f"written: {dest}/poll_cost.json, {dest}/poll_cost.md")


if __name__ == "__main__":
    main()
