"""Admission benchmark: who waits, who goes first, who is told to come back, through the real
Envoy, side by side in one run.

    .venv/bin/python examples/admission_bench.py                 # the documented run
    .venv/bin/python examples/admission_bench.py --rate 1.5      # denser arrivals
    .venv/bin/python examples/admission_bench.py --smoke         # seconds-long pipeline check

The workload is `two-tenants` (examples/loadgen/src/trace.rs): tenant `chat` sends a steady
stream of short requests, tenant `docs` sends bursts of 30 long prompts that saturate the
fleet's KV cache; each request names its tenant in the inference gateway's fairness-id header.
Runs, each on a freshly started cluster (bench.py's, two A100-like and two L4-like nodes):

- least_request: Envoy's own balancer, the filter removed;
- shipped: token-balancer as shipped (holding for VRAM only);
- fifo: token-balancer holding also while every node has more than --queued-ms of prompts
  queued (`admission.max_queued_ms`), first in, first out (tenants not told apart);
- fair: the same with token-weighted fair queuing among tenants;
- lane: fair, and while both tenants are active one node kept with at most --lane-ms of
  prompts queued, which long prompts leave to short ones (`admission.short_lane_ms`);
- chat_alone: fair, with only tenant chat's requests (its p99 alone);
- priority: fair, with chat's requests naming an objective of priority 100 and docs' one of
  priority 0;
- slo: fair, with every request carrying a time-to-first-token budget of --slo-ms and a
  time-per-output-token budget of --tpot-ms (model time); slo_least_request: the same requests through least_request (which reads no budget),
  for the share that meets it.

Printed and saved under results/<name>/: per run and tenant, requests, answers, p50/p99 TTFT,
p99 end-to-end, output tokens/s over the tenant's span; for the budget runs, the share of
admitted requests that met the budget and how fast refusals were answered. Times are model
time unless they say wall.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402

SLO_MS = 2000.0
TPOT_MS = 100.0
QUEUED_MS = 500.0
LANE_MS = 200.0


def runs(slo_ms: float, tpot_ms: float, queued_ms: float, lane_ms: float) -> list[tuple[str, str, list[str]]]:
    """(run, policy, load generator arguments). The token-balancer runs hold a request while
    every node has more than `queued_ms` (model time) of prompts queued, so that the hold
    queue, not the engines' first-come queues, decides who goes first."""
    # In model time: bench.envoy_for scales it to the wall clock.
    limit = {"max_queued_ms": queued_ms} if queued_ms > 0 else {}
    bench.VARIANTS.update({
        "adm_fifo": {"admission": {**bench.VARIANTS["tb_fifo"]["admission"], **limit}},
        "adm_fair": {"admission": {**limit}},
        "adm_lane": {"admission": {**limit, "short_lane_ms": lane_ms}},
        "adm_lane_previous": {"admission": {**limit, "short_lane_ms": lane_ms}},
        "adm_fair_previous": {"admission": {**limit}},
        "adm_priority": {"admission": {**bench.VARIANTS["tb_priority"]["admission"], **limit}},
    })
    priority = ["--objective", "chat=interactive", "--objective", "docs=bulk"]
    budget = ["--slo-ttft-ms", str(slo_ms), "--slo-tpot-ms", str(tpot_ms)]
    return [("least_request", "least_request", []),
            ("shipped", "token_balancer", []),
            ("fifo", "adm_fifo", []),
            ("fair", "adm_fair", []),
            ("lane", "adm_lane", []),
            # The same on another build of the filter (--previous-wasm).
            ("lane_previous", "adm_lane_previous", []),
            ("chat_alone", "adm_fair", ["--only-tenant", "chat"]),
            ("priority", "adm_priority", priority),
            ("slo", "adm_fair", budget),
            # The same on another build of the filter (--previous-wasm).
            ("slo_previous", "adm_fair_previous", budget),
            ("slo_least_request", "least_request", budget)]


def pctl(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * q))]


def per_tenant(doc: dict, time_scale: float, slo_ms: float, tpot_ms: float) -> dict[str, dict]:
    out = {}
    for tenant in sorted({r["tenant"] for r in doc["requests"]}):
        rs = [r for r in doc["requests"] if r["tenant"] == tenant]
        ok = [r for r in rs if r["status"] == 200 and not r["error"]]
        refused = [r for r in rs if r["status"] in (429, 503)]
        ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
        e2e = [r["e2e_ms"] for r in ok if r["e2e_ms"] is not None]
        tokens = sum(r["tokens_received"] + r["prompt_tokens"] for r in ok)
        span = (max((r["sent_ms"] + (r["e2e_ms"] or 0)) for r in rs) - min(r["sent_ms"] for r in rs)) if rs else 0
        answer_wall = [r["e2e_ms"] / time_scale for r in refused if r["e2e_ms"] is not None]
        out[tenant] = {
            "requests": len(rs), "ok": len(ok), "refused": len(refused),
            "other_errors": len(rs) - len(ok) - len(refused),
            "ttft_p50": pctl(ttft, 0.5), "ttft_p99": pctl(ttft, 0.99), "e2e_p99": pctl(e2e, 0.99),
            "tokens_per_s": tokens / (span / 1000) if span > 0 else None,
            # Within both budgets: the first token in time, and the tokens after it no slower.
            "met_budget": (sum(r["ttft_ms"] is not None and r["ttft_ms"] <= slo_ms
                               and (r["tpot_ms"] is None or r["tpot_ms"] <= tpot_ms)
                               for r in ok) / len(ok)) if ok else None,
            "met_ttft": (sum(t <= slo_ms for t in ttft) / len(ttft)) if ttft else None,
            "refused_with_retry_after": sum(r["retry_after_s"] is not None for r in refused),
            "refusal_answer_wall_ms_p99": pctl(answer_wall, 0.99),
            "refusal_answer_wall_ms_max": max(answer_wall) if answer_wall else None,
        }
    return out


def f(x, digits=0):
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: dict[str, dict]) -> str:
    head = ("| run | tenant | requests | ok | refused (with Retry-After) | TTFT p50 / p99 (ms) | e2e p99 (ms) "
            "| prompt+output tok/s | admitted within budget | refusal answered, wall ms p99 / max | VRAM overflows |")
    lines = [head, "|" + "---|" * 11]
    for run, doc in rows.items():
        for tenant, t in doc["tenants"].items():
            met = "-" if t["met_budget"] is None or not run.startswith("slo") else f"{100 * t['met_budget']:.1f}%"
            lines.append(
                f"| {run} | {tenant} | {t['requests']} | {t['ok']} | {t['refused']} ({t['refused_with_retry_after']}) "
                f"| {f(t['ttft_p50'])} / {f(t['ttft_p99'])} | {f(t['e2e_p99'])} | {f(t['tokens_per_s'])} | {met} "
                f"| {f(t['refusal_answer_wall_ms_p99'], 1)} / {f(t['refusal_answer_wall_ms_max'], 1)} "
                f"| {doc['overflows']} |")
    return "\n".join(lines)


def verdicts(rows: dict[str, dict], slo_ms: float, tpot_ms: float) -> str:
    def get(run, tenant, key):
        return rows.get(run, {}).get("tenants", {}).get(tenant, {}).get(key)

    out = []
    alone = get("chat_alone", "chat", "ttft_p99")
    for run in ("least_request", "shipped", "fifo", "fair", "lane", "lane_previous"):
        x = get(run, "chat", "ttft_p99")
        if x is not None and alone:
            out.append(f"- chat p99 TTFT with docs' bursts / alone, {run}: {x / alone:.2f}x (target <= 2x)")
    fifo = get("fifo", "docs", "tokens_per_s")
    for run in ("fair", "lane", "lane_previous"):
        x = get(run, "docs", "tokens_per_s")
        if x and fifo:
            out.append(f"- docs throughput, {run} / fifo: {x / fifo:.2f} (target >= 0.90)")
    hi, lo = get("priority", "chat", "ttft_p99"), get("priority", "docs", "ttft_p99")
    if hi is not None and lo:
        out.append(f"- priority run, p99 TTFT of priority 100 / priority 0: {hi / lo:.2f} (target <= 0.25)")
    for run in ("slo", "slo_previous", "slo_least_request"):
        d = rows.get(run)
        if not d:
            continue
        ok = sum(t["ok"] for t in d["tenants"].values())
        met = sum((t["met_budget"] or 0) * t["ok"] for t in d["tenants"].values())
        refused = sum(t["refused"] for t in d["tenants"].values())
        told = sum(t["refused_with_retry_after"] for t in d["tenants"].values())
        worst = max((t["refusal_answer_wall_ms_max"] or 0) for t in d["tenants"].values())
        share = f"{100 * met / ok:.1f}%" if ok else "-"
        out.append(f"- {run}: {share} of {ok} admitted met both budgets ({slo_ms:.0f} ms to the first token, "
                   f"{tpot_ms:.0f} ms a token after it; target >= 99%); "
                   f"{refused} refused, {told} with Retry-After, slowest refusal {worst:.1f} ms wall (target <= 10)")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1.0, help="offered-load multiplier over the workload")
    ap.add_argument("--duration-s", type=float, default=240.0, help="workload seconds replayed (model time)")
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--slo-ms", type=float, default=SLO_MS, help="time-to-first-token budget, model ms")
    ap.add_argument("--tpot-ms", type=float, default=TPOT_MS, help="time-per-output-token budget, model ms")
    ap.add_argument("--queued-ms", type=float, default=QUEUED_MS,
                    help="admission.max_queued_ms of the token-balancer runs, model ms (0: off)")
    ap.add_argument("--lane-ms", type=float, default=LANE_MS,
                    help="admission.short_lane_ms of the lane run, model ms")
    ap.add_argument("--poller", choices=["vm", "singleton"], default="vm",
                    help="who polls the nodes: each worker (vm) or the poller service (singleton)")
    ap.add_argument("--concurrency", type=int, default=1, help="Envoy worker threads")
    ap.add_argument("--runs", default="", help="comma-separated subset of the runs")
    ap.add_argument("--name", default="")
    ap.add_argument("--smoke", action="store_true", help="a few seconds of everything, for CI")
    ap.add_argument("--previous-wasm", type=Path, default=None,
                    help="another build of token_balancer.wasm for the lane_previous and slo_previous runs")
    args = ap.parse_args()
    plan = runs(args.slo_ms, args.tpot_ms, args.queued_ms, args.lane_ms)
    if args.previous_wasm:
        if not args.previous_wasm.is_file():
            ap.error(f"--previous-wasm {args.previous_wasm}: no such file")
        bench.PREVIOUS_WASM = args.previous_wasm.resolve()
    elif not args.runs:
        plan = [p for p in plan if not p[0].endswith("_previous")]
    if args.runs:
        wanted = set(args.runs.split(","))
        unknown = wanted - {r for r, _, _ in plan}
        if unknown:
            ap.error(f"unknown runs {sorted(unknown)}; known: {[r for r, _, _ in plan]}")
        plan = [p for p in plan if p[0] in wanted]
    previous = [p[0] for p in plan if p[0].endswith("_previous")]
    if previous and not args.previous_wasm:
        ap.error(f"run {previous[0]} needs --previous-wasm")
    b = argparse.Namespace(trace="two-tenants", start_s=0.0, duration_s=args.duration_s, rate=args.rate,
                           arrivals="poisson", time_scale=args.time_scale, max_tokens=1024,
                           max_prompt_tokens=0, requests=0, tenants="", concurrency=args.concurrency,
                           poller=args.poller)
    if args.smoke:
        b.duration_s, b.time_scale = 12.0, 8.0
    name = args.name or (("smoke-" if args.smoke else "admission-") + time.strftime("%Y%m%d-%H%M%S"))
    out_dir = bench.ROOT / "results" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"admission benchmark {name}: two-tenants for {b.duration_s:.0f}s, rate x{b.rate}, time scale "
          f"{b.time_scale}, budget {args.slo_ms:.0f} ms, cluster "
          f"{', '.join(f'{n} ({s[4:]})' for n, s in bench.CLUSTER)}")
    rows = {}
    for run, policy, extra in plan:
        t0 = time.monotonic()
        b.loadgen_extra = extra
        run_dir = out_dir / run
        run_dir.mkdir(exist_ok=True)
        doc = bench.run_policy(policy, b, run_dir)
        rows[run] = {"policy": policy, "loadgen": extra, "overflows": doc["summary"]["vram_overflow_events"],
                     "tenants": per_tenant(doc, b.time_scale, args.slo_ms, args.tpot_ms)}
        print(f"  {run:<18} {doc['summary']['ok']}/{doc['summary']['requests']} ok "
              f"({time.monotonic() - t0:.0f}s)", flush=True)
    md = table(rows) + "\n\n" + verdicts(rows, args.slo_ms, args.tpot_ms)
    (out_dir / "admission.md").write_text(md + "\n")
    (out_dir / "admission.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1, default=str))
    print("\n" + md + f"\n\nresults in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
