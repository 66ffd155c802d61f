"""The README's demo: a mixed fast/slow mock GPU cluster behind the real Envoy, once with the
token-balancer filter (envoy/envoy.yaml exactly as shipped) and once with Envoy's round robin,
the same bursts of short and long prompts through each, round after round.

One burst can be decided by luck: round robin's placement depends on where its counter stands
and in which order the requests arrive. So the demo sends several bursts (each in its own
shuffled order, the same order for both), the first one the moment each Envoy is up (a cold
start: no telemetry read yet), and prints each round, then the medians and the worst round.
The headline is the median over rounds of the slowest request in a burst: what a user waiting
on a batch of calls sees.

Run it with scripts/demo.sh (which builds everything first); `--rounds N` and
`--time-scale X` (the mock GPUs run X times faster than real time) shorten it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import yaml  # noqa: E402

from harness import ENVOY_YAML, Envoy, MockCluster, chat, without_filter  # noqa: E402

NODES = [("fast-1", "gpu=h100"), ("fast-2", "gpu=h100"), ("slow-1", "gpu=l4"), ("slow-2", "gpu=l4")]
SHORT = ("short", chat("What is the capital of France? Answer in one word.", 24))
LONG = ("long", chat("Summarise the following report. " + "The quarterly figures show steady growth. " * 300, 192))
# 32 requests at once: three short ones for each long one.
BURST = [LONG if i % 4 == 1 else SHORT for i in range(32)]


def round_robin_config(cfg: dict) -> dict:
    """The shipped configuration without the filter, the cluster on plain round robin, on the
    next ports so both can be told apart in the output."""
    cfg = without_filter(cfg, "ROUND_ROBIN")
    cfg["admin"]["address"]["socket_address"]["port_value"] += 1
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] += 1
    return cfg


def with_time_scale(cfg: dict, scale: float) -> dict:
    """The filter's tick, staleness and hold limits in the mock's model time (as the benchmark
    does): at scale 1 the shipped file unchanged."""
    if scale == 1:
        return cfg
    import json
    for li in cfg["static_resources"]["listeners"]:
        for f in li["filter_chains"][0]["filters"][0]["typed_config"].get("http_filters", []):
            if f["name"] == "token_balancer":
                c = f["typed_config"]["config"]["configuration"]
                conf = json.loads(c["value"])
                for k, floor in (("tick_ms", 10), ("stale_after_ms", 20), ("max_hold_ms", 0)):
                    if k in conf:
                        conf[k] = max(floor, round(conf[k] / scale))
                c["value"] = json.dumps(conf)
    return cfg


def run_burst(envoy: Envoy, burst: list) -> list[tuple[str, str, float]]:
    def one(item):
        kind, body = item
        t0 = time.monotonic()
        r = envoy.post("/v1/chat/completions", body, timeout=120)
        node = r.headers.get("x-mock-node") if r.status == 200 else None
        return kind, node or f"HTTP {r.status}", time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(len(burst)) as pool:
        return list(pool.map(one, burst))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="bursts sent through each (default 5)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="the mock GPUs' speed-up over real time")
    args = ap.parse_args()
    shipped = yaml.safe_load(ENVOY_YAML.read_text())
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for c in shipped["static_resources"]["clusters"] if c["name"] == "gpu_nodes"
             for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    print(f"starting mock GPU nodes {', '.join(f'{n} ({s[4:]})' for n, s in NODES)} on ports {ports}")
    cluster = MockCluster(NODES, time_scale=args.time_scale, ports=ports)
    policies = {"token-balancer": with_time_scale(shipped, args.time_scale),
                "round robin": round_robin_config(shipped)}
    rounds: dict[str, list[list[tuple[str, str, float]]]] = {label: [] for label in policies}
    envoys: dict[str, Envoy] = {}
    try:
        for r in range(args.rounds):
            burst = list(BURST)
            random.Random(r).shuffle(burst)
            for label, cfg in policies.items():
                if label not in envoys:
                    # Round 1 goes out the moment this Envoy is ready: a cold start.
                    envoys[label] = Envoy(cfg)
                rounds[label].append(run_burst(envoys[label], burst))
            tb, rr = (max(t for *_, t in rounds[k][-1]) for k in policies)
            cold = " (cold start)" if r == 0 else ""
            print(f"round {r + 1}{cold}: {len(burst)} requests at once, slowest answered in "
                  f"token-balancer {tb:.2f}s, round robin {rr:.2f}s")
    finally:
        for e in envoys.values():
            e.stop()
        cluster.stop()

    tb_last, rr_last = rounds["token-balancer"][-1], rounds["round robin"][-1]
    print("\nwhere each request of the last round went")
    print(f"  {'#':>3} {'prompt':<6} {'token-balancer':<15} {'round robin':<12}")
    for i, ((kind, a, _), (_, b, _)) in enumerate(zip(tb_last, rr_last)):
        print(f"  {i:>3} {kind:<6} {a:<15} {b:<12}")

    print(f"\neach node's share over all {args.rounds} rounds (requests short/long)")
    print(f"  {'node':<8} {'gpu':<5} {'token-balancer':>15} {'round robin':>12}")
    for name, spec in NODES:
        cells = []
        for label in policies:
            done = [x for res in rounds[label] for x in res]
            s = sum(1 for k, n, _ in done if n == name and k == "short")
            lo = sum(1 for k, n, _ in done if n == name and k == "long")
            cells.append(f"{s:>3}/{lo:<3}")
        print(f"  {name:<8} {spec[4:]:<5} {cells[0]:>15} {cells[1]:>12}")

    print("\nlatency over all rounds (seconds)")
    print(f"  {'':<16} {'p50':>6} {'p90':>6} {'max':>6} {'failed':>7}")
    for label in policies:
        done = [x for res in rounds[label] for x in res]
        lat = [t for _, _, t in done]
        failed = sum(1 for _, n, _ in done if n.startswith("HTTP"))
        print(f"  {label:<16} {pct(lat, 0.5):>6.2f} {pct(lat, 0.9):>6.2f} {max(lat):>6.2f} {failed:>7}")

    slowest = {label: [max(t for *_, t in res) for res in rounds[label]] for label in policies}
    tb_med, rr_med = (statistics.median(slowest[k]) for k in policies)
    ahead = sum(1 for a, b in zip(slowest["token-balancer"], slowest["round robin"]) if a < b)
    print(f"\nslowest request of a burst, median of {args.rounds} rounds: token-balancer {tb_med:.2f}s vs "
          f"round robin {rr_med:.2f}s ({tb_med / rr_med:.2f}x); token-balancer ahead in {ahead} of "
          f"{args.rounds} rounds; worst round {max(slowest['token-balancer']):.2f}s vs "
          f"{max(slowest['round robin']):.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
