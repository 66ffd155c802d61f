#!/usr/bin/env bash
# Runs the cargo-fuzz targets (fuzz/) with libFuzzer, one at a time, each in one process on one
# core, on the stable toolchain (RUSTC_BOOTSTRAP=1 lets stable rustc take the -Z sanitizer
# flags cargo-fuzz passes; see docs/FUZZING.md).
#
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
#   SECONDS  how long each target runs (default 10: the CI smoke)
#   TARGET   request_body, health_json, config, response_usage (default: every target that
#            `cargo fuzz list` finds in fuzz/Cargo.toml)
# Environment:
#   FUZZ_MERGE=1   afterwards merge the inputs that found new coverage into fuzz/corpus/<target>
#                  (libFuzzer -merge=1 -use_counters=0: only inputs adding new edges are
#                  kept, which keeps the corpus at a few hundred files); otherwise the
#                  committed corpus is read, never written.
#   FUZZ_SANITIZER address (default) or none (faster, catches panics and aborts only).
# Each run starts from the committed corpus fuzz/corpus/<target> with the dictionary
# fuzz/dict/<target>.dict; an input taking over 10 s counts as a crash (a hang). A crash stops the script with a non-zero status; its input is in
# fuzz/artifacts/<target>/ and the log in target/fuzz-logs/<target>.log.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
shift || true
targets=("$@")
sanitizer=${FUZZ_SANITIZER:-address}

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is not installed (scripts/setup.sh installs it)" >&2
  exit 1
fi
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cd fuzz && cargo fuzz list)
fi

export RUSTC_BOOTSTRAP=1
logs=$PWD/target/fuzz-logs
mkdir -p "$logs"
echo "== building the fuzz targets (sanitizer: $sanitizer)"
if ! (cd fuzz && cargo fuzz build --sanitizer "$sanitizer") >"$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log" >&2
  echo "fuzz: the build failed; log in $logs/build.log" >&2
  exit 1
fi

for t in "${targets[@]}"; do
  work=$(mktemp -d)
  start=$(date +%s)
  echo "== fuzz $t for ${seconds}s (sanitizer: $sanitizer)"
  status=0
  (cd fuzz && cargo fuzz run --sanitizer "$sanitizer" "$t" "$work" "corpus/$t" -- \
    -max_total_time="$seconds" -dict="dict/$t.dict" -timeout=10 -print_final_stats=1) \
    >"$logs/$t.log" 2>&1 || status=$?
  end=$(date +%s)
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log" | tail -1)
  echo "   $t: ${runs:-?} executions in $((end - start))s, exit status $status"
  if [ "$status" -ne 0 ]; then
    tail -40 "$logs/$t.log" >&2
    echo "fuzz: $t failed; reproducer in fuzz/artifacts/$t/, log in $logs/$t.log" >&2
    rm -rf "$work"
    exit "$status"
  fi
  if [ "${FUZZ_MERGE:-0}" = 1 ]; then
    before=$(find "fuzz/corpus/$t" -type f | wc -l)
    (cd fuzz && cargo fuzz run --sanitizer "$sanitizer" "$t" "corpus/$t" "$work" -- \
      -merge=1 -use_counters=0) >"$logs/$t.merge.log" 2>&1
    after=$(find "fuzz/corpus/$t" -type f | wc -l)
    echo "   $t: merged $((after - before)) new inputs into fuzz/corpus/$t ($after files)"
  fi
  rm -rf "$work"
done
