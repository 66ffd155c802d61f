#!/usr/bin/env python3
"""How good is the first-token forecast on real engines? The real Envoy and the filter in front
of real llama.cpp `llama-server` processes (CPU, SmolLM2-135M, built and fetched once by
scripts/llama-server.sh), sent streamed chat completions of varied prompt lengths, a few at a
time; for each, the forecast of its time to first token on the node chosen (`first_token_ms`
in the request's explanation: the prompts queued there and its own, at the rate the node was
seen to sustain) beside the time its first token took.

    .venv/bin/python examples/forecast_check.py                       # the documented run
    .venv/bin/python examples/forecast_check.py --requests 12         # a quick look
    .venv/bin/python examples/forecast_check.py --slo-ttft-ms 3000    # with a budget on each request
    .venv/bin/python examples/forecast_check.py --wasm old.wasm       # another build

The forecast is what a time-to-first-token budget (`x-slo-ttft-ms`) is held against, so its
errors are what admission gets wrong: observed / forecast above 1 admits requests that will
miss, below 1 refuses requests that would have made it. Reports the ratio's p10 / p50 / p90
over every request and per node, and the share of requests whose first token came within
1.5x and 2x of the forecast. Output: a table on stdout and results/<name>/forecast.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import real_engines  # noqa: E402
from harness import ROOT, Envoy, envoy_config, free_port, request, wait_until, with_node_settings  # noqa: E402
from real_engines import Fleet, Spec, chat  # noqa: E402

MODEL = "smollm2"
EXPLAIN = "x-token-balancer-explain"
# A benchmark on 127.0.0.1: the public listener may answer the beliefs (never in production).
BELIEFS = "/token-balancer/beliefs"
# Unequal servers, as in the real-engine tests: slots and context differ.
SPECS = [Spec("big", parallel=4, ctx_size=8192, aliases=(MODEL,)),
         Spec("small", parallel=2, ctx_size=4096, aliases=(MODEL,))]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near the old river bank").split()


def prompt(rng: random.Random, words: int) -> str:
    """`words` random words (about 1.3 tokens each), unique enough that no two prompts share
    a cached opening."""
    return f"{rng.random():.12f} " + " ".join(rng.choice(WORDS) for _ in range(words))


def fields(value: str) -> dict[str, str]:
    out = {}
    for part in value.split("; "):
        key, _, v = part.partition("=")
        out[key] = v
    return out


def forecast_ms(explanation: str) -> tuple[str, float | None]:
    """The chosen node and its first-token forecast from one explanation."""
    f = fields(explanation)
    first = f.get("candidates", "").split(",")[0].split(" ")
    ms = next((float(x.split("=")[1]) for x in first if x.startswith("first_token_ms=")), None)
    return first[0], ms


def one(port: int, body: dict, budget_ms: float | None = None, timeout: float = 300.0) -> dict:
    """Streams one completion; the time to its first content chunk and the explanation (with a
    time-to-first-token budget, also whether it was refused and when the refusal came)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    headers = {"content-type": "application/json", EXPLAIN: "1"}
    if budget_ms:
        headers["x-slo-ttft-ms"] = str(int(budget_ms))
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        r = conn.getresponse()
        explanation = r.getheader(EXPLAIN, "")
        if r.status == 429:
            r.read()
            return {"status": 429, "explanation": explanation, "ttft_ms": None,
                    "retry_after": r.getheader("retry-after"),
                    "answered_ms": (time.monotonic() - started) * 1000.0}
        first = None
        buf = b""
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            if first is None and b'"content"' in buf:
                first = time.monotonic() - started
        return {"status": r.status, "explanation": explanation,
                "ttft_ms": None if first is None else first * 1000.0}
    finally:
        conn.close()


def pctl(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(rows: list[dict]) -> dict:
    ratios = [r["observed_ms"] / r["forecast_ms"] for r in rows if r["forecast_ms"]]
    return {"requests": len(rows),
            "p10": pctl(ratios, 0.1), "p50": pctl(ratios, 0.5), "p90": pctl(ratios, 0.9),
            "within_1_5x": sum(1 for x in ratios if x <= 1.5) / len(ratios) if ratios else None,
            "within_2x": sum(1 for x in ratios if x <= 2.0) / len(ratios) if ratios else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=3, help="requests in flight at most")
    ap.add_argument("--gap-ms", type=float, default=400.0, help="mean gap between arrivals (exponential)")
    ap.add_argument("--min-words", type=int, default=20)
    ap.add_argument("--max-words", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=0.0,
                    help="send every request with this time-to-first-token budget (x-slo-ttft-ms): "
                         "the filter refuses (429) what no node's forecast meets")
    ap.add_argument("--wasm", type=Path, default=None,
                    help="another build of token_balancer.wasm (default: the one cargo built)")
    ap.add_argument("--name", default="forecast-check")
    args = ap.parse_args()
    if (why := real_engines.missing()) is not None:
        sys.exit(f"forecast_check: no real engine: {why} (run scripts/llama-server.sh)")
    rng = random.Random(args.seed)
    out_dir = ROOT / "results" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with Fleet(SPECS) as fleet:
        cfg = envoy_config([s.address for s in fleet], free_port(), free_port(), wasm_file=args.wasm,
                           plugin={"tick_ms": 100, "stale_after_ms": 2000, "debug_header": "x-token-balancer",
                                   "explain": {"sources": ["127.0.0.1"]}, "beliefs_path": BELIEFS})
        settings = [{"health_path": "/metrics", "format": "llamacpp", "models": [MODEL]} for _ in SPECS]
        envoy = Envoy(with_node_settings(cfg, settings))
        try:
            wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 4 * len(SPECS), 30,
                       "first health reports")
            # A few requests first, so the servers' rates are learned; not measured.
            for _ in range(4):
                one(envoy.port, chat(prompt(rng, 200), max_tokens=8, stream=True))
            names = {s.address: s.spec.name for s in fleet}
            rows: list[dict] = []
            lock = threading.Lock()

            def send(words: int, text: str):
                r = one(envoy.port, chat(text, max_tokens=8, stream=True), args.slo_ttft_ms)
                node, fc = forecast_ms(r["explanation"])
                with lock:
                    rows.append({"words": words, "status": r["status"], "node": names.get(node, node),
                                 "forecast_ms": fc, "observed_ms": r["ttft_ms"],
                                 "retry_after": r.get("retry_after"), "answered_ms": r.get("answered_ms")})

            with ThreadPoolExecutor(args.concurrency) as pool:
                futures = []
                for _ in range(args.requests):
                    words = int(args.min_words * (args.max_words / args.min_words) ** rng.random())
                    # Drawn here, not in the workers, so that a seed always sends the same prompts.
                    futures.append(pool.submit(send, words, prompt(rng, words)))
                    time.sleep(rng.expovariate(1000.0 / args.gap_ms))
                for f in futures:
                    f.result()
            beliefs = json.loads(request(envoy.port, "GET", BELIEFS).body)
            capacities = {names.get(n["address"], n["address"]):
                          {k: (n.get("report") or {}).get(k)
                           for k in ("capacity_used_tokens_per_sec", "forecast_tokens_per_sec")}
                          for n in beliefs.get("nodes", [])}
        finally:
            envoy.stop()
    good = [r for r in rows if r["status"] == 200 and r["observed_ms"] and r["forecast_ms"]]
    report = {"all": summary(good)}
    for name in sorted({r["node"] for r in good}):
        report[name] = summary([r for r in good if r["node"] == name])
    (out_dir / "forecast.json").write_text(json.dumps({"args": vars(args), "rows": rows, "summary": report,
                                                       "capacity_tokens_per_sec": capacities}, indent=1, default=str))
    print(f"forecast check {args.name}: {len(good)} of {len(rows)} requests with a first token and a "
          f"forecast, {args.concurrency} in flight at most, prompts {args.min_words}-{args.max_words} words")
    print()
    print("| requests on | count | observed / forecast p10 / p50 / p90 | within 1.5x | within 2x |")
    print("|---|---|---|---|---|")
    for name, s in report.items():
        if not s["requests"]:
            continue
        print(f"| {name} | {s['requests']} | {s['p10']:.2f} / {s['p50']:.2f} / {s['p90']:.2f} | "
              f"{100 * s['within_1_5x']:.0f}% | {100 * s['within_2x']:.0f}% |")
    def rate(v):
        return "none" if v is None else f"{v:.0f}"
    print("\nat the end, tokens/s each node was ranked with / its forecast drained at: "
          + ", ".join(f"{k} {rate(v['capacity_used_tokens_per_sec'])} / {rate(v['forecast_tokens_per_sec'])}"
                      for k, v in capacities.items()))
    if args.slo_ttft_ms:
        admitted = [r for r in rows if r["status"] == 200 and r["observed_ms"]]
        met = sum(1 for r in admitted if r["observed_ms"] <= args.slo_ttft_ms)
        refused = [r for r in rows if r["status"] == 429]
        told = sum(1 for r in refused if r["retry_after"])
        slowest = max((r["answered_ms"] for r in refused), default=0.0)
        share = f"{100 * met / len(admitted):.1f}%" if admitted else "-"
        report["budget"] = {"ms": args.slo_ttft_ms, "admitted": len(admitted), "met": met,
                            "refused": len(refused), "with_retry_after": told, "slowest_refusal_ms": slowest}
        (out_dir / "forecast.json").write_text(json.dumps({"args": vars(args), "rows": rows, "summary": report,
                                                           "capacity_tokens_per_sec": capacities},
                                                          indent=1, default=str))
        print(f"\nbudget {args.slo_ttft_ms:.0f} ms to the first token: {share} of {len(admitted)} admitted met it; "
              f"{len(refused)} refused, {told} with Retry-After, slowest refusal {slowest:.1f} ms")
    print(f"\nresults in {out_dir}")


if __name__ == "__main__":
    main()
