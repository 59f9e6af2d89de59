"""The linear op's GPU correctness cases (tools.gpucheck runs them): M = 1..8, odd N, K from 8 to
14336 (a partial last k-step included), bias on and off, strided x and out, fp16, each tunable
path, through the custom op (and its hand-back to torch, bit for bit), under CUDA-graph capture,
against the fp64 oracle, with poisoned outputs and a bit-identical rerun; the block-FP8 form
(cases named "fp8") against the C fp64 oracle, which quantizes x as the kernel does; the add +
RMSNorm form (cases named "norm") against vLLM's norm in torch and the C oracle, its residual_out
bit for bit; then the bench rows."""

from __future__ import annotations

import ctypes
import re

import torch

from opgraft import _lib, bench, dispatch
from opgraft.bench import linear as linear_bench
from opgraft.ops import linear as ops
from opgraft.presets import LINEAR_FP8_PRESETS, LINEAR_PRESETS, LinearShape

NAME = "linear"


def prepare() -> None:
    """Before the cases: every row count the kernel supports."""
    linear_bench.measure_whole_row_range()


def _case(name, N, K, M, dtype="bf16", bias=False, x_pad=0, out_pad=0, tunables=None, seed=0, path="into",
          expect="opgraft", misaligned=False):
    """path: "into" (ops.linear_into into a poisoned, possibly strided out), "op"
    (torch.ops.opgraft.linear; expect "opgraft" or "torch", the op's hand-back), "graph" (captured
    into a CUDA graph, replayed with new x). tunables: {key: value} set for this case only."""
    return dict(name=name, N=N, K=K, M=M, dtype=dtype, bias=bias, x_pad=x_pad, out_pad=out_pad,
                tunables=tunables or {}, seed=seed, path=path, expect=expect, misaligned=misaligned)


def _fp8(name, N, K, M, block=(128, 128), transposed=False, **kw):
    return _case(name, N, K, M, **kw) | {"fp8": True, "block": block, "transposed": transposed}


def fp8_cases() -> list[dict]:
    q = [_fp8(f"fp8 M={M} [5120, 2048] (Qwen3-30B-A3B-FP8 qkv)", 5120, 2048, M, seed=M) for M in (1, 2, 4, 8)]
    return q + [
        _fp8("fp8 M=1 [2048, 4096] (o)", 2048, 4096, 1),
        _fp8("fp8 M=8 [2048, 4096] (o) bias", 2048, 4096, 8, bias=True),
        _fp8("fp8 M=1 [128, 2048] (router gate)", 128, 2048, 1),
        _fp8("fp8 M=3 [128, 2048] (router gate)", 128, 2048, 3),
        _fp8("fp8 M=5 [129, 256] bias", 129, 256, 5, bias=True),
        _fp8("fp8 M=7 [24576, 1536] (DeepSeek-V3 q_b; over 16 MiB, taken by the tunable)", 24576, 1536, 7,
             tunables={"linear.max_rows": 8}),
        _fp8("fp8 M=2 [576, 7168] (DeepSeek-V3 kv_a)", 576, 7168, 2),
        _fp8("fp8 M=3 [40, 256] 16x64 blocks, transposed scales", 40, 256, 3, block=(16, 64), transposed=True),
        _fp8("fp8 fp16 x M=4 [5120, 2048] bias", 5120, 2048, 4, dtype="fp16", bias=True),
        _fp8("fp8 strided x and out M=6 [5120, 2048]", 5120, 2048, 6, x_pad=64, out_pad=3),
        _fp8("fp8 outliers and a zero row M=4 [2048, 4096]", 2048, 4096, 4, seed=77),
        _fp8("fp8 tiles 1, unroll 2 M=3 [5120, 2048] bias", 5120, 2048, 3, bias=True,
             tunables={"linear.tiles": 1, "linear.unroll": 2}),
        _fp8("fp8 tiles 2, N=129 M=8 [129, 256]", 129, 256, 8, tunables={"linear.tiles": 2}),
        _fp8("fp8 unroll 1, warps 4 M=2 [2048, 4096]", 2048, 4096, 2, tunables={"linear.unroll": 1, "linear.warps": 4}),
        _fp8("fp8 warps 1 M=8 [129, 1024]", 129, 1024, 8, tunables={"linear.warps": 1}),
        _fp8("fp8 warps 16 (warps without groups) M=1 [129, 512]", 129, 512, 1, tunables={"linear.warps": 16}),
        _fp8("fp8 load 1, L2 fetch 0 M=1 [5120, 2048]", 5120, 2048, 1, tunables={"linear.load": 1, "linear.l2_fetch": 0}),
        _fp8("fp8 pdl M=2 [5120, 2048] bias", 5120, 2048, 2, bias=True, tunables={"linear.pdl": 1}),
        _fp8("fp8 pdl, 16 warps without groups M=8 [129, 512]", 129, 512, 8,
             tunables={"linear.pdl": 1, "linear.warps": 16}),
        _fp8("fp8 op: M=3 ours", 5120, 2048, 3, path="op"),
        _fp8("fp8 op: M=9 to the registered path", 5120, 2048, 9, path="op", expect="fallback"),
        _fp8("fp8 op: x misaligned to the registered path", 129, 2048, 2, path="op", expect="fallback",
             misaligned=True),
        _fp8("fp8 graph: M=4 [5120, 2048] bias", 5120, 2048, 4, bias=True, path="graph"),
        _fp8("fp8 graph, pdl: M=1 [2048, 4096]", 2048, 4096, 1, path="graph", tunables={"linear.pdl": 1}),
    ]


def _norm(name, N, K, M, normed=False, **kw):
    """normed: the kernel also writes the normalized rows (as for a MoE layer's router gate)."""
    return _case(name, N, K, M, **kw) | {"norm": True, "normed": normed}


def norm_cases() -> list[dict]:
    """The add + RMSNorm form: M = 1..8, K from 72 (warps without k-steps) to 14336 (several
    chunks a thread in the norm, shared memory past 48 KB), strided x and residual, fp16, each PDL form, through the
    custom op and its hand-back (bit for bit), and replayed from a CUDA graph."""
    q = [_norm(f"norm M={M} [5120, 2048] (Qwen3-30B-A3B qkv){' bias' if M % 3 == 0 else ''}", 5120, 2048, M,
               bias=M % 3 == 0, seed=M) for M in range(1, 9)]
    return q + [
        _norm("norm N=7 K=72 M=3 bias (a partial k-step)", 7, 72, 3, bias=True),
        _norm("norm N=129 K=72 M=8, 16 warps (warps without k-steps)", 129, 72, 8, tunables={"linear.warps": 16}),
        _norm("norm N=6144 K=4096 M=2 (Llama-3-8B qkv)", 6144, 4096, 2),
        _norm("norm N=28672 K=4096 M=1 (Llama-3-8B gate_up)", 28672, 4096, 1),
        _norm("norm N=1280 K=8192 M=5 (Llama-3-70B/tp8 qkv, 82 KB of shared memory)", 1280, 8192, 5),
        _norm("norm N=129 K=14336 M=3 (84 KB of shared memory)", 129, 14336, 3),
        _norm("norm N=129 K=2056 M=4 strided x and residual, out", 129, 2056, 4, x_pad=40, out_pad=3),
        _norm("norm fp16 N=5120 K=2048 M=3 bias", 5120, 2048, 3, dtype="fp16", bias=True),
        _norm("norm pdl 0: N=5120 K=2048 M=2", 5120, 2048, 2, tunables={"linear.pdl": 0}),
        _norm("norm pdl 2: N=5120 K=2056 M=8", 5120, 2056, 8, tunables={"linear.pdl": 2}),
        _norm("norm tiles 4, unroll 8: N=2049 K=4104 M=6", 2049, 4104, 6,
              tunables={"linear.tiles": 4, "linear.unroll": 8}),
        _norm("norm op: N=5120 K=2048 M=1", 5120, 2048, 1, path="op"),
        _norm("norm op: M=9 goes to vLLM's norm and torch", 5120, 2048, 9, path="op", expect="torch"),
        _norm("norm op: x not 16-byte aligned goes to the norm and our linear", 129, 2048, 2, path="op",
              expect="torch", misaligned=True),
        _norm("norm op: K=8192 M=8 (over the shared memory) goes to the norm and our linear", 1280, 8192, 8,
              path="op", expect="torch"),
        _norm("norm normed: M=1 [128, 2048] (Qwen3-30B-A3B router, the rows written)", 128, 2048, 1, normed=True),
        _norm("norm normed: M=2 [128, 2048] strided", 128, 2048, 2, normed=True, x_pad=24),
        _norm("norm normed fp16: M=8 N=129 K=4104", 129, 4104, 8, dtype="fp16", normed=True),
        _norm("norm graph, normed: M=2 [128, 2048]", 128, 2048, 2, path="graph", normed=True),
        _norm("norm graph: N=5120 K=2048 M=4 bias", 5120, 2048, 4, bias=True, path="graph"),
        _norm("norm graph, pdl 0: N=2048 K=4096 M=1", 2048, 4096, 1, path="graph", tunables={"linear.pdl": 0}),
    ]


def _qk(name, M, D=128, q_heads=32, kv_heads=4, K=2048, norm=True, rope=1, add_norm=False, **kw):
    """The q/k epilogue on a qkv projection of q_heads + 2 kv_heads heads of D."""
    return _case(name, (q_heads + 2 * kv_heads) * D, K, M, **kw) | {
        "qk": True, "D": D, "q_heads": q_heads, "qk_heads": q_heads + kv_heads, "qknorm": norm, "rope": rope,
        "add_norm": add_norm}


def qk_cases() -> list[dict]:
    """The q/k epilogue ("qk"): Qwen3-30B-A3B's qkv at M = 1..8 with its norm and NeoX rotation,
    alone and after the add + RMSNorm form, fp16, head 64 with GPT-J rotation alone, head 256 with
    the norm alone, a position outside the rotary cache, and each tile count. Its query and key
    heads must be the attention prologue's bits on the plain product, its value heads the plain
    product's; against the C oracle (every head within two steps of its largest value: a product a
    step apart moves the normalized and rotated values by a step of the head, and the kernel's fp32
    sums are not the oracle's fp64 ones);
    two calls back to back bit-identical."""
    q = [_qk(f"qk M={M} Qwen3-30B-A3B qkv, norm + NeoX{' bias' if M % 3 == 0 else ''}", M, bias=M % 3 == 0, seed=M)
         for M in (1, 2, 3, 8)]
    return q + [
        _qk("qk add+RMSNorm M=2 Qwen3-30B-A3B qkv", 2, add_norm=True),
        _qk("qk fp16 M=4", 4, dtype="fp16"),
        _qk("qk head 64 GPT-J alone M=3, K=72", 3, D=64, q_heads=8, kv_heads=2, K=72, norm=False, rope=2),
        _qk("qk head 256 norm alone M=8", 8, D=256, q_heads=8, kv_heads=1, rope=0),
        _qk("qk tiles 1 M=1", 1, tunables={"linear.tiles": 1}),
        _qk("qk tiles 4 (clamped to 2) M=8, pdl 2, trigger", 8,
            tunables={"linear.tiles": 4, "linear.pdl": 2, "linear.trigger": 1}),
        _qk("qk op hand-back M=128 (a prefill: torch's product, the prologue in place)", 128, bias=True, seed=9,
            path="op"),
    ]


def cases() -> list[dict]:
    out = [_case(f"M={M} [129, 2048]{' bias' if M % 2 else ''}", 129, 2048, M, bias=bool(M % 2), seed=M)
           for M in range(1, 9)]
    out += [
        # odd N, K from 8 to 14336
        _case("N=1 K=8 M=1", 1, 8, 1),
        _case("N=7 K=72 M=3 bias (a partial k-step)", 7, 72, 3, bias=True),
        _case("N=129 K=8 M=8", 129, 8, 8),
        _case("N=1 K=14336 M=2 bias", 1, 14336, 2, bias=True),
        _case("N=7 K=14336 M=8", 7, 14336, 8),
        _case("N=129 K=4096 M=5", 129, 4096, 5),
        _case("N=5120 K=72 M=4", 5120, 72, 4),
        _case("N=5120 K=2048 M=1 (Qwen3-30B-A3B qkv)", 5120, 2048, 1),
        _case("N=5120 K=2048 M=8 bias", 5120, 2048, 8, bias=True),
        _case("N=2048 K=4096 M=2 (Qwen3-30B-A3B o)", 2048, 4096, 2),
        _case("N=128 K=2048 M=1 (router gate)", 128, 2048, 1),
        _case("N=4096 K=14336 M=3 (Llama-3-8B down)", 4096, 14336, 3),
        _case("N=8192 K=1024 M=1 (Llama-3-70B/tp8 o, 4 tiles)", 8192, 1024, 1),
        _case("N=151936 K=2048 M=1 (lm_head)", 151936, 2048, 1),
        _case("N=151936 K=2048 M=8 bias (lm_head)", 151936, 2048, 8, bias=True),
        _case("N=151936 K=72 M=3", 151936, 72, 3),
        # fp16
        _case("fp16 N=129 K=2048 M=5 bias", 129, 2048, 5, dtype="fp16", bias=True),
        _case("fp16 N=5120 K=4096 M=1", 5120, 4096, 1, dtype="fp16"),
        _case("fp16 N=7 K=72 M=8 bias", 7, 72, 8, dtype="fp16", bias=True),
        _case("fp16 N=151936 K=2048 M=2", 151936, 2048, 2, dtype="fp16"),
        # strided x and out
        _case("strided x and out N=129 K=2048 M=4 bias", 129, 2048, 4, bias=True, x_pad=64, out_pad=3),
        _case("strided x and out N=5120 K=2048 M=8", 5120, 2048, 8, x_pad=8, out_pad=1),
        _case("strided x, one row N=5120 K=4096", 5120, 4096, 1, x_pad=24, out_pad=5),
        # each tunable path (K=2056: 64 full k-steps and a partial one)
    ]
    for t in (1, 2, 3, 4):
        out.append(_case(f"tiles {t}: N=5120 K=2056 M=3 bias", 5120, 2056, 3, bias=True,
                         tunables={"linear.tiles": t}))
    out += [
        _case("warps 1: N=129 K=2056 M=7", 129, 2056, 7, tunables={"linear.warps": 1}),
        _case("warps 2, unroll 8: N=5120 K=4096 M=2", 5120, 4096, 2, tunables={"linear.warps": 2, "linear.unroll": 8}),
        _case("warps 16, tiles 4: N=1000 K=2056 M=8 bias", 1000, 2056, 8, bias=True,
              tunables={"linear.warps": 16, "linear.tiles": 4}),
        _case("unroll 1: N=129 K=2048 M=1", 129, 2048, 1, tunables={"linear.unroll": 1}),
        _case("min blocks 0: N=5120 K=2048 M=4", 5120, 2048, 4, tunables={"linear.min_blocks": 0}),
        _case("load form 1: N=5120 K=2048 M=2 bias", 5120, 2048, 2, bias=True, tunables={"linear.load": 1}),
        _case("L2 fetch 0: N=2048 K=4096 M=1", 2048, 4096, 1, tunables={"linear.l2_fetch": 0}),
        _case("L2 fetch 256: N=2048 K=4096 M=8", 2048, 4096, 8, tunables={"linear.l2_fetch": 256}),
        _case("pdl: N=5120 K=2056 M=3 bias", 5120, 2056, 3, bias=True, tunables={"linear.pdl": 1}),
        _case("pdl, 16 warps, K=72 (warps without k-steps): N=129 M=8", 129, 72, 8,
              tunables={"linear.pdl": 1, "linear.warps": 16}),
        _case("pdl 2 (L2 lines): N=5120 K=2056 M=3 bias", 5120, 2056, 3, bias=True, tunables={"linear.pdl": 2}),
        _case("pdl 2, 4 tiles: N=2049 K=4104 M=8", 2049, 4104, 8, tunables={"linear.pdl": 2, "linear.tiles": 4}),
        _case("pdl 2, 16 warps, K=72 (warps without k-steps): N=129 M=2", 129, 72, 2,
              tunables={"linear.pdl": 2, "linear.warps": 16}),
        _case("pdl 2, strided x and out: N=129 K=2048 M=4", 129, 2048, 4, x_pad=64, out_pad=3, tunables={"linear.pdl": 2}),
        # the custom op: ours, and its hand-backs to torch (bit for bit)
        _case("op: N=5120 K=2048 M=3 bias", 5120, 2048, 3, bias=True, path="op"),
        _case("op: M=9 goes to torch", 5120, 2048, 9, bias=True, path="op", expect="torch"),
        _case("op: x not 16-byte aligned goes to torch", 129, 2048, 2, path="op", expect="torch", misaligned=True),
        _case("op: fp16 N=7 K=72 M=1", 7, 72, 1, dtype="fp16", path="op"),
        # torch.compile (Inductor): the op's hand-back inside a compiled graph against stock
        # vLLM's compiled torch.nn.functional.linear, bit for bit; and the op taken when compiled
        _case("inductor: M=16 bias goes to torch, stock bits", 5120, 2048, 16, bias=True, path="inductor",
              expect="torch"),
        _case("inductor: M=300 goes to torch, stock bits", 2048, 4096, 300, path="inductor", expect="torch"),
        _case("inductor: M=4 bias, our kernel", 5120, 2048, 4, bias=True, path="inductor"),
        # CUDA graphs (with and without programmatic dependent launch)
        _case("graph: N=5120 K=2048 M=4 bias", 5120, 2048, 4, bias=True, path="graph"),
        _case("graph, pdl: N=2048 K=4096 M=1", 2048, 4096, 1, path="graph", tunables={"linear.pdl": 1}),
    ]
    return out + norm_cases() + fp8_cases() + qk_cases()


def configure(cfg: dict) -> None:
    """Exactly cfg's tunables set through the library's API; the op's plans are re-made."""
    _lib.tune_clear()
    _lib.tune_set(cfg)
    ops.forget_plans()


def run_case(c: dict, device="cuda") -> dict:
    configure(c["tunables"])
    try:
        return _run_case(c, device)
    finally:
        configure({})


def _reference(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def fp8_tensors(N, K, block, gen, device, transposed=False):
    """Random e4m3 weights (normal, up to the format's range) and positive fp32 block scales, as
    vLLM's block-FP8 layers hold them (scales [ceil(N/bn), K/bk], or a transposed view)."""
    bn, bk = block
    w = (torch.randn((N, K), generator=gen, device=device) * 96).clamp_(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-N // bn), K // bk)
    sc = (torch.rand(shape if not transposed else shape[::-1], generator=gen, device=device) + 0.5) * 1e-3 / K ** 0.5
    return w, (sc.t() if transposed else sc)


def _run_fp8(c: dict, device) -> dict:
    N, K, M, dtype = c["N"], c["K"], c["M"], c["dtype"]
    dt = linear_bench.TORCH_DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(200 + c["seed"])
    w, sc = fp8_tensors(N, K, c["block"], gen, device, c["transposed"])
    b = torch.randn(N, generator=gen, device=device).to(dt) if c["bias"] else None
    if c["misaligned"]:
        x = torch.randn(M * K + 8, generator=gen, device=device).to(dt)[4:4 + M * K].view(M, K)
    else:
        x = torch.randn((M, K + c["x_pad"]), generator=gen, device=device).to(dt)[:, :K]
    if "outliers" in c["name"]:  # saturation: one large value a group in row 0; row 1 all zeros
        x[0, ::128] = 300.0
        x[1].zero_()
    block = c["block"]
    ref = ops.linear_fp8_reference_cpu(x, w, sc, block, b).to(device)
    tol = bench.TOLERANCE[dtype]
    res = {k: v for k, v in c.items()}
    res["tolerance"] = tol
    if c["path"] == "op":
        return _run_fp8_op(res, x, w, sc, b, block, ref, tol)
    if c["path"] == "graph":
        return _run_graph(res, x, w, tol, gen, lambda o, xb: ops.linear_fp8_into(o, xb, w, sc, block, b),
                          lambda xb: ops.linear_fp8_reference_cpu(xb, w, sc, block, b).to(x.device))
    return _run_into(res, ref, tol, ops.linear_fp8_supports(x, w, sc, block, b),
                     lambda o: ops.linear_fp8_into(o, x, w, sc, block, b))


def _run_into(res, ref, tol, supported, into) -> dict:
    """into(out) into a poisoned, possibly strided out ([M, N] of a wider buffer), twice: the
    error against ref, determinism, and the padding left alone; supported: (ok, reason)."""
    ok, reason = supported
    res.update(supported=ok, reason=reason)
    if not ok:
        res.update(passed=False)
        return res
    (M, N), pad = ref.shape, res["out_pad"]
    ofull = torch.full((M, N + pad), float("nan"), dtype=linear_bench.TORCH_DTYPES[res["dtype"]],
                       device=ref.device)
    out = ofull[:, :N]
    into(out)
    err = bench.rel_err(out, ref)
    pad_ok = bool(torch.isnan(ofull[:, N:]).all()) if pad else True
    again = torch.full_like(out, float("nan"))
    into(again)
    det = bool(torch.equal(out, again))
    res.update(rel_err=err, deterministic=det, padding_untouched=pad_ok)
    res["passed"] = bool(err <= tol and det and pad_ok)
    return res


def _run_fp8_op(res, x, w, sc, b, block, ref, tol) -> dict:
    fallback_calls = []

    def fallback(xx, bb):
        fallback_calls.append(1)
        return ref.to(xx.dtype)

    key = ops.register_fp8_fallback(w, fallback)
    try:
        stats = dispatch.stats_of("linear")
        before = stats.snapshot()["taken"]
        y = torch.ops.opgraft.linear_fp8(x, w, sc, b, block[0], block[1])
        again = torch.ops.opgraft.linear_fp8(x, w, sc, b, block[0], block[1])
        taken = stats.snapshot()["taken"] - before
    finally:
        ops.unregister_fp8_fallback(key)
    err = bench.rel_err(y, ref)
    det = bool(torch.equal(y, again))
    res.update(rel_err=err, deterministic=det, taken=taken, fallback_calls=len(fallback_calls))
    if res["expect"] == "fallback":
        res["passed"] = bool(len(fallback_calls) == 2 and taken == 0 and torch.equal(y, ref.to(x.dtype)))
    else:
        res["passed"] = bool(err <= tol and det and taken == 2 and not fallback_calls)
    return res


NORM_EPS = 1e-6


def _norm_inputs(M, K, dt, gen, device, pad=0, misaligned=False):
    """x and residual ([M, K], rows padded by pad or 8 bytes past an aligned base) as a decoder
    layer's: the residual stream larger than the new part."""
    if misaligned:
        x = torch.randn(M * K + 8, generator=gen, device=device).to(dt)[4:4 + M * K].view(M, K)
    else:
        x = torch.randn((M, K + pad), generator=gen, device=device).to(dt)[:, :K]
    r = (4 * torch.randn((M, K + pad), generator=gen, device=device)).to(dt)[:, :K]
    return x, r


def _norm_reference(x, r, nw, w, b):
    """(fp64 [M, N], residual_out): vLLM's add + RMSNorm in torch, then the product in fp64."""
    n, ro = ops.add_rms_norm_reference(x, r, nw, NORM_EPS)
    return _reference(n, w, b), ro


def _within_two_roundings(got, want) -> bool:
    """Every element of got within two rounding steps (of its dtype) of want: the kernel's fp32
    sum of squares may round h * rstd the other way near a tie, and the product with the norm
    weight is rounded again."""
    step = 2.0 ** -(7 if want.dtype == torch.bfloat16 else 10)  # a step, relative, at most
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= w.abs() * 2 * step).all())


def _run_norm(c: dict, device) -> dict:
    N, K, M, dtype = c["N"], c["K"], c["M"], c["dtype"]
    dt = linear_bench.TORCH_DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(200 + c["seed"])
    w = linear_bench.make_weight(LinearShape("check", "w", N, K), dtype, device, seed=c["seed"])
    b = torch.randn(N, generator=gen, device=device).to(dt) if c["bias"] else None
    nw = (torch.rand(K, generator=gen, device=device) + 0.5).to(dt)
    x, r = _norm_inputs(M, K, dt, gen, device, c["x_pad"], c["misaligned"])
    ref, rref = _norm_reference(x, r, nw, w, b)
    tol = bench.TOLERANCE[dtype]
    res = {k: v for k, v in c.items()}
    res["tolerance"] = tol
    stats = dispatch.stats_of("linear")
    if c["path"] == "op":
        before = stats.snapshot()["taken"]
        y, ro = torch.ops.opgraft.add_rms_norm_linear(x, r, nw, NORM_EPS, w, b)
        again, _ = torch.ops.opgraft.add_rms_norm_linear(x, r, nw, NORM_EPS, w, b)
        taken = stats.snapshot()["taken"] - before
        err = bench.rel_err(y, ref)
        det = bool(torch.equal(y, again))
        res.update(rel_err=err, deterministic=det, taken=taken, residual_out_exact=bool(torch.equal(ro, rref)))
        if res["expect"] == "torch":  # handed back: the norm, then the linear op's own decision
            n, _ = ops.add_rms_norm_reference(x, r, nw, NORM_EPS)
            same = bool(torch.equal(y, ops.linear_or_torch(n, w, b)))
            res.update(bit_identical_to_hand_back=same)
            res["passed"] = bool(same and det and res["residual_out_exact"] and taken <= 2)
        else:
            res["passed"] = bool(err <= tol and det and taken == 2 and res["residual_out_exact"])
        return res
    normed = c.get("normed", False)
    # The normalized rows where the case asks for them (rows padded like x's), poisoned first.
    hn = torch.full((M, K + c["x_pad"]), float("nan"), dtype=dt, device=device)[:, :K] if normed else None
    if c["path"] == "graph":
        rbuf, ro = r.clone(), torch.empty_like(x)

        def call(o, xb):
            ops.add_rms_norm_linear_into(o, ro, xb, rbuf, nw, NORM_EPS, w, b, hn)

        def reference(xb):
            yref, want = _norm_reference(xb, rbuf, nw, w, b)
            res["residual_out_exact"] = res.get("residual_out_exact", True) and bool(torch.equal(ro, want))
            if normed:
                n, _ = ops.add_rms_norm_reference(xb, rbuf, nw, NORM_EPS)
                res["normed_out_ok"] = res.get("normed_out_ok", True) and _within_two_roundings(hn, n)
            return yref

        res = _run_graph(res, x, w, tol, gen, call, reference)
        res["passed"] = bool(res["passed"] and res["residual_out_exact"] and res.get("normed_out_ok", True))
        return res
    ro = torch.full(x.shape, float("nan"), dtype=dt, device=device)

    def into(o):
        ro.fill_(float("nan"))
        if normed:
            hn.fill_(float("nan"))
        ops.add_rms_norm_linear_into(o, ro, x, r, nw, NORM_EPS, w, b, hn)

    plan = ops.plan_for(x, w, b, norm=(r, nw, NORM_EPS, ro, hn))
    res = _run_into(res, ref, tol, (plan.handle is not None, plan.reason), into)
    if res["supported"]:
        res["residual_out_exact"] = bool(torch.equal(ro, rref))
        cref, cro, chn = ops.add_rms_norm_linear_reference_cpu(x, r, nw, NORM_EPS, w, b, normed=True)
        res["c_oracle_vs_torch_fp64"] = float((cref - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-300))
        ok = res["residual_out_exact"] and torch.equal(cro, rref.cpu()) and res["c_oracle_vs_torch_fp64"] < 1e-3
        if normed:  # against vLLM's norm in torch, and the oracle's rows
            n, _ = ops.add_rms_norm_reference(x, r, nw, NORM_EPS)
            res["normed_out_exact"] = bool(torch.equal(hn, n))
            res["normed_out_ok"] = _within_two_roundings(hn, n) and _within_two_roundings(hn.cpu(), chn)
            ok = ok and res["normed_out_ok"]
        res["passed"] = bool(res["passed"] and ok)
    return res


def _run_qk(c: dict, device) -> dict:
    from opgraft.ops import attention as attn

    N, K, M, D, dtype = c["N"], c["K"], c["M"], c["D"], c["dtype"]
    hq, hqk = c["q_heads"], c["qk_heads"]
    dt = linear_bench.TORCH_DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(300 + c["seed"])
    w = linear_bench.make_weight(LinearShape("check", "w", N, K), dtype, device, seed=c["seed"])
    b = torch.randn(N, generator=gen, device=device).to(dt) if c["bias"] else None
    x = torch.randn((M, K), generator=gen, device=device).to(dt)
    rows = 64
    qnw = (torch.rand(D, generator=gen, device=device) + 0.5).to(dt) if c["qknorm"] else None
    knw = (torch.rand(D, generator=gen, device=device) + 0.5).to(dt) if c["qknorm"] else None
    cs = (2 * torch.rand((rows, D), generator=gen, device=device) - 1).to(dt) if c["rope"] else None
    pos = torch.randint(0, rows, (M,), generator=gen, device=device) if c["rope"] else None
    if pos is not None and M > 1:
        pos[1] = rows + 5  # outside the cache: not rotated
    pro = attn.QKPrologue(qnw, knw, 1e-6, cs, pos, c["rope"])
    norm = plain_norm = None
    if c["add_norm"]:
        x, r = _norm_inputs(M, K, dt, gen, device)
        nw = (torch.rand(K, generator=gen, device=device) + 0.5).to(dt)
        norm = (r, nw, NORM_EPS, torch.empty_like(x))
        plain_norm = (r, nw, NORM_EPS, torch.empty_like(x))
    res = {k: v for k, v in c.items()}
    if c["path"] == "op":  # the op above linear.max_rows: torch's product, then the prologue in place in it
        args = (x, w, b, pos, cs, qnw, knw, 1e-6, D, hq, hqk - hq, c["rope"])
        out, again = torch.ops.opgraft.linear_qk(*args), torch.ops.opgraft.linear_qk(*args)
        plain = torch.nn.functional.linear(x, w, b)
        qn, kn = attn.qk_prologue(plain[:, :hq * D].view(M, hq, D), plain[:, hq * D:hqk * D].view(M, hqk - hq, D), pro)
        want = torch.cat((qn.reshape(M, -1), kn.reshape(M, -1), plain[:, hqk * D:]), dim=-1)
        torch.cuda.synchronize()
        res.update(prologue_bits=bool(torch.equal(out, want)), deterministic=bool(torch.equal(out, again)),
                   values_untouched=bool(torch.equal(out[:, hqk * D:], plain[:, hqk * D:])), oracle_ok=True,
                   rel_err=bench.rel_err(out, want.double()))
        res["passed"] = res["prologue_bits"] and res["deterministic"] and res["values_untouched"]
        return res
    out = torch.full((M, N), float("nan"), dtype=dt, device=device)
    ops.linear_qk_into(out, x, w, b, D, hq, hqk, pro, norm=norm)
    # the plain product at the epilogue plan's warp count (its clusters take 4 warps or fewer), so
    # that the warps' partial sums meet in the same order
    desc = ctypes.create_string_buffer(512)
    _lib.check(_lib.lib().opgraft_linear_describe(ctypes.byref(ops._qk_args(x, w, b, out, D, hq, hqk, pro, norm)),
                                                  linear_bench.device_of(device)[0], desc, len(desc)))
    warps = int(re.search(r"-DOG_WARPS=(\d+)", desc.value.decode()).group(1))
    configure(dict(c["tunables"], **{"linear.warps": warps}))
    plain = torch.full((M, N), float("nan"), dtype=dt, device=device)
    if plain_norm is not None:
        ops.add_rms_norm_linear_into(plain, plain_norm[3], x, *plain_norm[:3], w, b)
    else:
        ops.linear_into(plain, x, w, b)
    configure(c["tunables"])
    qn, kn = attn.qk_prologue(plain[:, :hq * D].view(M, hq, D), plain[:, hq * D:hqk * D].view(M, hqk - hq, D), pro)
    want = plain.clone()
    want[:, :hq * D], want[:, hq * D:hqk * D] = qn.view(M, -1), kn.view(M, -1)
    again = torch.full((M, N), float("nan"), dtype=dt, device=device)
    ops.linear_qk_into(again, x, w, b, D, hq, hqk, pro, norm=norm)
    torch.cuda.synchronize()
    res.update(prologue_bits=bool(torch.equal(out, want)), deterministic=bool(torch.equal(out, again)),
               values_untouched=bool(torch.equal(out[:, hqk * D:], plain[:, hqk * D:])))
    if plain_norm is None:  # the C oracle on CPU copies (the product in fp64, rounded, then the epilogue)
        cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
        cpro = attn.QKPrologue(*(cpu(t) for t in pro))  # named: the struct holds their addresses
        xc, wc, bc = cpu(x), cpu(w), cpu(b)
        a = ops._qk_args(xc, wc, bc, None, D, hq, hqk, cpro)
        ref = torch.empty((M, N), dtype=torch.float64)
        _lib.check(_lib.lib().opgraft_linear_reference(ctypes.byref(a), ctypes.cast(
            ref.data_ptr(), ctypes.POINTER(ctypes.c_double))))
        got, want_c = out.cpu(), ref.to(dt)
        res["oracle_ok"] = bench.heads_within_two_steps(got.view(M, N // D, D), want_c.view(M, N // D, D))
        res["rel_err"] = bench.rel_err(got, ref)
    else:
        res["oracle_ok"] = True  # the norm form's oracle is the plain product's case above
        res["rel_err"] = bench.rel_err(out, want.double())
    res["passed"] = bool(res["prologue_bits"] and res["deterministic"] and res["values_untouched"]
                         and res["oracle_ok"])
    return res


def _run_case(c: dict, device) -> dict:
    if c.get("fp8"):
        return _run_fp8(c, device)
    if c.get("qk"):
        return _run_qk(c, device)
    if c.get("norm"):
        return _run_norm(c, device)
    N, K, M, dtype = c["N"], c["K"], c["M"], c["dtype"]
    dt = linear_bench.TORCH_DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(100 + c["seed"])
    w = linear_bench.make_weight(LinearShape("check", "w", N, K), dtype, device, seed=c["seed"])
    b = torch.randn(N, generator=gen, device=device).to(dt) if c["bias"] else None
    if c["misaligned"]:  # 8 bytes past an aligned base
        x = torch.randn(M * K + 8, generator=gen, device=device).to(dt)[4:4 + M * K].view(M, K)
    else:
        x = torch.randn((M, K + c["x_pad"]), generator=gen, device=device).to(dt)[:, :K]
    ref = _reference(x, w, b)
    tol = bench.TOLERANCE[dtype]
    res = {k: v for k, v in c.items()}
    res["tolerance"] = tol
    if c["path"] == "op":
        return _run_op(res, x, w, b, ref, tol)
    if c["path"] == "graph":
        return _run_graph(res, x, w, tol, gen, lambda o, xb: ops.linear_into(o, xb, w, b),
                          lambda xb: _reference(xb, w, b))
    if c["path"] == "inductor":
        return _run_inductor(res, x, w, b, ref, tol)
    res = _run_into(res, ref, tol, ops.linear_supports(x, w, b), lambda o: ops.linear_into(o, x, w, b))
    if res["supported"] and N * K * M <= (8 << 20):  # the C fp64 oracle against torch's fp64
        cref = ops.linear_reference_cpu(x, w, b)
        res["c_oracle_vs_torch_fp64"] = float((cref - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-300))
        res["passed"] = bool(res["passed"] and res["c_oracle_vs_torch_fp64"] < 1e-9)
    return res


def _run_op(res, x, w, b, ref, tol) -> dict:
    stats = dispatch.stats_of("linear")
    before = stats.snapshot()["taken"]
    y = torch.ops.opgraft.linear(x, w, b)
    again = torch.ops.opgraft.linear(x, w, b)
    taken = stats.snapshot()["taken"] - before
    err = bench.rel_err(y, ref)
    det = bool(torch.equal(y, again))
    res.update(rel_err=err, deterministic=det, taken=taken, reason="")
    if res["expect"] == "torch":  # handed back: exactly torch's call
        same = bool(torch.equal(y, torch.nn.functional.linear(x, w, b)))
        res.update(bit_identical_to_torch=same, reason=ops.linear_supports(x, w, b)[1])
        res["passed"] = same and taken == 0 and det
    else:
        res["passed"] = bool(err <= tol and det and taken == 2 and y.shape == ref.shape)
    return res


def _run_inductor(res, x, w, b, ref, tol) -> dict:
    torch._dynamo.reset()
    stock = torch.compile(lambda t: torch.nn.functional.linear(t, w, b) * 2, fullgraph=True, dynamic=True)
    ours = torch.compile(lambda t: torch.ops.opgraft.linear(t, w, b) * 2, fullgraph=True, dynamic=True)
    stats = dispatch.stats_of("linear")
    before = stats.snapshot()["taken"]
    y, want = ours(x), stock(x)
    taken = stats.snapshot()["taken"] - before
    err = bench.rel_err(y / 2, ref)
    det = bool(torch.equal(y, ours(x)))
    res.update(rel_err=err, deterministic=det, taken=taken)
    if res["expect"] == "torch":
        same = bool(torch.equal(y, want))
        res.update(bit_identical_to_stock_compiled=same)
        res["passed"] = same and taken == 0 and det
    else:
        res["passed"] = bool(err <= tol and det and taken >= 1)
    return res


def _run_graph(res, x, w, tol, gen, call, reference) -> dict:
    """call(out, x) captured into a CUDA graph, replayed twice with new x each time: the error
    against reference(x) (float64 [M, N]) and whether the two replays agree bit for bit."""
    xbuf = x.clone()
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(out, xbuf)  # plans and compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out, xbuf)
    errs, det = [], True
    for _ in range(2):
        xbuf.copy_(torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        first = out.clone()
        errs.append(bench.rel_err(first, reference(xbuf)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        det &= bool(torch.equal(first, out))
    res.update(rel_err=max(errs), deterministic=det)
    res["passed"] = bool(max(errs) <= tol and det)
    return res


def bench_rows(ceiling: float, models: str = ",".join(LINEAR_PRESETS), rows: str = "1,2,4,8", dtype: str = "bf16",
               progress=print) -> list[dict]:
    """The linear bench at the presets' projections, against torch.nn.functional.linear; then the
    block-FP8 projections (ours and the read ceiling)."""
    r = [int(v) for v in rows.split(",")]
    out = linear_bench.bench_models(models.split(","), r, dtype, ceiling_tbps=ceiling,
                                    progress=lambda m: progress("  bench " + m))
    return out + linear_bench.bench_models(list(LINEAR_FP8_PRESETS), r, "fp8-block", ceiling_tbps=ceiling, timing="span",
                                           progress=lambda m: progress("  bench " + m))


def format_rows(rows: list[dict]) -> str:
    return linear_bench.format_table(rows)
