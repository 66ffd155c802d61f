"""The long run: sustained real traffic through Envoy with several workers, watching for leaks.

    .venv/bin/python examples/soak.py                  # 15 minutes, --concurrency 2 (RELIABILITY.md)
    .venv/bin/python examples/soak.py --minutes 1      # a quick look

Replays the Azure trace slice after slice (open loop, streaming) through Envoy with the filter
in front of four mock GPU nodes, and every 10 s samples Envoy's resident memory, the filter's
VM memory (the `vm_memory_bytes` gauge, summed over every VM) and its `inflight_now` and
`held_now` gauges. When the traffic stops, in-flight must return to zero. Prints the first and
last samples and writes every sample to results/<name>/soak.json. Exit status 1 when in-flight
does not return to zero or a request failed.
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

from harness import TARGET, Envoy, MockCluster, envoy_config, free_port, wait_until  # noqa: E402

LOADGEN = TARGET / "release/loadgen"
TRACE = ROOT.parent / "shared/data/AzureLLMInferenceTrace_conv.csv"
CLUSTER = [("fast-1", "gpu=a100"), ("fast-2", "gpu=a100"), ("slow-1", "gpu=l4"), ("slow-2", "gpu=l4")]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    if not TRACE.exists():
        print(f"soak: trace {TRACE} not found; skipping")
        return 0
    name = args.name or "soak-" + time.strftime("%Y%m%d-%H%M%S")
    out = ROOT / "results" / name
    out.mkdir(parents=True, exist_ok=True)

    cluster = MockCluster(CLUSTER, time_scale=args.time_scale)
    envoy = Envoy(envoy_config([n.address for n in cluster.nodes], free_port(), free_port(),
                               plugin={"debug_header": None}), concurrency=args.concurrency)
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample():
        c = envoy.counters()
        samples.append({"t_s": round(time.monotonic() - t0, 1), "envoy_rss_bytes": rss_bytes(envoy.proc.pid),
                        "vm_memory_bytes": c.get("token_balancer.vm_memory_bytes", 0),
                        "inflight_now": c.get("token_balancer.inflight_now", 0),
                        "held_now": c.get("token_balancer.held_now", 0),
                        "routed": c.get("token_balancer.routed", 0)})

    def sampler():
        while not stop.is_set():
            sample()
            stop.wait(10)

    requests = failed = 0
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= 2 * len(CLUSTER), 10, "first reports")
        threading.Thread(target=sampler, daemon=True).start()
        deadline = t0 + args.minutes * 60
        start_s, slice_s = 0.0, 240.0
        while time.monotonic() < deadline:
            wall_left = deadline - time.monotonic()
            duration = min(slice_s, max(10.0, wall_left * args.time_scale * args.rate))
            raw = out / f"slice-{int(start_s)}.json"
            subprocess.run([str(LOADGEN), "--url", f"http://127.0.0.1:{envoy.port}", "--trace", f"azure:{TRACE}",
                            "--start-s", str(start_s), "--duration-s", str(duration), "--rate", str(args.rate),
                            "--time-scale", str(args.time_scale), "--label", "soak", "--out", str(raw)],
                           check=True, stdout=subprocess.DEVNULL)
            result = json.loads(raw.read_text())
            requests += len(result["requests"])
            failed += sum(1 for r in result["requests"] if r.get("status") != 200 or r.get("error"))
            raw.unlink()
            start_s += slice_s
        # Traffic has stopped: every booking must be given back.
        wait_until(lambda: envoy.counter("token_balancer.inflight_now") == 0, 30, "in-flight to return to zero")
        sample()
    finally:
        stop.set()
        envoy.stop()
        cluster.stop()

    first, last = samples[0], samples[-1]
    (out / "soak.json").write_text(json.dumps({"args": vars(args), "requests": requests, "failed": failed,
                                               "samples": samples}, indent=1))
    mib = 1 << 20
    print(f"soak {name}: {args.minutes} min, --concurrency {args.concurrency}, {requests} requests, {failed} failed")
    for label, s in (("start", first), ("end", last)):
        print(f"  {label:5} t={s['t_s']:7.1f}s  envoy RSS {s['envoy_rss_bytes'] / mib:7.1f} MiB  "
              f"filter VMs {s['vm_memory_bytes'] / mib:6.2f} MiB  in flight {s['inflight_now']}  held {s['held_now']}")
    peak = max(s["vm_memory_bytes"] for s in samples)
    print(f"  peak filter VM memory {peak / mib:.2f} MiB; results in {out}")
    return 0 if failed == 0 and last["inflight_now"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
