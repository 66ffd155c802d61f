import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import MOCK, WASM, ENVOY  # noqa: E402


def pytest_sessionstart(session):
    missing = [str(p) for p in (MOCK, WASM, ENVOY) if not p.exists()]
    if missing:
        pytest.exit(f"missing {', '.join(missing)}: run scripts/setup.sh first", returncode=2)
