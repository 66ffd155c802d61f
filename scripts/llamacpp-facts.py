#!/usr/bin/env python3
"""Asks real llama-server processes (scripts/llama-server.sh) what they answer, and records it.

Writes the fixtures the core's tests read, from a server that has served a few requests (so
the counters are not zero):
  core/tests/data/metrics/llamacpp_real.prom   GET /metrics
  core/tests/data/models/llamacpp_real.json    GET /v1/models (server started with --alias)
  core/tests/data/models/llamacpp_real_noalias.json   GET /v1/models without --alias
  core/tests/data/llamacpp_slots.json          GET /slots
  core/tests/data/llamacpp_props.json          GET /props
  core/tests/data/streams/llamacpp_*.sse       streamed answers as served (chat without and with
                                               usage, a completion, OpenAI's Responses API,
                                               Anthropic's Messages API, the native
                                               /completion), 40 tokens each
and prints the observations (health while loading, model names served, usage in streams,
an over-long prompt) as JSON on stdout; tests/REAL_ENGINES.md is written from them.
Volatile values (timestamps, the cache path of the model) are kept as served: the fixtures
are what a server said, not a template.

Usage: .venv/bin/python scripts/llamacpp-facts.py [--no-write]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import real_engines  # noqa: E402
from real_engines import Spec, chat, stream  # noqa: E402

DATA = ROOT / "core/tests/data"

# Streamed answers recorded whole, as the server wrote them: the meter's tests cut them into
# the chunks an engine sends (core/src/ingest/response.rs).
STREAMS = {
    "llamacpp_chat": ("/v1/chat/completions", {"model": "smollm2", "stream": True, "max_tokens": 40, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Write two sentences about the sea."}]}),
    "llamacpp_chat_usage": ("/v1/chat/completions", {"model": "smollm2", "stream": True, "max_tokens": 40, "temperature": 0,
                                                     "stream_options": {"include_usage": True},
                                                     "messages": [{"role": "user", "content": "Write two sentences about the sea."}]}),
    "llamacpp_completion": ("/v1/completions", {"model": "smollm2", "stream": True, "max_tokens": 40, "temperature": 0,
                                                "prompt": "Once upon a time"}),
    "llamacpp_responses": ("/v1/responses", {"model": "smollm2", "stream": True, "max_output_tokens": 40, "temperature": 0,
                                             "instructions": "Answer in plain prose.",
                                             "input": "Write two sentences about the sea."}),
    "llamacpp_messages": ("/v1/messages", {"model": "smollm2", "stream": True, "max_tokens": 40, "temperature": 0,
                                           "system": "Answer in plain prose.",
                                           "messages": [{"role": "user", "content": "Write two sentences about the sea."}]}),
    "llamacpp_native": ("/completion", {"stream": True, "n_predict": 40, "temperature": 0,
                                        "prompt": "Once upon a time"}),
}


def raw_stream(port: int, path: str, body: dict) -> bytes:
    """A streamed answer's body, byte for byte."""
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return data


def health_while_loading(spec: Spec) -> dict:
    """Starts a server and polls /health from the first moment: the answers before 200."""
    server = real_engines.start(spec, wait=False)
    seen: list[tuple[int, str]] = []
    try:
        deadline = time.monotonic() + real_engines.START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                r = server.get("/health", timeout=2)
            except OSError as e:
                entry = (0, type(e).__name__)
            else:
                entry = (r.status, r.body.decode("utf-8", "replace"))
                if r.status == 200:
                    if not seen or seen[-1] != entry:
                        seen.append(entry)
                    break
            if not seen or seen[-1] != entry:
                seen.append(entry)
            time.sleep(0.005)
        other = {p: (lambda r: (r.status, r.body[:300].decode("utf-8", "replace")))(server.get(p))
                 for p in ("/v1/health", "/healthz", "/ready")}
        return {"sequence": seen, "other_paths": other}
    finally:
        server.stop()


def main() -> int:
    write = "--no-write" not in sys.argv
    reason = real_engines.missing()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    binary, model = real_engines.paths()
    facts: dict = {"binary": str(binary), "model": str(model)}
    import subprocess
    facts["version"] = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stderr.strip()

    facts["health_while_loading"] = health_while_loading(Spec("loading"))

    aliased = Spec("aliased", parallel=2, ctx_size=1024, aliases=("smollm2", "smollm2-135m"))
    plain = Spec("plain", parallel=1, ctx_size=512)
    with real_engines.Fleet([aliased, plain]) as fleet:
        a, p = fleet[0], fleet[1]
        facts["metrics_before_requests"] = a.get("/metrics").body.decode()

        # Model names: the aliases, the listed id, the file name, anything, none.
        names = {}
        listed_plain = p.get("/v1/models").json()["data"][0]["id"]
        for server, name in [(a, "smollm2"), (a, "smollm2-135m"), (a, "gpt-4o"), (a, "no/such:model"),
                             (a, None), (p, listed_plain), (p, "gpt-4o")]:
            body = chat("Say hi.", 4)
            if name is None:
                del body["model"]
            r = server.post("/v1/chat/completions", body)
            names[f"{server.name}:{name}"] = {"status": r.status,
                                               "response_model": r.json().get("model") if r.status == 200 else None,
                                               "body": None if r.status == 200 else r.body[:300].decode()}
        facts["model_names"] = names

        r = a.post("/v1/chat/completions", chat("Name three colours.", 16))
        facts["non_stream"] = {"status": r.status, "headers": r.headers, "body": r.json()}
        r = a.post("/v1/completions", {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8,
                                       "temperature": 0})
        facts["non_stream_completions"] = r.json()

        def summarize(events):
            return {"events": len(events),
                    "usage_chunks": [e.get("usage") for e in events if isinstance(e, dict) and e.get("usage")],
                    "last_two": events[-2:],
                    "has_timings": any(isinstance(e, dict) and "timings" in e for e in events)}

        for label, extra in [("stream_include_usage", {"stream_options": {"include_usage": True}}),
                             ("stream_no_options", {}),
                             ("stream_include_usage_false", {"stream_options": {"include_usage": False}})]:
            status, headers, events = stream(a.port, "/v1/chat/completions", chat("Count to five.", 12, **extra))
            facts[label] = {"status": status, **summarize(events)}
        status, headers, events = stream(a.port, "/v1/completions",
                                         {"model": "smollm2", "prompt": "Once", "max_tokens": 6, "temperature": 0,
                                          "stream_options": {"include_usage": True}})
        facts["stream_completions_include_usage"] = {"status": status, **summarize(events)}

        # Over the context: `plain` has one slot of 512 tokens, `aliased` two of 512 each.
        long_prompt = "lorem ipsum dolor sit amet " * 200
        r = p.post("/v1/chat/completions", chat(long_prompt, 8))
        facts["over_context"] = {"status": r.status, "body": r.body[:600].decode()}
        status, _, events = stream(p.port, "/v1/chat/completions", chat(long_prompt, 8))
        facts["over_context_stream"] = {"status": status, "events": [e if isinstance(e, (dict, str)) else e[:600].decode()
                                                                    for e in events][:3]}
        # Prompt fits, prompt + max_tokens does not: generation stops at the context end?
        mid_prompt = "lorem ipsum dolor sit amet " * 30
        r = p.post("/v1/chat/completions", chat(mid_prompt, 400, ignore_eos=True))
        facts["prompt_plus_max_tokens_over_context"] = {"status": r.status,
                                                        "usage": r.json().get("usage") if r.status == 200 else None,
                                                        "finish_reason": r.json()["choices"][0]["finish_reason"]
                                                        if r.status == 200 else None,
                                                        "body": None if r.status == 200 else r.body[:600].decode()}

        # Busy: `plain` has one slot; two generations at once, one runs and one waits.
        import threading
        busy = [threading.Thread(target=p.post, args=("/v1/chat/completions", chat("Tell a story.", 200)),
                                 daemon=True) for _ in range(2)]
        for t in busy:
            t.start()
        deadline = time.monotonic() + 30
        seen_busy = None
        while time.monotonic() < deadline:
            text = p.get("/metrics").body.decode()
            if "llamacpp:requests_deferred 1" in text:
                seen_busy = text
                break
            time.sleep(0.01)
        facts["metrics_busy"] = seen_busy
        facts["slots_busy"] = p.get("/slots").json()
        facts["health_busy"] = (lambda r: (r.status, r.body.decode()))(p.get("/health"))
        for t in busy:
            t.join(120)

        streams = {name: raw_stream(a.port, path, body) for name, (path, body) in STREAMS.items()}
        metrics = a.get("/metrics")
        facts["metrics_headers"] = metrics.headers
        models = a.get("/v1/models")
        slots = a.get("/slots")
        props = a.get("/props")
        facts["models_noalias"] = p.get("/v1/models").json()
        facts["other_endpoints"] = {path: (lambda r: (r.status, r.body[:200].decode("utf-8", "replace")))(a.get(path))
                                    for path in ("/api/tags", "/v1/slots", "/slots?fail_on_no_slot=1")}
        if write:
            (DATA / "metrics").mkdir(parents=True, exist_ok=True)
            (DATA / "models").mkdir(parents=True, exist_ok=True)
            (DATA / "metrics/llamacpp_real.prom").write_bytes(metrics.body)
            (DATA / "models/llamacpp_real.json").write_text(json.dumps(models.json(), indent=2) + "\n")
            (DATA / "models/llamacpp_real_noalias.json").write_text(json.dumps(facts["models_noalias"], indent=2) + "\n")
            (DATA / "llamacpp_slots.json").write_text(json.dumps(slots.json(), indent=2) + "\n")
            (DATA / "llamacpp_props.json").write_text(json.dumps(props.json(), indent=2) + "\n")
            (DATA / "streams").mkdir(parents=True, exist_ok=True)
            for name, data in streams.items():
                (DATA / f"streams/{name}.sse").write_bytes(data)
        facts["metrics"] = metrics.body.decode()
        facts["models"] = models.json()
        facts["slots"] = slots.json()
        facts["props"] = props.json()
    print(json.dumps(facts, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
