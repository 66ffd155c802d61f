"""The end-to-end benchmark: the same slice of a real trace, through the real Envoy, in front of
the same heterogeneous mock GPU cluster, once per balancing policy, side by side.

    .venv/bin/python examples/bench.py                      # the documented run (docs/BENCHMARKS.md)
    .venv/bin/python examples/bench.py --sweep 3,5,7,9      # SLO capacity per policy
    .venv/bin/python examples/bench.py --smoke              # seconds-long check of the pipeline (CI)
    .venv/bin/python examples/bench.py --previous-wasm old.wasm  # this build beside another one

Policies: Envoy's round_robin and least_request (the filter removed), the seed article's naive
rule (the filter with policy least_reported_load) and token-balancer (envoy/envoy.yaml as
shipped). Each policy gets a freshly started cluster, so none inherits another's queues. Output
under results/<name>/: every request (loadgen JSON per policy), the nodes' telemetry sampled
during each run, summary.json, summary.md (the table) and two SVG plots (latency CDF per policy,
per-node load over time). Times are model time: the mock GPUs run --time-scale times faster
than real time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import (TARGET, Envoy, MockCluster, envoy_config, free_port,  # noqa: E402
                     request, wait_until, without_filter)

LOADGEN = TARGET / "release/loadgen"
DATA = ROOT.parent / "shared/data"
TRACES = {"azure": ("azure", DATA / "AzureLLMInferenceTrace_conv.csv"),
          "mooncake": ("mooncake", DATA / "mooncake_synthetic_trace.jsonl")}
# Two fast and two slow GPUs (presets in examples/mock-node/src/engine.rs).
CLUSTER = [("fast-1", "gpu=a100"), ("fast-2", "gpu=a100"), ("slow-1", "gpu=l4"), ("slow-2", "gpu=l4")]
POLICIES = ["round_robin", "least_request", "cswrr_orca", "naive_seed", "token_balancer"]
# Ablations of token-balancer, run only when named in --policies: the shipped configuration
# with one setting changed.
VARIANTS = {"tb_no_hold": {"max_hold_ms": 0},
            "tb_hold_at_ceiling": {"hold_kv_ceiling": 0.9},
            # Every node compared on every request (argmin), against the shipped two choices.
            "tb_argmin": {"choices": 0},
            # The shipped configuration on another build of the filter (--previous-wasm): two
            # commits side by side in one run.
            "tb_previous": {}}
# Envoy's client_side_weighted_round_robin, weighing nodes by the ORCA load reports the mock
# sends in its `endpoint-load-metrics` response header (qps / utilization).
CSWRR = {"policies": [{"typed_extension_config": {
    "name": "envoy.load_balancing_policies.client_side_weighted_round_robin",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                 "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin",
        "blackout_period": "1s", "weight_update_period": "1s", "weight_expiration_period": "60s"}}}]}
# Another build of the filter for the `tb_previous` policy (--previous-wasm).
PREVIOUS_WASM: Path | None = None
SLO_TTFT_MS = 2000.0
SLO_TPOT_MS = 100.0


def envoy_for(policy: str, nodes: list[str]) -> dict:
    # Benchmarks run without the debug header: it costs a little on every response.
    plugin = {"debug_header": None}
    if policy == "naive_seed":
        plugin["policy"] = "least_reported_load"
    plugin.update(VARIANTS.get(policy, {}))
    wasm = PREVIOUS_WASM if policy == "tb_previous" else None
    cfg = envoy_config(nodes, free_port(), free_port(), plugin=plugin, wasm_file=wasm)
    if policy in ("round_robin", "least_request"):
        cfg = without_filter(cfg, policy.upper())
    elif policy == "cswrr_orca":
        cfg = without_filter(cfg, "ROUND_ROBIN")
        cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "gpu_nodes")
        del cluster["lb_policy"]
        cluster["load_balancing_policy"] = CSWRR
    return cfg


class Sampler(threading.Thread):
    """Samples every node's /health while a run goes on (for the per-node load plot and the
    VRAM-overflow count)."""

    def __init__(self, cluster: MockCluster, period: float):
        super().__init__(daemon=True)
        self.cluster, self.period = cluster, period
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        while not self.stop.is_set():
            t = time.monotonic() - self.t0
            for n in self.cluster.nodes:
                try:
                    h = request(n.port, "GET", "/health", timeout=2).json()
                    self.samples.append({"t": t, "node": n.name, **h})
                except (OSError, ValueError):
                    pass
            self.stop.wait(self.period)


def run_policy(policy: str, args, out_dir: Path) -> dict:
    cluster = MockCluster(CLUSTER, time_scale=args.time_scale)
    envoy = None
    try:
        envoy = Envoy(envoy_for(policy, [n.address for n in cluster.nodes]))
        if policy in ("naive_seed", "token_balancer", *VARIANTS):
            wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 2 * len(CLUSTER), 10,
                       "first health reports")
        sampler = Sampler(cluster, 0.25)
        sampler.start()
        kind, path = TRACES[args.trace]
        raw = out_dir / f"{policy}.json"
        cmd = [str(LOADGEN), "--url", f"http://127.0.0.1:{envoy.port}", "--trace", f"{kind}:{path}",
               "--start-s", str(args.start_s), "--duration-s", str(args.duration_s), "--rate", str(args.rate),
               "--time-scale", str(args.time_scale), "--max-tokens", str(args.max_tokens), "--label", policy,
               "--out", str(raw)]
        if args.requests:
            cmd += ["--requests", str(args.requests)]
        if args.max_prompt_tokens:
            cmd += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        sampler.stop.set()
        sampler.join()
        final = {n.name: n.health() for n in cluster.nodes}
        (out_dir / f"nodes_{policy}.json").write_text(json.dumps(sampler.samples))
        doc = json.loads(raw.read_text())
        doc["summary"]["vram_overflow_events"] = sum(h["vram_overflow_events"] for h in final.values())
        doc["summary"]["vram_overflow_events_per_node"] = {k: h["vram_overflow_events"] for k, h in final.items()}
        return doc
    finally:
        if envoy:
            envoy.stop()
        cluster.stop()


def fmt(x, digits=0):
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: dict[str, dict]) -> str:
    nodes = [n for n, _ in CLUSTER]
    head = ("| policy | TTFT p50 / p90 / p99 (ms) | e2e p50 / p90 / p99 (ms) | TPOT mean / p99 (ms) "
            "| output tok/s | VRAM overflows | errors | share per node (" + " / ".join(nodes) + ") |")
    lines = [head, "|" + "---|" * 8]
    for policy, doc in results.items():
        s = doc["summary"]
        t, e, p = s["ttft_ms"], s["e2e_ms"], s["tpot_ms"]
        total = max(1, s["requests"])
        share = " / ".join(f"{100 * s['requests_per_node'].get(n, 0) / total:.0f}%" for n in nodes)
        lines.append(f"| {policy} | {fmt(t['p50'])} / {fmt(t['p90'])} / {fmt(t['p99'])} "
                     f"| {fmt(e['p50'])} / {fmt(e['p90'])} / {fmt(e['p99'])} | {fmt(p['mean'], 1)} / {fmt(p['p99'], 1)} "
                     f"| {fmt(s['output_tokens_per_s'])} | {s['vram_overflow_events']} | {s['errors']} | {share} |")
    return "\n".join(lines)


def ratios(results: dict[str, dict]) -> str:
    if "token_balancer" not in results:
        return ""
    tb = results["token_balancer"]["summary"]
    out = []
    for base in ("least_request", "round_robin", "cswrr_orca", "naive_seed", "tb_previous"):
        if base not in results:
            continue
        b = results[base]["summary"]
        for metric in ("e2e_ms", "ttft_ms"):
            x, y = tb[metric]["p99"], b[metric]["p99"]
            if x is not None and y:
                out.append(f"- token_balancer p99 {metric[:-3]} / {base}: {x / y:.2f}")
        out.append(f"- VRAM overflows: token_balancer {tb['vram_overflow_events']}, {base} {b['vram_overflow_events']}")
    return "\n".join(out)


COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def svg_lines(title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
              logx: bool = False) -> str:
    """A minimal line chart (no plotting dependency)."""
    import math
    w, h, l, r, t, b = 720, 420, 70, 170, 40, 50
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"><text x="20" y="30">{title}: no data</text></svg>'
    fx = (lambda v: math.log10(max(v, 1e-9))) if logx else (lambda v: v)
    xs = [fx(p[0]) for p in pts]
    ys = [p[1] for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = 0.0, max(ys) if max(ys) > 0 else 1.0
    X = lambda v: l + (fx(v) - x0) / (x1 - x0) * (w - l - r)  # noqa: E731
    Y = lambda v: h - b - (v - y0) / (y1 - y0) * (h - t - b)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
           f'<line x1="{l}" y1="{h - b}" x2="{w - r}" y2="{h - b}" stroke="black"/>',
           f'<line x1="{l}" y1="{t}" x2="{l}" y2="{h - b}" stroke="black"/>',
           f'<text x="{(l + w - r) / 2}" y="{h - 12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{(t + h - b) / 2}" transform="rotate(-90 16 {(t + h - b) / 2})" text-anchor="middle">{ylabel}</text>']
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{l - 6}" y="{Y(yv) + 4}" text-anchor="end">{yv:.3g}</text>')
        xv = x0 + (x1 - x0) * i / 4
        label = 10 ** xv if logx else xv
        px = l + (xv - x0) / (x1 - x0) * (w - l - r)
        out.append(f'<text x="{px}" y="{h - b + 16}" text-anchor="middle">{label:.3g}</text>')
    for k, (name, s) in enumerate(series.items()):
        c = COLORS[k % len(COLORS)]
        path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.8" points="{path}"/>')
        out.append(f'<rect x="{w - r + 12}" y="{t + 18 * k}" width="12" height="12" fill="{c}"/>')
        out.append(f'<text x="{w - r + 30}" y="{t + 18 * k + 10}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def plots(results: dict[str, dict], out_dir: Path):
    cdf = {}
    for policy, doc in results.items():
        lat = sorted(r["e2e_ms"] / 1000 for r in doc["requests"] if r["e2e_ms"] is not None and r["status"] == 200)
        cdf[policy] = [(x, (i + 1) / len(lat)) for i, x in enumerate(lat)]
    (out_dir / "latency_cdf.svg").write_text(
        svg_lines("End-to-end latency CDF (model time)", "seconds (log)", "fraction of requests", cdf, logx=True))
    series = {}
    for policy in results:
        samples = json.loads((out_dir / f"nodes_{policy}.json").read_text())
        for n, _ in CLUSTER:
            s = [(x["t"], x["kv_cache_usage"]) for x in samples if x["node"] == n]
            series[f"{policy}:{n}"] = s
    # One chart per policy keeps the lines readable.
    for policy in results:
        sub = {k.split(":", 1)[1]: v for k, v in series.items() if k.startswith(policy + ":")}
        (out_dir / f"node_kv_{policy}.svg").write_text(
            svg_lines(f"{policy}: KV-cache use per node over time", "wall seconds", "KV-cache use (0..1)", sub))


def run_all(args, name: str, policies: list[str]) -> dict[str, dict]:
    out_dir = ROOT / "results" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in policies:
        t0 = time.monotonic()
        results[policy] = run_policy(policy, args, out_dir)
        s = results[policy]["summary"]
        print(f"  {policy:<15} {s['ok']}/{s['requests']} ok, p99 e2e {fmt(s['e2e_ms']['p99'])} ms, "
              f"p99 TTFT {fmt(s['ttft_ms']['p99'])} ms, overflows {s['vram_overflow_events']} "
              f"({time.monotonic() - t0:.0f}s)", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", choices=sorted(TRACES), default="azure")
    ap.add_argument("--start-s", type=float, default=600.0)
    ap.add_argument("--duration-s", type=float, default=240.0, help="trace seconds replayed")
    ap.add_argument("--rate", type=float, default=1.5, help="offered-load multiplier over the trace")
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-prompt-tokens", type=int, default=0,
                    help="cut longer trace prompts to this many tokens (Mooncake's longest exceed every KV cache)")
    ap.add_argument("--cluster", default="",
                    help="comma-separated GPU presets of the nodes, fast first (default a100,a100,l4,l4)")
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--name", default="")
    ap.add_argument("--sweep", default="", help="comma-separated rates: report the SLO capacity per policy")
    ap.add_argument("--smoke", action="store_true", help="a few seconds of everything, for CI")
    ap.add_argument("--previous-wasm", type=Path, default=None,
                    help="another build of token_balancer.wasm, run as policy tb_previous beside this one "
                         "(compare two commits in one run)")
    args = ap.parse_args()
    if args.previous_wasm:
        global PREVIOUS_WASM
        if not args.previous_wasm.is_file():
            ap.error(f"--previous-wasm {args.previous_wasm}: no such file")
        PREVIOUS_WASM = args.previous_wasm.resolve()
    if args.cluster:
        global CLUSTER
        presets = [g for g in args.cluster.split(",") if g]
        CLUSTER = [(f"{g}-{i + 1}", f"gpu={g}") for i, g in enumerate(presets)]
    policies = [p for p in args.policies.split(",") if p]
    if args.previous_wasm and "tb_previous" not in policies:
        policies.append("tb_previous")
    if "tb_previous" in policies and not args.previous_wasm:
        ap.error("policy tb_previous needs --previous-wasm")
    unknown = set(policies) - set(POLICIES) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {POLICIES + sorted(VARIANTS)}")
    kind, path = TRACES[args.trace]
    if not path.exists():
        print(f"bench: trace {path} not found (the shared data folder sits beside the repository); skipping")
        return 0
    if args.smoke:
        args.duration_s, args.requests, args.time_scale, args.rate = 20.0, 24, 8.0, 4.0
    name = args.name or (("smoke-" if args.smoke else "") + time.strftime("%Y%m%d-%H%M%S"))

    if args.sweep:
        rates = [float(r) for r in args.sweep.split(",")]
        capacity = {p: None for p in policies}
        rows = []
        for rate in rates:
            args.rate = rate
            print(f"rate x{rate}:")
            res = run_all(args, f"{name}/rate-{rate}", policies)
            for p, doc in res.items():
                s = doc["summary"]
                ok = (s["errors"] == 0 and (s["ttft_ms"]["p99"] or 1e18) <= SLO_TTFT_MS
                      and (s["tpot_ms"]["p99"] or 1e18) <= SLO_TPOT_MS)
                rows.append({"rate": rate, "policy": p, "meets_slo": ok, **{k: s[k] for k in ("ttft_ms", "tpot_ms")}})
                if ok and (capacity[p] is None or rate > capacity[p]):
                    capacity[p] = rate
        out = ROOT / "results" / name / "sweep.json"
        out.write_text(json.dumps({"rates": rates, "capacity": capacity, "rows": rows}, indent=1))
        print(f"\nhighest rate multiplier meeting p99 TTFT <= {SLO_TTFT_MS:.0f} ms and p99 TPOT <= {SLO_TPOT_MS:.0f} ms:")
        for p, c in capacity.items():
            print(f"  {p:<15} {c if c is not None else 'none of the rates tried'}")
        print(f"(raw: {out})")
        return 0

    print(f"benchmark {name}: {args.trace} trace from {args.start_s:.0f}s for {args.duration_s:.0f}s, rate x{args.rate}, "
          f"time scale {args.time_scale}, cluster {', '.join(f'{n} ({s[4:]})' for n, s in CLUSTER)}")
    results = run_all(args, name, policies)
    out_dir = ROOT / "results" / name
    plots(results, out_dir)
    md = table(results)
    rt = ratios(results)
    (out_dir / "summary.md").write_text(md + "\n\n" + rt + "\n")
    (out_dir / "summary.json").write_text(json.dumps(
        {"args": vars(args), "cluster": CLUSTER, "summaries": {p: d["summary"] for p, d in results.items()}},
        indent=1, default=str))
    print("\n" + md + "\n\n" + rt)
    print(f"\nresults in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
