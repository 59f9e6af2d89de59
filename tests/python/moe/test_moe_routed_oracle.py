"""The C oracle of a call routed from the router's logits (opgraft_moe_reference with routing set)
against the oracle with the routing computed here: vLLM's topk_softmax in fp64 (the k largest
logits, ties to the lower expert id), renormalized or not."""

import pytest

torch = pytest.importorskip("torch")

from opgraft.ops import moe  # noqa: E402


def _routing(logits, k, renorm):
    v = logits.double()
    order = torch.sort(-v, dim=-1, stable=True).indices[:, :k]
    p = torch.softmax(v, dim=-1).gather(1, order)
    return (p / p.sum(-1, keepdim=True) if renorm else p), order.to(torch.int32)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routed_oracle_is_the_oracle_of_vllms_routing(renorm, dtype):
    g = torch.Generator().manual_seed(3)
    T, H, I, E, k = 4, 64, 32, 16, 4
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    logits = torch.randn(T, E, generator=g).to(dtype)
    logits[0, 5] = logits[0, 3] = logits[0].max() + 1  # a tie at the top: 3 before 5
    logits[1, 2], logits[1, 7] = 0.0, -0.0  # equal values
    logits[2] = 0.25  # every expert tied: experts 0..k-1
    got = moe.moe_routed_reference_cpu(x, w13, w2, logits, k, renorm)
    w, ids = _routing(logits, k, renorm)
    assert ids[0, :2].tolist() == [3, 5] and ids[2].tolist() == list(range(k))
    want = moe.moe_reference_cpu(x, w13, w2, w.float(), ids)
    # the weights passed as fp32 above: the two differ by that rounding only
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("renorm", [True, False])
def test_routed_fp8_oracle_is_the_fp8_oracle_of_vllms_routing(renorm):
    """With block-FP8 weights and activations the logits are in the output dtype (bf16)."""
    from opgraft.bench import moe as moe_bench
    from opgraft.presets import MoeShape

    g = torch.Generator().manual_seed(5)
    T, k, block = 4, 4, (128, 128)
    shape = MoeShape("t", 16, 256, 128, k)
    w13, w2 = moe_bench.make_weights(shape, "bf16", "cpu", seed=2)
    q13, s13, q2, s2 = moe_bench.quantize_weights_fp8(w13, w2, "fp8-block", block)
    xq, xs = moe_bench.quantize_activations_fp8(torch.randn(T, 256, generator=g).bfloat16(), "fp8-block", 128)
    fp8 = moe_bench.fp8_scales("fp8-block", xs, s13, s2, block)
    logits = torch.randn(T, 16, generator=g).bfloat16()
    logits[0, 9] = logits[0, 4] = logits[0].max() + 1  # a tie at the top: 4 before 9
    got = moe.moe_routed_reference_cpu(xq, q13, q2, logits, k, renorm, fp8=fp8)
    w, ids = _routing(logits, k, renorm)
    assert ids[0, :2].tolist() == [4, 9]
    want = moe.moe_reference_cpu(xq, q13, q2, w.float(), ids, fp8=fp8)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
