"""Real inference engines for the tests: llama.cpp `llama-server` processes on 127.0.0.1.

scripts/llama-server.sh builds the binary and fetches a small model (SmolLM2-135M-Instruct,
Q4_1) into a cache outside the repository; this module finds them through that script (or
$TB_LLAMA_SERVER / $TB_LLAMA_MODEL), starts servers on free ports, made unequal by their slot
count (`--parallel`) and context size (`--ctx-size`), with `/metrics` and `/slots` on, waits
with a deadline until each one's `/health` answers `{"status":"ok"}`, and stops them.

Without the binary or the model, `require()` skips the calling test with the reason, unless
TB_REAL_ENGINES=1, which makes a missing engine a failure (CI that means to run them).
What a real server of the pinned version answers is written down in tests/REAL_ENGINES.md.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness import ROOT, Response, free_port, request, stop_process, wait_until

SCRIPT = ROOT / "scripts/llama-server.sh"
# Loading a 98 MB model takes about a second here; the deadline allows for a loaded machine.
START_TIMEOUT = 120.0


class EngineError(RuntimeError):
    """A llama-server did not start (exited, or did not load in time). Not an AssertionError,
    so that an expected failure (xfail with raises=AssertionError) cannot be a broken engine."""


def paths() -> tuple[Path, Path]:
    """(llama-server binary, model .gguf): $TB_LLAMA_SERVER and $TB_LLAMA_MODEL when set, else
    the cache paths scripts/llama-server.sh uses (asked with --paths, which builds nothing)."""
    env_bin, env_model = os.environ.get("TB_LLAMA_SERVER"), os.environ.get("TB_LLAMA_MODEL")
    if env_bin and env_model:
        return Path(env_bin), Path(env_model)
    out = subprocess.run(["bash", str(SCRIPT), "--paths"], capture_output=True, text=True, check=False).stdout
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return (Path(env_bin or found["LLAMA_SERVER"]), Path(env_model or found["LLAMA_MODEL"]))


def required() -> bool:
    """TB_REAL_ENGINES=1: the real-engine tests must run (a missing engine fails them)."""
    return os.environ.get("TB_REAL_ENGINES") == "1"


def missing() -> str | None:
    """Why real engines cannot run here, or None when they can."""
    binary, model = paths()
    gone = [f"{what} {p}" for what, p in (("llama-server binary", binary), ("model", model))
            if not (p.is_file() and (what == "model" or os.access(p, os.X_OK)))]
    if not gone:
        return None
    return f"no {' and no '.join(gone)}: run scripts/llama-server.sh (builds llama.cpp once, 6 to 12 min on 2 cores)"


def require():
    """Skips the calling test (or fixture) when no real engine is available, or fails it when
    TB_REAL_ENGINES=1 says one must be."""
    import pytest

    reason = missing()
    if reason is None:
        return
    if required():
        pytest.fail(f"TB_REAL_ENGINES=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set TB_REAL_ENGINES=1 to make this a failure)")


@dataclass
class Spec:
    """One server: `parallel` slots sharing `ctx_size` tokens of context (llama.cpp splits the
    context evenly between the slots unless the KV cache is unified), and the `aliases` its API
    names the model by (none: the model file's name)."""
    name: str
    parallel: int = 1
    ctx_size: int = 2048
    aliases: tuple[str, ...] = ()
    threads: int = 1
    extra: tuple[str, ...] = ()


@dataclass
class LlamaServer:
    spec: Spec
    port: int
    proc: subprocess.Popen
    log_path: Path
    _log: object = field(repr=False, default=None)
    # The log folder, when this server made it (removed on stop; a failure quotes the log's tail).
    _own_dir: Path | None = field(repr=False, default=None)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 10.0) -> Response:
        return request(self.port, "GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 120.0) -> Response:
        return request(self.port, "POST", path, body=body, timeout=timeout)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def ready(self) -> bool:
        """Whether /health answers 200 {"status":"ok"} (it answers 503 while the model loads);
        fails at once if the process has exited."""
        if self.proc.poll() is not None:
            raise EngineError(f"llama-server {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        r = self.get("/health", timeout=2)
        return r.status == 200 and r.json().get("status") == "ok"

    def kill(self):
        """SIGKILL, no goodbye (a node dying)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self):
        stop_process(self.proc, 15)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None


def command(binary: Path, model: Path, spec: Spec, port: int) -> list[str]:
    args = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(spec.parallel), "--ctx-size", str(spec.ctx_size),
            "--threads", str(spec.threads), "--threads-batch", str(spec.threads),
            "--metrics", "--slots", "--no-webui"]
    if spec.aliases:
        args += ["--alias", ",".join(spec.aliases)]
    return args + list(spec.extra)


def wait_ready(server: LlamaServer):
    try:
        wait_until(server.ready, START_TIMEOUT,
                   lambda: f"llama-server {server.name} to load ({server.log_path}):\n{server.tail()}", interval=0.05)
    except AssertionError as e:
        raise EngineError(str(e)) from None


def start(spec: Spec, port: int | None = None, log_dir: Path | None = None, wait: bool = True) -> LlamaServer:
    """Starts one llama-server; with `wait`, returns once /health says ok (the model is loaded)."""
    binary, model = paths()
    port = port or free_port()
    own_dir = None if log_dir else Path(tempfile.mkdtemp(prefix="tb-llama-"))
    log_path = (log_dir or own_dir) / f"llama-server-{spec.name}-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(command(binary, model, spec, port), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    server = LlamaServer(spec, port, proc, log_path, log, own_dir)
    if wait:
        try:
            wait_ready(server)
        except BaseException:
            server.stop()
            raise
    return server


class Fleet:
    """Several llama-servers, started together (their model loads overlap) and stopped together.
    Use as a context manager, or call stop() in a finally."""

    def __init__(self, specs: list[Spec]):
        self.log_dir = Path(tempfile.mkdtemp(prefix="tb-llama-"))
        self.servers: list[LlamaServer] = []
        try:
            for spec in specs:
                self.servers.append(start(spec, log_dir=self.log_dir, wait=False))
            for s in self.servers:
                wait_ready(s)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc):
        self.stop()

    def __getitem__(self, i: int) -> LlamaServer:
        return self.servers[i]

    def __iter__(self):
        return iter(self.servers)

    def by_address(self) -> dict[str, LlamaServer]:
        return {s.address: s for s in self.servers}

    def stop(self):
        for s in self.servers:
            s.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def chat(prompt: str, max_tokens: int = 8, model: str = "smollm2", **extra) -> dict:
    """A chat completion body. Greedy sampling (temperature 0) keeps the tiny model's answers
    repeatable."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def sse_events(body: bytes) -> list:
    """The JSON events of a server-sent-events body (`data: {...}` lines), `[DONE]` as the string."""
    out = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream(port: int, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, list]:
    """POSTs a streaming request; returns (status, headers, events) once the stream ends."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, sse_events(data) if r.status == 200 else [data]
    finally:
        conn.close()
