"""A seconds-long run of the overhead benchmark (examples/overhead.py): the four Envoys run,
the filter and the ext_proc picker each route every request they are sent, and the report is
produced and well formed. The full benchmark is a command, not a test (its figures are in
docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import ROOT

KINDS = ["plain", "floor", "token_balancer", "extproc"]


def run_benchmark(script: str, name: str, *args: str):
    """Runs examples/<script> with `args` and `--name name`; returns its results directory."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args, "--name", name],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ROOT / "results" / name


def test_overhead_benchmark_produces_a_well_formed_report():
    out = run_benchmark("overhead.py", "ci-overhead-smoke", "--nodes", "4", "--seconds", "1",
                        "--warmup", "1", "--rounds", "1")
    doc = json.loads((out / "overhead.json").read_text())
    [fleet] = doc["results"]
    assert fleet["nodes"] == 4
    for kind in KINDS:
        k = fleet[kind]
        assert k["rps"] > 0 and 0 < k["p50_us"] <= k["p99_us"], (kind, k)
        assert k["cpu_us_per_request"] > 0, (kind, k)
        [run] = fleet["runs"][kind]
        assert run["latency"]["non_2xx"] == 0 and run["throughput"]["non_2xx"] == 0, (kind, run)
    # Every request through token-balancer was routed by its own choice, none by the fallback.
    assert fleet["routed_share"] == 1.0, fleet["routed_share"]
    # So was every request through the ext_proc peer, by the picker's choice: the benchmark
    # also checked, before measuring, that Envoy sent requests to the very node the picker
    # named (it fails otherwise).
    assert fleet["extproc_routed_share"] == 1.0, fleet["extproc_routed_share"]
    ext = fleet["extproc"]
    assert 0 < ext["picker_cpu_us_per_request"] < ext["cpu_us_per_request"], ext
    vs = fleet["vs_extproc"]
    assert vs["rps_ratio"] > 0 and vs["cpu_ratio"] > 0, vs
    memory = fleet["vm_memory_bytes"]
    assert 0 < memory["1_worker"] < memory["4_workers"], memory
    for kind in ("floor", "token_balancer", "extproc"):
        assert 0 < fleet[kind]["rps_kept"], fleet[kind]
    table = (out / "overhead.md").read_text()
    assert "| 4 | token-balancer |" in table and "| 4 | floor filter" in table, table
    assert "Targets for token-balancer" in table
    assert "| 4 | ext_proc picker (same core, gRPC) |" in table, table
    assert "token-balancer against the ext_proc picker" in table, table


def test_a_streamed_run_reports_the_cost_of_following_the_answers():
    """--stream-tokens: the mock nodes stream each answer as token events, one a chunk; the
    filter counts most of them unread, and the picker follows them too (response body
    STREAMED, --extproc-follows-output)."""
    out = run_benchmark("overhead.py", "ci-overhead-stream-smoke", "--nodes", "2", "--seconds", "1",
                        "--warmup", "1", "--rounds", "1", "--stream-tokens", "12",
                        "--token-gap-us", "200", "--extproc-follows-output")
    doc = json.loads((out / "overhead.json").read_text())
    [fleet] = doc["results"]
    for kind in KINDS:
        [run] = fleet["runs"][kind]
        assert run["throughput"]["requests"] > 0, (kind, run)
        assert run["latency"]["non_2xx"] == 0 and run["throughput"]["non_2xx"] == 0, (kind, run)
    assert fleet["routed_share"] == 1.0 and fleet["extproc_routed_share"] == 1.0, fleet
    # Of 12 token events, the role chunk and the first few are read to learn their size.
    unread = fleet["token_balancer"]["chunks_unread_per_request"]
    assert 1 <= unread <= 12 - 4, unread
    table = (out / "overhead.md").read_text()
    assert "CPU added per token event" in table, table
    assert "ext_proc picker following output" in table, table
    assert "Targets for token-balancer" not in table, "whole-answer targets judged on streams"


def test_host_call_cost_benchmark_produces_a_well_formed_report():
    """examples/host_call_cost.py: the floor filter with a probe of host calls, beside none."""
    out = run_benchmark("host_call_cost.py", "ci-host-call-cost-smoke", "--kinds", "metric,shared_get",
                        "--calls", "4", "--rounds", "1", "--seconds", "1")
    doc = json.loads((out / "host_call_cost.json").read_text())
    assert [row["kind"] for row in doc["rows"]] == ["metric", "shared_get"], doc["rows"]
    for kind in ("none", "metric", "shared_get"):
        [us] = doc["runs"][kind]
        assert us > 0, (kind, us)
    table = (out / "host_call_cost.md").read_text()
    assert "| shared data read (96 bytes) |" in table and "| counter increment |" in table, table
