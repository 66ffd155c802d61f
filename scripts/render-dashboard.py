"""Renders the main panels of the Grafana dashboard (deploy/grafana/token-balancer.json) from a
short run into docs/img/dashboard.svg: the real Envoy with the shipped configuration in front of
four mock GPU nodes, a load of chat requests (and a few without a body, to show a fallback),
/stats/prometheus and the nodes' /metrics sampled every second. The queries are evaluated here
the simple way: a counter's rate over the last samples, a gauge as it is.

    .venv/bin/python scripts/render-dashboard.py [--seconds 40] [--out docs/img/dashboard.svg]

Python standard library only (plus the tests' harness); build the filter and the mock first.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import Envoy, MockCluster, chat, envoy_config, free_port, request, wait_until  # noqa: E402

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
CLUSTER = [("fast-1", "gpu=a100"), ("fast-2", "gpu=a100"), ("slow-1", "gpu=l4"), ("slow-2", "gpu=l4")]
COLOURS = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0"]
RATE_WINDOW = 5  # samples (seconds) a rate is taken over: the run is short, Grafana's is [1m]


def parse(text: str, extra: dict | None = None) -> dict[tuple[str, frozenset], float]:
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = dict(LABEL.findall(m.group(2) or ""))
            labels.update(extra or {})
            out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return out


def load(envoy: Envoy, stop: threading.Event, seed: int):
    rng = random.Random(seed)
    while not stop.is_set():
        if rng.random() < 0.03:
            envoy.post("/v1/chat/completions", b"")  # fallback.no_body
            continue
        words = " ".join(f"w{rng.randrange(5000)}" for _ in range(rng.randrange(50, 1500)))
        try:
            envoy.post("/v1/chat/completions", chat(words, rng.randrange(16, 200)), timeout=60)
        except OSError:
            pass


def run(seconds: int, workers: int) -> list[tuple[float, dict]]:
    cluster = MockCluster(CLUSTER)
    addresses = [n.address for n in cluster.nodes]
    envoy = Envoy(envoy_config(addresses, free_port(), free_port(), poller="singleton"), concurrency=2)
    samples: list[tuple[float, dict]] = []
    stop = threading.Event()
    try:
        wait_until(lambda: envoy.counter("token_balancer.health.ok") >= len(addresses), 15, "health polls")
        threads = [threading.Thread(target=load, args=(envoy, stop, i), daemon=True) for i in range(workers)]
        start = time.monotonic()
        for i, t in enumerate(threads):
            t.start()
        while time.monotonic() - start < seconds:
            tick = time.monotonic()
            s = parse(request(envoy.admin_port, "GET", "/stats/prometheus").body.decode())
            for n in cluster.nodes:
                s.update(parse(request(n.port, "GET", "/metrics").body.decode(), {"instance": n.address}))
            samples.append((tick - start, s))
            if tick - start > seconds * 0.75:
                stop.set()  # the last quarter shows the load draining
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    finally:
        stop.set()
        envoy.stop()
        cluster.stop()
    return samples


def series(samples, name: str, by: str | None = None, rate: bool = False) -> dict[str, list[tuple[float, float]]]:
    """`name`'s values over time, one line per value of the label `by` (summed over the rest)."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for i, (t, s) in enumerate(samples):
        values: dict[str, float] = {}
        for (n, labels), v in s.items():
            if n == name:
                key = dict(labels).get(by, "") if by else ""
                values[key] = values.get(key, 0.0) + v
        for key, v in values.items():
            lines.setdefault(key, []).append((t, v))
    if rate:
        for key, pts in lines.items():
            lines[key] = [(t, (v - pts[max(0, i - RATE_WINDOW)][1]) / max(1e-9, t - pts[max(0, i - RATE_WINDOW)][0]))
                          for i, (t, v) in enumerate(pts) if i > 0]
    return lines


def panel_svg(x: float, y: float, w: float, h: float, title: str, lines: dict, unit: str = "") -> str:
    out = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="#181b1f" stroke="#2c3235"/>',
           f'<text x="{x + 10}" y="{y + 20}" fill="#ccccdc" font-size="13" font-weight="bold">{escape(title)}</text>']
    px, py, pw, ph = x + 48, y + 32, w - 60, h - 32 - 48
    pts = [p for line in lines.values() for p in line]
    if not pts:
        return "\n".join(out)
    tmax = max(t for t, _ in pts) or 1.0
    vmax = max(v for _, v in pts)
    vmax = 1.0 if unit == "%" and vmax <= 1.0 else (vmax * 1.1 or 1.0)
    for k in range(5):
        gy = py + ph - ph * k / 4
        label = f"{vmax * k / 4 * 100:.0f}%" if unit == "%" else f"{vmax * k / 4:.3g}"
        out.append(f'<line x1="{px}" y1="{gy:.1f}" x2="{px + pw}" y2="{gy:.1f}" stroke="#2c3235"/>')
        out.append(f'<text x="{px - 6}" y="{gy + 4:.1f}" fill="#8e8e8e" font-size="10" text-anchor="end">{label}</text>')
    for k in range(0, int(tmax) + 1, 10):
        gx = px + pw * k / tmax
        out.append(f'<text x="{gx:.1f}" y="{py + ph + 14}" fill="#8e8e8e" font-size="10" text-anchor="middle">{k}s</text>')
    lx = x + 10
    for i, (name, line) in enumerate(sorted(lines.items())):
        c = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px + pw * t / tmax:.1f},{py + ph - ph * min(v, vmax) / vmax:.1f}" for t, v in line)
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        ly = y + h - 24 + 12 * (i // 4)
        out.append(f'<rect x="{lx + (i % 4) * (w - 20) / 4:.1f}" y="{ly - 7}" width="10" height="3" fill="{c}"/>')
        out.append(f'<text x="{lx + (i % 4) * (w - 20) / 4 + 14:.1f}" y="{ly}" fill="#ccccdc" font-size="10">{escape(name)}</text>')
    return "\n".join(out)


def render(samples, out: Path):
    routed = series(samples, "token_balancer_routed", rate=True)
    routed = {"routed": routed.get("", [])}
    fallbacks = {}
    for name in sorted({n for _, s in samples for n, _ in s if n.startswith("token_balancer_fallback_")}):
        line = series(samples, name, rate=True).get("", [])
        if any(v for _, v in line):
            fallbacks[name.removeprefix("token_balancer_fallback_")] = line
    picks = series(samples, "token_balancer_node_picks", by="node", rate=True)
    inflight = {"filter: in flight": series(samples, "token_balancer_inflight_now").get("", []),
                "poller: in flight (shared)": series(samples, "token_balancer_shared_inflight_requests").get("", []),
                "held now": series(samples, "token_balancer_held_now").get("", [])}
    active = {k: v for k, v in series(samples, "envoy_cluster_upstream_rq_active", by="envoy_cluster_name").items()
              if k == "gpu_nodes"}
    inflight.update({"Envoy: active upstream": active.get("gpu_nodes", [])})
    kv = series(samples, "vllm:kv_cache_usage_perc", by="instance")
    health = {"polls ok": series(samples, "token_balancer_health_ok", rate=True).get("", []),
              "polls failed": series(samples, "token_balancer_health_failed", rate=True).get("", []),
              "no telemetry now": series(samples, "token_balancer_telemetry_not_found_now").get("", [])}
    W, H, pw, ph = 1200, 920, 588, 290
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
             'font-family="Inter, Helvetica, Arial, sans-serif">',
             f'<rect width="{W}" height="{H}" fill="#111217"/>',
             '<text x="8" y="22" fill="#ccccdc" font-size="16" font-weight="bold">token-balancer</text>',
             '<text x="140" y="22" fill="#8e8e8e" font-size="12">rendered from a run: the shipped Envoy configuration, '
             'four mock GPU nodes (2 fast, 2 slow), rates over 5 s</text>']
    grid = [("Requests routed per second", routed, ""), ("Fallbacks by reason (per second)", fallbacks, ""),
            ("Picks per node (per second)", picks, ""), ("In flight and held", inflight, ""),
            ("KV-cache use per node (engines' /metrics)", kv, "%"), ("Telemetry health", health, "")]
    for i, (title, lines, unit) in enumerate(grid):
        peaks = ", ".join(f"{k or 'value'} {max((v for _, v in l), default=0):.3g}" for k, l in sorted(lines.items()))
        print(f"{title}: peak {peaks}")
        parts.append(panel_svg(8 + (i % 2) * (pw + 8), 34 + (i // 2) * (ph + 8), pw, ph, title, lines, unit))
    parts.append("</svg>")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=40)
    ap.add_argument("--workers", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/img/dashboard.svg")
    args = ap.parse_args()
    samples = run(args.seconds, args.workers)
    render(samples, args.out)
    print(f"{len(samples)} samples -> {args.out}")


if __name__ == "__main__":
    main()
