"""The linear bench: opgraft's kernel against torch.nn.functional.linear (the call vLLM's
unquantized linear layers make: cuBLAS) at the projection shapes of the presets and of dense
models, with an fp64 reference and the read ceiling of the same run.

Each timed replay makes one call per copy of the weights, rotating over enough copies that L2
(60 MB on an H200) holds none of them, with 64 MiB of other reads before each call (a decode
step's other kernels between two projections), timed as in the MoE bench (bench.timed_calls).
"""

from __future__ import annotations

import os

import torch

from .. import _lib
from ..ops import linear as ops
from ..presets import LINEAR_FP8_PRESETS, LINEAR_PRESETS, LinearShape
from . import BETWEEN_MIB, TOLERANCE, between_traffic, rel_err, run_facts, speed, timed_calls

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROWS = (1, 2, 4, 8)
# Weight copies a timed replay rotates over: at least this many bytes of them (twice L2), at most
# MAX_COPIES copies (with the reads between calls, L2 holds none of a small matrix anyway).
ROTATE_BYTES = 128 << 20
MAX_COPIES = 16


def measure_whole_row_range() -> None:
    """Lets the kernel take every row count it supports in this process (unless the caller set
    the threshold): measuring is separate from the shipped hand-back threshold linear.max_rows."""
    os.environ.setdefault("OPGRAFT_TUNE_LINEAR_MAX_ROWS", str(ops.MAX_ROWS))


def make_weight(shape: LinearShape, dtype: str, device, seed: int = 0) -> torch.Tensor:
    """Random normal weights, std 1/sqrt(K) so the outputs stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty((shape.out_features, shape.in_features), dtype=TORCH_DTYPES[dtype], device=device)
    step = max(1, (256 << 20) // (shape.in_features * 4))  # rows a draw, so fp32 draws stay small
    for r in range(0, shape.out_features, step):
        n = min(step, shape.out_features - r)
        w[r:r + n] = torch.randn((n, shape.in_features), generator=g, device=device).mul_(shape.in_features ** -0.5)
    return w


def copies_for(shape: LinearShape, elem_bytes: int = 2) -> int:
    return max(1, min(MAX_COPIES, -(-ROTATE_BYTES // shape.weight_bytes(elem_bytes))))


def call_bytes(shape: LinearShape, M: int, bias: bool = False, elem_bytes: int = 2) -> int:
    """Bytes a call must move: the weights once, x, the output (and the bias)."""
    N, K = shape.out_features, shape.in_features
    return elem_bytes * (N * K + M * K + M * N + (N if bias else 0))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 on the tensors' device."""
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


def device_of(device) -> tuple[int, str]:
    """(compute capability as major*10 + minor, name) of the GPU."""
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor, torch.cuda.get_device_name(device)


def result_rows(base: dict, results: dict, baseline: str, nbytes: int, ceiling_tbps: float | None,
                dtype: str) -> list[dict]:
    """A row per impl of results ({impl: (µs, rel_err, extra fields)}), its speedup over
    baseline's time."""
    base_us = results[baseline][0]
    rows = []
    for impl, (us, err, extra) in results.items():
        row = dict(base, impl=impl, **speed(nbytes, us, ceiling_tbps), speedup=round(base_us / us, 2),
                   rel_err=float(f"{err:.3g}"), tolerance=TOLERANCE[dtype])
        row.update(extra)
        rows.append(row)
    return rows


def bench_shape(shape: LinearShape, rows=ROWS, dtype: str = "bf16", device="cuda", ceiling_tbps: float | None = None,
                reps: int = 30, between_mib: int = BETWEEN_MIB, timing: str = "subtract", progress=None) -> list[dict]:
    """Rows for one projection at each row count: opgraft and torch-linear, checked against fp64."""
    measure_whole_row_range()
    L = copies_for(shape)
    weights = [make_weight(shape, dtype, device, seed=i) for i in range(L)]
    gen = torch.Generator(device=device).manual_seed(4321)
    between = between_traffic(between_mib, device)
    arch, gpu = device_of(device)
    base = {**run_facts(), "op": "linear", "model": shape.model, "proj": shape.proj, "N": shape.out_features,
            "K": shape.in_features, "dtype": dtype, "copies": L, "between_mib": max(between_mib, 0)}
    max_rows, max_rows_src = _lib.tune_get("linear.max_rows", arch, gpu, shape.tune_key(dtype), 1)
    out_rows = []
    w64 = weights[0].double()  # the oracle's weights, once for every row count
    for M in rows:
        if progress:
            progress(f"{shape.model} {shape.proj} [{shape.out_features}, {shape.in_features}] M={M}")
        xs = [torch.randn((M, shape.in_features), generator=gen, device=device).to(TORCH_DTYPES[dtype])
              for _ in range(L)]
        schedule = [(i, None) for i in range(L)]
        ref = xs[0].double() @ w64.T
        nbytes = call_bytes(shape, M)
        ok, reason = ops.linear_supports(xs[0], weights[0])
        results = {}
        if ok:
            out = torch.full((M, shape.out_features), float("nan"), dtype=xs[0].dtype, device=device)
            ops.linear_into(out, xs[0], weights[0])
            err = rel_err(out, ref)
            again = torch.full_like(out, float("nan"))
            ops.linear_into(again, xs[0], weights[0])
            outs = [torch.empty_like(out) for _ in range(L)]

            def call(i, _):
                ops.linear_into(outs[i], xs[i], weights[i])

            us, how = timed_calls(call, schedule, between, reps, timing)
            results["opgraft"] = (us, err, {"deterministic": bool(torch.equal(out, again)), **how})
        terr = rel_err(torch.nn.functional.linear(xs[0], weights[0]), ref)

        def tcall(i, _):
            torch.nn.functional.linear(xs[i], weights[i])

        us, how = timed_calls(tcall, schedule, between, reps, timing)
        results["torch-linear"] = (us, terr, how)
        out_rows += result_rows(dict(base, M=M, max_rows=max_rows, max_rows_source=max_rows_src,
                                     guard="take" if ok else f"delegate: {reason}"),
                                results, "torch-linear", nbytes, ceiling_tbps, dtype)
        if not ok:
            out_rows.append(dict(base, impl="opgraft", M=M, median_us=None, bytes=nbytes, guard=f"delegate: {reason}"))
    del weights, w64
    torch.cuda.empty_cache()
    return out_rows


def fp8_weights(shape: LinearShape, device, seed: int = 0, block=(128, 128)):
    """Random e4m3 weights and positive fp32 block scales [ceil(N/bn), K/bk]."""
    g = torch.Generator(device=device).manual_seed(seed)
    N, K = shape.out_features, shape.in_features
    w = (torch.randn((N, K), generator=g, device=device) * 96).clamp_(-448, 448).to(torch.float8_e4m3fn)
    sc = (torch.rand((-(-N // block[0]), K // block[1]), generator=g, device=device) + 0.5) * 1e-3 / K ** 0.5
    return w, sc


def vllm_fp8_linear():
    """vLLM's own block-FP8 linear path as Fp8LinearMethod runs it on an H200 for rows below 32:
    FlashInferFp8DeepGEMMDynamicBlockScaledKernel's small-row branch, FlashInfer's
    fp8_blockscale_gemm_sm90 on bf16 x (it quantizes x per 1x128 group itself), on weights
    post-processed as that kernel's process_weights_after_loading does (DeepGEMM's: UE8M0
    requantization where vLLM uses E8M0 scales, its scale layout).
    Returns (prepare(w, s) -> (w, s), fn(x, w, s) -> y, "") or (None, None, why not)."""
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used, is_deep_gemm_supported
        from vllm.utils.flashinfer import flashinfer_fp8_blockscale_gemm, is_flashinfer_fp8_blockscale_gemm_supported
    except Exception as e:
        return None, None, f"vLLM is not importable here ({type(e).__name__}: {str(e)[:80]})"
    if not is_flashinfer_fp8_blockscale_gemm_supported():
        return None, None, "vLLM finds no FlashInfer block-FP8 GEMM here (not sm_90, or not installed)"
    use_e8m0 = is_deep_gemm_e8m0_used()

    def prepare(w, s):
        if not is_deep_gemm_supported():
            return w, s
        return deepgemm_post_process_fp8_weight_block(wq=w, ws=s, quant_block_shape=(128, 128), use_e8m0=use_e8m0)

    def fn(x, w, s):
        return flashinfer_fp8_blockscale_gemm(input=x, weight=w, weight_scale=s, out_dtype=torch.bfloat16)

    return prepare, fn, ""


def bench_fp8_shape(shape: LinearShape, rows=ROWS, device="cuda", ceiling_tbps: float | None = None, reps: int = 30,
                    between_mib: int = BETWEEN_MIB, timing: str = "span", baseline: bool = True,
                    progress=None) -> list[dict]:
    """Our FP8 kernel at one projection and each row count against vLLM's own block-FP8 kernel
    (vllm_fp8_linear, where vLLM runs here; both on the weights as vLLM post-processes them),
    each checked against the C fp64 oracle (x quantized as our kernel does), timed as bench_shape
    times the 16-bit kernel."""
    measure_whole_row_range()
    L = copies_for(shape, 1)
    weights = [fp8_weights(shape, device, seed=i) for i in range(L)]
    prepare, vfn, vwhy = vllm_fp8_linear() if baseline else (None, None, "not asked for")
    if prepare is not None:
        weights = [prepare(w, s) for w, s in weights]
    gen = torch.Generator(device=device).manual_seed(4321)
    between = between_traffic(between_mib, device)
    base = {**run_facts(), "op": "linear", "model": shape.model, "proj": shape.proj, "N": shape.out_features,
            "K": shape.in_features, "dtype": "fp8-block", "copies": L, "between_mib": max(between_mib, 0)}
    out_rows = []
    for M in rows:
        if progress:
            progress(f"{shape.model} {shape.proj} fp8 [{shape.out_features}, {shape.in_features}] M={M}")
        xs = [torch.randn((M, shape.in_features), generator=gen, device=device).to(torch.bfloat16) for _ in range(L)]
        w0, s0 = weights[0]
        nbytes = shape.out_features * shape.in_features + s0.numel() * 4 + 2 * M * (shape.in_features + shape.out_features)
        schedule = [(i, None) for i in range(L)]
        ok, reason = ops.linear_fp8_supports(xs[0], w0, s0, (128, 128))
        ref = ops.linear_fp8_reference_cpu(xs[0], w0, s0, (128, 128)).to(device) if ok or vfn else None
        vllm_row = None
        if vfn is not None:
            vout = vfn(xs[0], w0, s0)

            def vcall(i, _):
                vfn(xs[i], weights[i][0], weights[i][1])

            us, how = timed_calls(vcall, schedule, between, reps, timing)
            vllm_row = dict(base, impl="vllm-fp8", M=M, **speed(nbytes, us, ceiling_tbps),
                            kernel="flashinfer fp8_blockscale_gemm_sm90", rel_err=float(f"{rel_err(vout, ref):.3g}"),
                            **how)
        if not ok:
            out_rows.append(dict(base, impl="opgraft-fp8", M=M, median_us=None, bytes=nbytes, guard=f"delegate: {reason}"))
        else:
            out = ops.linear_fp8_into(torch.empty((M, shape.out_features), dtype=torch.bfloat16, device=device),
                                      xs[0], w0, s0, (128, 128))
            again = ops.linear_fp8_into(torch.empty_like(out), xs[0], w0, s0, (128, 128))
            outs = [torch.empty_like(out) for _ in range(L)]

            def call(i, _):
                ops.linear_fp8_into(outs[i], xs[i], weights[i][0], weights[i][1], (128, 128))

            us, how = timed_calls(call, schedule, between, reps, timing)
            row = dict(base, impl="opgraft-fp8", M=M, **speed(nbytes, us, ceiling_tbps),
                       rel_err=float(f"{rel_err(out, ref):.3g}"), tolerance=TOLERANCE["bf16"],
                       deterministic=bool(torch.equal(out, again)), guard="take", **how)
            if vllm_row is not None:
                row["speedup"] = round(vllm_row["median_us"] / us, 2)
            out_rows.append(row)
        out_rows.append(vllm_row or dict(base, impl="vllm-fp8", M=M, median_us=None, bytes=nbytes,
                                         guard=f"not run: {vwhy}"))
    del weights
    torch.cuda.empty_cache()
    return out_rows


class TuneFixture:
    """One projection at one row count for the tuner: the weight copies, inputs and fp64
    reference of bench_shape, a configuration checked and timed as bench_shape times ours."""

    def __init__(self, shape: LinearShape, M: int, dtype: str = "bf16", device="cuda", reps: int = 30,
                 between_mib: int = BETWEEN_MIB, weights=None):
        measure_whole_row_range()
        self.shape, self.M, self.dtype, self.reps = shape, M, dtype, reps
        L = copies_for(shape)
        # weights: another row count's copies of the same shape, or None (made here)
        self.weights = weights or [make_weight(shape, dtype, device, seed=i) for i in range(L)]
        gen = torch.Generator(device=device).manual_seed(4321)
        self.xs = [torch.randn((M, shape.in_features), generator=gen, device=device).to(TORCH_DTYPES[dtype])
                   for _ in range(L)]
        self.outs = [torch.empty((M, shape.out_features), dtype=self.xs[0].dtype, device=device) for _ in range(L)]
        self.ref = reference(self.xs[0], self.weights[0])
        self.bytes = call_bytes(shape, M)
        self.tolerance = TOLERANCE[dtype]
        self.between = between_traffic(between_mib, device)
        self.tokens = M
        self.tune_key = shape.tune_key(dtype)
        self.label = f"{shape.model} {shape.proj} [{shape.out_features}, {shape.in_features}] M={M}"

    def forget_plans(self) -> None:
        ops.forget_plans()

    def check(self) -> float:
        ok, _ = ops.linear_supports(self.xs[0], self.weights[0])
        if not ok:
            return float("inf")
        out = torch.full_like(self.outs[0], float("nan"))
        ops.linear_into(out, self.xs[0], self.weights[0])
        return rel_err(out, self.ref)

    def time(self) -> float:
        def call(i, _):
            ops.linear_into(self.outs[i], self.xs[i], self.weights[i])

        return timed_calls(call, [(i, None) for i in range(len(self.xs))], self.between, self.reps, "span",
                           False)[0]


# The projections a decoder layer feeds from add + RMSNorm: qkv (input_layernorm), a dense MLP's
# gate_up and a MoE layer's router gate (post_attention_layernorm; the router's form also writes
# the normalized rows, which the experts read).
NORM_FED = ("qkv", "gate_up", "router")
NORM_EPS = 1e-6


def _compiled_norm():
    """vLLM's add + RMSNorm as its compiled model runs it: the function traced by Inductor, one
    Triton kernel a shape (Dynamo's caches reset first: a shape's row counts stay under its
    recompile limit)."""
    torch._dynamo.reset()
    return torch.compile(ops.add_rms_norm_reference, fullgraph=True, dynamic=False)


def bench_norm_shape(shape: LinearShape, rows=ROWS, dtype: str = "bf16", device="cuda",
                     ceiling_tbps: float | None = None, reps: int = 30, between_mib: int = BETWEEN_MIB,
                     timing: str = "span", progress=None) -> list[dict]:
    """Rows for add + RMSNorm and then the projection, at each row count: our one kernel
    (opgraft-norm; for a router gate also writing the normalized rows, as the MoE form runs it)
    against the compiled norm's Triton kernel followed by our plain kernel (norm+opgraft) or by
    torch.nn.functional.linear (norm+torch, stock vLLM's two kernels)."""
    measure_whole_row_range()
    L = copies_for(shape)
    K = shape.in_features
    dt = TORCH_DTYPES[dtype]
    weights = [make_weight(shape, dtype, device, seed=i) for i in range(L)]
    gen = torch.Generator(device=device).manual_seed(4322)
    norm_w = (torch.rand(K, generator=gen, device=device) + 0.5).to(dt)
    between = between_traffic(between_mib, device)
    base = {**run_facts(), "op": "linear", "model": shape.model, "proj": shape.proj, "N": shape.out_features,
            "K": K, "dtype": dtype, "copies": L, "between_mib": max(between_mib, 0), "norm": "add_rms_norm"}
    norm = _compiled_norm()
    normed = shape.proj == "router"
    if normed:
        base["normed_out"] = True
    out_rows = []
    w64 = weights[0].double()
    for M in rows:
        if progress:
            progress(f"{shape.model} {shape.proj} [{shape.out_features}, {K}] add + RMSNorm M={M}")
        xs = [torch.randn((M, K), generator=gen, device=device).to(dt) for _ in range(L)]
        rs = [(4 * torch.randn((M, K), generator=gen, device=device)).to(dt) for _ in range(L)]
        schedule = [(i, None) for i in range(L)]
        n0, r0 = ops.add_rms_norm_reference(xs[0], rs[0], norm_w, NORM_EPS)
        ref = n0.double() @ w64.T
        n_compiled = norm(xs[0], rs[0], norm_w, NORM_EPS)[0]  # the baselines' normalized input
        # x and residual read, residual_out (and the normalized rows) written
        nbytes = call_bytes(shape, M) + (3 + normed) * M * K * 2
        outs = [torch.empty((M, shape.out_features), dtype=dt, device=device) for _ in range(L)]
        routs = [torch.empty((M, K), dtype=dt, device=device) for _ in range(L)]
        houts = [torch.empty((M, K), dtype=dt, device=device) if normed else None for _ in range(L)]
        ok, reason = True, ""
        results = {}

        def fused(i, _):
            ops.add_rms_norm_linear_into(outs[i], routs[i], xs[i], rs[i], norm_w, NORM_EPS, weights[i], None, houts[i])

        try:
            fused(0, None)
        except _lib.OpgraftError as e:
            ok, reason = False, str(e)
        if ok:
            err = rel_err(outs[0], ref)
            first, rfirst = outs[0].clone(), routs[0].clone()
            fused(0, None)
            det = bool(torch.equal(first, outs[0]))
            extra = {"deterministic": det, "residual_out_exact": bool(torch.equal(rfirst, r0))}
            if normed:
                extra["normed_out_exact"] = bool(torch.equal(houts[0], n0))

            us, how = timed_calls(fused, schedule, between, reps, timing)
            results["opgraft-norm"] = (us, err, {**extra, **how})

            def two(i, _):
                n, _r = norm(xs[i], rs[i], norm_w, NORM_EPS)
                ops.linear_into(outs[i], n, weights[i])

            us, how = timed_calls(two, schedule, between, reps, timing)
            results["norm+opgraft"] = (us, rel_err(ops.linear_or_torch(n_compiled, weights[0]), ref), how)

        def stock(i, _):
            n, _r = norm(xs[i], rs[i], norm_w, NORM_EPS)
            torch.nn.functional.linear(n, weights[i])

        us, how = timed_calls(stock, schedule, between, reps, timing)
        results["norm+torch"] = (us, rel_err(torch.nn.functional.linear(n_compiled, weights[0]), ref), how)
        out_rows += result_rows(dict(base, M=M, guard="take" if ok else f"delegate: {reason}"), results,
                                "norm+torch", nbytes, ceiling_tbps, dtype)
    del weights, w64
    torch.cuda.empty_cache()
    return out_rows


def bench_models(models=tuple(LINEAR_PRESETS), rows=ROWS, dtype: str = "bf16", ceiling_tbps: float | None = None,
                 between_mib: int = BETWEEN_MIB, timing: str = "subtract", progress=None) -> list[dict]:
    """Each model's projections: 16-bit ones (LINEAR_PRESETS) against torch.nn.functional.linear,
    or with dtype "fp8-block" the block-FP8 ones (LINEAR_FP8_PRESETS) against vLLM's FP8 kernel."""
    out = []
    for m in models:
        if dtype == "fp8-block":
            for shape in LINEAR_FP8_PRESETS[m]:
                out += bench_fp8_shape(shape, rows, ceiling_tbps=ceiling_tbps, between_mib=between_mib, timing=timing,
                                       progress=progress)
            continue
        for shape in LINEAR_PRESETS[m]:
            out += bench_shape(shape, rows, dtype, ceiling_tbps=ceiling_tbps, between_mib=between_mib, timing=timing,
                               progress=progress)
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':<18} {'proj':<8} {'N':>7} {'K':>6} {'M':>2} {'impl':<13} {'us':>8} {'MB':>7} {'TB/s':>5} "
            f"{'ceil%':>6} {'xbase':>6} {'relerr':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("median_us") is None:
            lines.append(f"{r['model']:<18} {r['proj']:<8} {r['N']:>7} {r['K']:>6} {r['M']:>2} {r['impl']:<13} "
                         f"{r.get('guard', '')}")
            continue
        frac = r.get("fraction_of_ceiling") or 0
        lines.append(f"{r['model']:<18} {r['proj']:<8} {r['N']:>7} {r['K']:>6} {r['M']:>2} {r['impl']:<13} "
                     f"{r['median_us']:>8.2f} {r['bytes'] / 1e6:>7.1f} {r['tbps']:>5.2f} {frac * 100:>5.1f}% "
                     f"{'' if r.get('speedup') is None else format(r['speedup'], '.2f'):>6} {r['rel_err']:>8.1e}")
    return "\n".join(lines)
