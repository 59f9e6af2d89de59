"""The FP8 side of the MoE op's torch layer on CPU: the argument struct from FP8 tensors and
scales, the quantization helpers the bench and checks use, and the C fp64 oracle against the
torch oracle of the quantized model."""

import ctypes

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from opgraft import _lib  # noqa: E402
from opgraft.bench import moe as moe_bench  # noqa: E402
from opgraft.ops import moe as ops  # noqa: E402
from opgraft.presets import MoeShape  # noqa: E402

E, H, I, K, T = 4, 256, 128, 2, 3


def _problem(kind, block=(128, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = MoeShape("t", E, H, I, K)
    w13, w2 = moe_bench.make_weights(shape, "bf16", "cpu", seed=seed)
    q13, s13, q2, s2 = moe_bench.quantize_weights_fp8(w13, w2, kind, block)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    xq, xs = moe_bench.quantize_activations_fp8(x, kind, block[1])
    tw = torch.softmax(torch.randn((T, K), generator=g), dim=1)
    ids = torch.tensor([[0, 3], [2, 1], [3, 0]], dtype=torch.int32)
    return xq, moe_bench.fp8_scales(kind, xs, s13, s2, block), q13, q2, tw, ids


def test_block_quantization_layout_and_error():
    w = torch.randn((300, 200)) * 0.02
    q, s = moe_bench.block_quantize(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (300, 200)
    assert tuple(s.shape) == (3, 2) and s.dtype == torch.float32
    d = moe_bench.dequantize_fp8(q, s, "fp8-block", (128, 128))
    assert float((d - w.double()).norm() / w.double().norm()) < 0.05  # e4m3: 3 mantissa bits
    # vLLM's own function, where it imports, is what the helper uses: same blocks, same scales.
    fn = moe_bench._vllm_attr("vllm.utils.deep_gemm", "per_block_cast_to_fp8")
    if fn is not None:
        try:
            vq, vs = fn(w, [128, 128], use_ue8m0=False)
        except Exception:
            vq = None
        if vq is not None:
            assert torch.equal(vq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(vs.float(), s)


def test_tensor_quantization_and_activation_groups():
    w = torch.randn((64, 96))
    q, s = moe_bench.tensor_quantize(w)
    assert s.shape == (1,) and float(q.float().abs().max()) == 448.0
    x = torch.randn((3, 256)).to(torch.bfloat16)
    xq, xs = moe_bench.quantize_activations_fp8(x, "fp8-block", 128)
    assert tuple(xs.shape) == (3, 2) and xq.dtype == torch.float8_e4m3fn
    # each group's largest value lands on 448
    g = xq.float().abs().view(3, 2, 128).amax(dim=2)
    assert torch.all(g == 448.0)


def test_weights_per_half_row_blocks():
    """Each half of w13 has its own ceil(I / bn) row blocks (vLLM loads w1 and w3 apart)."""
    shape = MoeShape("t", 2, 128, 96, 1)
    w13, w2 = moe_bench.make_weights(shape, "bf16", "cpu")
    q13, s13, q2, s2 = moe_bench.quantize_weights_fp8(w13, w2, "fp8-block", (64, 64))
    assert tuple(s13.shape) == (2, 2 * 2, 2) and tuple(s2.shape) == (2, 2, 2)
    qa, sa = moe_bench.block_quantize(w13[1, 96:], (64, 64))  # the up half alone
    assert torch.equal(q13[1, 96:].view(torch.uint8), qa.view(torch.uint8)) and torch.equal(s13[1, 2:], sa)


@pytest.mark.parametrize("kind", ["fp8-block", "fp8-tensor"])
def test_struct_fields(kind):
    xq, fp8, q13, q2, tw, ids = _problem(kind)
    out = torch.empty((T, H), dtype=torch.bfloat16)
    a = ops.moe_args(xq, q13, q2, tw, ids, out, fp8=fp8)
    assert a.dtype == _lib.DTYPE_BF16 and a.weight_dtype == _lib.DTYPE_FP8_E4M3
    assert a.scale_dtype == _lib.DTYPE_FP32
    assert a.hidden_scale == fp8.hidden_scale.data_ptr() and a.w13_scale == fp8.w13_scale.data_ptr()
    if kind == "fp8-block":
        assert a.scale_layout == _lib.SCALE_BLOCK and (a.block_n, a.block_k) == (128, 128)
        assert list(a.w13_scale_stride) == list(fp8.w13_scale.stride())
        assert list(a.hidden_scale_stride) == list(fp8.hidden_scale.stride())
    else:
        assert a.scale_layout == _lib.SCALE_TENSOR
        assert list(a.w13_scale_stride) == [1, 0, 0] and list(a.w2_scale_stride) == [1, 0, 0]
    # fp16 out through out_dtype when there is no out tensor
    assert ops.moe_args(xq, q13, q2, tw, ids, None, fp8=fp8, out_dtype=torch.float16).dtype == _lib.DTYPE_FP16


def test_struct_refuses_mismatched_scales():
    xq, fp8, q13, q2, tw, ids = _problem("fp8-block")
    out = torch.empty((T, H), dtype=torch.bfloat16)
    bad = ops.Fp8Scales(fp8.hidden_scale[:, :1], fp8.w13_scale, fp8.w2_scale, (128, 128))
    assert ops.moe_args(xq, q13, q2, tw, ids, out, fp8=bad).dtype == -1
    bad = ops.Fp8Scales(fp8.hidden_scale, fp8.w13_scale, fp8.w2_scale, (64, 64))  # not these blocks
    assert ops.moe_args(xq, q13, q2, tw, ids, out, fp8=bad).dtype == -1
    # bf16 weights with FP8 scales: not an FP8 call
    a = ops.moe_args(xq, q13.to(torch.bfloat16), q2, tw, ids, out, fp8=fp8)
    assert a.dtype in (0, -1)
    # per-tensor: [E, 2] takes a scale per half
    xq, fp8, q13, q2, tw, ids = _problem("fp8-tensor")
    two = ops.Fp8Scales(fp8.hidden_scale, torch.stack([fp8.w13_scale, 2 * fp8.w13_scale], 1), fp8.w2_scale)
    a = ops.moe_args(xq, q13, q2, tw, ids, out, fp8=two)
    assert list(a.w13_scale_stride) == [2, 1, 0]
    three = ops.Fp8Scales(fp8.hidden_scale, fp8.w13_scale.repeat(3), fp8.w2_scale)
    assert ops.moe_args(xq, q13, q2, tw, ids, out, fp8=three).dtype == -1


@pytest.mark.parametrize("kind,block", [("fp8-block", (128, 128)), ("fp8-block", (64, 64)), ("fp8-tensor", None)])
def test_c_oracle_matches_torch_oracle(kind, block):
    xq, fp8, q13, q2, tw, ids = _problem(kind, block or (128, 128), seed=3)
    if block is None:
        fp8 = ops.Fp8Scales(fp8.hidden_scale, fp8.w13_scale, fp8.w2_scale, None)
    c = ops.moe_reference_cpu(xq, q13, q2, tw, ids, fp8=fp8)
    t = moe_bench.reference_fp8(xq, fp8, q13, q2, tw, ids)
    assert float((c - t).norm() / t.norm()) < 1e-12


def test_oracle_of_the_quantized_model_is_close_to_bf16():
    """The quantized model's oracle is the bf16 model's up to e4m3's rounding of weights and
    activations (a few percent): the scales are wired the right way round."""
    shape = MoeShape("t", E, H, I, K)
    w13, w2 = moe_bench.make_weights(shape, "bf16", "cpu", seed=5)
    xq, fp8, q13, q2, tw, ids = _problem("fp8-block", seed=5)
    x = moe_bench.dequantize_fp8(xq, fp8.hidden_scale, "fp8-block", (1, 128)).to(torch.bfloat16)
    ref16 = moe_bench.reference(x, w13, w2, tw, ids)
    ref8 = ops.moe_reference_cpu(xq, q13, q2, tw, ids, fp8=fp8)
    assert float((ref8 - ref16).norm() / ref16.norm()) < 0.1


def test_cpu_tensors_are_refused_with_a_reason():
    xq, fp8, q13, q2, tw, ids = _problem("fp8-block")
    ok, why = ops.moe_supports(xq, q13, q2, tw, ids, fp8=fp8)
    assert not ok and why == "tensors are not on a CUDA device"


def test_custom_op_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    xq, fp8, q13, q2, tw, ids = _problem("fp8-block")
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (xq, fp8.hidden_scale, q13, fp8.w13_scale, q2, fp8.w2_scale, tw, ids)]
        out = torch.ops.opgraft.moe_experts_fp8(*args, 128, 128, torch.float16)
    assert tuple(out.shape) == (T, H) and out.dtype == torch.float16


def test_fp8_bytes_count_weights_and_scales():
    shape = MoeShape("q", 128, 2048, 768, 8)
    per = shape.expert_bytes(1) + moe_bench.fp8_scale_bytes(shape, "fp8-block")
    assert moe_bench.fp8_scale_bytes(shape, "fp8-block") == 4 * (2 * 6 * 16 + 16 * 6)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)
    assert moe_bench.unique_expert_bytes_fp8(shape, "fp8-block", [(None, ids)]) == 8 * per
    emap = torch.full((256,), -1, dtype=torch.int32)
    emap[[0, 1]] = torch.tensor([0, 1], dtype=torch.int32)
    assert moe_bench.unique_expert_bytes_fp8(shape, "fp8-block", [(None, ids)], emap) == 2 * per


def test_ctypes_signature_of_the_fp8_run():
    fn = _lib.lib().opgraft_moe_plan_run_fp8
    assert fn.restype is ctypes.c_int32 and len(fn.argtypes) == 13
    st = fn(None, *([None] * 12))
    assert st == _lib.EINVAL
