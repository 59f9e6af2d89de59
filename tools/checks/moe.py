"""The MoE op's GPU correctness cases (tools.gpucheck runs them): odd sizes, T = 1..64, fp16, int64
ids, router weight on input, strided tensors, duplicate and out-of-range ids, expert parallelism,
and each tunable path, against the fp64 oracles, with poisoned outputs and a bit-identical rerun.

FP8 weights (cases named "fp8 ..."; `python -m tools.gpucheck --only fp8` runs them alone):
block (128x128, and vLLM 0.33's 64x64 / 32x32) and per-tensor scales, weights quantized from
random bf16 ones with vLLM's own functions where they import, activations as vLLM's prepare step
quantizes them; each against the fp64 oracle of the quantized model (tolerance 1e-2: the
intermediate is f16 on 16-row scales) and, where vLLM's TritonExperts runs, against vLLM's
result: its own error vs the oracle is stated next to ours, and ours vs vLLM's must stay within
1.25x vLLM's own error. "routed fp8 block x16 ..." cases hand the kernels bf16/fp16 hidden states
that gate_up quantizes itself: against the oracle of that quantization (done here in torch, and by
the C oracle) and bit for bit against the e4m3 form with it done beforehand; "routed fp8 tensor
x16 ..." likewise with per-tensor weight scales and gate_up's 1 x 128 groups (against the oracles
only: the per-tensor e4m3 form takes one activation scale). The bench rows: OPGRAFT_CHECK_DTYPES
(default "bf16,fp8-block,fp8-tensor") picks the dtypes."""

from __future__ import annotations

import os

import torch

from opgraft import bench
from opgraft.bench import linear as linear_bench
from opgraft.bench import moe as moe_bench
from opgraft.bench.moe import tunables
from opgraft.ops import moe as ops
from opgraft.presets import PRESETS, MoeShape

NAME = "moe"


def prepare() -> None:
    """Before the cases: every token count the kernel supports, and the expert-parallel path."""
    import os

    moe_bench.measure_whole_token_range()
    os.environ["OPGRAFT_TUNE_MOE_EXPERT_MAP"] = "1"
    os.environ.setdefault("OPGRAFT_TUNE_MOE_FP8", "1")  # the rule hands FP8 back; the check runs the kernels


def _case(name, shape, T, dtype="bf16", ids64=False, on_input=False, x_pad=0, out_pad=0, dup=False, invalid=False,
          seed=0, ep=0, tunables=None, hot=False):
    """ep > 0: expert parallelism, shape's experts are a random subset of ep global experts, the
    ids are global and an expert_map sends them to local ids or -1. hot: every token's first
    choice is expert 0. tunables: {key: value} set for this case only (through their env vars)."""
    return dict(name=name, shape=shape, T=T, dtype=dtype, ids64=ids64, on_input=on_input, x_pad=x_pad,
                out_pad=out_pad, dup=dup, invalid=invalid, seed=seed, ep=ep, tunables=tunables or {}, hot=hot)


SLOTS = {"moe.gate_up.slot_routing": 1, "moe.down.warp_routing": 1}


def cases() -> list[dict]:
    small = MoeShape("small", 16, 256, 128, 4)
    odd = MoeShape("odd", 7, 96, 160, 3)
    cases = []
    for T in (1, 3, 8, 13, 16, 33, 64):
        cases.append(_case(f"small T={T}", small, T))
    cases += [
        _case("fp16 T=5", small, 5, dtype="fp16"),
        _case("fp16 T=40", small, 40, dtype="fp16"),
        _case("int64 ids T=9", small, 9, ids64=True),
        _case("router weight on input T=6", small, 6, on_input=True),
        _case("strided x and out T=11", small, 11, x_pad=64, out_pad=32),
        _case("duplicate expert in a row T=7", small, 7, dup=True),
        _case("id -1 and E (not routed) T=4", small, 4, invalid=True),
        _case("odd dims E=7 H=96 I=160 k=3 T=10", odd, 10),
        _case("Qwen3-30B-A3B T=2", PRESETS["Qwen3-30B-A3B"], 2),
        _case("expert_map: 16 of 32 experts T=1", small, 1, ep=32),
        _case("expert_map: 16 of 64 experts T=9, int64 ids", small, 9, ids64=True, ep=64),
        _case("expert_map: Qwen3-30B-A3B/ep2 T=4", MoeShape("Qwen3-30B-A3B/ep2", 64, 2048, 768, 8), 4, ep=128),
        _case("down loads form 4: small T=13", small, 13, tunables={"moe.down_load": 4}),
        _case("fused: small T=13, duplicate ids", small, 13, dup=True, tunables={"moe.fused": 1}),
        _case("fused: odd dims T=3", odd, 3, tunables={"moe.fused": 1}),
        _case("gate_up min blocks 2: Qwen3-30B-A3B T=1", PRESETS["Qwen3-30B-A3B"], 1,
              tunables={"moe.gate_up.min_blocks": 2}),
        # down's first weight loads before its wait for gate_up (programmatic dependent launch, sm_90)
        _case("down early: small T=3, duplicate ids", small, 3, dup=True, tunables={"moe.pdl": 1, "moe.down.early": 1}),
        _case("down early: odd dims T=2, strided x and out", odd, 2, x_pad=64, out_pad=32,
              tunables={"moe.pdl": 1, "moe.down.early": 1}),
        _case("down early: Qwen3-30B-A3B T=1", PRESETS["Qwen3-30B-A3B"], 1, tunables={"moe.pdl": 1, "moe.down.early": 1}),
        # down lets the next kernel launch as it starts (nothing follows here: the path runs, the output stays right)
        _case("down trigger: Qwen3-30B-A3B T=1", PRESETS["Qwen3-30B-A3B"], 1,
              tunables={"moe.pdl": 1, "moe.down.early": 1, "moe.trigger": 1}),
        # gate_up's one-tile pass; an expert with more than 8 pairs takes the two-tile path
        _case("gate_up one tile a pass: small T=16, expert 0 in every token", small, 16, hot=True,
              tunables={"moe.gate_up.nt": 1}),
        _case("gate_up one tile a pass: small T=13, duplicate ids", small, 13, dup=True,
              tunables={"moe.gate_up.nt": 1}),
        _case("gate_up one tile a pass: Qwen3-30B-A3B T=16, 16 warps", PRESETS["Qwen3-30B-A3B"], 16,
              tunables={"moe.gate_up.nt": 1, "moe.gate_up.warps": 16}),
        # gate_up's one-slot blocks at one token; gate_up after the previous kernel under PDL (sm_90)
        _case("gate_up one slot: Qwen3-30B-A3B T=1", PRESETS["Qwen3-30B-A3B"], 1,
              tunables={"moe.gate_up.one_token": 1}),
        _case("gate_up one slot: small T=1, duplicate ids, pdl in", small, 1, dup=True,
              tunables={"moe.gate_up.one_token": 1, "moe.pdl_in": 1, "moe.pdl": 1, "moe.down.early": 1}),
        _case("gate_up one slot: small T=1, id -1 and E, int64 ids", small, 1, ids64=True, invalid=True,
              tunables={"moe.gate_up.one_token": 1}),
        _case("gate_up one slot: expert_map 16 of 32 experts T=1, pdl in", small, 1, ep=32,
              tunables={"moe.gate_up.one_token": 1, "moe.pdl_in": 1}),
        _case("down one slot: small T=1, duplicate ids, fp16", small, 1, dup=True, dtype="fp16",
              tunables={"moe.down.one_token": 1}),
        _case("down one slot: small T=1, id -1 and E, both one slot", small, 1, invalid=True,
              tunables={"moe.down.one_token": 1, "moe.gate_up.one_token": 1}),
        _case("down one slot: odd dims E=7 k=3 T=1, expert_map 7 of 8, down early", odd, 1, ep=8,
              tunables={"moe.down.one_token": 1, "moe.pdl": 1, "moe.down.early": 1}),
        _case("down one slot: Qwen3-30B-A3B T=1, all one-token paths, pdl in", PRESETS["Qwen3-30B-A3B"], 1,
              tunables={"moe.down.one_token": 1, "moe.gate_up.one_token": 1, "moe.pdl_in": 1, "moe.pdl": 1,
                        "moe.down.early": 1}),
        # routing by slot (gate_up) and per warp (down) for calls of up to 32 routing slots
        _case("slot routing: small T=3, duplicate ids", small, 3, dup=True, tunables=SLOTS),
        _case("slot routing: small T=8, id -1 and E, int64 ids", small, 8, ids64=True, invalid=True,
              tunables=SLOTS),
        _case("slot routing: odd dims E=7 k=3 T=10 (more slots than experts)", odd, 10, tunables=SLOTS),
        _case("slot routing: expert_map 16 of 32 experts T=4, fp16", small, 4, ep=32, dtype="fp16",
              tunables=SLOTS),
        _case("slot routing: k=2 T=16, expert 0 in every token, gate_up one tile a pass",
              MoeShape("small-k2", 16, 256, 128, 2), 16, hot=True, tunables=dict(SLOTS, **{"moe.gate_up.nt": 1})),
        _case("slot routing: Qwen3-30B-A3B T=4, pdl, down early", PRESETS["Qwen3-30B-A3B"], 4,
              tunables=dict(SLOTS, **{"moe.pdl": 1, "moe.down.early": 1, "moe.pdl_in": 1})),
        _case("pdl in: odd dims T=5, strided x and out", odd, 5, x_pad=64, out_pad=32,
              tunables={"moe.pdl_in": 1, "moe.pdl": 1}),
        _case("pdl in: Qwen3-30B-A3B T=1, one slot, down early", PRESETS["Qwen3-30B-A3B"], 1,
              tunables={"moe.pdl_in": 1, "moe.pdl": 1, "moe.down.early": 1, "moe.gate_up.one_token": 1}),
    ]
    # An expert-parallel rank with fewer local experts than a token's picks (DeepSeek-V3 at EP 64:
    # 4 local experts, top-8): most of a token's slots are other ranks'.
    few = MoeShape("2 local experts, k=6", 2, 256, 128, 6)
    cases += [
        _case("expert_map: 2 of 8 experts, k=6 > 2, T=1", few, 1, ep=8),
        _case("expert_map: 2 of 8 experts, k=6 > 2, T=5, fp16", few, 5, ep=8, dtype="fp16"),
        _case("expert_map: 2 of 8 experts, k=6 > 2, T=3, fused", few, 3, ep=8, tunables={"moe.fused": 1}),
        _case("expert_map: 4 of 256 experts, k=8 > 4 (DeepSeek-V3/ep64 dims), T=2",
              MoeShape("DeepSeek-V3/ep64", 4, 7168, 2048, 8), 2, ep=256),
        _case("expert_map: 4 of 256 experts, k=8 > 4 (DeepSeek-V3/ep64 dims), T=1, fp16", 
              MoeShape("DeepSeek-V3/ep64", 4, 7168, 2048, 8), 1, ep=256, dtype="fp16"),
    ]
    return cases + routed_cases() + fp8_cases()


def _routed_case(name, shape, T, renorm=True, dtype="bf16", ties=False, tunables=None, fp8=False, xq=False,
                 scales="fp8-block"):
    """Routing from the router's logits in the kernels (cases named "routed ..."). ties: equal
    logits at the top and across the k-th place, and a -0 next to a +0. Every token count is
    checked: moe.route is forced on above the shipped 4 tokens (and moe.fp8 with fp8: FP8 weights
    with scales (block or per-tensor) and activations, the logits and output in dtype; xq: the
    activations in dtype too, quantized by gate_up, "routed fp8 block x16 ...")."""
    fp8_on = {"moe.fp8": 1, "moe.fp8_quantize": int(xq)} if fp8 else {}
    sk = scales.split("-")[1]
    kind = f"fp8 {sk} x16 " if xq else f"fp8 {sk} " if fp8 else ""
    return dict(name=f"routed {kind}{name}", shape=shape, T=T, renorm=renorm, dtype=dtype, ties=ties,
                tunables={"moe.route": 1, **fp8_on, **(tunables or {})}, routed=True, seed=0, fp8=fp8, xq=xq,
                scales=scales)


def routed_cases() -> list[dict]:
    small = MoeShape("small", 16, 256, 128, 4)
    q30 = PRESETS["Qwen3-30B-A3B"]
    ONE = {"moe.gate_up.one_token": 1, "moe.down.one_token": 1, "moe.pdl_in": 1, "moe.pdl": 1, "moe.down.early": 1}
    return [
        _routed_case("Qwen3-30B-A3B T=1", q30, 1),
        _routed_case("Qwen3-30B-A3B T=2", q30, 2),
        _routed_case("Qwen3-30B-A3B T=8", q30, 8),
        _routed_case("Qwen3-30B-A3B T=1, softmax without renormalize", q30, 1, renorm=False),
        _routed_case("Qwen3-30B-A3B T=1, all one-token paths, pdl in", q30, 1, tunables=ONE),
        _routed_case("Qwen3-30B-A3B T=4, slot routing, pdl in, down early", q30, 4,
                     tunables=dict(SLOTS, **{"moe.pdl": 1, "moe.down.early": 1, "moe.pdl_in": 1})),
        _routed_case("small T=13, ties", small, 13, ties=True),
        _routed_case("small T=1, ties, one-token paths", small, 1, ties=True, tunables=ONE),
        _routed_case("small T=64, softmax without renormalize", small, 64, renorm=False),
        _routed_case("small T=5, fp16, ties", small, 5, dtype="fp16", ties=True),
        _routed_case("small T=3, fused", small, 3, tunables={"moe.fused": 1}),
        _routed_case("odd dims E=7 k=3 T=10", MoeShape("odd", 7, 96, 160, 3), 10),
        _routed_case("Mixtral-8x7B T=4", PRESETS["Mixtral-8x7B"], 4),
        _routed_case("Kimi-K2 dims E=384 T=1", PRESETS["Kimi-K2"], 1),
        _routed_case("Qwen3-30B-A3B T=1", q30, 1, fp8=True),
        _routed_case("Qwen3-30B-A3B T=2, pdl in, down early", q30, 2, fp8=True,
                     tunables={"moe.pdl": 1, "moe.down.early": 1, "moe.pdl_in": 1}),
        _routed_case("Qwen3-30B-A3B T=8, general routing", q30, 8, fp8=True,
                     tunables={"moe.gate_up.slot_routing": 0, "moe.down.warp_routing": 0}),
        _routed_case("small T=5, ties, fp16 out", small, 5, dtype="fp16", ties=True, fp8=True),
        _routed_case("DeepSeek-V3/tp8 dims T=1, softmax without renormalize",
                     MoeShape("DeepSeek-V3/tp8", 256, 7168, 256, 8), 1, renorm=False, fp8=True),
        _routed_case("Qwen3-30B-A3B T=1", q30, 1, fp8=True, xq=True),
        _routed_case("Qwen3-30B-A3B T=2, pdl in, down early", q30, 2, fp8=True, xq=True,
                     tunables={"moe.pdl": 1, "moe.down.early": 1, "moe.pdl_in": 1}),
        _routed_case("Qwen3-30B-A3B T=8, general routing", q30, 8, fp8=True, xq=True,
                     tunables={"moe.gate_up.slot_routing": 0, "moe.down.warp_routing": 0}),
        _routed_case("Qwen3-30B-A3B T=1, 32-k steps", q30, 1, fp8=True, xq=True, tunables={"moe.fp8_kstep": 32}),
        _routed_case("small T=5, ties, fp16 out", small, 5, dtype="fp16", ties=True, fp8=True, xq=True),
        _routed_case("DeepSeek-V3/ep8 dims E=32 T=1", MoeShape("DeepSeek-V3/ep8", 32, 7168, 2048, 8), 1, fp8=True,
                     xq=True),
        _routed_case("DeepSeek-V3/tp8 dims T=2, softmax without renormalize",
                     MoeShape("DeepSeek-V3/tp8", 256, 7168, 256, 8), 2, renorm=False, fp8=True, xq=True),
        _routed_case("Mixtral-8x7B T=1", PRESETS["Mixtral-8x7B"], 1, fp8=True, scales="fp8-tensor"),
        _routed_case("Mixtral-8x7B T=1", PRESETS["Mixtral-8x7B"], 1, fp8=True, xq=True, scales="fp8-tensor"),
        _routed_case("Mixtral-8x7B T=2", PRESETS["Mixtral-8x7B"], 2, fp8=True, xq=True, scales="fp8-tensor"),
        _routed_case("Mixtral-8x7B T=8, 32-k steps", PRESETS["Mixtral-8x7B"], 8, fp8=True, xq=True,
                     scales="fp8-tensor", tunables={"moe.fp8_kstep": 32}),
        _routed_case("small T=5, ties, fp16 out", small, 5, dtype="fp16", ties=True, fp8=True, xq=True,
                     scales="fp8-tensor"),
    ]


def _expected_routing(logits, k: int, renorm: bool):
    """vLLM's topk_softmax in fp64: the k largest logits, ties to the lower id, in decreasing order."""
    v = logits.double()
    order = torch.sort(-v, dim=-1, stable=True).indices[:, :k]
    p = torch.softmax(v, dim=-1).gather(1, order)
    if renorm:
        p = p / p.sum(-1, keepdim=True)
    return p, order.to(torch.int32)


def _vllm_topk(logits, k: int, renorm: bool):
    """vLLM's own topk_softmax on these logits, or (None, why)."""
    try:
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    except Exception as e:
        return None, f"vLLM not importable ({type(e).__name__})"
    try:
        w, ids, _ = fused_topk(logits, logits, k, renorm)
    except Exception as e:
        return None, f"vLLM's fused_topk failed ({type(e).__name__}: {str(e)[:80]})"
    return (w, ids), ""


def _run_routed_case(c: dict, device) -> dict:
    shape: MoeShape = c["shape"]
    T, dtype, k, E = c["T"], c["dtype"], shape.top_k, shape.num_experts
    gen = torch.Generator(device=device).manual_seed(300 + c["seed"])
    fp8 = fp8_given = None
    kind = c.get("scales", "fp8-block")
    if c.get("fp8"):  # e4m3 weights and activations, as vLLM's prepare step hands them (xq: in dtype)
        w13, s13, w2, s2 = moe_bench.make_weights_fp8(shape, kind, device, seed=c["seed"])
        xb = moe_bench.make_x(T, shape.hidden, dtype, device, gen)
        if c.get("xq"):
            x, fp8 = xb, moe_bench.fp8_scales(kind, None, s13, s2)
            xq, xs = moe_bench.quantize_as_the_kernel(xb, moe_bench.kernel_group(fp8.block_shape))
            fp8_given = moe_bench.fp8_scales(kind, xs, s13, s2)  # the same quantization, done here
        else:
            x, xs = moe_bench.quantize_activations_fp8(xb, kind, moe_bench.FP8_BLOCK[1])
            fp8 = moe_bench.fp8_scales(kind, xs, s13, s2)
        odt = xb.dtype
    else:
        w13, w2 = moe_bench.make_weights(shape, dtype, device, seed=c["seed"])
        x = moe_bench.make_x(T, shape.hidden, dtype, device, gen)
        odt = x.dtype
    logits = (torch.randn((T, E), generator=gen, device=device) * 2).to(odt)
    if c["ties"]:
        logits[:, 1] = logits[:, 0] = logits.max(-1).values + 1  # a tie at the top
        kth = torch.sort(logits.float(), -1, descending=True).values[:, k - 1]
        logits[:, E - 1] = kth.to(logits.dtype)  # a tie at the k-th place: the lower id wins it
        logits[:, 2], logits[:, 3] = 0.0, -0.0
    out = torch.full((T, shape.hidden), float("nan"), dtype=odt, device=device)
    tw = torch.full((T, k), float("nan"), device=device)
    ids = torch.full((T, k), -7, dtype=torch.int32, device=device)
    plan = ops.plan_for_routed(x, w13, w2, logits, k, c["renorm"], out, tw, ids, fp8=fp8)
    res = {k_: v for k_, v in c.items() if k_ != "shape"}
    res.update(shape=shape.as_dict(), supported=plan.handle is not None, reason=plan.reason)
    if plan.handle is None:
        res.update(passed=False)
        return res
    ops.run_routed(plan, out, x, w13, w2, logits, k, c["renorm"], tw, ids, fp8=fp8)
    ew, eids = _expected_routing(logits, k, c["renorm"])
    ids_ok = bool(torch.equal(ids, eids))
    w_err = float(((tw.double() - ew).abs() / ew.abs().clamp_min(1e-30)).max())
    if fp8 is None:
        ref = moe_bench.reference(x, w13, w2, ew.float(), eids)
    elif fp8_given is not None:
        ref = moe_bench.reference_fp8(xq, fp8_given, w13, w2, ew.float(), eids)
    else:
        ref = moe_bench.reference_fp8(x, fp8, w13, w2, ew.float(), eids)
    err = bench.rel_err(out, ref)
    # block scales only: the per-tensor e4m3 form takes one activation scale, not groups
    against_e4m3 = fp8_given is not None and kind == "fp8-block"
    if against_e4m3:
        # the e4m3 form with this quantization done beforehand: the same bits where both compile
        # the same configuration with 64-k steps (the same f16 operands and sums). x's 16-bit
        # registers can lower gate_up's unroll, which splits H over the warps' rounds otherwise
        # and so sums in another order; with 32-k steps the e4m3 form runs e4m3 MMAs. Only close then.
        e4m3 = torch.full_like(out, float("nan"))
        ops.moe_routed_into(e4m3, xq, w13, w2, logits, k, c["renorm"], fp8=fp8_given)
        res["same_as_quantized_first"] = bool(torch.equal(out, e4m3))
        res["rel_err_vs_quantized_first"] = bench.rel_err(out, e4m3.double())
        arch = 90 if device == "cpu" else linear_bench.device_of(device)[0]
        cfg16, cfg8 = (ops.routed_config(xi, w13, w2, logits, k, c["renorm"], fp8=fi, arch=arch).split()
                       for xi, fi in ((x, fp8), (xq, fp8_given)))
        res["config_differs_from_quantized_first"] = " ".join(
            f"{a} vs {b}" for a, b in zip(cfg16, cfg8) if a != b and not a.startswith(("-DOG_XQ=", "-DOG_XG=")))
    # the same call with the routing given (vLLM's form): the same bits
    given = torch.full_like(out, float("nan"))
    ops.moe_experts_into(given, x, w13, w2, tw.clone(), ids.clone(), fp8=fp8)
    same_as_given = bool(torch.equal(out, given))
    again = torch.full_like(out, float("nan"))
    ops.run_routed(plan, again, x, w13, w2, logits, k, c["renorm"], fp8=fp8)  # no routing outputs this time
    det = bool(torch.equal(out, again))
    tol = bench.TOLERANCE[dtype] if fp8 is None else FP8_TOL
    res.update(rel_err=err, tolerance=tol, ids_exact=ids_ok, weights_rel_err=w_err, same_as_given_routing=same_as_given,
               deterministic=det)
    passed = err <= tol and ids_ok and w_err <= 1e-5 and same_as_given and det
    if against_e4m3:
        only_close = c["tunables"].get("moe.fp8_kstep") == 32 or res["config_differs_from_quantized_first"]
        close = only_close and res["rel_err_vs_quantized_first"] <= 1e-3
        passed = passed and (res["same_as_quantized_first"] or close)
    if shape.hidden * shape.inter * E <= 16 * 256 * 256 or fp8_given is not None:
        cref = ops.moe_routed_reference_cpu(x, w13, w2, logits, k, c["renorm"], fp8=fp8)
        res["c_oracle_vs_torch_fp64"] = float((cref - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-300))
        passed = passed and res["c_oracle_vs_torch_fp64"] < 1e-6
    v, why = _vllm_topk(logits, k, c["renorm"])
    if v is None:
        res["vllm_missing"] = why
    else:
        res["ids_match_vllm"] = bool(torch.equal(v[1].to(torch.int32), ids))
        res["weights_rel_err_vs_vllm"] = float(((tw - v[0]).abs() / v[0].abs().clamp_min(1e-30)).max())
        passed = passed and res["ids_match_vllm"] and res["weights_rel_err_vs_vllm"] <= 1e-5
    res["passed"] = bool(passed)
    return res


FP8_TOL = 1e-2  # the e4m3 inputs, the f16 intermediate, the output bf16


def _fp8_case(name, shape, T, kind="fp8-block", block=(128, 128), out_dtype="bf16", ids64=False, x_pad=0,
              out_pad=0, dup=False, invalid=False, seed=0, ep=0, tunables=None, hot=False, transposed=False,
              vllm=False):
    """An FP8 case (see _case); block: the weight blocks (fp8-block); transposed: the weight
    scales in a transposed (DeepGEMM-like) layout; vllm: compare with vLLM's TritonExperts too
    (a few cases: each new shape costs vLLM a Triton compile)."""
    c = _case(name, shape, T, out_dtype, ids64, False, x_pad, out_pad, dup, invalid, seed, ep, tunables, hot)
    c.update(kind=kind, block=block if kind == "fp8-block" else None, transposed=transposed, vllm=vllm)
    return c


def fp8_cases() -> list[dict]:
    small = MoeShape("small", 16, 256, 128, 4)
    odd = MoeShape("odd", 7, 96, 160, 3)
    q30 = PRESETS["Qwen3-30B-A3B"]
    few = MoeShape("2 local experts, k=6", 2, 256, 128, 6)
    slots_off = {"moe.gate_up.slot_routing": 0, "moe.down.warp_routing": 0}
    pdl = {"moe.pdl": 1, "moe.down.early": 1, "moe.pdl_in": 1}
    cases = []
    for T in (1, 2, 8):
        cases.append(_fp8_case(f"fp8 block Qwen3-30B-A3B T={T}", q30, T, vllm=T != 2))
    for T in (1, 2, 4, 8):  # table.c's tuned rows for this shape (v39)
        cases.append(_fp8_case(f"fp8 tensor Mixtral-8x7B T={T}", PRESETS["Mixtral-8x7B"], T, kind="fp8-tensor",
                               vllm=T == 1))
    # the configurations of table.c's rows for these shapes (v36)
    for T in (1, 2, 4):
        cases.append(_fp8_case(f"fp8 block tuned rows Qwen3-235B-A22B T={T}", PRESETS["Qwen3-235B-A22B"], T))
    for T in (1, 4, 8):
        cases.append(_fp8_case(f"fp8 block tuned rows Kimi-K2/tp8 T={T}", PRESETS["Kimi-K2"].per_rank(8), T))
    for T in (1, 2, 8):  # the H100's rows for this shape (v69); elsewhere the rule's configuration
        cases.append(_fp8_case(f"fp8 block tuned rows Qwen3-235B-A22B/tp4 T={T}", PRESETS["Qwen3-235B-A22B"].per_rank(4), T))
    cases += [
        _fp8_case("fp8 tensor Qwen3-30B-A3B T=3", q30, 3, kind="fp8-tensor", vllm=True),
        _fp8_case("fp8 block small T=5", small, 5),
        _fp8_case("fp8 block down trigger Qwen3-30B-A3B T=1", q30, 1, tunables=dict(pdl, **{"moe.trigger": 1})),
        _fp8_case("fp8 block small T=13", small, 13, vllm=True),
        _fp8_case("fp8 block small T=33", small, 33),
        _fp8_case("fp8 block small T=64", small, 64),
        _fp8_case("fp8 tensor small T=64", small, 64, kind="fp8-tensor"),
        _fp8_case("fp8 block 64x64 (vLLM 0.33 refined) Qwen3-30B-A3B/tp4 T=2",
                  MoeShape("Qwen3-30B-A3B/tp4", 128, 2048, 192, 8), 2, block=(64, 64), vllm=True),
        _fp8_case("fp8 block 32x32 odd dims E=7 H=96 I=160 k=3 T=10", odd, 10, block=(32, 32)),
        _fp8_case("fp8 tensor odd dims E=7 H=96 I=160 k=3 T=5 (K, N no multiples of 128)", odd, 5,
                  kind="fp8-tensor", vllm=True),
        _fp8_case("fp8 tensor Qwen3-30B-A3B/tp8 I=96 T=4", MoeShape("Qwen3-30B-A3B/tp8", 128, 2048, 96, 8), 4,
                  kind="fp8-tensor"),
        _fp8_case("fp8 block fp16 out small T=6", small, 6, out_dtype="fp16", vllm=False),
        _fp8_case("fp8 block int64 ids, strided x and out small T=9", small, 9, ids64=True, x_pad=64, out_pad=32),
        _fp8_case("fp8 block transposed weight scales small T=3", small, 3, transposed=True, vllm=False),
        _fp8_case("fp8 block duplicate expert in a row small T=7", small, 7, dup=True, vllm=False),
        _fp8_case("fp8 tensor duplicate expert, general routing small T=3", small, 3, kind="fp8-tensor", dup=True,
                  tunables=slots_off, vllm=False),
        _fp8_case("fp8 block id -1 and E (not routed) small T=4", small, 4, invalid=True, vllm=False),
        _fp8_case("fp8 block general routing Qwen3-30B-A3B T=2", q30, 2, tunables=slots_off),
        _fp8_case("fp8 block expert 0 in every token small T=16", small, 16, hot=True),
        _fp8_case("fp8 block pdl, down early, pdl in Qwen3-30B-A3B T=1", q30, 1, tunables=pdl),
        _fp8_case("fp8 tensor pdl, general routing odd dims T=3", odd, 3, kind="fp8-tensor",
                  tunables=dict(pdl, **slots_off)),
        _fp8_case("fp8 block load forms 1 Qwen3-30B-A3B T=4", q30, 4, tunables={"moe.load": 1, "moe.down_load": 1}),
        # expert parallelism, fewer local experts than a token's picks (DeepSeek-V3 at EP 64)
        _fp8_case("fp8 block expert_map: 2 of 8 experts, k=6 > 2, T=1", few, 1, ep=8, vllm=True),
        _fp8_case("fp8 tensor expert_map: 2 of 8 experts, k=6 > 2, T=5", few, 5, kind="fp8-tensor", ep=8),
        _fp8_case("fp8 block expert_map: 4 of 256 experts, k=8 > 4 (DeepSeek-V3/ep64 dims), T=2",
                  MoeShape("DeepSeek-V3/ep64", 4, 7168, 2048, 8), 2, ep=256, vllm=True),
        _fp8_case("fp8 block expert_map: 16 of 64 experts small T=9, general routing", small, 9, ep=64,
                  tunables=slots_off),
    ]
    return cases


def run_case(c: dict, device="cuda") -> dict:
    """One correctness case, with its tunables (if any) set while it runs."""
    with tunables(c["tunables"]):
        if c.get("routed"):
            return _run_routed_case(c, device)
        return _run_fp8_case(c, device) if "kind" in c else _run_case(c, device)


def _to_local(ids, emap, k: int):
    """ids with this rank's experts in them: token 0 routed to as many of them as k allows, every
    other token to one (a rank of 4 of 256 experts would otherwise see no token routed to it, and
    its all-zero output would match any kernel). Each row stays k distinct experts."""
    local = (emap >= 0).nonzero().flatten().tolist()
    rows = ids.tolist()
    for t, row in enumerate(rows):
        want = local[: min(k, len(local))] if t == 0 else [local[t % len(local)]]
        rows[t] = want + [e for e in row if e not in want][: k - len(want)]
    return torch.tensor(rows, dtype=ids.dtype, device=ids.device)


def _routing(c: dict, global_experts: int, device, gen):
    """A case's routing over global_experts: weights, ids, and with c["ep"] the expert_map of a rank
    holding a random subset of them; then the ids' edits (a duplicate expert in a row, expert 0
    in every token, ids routed nowhere)."""
    shape: MoeShape = c["shape"]
    tw, ids = moe_bench.make_routing(c["T"], global_experts, shape.top_k, device, gen,
                                     ids_dtype=torch.int64 if c["ids64"] else torch.int32)
    emap = moe_bench.ep_map(shape, global_experts, device, c["seed"]) if c["ep"] else None
    if emap is not None:
        ids = _to_local(ids, emap, shape.top_k)
    if c["dup"]:
        ids[:, 1] = ids[:, 0]
    if c["hot"]:
        ids[:, 0] = 0
    if c["invalid"]:
        ids[0, 0] = -1
        ids[-1, -1] = shape.num_experts
    return tw, ids, emap


def _run_fp8_case(c: dict, device) -> dict:
    shape: MoeShape = c["shape"]
    T, kind, block = c["T"], c["kind"], c["block"] or moe_bench.FP8_BLOCK
    gen = torch.Generator(device=device).manual_seed(200 + c["seed"])
    q13, s13, q2, s2 = moe_bench.make_weights_fp8(shape, kind, device, seed=c["seed"], block=block)
    if c["transposed"]:  # the same scales in memory as [E, kb, nb], read through a transposed view
        s13 = s13.transpose(1, 2).contiguous().transpose(1, 2)
        s2 = s2.transpose(1, 2).contiguous().transpose(1, 2)
    G = c["ep"] or shape.num_experts
    tw, ids, emap = _routing(c, G, device, gen)
    xfull = moe_bench.make_x(T, shape.hidden + c["x_pad"], "bf16", device, gen)
    x = xfull[:, : shape.hidden]
    xq, xs = moe_bench.quantize_activations_fp8(x.contiguous(), kind, block[1])
    if c["x_pad"]:  # the quantized activations in rows of a wider buffer
        xqf = torch.zeros((T, shape.hidden + c["x_pad"]), dtype=xq.dtype, device=device)
        xqf[:, : shape.hidden] = xq
        xq = xqf[:, : shape.hidden]
    fp8 = moe_bench.fp8_scales(kind, xs, s13, s2, block)
    odt = moe_bench.TORCH_DTYPES[c["dtype"]]
    ofull = torch.full((T, shape.hidden + c["out_pad"]), float("nan"), dtype=odt, device=device)
    out = ofull[:, : shape.hidden]
    ok, reason = ops.moe_supports(xq, q13, q2, tw, ids, False, emap, fp8=fp8, out_dtype=odt)
    res = {k: v for k, v in c.items() if k != "shape"}
    res.update(shape=shape.as_dict(), supported=ok, reason=reason, tolerance=FP8_TOL)
    if not ok:
        res.update(passed=False)
        return res
    ops.moe_experts_into(out, xq, q13, q2, tw, ids, expert_map=emap, fp8=fp8)
    local_ids = ids if emap is None else emap[ids.long()].to(ids.dtype)
    ref = moe_bench.reference_fp8(xq, fp8, q13, q2, tw, local_ids)
    err = bench.rel_err(out, ref)
    pad_ok = bool(torch.isnan(ofull[:, shape.hidden:]).all()) if c["out_pad"] else True
    again = torch.full_like(out, float("nan"))
    ops.moe_experts_into(again, xq, q13, q2, tw, ids, expert_map=emap, fp8=fp8)
    det = bool(torch.equal(out, again))
    res.update(rel_err=err, deterministic=det, padding_untouched=pad_ok)
    passed = err <= FP8_TOL and det and pad_ok
    if shape.hidden * shape.inter * shape.num_experts <= 16 * 256 * 256 and T <= 16:
        cref = ops.moe_reference_cpu(xq, q13, q2, tw, ids, False, emap, fp8=fp8)
        res["c_oracle_vs_torch_fp64"] = float((cref - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-300))
        passed = passed and res["c_oracle_vs_torch_fp64"] < 1e-9
    if c["vllm"] and c["dtype"] == "bf16" and not c["x_pad"]:
        fn, why = moe_bench.vllm_fp8_experts(shape, kind, q13, s13, q2, s2, G, "triton", device)
        if fn is None:
            res["vllm_missing"] = why
        else:
            try:
                vout = fn(x.contiguous(), tw, ids, emap)
                res["vllm_rel_err"] = bench.rel_err(vout, ref)
                res["rel_err_vs_vllm"] = bench.rel_err(out, vout.double())
                # within vLLM's own quantization error of vLLM's result
                passed = passed and res["rel_err_vs_vllm"] <= 1.25 * res["vllm_rel_err"] + 1e-3
            except Exception as e:  # say so; our own checks still decide
                res["vllm_missing"] = f"vLLM's TritonExperts failed here ({type(e).__name__}: {str(e)[:100]})"
    res["passed"] = bool(passed)
    return res


def _run_case(c: dict, device) -> dict:
    shape: MoeShape = c["shape"]
    T, dtype = c["T"], c["dtype"]
    gen = torch.Generator(device=device).manual_seed(100 + c["seed"])
    w13, w2 = moe_bench.make_weights(shape, dtype, device, seed=c["seed"])
    tw, ids, emap = _routing(c, c["ep"] or shape.num_experts, device, gen)
    xfull = moe_bench.make_x(T, shape.hidden + c["x_pad"], dtype, device, gen)
    x = xfull[:, : shape.hidden]
    ofull = torch.full((T, shape.hidden + c["out_pad"]), float("nan"), dtype=x.dtype, device=device)
    out = ofull[:, : shape.hidden]
    ok, reason = ops.moe_supports(x, w13, w2, tw, ids, c["on_input"], emap)
    res = {k: v for k, v in c.items() if k != "shape"}
    res.update(shape=shape.as_dict(), supported=ok, reason=reason)
    if not ok:
        res.update(passed=False)
        return res
    ops.moe_experts_into(out, x, w13, w2, tw, ids, c["on_input"], expert_map=emap)
    local_ids = ids if emap is None else emap[ids.long()].to(ids.dtype)  # -1: another rank's expert
    ref = moe_bench.reference(x, w13, w2, tw, local_ids, c["on_input"])
    err = bench.rel_err(out, ref)
    pad_ok = bool(torch.isnan(ofull[:, shape.hidden:]).all()) if c["out_pad"] else True
    again = torch.full_like(out, float("nan"))
    ops.moe_experts_into(again, x, w13, w2, tw, ids, c["on_input"], expert_map=emap)
    det = bool(torch.equal(out, again))
    tol = bench.TOLERANCE[dtype]
    res.update(rel_err=err, tolerance=tol, deterministic=det, padding_untouched=pad_ok)
    if shape.hidden * shape.inter * shape.num_experts <= 16 * 256 * 256 and T <= 16:
        cref = ops.moe_reference_cpu(x, w13, w2, tw, ids, c["on_input"], emap)
        # (a zero reference, where no slot is routed to this rank, compares absolutely)
        res["c_oracle_vs_torch_fp64"] = float((cref - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-300))
    res["passed"] = bool(err <= tol and det and pad_ok and res.get("c_oracle_vs_torch_fp64", 0) < 1e-9)
    return res




# FP8 bench shapes: (name, shape, global experts (expert parallelism), tokens). Per-rank shapes of
# DeepSeek-V3 and Kimi-K2 under tensor parallelism 8 (I/8) and expert parallelism 8 (E/8 local
# experts, an expert_map over all of them).
# About 30 points (each: ours twice, vLLM's once, a Triton compile for vLLM's new shapes) to keep
# the FP8 bench near 4 minutes; `opgraft bench moe --dtype ...` takes any other shape and tokens.
FP8_BLOCK_BENCH = [
    ("Qwen3-30B-A3B", PRESETS["Qwen3-30B-A3B"], 0, "1,2,4,8,16,64"),
    ("DeepSeek-V3", PRESETS["DeepSeek-V3"], 0, "1,4,8,16"),
    ("Kimi-K2", PRESETS["Kimi-K2"], 0, "1,4,8"),
    ("Qwen3-235B-A22B", PRESETS["Qwen3-235B-A22B"], 0, "1,8"),
    ("DeepSeek-V3/tp8", PRESETS["DeepSeek-V3"].per_rank(8), 0, "1,8"),
    ("Kimi-K2/tp8", PRESETS["Kimi-K2"].per_rank(8), 0, "1,8"),
    ("DeepSeek-V3/ep8", MoeShape("DeepSeek-V3/ep8", 32, 7168, 2048, 8), 256, "1,8"),
    ("Kimi-K2/ep8", MoeShape("Kimi-K2/ep8", 48, 7168, 2048, 8), 384, "1,8"),
]
FP8_TENSOR_BENCH = [
    ("Mixtral-8x7B", PRESETS["Mixtral-8x7B"], 0, "1,4,8,16"),
    ("Qwen3-30B-A3B", PRESETS["Qwen3-30B-A3B"], 0, "1,8"),
]


def bench_rows(ceiling: float, presets: str = "Qwen3-30B-A3B,Mixtral-8x7B,Kimi-K2,Qwen3-235B-A22B",
               tokens: str = "1,2,4,8,16,32,64", dtypes: str | None = None, progress=print) -> list[dict]:
    """The MoE bench at the presets' dims, against vLLM's kernel where it imports; then the FP8
    rows (fp8_bench_rows). dtypes: comma-separated of bf16, fp16, fp8-block, fp8-tensor (default
    $OPGRAFT_CHECK_DTYPES, else bf16,fp8-block,fp8-tensor)."""
    dtypes = dtypes or os.environ.get("OPGRAFT_CHECK_DTYPES", "bf16,fp8-block,fp8-tensor")
    rows = []
    for name in presets.split(","):
        shape = PRESETS[name]
        for dtype in dtypes.split(","):
            if dtype not in moe_bench.TORCH_DTYPES:
                continue
            w13, w2 = moe_bench.make_weights(shape, dtype, "cuda")
            rows += moe_bench.bench_shape(shape, [int(t) for t in tokens.split(",")], dtype, ceiling_tbps=ceiling,
                                          w13=w13, w2=w2, progress=lambda m: progress("  bench " + m))
            del w13, w2
            torch.cuda.empty_cache()
    for kind in moe_bench.FP8_KINDS:
        if kind in dtypes.split(","):
            rows += fp8_bench_rows(ceiling, kind, progress)
    return rows


def fp8_bench_rows(ceiling: float, kind: str, progress=print) -> list[dict]:
    """FP8 rows (bench_shape_fp8): ours (kernel alone, and with vLLM's activation quantization)
    against vLLM's own FP8 path, per backend, at the FP8 bench shapes."""
    rows = []
    for name, shape, G, toks in (FP8_BLOCK_BENCH if kind == "fp8-block" else FP8_TENSOR_BENCH):
        weights = moe_bench.make_weights_fp8(shape, kind, "cuda")
        rows += moe_bench.bench_shape_fp8(shape, [int(t) for t in toks.split(",")], kind, ceiling_tbps=ceiling,
                                          weights=weights, global_experts=G, reps=20,
                                          progress=lambda m: progress("  bench " + m))
        del weights
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict]) -> str:
    return moe_bench.format_table(rows)
