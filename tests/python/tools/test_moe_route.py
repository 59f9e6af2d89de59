"""tools.moe_route run on the CPU with stand-ins for the kernels (fp64-free torch versions of what
each kernel computes), so that a mistake in the tool's own code shows here and not on a GPU: every
bf16 variant runs, is timed by the stand-in timer and checked against the tool's own reference."""

import json

import pytest

torch = pytest.importorskip("torch")

from opgraft import bench  # noqa: E402
from opgraft.bench import linear as linear_bench  # noqa: E402
from opgraft.bench import moe as moe_bench  # noqa: E402
from opgraft.ops import linear as linear_ops  # noqa: E402
from opgraft.ops import moe as ops  # noqa: E402
from opgraft.presets import PRESETS, MoeShape  # noqa: E402
from tools import moe_route  # noqa: E402


def _routing(logits, k):
    v = logits.double()
    order = torch.sort(-v, dim=-1, stable=True).indices[:, :k]
    p = torch.softmax(v, -1).gather(1, order)
    return (p / p.sum(-1, keepdim=True)).float(), order.to(torch.int32)


@pytest.fixture
def stand_ins(monkeypatch):
    """The kernels, the GPU and the timer replaced; returns the names of the calls made."""
    calls = []

    class Plan:
        handle, reason = 1, ""

    def linear_into(out, x, w, b=None):
        calls.append("linear")
        return out.copy_(torch.nn.functional.linear(x, w, b))

    def norm_linear_into(out, r_out, x, r, nw, eps, w, b=None, normed_out=None):
        calls.append("norm linear" + (" normed" if normed_out is not None else ""))
        n, ro = linear_ops.add_rms_norm_reference(x, r, nw, eps)
        r_out.copy_(ro)
        if normed_out is not None:
            normed_out.copy_(n)
        return out.copy_(torch.nn.functional.linear(n, w, b)), r_out

    def experts(out, hidden, w13, w2, tw, ids, **kw):
        calls.append("experts")
        return out.copy_(moe_bench.reference(hidden, w13, w2, tw, ids).to(out.dtype))

    def routed(out, hidden, w13, w2, logits, k, renormalize=True, **kw):
        calls.append("routed")
        return out.copy_(moe_bench.reference(hidden, w13, w2, *_routing(logits, k)).to(out.dtype))

    def timed(call, schedule, between, reps=30):
        for i, arg in schedule:
            call(i, arg)
        return 1.0

    monkeypatch.setattr(moe_route, "DEVICE", "cpu")
    monkeypatch.setattr(moe_route, "require_gpu", lambda prog, why="": torch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setitem(PRESETS, "toy", MoeShape("toy", 8, 64, 32, 2))
    monkeypatch.setattr(linear_ops, "linear_into", linear_into)
    monkeypatch.setattr(linear_ops, "add_rms_norm_linear_into", norm_linear_into)
    monkeypatch.setattr(ops, "plan_for_routed", lambda *a, **k: Plan())
    monkeypatch.setattr(ops, "moe_routed_into", routed)
    monkeypatch.setattr(ops, "moe_experts_into", experts)
    monkeypatch.setattr(bench, "measure_read_ceiling", lambda device: 4.8)
    monkeypatch.setattr(bench, "between_traffic", lambda mib, device: None)
    monkeypatch.setattr(bench, "time_calls_span", timed)
    monkeypatch.setattr(bench, "gpu_facts", lambda: {"gpu": "CPU stand-ins"})
    monkeypatch.setattr(moe_bench, "measure_whole_token_range", lambda: None)
    monkeypatch.setattr(linear_bench, "_compiled_norm", lambda: linear_ops.add_rms_norm_reference)
    return calls


def test_every_bf16_variant_runs_and_checks(stand_ins, tmp_path, capsys):
    out = tmp_path / "route.json"
    variants = "given,torch-topk,routed,norm+routed,routed-norm"
    assert moe_route.main(["--model", "toy", "--tokens", "1,2", "--variants", variants, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["tokens"]) for r in rows] == [(v, t) for t in (1, 2) for v in variants.split(",")]
    assert all(r["ok"] and r["rel_err"] < 1e-2 for r in rows), rows
    # the norm variants: the Inductor norm then the plain gate, or the gate's kernel with the rows
    assert "norm linear normed" in stand_ins and "norm linear" not in stand_ins


def test_a_wrong_norm_variant_fails_its_check(stand_ins, monkeypatch, tmp_path):
    """The check has teeth: normalized rows that are not the norm's make the row fail."""
    real = linear_ops.add_rms_norm_linear_into

    def skips_the_norm(out, r_out, x, r, nw, eps, w, b=None, normed_out=None):
        real(out, r_out, x, r, nw, eps, w, b, normed_out)
        normed_out.copy_(x)  # the experts then read the raw rows

    monkeypatch.setattr(linear_ops, "add_rms_norm_linear_into", skips_the_norm)
    out = tmp_path / "route.json"
    assert moe_route.main(["--model", "toy", "--tokens", "1", "--variants", "routed-norm", "--json", str(out)]) == 1
    assert not json.loads(out.read_text())["rows"][0]["ok"]
