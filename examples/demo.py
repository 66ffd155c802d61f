"""The README's demo: a mixed fast/slow mock GPU cluster behind the real Envoy, first with the
token-balancer filter (envoy/envoy.yaml exactly as shipped), then with Envoy's round robin,
the same burst of short and long prompts through each. Prints where every request went and
each node's load under both.

Run it with scripts/demo.sh (which builds everything first).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import yaml  # noqa: E402

from harness import ENVOY_YAML, Envoy, MockCluster, chat, wait_until, without_filter  # noqa: E402

NODES = [("fast-1", "gpu=h100"), ("fast-2", "gpu=h100"), ("slow-1", "gpu=l4"), ("slow-2", "gpu=l4")]
SHORT = ("short", chat("What is the capital of France? Answer in one word.", 24))
LONG = ("long", chat("Summarise the following report. " + "The quarterly figures show steady growth. " * 300, 192))
# 32 requests at once: three short ones for each long one, interleaved.
BURST = [LONG if i % 4 == 1 else SHORT for i in range(32)]


def round_robin_config(cfg: dict) -> dict:
    """The shipped configuration without the filter, the cluster on plain round robin, on the
    next ports so both can be told apart in the output."""
    cfg = without_filter(cfg, "ROUND_ROBIN")
    cfg["admin"]["address"]["socket_address"]["port_value"] += 1
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] += 1
    return cfg


def run_burst(envoy: Envoy) -> list[tuple[str, str, float]]:
    def one(item):
        kind, body = item
        t0 = time.monotonic()
        r = envoy.post("/v1/chat/completions", body, timeout=120)
        return kind, r.headers.get("x-mock-node", f"HTTP {r.status}"), time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(len(BURST)) as pool:
        return list(pool.map(one, BURST))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    shipped = yaml.safe_load(ENVOY_YAML.read_text())
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for c in shipped["static_resources"]["clusters"] if c["name"] == "gpu_nodes"
             for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    print(f"starting mock GPU nodes {', '.join(f'{n} ({s[4:]})' for n, s in NODES)} on ports {ports}")
    cluster = MockCluster(NODES, ports=ports)
    results = {}
    try:
        for label, cfg in [("token-balancer", shipped), ("round robin", round_robin_config(shipped))]:
            envoy = Envoy(cfg)
            try:
                if label == "token-balancer":
                    # The filter needs its first health reports before it can choose.
                    wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 2 * len(NODES), 10,
                               "first health reports")
                print(f"\n{label}: sending {len(BURST)} requests at once through Envoy on port {envoy.port}")
                t0 = time.monotonic()
                results[label] = run_burst(envoy)
                print(f"  all answered in {time.monotonic() - t0:.1f}s")
            finally:
                envoy.stop()
    finally:
        cluster.stop()

    tb, rr = results["token-balancer"], results["round robin"]
    print("\nwhere each request went")
    print(f"  {'#':>3} {'prompt':<6} {'token-balancer':<15} {'round robin':<12}")
    for i, ((kind, a, _), (_, b, _)) in enumerate(zip(tb, rr)):
        print(f"  {i:>3} {kind:<6} {a:<15} {b:<12}")

    print("\neach node's load (requests short/long, and the prompt+output tokens sent to it, at ~4 chars a token)")
    print(f"  {'node':<8} {'gpu':<5} {'token-balancer':>24} {'round robin':>24}")
    tokens = {k: len(str(b)) // 4 + b["max_tokens"] for k, b in (SHORT, LONG)}
    for name, spec in NODES:
        cells = []
        for res in (tb, rr):
            s = sum(1 for k, n, _ in res if n == name and k == "short")
            lo = sum(1 for k, n, _ in res if n == name and k == "long")
            cells.append(f"{s:>2}/{lo:<2} {s * tokens['short'] + lo * tokens['long']:>8} tok")
        print(f"  {name:<8} {spec[4:]:<5} {cells[0]:>24} {cells[1]:>24}")

    print("\nlatency (seconds)")
    print(f"  {'':<16} {'p50':>6} {'p90':>6} {'max':>6}")
    for label, res in results.items():
        lat = [t for _, _, t in res]
        print(f"  {label:<16} {pct(lat, 0.5):>6.2f} {pct(lat, 0.9):>6.2f} {max(lat):>6.2f}")
    worst_tb, worst_rr = max(t for *_, t in tb), max(t for *_, t in rr)
    print(f"\nslowest request: token-balancer {worst_tb:.2f}s vs round robin {worst_rr:.2f}s "
          f"({worst_tb / worst_rr:.2f}x)")


if __name__ == "__main__":
    main()
