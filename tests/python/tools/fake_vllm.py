"""A stand-in for the interpreter that runs vLLM in tools/serve_bench.py's tests (its --python).

`FAKE -m vllm.entrypoints.cli.main serve DIR ... --port P` answers like vLLM's OpenAI server: /health,
/v1/completions (streamed or not; an over-long prompt and max_tokens 0 get 400 BadRequestError, a
body that is not JSON 400 Bad Request), /collective_rpc (the worker's counters), and logs the
plugin's lines as vLLM's API server and engine process would. `FAKE -m tools.serve_bench client|
latency RUNS STATUS` writes result files shaped like vLLM's. FAKE_VLLM (comma-separated) picks
what goes wrong: serve-exits (the server exits at once), client-fails, latency-fails,
opgraft-differs (the opgraft server accepts max_tokens 0), real-client (the client is the real
one: vLLM's `vllm bench serve` code against this server).
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FLAGS = set(filter(None, os.environ.get("FAKE_VLLM", "").split(",")))
DISABLED = os.environ.get("OPGRAFT_DISABLE") == "1"
ENGINE = "(EngineCore pid=4242) "


def _opt(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def _error(message, kind):
    return {"error": {"message": message, "type": kind, "param": None, "code": 400}}


def serve(argv) -> int:
    port, max_len = int(_opt(argv, "--port")), int(_opt(argv, "--max-model-len"))
    for prefix in ("", ENGINE):
        if DISABLED:
            print(f"{prefix}INFO 12-01 10:00:00 [__init__.py:73] opgraft: disabled by OPGRAFT_DISABLE: nothing patched")
        else:
            print(f"{prefix}INFO 12-01 10:00:00 [__init__.py:113] opgraft 0.1.0: MoE experts seam installed "
                  "(TritonExperts.apply); MoE variant opgraft")
    print(f"{ENGINE}INFO 12-01 10:00:01 [serve_worker.py:50] serve bench: weights re-initialised: "
          f"{{'std': {os.environ.get('OPGRAFT_SERVE_INIT_STD')}}}", flush=True)
    if "serve-exits" in FLAGS:
        print("RuntimeError: fake start-up failure", flush=True)
        return 3
    taken = 0 if DISABLED else 96

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *a):
            pass

        def _json(self, status, obj):
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {})
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [{"id": argv[1], "object": "model"}]})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/collective_rpc":
                return self._json(200, {"results": [{"pid": 4242, "plugin": "fake", "moe": None if DISABLED else
                                                     {"taken": taken, "delegated": 0, "delegated_by_reason": {}}}]})
            if self.path != "/v1/completions":
                return self._json(404, {"detail": "Not Found"})
            try:
                body = json.loads(raw)
            except ValueError:
                return self._json(400, _error("1 validation error: JSON decode error", "Bad Request"))
            max_tokens = body.get("max_tokens", 16)
            prompt = body.get("prompt")
            n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            if max_tokens == 0 and (DISABLED or "opgraft-differs" not in FLAGS):
                return self._json(400, _error("max_tokens must be at least 1, got 0.", "BadRequestError"))
            if n_prompt + max_tokens > max_len:
                return self._json(400, _error(f"This model's maximum context length is {max_len} tokens.",
                                              "BadRequestError"))
            texts = [f" t{100 + k}" for k in range(max_tokens)]
            if not body.get("stream"):
                return self._json(200, {"object": "text_completion", "choices": [{"index": 0, "text": "".join(texts)}],
                                        "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in texts:
                self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': t}]})}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.002)
            usage = {"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # SIGINT: a clean stop, with the exit counters
        if not DISABLED:
            print(f"{ENGINE}WARNING 12-01 10:00:09 [dispatch.py:228] opgraft stats (pid 4242): moe calls taken "
                  f"{taken}, handed back 0 {{}}", flush=True)
    return 0


def _result(run, kind):
    """A result file with the keys vLLM 0.26's benchmarks write (the values made up)."""
    argv = run["argv"]
    scale = 1.0 if DISABLED else 0.9
    if kind == "client":
        c = int(_opt(argv, "--max-concurrency"))
        n = int(_opt(argv, "--num-prompts"))
        tpot = (4.0 + 0.2 * c) * scale
        res = {"date": "20261201-100000", "backend": "openai", "num_prompts": n, "max_concurrency": c,
               "duration": 1.5, "completed": n, "failed": 0, "output_throughput": 1000.0 / tpot * c,
               "median_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.1, "median_itl_ms": tpot, "p99_itl_ms": tpot * 1.3,
               "median_ttft_ms": 20.0, "p99_ttft_ms": 25.0, "mean_tpot_ms": tpot}
    else:
        b = int(_opt(argv, "--batch-size"))
        lat = (1.0 + 0.1 * b) * scale
        res = {"avg_latency": lat, "latencies": [lat] * int(_opt(argv, "--num-iters")),
               "percentiles": {"10": lat, "25": lat, "50": lat, "75": lat, "90": lat, "99": lat}}
    with open(run["result_file"], "w") as f:
        json.dump(res, f)


def runner(kind, runs_path, status_path) -> int:
    if kind == "client" and "real-client" in FLAGS:
        os.execv(sys.executable, [sys.executable, "-m", "tools.serve_bench", kind, runs_path, status_path])
    if f"{kind}-fails" in FLAGS:
        print(f"Traceback (most recent call last):\nValueError: fake {kind} failure", flush=True)
        return 1
    with open(runs_path) as f:
        runs = json.load(f)
    status = {"runs": []}
    for run in runs:
        _result(run, kind)
        status["runs"].append({"result_file": run["result_file"], "ok": True, "seconds": 0.1})
    if kind == "latency":
        status.update(ready_s=1.0, engine_s=0.5, stats=[{"pid": 4243, "moe": None if DISABLED else {"taken": 48}}])
        print(f"{ENGINE}WARNING [dispatch.py:228] opgraft stats (pid 4243): moe calls taken 48, handed back 0 {{}}")
    with open(status_path, "w") as f:
        json.dump(status, f)
    return 0


def main(argv) -> int:
    if argv[:2] == ["-m", "vllm.entrypoints.cli.main"] and argv[2:3] == ["serve"]:
        return serve(argv[2:])
    if argv[:2] == ["-m", "tools.serve_bench"] and argv[2] in ("client", "latency"):
        return runner(argv[2], argv[3], argv[4])
    print(f"fake vLLM: unexpected command {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
