"""The MoE op's GPU correctness cases (tools.gpucheck runs them): odd sizes, T = 1..64, fp16, int64
ids, router weight on input, strided tensors, duplicate and out-of-range ids, expert parallelism,
and each tunable path, against the fp64 oracles, with poisoned outputs and a bit-identical rerun."""

from __future__ import annotations

import torch

from opgraft import bench
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
    ]
    return cases


def run_case(c: dict, device="cuda") -> dict:
    """One correctness case, with its tunables (if any) set while it runs."""
    with tunables(c["tunables"]):
        return _run_case(c, device)


def _run_case(c: dict, device) -> dict:
    shape: MoeShape = c["shape"]
    T, dtype = c["T"], c["dtype"]
    gen = torch.Generator(device=device).manual_seed(100 + c["seed"])
    w13, w2 = moe_bench.make_weights(shape, dtype, device, seed=c["seed"])
    tw, ids = moe_bench.make_routing(T, c["ep"] or shape.num_experts, shape.top_k, device, gen,
                                 ids_dtype=torch.int64 if c["ids64"] else torch.int32)
    emap = None
    if c["ep"]:  # this rank holds a random subset of the global experts
        local = torch.randperm(c["ep"], generator=torch.Generator().manual_seed(c["seed"]))[: shape.num_experts]
        emap = torch.full((c["ep"],), -1, dtype=torch.int32)
        emap[local] = torch.arange(shape.num_experts, dtype=torch.int32)
        emap = emap.to(device)
    if c["dup"]:
        ids[:, 1] = ids[:, 0]
    if c["hot"]:
        ids[:, 0] = 0
    if c["invalid"]:
        ids[0, 0] = -1
        ids[-1, -1] = shape.num_experts
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




def bench_rows(ceiling: float, presets: str = "Qwen3-30B-A3B,Mixtral-8x7B,Kimi-K2,Qwen3-235B-A22B",
               tokens: str = "1,2,4,8,16,32,64", dtypes: str = "bf16", progress=print) -> list[dict]:
    """The MoE bench at the presets' dims, against vLLM's kernel where it imports."""
    rows = []
    for name in presets.split(","):
        shape = PRESETS[name]
        for dtype in dtypes.split(","):
            w13, w2 = moe_bench.make_weights(shape, dtype, "cuda")
            rows += moe_bench.bench_shape(shape, [int(t) for t in tokens.split(",")], dtype, ceiling_tbps=ceiling,
                                          w13=w13, w2=w2, progress=lambda m: progress("  bench " + m))
            del w13, w2
            torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict]) -> str:
    return moe_bench.format_table(rows)
