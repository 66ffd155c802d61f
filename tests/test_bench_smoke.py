"""A seconds-long run of the benchmark pipelines (examples/bench.py --smoke, admission_bench.py
--smoke, forecast_check.py with a few requests): every policy runs, and the report is produced
and well formed. The full benchmarks are commands, not tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import real_engines
from harness import ROOT

POLICIES = ["round_robin", "least_request", "cswrr_orca", "naive_seed", "token_balancer"]


def test_benchmark_pipeline_produces_a_well_formed_report():
    trace = ROOT.parent / "shared/data/AzureLLMInferenceTrace_conv.csv"
    if not trace.exists():
        pytest.skip(f"{trace} not present")
    name = "ci-smoke"
    r = subprocess.run([sys.executable, str(ROOT / "examples/bench.py"), "--smoke", "--name", name],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = ROOT / "results" / name
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["summaries"]) == POLICIES
    for policy, s in summary["summaries"].items():
        assert s["requests"] == 24 and s["ok"] == 24, (policy, s)
        for metric in ("ttft_ms", "e2e_ms", "tpot_ms"):
            assert 0 < s[metric]["p50"] <= s[metric]["p99"], (policy, metric, s[metric])
        assert sum(s["requests_per_node"].values()) == 24
        assert isinstance(s["vram_overflow_events"], int)
        raw = json.loads((out / f"{policy}.json").read_text())
        assert len(raw["requests"]) == 24
        assert all(q["node"] for q in raw["requests"])
        assert (out / f"node_kv_{policy}.svg").read_text().startswith("<svg")
    table = (out / "summary.md").read_text()
    assert all(f"| {p} |" in table for p in POLICIES)
    assert "token_balancer p99 e2e / least_request" in table
    assert (out / "latency_cdf.svg").read_text().count("<polyline") == len(POLICIES)


def test_admission_benchmark_pipeline_produces_a_well_formed_report():
    """examples/admission_bench.py --smoke: every run, per tenant, and the budget runs' refusals
    carry a Retry-After."""
    name = "ci-admission-smoke"
    r = subprocess.run([sys.executable, str(ROOT / "examples/admission_bench.py"), "--smoke", "--name", name],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((ROOT / "results" / name / "admission.json").read_text())
    runs = doc["runs"]
    assert list(runs) == ["least_request", "shipped", "fifo", "fair", "lane", "chat_alone", "priority", "slo",
                          "slo_least_request"]
    for run, d in runs.items():
        tenants = d["tenants"]
        assert set(tenants) == ({"chat"} if run == "chat_alone" else {"chat", "docs"}), (run, tenants)
        for t in tenants.values():
            assert t["ok"] + t["refused"] + t["other_errors"] == t["requests"] > 0, (run, t)
            assert t["other_errors"] == 0, (run, t)
            assert t["refused_with_retry_after"] == t["refused"], (run, t)
        if run != "slo":
            assert all(t["refused"] == 0 for t in tenants.values()), (run, tenants)
    report = (ROOT / "results" / name / "admission.md").read_text()
    assert "docs throughput, fair / fifo" in report and "docs throughput, lane / fifo" in report
    assert "admitted met both budgets" in report


def test_forecast_check_against_real_engines_produces_a_well_formed_report():
    """examples/forecast_check.py with a few requests: every request streamed through Envoy to a
    real llama.cpp server, its forecast read from the explanation, and each node's ranking
    capacity and forecast rate taken from the beliefs."""
    real_engines.require()
    name = "ci-forecast-smoke"
    r = subprocess.run([sys.executable, str(ROOT / "examples/forecast_check.py"), "--requests", "6",
                        "--max-words", "200", "--name", name],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((ROOT / "results" / name / "forecast.json").read_text())
    assert len(doc["rows"]) == 6
    for row in doc["rows"]:
        assert row["status"] == 200 and row["node"] in ("big", "small"), row
        assert row["forecast_ms"] > 0 and row["observed_ms"] > 0, row
    assert doc["summary"]["all"]["requests"] == 6
    assert set(doc["capacity_tokens_per_sec"]) == {"big", "small"}
    for rates in doc["capacity_tokens_per_sec"].values():
        assert rates["capacity_used_tokens_per_sec"] > 0 and rates["forecast_tokens_per_sec"] > 0, rates
    assert "| all | 6 |" in r.stdout


def test_simulator_grid_compares_policies_in_every_cell():
    """examples/sim_grid.py on two cells of ten simulated seconds: each cell's policies are
    read from the simulator's table, and the report names every policy compared."""
    name = "ci-sim-grid"
    r = subprocess.run([sys.executable, str(ROOT / "examples/sim_grid.py"), "--workloads", "decode",
                        "--arrivals", "poisson", "--loads", "0.8", "--replicas", "1",
                        "--fleets", "a100,l4:2;mixed:4", "--duration-s", "10", "--name", name],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = ROOT / "results" / name
    grid = json.loads((out / "grid.json").read_text())
    assert len(grid["cells"]) == 2
    for cell in grid["cells"]:
        assert set(cell["rows"]) == {"tb", "least-request", "gateway"}, cell
        for row in cell["rows"].values():
            assert 0 < row["ttft_p50"] <= row["ttft_p99"], cell
            assert isinstance(row["overflows"], int)
    report = (out / "grid.md").read_text()
    assert "| least-request | up to 0.8 | 2 |" in report and "| gateway | up to 0.8 | 2 |" in report
