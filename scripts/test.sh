#!/usr/bin/env bash
# Runs every test of the project: formatting and lints, the native unit tests (with the fuzz
# corpus replay), a seconds-long fuzz smoke, the pure core compiled to wasm32-wasip1 and run
# under WASI, and the integration tests that start the real Envoy with the built filter and
# mock GPU nodes, and in front of real llama.cpp servers (built once by scripts/llama-server.sh
# into a cache outside the repository: about 6 minutes the first time). Usage: scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

echo "== the decision core links no proxy-wasm (everything but the glue is testable without a host)"
if cargo tree --quiet -p token-balancer-core -e normal,build | grep -q proxy-wasm; then
  echo "token-balancer-core depends on proxy-wasm: keep host calls in the glue crate (src/)" >&2
  exit 1
fi
echo "== cargo fmt --check"
cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
echo "== cargo clippy (native and wasm32-wasip1)"
cargo clippy --quiet --workspace --all-targets -- -D warnings
cargo clippy --quiet --all-targets --target wasm32-wasip1 -- -D warnings
echo "== native unit tests (with core/tests/fuzz_corpus.rs: every committed fuzz input through its target)"
cargo test --quiet --workspace
echo "== fuzz smoke: each libFuzzer target for ${FUZZ_SECONDS:-10} s on stable (docs/FUZZING.md)"
FUZZ_SANITIZER=none scripts/fuzz.sh "${FUZZ_SECONDS:-10}"
echo "== the pure core compiled to wasm32-wasip1, run under WASI"
CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings $PWD/scripts/wasi-run.mjs" \
  cargo test --quiet --target wasm32-wasip1 -p token-balancer-core --lib
echo "== a real inference engine: llama.cpp's llama-server and a small model (cached after the first build)"
scripts/llama-server.sh
echo "== integration tests: real Envoy + token_balancer.wasm + mock GPU nodes and real llama.cpp servers"
TB_REAL_ENGINES=1 .venv/bin/python -m pytest -q tests
