"""`opgraft` command line: bench (and, on a machine without a GPU, what can run without one)."""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import struct
import sys
import time

from . import _lib
from .presets import PRESETS, ConfigError, MoeShape, config_path, resolve


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",")]  # an empty item ("1,,2", "1,") is an error too
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not tokens or any(t < 1 or t > 4096 for t in tokens):
        raise argparse.ArgumentTypeError("--tokens values must be between 1 and 4096")
    return tokens


MODEL_HELP = f"a preset ({', '.join(PRESETS)}), a Hugging Face config.json, or a model folder holding one"
TOKENS_HELP = "comma-separated token counts of the calls (1..4096)"


def _gpu_status() -> tuple[bool, str]:
    """(True, "") when torch sees a CUDA GPU, else (False, why not)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU"
    return True, ""


FP8_DTYPES = ("fp8-block", "fp8-tensor")  # FP8 weights with 128x128 block or per-tensor scales, bf16 out
FP8_BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_args_struct(shape: MoeShape, tokens: int, dtype: str, arch: int) -> _lib.MoeArgs:
    """Arguments that describe a shape only (fake aligned pointers): for the guard and compiler.
    dtype: bf16, fp16, or fp8-block / fp8-tensor (FP8 weights and activations, bf16 out, vLLM's
    contiguous scale layouts)."""
    a = _lib.MoeArgs()
    a.struct_size = ctypes.sizeof(_lib.MoeArgs)
    a.dtype = _lib.DTYPE_FP16 if dtype == "fp16" else _lib.DTYPE_BF16
    a.activation = _lib.ACT_SILU
    E, H, I, k = shape.num_experts, shape.hidden, shape.inter, shape.top_k
    a.num_tokens, a.hidden, a.inter, a.num_experts, a.top_k = tokens, H, I, E, k
    fake = 1 << 20  # never dereferenced: the guard and the compiler look at shapes only
    a.hidden_states, a.w13, a.w2, a.topk_weights, a.topk_ids, a.out = (fake,) * 6
    a.hidden_states_stride[:] = [H, 1]
    a.w13_stride[:] = [2 * I * H, H, 1]
    a.w2_stride[:] = [H * I, I, 1]
    a.topk_weights_dtype, a.topk_ids_dtype = _lib.DTYPE_FP32, _lib.DTYPE_INT32
    a.topk_weights_stride[:] = [k, 1]
    a.topk_ids_stride[:] = [k, 1]
    a.out_stride[:] = [H, 1]
    a.arch = arch
    if dtype in FP8_DTYPES:
        a.weight_dtype, a.scale_dtype = _lib.DTYPE_FP8_E4M3, _lib.DTYPE_FP32
        a.hidden_scale = a.w13_scale = a.w2_scale = fake
        if dtype == "fp8-block":
            b = FP8_BLOCK
            a.scale_layout, a.block_n, a.block_k = _lib.SCALE_BLOCK, b, b
            a.hidden_scale_stride[:] = [_cdiv(H, b), 1]
            a.w13_scale_stride[:] = [2 * _cdiv(I, b) * _cdiv(H, b), _cdiv(H, b), 1]
            a.w2_scale_stride[:] = [_cdiv(H, b) * _cdiv(I, b), _cdiv(I, b), 1]
        else:
            a.scale_layout = _lib.SCALE_TENSOR
            a.w13_scale_stride[:] = [1, 0, 0]
            a.w2_scale_stride[:] = [1, 0, 0]
    return a


def guard_decision(shape: MoeShape, tokens: int, dtype: str, arch: int, global_experts: int = 0) -> tuple[bool, str]:
    a = moe_args_struct(shape, tokens, dtype, arch)
    if global_experts:  # expert parallelism: an expert_map (never read by the guard)
        a.expert_map, a.expert_map_len = 1 << 20, global_experts
    reason = ctypes.create_string_buffer(256)
    st = _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, len(reason))
    return st == _lib.OK, reason.value.decode()


def compile_report(shape: MoeShape, tokens: int, dtype: str, arch: int, global_experts: int = 0) -> list[dict]:
    a = moe_args_struct(shape, tokens, dtype, arch)
    if global_experts:
        a.expert_map, a.expert_map_len = 1 << 20, global_experts
    infos = (_lib.KernelInfo * 4)()
    n = ctypes.c_int32()
    _lib.check(_lib.lib().opgraft_moe_compile_report(ctypes.byref(a), arch, infos, 4, ctypes.byref(n)))
    return [{"kernel": infos[i].name.decode(), "registers": infos[i].registers,
             "spill_bytes": infos[i].spill_store_bytes + infos[i].spill_load_bytes,
             "shared_bytes": infos[i].shared_bytes} for i in range(min(n.value, 4))]


def oracle_selfcheck(seed: int = 0) -> float:
    """Runs the C fp64 oracle on a small random bf16 problem and compares it with a Python loop;
    returns the largest relative difference (a check that the CPU path works here)."""
    rng = random.Random(seed)
    T, H, I, E, k = 2, 16, 8, 4, 2

    def bf16(x: float) -> int:
        return int.from_bytes(struct.pack("<f", x), "little") >> 16

    def val(b: int) -> float:
        return struct.unpack("<f", (b << 16).to_bytes(4, "little"))[0]

    x = [bf16(rng.uniform(-1, 1)) for _ in range(T * H)]
    w13 = [bf16(rng.uniform(-0.5, 0.5)) for _ in range(E * 2 * I * H)]
    w2 = [bf16(rng.uniform(-0.5, 0.5)) for _ in range(E * H * I)]
    ids = [rng.sample(range(E), k) for _ in range(T)]
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # the router weights are fp32
    tw = [[f32(rng.random()) for _ in range(k)] for _ in range(T)]
    U16 = ctypes.c_uint16
    bx, b13, b2 = (U16 * len(x))(*x), (U16 * len(w13))(*w13), (U16 * len(w2))(*w2)
    bids = (ctypes.c_int32 * (T * k))(*[e for row in ids for e in row])
    btw = (ctypes.c_float * (T * k))(*[w for row in tw for w in row])
    out = (ctypes.c_double * (T * H))()
    shape = MoeShape("selfcheck", E, H, I, k)
    a = moe_args_struct(shape, T, "bf16", 90)
    a.hidden_states, a.w13, a.w2 = ctypes.addressof(bx), ctypes.addressof(b13), ctypes.addressof(b2)
    a.topk_ids, a.topk_weights = ctypes.addressof(bids), ctypes.addressof(btw)
    _lib.check(_lib.lib().opgraft_moe_reference(ctypes.byref(a), out))
    worst = 0.0
    for t in range(T):
        acc = [0.0] * H
        for j in range(k):
            e = ids[t][j]
            act = []
            for i in range(I):
                g = sum(val(w13[(e * 2 * I + i) * H + h]) * val(x[t * H + h]) for h in range(H))
                u = sum(val(w13[(e * 2 * I + I + i) * H + h]) * val(x[t * H + h]) for h in range(H))
                act.append(g / (1 + math.exp(-g)) * u)
            for h in range(H):
                acc[h] += tw[t][j] * sum(val(w2[(e * H + h) * I + i]) * act[i] for i in range(I))
        for h in range(H):
            worst = max(worst, abs(acc[h] - out[t * H + h]) / max(1e-12, abs(acc[h])))
    return worst


def _cpu_bench(shape: MoeShape, tokens: list[int], dtype: str, why: str, json_to: str | None = None,
               plot: str | None = None, global_experts: int = 0) -> int:
    """What runs without a GPU. json_to: None, "-" (the JSON on stdout instead of the table) or a
    file that gets the same JSON beside the table."""
    print(f"no GPU here ({why}): running what works without one -- the dispatch guard, the NVRTC "
          f"compile of every kernel variant for sm_90 with its resource report, and the C fp64 oracle.",
          file=sys.stderr)
    rows = []
    info = _lib.runtime_info()
    print(f"libnvrtc: {info['nvrtc_path'] or 'not found: ' + info['nvrtc_error']}", file=sys.stderr)
    for T in tokens:
        ok, reason = guard_decision(shape, T, dtype, 90, global_experts)
        row = {"model": shape.name, "dtype": dtype, "tokens": T, "arch": "sm_90",
               "guard": "take" if ok else f"delegate: {reason}"}
        if info["nvrtc_path"] and T <= 64:
            try:
                row["kernels"] = compile_report(shape, T, dtype, 90, global_experts)
            except _lib.OpgraftError as e:
                row["compile_error"] = str(e)
        rows.append(row)
    err = oracle_selfcheck()
    rc = 0 if err < 1e-9 else 1
    doc = {"gpu": None, "why": why, "oracle_selfcheck_rel_diff": err, "rows": rows}
    if json_to == "-":
        print(json.dumps(doc, indent=1))
        return rc
    w = max([16] + [len(r["model"]) for r in rows])  # a long model name widens the column
    print(f"{'model':<{w}} {'dt':<4} {'T':>4}  {'guard (sm_90)':<44} kernels (registers / spill bytes)")
    for r in rows:
        ks = ", ".join(f"{k['kernel']} {k['registers']}r/{k['spill_bytes']}s" for k in r.get("kernels", []))
        print(f"{r['model']:<{w}} {r['dtype']:<4} {r['tokens']:>4}  {r['guard'][:44]:<44} "
              f"{ks or r.get('compile_error', '-')}")
    print(f"C fp64 oracle vs Python loop, small bf16 problem: max relative difference {err:.1e}")
    if json_to:
        rc = max(rc, _write_json(json_to, doc))
    if plot:
        print(f"--plot {plot}: not written: nothing is timed without a GPU", file=sys.stderr)
    return rc


def _write_json(path: str, doc: dict) -> int:
    """Writes doc to path and says so; 0, or 1 with the reason."""
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    except OSError as e:
        print(f"error: cannot write {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"{len(doc.get('rows', []))} rows written to {path}", file=sys.stderr)
    return 0


def _check_outputs(outputs: dict, need_plot: bool = False) -> bool:
    """The files a command will write, checked before any work ({flag: path or None}; "-" for
    --json is stdout); with need_plot, that matplotlib can be imported."""
    from ._entry import check_outputs

    ok = check_outputs("opgraft", {k: v for k, v in outputs.items() if v not in (None, "-")})
    if need_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("opgraft: error: --plot needs matplotlib, which is not installed (pip install matplotlib)",
                  file=sys.stderr)
            ok = False
    return ok


def _keep_rows(what: str, measure, rows: list) -> int:
    """Runs measure(), which appends to rows as it goes: 0, or 130 on an interrupt and 1 on a
    failure (said on stderr), with the rows measured so far kept for the caller to write."""
    try:
        measure()
    except KeyboardInterrupt:
        print("\ninterrupted: results so far", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"error: the {what} failed after {len(rows)} rows: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _gpu_bench(run, format_table) -> tuple[list[dict], int]:
    """The GPU part of every bench: the read ceiling, then run(ceiling, rows), which appends the
    rows as they are measured. An interrupt (exit 130) or a failure (exit 1) keeps the rows so
    far; their table is printed in every case. Returns (rows, rc)."""
    from . import bench

    rows: list[dict] = []

    def measure():
        ceiling = bench.measure_read_ceiling("cuda")
        print(f"read ceiling: {ceiling:.3f} TB/s (16-byte streaming reads of 4 GiB)", file=sys.stderr)
        run(ceiling, rows)

    rc = _keep_rows("bench", measure, rows)
    print(format_table(rows))
    return rows, rc


def _write_rows(path: str | None, rows: list[dict]) -> int:
    """A GPU bench's --json: "-" prints the rows, a file gets them (each row carries the run's
    facts and read ceiling). 0, or 1 with the reason."""
    if path == "-":
        print(json.dumps({"rows": rows}, indent=1))
        return 0
    return _write_json(path, {"rows": rows}) if path else 0


def cmd_bench(args) -> int:
    if args.layers < 1:
        print("error: --layers must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.between_mib <= 4096:
        print("error: --between-mib must be in 0..4096", file=sys.stderr)
        return 2
    if args.max_tokens is not None:
        if not 1 <= args.max_tokens <= 64:
            print("error: --max-tokens must be in 1..64", file=sys.stderr)
            return 2
        os.environ["OPGRAFT_TUNE_MOE_MAX_TOKENS"] = str(args.max_tokens)
    fp8 = args.dtype in FP8_DTYPES
    if fp8:  # the shipped rule takes FP8 at few tokens only; the bench times the kernels at every T
        os.environ.setdefault("OPGRAFT_TUNE_MOE_FP8", "1")
    if args.ep != 1 and not fp8:
        print("error: --ep takes the FP8 dtypes (fp8-block, fp8-tensor)", file=sys.stderr)
        return 2
    if fp8 and args.layers != 1:
        print("error: --layers is for bf16/fp16 (the FP8 bench rotates routings over one layer)", file=sys.stderr)
        return 2
    try:
        shape = resolve(args.model).per_rank(args.tp)
        global_experts = 0
        if args.ep != 1:
            if args.ep < 1 or shape.num_experts % args.ep:
                raise ConfigError(f"{shape.name}: {shape.num_experts} experts do not split {args.ep} ways")
            global_experts = shape.num_experts
            shape = MoeShape(f"{shape.name}/ep{args.ep}", shape.num_experts // args.ep, shape.hidden, shape.inter,
                             shape.top_k)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok, why = _gpu_status()
    if not _check_outputs({"--json": args.json, "--plot": args.plot}, need_plot=bool(args.plot) and ok):
        return 2
    if not ok:
        return _cpu_bench(shape, args.tokens, args.dtype, why, args.json, args.plot, global_experts)
    from .bench import moe as moe_bench

    t0 = time.time()

    def progress(T):
        print(f"[{time.time() - t0:6.1f} s] {shape.name} {args.dtype} T={T} ...", file=sys.stderr, flush=True)

    def run_fp8(ceiling, rows):
        weights = moe_bench.make_weights_fp8(shape, args.dtype, "cuda")
        for T in args.tokens:
            progress(T)
            rows += moe_bench.bench_shape_fp8(shape, [T], args.dtype, ceiling_tbps=ceiling, weights=weights,
                                              global_experts=global_experts, between_mib=args.between_mib,
                                              timing=args.timing, flashinfer_build=args.flashinfer_build)

    def run(ceiling, rows):
        w13, w2 = moe_bench.make_weights(shape, args.dtype, "cuda")
        extra = [moe_bench.make_weights(shape, args.dtype, "cuda", seed=1 + i) for i in range(args.layers - 1)]
        if args.layers > 1:
            print(f"{args.layers} layers of weights: {args.layers * shape.num_experts * shape.expert_bytes() / 2**30:.1f} GiB",
                  file=sys.stderr)
        for T in args.tokens:
            progress(T)
            rows += moe_bench.bench_shape(shape, [T], args.dtype, ceiling_tbps=ceiling, w13=w13, w2=w2,
                                          baseline=not args.no_baseline, extra_layers=extra,
                                          between_mib=args.between_mib, timing=args.timing)

    rows, rc = _gpu_bench(run_fp8 if fp8 else run, moe_bench.format_table)
    if args.plot and not write_plot(rows, args.plot):
        rc = rc or 1
    failed = _write_rows(args.json, rows)
    return rc or failed


def linear_args_struct(N: int, K: int, M: int, dtype: str, arch: int) -> _lib.LinearArgs:
    """Arguments that describe a linear shape only (fake aligned pointers): for the guard and
    the compiler."""
    a = _lib.LinearArgs()
    a.struct_size = ctypes.sizeof(_lib.LinearArgs)
    a.dtype = a.weight_dtype = a.bias_dtype = a.out_dtype = _lib.DTYPE_FP16 if dtype == "fp16" else _lib.DTYPE_BF16
    a.rows, a.out_features, a.in_features = M, N, K
    a.x = a.weight = a.out = 1 << 20  # never dereferenced: the guard and the compiler look at shapes only
    a.x_stride[:] = [K, 1]
    a.weight_stride[:] = [K, 1]
    a.out_stride[:] = [N, 1]
    if dtype == "fp8-block":  # e4m3 weights with fp32 scales per 128x128 block, x and y bf16
        a.weight_dtype, a.scale_dtype, a.block_n, a.block_k = _lib.DTYPE_FP8_E4M3, _lib.DTYPE_FP32, 128, 128
        a.weight_scale = 1 << 20
        a.weight_scale_stride[:] = [-(-K // 128), 1]
    a.arch = arch
    return a


def _linear_presets(dtype: str) -> dict:
    from .presets import LINEAR_FP8_PRESETS, LINEAR_PRESETS

    return LINEAR_FP8_PRESETS if dtype == "fp8-block" else LINEAR_PRESETS


def _linear_models(text: str | None, dtype: str) -> list[str]:
    """The --models names for this dtype (all of its presets without the option); ValueError
    naming the choices where one is not among them."""
    presets = _linear_presets(dtype)
    if text is None:
        return list(presets)
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in presets for m in names):
        raise ValueError(f"--models with --dtype {dtype} takes names from {', '.join(presets)}; got {text!r}")
    return names


def _compile_sm90(report, a) -> dict:
    """{"kernel": name, registers, spill bytes} of the one kernel an op's compile report (report:
    opgraft_<op>_compile_report) builds for a on sm_90, or {"compile_error": why}."""
    ki, n = _lib.KernelInfo(), ctypes.c_int32()
    if report(ctypes.byref(a), 90, ctypes.byref(ki), 1, ctypes.byref(n)) == _lib.OK:
        return {"kernel": {"name": ki.name.decode(), "registers": ki.registers,
                           "spill_bytes": ki.spill_store_bytes + ki.spill_load_bytes}}
    return {"compile_error": _lib.lib().opgraft_last_error().decode()}


def _cpu_bench_linear(models: list[str], rows_m: list[int], dtype: str, why: str, json_to: str | None = None) -> int:
    """What runs without a GPU; json_to as _cpu_bench's."""
    presets = _linear_presets(dtype)

    print(f"no GPU here ({why}): the guard's decision and the NVRTC compile of each shape's kernel for sm_90 "
          f"with its resource report.", file=sys.stderr)
    info = _lib.runtime_info()
    rows = []
    for m in models:
        for s in presets[m]:
            row = {"op": "linear", "model": s.model, "proj": s.proj, "N": s.out_features, "K": s.in_features,
                   "dtype": dtype, "arch": "sm_90", "guard": {}}
            for M in rows_m:
                a = linear_args_struct(s.out_features, s.in_features, M, dtype, 90)
                reason = ctypes.create_string_buffer(256)
                st = _lib.lib().opgraft_linear_supports(ctypes.byref(a), reason, len(reason))
                row["guard"][M] = "take" if st == _lib.OK else f"delegate: {reason.value.decode()}"
            a = linear_args_struct(s.out_features, s.in_features, 1, dtype, 90)
            buf = ctypes.create_string_buffer(512)
            _lib.check(_lib.lib().opgraft_linear_describe(ctypes.byref(a), 90, buf, len(buf)))
            row["config"] = " ".join(o.split("=", 1)[0][5:].lower() + "=" + o.split("=", 1)[1]
                                     for o in buf.value.decode().split() if o.startswith("-DOG_") and "DTYPE" not in o)
            if info["nvrtc_path"]:
                row.update(_compile_sm90(_lib.lib().opgraft_linear_compile_report, a))
            rows.append(row)
    doc = {"gpu": None, "why": why, "rows": rows}
    if json_to == "-":
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{'model':<18} {'proj':<8} {'N':>7} {'K':>6}  {'guard (sm_90)':<34} configuration; registers / spill bytes")
    for r in rows:
        guard = " ".join(f"M={M}:" + ("take" if g == "take" else "no") for M, g in r["guard"].items())
        k = r.get("kernel")
        res = f"{k['registers']}r/{k['spill_bytes']}s" if k else r.get("compile_error", "-")[:60]
        print(f"{r['model']:<18} {r['proj']:<8} {r['N']:>7} {r['K']:>6}  {guard:<34} {r['config']}; {res}")
    return _write_json(json_to, doc) if json_to else 0


def cmd_bench_linear(args) -> int:
    if not 0 <= args.between_mib <= 4096:
        print("error: --between-mib must be in 0..4096", file=sys.stderr)
        return 2
    try:
        models = _linear_models(args.models, args.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.norm and args.dtype == "fp8-block":
        print("error: --norm takes 16-bit weights (the add + RMSNorm form has no FP8 kernel)", file=sys.stderr)
        return 2
    if not _check_outputs({"--json": args.json}):
        return 2
    ok, why = _gpu_status()
    if not ok:
        return _cpu_bench_linear(models, args.rows, args.dtype, why, args.json)
    from .bench import linear as linear_bench

    t0 = time.time()

    def run(ceiling, rows):
        progress = lambda msg: print(f"[{time.time() - t0:6.1f} s] {msg} ...", file=sys.stderr, flush=True)  # noqa: E731
        for m in models:
            if args.norm:
                for shape in _linear_presets(args.dtype)[m]:
                    if shape.proj in linear_bench.NORM_FED:
                        rows += linear_bench.bench_norm_shape(shape, args.rows, args.dtype, ceiling_tbps=ceiling,
                                                              between_mib=args.between_mib, timing=args.timing,
                                                              progress=progress)
                continue
            rows += linear_bench.bench_models(
                [m], args.rows, args.dtype, ceiling_tbps=ceiling, between_mib=args.between_mib, timing=args.timing,
                progress=progress)

    rows, rc = _gpu_bench(run, linear_bench.format_table)
    failed = _write_rows(args.json, rows)
    return rc or failed


def _parse_ints(text: str, what: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",")]  # an empty item ("1,,2", "1,") is an error too
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} takes comma-separated integers, got {text!r}") from None
    if not vals or any(v < lo or v > hi for v in vals):
        raise argparse.ArgumentTypeError(f"{what} values must be between {lo} and {hi}")
    return vals


def _parse_names(text: str, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:  # "," or "" would otherwise mean every name
        raise argparse.ArgumentTypeError(f"{what} takes comma-separated names, got {text!r}")
    return names


def attention_args_struct(heads_q: int, heads_kv: int, head_size: int, batch: int, dtype: str, arch: int,
                          block_size: int = 16, prologue: bool = False) -> _lib.AttentionArgs:
    """Arguments that describe a decode-attention shape only (fake aligned pointers, vLLM's NHD
    cache strides): for the guard and the compiler. prologue: the call that writes its new keys
    after Qwen3's q/k norm and NeoX rotary embedding."""
    a = _lib.AttentionArgs()
    a.struct_size = ctypes.sizeof(_lib.AttentionArgs)
    a.dtype = a.kv_dtype = _lib.DTYPE_BF16 if dtype == "bf16" else _lib.DTYPE_FP16
    a.batch, a.query_len, a.num_heads, a.num_kv_heads, a.head_size = batch, 1, heads_q, heads_kv, head_size
    a.block_size, a.num_blocks, a.max_blocks = block_size, 1 << 16, 4096
    a.scale, a.window_left = head_size ** -0.5, -1
    fake = 1 << 20  # never dereferenced
    a.q = a.k_cache = a.v_cache = a.block_table = a.seq_lens = a.out = fake
    a.q_stride[:] = a.out_stride[:] = [heads_q * head_size, head_size, 1]
    a.k_stride[:] = a.v_stride[:] = [block_size * heads_kv * 2 * head_size, heads_kv * 2 * head_size, 2 * head_size, 1]
    a.block_table_dtype = a.seq_lens_dtype = _lib.DTYPE_INT32
    a.block_table_stride[:] = [4096, 1]
    a.arch = arch
    if prologue:
        a.k_new = a.v_new = a.slot_mapping = a.q_norm_weight = a.k_norm_weight = a.cos_sin_cache = a.positions = fake
        a.k_new_stride[:] = a.v_new_stride[:] = [(heads_q + 2 * heads_kv) * head_size, head_size]
        a.slot_mapping_dtype = a.positions_dtype = _lib.DTYPE_INT64
        a.qk_norm_dtype = a.cos_sin_dtype = a.dtype
        a.qk_norm_eps, a.rope_style, a.cos_sin_stride, a.rope_rows = 1e-6, _lib.ROPE_NEOX, head_size, 40960
    return a


def _attention_points(args):
    from .presets import ATTENTION_POINTS, ATTENTION_PRESETS, AttnShape

    if args.model is None:
        return ATTENTION_POINTS, ATTENTION_PRESETS
    presets = dict(ATTENTION_PRESETS)
    if args.model not in presets:
        try:
            hq, hk, d = (int(x) for x in args.model.split("/"))
        except ValueError:
            raise ValueError(f"--model {args.model!r} is neither a preset ({', '.join(ATTENTION_PRESETS)}) nor HQ/HKV/D") from None
        if not all(0 < v <= 1 << 16 for v in (hq, hk, d)):
            raise ValueError(f"--model {args.model!r}: HQ, HKV and D must be integers in 1..65536")
        presets[args.model] = AttnShape(args.model, hq, hk, d)
    return [(args.model, b, c) for b in args.batch for c in args.context], presets


def _cpu_bench_attention(args, why: str) -> int:
    print(f"no GPU here ({why}): running what works without one -- the guard and the NVRTC compile of the "
          f"kernel for sm_90 with its resource report.", file=sys.stderr)
    try:
        points, presets = _attention_points(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = _lib.runtime_info()
    rows = []
    for name, batch, context in points:
        s = presets[name]
        a = attention_args_struct(s.heads_q, s.heads_kv, s.head_size, batch, args.dtype, 90, prologue=args.prologue)
        reason = ctypes.create_string_buffer(256)
        st = _lib.lib().opgraft_attention_supports(ctypes.byref(a), reason, len(reason))
        row = {"op": "attention", "model": name, "batch": batch, "context": context, "heads_q": s.heads_q,
               "heads_kv": s.heads_kv, "head_size": s.head_size, "arch": "sm_90",
               "guard": "take" if st == _lib.OK else f"delegate: {reason.value.decode()}"}
        if info["nvrtc_path"] and st == _lib.OK:
            row.update(_compile_sm90(_lib.lib().opgraft_attention_compile_report, a))
        rows.append(row)
    doc = {"gpu": None, "why": why, "rows": rows}
    if args.json == "-":
        print(json.dumps(doc, indent=1))
        return 0
    for r in rows:
        k = r.get("kernel")
        print(f"{r['model']:<14} batch {r['batch']:>3} context {r['context']:>6}  {r['guard'][:40]:<40} "
              f"{(k['name'] + ' ' + str(k['registers']) + 'r/' + str(k['spill_bytes']) + 's') if k else r.get('compile_error', '-')}")
    return _write_json(args.json, doc) if args.json else 0


def cmd_bench_attention(args) -> int:
    # The bench times every batch size; attention.max_batch (where vLLM's FA3 takes over) is the
    # guard's business in vLLM.
    os.environ.setdefault("OPGRAFT_TUNE_ATTENTION_MAX_BATCH", "4096")
    if not 0 <= args.between_mib <= 4096:
        print("error: --between-mib must be in 0..4096", file=sys.stderr)
        return 2
    if args.reps < 1 or args.hint < 0:
        print("error: --reps must be at least 1 and --hint at least 0", file=sys.stderr)
        return 2
    from .bench import attention as ab

    known = (ab.PROLOGUE_ALONE_IMPLS if args.prologue_rows else ab.PROLOGUE_IMPLS if args.prologue else ab.IMPLS)
    impls = known if args.impls is None else tuple(args.impls.split(","))
    unknown = [i for i in impls if i not in known]
    if unknown:
        print(f"error: unknown --impls {', '.join(unknown)} (have: {', '.join(known)})", file=sys.stderr)
        return 2
    if not _check_outputs({"--json": args.json}):
        return 2
    ok, why = _gpu_status()
    if not ok and args.prologue_rows:
        print(f"no GPU here ({why}): the prologue-alone bench times kernels and has nothing to run without one "
              f"(its kernel's NVRTC compile is checked by the C tests).", file=sys.stderr)
        return 0
    if not ok:
        return _cpu_bench_attention(args, why)
    try:
        points, presets = _attention_points(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prologue_rows:
        return _bench_prologue_alone(args, points, presets, impls, ab)

    def run(ceiling, rows):
        for point in points:
            rows += ab.bench_rows(ceiling, [point], args.dtype, args.reps, args.between_mib, args.hint, impls,
                                  progress=lambda m: print(m, file=sys.stderr, flush=True), shapes=presets,
                                  prologue=args.prologue)

    rows, rc = _gpu_bench(run, ab.format_table)
    failed = _write_rows(args.json, rows)
    return rc or failed


def _bench_prologue_alone(args, points, presets, impls, ab) -> int:
    """opgraft bench attention --prologue-rows: the q/k norm + rotary alone on each model's rows."""
    models = list(dict.fromkeys(name for name, _, _ in points))

    def run(ceiling, rows):
        for name in models:
            for n in args.prologue_rows:
                rows += ab.bench_prologue_alone(presets[name], n, args.dtype, ceiling, args.reps, args.between_mib,
                                                impls, progress=lambda m: print(m, file=sys.stderr, flush=True))

    rows, rc = _gpu_bench(run, ab.format_table)
    failed = _write_rows(args.json, rows)
    return rc or failed


def write_plot(rows: list[dict], path: str) -> bool:
    """Time against tokens, one line per implementation, with the byte floor (bytes over the
    measured read ceiling) drawn as the roofline. Needs matplotlib; says so if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
        return False
    timed = [r for r in rows if r.get("median_us")]
    if not timed:
        print("nothing measured: no plot written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in sorted({r["impl"] for r in timed}):
        pts = sorted((r["tokens"], r["median_us"]) for r in timed if r["impl"] == impl)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    floor = sorted({(r["tokens"], r["bytes"] / (r["ceiling_tbps"] * 1e12) * 1e6) for r in timed if r.get("ceiling_tbps")})
    if floor:
        ax.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="byte floor (roofline)")
    r0 = timed[0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs per call")
    ax.set_title(f"{r0['model']} {r0['dtype']} MoE experts on {r0.get('gpu', '?')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)
    return True


VERDICTS = {
    "bandwidth": "bandwidth-bound: within 15% of the byte floor; stop tuning, move fewer bytes",
    "latency": "launch/latency-bound: fixed costs (kernel ramps and tails, routing setup) dominate a "
               "short call; fuse stages or overlap launches",
    "occupancy": "occupancy-bound: too few bytes in flight for the bandwidth; run `opgraft tune`",
}


def verdict(us: float, nbytes: float, ceiling_tbps: float) -> str:
    """Classifies one timing against the byte floor measured in the same run."""
    floor_us = nbytes / (ceiling_tbps * 1e12) * 1e6
    frac = floor_us / us if us > 0 else 0.0
    if frac >= 0.85:
        return "bandwidth"
    if floor_us < 40.0 and us - floor_us >= 4.0:
        return "latency"
    return "occupancy"


def _shape_tokens(args):
    try:
        return resolve(args.model).per_rank(getattr(args, "tp", 1)), None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2


def cmd_profile(args) -> int:
    shape, rc = _shape_tokens(args)
    if shape is None:
        return rc
    if not _check_outputs({"--json": args.json}):
        return 2
    ok, why = _gpu_status()
    if not ok:
        return _cpu_bench(shape, args.tokens, args.dtype, why, args.json)
    from . import bench
    from .bench.moe import FP8_KINDS, make_weights, make_weights_fp8

    ceiling = bench.measure_read_ceiling("cuda")
    make = make_weights_fp8 if args.dtype in FP8_KINDS else make_weights
    weights = make(shape, args.dtype, "cuda")
    rows: list[dict] = []
    print(f"read ceiling {ceiling:.3f} TB/s; {shape.name} {args.dtype}")
    print(f"{'T':>3} {'stage':<8} {'us':>9} {'MB':>8} {'TB/s':>6} {'ceil%':>6}  verdict")
    rc = _keep_rows("profile", lambda: _profile_rows(args, shape, ceiling, weights, rows), rows)
    if args.json:
        failed = _write_json(args.json, {"gpu": bench.gpu_facts(), "rows": rows})
        rc = rc or failed
    return rc


def _profile_rows(args, shape, ceiling, weights, rows: list) -> None:
    """Times each token count's stages; appends the rows and prints them as they come. weights:
    (w13, w2), or make_weights_fp8's four tensors for the FP8 dtypes."""
    from .bench.moe import FP8_KINDS, Fixture, Fp8Fixture
    from .ops import moe as ops

    for T in args.tokens:
        if args.dtype in FP8_KINDS:
            fx = Fp8Fixture(shape, T, args.dtype, weights=weights)
        else:
            fx = Fixture(shape, T, args.dtype, w13=weights[0], w2=weights[1])
        err = fx.check()
        if err > fx.tolerance:
            print(f"{T:>3} kernel output wrong (rel err {err:.2e}): not profiled")
            continue
        b_all = fx.bytes
        parts = {"all": (fx.time(ops.STAGE_ALL), b_all), "gate_up": (fx.time(ops.STAGE_GATE_UP), b_all * 2 / 3),
                 "down": (fx.time(ops.STAGE_DOWN), b_all / 3)}
        for stage, (us, nb) in parts.items():
            v = verdict(us, nb, ceiling)
            tbps = nb / (us * 1e-6) / 1e12
            rows.append({"model": shape.name, "dtype": args.dtype, "tokens": T, "stage": stage, "median_us": us,
                         "bytes": nb, "tbps": tbps, "fraction_of_ceiling": tbps / ceiling, "verdict": v,
                         "ceiling_tbps": ceiling, "rel_err": err})
            print(f"{T:>3} {stage:<8} {us:>9.1f} {nb / 1e6:>8.1f} {tbps:>6.2f} {tbps / ceiling * 100:>5.1f}%  "
                  f"{VERDICTS[v] if stage == 'all' else v}")


# Keys the FP8 MoE kernels do not read (they have no cooperative kernel, no one-token paths and
# one gate_up token pass): the tuner skips them for the FP8 dtypes.
_FP8_UNUSED = ("moe.fused", "moe.gate_up.nt", "moe.gate_up.one_token", "moe.down.one_token")
# Keys only the FP8 kernels read: the tuner skips them for bf16 and fp16.
_FP8_ONLY = ("moe.fp8_kstep", "moe.gate_up.fp8_rows")


def _tune_fixtures(args, shape=None):
    """(fixture, (lo, hi)) for the op and points of a tune command, made one at a time as the
    tuner reaches them: each tunes the token (moe, shape: the rank's MoE shape), batch (attention)
    or row (linear) range around its own count."""
    from .tune import token_ranges

    if args.op == "moe":
        from .bench.moe import FP8_KINDS, Fixture, Fp8Fixture, make_weights, make_weights_fp8

        ts = sorted(set(args.tokens))
        if args.dtype in FP8_KINDS:
            w = make_weights_fp8(shape, args.dtype, "cuda")
            fxs = (Fp8Fixture(shape, T, args.dtype, weights=w) for T in ts)
        else:
            w13, w2 = make_weights(shape, args.dtype, "cuda")
            fxs = (Fixture(shape, T, args.dtype, w13=w13, w2=w2) for T in ts)
        yield from zip(fxs, token_ranges(ts))
        return
    if args.op == "attention":
        from .bench.attention import TuneFixture
        from .presets import ATTENTION_PRESETS

        # Every batch is timed; the guard's attention.max_batch decides in vLLM.
        os.environ.setdefault("OPGRAFT_TUNE_ATTENTION_MAX_BATCH", "4096")
        shape = ATTENTION_PRESETS[args.model]
        bs = sorted(set(args.batch))
        hi = _lib.tune_range("attention.max_batch")[1]
        for b, r in zip(bs, token_ranges(bs, upper=hi)):
            yield TuneFixture(shape, b, args.context, args.dtype), r
        return
    from .bench.linear import TuneFixture
    from .ops.linear import MAX_ROWS
    from .presets import LINEAR_PRESETS

    ms = sorted(set(args.rows))
    for s in LINEAR_PRESETS[args.model]:
        if args.proj and s.proj not in args.proj:
            continue
        weights = None  # one set of weight copies for the shape's row counts
        for M, r in zip(ms, token_ranges(ms, upper=MAX_ROWS)):
            fx = TuneFixture(s, M, args.dtype, weights=weights)
            weights = fx.weights
            yield fx, r


def _tune_space(args) -> dict:
    space = _lib.tune_space(args.op)
    if args.op == "moe":
        skip = _FP8_UNUSED if args.dtype.startswith("fp8") else _FP8_ONLY
        space = {k: v for k, v in space.items() if k not in skip}
    if args.keys:
        unknown = [k for k in args.keys if k not in space]
        if unknown:
            raise ValueError(f"--keys: {', '.join(unknown)} not among the tuned keys ({', '.join(space)})")
        space = {k: space[k] for k in args.keys}
    return space


def cmd_tune(args) -> int:
    shape = None
    if args.op == "moe":
        try:
            shape = resolve(args.model).per_rank(args.tp)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.op == "linear" and args.proj:
        from .presets import LINEAR_PRESETS

        names = [s.proj for s in LINEAR_PRESETS[args.model]]
        unknown = [p for p in args.proj if p not in names]
        if unknown:
            print(f"error: --proj: {', '.join(unknown)} not a projection of {args.model} ({', '.join(names)})",
                  file=sys.stderr)
            return 2
    if args.rounds < 1:
        print("error: --rounds must be at least 1", file=sys.stderr)
        return 2
    if not _check_outputs({"--out": args.out, "--report": args.report}):
        return 2
    try:
        if args.out:
            from .tune import read_tune_file

            read_tune_file(args.out)  # a file it could not merge into fails now, not after the first point
        space = _tune_space(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok, why = _gpu_status()
    if not ok:
        print(f"error: tune measures on a GPU and there is none here ({why})", file=sys.stderr)
        return 2
    import datetime

    import torch

    from . import bench
    from .tune import coordinate_descent, inject_baked, make_entries, merge_tune_file

    table = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src",
                         "ops", args.op, "table.c")
    if args.inject and not args.out and not os.path.exists(table):
        print(f"error: --inject without --out writes src/ops/{args.op}/table.c of a source checkout, and there is "
              "none here: give --out FILE (then set OPGRAFT_TUNE_FILE=FILE)", file=sys.stderr)
        return 2
    p = torch.cuda.get_device_properties(0)
    arch, gpu = p.major * 10 + p.minor, p.name
    winners, report = [], []
    date = datetime.date.today().isoformat()
    total = sum(len(v) for v in space.values())
    for fx, rng in _tune_fixtures(args, shape):
        bench.configure({}, fx.forget_plans)
        start = {k: _lib.tune_get(k, arch, gpu, fx.tune_key, fx.tokens)[0] for k in space}
        n = [0]

        def cost(cfg, fx=fx):
            bench.configure(cfg, fx.forget_plans)
            err = fx.check()
            return fx.time() if err <= fx.tolerance else float("inf")

        def progress(msg, fx=fx):
            n[0] += 1
            print(f"\r  {fx.label} [{n[0]:>3}/{total * args.rounds}] {msg[:60]:<60}", end="", file=sys.stderr,
                  flush=True)

        try:
            best, best_us, hist = coordinate_descent(cost, space, start, rounds=args.rounds, progress=progress)
        except RuntimeError as e:  # not even the starting configuration passed its check
            print(f"\n{fx.label}: {e}", file=sys.stderr)
            bench.configure({}, fx.forget_plans)
            return 1
        print(file=sys.stderr)
        start_us = hist[0][1]
        changed = {k: v for k, v in best.items() if start.get(k) != v}
        print(f"{fx.label} ({rng[0]}-{rng[1]}): {start_us:.2f} -> {best_us:.2f} us "
              f"({fx.bytes / (best_us * 1e-6) / 1e12:.2f} TB/s) {changed or 'no change'}")
        report.append({"point": fx.label, "shape": fx.tune_key, "tokens": list(rng), "start": start,
                       "start_us": round(start_us, 3), "best": best, "best_us": round(best_us, 3),
                       "tried": len(hist)})
        won = [{"arch": arch, "gpu": gpu, "shape": fx.tune_key, "tokens": rng, "values": changed,
                "why": f"opgraft tune {date}: {fx.label} {start_us:.2f} -> {best_us:.2f} us"}] if changed else []
        winners += won
        bench.configure({}, fx.forget_plans)
        # Each point's result is kept as soon as it exists (a long run may be stopped).
        if args.report and _write_json(args.report, {"gpu": gpu, "arch": arch, "op": args.op, "rows": report}):
            return 1
        if args.out and won:
            merge_tune_file(args.out, make_entries(won))
    entries = make_entries(winners)
    if args.out:
        print(f"wrote {len(entries)} entries to {args.out} (use it with OPGRAFT_TUNE_FILE={args.out})")
    elif args.inject:
        n_rows = inject_baked(table, entries)
        print(f"wrote {n_rows} rows to {table}: rebuild libopgraft to use them")
    else:
        print(json.dumps({"entries": entries}, indent=1))
    return 0


def _pkg_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def dispatch_variant(op: str) -> str:
    from . import dispatch

    return dispatch.selected_variant(op)


def cmd_doctor(args) -> int:
    """What opgraft would do in a vLLM process on this machine, and why."""
    from .vllm import attn_seam, moe_seam, platform_gate
    from .vllm.compat import switched_on

    out = []
    say = lambda k, v: out.append(f"{k:<22} {v}")
    import opgraft

    say("opgraft", opgraft.__version__)
    for pkg in ("vllm", "torch"):
        say(pkg, _pkg_version(pkg))
    arch = 0
    ok, why = _gpu_status()
    if ok:
        import torch

        p = torch.cuda.get_device_properties(0)
        arch = p.major * 10 + p.minor
        say("GPU", f"{p.name} (sm_{arch}, {p.multi_processor_count} SMs)")
    else:
        say("GPU", f"none ({why})")
    try:
        lib = _lib.lib()
        say("libopgraft", f"{lib._name} (version {lib.opgraft_version_string().decode()})")
        # The library's own answers: what it loaded, and whether it can keep kernels on disk.
        info = _lib.runtime_info()
        dv = info["driver_version"]
        say("libcuda", f"{info['libcuda_path']} (driver API {dv // 1000}.{dv % 1000 // 10})" if info["libcuda_path"]
            else f"not usable: {info['libcuda_error']}")
        nv = info["nvrtc_version"]
        say("NVRTC", f"{info['nvrtc_path']} ({nv // 1000}.{nv % 1000 // 10})" if nv else
            f"not usable: {info['nvrtc_error']}")
        cache, why = _lib.cache_check()
        say("kernel cache", f"{cache} (writable)" if not why else
            f"{cache or 'none'} (not usable: {why}; compiled kernels are kept in memory only)")
    except _lib.OpgraftError as e:
        say("libopgraft", f"not usable: {e}")
    if switched_on("OPGRAFT_DISABLE"):  # as register() reads it
        say("seams", "none: OPGRAFT_DISABLE is set")
    elif _pkg_version("vllm") == "not installed":
        say("seams", "none: vLLM is not installed")
    else:
        gate_ok, gate_why = platform_gate()
        say("platform gate", "pass" if gate_ok else f"closed ({gate_why}): nothing would be patched")
        cls, why = moe_seam._target()
        sig = cls is not None and moe_seam._signature_matches(cls.__dict__.get("apply"))
        say("MoE seam", "TritonExperts.apply: ready" if sig else f"unavailable: {why or 'unexpected signature'}")
        try:
            override = attn_seam.requested_backend()
            say("attention seam", f"inject {override}" if override else "pass-through")
        except ValueError as e:
            say("attention seam", f"not installed: {e}")
        say("decode attention", f"opgraft kernel for FLASH_ATTN decode (variant {dispatch_variant('attention')})"
            if attn_seam.kernel_enabled() else "off (OPGRAFT_ATTENTION=0): vLLM's FlashAttention as shipped")
        from . import dispatch
        from .vllm import linear_seam

        say("MoE variant", dispatch.selected_variant())
        off = linear_seam.disabled()
        targets, _, lwhy = linear_seam._targets()
        say("linear seam", off or (f"ready, variant {dispatch.selected_variant('linear')}" if targets
                                   else f"unavailable: {lwhy}"))
        fp8_cls, _, _, fwhy = linear_seam._fp8_target()
        say("block-FP8 linear", off or ("off (OPGRAFT_LINEAR_FP8=0): vLLM's FP8 kernels" if linear_seam.fp8_disabled()
                                        else "ready: Fp8LinearMethod layers with block scales, up to linear.max_rows"
                                        if fp8_cls else f"unavailable: {fwhy}"))
        from .vllm import norm_seam

        noff = norm_seam.disabled()
        ncls, nwhy = (None, "") if noff else norm_seam._target()
        say("norm fusion", noff or ("ready: add + RMSNorm in the qkv projection's kernel, in graphs of up to "
                                    "linear.norm_rows tokens" if ncls else f"unavailable: {nwhy}"))
        moe_on = norm_seam.moe_switch()
        say("norm fusion, MoE", noff or ("off (OPGRAFT_NORM_FUSION_MOE=1 turns it on)" if moe_on is False else
                                         "ready: add + RMSNorm in a MoE layer's router gate, which also writes the "
                                         "normalized rows (" + ("OPGRAFT_NORM_FUSION_MOE=1)" if moe_on
                                                                else "models with the q/k epilogue; "
                                                                "OPGRAFT_NORM_FUSION_MOE=1 every MoE model)")))
        from .vllm import rope_seam

        say("attention prologue", rope_seam.disabled() or "ready: q/k RMSNorm and rotary embedding in the attention "
            "kernel (" + ("every model, OPGRAFT_ATTENTION_PROLOGUE=1)" if rope_seam.switch_state()
                          else "with the MoE norm form)" if moe_on
                          else "with the MoE norm form where no q/k epilogue takes the graph; "
                          "OPGRAFT_NORM_FUSION_MOE=1 turns both on)" if moe_on is None
                          else "with the MoE norm form, off: OPGRAFT_NORM_FUSION_MOE=1 turns both on)"))
    print("\n".join(out))
    if args.model:
        try:
            shape = resolve(args.model)
            layers = None
            path = config_path(args.model)
            if path:
                from .presets import load_config, moe_layer_count

                layers = moe_layer_count(load_config(path))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        a = arch or 90
        print(f"\n{shape.name}: E={shape.num_experts} H={shape.hidden} I={shape.inter} top_k={shape.top_k}, "
              f"{layers if layers is not None else 'all'} MoE layers; guard at sm_{a}"
              f"{'' if arch else ' (no GPU here: assuming an H200)'}, bf16:")
        for T in (1, 2, 4, 8, 16, 32, 64):
            took, why = guard_decision(shape, T, "bf16", a)
            print(f"  T={T:<3} {'opgraft kernel' if took else 'vLLM (' + why + ')'}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Every parser of the command line, sub-subcommands included (add_subparsers makes parsers of
    its parent's class), shows the defaults."""

    def __init__(self, *args, **kwargs):
        from ._entry import DefaultsHelp

        kwargs.setdefault("formatter_class", DefaultsHelp)
        super().__init__(*args, **kwargs)


def main(argv=None) -> int:
    # stdout is the commands' output (tables, `--json -`): vLLM, imported by some of them, logs to stderr.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import opgraft

    ap = _Parser(prog="opgraft", description="opgraft: faster decode kernels (MoE experts, attention, projections) for stock vLLM")
    ap.add_argument("--version", action="version", version=f"opgraft {opgraft.__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    bench_ops = sub.add_parser("bench", help="benchmark an op at a model's dims").add_subparsers(
        dest="op", required=True, metavar="OP")
    b = bench_ops.add_parser("moe", help="MoE experts after routing, against vLLM's fused_experts")
    b.add_argument("--model", default="Qwen3-30B-A3B", help=MODEL_HELP)
    b.add_argument("--tokens", type=_parse_tokens, default="1,2,4,8,16,32,64", help=TOKENS_HELP)
    b.add_argument("--dtype", choices=["bf16", "fp16", *FP8_DTYPES], default="bf16",
                   help="activations and weights; fp8-block: FP8 weights with 128x128 block scales and 1x128 "
                        "activation groups (DeepSeek-V3, Qwen3 FP8), fp8-tensor: per-tensor scales (Mixtral FP8); "
                        "both against vLLM's own FP8 path")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: bench one rank's shape (I/tp)")
    b.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (FP8 dtypes): one rank's E/ep experts with an expert_map")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the rows as JSON to FILE, or to stdout without FILE (default: no JSON)")
    b.add_argument("--no-baseline", action="store_true", help="skip the torch baseline")
    b.add_argument("--max-tokens", type=int, default=None,
                   help="time opgraft's kernel up to this many tokens although the shipped "
                        "moe.max_tokens hands larger calls back to vLLM (OPGRAFT_TUNE_MOE_MAX_TOKENS; "
                        "default: the shipped value)")
    b.add_argument("--layers", type=int, default=1,
                   help="rotate the calls over this many copies of the layer's weights (a model's MoE "
                        "layer count gives a real decode step's footprint)")
    b.add_argument("--between-mib", type=int, default=64,
                   help="read this many MiB of other data before each timed call, as a decode step's "
                        "other kernels do between two MoE layers (0: calls back to back)")
    b.add_argument("--timing", choices=["span", "subtract"], default="span",
                   help="with --between-mib: charge each call from its kernels' start/end times "
                        "(span, torch profiler) or as (read + call) minus the read alone (subtract)")
    b.add_argument("--plot", default=None, metavar="FILE",
                   help="write a PNG: time against tokens with the roofline (needs matplotlib; default: no plot)")
    b.add_argument("--flashinfer-build", action="store_true",
                   help="FP8 dtypes: time FlashInfer's CUTLASS MoE even where FlashInfer must compile it first "
                        "(minutes, once per machine; default: that baseline is skipped with the reason)")
    b.set_defaults(fn=cmd_bench)
    from .presets import LINEAR_FP8_PRESETS, LINEAR_PRESETS

    bl = bench_ops.add_parser("linear", help="decode projections (1..8 rows) against torch.nn.functional.linear (fp8-block: vLLM's FP8 kernel)")
    bl.add_argument("--models", default=None,
                    help=f"comma-separated, from {', '.join(LINEAR_PRESETS)}; with --dtype fp8-block from "
                         f"{', '.join(LINEAR_FP8_PRESETS)} (default: all)")
    bl.add_argument("--rows", type=lambda t: _parse_ints(t, "--rows", 1, 8), default=[1, 2, 4, 8],
                    help="row counts M (1..8)")
    bl.add_argument("--dtype", choices=["bf16", "fp16", "fp8-block"], default="bf16",
                    help="fp8-block: e4m3 weights with 128x128 fp32 block scales, bf16 x (ours alone: vLLM's FP8 "
                         "kernel is timed in the engine)")
    bl.add_argument("--norm", action="store_true",
                    help="the projections fed by add + RMSNorm (qkv, gate_up): our one kernel for both against "
                         "the compiled norm followed by our kernel or by torch's linear")
    bl.add_argument("--between-mib", type=int, default=64,
                    help="read this many MiB of other data before each timed call (0: back to back)")
    bl.add_argument("--timing", choices=["subtract", "span"], default="subtract",
                    help="with --between-mib: (read + call) minus the read alone, or from the kernels' start/end "
                         "times (span, torch profiler: slower)")
    bl.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to FILE, or stdout)")
    bl.set_defaults(fn=cmd_bench_linear)
    ba = bench_ops.add_parser("attention", aliases=["attn"],
                              help="paged decode attention, against vLLM's FA3, FlashInfer and Triton decode")
    ba.add_argument("--model", default=None,
                    help="a preset (Qwen3-30B-A3B, Llama-3-8B, head-64, head-256) or HQ/HKV/D, e.g. 32/8/128; "
                         "default: the preset sweep (Qwen3-30B-A3B at batch 1/8 x 192 tokens and 1/8/64 x 1K/8K/32K, "
                         "and the others)")
    ba.add_argument("--batch", type=lambda t: _parse_ints(t, "--batch", 1, 4096), default=[1, 8, 64])
    ba.add_argument("--context", type=lambda t: _parse_ints(t, "--context", 1, 1 << 20), default=[1024, 8192, 32768])
    ba.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ba.add_argument("--reps", type=int, default=20)
    ba.add_argument("--between-mib", type=int, default=64,
                    help="read this many MiB of other data before each timed call (0: back to back)")
    ba.add_argument("--hint", type=int, default=0,
                    help="the max_seq_len our kernel gets (0: unknown, as in a CUDA graph; it caps splits only)")
    ba.add_argument("--impls", default=None,
                    help="the implementations to time (default: opgraft,vllm-fa3,vllm-flashinfer,vllm-triton; "
                         "with --prologue opgraft-fused,norm-rope+opgraft,vllm-qk-norm-rope+opgraft)")
    ba.add_argument("--prologue", action="store_true",
                    help="q/k RMSNorm + rotary embedding + KV-cache write + attention from the qkv output: our "
                         "kernel doing all of it against the compiled norm and rotary (or vLLM's fused_qk_norm_rope) "
                         "followed by our kernel")
    ba.add_argument("--prologue-rows", type=lambda t: _parse_ints(t, "--prologue-rows", 1, 1 << 20), default=None,
                    metavar="T,...",
                    help="instead: the q/k norm + rotary alone on T token rows (a prefill's): our kernel against "
                         "Inductor's compiled norm and rotary and vLLM's copy + fused_qk_norm_rope (--impls "
                         "opgraft-prologue,inductor-norm-rope,vllm-cat-fused)")
    ba.add_argument("--json", nargs="?", const="-", default=None, help="write JSON rows (to FILE, or stdout)")
    ba.set_defaults(fn=cmd_bench_attention)
    profile_ops = sub.add_parser("profile", help="time split and roofline verdict per token count").add_subparsers(
        dest="op", required=True, metavar="OP")
    pr = profile_ops.add_parser("moe", help="MoE experts: gate/up and down stages")
    pr.add_argument("--model", default="Qwen3-30B-A3B", help=MODEL_HELP)
    pr.add_argument("--tokens", type=_parse_tokens, default="1,8", help=TOKENS_HELP)
    pr.add_argument("--dtype", choices=["bf16", "fp16", *FP8_DTYPES], default="bf16",
                    help="the weights' and activations' type (FP8: e4m3 weights, activations quantized beforehand)")
    pr.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: profile one rank's shape (I/tp)")
    pr.add_argument("--json", default=None, metavar="FILE", help="write the rows to FILE (default: no file)")
    pr.set_defaults(fn=cmd_profile)
    tune_ops = sub.add_parser("tune", help="correctness-gated coordinate descent over an op's tunables").add_subparsers(
        dest="op", required=True, metavar="OP")
    def tune_common(tp, table):
        tp.add_argument("--rounds", type=int, default=2, help="rounds of the coordinate descent over the tunables")
        tp.add_argument("--keys", type=lambda t: _parse_names(t, "--keys"), default=None,
                        help="comma-separated tunable keys to search (default: all the op's tuned keys)")
        tp.add_argument("--out", default=None, metavar="FILE",
                        help="merge the winners into this JSON tune file (default: print them)")
        tp.add_argument("--inject", action="store_true",
                        help=f"write the winners where the library reads them (--out FILE, else {table})")
        tp.add_argument("--report", default=None, metavar="FILE",
                        help="write each point's start, best and times as JSON to FILE (default: no file)")
        tp.set_defaults(fn=cmd_tune)

    tu = tune_ops.add_parser("moe", help="MoE experts")
    tu.add_argument("--model", default="Qwen3-30B-A3B", help=MODEL_HELP)
    tu.add_argument("--tokens", type=_parse_tokens, default="1,8",
                    help=TOKENS_HELP + "; each one tunes the token range around it")
    tu.add_argument("--dtype", choices=["bf16", "fp16", *FP8_DTYPES], default="bf16",
                    help="the weights' and activations' type (FP8: e4m3 weights with block or per-tensor scales)")
    tu.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: tune one rank's shape (I/tp)")
    tune_common(tu, "src/ops/moe/table.c")
    from .presets import ATTENTION_PRESETS

    ta = tune_ops.add_parser("attention", aliases=["attn"], help="paged decode attention")
    ta.add_argument("--model", choices=list(ATTENTION_PRESETS), default="Qwen3-30B-A3B", help="the heads' preset (default: %(default)s)")
    ta.add_argument("--batch", type=lambda t: _parse_ints(t, "--batch", 1, 4096), default=[1, 8],
                    help="batch sizes; each one tunes the batch range around it")
    ta.add_argument("--context", type=lambda t: _parse_ints(t, "--context", 1, 1 << 20), default=[1024, 8192],
                    help="context lengths a configuration is timed at (its cost: their geometric mean)")
    ta.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="the cache's and queries' type")
    tune_common(ta, "src/ops/attention/table.c")
    tl = tune_ops.add_parser("linear", help="decode projections")
    tl.add_argument("--model", choices=list(LINEAR_PRESETS), default="Qwen3-30B-A3B",
                    help="whose projections (each tuned on its own)")
    tl.add_argument("--proj", type=lambda t: _parse_names(t, "--proj"), default=None,
                    help="comma-separated projection names of the model (default: all)")
    tl.add_argument("--rows", type=lambda t: _parse_ints(t, "--rows", 1, 8), default=[1, 8],
                    help="row counts M; each one tunes the row range around it")
    tl.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="the weights' and inputs' type")
    tune_common(tl, "src/ops/linear/table.c")
    d = sub.add_parser("doctor", help="what opgraft would do on this machine, and why")
    d.add_argument("--model", default=None,
                   help="a preset, a config.json or a model folder: which calls would take our kernel "
                        "(default: none)")
    d.set_defaults(fn=cmd_doctor)
    args = ap.parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # a reader that left shows here, in the handler below, not at exit
        return rc
    except _lib.OpgraftError as e:  # libopgraft missing or unusable, wherever a command first needs it
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
