"""A seconds-long run of the polling benchmark (examples/poll_cost.py): each kind's Envoy
starts and polls, the report is produced and well formed, and what it measures holds at this
size too: quiet nodes are polled less often than every tick, and a vLLM page asked for with
name[] filters is a small fraction of the whole page. The figures are in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import ROOT


def test_poll_cost_benchmark_produces_a_well_formed_report():
    name = "ci-poll-cost-smoke"
    kinds = "plain,json_every_tick,json,vllm_whole_every_tick,vllm"
    r = subprocess.run([sys.executable, str(ROOT / "examples/poll_cost.py"), "--nodes", "8",
                        "--seconds", "2", "--rounds", "1", "--kinds", kinds, "--name", name],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = ROOT / "results" / name
    doc = json.loads((out / "poll_cost.json").read_text())
    k = doc["kinds"]
    assert set(k) == set(kinds.split(","))
    # 8 nodes every 250 ms: 32 polls a second; quiet nodes once a second (stale_after 2 s).
    assert 24 <= k["json_every_tick"]["polls_per_s"] <= 40, k
    assert k["json"]["polls_per_s"] <= 0.5 * k["json_every_tick"]["polls_per_s"], k
    assert k["vllm"]["polls_per_s"] <= 0.5 * k["json_every_tick"]["polls_per_s"], k
    assert k["vllm_whole_every_tick"]["bytes_per_answer"] > 25_000, k
    assert k["vllm"]["bytes_per_answer"] < 0.1 * k["vllm_whole_every_tick"]["bytes_per_answer"], k
    for kind in kinds.split(","):
        assert k[kind]["core_share"] >= 0, (kind, k[kind])
    table = (out / "poll_cost.md").read_text()
    assert "| vLLM /metrics, whole page, every tick |" in table, table
