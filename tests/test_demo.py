"""The README's demo in reduced form (examples/demo.py: two rounds, the mock GPUs four times
faster than real time): it runs on a fresh machine, answers every request, starts cold, and its
headline shows token-balancer ahead of round robin in every round, as the full demo does."""

from __future__ import annotations

import re
import subprocess
import sys

from harness import ROOT


def test_the_demo_runs_and_its_headline_holds():
    r = subprocess.run([sys.executable, str(ROOT / "examples/demo.py"), "--rounds", "2", "--time-scale", "4"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "round 1 (cold start)" in out, out
    # Every request answered, under both.
    failed = re.findall(r"^  (token-balancer|round robin) .* (\d+)$", out, re.M)
    assert [f[0] for f in failed] == ["token-balancer", "round robin"], out
    assert all(f[1] == "0" for f in failed), out
    m = re.search(r"slowest request of a burst, median of 2 rounds: token-balancer ([\d.]+)s vs "
                  r"round robin ([\d.]+)s \(([\d.]+)x\); token-balancer ahead in (\d) of 2 rounds", out)
    assert m, out
    assert float(m.group(1)) < float(m.group(2)) and m.group(4) == "2", out
