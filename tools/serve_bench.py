"""opgraft under `vllm serve`, measured with vLLM's own benchmark clients: stock vLLM
(OPGRAFT_DISABLE=1) against opgraft, same model, same requests, one server process per setting.

    python -m tools.serve_bench study --out-dir DIR [--preset Qwen3-30B-A3B | --model-dir DIR]
        [--parts serve,latency] [--modes disabled,opgraft] [--lengths 128x256[,2048x256]]
        [--concurrency 1,8,32] [--latency-batches 1,8] [--budget-s S]
    python -m tools.serve_bench prepare --model-dir DIR [--preset NAME]   (config + tokenizer only)
    python -m tools.serve_bench table DIR                                 (the tables again)

The model folder holds a public MoE architecture's config.json (--preset writes it from the
public config in tools/e2e.py, whose MoE dims tests check against opgraft.presets) and, unless
the folder already has one, a local tokenizer built with the `tokenizers` library: one word a
token id ("t0" .. "t<vocab-1>", the config's special token ids named), so vLLM and its clients
load it offline and a prompt of N random tokens is N tokens again after decoding and encoding.

For each setting: `vllm serve DIR --load-format dummy` starts (torch.compile and CUDA graphs on,
capture sizes limited to the batch sizes the runs can reach), its worker re-initialises the dummy
weights right after loading (tools/serve_worker.py: N(0, std^2) seeded per parameter name, as
tools/e2e.py does), and once /health answers, `vllm bench serve` runs the random dataset at each
input/output length and max concurrency (greedy, --ignore-eos, vLLM's result files saved). Then
three bad requests (an over-long prompt, max_tokens 0, a malformed JSON body) and a good one, the
plugin's counters from the worker (POST /collective_rpc, VLLM_SERVER_DEV_MODE=1) and a clean
stop (SIGINT, so OPGRAFT_STATS=1 writes each process's counters to the log). `vllm bench latency`
(batch sizes --latency-batches) runs in a process of its own per setting, with the same engine
arguments. The runs of one client happen in one Python process (the same parser and main
function as `vllm bench serve` / `vllm bench latency`, without the CLI's start-up for each run;
the latency runs share one engine).

torch.compile's cache (VLLM_CACHE_ROOT) is shared by the settings by default: its key covers the
vLLM configuration, vLLM's environment variables and the model's traced source files, not
opgraft's patches; that is safe because the patched methods run inside vLLM's opaque MoE custom
op (and the attention backend choice, unchanged by default) at run time, outside the traced
graph. --compile-cache separate keeps one cache a setting (for a seam that changes traced code,
or OPGRAFT_ATTN_BACKEND).

Output under --out-dir: vllm/ (vLLM's own result files), logs/ (server, client and latency logs),
serve-summary.json (rows per setting, length and concurrency; latency rows; bad-request
comparison; counters; the plugin's log lines; the exact command lines). Any failure (a server
that does not start, a client that fails) is reported with the setting and its log's last lines,
the remaining settings still run, and the exit status is 1. --budget-s skips the phases that no
longer fit (reported, exit status 0) instead of running into an outer time limit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tools import e2e

MODES = ("disabled", "opgraft")
PARTS = ("serve", "latency")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_CLS = "tools.serve_worker.ReinitWorker"
INIT_STD_ENV = "OPGRAFT_SERVE_INIT_STD"  # read by tools/serve_worker.py
SERVER_MODULE = "vllm.entrypoints.cli.main"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Names of special token ids for the presets' tokenizers (Qwen/Qwen3-30B-A3B's tokenizer_config,
# mistralai/Mixtral-8x7B-v0.1's); any other config gets <s> / </s> at its bos / eos ids.
PRESET_SPECIALS = {
    "Qwen3-30B-A3B": {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
    "Mixtral-8x7B": {0: "<unk>", 1: "<s>", 2: "</s>"},
}


class Failure(Exception):
    """A step of a setting that failed; str() names the setting and holds its log's tail."""


# ---- the model folder ---------------------------------------------------------------------------


def preset_config(name: str) -> dict:
    """The public config.json of a preset (tools/e2e.py's, sourced from the model cards)."""
    if name not in e2e.MODEL_CONFIGS:
        raise SystemExit(f"serve bench: unknown preset {name!r} (have {', '.join(e2e.MODEL_CONFIGS)})")
    return dict(e2e.MODEL_CONFIGS[name])


def _ids(value) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def vocab_size_of(cfg: dict) -> int:
    vocab = cfg.get("vocab_size")
    if vocab is None and isinstance(cfg.get("text_config"), dict):
        vocab = cfg["text_config"].get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 16:
        raise SystemExit("serve bench: config.json has no usable vocab_size")
    return vocab


def special_tokens(cfg: dict, preset: str | None = None) -> dict[int, str]:
    """{id: name} of the tokenizer's special tokens: the preset's names, else <s> / </s> at the
    config's bos / eos ids, and <unk> at the highest free id (WordLevel needs an unknown token)."""
    vocab = vocab_size_of(cfg)
    out = dict(PRESET_SPECIALS.get(preset or "", {}))
    if not out:
        for k, i in enumerate(_ids(cfg.get("bos_token_id"))):
            out.setdefault(i, "<s>" if k == 0 else f"<s{k}>")
        for k, i in enumerate(_ids(cfg.get("eos_token_id"))):
            out.setdefault(i, "</s>" if k == 0 else f"</s{k}>")
    bad = sorted(i for i in out if not 0 <= i < vocab)
    if bad:
        raise SystemExit(f"serve bench: special token ids {bad} outside the vocabulary of {vocab}")
    if "<unk>" not in out.values():
        out[max(i for i in range(vocab) if i not in out)] = "<unk>"
    return out


def build_tokenizer(model_dir: str, cfg: dict, preset: str | None = None) -> dict:
    """Writes tokenizer.json (WordLevel, whitespace split, one token an id) and
    tokenizer_config.json into model_dir; returns what it built."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = special_tokens(cfg, preset)
    vocab_size = vocab_size_of(cfg)
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in specials}
    vocab.update({name: i for i, name in specials.items()})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in specials.values()])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    eos = _ids(cfg.get("eos_token_id"))
    bos = _ids(cfg.get("bos_token_id"))
    tcfg = {
        # Loads tokenizer.json as it is (transformers' tokenizers backend), with no model-specific
        # tokenizer class that would rebuild it from a vocabulary file it lacks.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": specials[eos[0]] if eos else None,
        "bos_token": None,  # prompts are the random tokens alone
        "unk_token": "<unk>",
        "pad_token": specials[eos[0]] if eos else "<unk>",
        # Every special token is one, so that vLLM's random dataset leaves them out of prompts.
        "additional_special_tokens": [n for n in specials.values() if n not in ("<unk>", specials[eos[0]] if eos else "")],
        "model_max_length": int(cfg.get("max_position_embeddings") or 4096),
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=1)
    return {"kind": "WordLevel", "vocab_size": vocab_size, "special_tokens": {str(k): v for k, v in specials.items()},
            "bos_token_id": bos[0] if bos else None}


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"  # atomic: a reader never sees half a file
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def default_model_dir(cfg: dict, name: str) -> str:
    """A folder whose path depends only on the config (vLLM's compile cache key includes it)."""
    import hashlib

    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join("/tmp", f"opgraft-serve-{name}-{key}")


def prepare_model_dir(model_dir: str | None, preset: str | None, rebuild_tokenizer: bool = False) -> tuple[str, dict]:
    """(folder, config): writes the preset's config.json (if a preset is given) and the tokenizer
    (if the folder has none, or rebuild_tokenizer)."""
    if preset:
        cfg = preset_config(preset)
        model_dir = model_dir or default_model_dir(cfg, preset)
        os.makedirs(model_dir, exist_ok=True)
        _write_json(os.path.join(model_dir, "config.json"), cfg)
    else:
        if not model_dir:
            raise SystemExit("serve bench: give --preset or --model-dir")
        cfg = e2e.model_config(model_dir)
    model_dir = os.path.abspath(model_dir)
    if rebuild_tokenizer or not all(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        build_tokenizer(model_dir, cfg, preset)
    return model_dir, cfg


# ---- command lines ------------------------------------------------------------------------------


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's own spacing of CUDA-graph sizes (1, 2, 4, then multiples of 8), up to max_batch:
    the decode batches the runs can reach, and nothing larger to capture at start-up."""
    sizes = {s for s in (1, 2, 4) if s <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


def max_num_seqs(args) -> int:
    batches = list(args.concurrency) + (list(args.latency_batches) if "latency" in args.parts else [])
    return max(batches)


def engine_argv(args) -> list[str]:
    """The engine arguments of every process. The server's and bench latency's are the same, so
    their vLLM configurations hash alike and share torch.compile's cache; max-num-batched-tokens
    and max-num-seqs are explicit because their defaults differ between the two entry points."""
    compilation = {"cudagraph_capture_sizes": capture_sizes(max_num_seqs(args))}
    return ["--load-format", "dummy", "--dtype", "bfloat16", "--seed", str(args.seed),
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(max_num_seqs(args)),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-enable-prefix-caching",
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--compilation-config", json.dumps(compilation, separators=(",", ":")),
            "--worker-cls", WORKER_CLS]


def serve_argv(args, model_dir: str, port: int) -> list[str]:
    """`vllm serve` arguments (after the program name)."""
    return ["serve", model_dir, *engine_argv(args), "--host", "127.0.0.1", "--port", str(port)]


def num_prompts(concurrency: int, args) -> int:
    """Enough requests for --waves full waves at this concurrency, and at least --min-prompts."""
    return max(args.min_prompts, args.waves * concurrency)


def bench_serve_argv(args, model_dir: str, port: int, mode: str, input_len: int, output_len: int,
                     concurrency: int, result_dir: str, result_filename: str) -> list[str]:
    """`vllm bench serve` arguments (after `vllm bench serve`): the random dataset at fixed
    lengths, greedy, every request to its full length, vLLM's result file saved."""
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--host", "127.0.0.1", "--port", str(port),
            "--model", model_dir, "--tokenizer", model_dir,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts(concurrency, args)), "--max-concurrency", str(concurrency),
            "--num-warmups", str(min(concurrency, 8)), "--ignore-eos", "--temperature", "0",
            "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--label", mode,
            "--metadata", f"mode={mode}", f"input_len={input_len}", f"output_len={output_len}",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_filename,
            "--disable-tqdm"]


def latency_argv(args, model_dir: str, batch: int, output_json: str) -> list[str]:
    """`vllm bench latency` arguments (after `vllm bench latency`), the same engine arguments as
    the server's."""
    i, o = args.latency_len
    return ["--model", model_dir, *engine_argv(args), "--input-len", str(i), "--output-len", str(o),
            "--batch-size", str(batch), "--num-iters-warmup", str(args.latency_warmup),
            "--num-iters", str(args.latency_iters), "--output-json", output_json]


def cache_root(args, mode: str) -> str:
    return args.cache_root if args.compile_cache == "shared" else os.path.join(args.cache_root, mode)


def child_env(mode: str, args, base: dict | None = None) -> dict:
    """The environment of a setting's processes (server, client, latency)."""
    base = dict(os.environ if base is None else base)
    env = e2e.mode_env(mode, base)  # OPGRAFT_DISABLE / OPGRAFT_MOE_EXPERTS, FlashInfer sampler off
    if "VLLM_ALLOW_INSECURE_SERIALIZATION" not in base:
        env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # the counters come by method name
    env.update({
        "OPGRAFT_STATS": "1",  # each process logs its counters at exit
        INIT_STD_ENV: str(args.init_std),
        # /collective_rpc (the counters) exists in dev mode only; not part of the compile key.
        "VLLM_SERVER_DEV_MODE": "1",
        # What the vllm CLI sets, set for the latency process too: vLLM's environment variables
        # are part of the compile cache key. Spawned engine processes also run their exit hooks.
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_CACHE_ROOT": cache_root(args, mode),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",  # the logs as they happen (a killed process loses no lines)
        # The worker class (tools.serve_worker) and the runners come from this checkout.
        "PYTHONPATH": REPO + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else ""),
    })
    # vLLM's client (aiohttp, trust_env) must not send the local requests to a proxy.
    for key in ("no_proxy", "NO_PROXY"):
        env[key] = ",".join(filter(None, [base.get(key, ""), "127.0.0.1", "localhost"]))
    return env


# ---- processes ----------------------------------------------------------------------------------


def log_tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:])


def failure(setting: str, what: str, log: str, n: int = 30) -> Failure:
    return Failure(f"{setting}: {what}\n---- last lines of {log}:\n{log_tail(log, n)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` in its own process group, its output in a log file."""

    def __init__(self, setting: str, cmd: list[str], env: dict, log: str, port: int):
        self.setting, self.cmd, self.env, self.log, self.port = setting, cmd, env, log, port
        self.base = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self) -> None:
        with open(self.log, "w") as lf:
            # SIGINT back to its default in the server: a study started in the background (nohup,
            # `cmd &`) inherits it ignored, and then the clean stop below never reaches the server
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.t0 = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from start until /health answered 200; Failure if the server exits first or
        does not answer within timeout."""
        while True:
            waited = time.monotonic() - self.t0
            if not self.alive():
                raise failure(self.setting, f"the server exited with status {self.proc.returncode} after "
                              f"{waited:.0f} s, before it answered /health", self.log)
            try:
                status, _ = http_request("GET", self.base + "/health", timeout=5)
                if status == 200:
                    return round(waited, 1)
            except NET_ERRORS:
                pass
            if waited > timeout:
                raise failure(self.setting, f"the server did not answer /health within {timeout:.0f} s", self.log)
            time.sleep(1.0)

    def stop(self, grace: float = 40.0) -> dict:
        """SIGINT to the API server, which stops its engine process (both write their exit
        counters); the process group is ended if that takes longer than grace."""
        if self.proc is None:
            return {"rc": None}
        t = time.monotonic()
        how = "SIGINT"
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                how = "SIGINT, then the process group ended"
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.proc.pid, sig)
                        self.proc.wait(timeout=10)
                        break
                    except ProcessLookupError:
                        break
                    except subprocess.TimeoutExpired:
                        continue
        try:  # children left behind (an engine process whose parent went first)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return {"rc": self.proc.returncode, "stop_s": round(time.monotonic() - t, 1), "how": how}


def run_child(kind: str, runs: list[dict], env: dict, python: str, log: str, status_path: str,
              timeout: float) -> tuple:
    """Runs `python -m tools.serve_bench <kind> RUNS STATUS` (the client or the latency runner) in
    its own process group; returns (exit status or "timeout", status dict or None)."""
    runs_path = status_path[: -len(".status.json")] + ".runs.json"
    _write_json(runs_path, runs)
    for stale in [status_path] + [r["result_file"] for r in runs]:  # a rerun into the same folder
        if os.path.exists(stale):
            os.remove(stale)
    cmd = [python, "-m", "tools.serve_bench", kind, runs_path, status_path]
    with open(log, "w") as lf:
        rc = e2e.run_group(cmd, env, lf, max(timeout, 30.0))
    try:
        with open(status_path) as f:
            status = json.load(f)
    except (OSError, ValueError):
        status = None
    return rc, status


# ---- HTTP ---------------------------------------------------------------------------------------


# The servers are local: no proxy from the environment applies.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_request(method: str, url: str, body=None, timeout: float = 60.0) -> tuple[int, object]:
    """(status, JSON body or text). body: a dict (sent as JSON), raw bytes, or None."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def error_type(payload) -> str:
    """The error's type in an OpenAI-style error body ("" for a success)."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            return str(err.get("type"))
        if "detail" in payload:
            return "detail"
        if "choices" in payload:
            return ""
    return f"unparsed {type(payload).__name__}"


def error_message(payload) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", ""))[:300]
    if isinstance(payload, dict) and "detail" in payload:
        return str(payload["detail"])[:300]
    return "" if isinstance(payload, dict) else str(payload)[:300]


# What a request can fail with short of an HTTP status: no connection, a reset, a broken answer.
NET_ERRORS = (OSError, http.client.HTTPException)

BAD_REQUESTS = ("over_long_prompt", "max_tokens_0", "malformed_json")


def bad_request_bodies(model: str, max_model_len: int) -> dict:
    """The bad requests, as token-id prompts (independent of the tokenizer)."""
    return {
        "over_long_prompt": {"model": model, "prompt": [100 + i % 1000 for i in range(max_model_len + 100)],
                             "max_tokens": 16},
        "max_tokens_0": {"model": model, "prompt": [100, 101, 102, 103], "max_tokens": 0},
        "malformed_json": b'{"model": ' + json.dumps(model).encode() + b', "prompt": [100, 101], "max_tokens": 8',
    }


def good_request(base: str, model: str, tokens: int = 8) -> dict:
    body = {"model": model, "prompt": [100 + i for i in range(16)], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        status, payload = http_request("POST", base + "/v1/completions", body)
    except NET_ERRORS as e:
        return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}
    got = payload.get("usage", {}).get("completion_tokens") if isinstance(payload, dict) else None
    text = payload["choices"][0].get("text") if status == 200 and isinstance(payload, dict) and payload.get("choices") else None
    return {"ok": status == 200 and got == tokens, "status": status, "completion_tokens": got, "text": text,
            "error_type": error_type(payload) if status != 200 else ""}


def bad_requests(base: str, model: str, max_model_len: int) -> dict:
    """Each bad request's status and error type, then whether a good request still succeeds."""
    checks = {}
    for name, body in bad_request_bodies(model, max_model_len).items():
        try:
            status, payload = http_request("POST", base + "/v1/completions", body)
            checks[name] = {"status": status, "error_type": error_type(payload), "message": error_message(payload)}
        except NET_ERRORS as e:  # no answer at all (connection reset, timeout)
            checks[name] = {"status": None, "error_type": f"no answer ({type(e).__name__})", "message": str(e)[:300]}
    return {"checks": checks, "good_after": good_request(base, model)}


def compare_bad_requests(results: dict) -> dict:
    """{mode: bad_requests(...)} -> per check whether every setting gave the same status and error
    type, and whether each server kept serving."""
    rows = []
    for name in BAD_REQUESTS:
        per = {m: r["checks"].get(name, {}) for m, r in results.items()}
        answers = {(c.get("status"), c.get("error_type")) for c in per.values()}
        rows.append({"name": name, "same": len(answers) == 1,
                     **{m: {"status": c.get("status"), "error_type": c.get("error_type")} for m, c in per.items()}})
    return {"checks": rows,
            "same_as_stock": all(r["same"] for r in rows) if len(results) > 1 else None,
            "kept_serving": {m: bool(r.get("good_after", {}).get("ok")) for m, r in results.items()}}


def worker_stats(base: str) -> list | dict:
    """The plugin's counters in the engine's worker (tools/serve_worker.py's opgraft_stats)."""
    try:
        status, payload = http_request("POST", base + "/collective_rpc", {"method": "opgraft_stats"}, timeout=30)
    except NET_ERRORS as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if status != 200 or not isinstance(payload, dict):
        return {"error": f"HTTP {status}: {str(payload)[:300]}"}
    return payload.get("results", payload)


# ---- what the logs and result files say -----------------------------------------------------------

PLUGIN_LINE = re.compile(r"\] opgraft[ :]|opgraft stats \(pid|handed back to vLLM|serve bench: weights")


def plugin_lines(log: str, limit: int = 40) -> dict:
    """The plugin's lines of a vLLM log, by process: its register() line, its exit counters, the
    worker's re-initialisation line."""
    out: dict = {"api_server": [], "engine_core": []}
    try:
        with open(log, errors="replace") as f:
            for ln in f:
                if PLUGIN_LINE.search(ln):
                    key = "engine_core" if "EngineCore" in ln or "Worker" in ln else "api_server"
                    if len(out[key]) < limit:
                        out[key].append(ln.strip()[:400])
    except OSError:
        pass
    return out


def serve_row(result: dict, mode: str, input_len: int, output_len: int, concurrency: int, meta: dict,
              result_file: str) -> dict:
    """The summary of one `vllm bench serve` result file (keys of vLLM 0.26's benchmarks/serve.py:
    median_/p99_ tpot, itl, ttft in ms, output_throughput in tokens/s)."""
    g = result.get
    return {"client": "vllm bench serve", "mode": mode, "concurrency": concurrency, "input_len": input_len,
            "output_len": output_len, "tpot_ms_median": g("median_tpot_ms"), "tpot_ms_p99": g("p99_tpot_ms"),
            "itl_ms_median": g("median_itl_ms"), "itl_ms_p99": g("p99_itl_ms"),
            "ttft_ms_median": g("median_ttft_ms"), "ttft_ms_p99": g("p99_ttft_ms"),
            "output_tok_s": g("output_throughput"), "num_prompts": g("num_prompts"), "completed": g("completed"),
            "failed": g("failed"), "duration_s": g("duration"), "gpu": meta.get("gpu"), "date": meta.get("date"),
            "vllm": meta.get("vllm"), "commit": meta.get("commit"), "result_file": result_file}


def latency_row(result: dict, mode: str, batch: int, input_len: int, output_len: int, meta: dict,
                result_file: str) -> dict:
    """The summary of one `vllm bench latency` --output-json file (avg_latency, latencies,
    percentiles keyed by 10 .. 99, in seconds)."""
    pct = {str(k): v for k, v in (result.get("percentiles") or {}).items()}
    return {"client": "vllm bench latency", "mode": mode, "batch_size": batch, "input_len": input_len,
            "output_len": output_len, "latency_s_median": pct.get("50"), "latency_s_p99": pct.get("99"),
            "latency_s_avg": result.get("avg_latency"), "iters": len(result.get("latencies") or []),
            "gpu": meta.get("gpu"), "date": meta.get("date"), "vllm": meta.get("vllm"), "commit": meta.get("commit"),
            "result_file": result_file}


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _f(v, fmt: str = "8.2f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else format("-", f">{fmt.split('.')[0]}")


def table(summary: dict) -> str:
    """The tables printed last: serve rows (TPOT vs stock), latency rows, bad requests, counters."""
    out = []
    rows = summary.get("rows", [])
    base = {(r["input_len"], r["output_len"], r["concurrency"]): r for r in rows if r["mode"] == "disabled"}
    if rows:
        out.append("vllm bench serve (ms; output tokens/s)")
        out.append(f"{'mode':<10} {'in/out':>9} {'conc':>4} {'TPOT med':>8} {'p99':>8} {'ITL med':>8} "
                   f"{'p99':>8} {'TTFT med':>8} {'p99':>8} {'out tok/s':>9} {'TPOT/stock':>10}")
        for r in sorted(rows, key=lambda r: (r["input_len"], r["output_len"], r["concurrency"], r["mode"])):
            b = base.get((r["input_len"], r["output_len"], r["concurrency"]))
            ratio = _ratio(r["tpot_ms_median"], b["tpot_ms_median"]) if b and r["mode"] != "disabled" else None
            out.append(f"{r['mode']:<10} {str(r['input_len']) + '/' + str(r['output_len']):>9} {r['concurrency']:>4} "
                       f"{_f(r['tpot_ms_median'])} {_f(r['tpot_ms_p99'])} {_f(r['itl_ms_median'])} {_f(r['itl_ms_p99'])} "
                       f"{_f(r['ttft_ms_median'])} {_f(r['ttft_ms_p99'])} {_f(r['output_tok_s'], '9.1f')} "
                       f"{_f(ratio, '10.3f')}")
    lrows = summary.get("latency_rows", [])
    lbase = {r["batch_size"]: r for r in lrows if r["mode"] == "disabled"}
    if lrows:
        out.append("vllm bench latency (s a batch)")
        out.append(f"{'mode':<10} {'B':>3} {'in/out':>9} {'p50 s':>8} {'p99 s':>8} {'avg s':>8} "
                   f"{'iters':>5} {'p50/stock':>9}")
        for r in sorted(lrows, key=lambda r: (r["batch_size"], r["mode"])):
            b = lbase.get(r["batch_size"])
            ratio = _ratio(r["latency_s_median"], b["latency_s_median"]) if b and r["mode"] != "disabled" else None
            out.append(f"{r['mode']:<10} {r['batch_size']:>3} {str(r['input_len']) + '/' + str(r['output_len']):>9} "
                       f"{_f(r['latency_s_median'], '8.4f')} {_f(r['latency_s_p99'], '8.4f')} "
                       f"{_f(r['latency_s_avg'], '8.4f')} {r['iters']:>5} {_f(ratio, '9.3f')}")
    cmp = summary.get("bad_requests_compare")
    if cmp:
        same = {True: "yes", False: "NO", None: "-"}[cmp.get("same_as_stock")]
        kept = ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in cmp.get("kept_serving", {}).items())
        answers = "; ".join(f"{c['name']}: " + ", ".join(f"{m} {c[m]['status']} {c[m]['error_type']}"
                                                         for m in cmp.get("kept_serving", {}) if m in c)
                            for c in cmp.get("checks", []))
        out.append(f"bad requests: same answers as stock: {same}; kept serving: {kept}")
        out.append(f"  {answers}")
    for setting, stats in summary.get("counters", {}).items():
        out.append(f"counters {setting}: {json.dumps(stats)[:300]}")
    for key, state in summary.get("phases", {}).items():
        if not state.startswith("done"):
            out.append(f"{key}: {state}")
    for f in summary.get("failures", []):
        out.append(f"FAILED {f['setting']}: {f['error'].splitlines()[0]}")
    return "\n".join(out)


# ---- the runners (child processes) --------------------------------------------------------------


def client_main(runs_path: str, status_path: str) -> int:
    """Runs vLLM's `vllm bench serve` (its argument parser and main function) for each run, in
    this one process."""
    with open(runs_path) as f:
        runs = json.load(f)
    from vllm import platforms

    if platforms.current_platform.is_unspecified():  # as the vllm CLI does for `vllm bench`
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    status: dict = {"runs": []}
    for run in runs:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        entry = {"result_file": run["result_file"]}
        t = time.monotonic()
        try:
            res = bench_main(parser.parse_args(run["argv"]))
            done, failed = res.get("completed") or 0, res.get("failed") or 0
            entry["ok"] = failed == 0 and done == run["num_prompts"] and os.path.isfile(run["result_file"])
            if not entry["ok"]:
                errors = [e for e in res.get("errors") or [] if e][:3]
                entry["error"] = (f"{done} of {run['num_prompts']} requests completed, {failed} failed"
                                  + (f": {errors}" if errors else ""))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the parser's SystemExit too
            entry.update(ok=False, error=f"{type(e).__name__}: {e}")
        entry["seconds"] = round(time.monotonic() - t, 1)
        status["runs"].append(entry)
        _write_json(status_path, status)
        print(f"serve bench client: {os.path.basename(run['result_file'])} "
              f"{'ok' if entry['ok'] else 'FAILED: ' + entry['error']} ({entry['seconds']} s)", flush=True)
    return 0 if all(e["ok"] for e in status["runs"]) else 1


def latency_main(runs_path: str, status_path: str) -> int:
    """Runs vLLM's `vllm bench latency` (its argument parser and main function) for each run, in
    this one process and on one engine (the runs differ only in batch size), then reads the
    worker's counters."""
    t0 = time.monotonic()
    with open(runs_path) as f:
        runs = json.load(f)
    from vllm import LLM
    from vllm.benchmarks import latency
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    status: dict = {"runs": []}
    engine: dict = {}
    original = LLM.__dict__["from_engine_args"].__func__

    def from_engine_args(cls, engine_args):
        if "llm" not in engine:
            t = time.monotonic()
            engine["llm"], engine["args"] = original(cls, engine_args), engine_args
            status["engine_s"] = round(time.monotonic() - t, 1)
            status["ready_s"] = round(time.monotonic() - t0, 1)
        elif engine_args != engine["args"]:
            raise RuntimeError("the latency runs of one process must have the same engine arguments")
        return engine["llm"]

    LLM.from_engine_args = classmethod(from_engine_args)
    for run in runs:
        parser = FlexibleArgumentParser(prog="vllm bench latency")
        latency.add_cli_args(parser)
        entry = {"result_file": run["result_file"]}
        t = time.monotonic()
        try:
            latency.main(parser.parse_args(run["argv"]))
            entry["ok"] = os.path.isfile(run["result_file"])
            if not entry["ok"]:
                entry["error"] = "no result file written"
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            entry.update(ok=False, error=f"{type(e).__name__}: {e}")
        entry["seconds"] = round(time.monotonic() - t, 1)
        status["runs"].append(entry)
        _write_json(status_path, status)
        print(f"serve bench latency: {os.path.basename(run['result_file'])} "
              f"{'ok' if entry['ok'] else 'FAILED: ' + entry['error']} ({entry['seconds']} s)", flush=True)
    if "llm" in engine:
        try:
            status["stats"] = engine["llm"].collective_rpc("opgraft_stats")
        except Exception as e:
            status["stats"] = {"error": f"{type(e).__name__}: {e}"}
    _write_json(status_path, status)
    return 0 if status["runs"] and all(e["ok"] for e in status["runs"]) else 1


# ---- the study ----------------------------------------------------------------------------------

COLD_START_S = 200.0  # a first start-up that compiles (Qwen3-30B-A3B on an H200: 100-170 s measured)
PHASE_OVERHEAD_S = 15.0  # bad requests, counters, the stop, GPU memory coming back


def itl_guess_s(batch: int) -> float:
    """A pessimistic decode step for the budget (Qwen3-30B-A3B on an H200: ~4 ms at batch 1,
    ~9 ms at 8, measured by tools/e2e.py)."""
    return 0.005 + 0.0004 * batch


def client_guess_s(args) -> float:
    """How long one setting's `vllm bench serve` runs take, before any was measured."""
    total = 10.0  # the client process's start-up
    for i, o in args.lengths:
        for c in args.concurrency:
            waves = math.ceil(num_prompts(c, args) / c) + math.ceil(min(c, 8) / c)
            total += waves * (o * itl_guess_s(c) + c * i * 2e-5) + o * itl_guess_s(1)
    return total


def latency_guess_s(args) -> float:
    i, o = args.latency_len
    return sum((args.latency_warmup + args.latency_iters) * (o * itl_guess_s(b) + b * i * 2e-5)
               for b in args.latency_batches)


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def commit_id() -> str:
    if os.environ.get("OPGRAFT_COMMIT"):
        return os.environ["OPGRAFT_COMMIT"]
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def serve_phase(mode: str, args, model_dir: str, out: str, summary: dict, seen: dict, deadline: float,
                save) -> None:
    setting = f"serve:{mode}"
    env = child_env(mode, args)
    port = args.port or free_port()
    cmd = [args.python, "-m", SERVER_MODULE, *serve_argv(args, model_dir, port)]
    log = os.path.join(out, "logs", f"server-{mode}.log")
    commands = summary["commands"].setdefault(setting, {})
    commands["server"] = "vllm " + " ".join(shlex.quote(a) for a in cmd[3:])
    commands["env"] = {k: v for k, v in sorted(env.items()) if k.startswith(("OPGRAFT_", "VLLM_"))}
    server = Server(setting, cmd, env, log, port)
    print(f"serve bench: {setting}: starting the server (log {log})", flush=True)
    server.start()
    problems = []
    try:
        startup = server.wait_healthy(min(args.startup_timeout, max(deadline - time.monotonic(), 30.0)))
        summary["startup_s"][setting] = startup
        seen["startup"].append(startup)
        print(f"serve bench: {setting}: healthy after {startup} s", flush=True)
        runs = []
        for i, o in args.lengths:
            for c in args.concurrency:
                name = f"serve-{mode}-{i}x{o}-c{c}.json"
                runs.append({"argv": bench_serve_argv(args, model_dir, port, mode, i, o, c, os.path.join(out, "vllm"),
                                                      name),
                             "input_len": i, "output_len": o, "concurrency": c, "num_prompts": num_prompts(c, args),
                             "result_file": os.path.join(out, "vllm", name)})
        commands["clients"] = ["vllm bench serve " + " ".join(shlex.quote(a) for a in r["argv"]) for r in runs]
        clog = os.path.join(out, "logs", f"client-{mode}.log")
        guess = seen["client"] or client_guess_s(args)
        t = time.monotonic()
        rc, status = run_child("client", runs, env, args.python, clog,
                               os.path.join(out, "logs", f"client-{mode}.status.json"),
                               min(3 * guess + 120, max(deadline - time.monotonic(), 30.0)))
        seen["client"] = max(seen["client"], time.monotonic() - t)
        for run in runs:
            try:
                with open(run["result_file"]) as f:
                    res = json.load(f)
            except (OSError, ValueError):
                continue
            summary["rows"].append(serve_row(res, mode, run["input_len"], run["output_len"], run["concurrency"],
                                             summary["meta"], os.path.relpath(run["result_file"], out)))
        save()  # the numbers are kept even if an outer time limit ends the rest
        bad = [e for e in (status or {}).get("runs", []) if not e.get("ok")]
        if rc != 0 or status is None or bad or len(status.get("runs", [])) < len(runs):
            why = "; ".join(f"{os.path.basename(e['result_file'])}: {e.get('error')}" for e in bad) or f"exit {rc}"
            problems.append(str(failure(setting, f"vllm bench serve failed ({why})", clog)))
        if server.alive():
            summary["bad_requests"][mode] = bad_requests(server.base, model_dir, args.max_model_len)
            summary["counters"][setting] = worker_stats(server.base)
            if not server.alive():
                problems.append(str(failure(setting, "the server died during the bad requests", log)))
        else:
            problems.append(str(failure(setting, f"the server exited (status {server.proc.returncode}) while the "
                                        "client ran", log)))
    finally:
        summary.setdefault("stops", {})[setting] = server.stop()
        summary["plugin_log"][setting] = plugin_lines(log)
        e2e.wait_gpu_memory_free()
    if problems:
        raise Failure("\n".join(problems))


def latency_phase(mode: str, args, model_dir: str, out: str, summary: dict, seen: dict, deadline: float,
                  save) -> None:
    setting = f"latency:{mode}"
    env = child_env(mode, args)
    i, o = args.latency_len
    runs = []
    for b in args.latency_batches:
        path = os.path.join(out, "vllm", f"latency-{mode}-{i}x{o}-b{b}.json")
        runs.append({"argv": latency_argv(args, model_dir, b, path), "batch_size": b, "result_file": path})
    summary["commands"][setting] = {
        "latency": ["vllm bench latency " + " ".join(shlex.quote(a) for a in r["argv"]) for r in runs],
        "env": {k: v for k, v in sorted(env.items()) if k.startswith(("OPGRAFT_", "VLLM_"))},
        "note": "run in one process on one engine (tools.serve_bench latency)"}
    log = os.path.join(out, "logs", f"latency-{mode}.log")
    print(f"serve bench: {setting}: vllm bench latency, batch sizes {args.latency_batches} (log {log})", flush=True)
    t = time.monotonic()
    rc, status = run_child("latency", runs, env, args.python, log, os.path.join(out, "logs", f"latency-{mode}.status.json"),
                           min(args.startup_timeout + 3 * latency_guess_s(args) + 60,
                               max(deadline - time.monotonic(), 30.0)))
    seen["latency"] = max(seen["latency"], time.monotonic() - t)
    e2e.wait_gpu_memory_free()
    status = status or {}
    if status.get("ready_s") is not None:
        summary["startup_s"][setting] = status["ready_s"]
    summary["counters"][setting] = status.get("stats")
    summary["plugin_log"][setting] = plugin_lines(log)
    for run in runs:
        try:
            with open(run["result_file"]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            continue
        summary["latency_rows"].append(latency_row(res, mode, run["batch_size"], i, o, summary["meta"],
                                                   os.path.relpath(run["result_file"], out)))
    bad = [e for e in status.get("runs", []) if not e.get("ok")]
    if rc != 0 or bad or len(status.get("runs", [])) < len(runs):
        why = "; ".join(f"{os.path.basename(e['result_file'])}: {e.get('error')}" for e in bad) or f"exit {rc}"
        raise failure(setting, f"vllm bench latency failed ({why})", log)


def estimate_s(part: str, index: int, args, seen: dict) -> float:
    """Time a phase needs; the first latency phase needs room for every setting's (one alone
    compares nothing)."""
    # The latest start-up: after the first, the compile cache is warm (the first is the cold one).
    startup = seen["startup"][-1] if seen["startup"] else COLD_START_S
    if part == "serve":
        return startup + (seen["client"] or client_guess_s(args)) + PHASE_OVERHEAD_S
    one = seen["latency"] or (startup + latency_guess_s(args) + PHASE_OVERHEAD_S)
    return one * (len(args.modes) if index == 0 else 1)


def study(args) -> int:
    t0 = time.monotonic()
    deadline = t0 + args.budget_s if args.budget_s > 0 else math.inf
    out = os.path.abspath(args.out_dir)
    for d in ("vllm", "logs"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    model_dir, cfg = prepare_model_dir(args.model_dir, args.preset)
    meta = {"model": args.preset or (cfg.get("architectures") or ["?"])[0], "model_dir": model_dir,
            "gpu": gpu_name(), "vllm": package_version("vllm"), "commit": commit_id(),
            "date": time.strftime("%Y-%m-%d"), "engine_args": engine_argv(args), "init_std": args.init_std,
            "lengths": [list(x) for x in args.lengths], "concurrency": args.concurrency,
            "latency_batches": args.latency_batches, "latency_len": list(args.latency_len),
            "compile_cache": {"mode": args.compile_cache, "root": args.cache_root},
            "budget_s": args.budget_s or None}
    summary = {"meta": meta, "rows": [], "latency_rows": [], "bad_requests": {}, "bad_requests_compare": None,
               "counters": {}, "plugin_log": {}, "startup_s": {}, "phases": {}, "failures": [], "commands": {}}
    path = os.path.join(out, "serve-summary.json")
    seen = {"startup": [], "client": 0.0, "latency": 0.0}
    print(f"serve bench: {meta['model']} in {model_dir}; {meta['gpu'] or 'no GPU found'}, vLLM {meta['vllm']}, "
          f"commit {meta['commit'] or '?'}; results in {out}", flush=True)
    for part in PARTS:
        if part not in args.parts:
            continue
        for index, mode in enumerate(args.modes):
            key = f"{part}:{mode}"
            need, left = estimate_s(part, index, args, seen), deadline - time.monotonic()
            first = summary["phases"].get(f"{part}:{args.modes[0]}", "")
            # The first phase always runs (its start-up timeout is held to the budget); a later one
            # only where its estimate, from what the earlier ones took, still fits. The latency
            # settings run together or not at all: one alone compares nothing.
            if part == "latency" and index > 0 and first.startswith("skipped"):
                summary["phases"][key] = f"skipped with latency:{args.modes[0]} (run them alone with --parts {part})"
                print(f"serve bench: {key}: {summary['phases'][key]}", flush=True)
                continue
            if summary["phases"] and left < need:
                summary["phases"][key] = (f"skipped: needs ~{need:.0f} s, {left:.0f} s of the budget left "
                                          f"(run it alone with --parts {part})")
                print(f"serve bench: {key}: {summary['phases'][key]}", flush=True)
                continue
            t = time.monotonic()
            try:
                (serve_phase if part == "serve" else latency_phase)(mode, args, model_dir, out, summary, seen, deadline,
                                                                    lambda: _write_json(path, summary))
                summary["phases"][key] = f"done in {time.monotonic() - t:.0f} s"
            except Failure as e:
                summary["phases"][key] = "failed"
                summary["failures"].append({"setting": key, "error": str(e)})
                print(f"serve bench: FAILED {e}", flush=True)
            if summary["bad_requests"]:
                summary["bad_requests_compare"] = compare_bad_requests(summary["bad_requests"])
            summary["total_s"] = round(time.monotonic() - t0, 1)
            _write_json(path, summary)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    _write_json(path, summary)
    print(f"serve bench: done in {summary['total_s']} s; summary {path}", flush=True)
    if not args.no_table:
        print(table(summary), flush=True)
    return 1 if summary["failures"] else 0


# ---- command line -------------------------------------------------------------------------------


def _lengths(text: str) -> list[tuple[int, int]]:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"(\d+)[x/](\d+)", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 2:
            raise argparse.ArgumentTypeError(f"lengths look like 128x256 (input >= 1, output >= 2); got {part!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise argparse.ArgumentTypeError("no lengths given")
    return out


def _one_length(text: str) -> tuple[int, int]:
    vals = _lengths(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"one length, like 128x256; got {text!r}")
    return vals[0]


def _choices(allowed: tuple):
    def parse(text: str) -> list[str]:
        vals = [v.strip() for v in text.split(",") if v.strip()]
        if not vals or any(v not in allowed for v in vals) or len(set(vals)) != len(vals):
            raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(allowed)}; got {text!r}")
        return vals

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.serve_bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_opts(p):
        p.add_argument("--preset", default=None, help=f"write this architecture's config.json ({', '.join(e2e.MODEL_CONFIGS)})")
        p.add_argument("--model-dir", default=None, help="the model folder (with --preset: where to write it; "
                       "default /tmp/opgraft-serve-<preset>-<config hash>)")

    s = sub.add_parser("study", help="every setting: servers, vllm bench serve, bad requests, bench latency")
    model_opts(s)
    s.add_argument("--out-dir", required=True)
    s.add_argument("--parts", type=_choices(PARTS), default=list(PARTS))
    s.add_argument("--modes", type=_choices(MODES), default=list(MODES))
    s.add_argument("--lengths", type=_lengths, default=[(128, 256)], help="input x output tokens (default 128x256)")
    s.add_argument("--long", action="store_true", help="add 2048x256 to --lengths")
    s.add_argument("--concurrency", type=e2e._ints, default=[1, 8, 32])
    s.add_argument("--min-prompts", type=int, default=16, help="requests a run at least (default 16)")
    s.add_argument("--waves", type=int, default=2, help="requests a run at least this many times its concurrency")
    s.add_argument("--latency-batches", type=e2e._ints, default=[1, 8])
    s.add_argument("--latency-len", type=_one_length, default=(128, 256))
    s.add_argument("--latency-iters", type=int, default=8)
    s.add_argument("--latency-warmup", type=int, default=2)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="vLLM's own default for `vllm serve` on a GPU of this class (default 8192)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--init-std", type=float, default=0.02,
                   help="re-initialise the dummy weights as N(0, std^2) after loading (0: keep vLLM's)")
    s.add_argument("--compile-cache", choices=("shared", "separate"), default="shared")
    s.add_argument("--cache-root", default="/tmp/opgraft-serve-vllm-cache", help="VLLM_CACHE_ROOT")
    s.add_argument("--startup-timeout", type=float, default=420.0)
    s.add_argument("--budget-s", type=float, default=0.0, help="skip the phases that no longer fit (0: no limit)")
    s.add_argument("--port", type=int, default=0, help="the servers' port (default: a free one)")
    s.add_argument("--python", default=sys.executable, help="the interpreter of the servers and clients")
    s.add_argument("--no-table", action="store_true", help="do not print the tables at the end (see `table`)")

    p = sub.add_parser("prepare", help="write the model folder (config.json, tokenizer) only")
    model_opts(p)
    p.add_argument("--rebuild-tokenizer", action="store_true")
    t = sub.add_parser("table", help="print a study's tables again")
    t.add_argument("out_dir")
    for name in ("client", "latency"):
        r = sub.add_parser(name, help=f"(internal) the {name} runner of a study")
        r.add_argument("runs")
        r.add_argument("status")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.cmd == "client":
        return client_main(args.runs, args.status)
    if args.cmd == "latency":
        return latency_main(args.runs, args.status)
    if args.cmd == "table":
        path = os.path.join(args.out_dir, "serve-summary.json")
        if not os.path.isfile(path):
            ap.error(f"no serve-summary.json in {args.out_dir}")
        with open(path) as f:
            print(table(json.load(f)))
        return 0
    if args.cmd == "prepare":
        if not args.preset and not args.model_dir:
            ap.error("give --preset or --model-dir")
        model_dir, cfg = prepare_model_dir(args.model_dir, args.preset, args.rebuild_tokenizer)
        print(model_dir)
        return 0
    if args.preset is None and args.model_dir is None:
        args.preset = "Qwen3-30B-A3B"
    if args.long and (2048, 256) not in args.lengths:
        args.lengths.append((2048, 256))
    longest = max(i + o for i, o in args.lengths + [args.latency_len])
    if args.max_model_len < longest:
        ap.error(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest} tokens)")
    if args.min_prompts < 1 or args.waves < 1 or args.latency_iters < 1 or args.latency_warmup < 0:
        ap.error("--min-prompts, --waves and --latency-iters must be >= 1, --latency-warmup >= 0")
    if not 0 <= args.init_std < 1 or not 0 < args.gpu_memory_utilization <= 1:
        ap.error("--init-std must be in [0, 1) and --gpu-memory-utilization in (0, 1]")
    return study(args)


if __name__ == "__main__":
    sys.exit(main())
