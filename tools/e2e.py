"""End-to-end decode study in a real vLLM: stock vLLM against opgraft pass-through and opgraft's
kernel, same model, same prompts, one process per setting.

    python -m tools.e2e study --model Qwen3-30B-A3B --out-dir DIR
        [--modes disabled,opgraft,passthrough] [--batches 1,8,32] [--input-len 128]
        [--output-len 256] [--reps 5] [--mode-timeout 600] [--tp 2 [--expert-parallel]]
        [--profile-steps 32] [--init-std 0.02] [--moe-backend auto] [--env MODE:KEY=VALUE ...]
        [--mode-moe-backend MODE:BACKEND ...]
    python -m tools.e2e run --mode opgraft --model Qwen3-30B-A3B --json FILE   (one setting)
    python -m tools.e2e compare DIR                                            (table again)

Settings ("modes"): `disabled` runs with OPGRAFT_DISABLE=1 (the plugin patches nothing: stock
vLLM); `passthrough` installs the seams but hands every call back (every op's variant passthrough);
`opgraft` takes the calls our guards accept, in every op (the default variant); `disabled-again` is stock
vLLM a second time, so the parity table shows how far stock agrees with itself (with random
weights greedy margins are small, and vLLM's batched decode is not run-to-run deterministic:
a difference between stock and opgraft means little where stock differs from stock as much), and
`opgraft-again` is opgraft a second time: host-bound times (the one-token run) differ by 20-40%
between two processes of the same setting on a shared host, which only repeats show. Any
other label after a setting's name runs that setting too, with the environment --env gives it
(opgraft-pairoff with MODE:OPGRAFT_ATTENTION_PROLOGUE=0: a switch beside opgraft in one study);
the comparison then sets each labelled setting against the one it labels too (its ITL ratio,
parity and profile difference: what its switches alone change). Each runs in its own
process because the plugin is installed when vLLM starts and CUDA graphs fix the kernels at
capture time.

The model is a public architecture (its config.json values, below, or a path to a config.json)
with random weights (load_format="dummy": no download) and token-id prompts
(skip_tokenizer_init=True). torch.compile and CUDA graphs stay on, as users run vLLM. vLLM's
dummy weights are uniform in +-1e-3, norms included, and every layer gets the same values: the
MoE output is then too small to move a logit, so any kernel would "agree" with any other. The
study therefore re-initializes the weights in the worker after start-up (--init-std, default
0.02: matrices ~N(0, std^2) seeded per parameter name, norm weights 1, biases 0; same values in
every setting), so the parity check can see a wrong or inexact MoE output. --init-std 0 keeps
vLLM's values. The model folder's path depends only on the config, so vLLM's torch.compile cache
is shared by the settings.

Timing: for each batch size B, `generate(B prompts, max_tokens=1)` and `generate(B prompts,
max_tokens=N)` are timed back to back (greedy, ignore_eos); the difference is N-1 decode steps, so
ITL = (t_N - t_1) / (N - 1) and decode tokens/s = B (N-1) / (t_N - t_1), with the fastest t_1 of the
reps (a stalled one-token run would make a rep's difference meaningless). Repeated --reps times;
medians and spread are reported. Before a batch size's reps the study waits (up to a minute) for a
window in which the host keeps under two cores busy, and it records the busy cores beside each rep
(host_quiet, host_busy_cores): what the host did while a rep ran slow. A separate greedy run with
logprobs gives the token ids and the chosen tokens' logprobs for the parity check between settings.
With --profile-steps N, a torch profiler in the worker records the GPU's kernels during a prefill
alone and during the same prefill plus N decode steps; the difference is the GPU time of one decode
step, kernel by kernel (CUDA-graph replays included), to set against the ITL, with each kernel's
exposed time (the part of its span that no kernel started before it covers: under programmatic
dependent launch a kernel's own span includes its wait), whose sum is the GPU's busy span a step,
and both summed by op (`ops`: the kernel's name decides, OP_PATTERNS);
the prefill's own kernels are kept too, to set against the one-token run (whose phases, from vLLM's
per-request stats, are kept for every rep: front end, queue, the engine core's prefill step), and
with --profile-host the worker's host ops during that prefill (self CPU time, op by op), for a
one-token run that is longer than its GPU time. vLLM's engine core steps on its own while the front
end adds a batch's requests, so it may take the prompts in two steps, a forward more: each one-token
run and each profiled run records how many steps took its prompts (`prefill_steps`, with the
requests of each step). The profiled runs hold the engine core (a collective_rpc that sleeps in the
worker) while the front end adds the batch, so that it takes every prompt in its first step; the
pair is taken again (up to three times) until both runs took them in the same steps, and the
printout says where they differ.
The MoE counters of the engine's worker process (opgraft.stats()) are read through vLLM's
collective_rpc.

Each setting's torch.compile times, from vLLM's own log lines (each compile range compiled, or
loaded from vLLM's compile cache, and the total), go into its result and the summary (`compile`),
beside its start-up time; so do the kernel JIT compiles vLLM's monitor logs after its warm-up
(`jit_events`, each one logged where vLLM can), by batch size for those inside the timed runs: a
stalled rep with one there was a kernel compiling, not the setting's speed.

--cold-caches gives each setting empty JIT and compile caches of its own (vLLM's, Inductor's,
Triton's, DeepGEMM's and opgraft's, removed after it), so that start-up times and first reps
compare: by default the settings share the machine's caches, and a later setting finds the kernels
an earlier one compiled (bench/NOTES.md v52: stock FP8 after opgraft started in 52 s against
opgraft's 188, with no Triton or DeepGEMM compile of its own).

--mode-timeout bounds one setting, start-up included: with empty torch.compile and Triton caches
(a fresh machine) Qwen3-30B-A3B-FP8 took 200 s to start and 332 s in all at batch 8 with 5 reps
on an H200 (bench/NOTES.md v38); a later setting with the caches filled took 113 s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("disabled", "passthrough", "opgraft", "disabled-again", "opgraft-again")
# A setting's name: one of the three settings, alone or with a label (disabled-again, opgraft-again,
# opgraft-prologue): the same setting in a process of its own, with its own --env.
_MODE_NAME = re.compile(r"(disabled|passthrough|opgraft)(-[a-z0-9]+)*")


def base_mode(mode: str) -> str | None:
    """The setting a mode name runs (disabled, passthrough or opgraft), None for another name."""
    m = _MODE_NAME.fullmatch(mode)
    return m.group(1) if m else None

# Public config.json values (Hugging Face model cards: Qwen/Qwen3-30B-A3B,
# mistralai/Mixtral-8x7B-v0.1). Only the architecture matters: weights are random.
MODEL_CONFIGS = {
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 48, "initializer_range": 0.02,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "use_cache": True,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    # Qwen/Qwen3-30B-A3B-FP8: the same architecture with 128x128 block-FP8 weights (its config.json's
    # quantization_config); dynamic per-token-group activation scales.
    "Qwen3-30B-A3B-FP8": None,
    "Mixtral-8x7B": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "sliding_window": None, "tie_word_embeddings": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "output_router_logits": False, "router_aux_loss_coef": 0.02,
        "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}


# deepseek-ai/DeepSeek-V3 (its config.json): MLA attention (stays vLLM's), 256 routed experts of
# which 8 per token, block-FP8 weights. Needs eight H200s (tensor_parallel_size=8).
MODEL_CONFIGS["DeepSeek-V3"] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True, "bos_token_id": 0,
    "eos_token_id": 1, "torch_dtype": "bfloat16", "ep_size": 1, "aux_loss_alpha": 0.001, "seq_aux": True,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}

MODEL_CONFIGS["Qwen3-30B-A3B-FP8"] = dict(
    MODEL_CONFIGS["Qwen3-30B-A3B"],
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]})


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]  # an empty item ("1,,2") is an error too
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


_MODES_SAID = f"{', '.join(MODES)}, or disabled, passthrough or opgraft with a label (opgraft-prologue)"


def _mode(text: str) -> str:
    if base_mode(text) is None:
        raise argparse.ArgumentTypeError(f"modes are {_MODES_SAID}; got {text!r}")
    return text


def _modes(text: str) -> list[str]:
    vals = [m.strip() for m in text.split(",") if m.strip()]
    if not vals or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"modes are {_MODES_SAID}, each once; got {text!r}")
    return [_mode(m) for m in vals]


_VARIANT_KEYS = ("OPGRAFT_MOE_EXPERTS", "OPGRAFT_ATTENTION_VARIANT", "OPGRAFT_LINEAR_VARIANT")
_MODE_KEYS = ("OPGRAFT_DISABLE", *_VARIANT_KEYS)  # what a setting sets itself


def _setting_env(text: str) -> tuple[str, str, str]:
    """MODE:KEY=VALUE, an environment variable for one setting only (an A/B of a tunable)."""
    mode, sep, kv = text.partition(":")
    key, eq, value = kv.partition("=")
    if not sep or not eq or base_mode(mode) is None or not key or not (key[0].isalpha() or key[0] == "_") \
            or not all(ch.isalnum() or ch == "_" for ch in key):
        raise argparse.ArgumentTypeError(f"--env takes MODE:KEY=VALUE with MODE one of {_MODES_SAID}; got {text!r}")
    if key in _MODE_KEYS:
        raise argparse.ArgumentTypeError(f"{key} is what the setting itself decides; got {text!r}")
    return mode, key, value


def _setting_backend(text: str) -> tuple[str, str]:
    """MODE:BACKEND, vLLM's moe_backend for one setting only (stock on another experts backend beside
    stock on vLLM's choice, in one study)."""
    mode, sep, backend = text.partition(":")
    if not sep or base_mode(mode) is None or not backend or not all(ch.isalnum() or ch == "_" for ch in backend):
        raise argparse.ArgumentTypeError(
            f"--mode-moe-backend takes MODE:BACKEND with MODE one of {_MODES_SAID}; got {text!r}")
    return mode, backend


def model_config(model: str) -> dict:
    """The config.json dict of a built-in architecture, or of a config.json path (file or dir)."""
    if model in MODEL_CONFIGS:
        return dict(MODEL_CONFIGS[model])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise SystemExit(f"opgraft e2e: {model!r} is neither a built-in architecture "
                         f"({', '.join(MODEL_CONFIGS)}) nor a config.json")
    with open(path, "rb") as f:
        data = f.read(1 << 24)
    try:
        cfg = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SystemExit(f"opgraft e2e: {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})")
    except json.JSONDecodeError as e:
        raise SystemExit(f"opgraft e2e: {path}: not JSON ({e})")
    if not isinstance(cfg, dict) or "architectures" not in cfg:
        raise SystemExit(f"opgraft e2e: {path}: no 'architectures' field")
    return cfg


def model_dir_for(cfg: dict) -> str:
    """A folder whose path depends only on the config: vLLM keys its compile cache on it."""
    import hashlib

    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"opgraft-e2e-{key}")


def write_model_dir(cfg: dict, root: str) -> str:
    d = os.path.join(root, "model")
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".config.json.{os.getpid()}")  # two studies may start at once
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, os.path.join(d, "config.json"))
    return d


def _multicast_off(env) -> bool:
    """The host turns NVLink multicast off for NCCL, and wants it off everywhere."""
    return env.get("NCCL_NVLS_ENABLE") == "0"


def mode_env(mode: str, base: dict | None = None) -> dict:
    """The environment a setting runs under."""
    env = dict(os.environ if base is None else base)
    for k in _MODE_KEYS:
        env.pop(k, None)
    base = base_mode(mode)
    if base == "disabled":
        env["OPGRAFT_DISABLE"] = "1"
    elif base in ("passthrough", "opgraft"):  # every op's seam; each takes calls, or none
        for k in _VARIANT_KEYS:
            env[k] = base
    else:
        raise ValueError(f"unknown mode {mode!r}")
    # collective_rpc sends our stats function to the worker by pickling it.
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # Greedy decoding never uses FlashInfer's top-k/top-p sampler, but vLLM warms it up at start,
    # which JIT-compiles it (minutes on a fresh machine, measured on an H200). Same for every
    # setting; set VLLM_USE_FLASHINFER_SAMPLER=1 to keep it.
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # Block-FP8 checkpoints: vLLM JIT-compiles DeepGEMM for every GEMM shape at start (253 shapes,
    # past 225 s for Qwen3-30B-A3B-FP8 on an H200). The timed runs come after warm-up generates of
    # every batch size, which compile what they use. Same for every setting.
    env.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    # A host that turns NVLink multicast off for NCCL (NCCL_NVLS_ENABLE=0) wants it off everywhere:
    # vLLM's symmetric-memory all-reduce (tensor parallelism) would use it, so keep that off too
    # (vLLM's custom all-reduce and NCCL remain). Same for every setting.
    if _multicast_off(env):
        env.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    return env


def one_token_phases(outs, t1_s: float) -> dict:
    """Where a one-token run's time went, from vLLM's per-request stats (RequestOutput.metrics,
    kept when log stats are on), in ms, the slowest request's: `first_token` (arrival to first
    token, as the front end sees it), `queue` (queued to scheduled) and `engine` (scheduled to
    first token: the prefill step in the engine core, timestamps of its own clock), and `outside`
    (the generate call less first_token: input processing and output handling). Missing stats
    give {}."""
    ms = {}
    for o in outs:
        m = getattr(o, "metrics", None)
        if m is None or not getattr(m, "first_token_ts", 0):
            return {}
        got = {"first_token": m.first_token_latency * 1e3, "queue": (m.scheduled_ts - m.queued_ts) * 1e3,
               "engine": (m.first_token_ts - m.scheduled_ts) * 1e3}
        for k, v in got.items():
            ms[k] = max(ms.get(k, v), v)
    if not ms:
        return {}
    ms["outside"] = t1_s * 1e3 - ms["first_token"]
    return {k: round(v, 2) for k, v in ms.items()}


def prefill_split(outs) -> list[int] | None:
    """How many of a batch's requests each engine step first scheduled, in step order (vLLM stamps
    every request a scheduler step takes with that step's time): more than one step when the engine
    core began stepping before the front end had added every request. None without vLLM's
    per-request stats."""
    stamps = []
    for o in outs:
        t = getattr(getattr(o, "metrics", None), "scheduled_ts", 0)
        if not t:
            return None
        stamps.append(t)
    return [stamps.count(t) for t in sorted(set(stamps))] or None


def prefill_steps(outs) -> int | None:
    """In how many engine steps a batch's prompts were first scheduled (see prefill_split)."""
    split = prefill_split(outs)
    return len(split) if split else None


PROFILE_TRIES = 3


def profiled_pair(profile_run, steps: int, tries: int = PROFILE_TRIES):
    """The profiled prefill alone and the profiled run with `steps` decode steps, taken again (up to
    `tries` times) until both took the batch's prompts in the same engine steps: a decode step's
    kernels are their difference, off by a forward where the splits differ (v52's batch-8 bf16
    pairs, bench/NOTES.md v53). profile_run(max_tokens) -> (the workers' profiles, prefill_split).
    Returns ([profiles alone, profiles with decode], [split alone, split with decode], tries)."""
    for t in range(1, tries + 1):
        runs, splits = zip(*(profile_run(m) for m in (1, steps + 1)))
        if splits[0] == splits[1] or None in splits:
            break
    return list(runs), list(splits), t


QUIET_LIMIT_S = 60.0  # the longest wait for a quiet host before a batch size's timed reps
QUIET_CORES = 2.0  # busy cores below which the host counts as quiet (a guess: host_quiet keeps what was seen)
HOLD_S = 0.5  # long enough for the front end to add a batch of token prompts (a few ms for 64)
HOLD_GRACE_S = 60.0  # a hold that has not returned this long after its end is left behind


def _worker_hold(worker=None, seconds: float = HOLD_S) -> int:
    """Runs in vLLM's worker process (collective_rpc): keeps the engine core, which waits for the
    result, from stepping for `seconds`."""
    time.sleep(seconds)
    return os.getpid()


def held_generate(llm, requests, params, hold_s: float = HOLD_S):
    """llm.generate with the engine core held in a collective_rpc until the front end has queued
    every request: the core then takes the whole batch into its first step (it drains its input
    queue before it schedules), so a batch's prompts go in one engine step, as they do not when the
    core steps while the front end is still adding them (v54: batch 8 in two steps in nearly every
    run). The hold's time falls before the prefill; use it where the steps' work matters, not for a
    timed run."""
    import threading

    err: list = []

    def hold():
        try:
            llm.collective_rpc(_worker_hold, args=(hold_s,))
        except Exception as e:  # the split check still sees a batch that went in several steps
            err.append(e)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    time.sleep(min(0.05, hold_s / 4))  # the hold reaches the core before the first request does
    outs = llm.generate(requests, params, use_tqdm=False)
    t.join(hold_s + HOLD_GRACE_S)  # a hold that never returns must not stop the study
    if t.is_alive():
        err.append(TimeoutError(f"the hold had not returned {HOLD_GRACE_S:g} s after its end"))
    if err:
        print(f"opgraft e2e: the engine core was not held ({type(err[0]).__name__}: {err[0]})", flush=True)
    return outs


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


# The graph rewrites a worker reports: its key, the seam module and counter, the table's name.
_REWRITES = (("norm_fusion_fused", "opgraft.vllm.norm_seam", "fused_total", "norm+linear"),
             ("norm_fusion_moe_fused", "opgraft.vllm.norm_seam", "fused_moe_total", "norm+MoE"),
             ("attention_prologue_fused", "opgraft.vllm.rope_seam", "fused_total", "attention prologue"),
             ("qk_epilogue_fused", "opgraft.vllm.rope_seam", "qk_fused_total", "q/k epilogue"))


def _worker_stats(worker=None) -> dict:
    """Runs in vLLM's worker process (collective_rpc): the plugin's state there."""
    out = {"pid": os.getpid()}
    try:
        from opgraft import vllm as plugin

        out["plugin"] = plugin.summary()
    except Exception as e:  # plugin not importable there
        out["plugin"] = f"not importable ({type(e).__name__}: {e})"
    dispatch = sys.modules.get("opgraft.dispatch")  # absent: the MoE seam never ran here
    try:
        # {op: {taken, delegated, ...}} of every op that saw a call; None where the seams never ran
        ops = dispatch.stats() if dispatch else {}
        out.update({op: ops.get(op) for op in ("moe", "attention", "linear")}, **ops)
    except Exception as e:
        out["moe_error"] = f"{type(e).__name__}: {e}"
    # what the graph rewrites did in this process (None: the seam never loaded here)
    for key, name, total, _ in _REWRITES:
        seam = sys.modules.get(name)
        out[key] = getattr(seam, total)() if seam is not None else None
    return out


FP8_MAX = 448.0  # the largest float8_e4m3fn value


def _fp8_fill(w, scale, std: float, gen) -> None:
    """Fills an FP8 weight with N(0, std^2) values quantized as an FP8 checkpoint is: per block
    (the scale tensor's shape over the weight's last two dims gives the block size; one scale per
    matrix for per-tensor scales), scale = amax / 448, w = fp8(x / scale). In place, a few leading
    slices (experts) at a time."""
    import torch
    import torch.nn.functional as F

    rows, cols = w.shape[-2], w.shape[-1]
    w3 = w.view(-1, rows, cols)
    n = w3.shape[0]
    per_tensor = scale.numel() == n
    s3 = scale.view(n, 1, 1) if per_tensor else scale.view(-1, scale.shape[-2], scale.shape[-1])
    nr, nc = s3.shape[1], s3.shape[2]
    br, bc = -(-rows // nr), -(-cols // nc)
    step = max(1, (256 << 20) // (rows * cols * 4))
    for e0 in range(0, n, step):
        e1 = min(n, e0 + step)
        x = torch.empty((e1 - e0, rows, cols), dtype=torch.float32, device=w.device).normal_(0.0, std, generator=gen)
        if per_tensor:
            sc = (x.abs().amax(dim=(1, 2)) / FP8_MAX).clamp_min(1e-12)
            w3[e0:e1].copy_((x / sc[:, None, None]).to(w.dtype))
            s3[e0:e1, 0, 0] = sc
            continue
        xp = F.pad(x, (0, nc * bc - cols, 0, nr * br - rows))  # zeros do not change an amax
        sc = (xp.view(e1 - e0, nr, br, nc, bc).abs().amax(dim=(2, 4)) / FP8_MAX).clamp_min(1e-12)
        q = xp / sc[:, :, None, :, None].expand(-1, -1, br, -1, bc).reshape(e1 - e0, nr * br, nc * bc)
        w3[e0:e1].copy_(q[:, :rows, :cols].to(w.dtype))
        s3[e0:e1] = sc


def _worker_reinit(worker=None, std: float = 0.02) -> dict:
    """Runs in vLLM's worker process (collective_rpc): replaces the dummy weights, in place (CUDA
    graphs keep their pointers), by N(0, std^2) seeded per parameter name (the same values in
    every run and setting), norm weights by 1 and biases by 0. FP8 weights get those values
    quantized with their own scales (`<name>_scale_inv` for block scales, `<name>_scale` per
    tensor), as an FP8 checkpoint would hold them."""
    import zlib

    import torch

    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    params = dict(model.named_parameters())
    fp8 = {getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e4m3fnuz", None)} - {None}
    scales = set()
    for name, p in params.items():
        if p.dtype in fp8:
            for sname in (name + "_scale_inv", name + "_scale"):
                if sname in params:
                    scales.add(sname)
    n = nbytes = 0
    with torch.no_grad():
        for name, p in params.items():
            if p.device.type == "meta" or name in scales:
                continue
            g = torch.Generator(device=p.device)
            g.manual_seed(zlib.crc32(name.encode()))
            if p.dtype in fp8:
                sname = next((s for s in (name + "_scale_inv", name + "_scale") if s in params), None)
                if sname is None:
                    continue  # an FP8 tensor without a scale we know: leave vLLM's values
                _fp8_fill(p.data, params[sname].data, std, g)
            elif not torch.is_floating_point(p):
                continue
            else:
                module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # "input_layernorm", "q_norm", ...
                if "norm" in module:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=g)
            n += 1
            nbytes += p.numel() * p.element_size()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"pid": os.getpid(), "params": n, "bytes": nbytes, "std": std}


_PROFILER = None  # the worker process's running torch profiler (_worker_profile)


def _worker_profile(worker=None, action: str = "start", host: bool = False) -> dict:
    """Runs in vLLM's worker process (collective_rpc). "start" starts a CUDA-activity torch
    profiler (host: the CPU's too); "stop" stops it and returns {kernel name: [launches, self
    device µs]} of everything the GPU ran meanwhile, kernels inside CUDA-graph replays included,
    and for a profiler that recorded the CPU, {host op: [calls, self CPU µs, CPU µs]}."""
    # collective_rpc pickles this function by value when the study runs as __main__, and its
    # globals with it: the running profiler lives in the importable module instead.
    import tools.e2e as this

    out: dict = {"pid": os.getpid()}
    if action == "stop" and this._PROFILER is None:
        out["error"] = "profiler not started"
        return out
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if action == "start":
            if this._PROFILER is None:
                acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
                this._PROFILER = profile(activities=acts)
                this._PROFILER.start()
            return out
        prof, this._PROFILER = this._PROFILER, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        from opgraft.bench import profiler_exposed, profiler_host_ops, profiler_kernels

        out["kernels"] = short_names(profiler_kernels(prof))
        try:  # the kernels' spans, a second reading of the same profile: its failure keeps the table
            out["exposed"] = short_names({k: [us] for k, us in profiler_exposed(prof).items()})
        except Exception as e:
            out["exposed_error"] = f"{type(e).__name__}: {e}"
        if ProfilerActivity.CPU in prof.activities:
            out["host"] = short_names(profiler_host_ops(prof))
    except Exception as e:  # a profiler that cannot run must not end the study
        this._PROFILER = None
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def short_names(table: dict, width: int = 160) -> dict:
    """{name cut to `width` characters: [counts and times summed]}: names that share their first
    `width` characters (FA3's prefill and decode kernels, which differ only in late template
    arguments) are added up, not one kept, so profile_rows' prefill subtraction stays right."""
    out: dict = {}
    for name, vals in table.items():
        key = name[:width]
        prev = out.get(key)
        out[key] = list(vals) if prev is None else [a + b for a, b in zip(prev, vals)]
    return out


RUNNER_SCOPE = "gpu_model_runner: "  # vLLM's record_function scopes of a model-runner step


# Which op of a decode step a kernel serves, by its name: the first pattern that matches. Ours and
# vLLM's (FA3, cuBLAS's nvjet GEMMs and split-K, the Triton / CUDA MoE kernels, Inductor's norms).
# Inductor names its other fused kernels only by number (stock's q/k norm and rotary among them):
# those count as "inductor", not guessed.
OP_PATTERNS = (
    ("norms", re.compile(r"rms_norm")),  # before "moe": Inductor's add + norm before it is "..._moe_forward_0"
    ("attention", re.compile(r"flash::|FlashAttn|reshape_and_cache|^attention_|prepare_varlen_num_blocks")),
    ("moe", re.compile(r"moe|topkGating|act_and_mul|count_and_sort_expert")),
    ("projections", re.compile(r"^linear_|nvjet|splitKreduce|gemm|gemv|cutlass")),
    ("inductor", re.compile(r"^triton_(poi|red|per)_fused_\d+$")),
)


def op_of(kernel: str) -> str:
    return next((op for op, pat in OP_PATTERNS if pat.search(kernel)), "other")


def op_times(rows: list) -> dict:
    """{op: {"us": device time a step, "exposed": its exposed time where every kernel has one}}
    over profile_rows' kernel rows. Our qkv projection with the norm folded in counts as a
    projection: compare projections + norms where the norm fusion is on."""
    out: dict = {}
    for r in rows:
        o = out.setdefault(op_of(r["kernel"]), {"us": 0.0, "exposed": 0.0})
        o["us"] += r["us_per_step"]
        if o["exposed"] is not None:
            o["exposed"] = None if "exposed_us_per_step" not in r else o["exposed"] + r["exposed_us_per_step"]
    return {op: {k: (None if v is None else round(v, 1)) for k, v in o.items()} for op, o in sorted(out.items())}


def profile_ops(prof: dict) -> dict:
    """A profile's op_times: stored since the sums were added, else from its top kernels."""
    return prof.get("ops") or op_times(prof["kernels"])


def op_ratios(base: dict, ops: dict) -> dict:
    """{op: ops' time over base's} for the ops base has (op_times results): exposed time where
    both have it, else device time; an op that `ops` no longer runs is 0."""
    out = {}
    for op, b in base.items():
        o = ops.get(op, {"us": 0.0, "exposed": 0.0})
        key = "exposed" if b["exposed"] is not None and o["exposed"] is not None else "us"
        if b[key]:
            out[op] = round(o[key] / b[key], 3)
    return out


def profile_rows(prefill: dict, full: dict, steps: int, top: int = 60) -> dict:
    """Per decode step: the kernels of `full` (prefill + `steps` decode steps) minus those of
    `prefill` (the same prefill alone), by device time, with the step's total GPU time."""
    if "error" in prefill or "error" in full:
        return {"error": prefill.get("error") or full.get("error")}
    rows = []
    exposed = {}  # per step: what each kernel adds to the GPU's busy span (profiler_exposed)
    for name, (us,) in full.get("exposed", {}).items():
        exposed[name] = (us - prefill.get("exposed", {}).get(name, (0.0,))[0]) / steps
    for name, (n, us) in full.get("kernels", {}).items():
        n0, us0 = prefill.get("kernels", {}).get(name, (0, 0.0))
        if us - us0 > 0:
            rows.append({"kernel": name, "launches_per_step": round((n - n0) / steps, 2),
                         "us_per_step": round((us - us0) / steps, 2)})
            if name in exposed:
                rows[-1]["exposed_us_per_step"] = round(exposed[name], 2)
    rows.sort(key=lambda r: -r["us_per_step"])
    pre = [{"kernel": name, "launches_per_step": n, "us_per_step": round(us, 2)}
           for name, (n, us) in prefill.get("kernels", {}).items()]
    pre.sort(key=lambda r: -r["us_per_step"])
    # The prefill alone as a "step" of its own, in the same form (profile_diff compares it too).
    prefill_step = {"steps": 1, "gpu_us_per_step": round(sum(r["us_per_step"] for r in pre), 1),
                    "kernels_per_step": sum(r["launches_per_step"] for r in pre), "kernels": pre[:top]}
    if "host" in prefill:  # the worker's host ops during the prefill alone (--profile-host)
        ops = sorted(({"op": k, "calls": n, "us": round(us, 1), "total_us": round(tot, 1)}
                      for k, (n, us, tot) in prefill["host"].items()), key=lambda r: -r["us"])
        # vLLM's model-runner scopes (VLLM_CUSTOM_SCOPES_FOR_PROFILING): the wall time of each phase
        scopes = {r["op"]: r["total_us"] for r in ops if r["op"].startswith(RUNNER_SCOPE)}
        prefill_step["host"] = {"us": round(sum(r["us"] for r in ops), 1), "calls": sum(r["calls"] for r in ops),
                                "ops": ops[:top], "scopes": scopes}
    out = {"steps": steps, "gpu_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
           "kernels_per_step": round(sum(r["launches_per_step"] for r in rows), 1),
           "ops": op_times(rows), "kernels": rows[:top], "prefill": prefill_step}
    if exposed:  # the GPU's busy span a step: the kernels' sum less their overlaps
        out["busy_us_per_step"] = round(sum(exposed.values()), 1)
    return out


def host_diff(base: dict, other: dict, top: int = 10) -> dict:
    """Op by op, the host (self CPU) time `other`'s prefill spends beyond `base`'s (the "host"
    entries of profile_rows' prefills): the ops that changed most, either way, and the totals."""
    b = {r["op"]: r for r in base.get("ops", [])}
    o = {r["op"]: r for r in other.get("ops", [])}
    none = {"us": 0.0, "calls": 0}
    rows = [{"op": k, "base_us": b.get(k, none)["us"], "us": o.get(k, none)["us"],
             "delta_us": round(o.get(k, none)["us"] - b.get(k, none)["us"], 1),
             "base_calls": b.get(k, none)["calls"], "calls": o.get(k, none)["calls"]} for k in set(b) | set(o)]
    rows.sort(key=lambda r: -abs(r["delta_us"]))
    bs, ts = base.get("scopes", {}), other.get("scopes", {})
    scopes = [{"scope": k, "base_us": bs.get(k, 0.0), "us": ts.get(k, 0.0),
               "delta_us": round(ts.get(k, 0.0) - bs.get(k, 0.0), 1)} for k in sorted(set(bs) | set(ts))]
    return {"us_delta": round(other.get("us", 0.0) - base.get("us", 0.0), 1),
            "calls_delta": other.get("calls", 0) - base.get("calls", 0), "ops": rows[:top], "scopes": scopes}


def profile_diff(base: dict, other: dict, top: int = 10) -> dict:
    """Kernel by kernel, what `other` spends per decode step beyond `base` (profile_rows results):
    the kernels whose time changed most, either way, and the totals."""
    b = {k["kernel"]: k for k in base.get("kernels", [])}
    o = {k["kernel"]: k for k in other.get("kernels", [])}
    none = {"us_per_step": 0.0, "launches_per_step": 0.0}
    rows = []
    for name in set(b) | set(o):
        bk, ok = b.get(name, none), o.get(name, none)
        rows.append({"kernel": name, "base_us": bk["us_per_step"], "us": ok["us_per_step"],
                     "delta_us": round(ok["us_per_step"] - bk["us_per_step"], 2),
                     "base_launches": bk["launches_per_step"], "launches": ok["launches_per_step"]})
    rows.sort(key=lambda r: -abs(r["delta_us"]))
    return {"gpu_delta_us": round(other.get("gpu_us_per_step", 0.0) - base.get("gpu_us_per_step", 0.0), 1),
            "kernels_delta": round(other.get("kernels_per_step", 0.0) - base.get("kernels_per_step", 0.0), 1),
            "kernels": rows[:top]}


# vLLM 0.26 and 0.33 on Hopper: min(2 * max_num_seqs, 512) with serve's max_num_seqs of 256 or more
# (0.33 caps at 1024 on sm_100)
SERVE_CAPTURE_MAX = 512


def compilation_config(capture: list[int] | None, tp: int, env) -> dict:
    """vLLM's compilation_config for a setting. With tensor parallelism on a host that turns NVLink
    multicast off (NCCL_NVLS_ENABLE=0), vLLM's all-reduce + RMSNorm fusion is off too: it runs
    FlashInfer's all-reduce, whose backend vLLM picks by itself and which on an H200 pair picked
    a multicast one ("mnnvl") and failed with an illegal address. Same for every setting. capture
    None: the list vLLM builds for `vllm serve` (1, 2, 4, then 8 to 512): vLLM caps its largest
    size at twice max_num_seqs, which the study sets to its largest batch, so the cap is given
    (512, vLLM's own for serve's max_num_seqs) and a prompt of up to 512 tokens replays graphs
    as it would in a server."""
    cfg: dict = {"max_cudagraph_capture_size": SERVE_CAPTURE_MAX} if capture is None else \
        {"cudagraph_capture_sizes": capture}
    if tp > 1 and _multicast_off(env):
        cfg["pass_config"] = {"fuse_allreduce_rms": False}
    return cfg


def itl_floor_ms(t1s: list[float], tns: list[float], n: int) -> float:
    """(fastest n-token run - fastest one-token run) / (n - 1), in ms: a run that a one-time
    stall made seconds longer (seen on a busy host, stock vLLM too) cannot move it, while it
    moves that rep's ITL either way."""
    return round((min(tns) - min(t1s)) / (n - 1) * 1e3, 4)


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all of this host's CPUs (/proc/stat), None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0), sum(v)


def busy_cores(a, b) -> float | None:
    """Cores this host kept busy between two cpu_jiffies() readings (every process's)."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    return round((b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1), 2)


def wait_quiet(limit_s: float = QUIET_LIMIT_S, cores: float = QUIET_CORES, window_s: float = 1.0) -> dict:
    """Wait, at most limit_s, for a window_s window in which this host keeps fewer than `cores`
    cores busy. In v59 the first timed reps of a process whose graphs it had just compiled ran up
    to 1.6x slower than its last ones (a loaded process's did not); the busy cores beside each rep
    say whether the host was the cause."""
    t0 = time.perf_counter()
    seen = []
    while True:
        a = cpu_jiffies()
        time.sleep(window_s)
        c = busy_cores(a, cpu_jiffies())
        seen.append(c)
        if c is None or c < cores or time.perf_counter() - t0 >= limit_s:
            return {"waited_s": round(time.perf_counter() - t0, 1), "busy_cores": seen[-8:],
                    "quiet": c is not None and c < cores}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def run(args) -> int:
    """One setting in this process; writes args.json after each batch size."""
    env = mode_env(args.mode)
    if args.profile_host:  # vLLM's model-runner phases as profiler scopes (read once, at the first step)
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    os.environ.clear()
    os.environ.update(env)
    cfg = model_config(args.model)
    result: dict = {"mode": args.mode, "model": args.model, "tp": args.tp,
                    "expert_parallel": args.expert_parallel, "moe_backend": args.moe_backend,
                    "input_len": args.input_len,
                    "output_len": args.output_len, "reps": args.reps, "batches": {},
                    "commit": os.environ.get("OPGRAFT_COMMIT", ""),
                    "opgraft_env": {k: v for k, v in sorted(os.environ.items())
                                    if k.startswith("OPGRAFT_") and k != "OPGRAFT_COMMIT"},
                    "date": time.strftime("%Y-%m-%d"), "status": "starting"}

    def save():
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, args.json)

    from opgraft._entry import require

    torch = require("torch", "tools.e2e run")
    vllm = require("vllm", "tools.e2e run")
    from vllm import LLM, SamplingParams

    save()
    t0 = time.perf_counter()

    result.update(vllm=vllm.__version__, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    batches = sorted(set(args.batches))
    capture = None if args.capture == "vllm" else sorted({c for c in (1, 2, 4, 8, 16, 32) if c <= max(batches)} |
                                                          set(batches))
    llm = LLM(model=write_model_dir(cfg, model_dir_for(cfg)), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", seed=0, max_model_len=args.input_len + args.output_len + 8,
              max_num_seqs=max(batches), gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False, tensor_parallel_size=args.tp, disable_log_stats=False,
              enable_expert_parallel=args.expert_parallel,
              compilation_config=compilation_config(capture, args.tp, os.environ),
              **({} if args.moe_backend == "auto" else {"moe_backend": args.moe_backend}),
              **_jit_monitor_every_event())
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    result["status"] = "started"
    result["init_std"] = args.init_std
    if args.init_std > 0:
        result["init"] = llm.collective_rpc(_worker_reinit, args=(args.init_std,))
    save()
    P = prompts(max(batches), args.input_len, int(cfg.get("vocab_size", 32000)))
    tok = [{"prompt_token_ids": p} for p in P]
    n = args.output_len

    def sp(max_tokens, logprobs=None):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False, logprobs=logprobs)

    for b in batches:  # warm every batch size as a rep runs it (first-call costs, lazy compiles: after
        # 8-token warm-ups vLLM's FP8 Triton experts still JIT-compiled inside the timed runs; after one
        # rep-length warm-up, in 3 of 10 batch-8 reps, as the prompts fell into engine steps, v52)
        for _ in range(args.warmups):
            llm.generate(tok[:b], sp(1), use_tqdm=False)
            llm.generate(tok[:b], sp(n), use_tqdm=False)
    for b in batches:
        itl, tps, t1s, tns, phases, busy = [], [], [], [], [], []
        quiet = wait_quiet()
        print(f"{_TIMED_MARK} {b}", flush=True)  # the log's JIT events are placed by these two lines
        for _ in range(args.reps):
            j = cpu_jiffies()
            t = time.perf_counter()
            first = llm.generate(tok[:b], sp(1), use_tqdm=False)
            t1 = time.perf_counter() - t
            phases.append(one_token_phases(first, t1))
            took = prefill_steps(first)
            if took:
                phases[-1]["prefill_steps"] = took
            t = time.perf_counter()
            outs = llm.generate(tok[:b], sp(n), use_tqdm=False)
            tn = time.perf_counter() - t
            busy.append(busy_cores(j, cpu_jiffies()))
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != [n] * b:
                raise SystemExit(f"opgraft e2e: expected {n} tokens per sequence, got {got}")
            t1s.append(round(t1, 4))
            tns.append(round(tn, 4))
        # Each rep's n-token run less the fastest one-token run: a one-time stall of seconds in a
        # one-token run (seen on a busy host, stock vLLM too) made its own rep's ITL negative.
        t1 = min(t1s)
        if min(tns) <= t1:
            raise SystemExit(f"opgraft e2e: batch {b}: an {n}-token run took no longer than the one-token run "
                             f"({tns} s against {t1s} s); no ITL can be read from these runs")
        print(f"{_TIMED_END} {b}", flush=True)
        itl = [(tn - t1) / (n - 1) * 1e3 for tn in tns]
        tps = [b * (n - 1) / (tn - t1) for tn in tns]
        prof = None
        if args.profile_steps:  # GPU time per decode step, kernel by kernel (after the timed runs)
            def profile_run(max_tokens, b=b):
                host = args.profile_host and max_tokens == 1  # the host ops of the prefill alone
                started = llm.collective_rpc(_worker_profile, args=("start", host))
                split = prefill_split(held_generate(llm, tok[:b], sp(max_tokens)))
                stopped = llm.collective_rpc(_worker_profile, args=("stop",))
                return [a if "error" in a else z for a, z in zip(started, stopped)], split

            runs, splits, tries = profiled_pair(profile_run, args.profile_steps)
            said = {"alone": len(splits[0]) if splits[0] else None,
                    "with_decode": len(splits[1]) if splits[1] else None,
                    "split": {"alone": splits[0], "with_decode": splits[1]}, "tries": tries}
            prof = [dict(profile_rows(p, f, args.profile_steps), prefill_steps=said) for p, f in zip(*runs)]
        outs = llm.generate(tok[:b], sp(n, logprobs=0), use_tqdm=False)
        ids, lps = [], []
        for o in outs:
            c = o.outputs[0]
            ids.append([int(x) for x in c.token_ids])
            lps.append([float(d[t].logprob) if d and t in d else None
                        for t, d in zip(c.token_ids, c.logprobs or [None] * len(c.token_ids))])
        result["batches"][str(b)] = {"itl_ms": summarize(itl), "decode_tok_s": summarize(tps),
                                     "itl_ms_floor": itl_floor_ms(t1s, tns, n),
                                     "itl_ms_all": [round(x, 4) for x in itl],
                                     "t_1_s": t1s, "t_n_s": tns, "t_1_phases_ms": phases,
                                     "host_busy_cores": busy, "host_quiet": quiet,
                                     "token_ids": ids, "logprobs": lps}
        if prof is not None:
            result["batches"][str(b)]["profile"] = prof
        save()
    try:
        result["workers"] = llm.collective_rpc(_worker_stats)
    except Exception as e:
        result["workers_error"] = f"{type(e).__name__}: {e}"
    result["status"] = "done"
    result["total_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"opgraft e2e: {args.mode} done in {result['total_s']} s", flush=True)
    return 0


def parity(a: dict, b: dict) -> dict:
    """Token and logprob agreement of run b against run a, per batch size present in both.
    Logprobs are compared only up to each sequence's first differing token (after it the
    contexts differ)."""
    out = {}
    for key, ra in a.get("batches", {}).items():
        rb = b.get("batches", {}).get(key)
        if not rb:
            continue
        same = total = prefix = 0
        dmax = 0.0
        for ia, ib, la, lb in zip(ra["token_ids"], rb["token_ids"], ra["logprobs"], rb["logprobs"]):
            total += len(ia)
            same += sum(x == y for x, y in zip(ia, ib))
            k = 0
            while k < min(len(ia), len(ib)) and ia[k] == ib[k]:
                k += 1
            prefix += k
            for x, y in zip(la[:k], lb[:k]):
                if x is not None and y is not None:
                    dmax = max(dmax, abs(x - y))
        out[key] = {"identical": ra["token_ids"] == rb["token_ids"],
                    "same_position_fraction": same / total if total else None,
                    "common_prefix_fraction": prefix / total if total else None,
                    "max_abs_logprob_diff_on_common_prefix": dmax}
    return out


def _rank0_profile(batch_result: dict) -> dict | None:
    return (batch_result.get("profile") or [None])[0]


def _modes_in(out_dir: str) -> list[str]:
    """The settings a study's folder holds results of: MODES' order, then labelled ones by name."""
    names = {f[4:-5] for f in os.listdir(out_dir) if f.startswith("e2e-") and f.endswith(".json")}
    names = {m for m in names if base_mode(m) is not None}
    return [m for m in MODES if m in names] + sorted(names - set(MODES))


def _print_profile_diff(title: str, what: str, base: dict, prof: dict) -> None:
    d = profile_diff(base, prof)
    print(f"{title}: GPU {d['gpu_delta_us']:+.1f} us per {what}, kernels {d['kernels_delta']:+.1f} per {what}")
    for k in d["kernels"][:8]:
        print(f"    {k['delta_us']:+9.1f} us  ({k['base_us']:.1f} -> {k['us']:.1f}, "
              f"{k['base_launches']:.0f} -> {k['launches']:.0f}x)  {k['kernel'][:80]}")


def compare(out_dir: str, modes=None) -> dict:
    runs = {}
    for m in modes if modes is not None else _modes_in(out_dir):
        p = os.path.join(out_dir, f"e2e-{m}.json")
        if os.path.isfile(p):
            with open(p) as f:
                runs[m] = json.load(f)
    rows = []
    base = runs.get("disabled")
    for m, r in runs.items():
        for key, br in sorted(r.get("batches", {}).items(), key=lambda kv: int(kv[0])):
            row = {"mode": m, "batch": int(key), "itl_ms": br["itl_ms"]["median"],
                   "itl_ms_floor": br.get("itl_ms_floor"),
                   "itl_ms_min": br["itl_ms"]["min"], "itl_ms_max": br["itl_ms"]["max"],
                   "decode_tok_s": br["decode_tok_s"]["median"], "reps": br["itl_ms"]["n"],
                   "first_token_ms": statistics.median(br["t_1_s"]) * 1e3 if br.get("t_1_s") else None,
                   "moe_backend": r.get("moe_backend", "auto")}
            if base and key in base.get("batches", {}):
                bi = base["batches"][key]["itl_ms"]["median"]
                row["itl_vs_disabled"] = br["itl_ms"]["median"] / bi
                bp, mp = _rank0_profile(base["batches"][key]), _rank0_profile(br)
                if m != "disabled" and bp and mp and "error" not in bp and "error" not in mp:
                    row["ops_vs_disabled"] = op_ratios(profile_ops(bp), profile_ops(mp))
            rows.append(row)
    par = {m: parity(base, r) for m, r in runs.items() if base and m != "disabled"}
    # A labelled setting (opgraft-both) against the setting it labels (opgraft), run in the same
    # study: what its switches alone change.
    # reps_apart: every rep of one on the faster side of every rep of the other (with 3 reps each,
    # 1 chance in 10 of that for settings that do not differ); first token and prefill GPU time
    # (the profile's) where both have them, since a switch may move them while the ITL gains.
    vs_base = {}
    for m, r in runs.items():
        b = base_mode(m)
        if b != m and b in runs:
            both = [(key, br, runs[b]["batches"][key]) for key, br in r.get("batches", {}).items()
                    if key in runs[b].get("batches", {})]
            v = {"base": b, "itl_ratio": {}, "reps_apart": {}, "t1_ratio": {}, "prefill_gpu_ratio": {},
                 "parity": parity(runs[b], r)}
            for key, br, bb in both:
                x, y = br["itl_ms"], bb["itl_ms"]
                v["itl_ratio"][key] = x["median"] / y["median"]
                v["reps_apart"][key] = x["max"] < y["min"] or x["min"] > y["max"]
                if br.get("t_1_s") and bb.get("t_1_s"):
                    v["t1_ratio"][key] = statistics.median(br["t_1_s"]) / statistics.median(bb["t_1_s"])
                pa, pb = ((_rank0_profile(z) or {}).get("prefill") or {} for z in (br, bb))
                if pa.get("gpu_us_per_step") and pb.get("gpu_us_per_step"):
                    v["prefill_gpu_ratio"][key] = pa["gpu_us_per_step"] / pb["gpu_us_per_step"]
            vs_base[m] = v
    meta = {k: v for k, v in (base or next(iter(runs.values()), {})).items()
            if k in ("model", "tp", "expert_parallel", "vllm", "torch", "gpu", "commit", "date",
                     "input_len", "output_len", "init_std")}
    summary = {"meta": meta, "rows": rows, "parity_vs_disabled": par, "vs_base": vs_base,
               "status": {m: r.get("status") for m, r in runs.items()},
               "startup_s": {m: r.get("startup_s") for m, r in runs.items()},
               "compile": {m: r["compile"] for m, r in runs.items() if "compile" in r},
               "caches": {m: r["caches"] for m, r in runs.items() if "caches" in r},
               "jit_events": {m: r["jit_events"] for m, r in runs.items() if r.get("jit_events")},
               "workers": {m: r.get("workers") or r.get("workers_error") for m, r in runs.items()}}
    with open(os.path.join(out_dir, "e2e-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{'mode':<18} {'B':>3} {'ITL ms (median)':>16} {'min..max':>16} {'floor':>7} {'tok/s':>9} {'vs off':>7} "
          f"{'1st tok ms':>10}")
    for r in rows:
        vs = f"{r['itl_vs_disabled']:.3f}" if "itl_vs_disabled" in r else "-"
        floor = f"{r['itl_ms_floor']:.3f}" if r.get("itl_ms_floor") is not None else "-"
        t1 = f"{r['first_token_ms']:.1f}" if r.get("first_token_ms") is not None else "-"
        print(f"{r['mode']:<18} {r['batch']:>3} {r['itl_ms']:>16.3f} "
              f"{r['itl_ms_min']:>7.3f}..{r['itl_ms_max']:<7.3f} {floor:>7} {r['decode_tok_s']:>9.1f} {vs:>7} {t1:>10}")
    for m, r in runs.items():  # the host before and during the timed reps (wait_quiet, busy cores a rep)
        for key, br in sorted(r.get("batches", {}).items(), key=lambda kv: int(kv[0])):
            q, busy = br.get("host_quiet"), [c for c in br.get("host_busy_cores") or [] if c is not None]
            if q and busy:
                print(f"host {m} B={key}: {'quiet' if q['quiet'] else 'not quiet'} after {q['waited_s']} s; "
                      f"busy cores a rep {min(busy):.1f}..{max(busy):.1f}; ITL a rep "
                      f"{' '.join(f'{x:.2f}' for x in br['itl_ms_all'])}")
    for m, r in runs.items():
        if r.get("moe_backend", "auto") != "auto":
            print(f"moe_backend {m}: {r['moe_backend']}")
    for m, r in runs.items():
        c = r.get("compile") or {}
        if c or "caches" in r:
            parts = [f"compiled {k} {v:.1f} s" for k, v in c.get("compiled", {}).items()]
            parts += [f"loaded {k} {v:.2f} s" for k, v in c.get("loaded", {}).items()]
            total = f"{c['total_s']:.1f} s" if "total_s" in c else "-"
            cold = " (cold caches)" if r.get("caches") == "cold" else ""
            print(f"torch.compile {m}: {total} in all, start-up {r.get('startup_s')} s{cold}; {', '.join(parts) or '-'}")
    for m, r in runs.items():
        for where, events in sorted((r.get("jit_events") or {}).items()):
            said = "; ".join(f"{k} x{v}" for k, v in sorted(events.items()))
            print(f"JIT after vLLM's warm-up, {m}, {'B=' + where + ' timed runs' if where != 'other' else 'elsewhere'}: {said}")
    for m, p in par.items():
        for key, v in p.items():
            print(f"parity {m} vs disabled, B={key}: identical={v['identical']} "
                  f"same-position {v['same_position_fraction']:.4f} "
                  f"common-prefix {v['common_prefix_fraction']:.4f} "
                  f"max|dlogprob| {v['max_abs_logprob_diff_on_common_prefix']:.4g}")
    for m, v in vs_base.items():
        for key, p in sorted(v["parity"].items(), key=lambda kv: int(kv[0])):
            ratio = v["itl_ratio"].get(key)
            apart = "reps apart" if v["reps_apart"].get(key) else "inside the reps' spread"
            more = "".join(f", {label} x{v[f][key]:.3f}" for f, label in (("t1_ratio", "first token"),
                                                                             ("prefill_gpu_ratio", "prefill GPU"))
                           if key in v[f])
            print(f"{m} vs {v['base']}, B={key}: ITL x{ratio:.3f} ({apart}){more}, identical={p['identical']} "
                  f"same-position {p['same_position_fraction']:.4f} "
                  f"max|dlogprob| {p['max_abs_logprob_diff_on_common_prefix']:.4g}")
    for m, w in summary["workers"].items():
        print(f"workers {m}: {json.dumps(w)[:400]}")
        if isinstance(w, list) and w and all(isinstance(x, dict) for x in w):  # each rank's rewrites, in full
            said = [f"{label} {[x.get(key) for x in w]}" for key, _, _, label in _REWRITES
                    if any(x.get(key) for x in w)]
            if said:
                print(f"graph rewrites {m} (a rank each): {', '.join(said)}")
    for m, r in runs.items():  # --profile-steps: rank 0's GPU time per decode step against the ITL
        for key, br in sorted(r.get("batches", {}).items(), key=lambda kv: int(kv[0])):
            prof = _rank0_profile(br)
            if not prof:
                continue
            if "error" in prof:
                print(f"profile {m} B={key}: {prof['error']}")
                continue
            busy = f", busy {prof['busy_us_per_step'] / 1e3:.3f} ms" if "busy_us_per_step" in prof else ""
            print(f"profile {m} B={key}: GPU {prof['gpu_us_per_step'] / 1e3:.3f} ms per step{busy} "
                  f"(ITL {br['itl_ms']['median']:.3f} ms)")
            for k in prof["kernels"][:8]:
                exp = f" ({k['exposed_us_per_step']:.1f} exposed)" if "exposed_us_per_step" in k else ""
                print(f"    {k['us_per_step']:9.1f} us{exp}  {k['launches_per_step']:6.1f}x  {k['kernel'][:90]}")
            ops = profile_ops(prof)
            print(f"ops {m} B={key} (us a step, exposed): " + ", ".join(
                f"{op} {o['us']:.1f}" + ("" if o["exposed"] is None else f" ({o['exposed']:.1f})")
                for op, o in sorted(ops.items(), key=lambda kv: -kv[1]["us"])))
            vs = next((r["ops_vs_disabled"] for r in rows
                       if r["mode"] == m and r["batch"] == int(key) and "ops_vs_disabled" in r), None)
            if vs:
                print(f"ops {m} vs disabled B={key} (exposed where both have it): "
                      + ", ".join(f"{op} x{x:.3f}" for op, x in vs.items()))
            pre = prof.get("prefill")
            ps = prof.get("prefill_steps") or {}
            if pre:
                split = f" in {ps['alone']} engine steps" if (ps.get("alone") or 1) > 1 else ""
                print(f"profile {m} B={key}: GPU {pre['gpu_us_per_step'] / 1e3:.3f} ms in the prefill alone{split}, "
                      f"{pre['kernels_per_step']} kernels (one-token run {min(br.get('t_1_s') or [0]) * 1e3:.1f} ms)")
            sa, sw = (ps.get("split") or {}).get("alone"), (ps.get("split") or {}).get("with_decode")
            if ps.get("alone") and ps.get("with_decode") and ps["alone"] != ps["with_decode"]:
                print(f"profile {m} B={key}: the prompts went in {ps['alone']} engine steps alone and "
                      f"{ps['with_decode']} before the decode steps: the step's kernels above are off by that")
            elif sa and sw and sa != sw:
                print(f"profile {m} B={key}: the prompts went in steps of {sa} requests alone and {sw} before "
                      f"the decode steps: the step's kernels above are off by the difference")
            if (ps.get("tries") or 1) > 1:
                print(f"profile {m} B={key}: {ps['tries']} profiled pairs taken"
                      + ("" if sa == sw else ", none whose prompts went in the same engine steps"))
            t1_split = [(p.get("prefill_steps") or 1) > 1 for p in br.get("t_1_phases_ms") or []]
            if any(t1_split) and len(t1_split) == len(br.get("t_1_s") or []):
                one = [t for t, sp_ in zip(br["t_1_s"], t1_split) if not sp_]
                said = f"{statistics.median(one) * 1e3:.1f} ms" if one else "none"
                print(f"first token {m} B={key}: {sum(t1_split)} of {len(t1_split)} one-token runs took their "
                      f"prompts in several engine steps; the median of the others {said}")
            lb = runs.get(base_mode(m)) if base_mode(m) != m else None
            lprof = _rank0_profile((lb or {}).get("batches", {}).get(key, {}))
            if lprof and "error" not in lprof:
                _print_profile_diff(f"profile {m} vs {base_mode(m)} B={key}", "step", lprof, prof)
            bprof = _rank0_profile((base or {}).get("batches", {}).get(key, {}))
            if m != "disabled" and bprof and "error" not in bprof:
                for what, b_, o_ in (("step", bprof, prof), ("prefill", bprof.get("prefill"), pre)):
                    if b_ and o_:
                        _print_profile_diff(f"profile {m} vs disabled B={key}", what, b_, o_)
                bps = bprof.get("prefill_steps") or {}
                bs_, os_ = bps.get("alone"), ps.get("alone")
                bsa = (bps.get("split") or {}).get("alone")
                if bs_ and os_ and bs_ != os_:
                    print(f"profile {m} vs disabled B={key}: the prefills above went in {bs_} and {os_} "
                          f"engine steps: not the same work")
                elif bsa and sa and bsa != sa:
                    print(f"profile {m} vs disabled B={key}: the prefills above went in steps of {bsa} and {sa} "
                          f"requests: not the same work")
                bh, oh = (bprof.get("prefill") or {}).get("host"), (pre or {}).get("host")
                if bh and oh:
                    d = host_diff(bh, oh)
                    print(f"profile {m} vs disabled B={key}: host {d['us_delta']:+.1f} us of self CPU time per "
                          f"prefill ({bh['us'] / 1e3:.2f} -> {oh['us'] / 1e3:.2f} ms), calls {d['calls_delta']:+d}")
                    for k in d["scopes"]:
                        print(f"    {k['delta_us']:+9.1f} us  ({k['base_us']:.1f} -> {k['us']:.1f} wall)  {k['scope']}")
                    for k in d["ops"][:12]:
                        print(f"    {k['delta_us']:+9.1f} us  ({k['base_us']:.1f} -> {k['us']:.1f}, "
                              f"{k['base_calls']} -> {k['calls']} calls)  {k['op'][:80]}")
    return summary


def run_group(cmd: list[str], env: dict, out, timeout: float):
    """Runs cmd in its own process group and returns its exit status, or "timeout". On timeout
    the whole group goes (vLLM's engine-core process too, which would otherwise keep the GPU's
    memory and make the next setting fail)."""
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return "timeout"
    finally:
        try:  # children left behind by a setting that exited on its own
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def gpu_memory_used_mib() -> list[int] | None:
    """Memory in use on each GPU this process may use (CUDA_VISIBLE_DEVICES, as indices)."""
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    if visible and all(v.isdigit() for v in visible.split(",")):
        cmd.append(f"--id={visible}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        return [int(x) for x in out.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def wait_gpu_memory_free(limit_mib: int = 4096, timeout: float = 60.0) -> None:
    """Waits until every GPU uses less than limit_mib (a finished setting's memory is back)."""
    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        used = gpu_memory_used_mib()
        if used is None or max(used, default=0) < limit_mib:
            return
        time.sleep(1.0)
    print(f"opgraft e2e: GPU memory still in use after {timeout:.0f} s: {gpu_memory_used_mib()} MiB",
          flush=True)


def last_line(path: str) -> str:
    """The last non-empty line of a text file ("" if none or unreadable)."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


# vLLM's own log lines for its torch.compile (vllm/compilation/backends.py and monitor.py, 0.26-0.34).
_COMPILED = re.compile(r"Compiling a graph for compile range \((\d+), (\d+)\) takes ([0-9.]+) s")
_LOADED = re.compile(r"Directly load the compiled graph\(s\) for compile range \((\d+), (\d+)\) "
                     r"from the cache, took ([0-9.]+) s")
_COMPILE_TOTAL = re.compile(r"torch\.compile took ([0-9.]+) s in total")


def compile_times(log: str) -> dict:
    """vLLM's torch.compile times in a setting's log: {"compiled": {"1-2": s, ...}, "loaded": {...}
    (ranges found in vLLM's compile cache), "total_s": s}; the slowest rank's where several log.
    Empty when the log has none or cannot be read."""
    out: dict = {}
    try:
        with open(log, errors="replace") as f:
            for line in f:
                for key, pat in (("compiled", _COMPILED), ("loaded", _LOADED)):
                    m = pat.search(line)
                    if m:
                        r = f"{m.group(1)}-{m.group(2)}"
                        d = out.setdefault(key, {})
                        d[r] = max(d.get(r, 0.0), float(m.group(3)))
                m = _COMPILE_TOTAL.search(line)
                if m:
                    out["total_s"] = max(out.get("total_s", 0.0), float(m.group(1)))
    except OSError:
        return {}
    return out


# Where each JIT or compile cache a setting fills lives (DeepGEMM's: vLLM sets it under its own
# root only when unset).
_CACHE_DIRS = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
               "DG_JIT_CACHE_DIR": "deep_gemm", "OPGRAFT_CACHE_DIR": "opgraft"}


def cold_cache_env(root: str) -> dict:
    """The environment that gives a setting empty caches of its own under root."""
    return {k: os.path.join(root, sub) for k, sub in _CACHE_DIRS.items()}


_TIMED_MARK, _TIMED_END = "opgraft e2e: timed runs of batch", "opgraft e2e: timed runs done, batch"
_JIT_EVENT = re.compile(r"\] (.+?) during inference: ([^\s(.]+)")


def _jit_monitor_every_event() -> dict:
    """vLLM's keyword that logs every JIT event its monitor sees after warm-up, not only a kind's
    first, where this vLLM has it (0.26, 0.33 and 0.34 do)."""
    from vllm.engine.arg_utils import EngineArgs
    return {"jit_monitor_verbose": True} if "jit_monitor_verbose" in {f.name for f in dataclasses.fields(EngineArgs)} \
        else {}


def jit_events(log: str) -> dict:
    """The kernel JIT events vLLM's monitor logged after its warm-up: {"8": {"Triton kernel JIT
    compilation: fused_moe_kernel": 3}, ...} for those inside a batch size's timed runs, "other"
    for the rest (the study's own warm-up and profiled runs). Empty when there were none or the log
    cannot be read."""
    out: dict = {}
    where = "other"
    try:
        with open(log, errors="replace") as f:
            for line in f:  # a marker may follow another process's unfinished line
                if _TIMED_MARK in line:
                    where = line.split(_TIMED_MARK, 1)[1].strip()
                elif _TIMED_END in line:
                    where = "other"
                elif "during inference:" in line:
                    m = _JIT_EVENT.search(line)
                    if m:
                        d = out.setdefault(where, {})
                        key = f"{m.group(1)}: {m.group(2)}"
                        d[key] = d.get(key, 0) + 1
    except OSError:
        return {}
    return out


def _note_setting(json_path: str, log: str, caches: str) -> None:
    """Adds the setting's compile times and JIT events from its log, and whether its caches were
    its own empty ones ("cold") or the machine's ("shared"), to its result file (when it wrote one)."""
    times = compile_times(log)
    try:
        with open(json_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(result, dict):
        return
    result["compile"] = times
    result["jit_events"] = jit_events(log)
    result["caches"] = caches
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)


def setting_failure(rc, json_path: str, log: str) -> str | None:
    """Why a setting's run failed (None if it finished): its exit status, or a result file that
    is missing or not done, with the last line of its log."""
    if rc == 0:
        try:
            with open(json_path) as f:
                status = json.load(f).get("status")
        except (OSError, ValueError, AttributeError):
            status = "no result file"
        if status == "done":
            return None
        why = f"exit 0 but {status!r}"
    else:
        why = "timed out" if rc == "timeout" else f"exit {rc}"
    tail = last_line(log)
    return f"{why}{': ' + tail if tail else ''} (log {log})"


def _exit_on_term(signum, frame):
    """SIGTERM or SIGHUP as an exit (143 / 129): run_group's cleanup then stops the running
    setting's process group, which lives in a session of its own (a `timeout` around the study
    signals only the study's group) and would outlive the study, keeping the GPU's memory."""
    raise SystemExit(128 + signum)


def study(args) -> int:
    signal.signal(signal.SIGTERM, _exit_on_term)
    signal.signal(signal.SIGHUP, _exit_on_term)
    unused = sorted({mode for mode, _, _ in args.env} - set(args.modes))
    if unused:
        print(f"opgraft e2e: --env names {', '.join(unused)}, which --modes does not run", file=sys.stderr)
        return 2
    backends = dict(args.mode_moe_backend)
    named = [mode for mode, _ in args.mode_moe_backend]
    unused = sorted(set(backends) - set(args.modes))
    twice = sorted({mode for mode in named if named.count(mode) > 1})
    if unused or twice:
        print(f"opgraft e2e: --mode-moe-backend names {', '.join(unused or twice)}, "
              f"{'which --modes does not run' if unused else 'more than once'}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.log_dir or args.out_dir, exist_ok=True)
    failed = {}
    for i, m in enumerate(args.modes):
        path = os.path.join(args.out_dir, f"e2e-{m}.json")
        cmd = [sys.executable, "-m", "tools.e2e", "run", "--mode", m, "--model", args.model,
               "--json", path, "--batches", ",".join(map(str, args.batches)),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--reps", str(args.reps), "--warmups", str(args.warmups), "--init-std", str(args.init_std),
               "--profile-steps", str(args.profile_steps), *(["--profile-host"] if args.profile_host else []),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--tp", str(args.tp),
               "--capture", args.capture, "--moe-backend", backends.get(m, args.moe_backend)]
        if args.expert_parallel:
            cmd.append("--expert-parallel")
        if os.path.exists(path):  # a previous study's result must not stand in for this one's
            os.remove(path)
        log = os.path.join(args.log_dir or args.out_dir, f"e2e-{m}.log")
        print(f"opgraft e2e: {m} ... (log {log})", flush=True)
        t = time.perf_counter()
        env = mode_env(m)
        caches = tempfile.mkdtemp(prefix=f"opgraft-e2e-{m}-caches-") if args.cold_caches else None
        if caches:
            env.update(cold_cache_env(caches))
        env.update({k: v for mode, k, v in args.env if mode == m})
        try:
            with open(log, "w") as lf:
                rc = run_group(cmd, env, lf, args.mode_timeout)
        finally:
            if caches:
                shutil.rmtree(caches, ignore_errors=True)
        print(f"opgraft e2e: {m} exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
        _note_setting(path, log, "cold" if caches else "shared")
        wait_gpu_memory_free()
        if rc != 0:
            with open(log, errors="replace") as lf:
                print("".join(lf.readlines()[-25:]), flush=True)
        why = setting_failure(rc, path, log)
        if why:
            failed[m] = why
        if i + 1 < len(args.modes):  # the summary so far, quietly: a call cut off during the next
            with contextlib.redirect_stdout(io.StringIO()):  # setting still leaves e2e-summary.json
                compare(args.out_dir, args.modes[:i + 1])
    compare(args.out_dir, args.modes)
    for m, why in failed.items():
        print(f"opgraft e2e: setting {m} failed: {why}", file=sys.stderr, flush=True)
    if failed:
        n = len(args.modes)
        print(f"opgraft e2e: {len(failed)} of {n} settings failed"
              f"{': nothing to compare' if len(failed) == n else ''}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.e2e", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    from opgraft._entry import DefaultsHelp

    with_defaults = {"formatter_class": DefaultsHelp}

    def common(p):
        p.add_argument("--model", default="Qwen3-30B-A3B",
                       help=f"built-in architecture ({', '.join(MODEL_CONFIGS)}) or a config.json")
        p.add_argument("--batches", type=_ints, default="1,8,32", help="comma-separated batch sizes")
        p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
        p.add_argument("--output-len", type=int, default=256, help="generated tokens a sequence")
        p.add_argument("--reps", type=int, default=5, help="timed repetitions a batch size")
        p.add_argument("--warmups", type=int, default=3,
                       help="untimed repetitions a batch size before the timed ones (a one-token and a full run each)")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's gpu_memory_utilization")
        p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size (GPUs)")
        p.add_argument("--expert-parallel", action="store_true",
                       help="vLLM enable_expert_parallel (experts split over the --tp ranks)")
        p.add_argument("--moe-backend", default="auto",
                       help="vLLM's moe_backend (its --moe-backend: triton, deep_gemm, flashinfer_cutlass, ...; "
                            "auto: vLLM's choice, not passed, for vLLMs without the option); opgraft's seams "
                            "take only the calls of the experts classes they wrap, the rest stay that backend's")
        p.add_argument("--profile-steps", type=int, default=0,
                       help="after the timed runs, profile this many decode steps per batch size "
                            "(GPU time per step, kernel by kernel; 0: off)")
        p.add_argument("--profile-host", action="store_true",
                       help="with --profile-steps: record the worker's host ops during the prefill too "
                            "(self CPU time op by op, compared between settings)")
        p.add_argument("--init-std", type=float, default=0.02,
                       help="re-initialize the dummy weights as N(0, std^2) (0: keep vLLM's)")
        p.add_argument("--capture", choices=["study", "vllm"], default="study",
                       help="CUDA-graph capture sizes: the study's (1, 2, 4, ... up to the largest batch) or vLLM's own "
                            "default list (up to 512, captured from the largest down, as `vllm serve` does)")

    r = sub.add_parser("run", help="one setting, in this process", **with_defaults)
    common(r)
    r.add_argument("--mode", type=_mode, required=True, help=f"the setting to run: {_MODES_SAID}")
    r.add_argument("--json", default=None, help="write the setting's results to this file (default: none)")
    s = sub.add_parser("study", help="every setting, each in its own process, then the comparison", **with_defaults)
    common(s)
    s.add_argument("--modes", type=_modes, default="disabled,opgraft,passthrough",
                   help=f"comma-separated settings, of {_MODES_SAID}")
    s.add_argument("--env", type=_setting_env, action="append", default=[], metavar="MODE:KEY=VALUE",
                   help="an environment variable for one setting only, e.g. "
                        "opgraft-again:OPGRAFT_TUNE_MOE_FP8_QUANTIZE=0 (a tunable's A/B in one study); repeatable")
    s.add_argument("--mode-moe-backend", type=_setting_backend, action="append", default=[],
                   metavar="MODE:BACKEND",
                   help="vLLM's moe_backend for one setting instead of --moe-backend, e.g. "
                        "disabled-again:flashinfer_cutlass (stock on two experts backends in one study); "
                        "repeatable, once a setting")
    s.add_argument("--out-dir", required=True, help="where each setting's results and the summary go")
    s.add_argument("--mode-timeout", type=float, default=600, help="seconds a setting may run")
    s.add_argument("--log-dir", default=None, help="where each setting's vLLM log goes (default: --out-dir)")
    s.add_argument("--cold-caches", action="store_true",
                   help="each setting starts with empty JIT and compile caches of its own (comparable start-up times)")
    c = sub.add_parser("compare", help="the comparison table of a study's folder", **with_defaults)
    c.add_argument("out_dir", help="a study's --out-dir")
    args = ap.parse_args(argv)
    if args.cmd in ("run", "study"):
        if args.output_len < 2 or args.input_len < 1 or args.reps < 1 or args.tp < 1 or args.warmups < 1:
            ap.error("--output-len must be >= 2, --input-len, --reps, --warmups and --tp >= 1")
        if args.profile_steps < 0 or args.profile_steps >= args.output_len:
            ap.error("--profile-steps must be in [0, --output-len)")
        if args.profile_host and not args.profile_steps:
            ap.error("--profile-host needs --profile-steps")
        if not 0 <= args.init_std < 1:
            ap.error("--init-std must be in [0, 1)")
        model_config(args.model)  # fail early on a bad --model
    if args.cmd == "run":
        return run(args)
    if args.cmd == "study":
        return study(args)
    if not os.path.isdir(args.out_dir):
        ap.error(f"no such folder: {args.out_dir}")
    compare(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
