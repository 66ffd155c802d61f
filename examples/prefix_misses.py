"""Where a benchmark run's prefix-cache hits were lost.

Reads the per-request records `examples/bench.py` saves (results/NAME/POLICY.json: send time,
node, prefix key, prompt tokens some earlier request had sent, tokens the engine found cached)
and sorts the reachable tokens (those an earlier request sent, the run's bound) by what became
of them: found by the engine; sent to a node that had been sent the prefix before but whose
engine no longer held it; sent to a node the prefix had never been sent to. For the first two it
prints, per node, how long (model time) after the node last got the prefix the request came.

    .venv/bin/python examples/prefix_misses.py results/analysis-tenants token_balancer gateway_profile
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def quantiles(values: list[float]) -> str:
    values = sorted(values)
    pick = [values[int(q * (len(values) - 1))] for q in (0.1, 0.5, 0.9)]
    return "/".join(f"{v:.1f}" for v in pick)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    run = Path(sys.argv[1])
    for policy in sys.argv[2:]:
        requests = json.loads((run / f"{policy}.json").read_text())["requests"]
        requests.sort(key=lambda r: r["sent_ms"])
        last_sent: dict[str, dict[str, float]] = collections.defaultdict(dict)
        tokens: collections.Counter = collections.Counter()
        ages: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for r in requests:
            key, node = r["prefix_key"], r["node"]
            if r["seen_before"] > 0:
                if node in last_sent[key]:
                    fate = "found" if r["cached"] > 0 else "evicted"
                    ages[(node, fate)].append((r["sent_ms"] - last_sent[key][node]) / 1000)
                else:
                    fate = "elsewhere"
                tokens[fate] += r["seen_before"]
            last_sent[key][node] = r["sent_ms"]
        bound = sum(tokens.values()) or 1
        print(f"{policy}: share of the bound's tokens: "
              + ", ".join(f"{fate} {tokens[fate] / bound:.1%}" for fate in ("found", "evicted", "elsewhere")))
        for (node, fate), a in sorted(ages.items()):
            print(f"  {node} {fate}: {len(a)} requests, s since the node last got the prefix p10/p50/p90 {quantiles(a)}")


if __name__ == "__main__":
    main()
