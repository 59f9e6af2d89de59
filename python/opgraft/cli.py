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
from .presets import PRESETS, ConfigError, MoeShape, resolve


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not tokens or any(t < 1 or t > 4096 for t in tokens):
        raise argparse.ArgumentTypeError("--tokens values must be between 1 and 4096")
    return tokens


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


def _cpu_bench(shape: MoeShape, tokens: list[int], dtype: str, why: str, as_json: bool,
               global_experts: int = 0) -> int:
    print(f"no GPU here ({why}): running what works without one -- the dispatch guard, the NVRTC "
          f"compile of every kernel variant for sm_90 with its resource report, and the C fp64 oracle.",
          file=sys.stderr)
    rows = []
    try:
        info = _lib.runtime_info()
    except _lib.OpgraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
    if as_json:
        print(json.dumps({"gpu": None, "why": why, "oracle_selfcheck_rel_diff": err, "rows": rows}, indent=1))
        return 0
    print(f"{'model':<16} {'dt':<4} {'T':>4}  {'guard (sm_90)':<44} kernels (registers / spill bytes)")
    for r in rows:
        ks = ", ".join(f"{k['kernel']} {k['registers']}r/{k['spill_bytes']}s" for k in r.get("kernels", []))
        print(f"{r['model']:<16} {r['dtype']:<4} {r['tokens']:>4}  {r['guard'][:44]:<44} "
              f"{ks or r.get('compile_error', '-')}")
    print(f"C fp64 oracle vs Python loop, small bf16 problem: max relative difference {err:.1e}")
    return 0 if err < 1e-9 else 1


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
    if not ok:
        return _cpu_bench(shape, args.tokens, args.dtype, why, args.json is not None and args.json == "-",
                          global_experts)
    from . import bench
    from .bench import moe as moe_bench

    rows: list[dict] = []
    t0 = time.time()
    if fp8:
        try:
            ceiling = bench.measure_read_ceiling("cuda")
            print(f"read ceiling: {ceiling:.3f} TB/s (16-byte streaming reads of 4 GiB)", file=sys.stderr)
            weights = moe_bench.make_weights_fp8(shape, args.dtype, "cuda")
            for T in args.tokens:
                print(f"[{time.time() - t0:6.1f} s] {shape.name} {args.dtype} T={T} ...", file=sys.stderr, flush=True)
                rows += moe_bench.bench_shape_fp8(shape, [T], args.dtype, ceiling_tbps=ceiling, weights=weights,
                                                  global_experts=global_experts, between_mib=args.between_mib,
                                                  timing=args.timing)
        except KeyboardInterrupt:
            print("\ninterrupted: results so far", file=sys.stderr)
        return _bench_output(rows, args)
    try:
        ceiling = bench.measure_read_ceiling("cuda")
        print(f"read ceiling: {ceiling:.3f} TB/s (16-byte streaming reads of 4 GiB)", file=sys.stderr)
        w13, w2 = moe_bench.make_weights(shape, args.dtype, "cuda")
        extra = [moe_bench.make_weights(shape, args.dtype, "cuda", seed=1 + i) for i in range(args.layers - 1)]
        if args.layers > 1:
            print(f"{args.layers} layers of weights: {args.layers * shape.num_experts * shape.expert_bytes() / 2**30:.1f} GiB",
                  file=sys.stderr)
        for T in args.tokens:
            print(f"[{time.time() - t0:6.1f} s] {shape.name} {args.dtype} T={T} ...", file=sys.stderr, flush=True)
            rows += moe_bench.bench_shape(shape, [T], args.dtype, ceiling_tbps=ceiling, w13=w13, w2=w2,
                                      baseline=not args.no_baseline, extra_layers=extra,
                                      between_mib=args.between_mib, timing=args.timing)
    except KeyboardInterrupt:
        print("\ninterrupted: results so far", file=sys.stderr)
    return _bench_output(rows, args)


def _bench_output(rows: list[dict], args) -> int:
    from .bench import moe as moe_bench

    print(moe_bench.format_table(rows))
    if args.plot:
        write_plot(rows, args.plot)
    if args.json:
        text = json.dumps({"rows": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


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
    ok, why = _gpu_status()
    if not ok:
        return _cpu_bench(shape, args.tokens, args.dtype, why, False)
    from . import bench
    from .bench.moe import Fixture, make_weights
    from .ops import moe as ops

    ceiling = bench.measure_read_ceiling("cuda")
    w13, w2 = make_weights(shape, args.dtype, "cuda")
    rows = []
    print(f"read ceiling {ceiling:.3f} TB/s; {shape.name} {args.dtype}")
    print(f"{'T':>3} {'stage':<8} {'us':>9} {'MB':>8} {'TB/s':>6} {'ceil%':>6}  verdict")
    for T in args.tokens:
        fx = Fixture(shape, T, args.dtype, w13=w13, w2=w2)
        err = fx.check()
        if err > bench.TOLERANCE[args.dtype]:
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": bench.gpu_facts(), "rows": rows}, f, indent=1)
    return 0


def cmd_tune(args) -> int:
    shape, rc = _shape_tokens(args)
    if shape is None:
        return rc
    ok, why = _gpu_status()
    if not ok:
        print(f"error: tune measures on a GPU and there is none here ({why})", file=sys.stderr)
        return 2
    import datetime

    import torch

    from .bench.moe import Fixture, configure, make_weights, measure
    from .tune import coordinate_descent, inject_baked, make_entries, merge_tune_file, token_ranges

    table = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src",
                         "ops", "moe", "table.c")
    if args.inject and not args.out and not os.path.exists(table):
        print("error: --inject without --out writes src/ops/moe/table.c of a source checkout, and there is "
              "none here: give --out FILE (then set OPGRAFT_TUNE_FILE=FILE)", file=sys.stderr)
        return 2
    p = torch.cuda.get_device_properties(0)
    arch, gpu = p.major * 10 + p.minor, p.name
    sk = shape.tune_key(args.dtype)
    w13, w2 = make_weights(shape, args.dtype, "cuda")
    MOE_SPACE = _lib.tune_space("moe")
    winners = []
    date = datetime.date.today().isoformat()
    for T, rng in zip(sorted(set(args.tokens)), token_ranges(args.tokens)):
        fx = Fixture(shape, T, args.dtype, w13=w13, w2=w2)
        configure({})
        start = {k: _lib.tune_get(k, arch, gpu, sk, T)[0] for k in MOE_SPACE}
        n = [0]
        total = sum(len(v) for v in MOE_SPACE.values())

        def cost(cfg):
            r = measure(fx, cfg, stages_all=False)
            return r["all_us"] if r["ok"] else float("inf")

        def progress(msg):
            n[0] += 1
            print(f"\r  {shape.name} T={T} [{n[0]:>3}/{total * args.rounds}] {msg[:70]:<70}", end="",
                  file=sys.stderr, flush=True)

        best, best_us, hist = coordinate_descent(cost, MOE_SPACE, start, rounds=args.rounds, progress=progress)
        print(file=sys.stderr)
        start_us = hist[0][1]
        changed = {k: v for k, v in best.items() if start.get(k) != v}
        print(f"T={T} (tokens {rng[0]}-{rng[1]}): {start_us:.1f} -> {best_us:.1f} us "
              f"({fx.bytes / (best_us * 1e-6) / 1e12:.2f} TB/s) {changed or 'no change'}")
        if changed:
            winners.append({"arch": arch, "gpu": gpu, "shape": sk, "tokens": rng, "values": changed,
                            "why": f"opgraft tune {date}: {start_us:.1f} -> {best_us:.1f} us at T={T}"})
    configure({})
    entries = make_entries(winners)
    if args.out:
        merge_tune_file(args.out, entries)
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


def cmd_doctor(args) -> int:
    """What opgraft would do in a vLLM process on this machine, and why."""
    from .vllm import attn_seam, moe_seam, platform_gate

    out = []
    say = lambda k, v: out.append(f"{k:<22} {v}")
    import opgraft

    say("opgraft", opgraft.__version__)
    for pkg in ("vllm", "torch"):
        say(pkg, _pkg_version(pkg))
    arch, gpu = 0, None
    ok, why = _gpu_status()
    if ok:
        import torch

        p = torch.cuda.get_device_properties(0)
        arch, gpu = p.major * 10 + p.minor, p.name
        say("GPU", f"{p.name} (sm_{arch}, {p.multi_processor_count} SMs)")
    else:
        say("GPU", f"none ({why})")
    try:
        lib = _lib.lib()
        say("libopgraft", f"{lib._name} (version {lib.opgraft_version_string().decode()})")
        info = _lib.runtime_info()
        say("libcuda", info["libcuda_path"] or f"not found: {info['libcuda_error']}")
        nv = info["nvrtc_version"]
        say("NVRTC", f"{info['nvrtc_path']} ({nv // 1000}.{nv % 1000 // 10})" if nv else
            f"not found: {info['nvrtc_error']}")
        cache = _lib.cache_dir()
        writable = os.access(cache, os.W_OK) if os.path.isdir(cache) else os.access(
            os.path.dirname(cache.rstrip("/")) or "/", os.W_OK)
        say("kernel cache", f"{cache} ({'writable' if writable else 'NOT writable: kept in memory only'})")
    except _lib.OpgraftError as e:
        say("libopgraft", f"not usable: {e}")
    if os.environ.get("OPGRAFT_DISABLE", "").strip() not in ("", "0"):
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
        from . import dispatch

        say("MoE variant", dispatch.selected_variant())
    print("\n".join(out))
    if args.model:
        try:
            shape = resolve(args.model)
            layers = None
            if args.model.endswith(".json") or "/" in args.model:
                from .presets import load_config, moe_layer_count

                layers = moe_layer_count(load_config(args.model))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="opgraft", description="opgraft: faster MoE kernels for stock vLLM")
    sub = ap.add_subparsers(dest="cmd", required=True)
    bench_ops = sub.add_parser("bench", help="benchmark an op at a model's dims").add_subparsers(
        dest="op", required=True, metavar="OP")
    b = bench_ops.add_parser("moe", help="MoE experts after routing, against vLLM's fused_experts")
    b.add_argument("--model", default="Qwen3-30B-A3B", help=f"a preset ({', '.join(PRESETS)}) or a config.json")
    b.add_argument("--tokens", type=_parse_tokens, default=[1, 2, 4, 8, 16, 32, 64])
    b.add_argument("--dtype", choices=["bf16", "fp16", *FP8_DTYPES], default="bf16",
                   help="activations and weights; fp8-block: FP8 weights with 128x128 block scales and 1x128 "
                        "activation groups (DeepSeek-V3, Qwen3 FP8), fp8-tensor: per-tensor scales (Mixtral FP8); "
                        "both against vLLM's own FP8 path")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: bench one rank's shape (I/tp)")
    b.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (FP8 dtypes): one rank's E/ep experts with an expert_map")
    b.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to FILE, or stdout)")
    b.add_argument("--no-baseline", action="store_true", help="skip the torch baseline")
    b.add_argument("--max-tokens", type=int, default=None,
                   help="time opgraft's kernel up to this many tokens although the shipped "
                        "moe.max_tokens hands larger calls back to vLLM (OPGRAFT_TUNE_MOE_MAX_TOKENS)")
    b.add_argument("--layers", type=int, default=1,
                   help="rotate the calls over this many copies of the layer's weights (a model's MoE "
                        "layer count gives a real decode step's footprint)")
    b.add_argument("--between-mib", type=int, default=64,
                   help="read this many MiB of other data before each timed call, as a decode step's "
                        "other kernels do between two MoE layers (0: calls back to back)")
    b.add_argument("--timing", choices=["span", "subtract"], default="span",
                   help="with --between-mib: charge each call from its kernels' start/end times "
                        "(span, torch profiler) or as (read + call) minus the read alone (subtract)")
    b.add_argument("--plot", default=None, help="write a PNG: time against tokens with the roofline")
    b.set_defaults(fn=cmd_bench)
    profile_ops = sub.add_parser("profile", help="time split and roofline verdict per token count").add_subparsers(
        dest="op", required=True, metavar="OP")
    pr = profile_ops.add_parser("moe", help="MoE experts: gate/up and down stages")
    pr.add_argument("--model", default="Qwen3-30B-A3B")
    pr.add_argument("--tokens", type=_parse_tokens, default=[1, 8])
    pr.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    pr.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: bench one rank's shape (I/tp)")
    pr.add_argument("--json", default=None, help="write the rows to FILE")
    pr.set_defaults(fn=cmd_profile)
    tune_ops = sub.add_parser("tune", help="correctness-gated coordinate descent over an op's tunables").add_subparsers(
        dest="op", required=True, metavar="OP")
    tu = tune_ops.add_parser("moe", help="MoE experts")
    tu.add_argument("--model", default="Qwen3-30B-A3B")
    tu.add_argument("--tokens", type=_parse_tokens, default=[1, 8])
    tu.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    tu.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: bench one rank's shape (I/tp)")
    tu.add_argument("--rounds", type=int, default=2)
    tu.add_argument("--out", default=None, help="merge the winners into this JSON tune file")
    tu.add_argument("--inject", action="store_true",
                    help="write the winners where the library reads them (--out FILE, else src/ops/moe/table.c)")
    tu.set_defaults(fn=cmd_tune)
    d = sub.add_parser("doctor", help="what opgraft would do on this machine, and why")
    d.add_argument("--model", default=None, help="a preset or config.json: which calls would take our kernel")
    d.set_defaults(fn=cmd_doctor)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
