"""The MoE seam with FP8 and other quantizations, against the real vLLM classes: TritonExperts
built as Fp8MoEMethod builds it (FusedMoEConfig, the FP8 quant configs of vLLM's config module),
called with the arguments the modular kernel passes. Which calls reach our kernel with which
scales, and which are handed back with which reason."""

import os

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.vllm import moe_seam  # noqa: E402
from vllm.model_executor.layers.fused_moe import config as fmc  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import triton_moe  # noqa: E402

E, H, I, K, T = 4, 256, 128, 2, 3
F8 = torch.float8_e4m3fn


@pytest.fixture
def clean(clean_plugin):
    pass


def moe_config(**kw):
    return fmc.FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=I,
                              num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU,
                              device="cpu", routing_method=fmc.RoutingMethodType.Renormalize,
                              moe_parallel_config=fmc.FusedMoEParallelConfig.make_no_parallel(),
                              in_dtype=torch.bfloat16, intermediate_size_per_partition=I, **kw)


def experts(qc, **kw):
    return triton_moe.TritonExperts(moe_config(**kw), qc)


def block_config():
    return fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E, 2 * I // 128, H // 128),
                                         w2_scale=torch.rand(E, H // 128, I // 128), block_shape=[128, 128])


def tensor_config(**kw):
    return fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E), w2_scale=torch.rand(E), **kw)


def call_args(kind="block", a1q_scale=None, weights=F8, hidden=F8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(hidden)
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(weights)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(weights)
    if a1q_scale is None:
        a1q_scale = torch.rand(T, H // 128) if kind == "block" else torch.rand(1)
    return dict(output=torch.zeros(T, H, dtype=torch.bfloat16), hidden_states=x, w1=w1, w2=w2,
                topk_weights=torch.rand(T, K, generator=g), topk_ids=torch.tensor([[0, 3], [2, 1], [3, 0]],
                                                                                   dtype=torch.int32),
                activation=MoEActivation.SILU, global_num_experts=E, expert_map=None, a1q_scale=a1q_scale,
                a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
                apply_router_weight_on_input=False)


class _Original:
    """Stands in for vLLM's own apply inside our wrapper."""

    def __init__(self):
        self.calls = 0

    def __call__(self, expert_self, output, *args):
        self.calls += 1
        output.fill_(7.0)


@pytest.fixture
def captured(clean, monkeypatch):
    """Selects a variant that records the ExpertsCall the seam builds and delegates."""
    seen = []

    @dispatch.register_variant("moe", "test-capture")
    def capture(call):
        seen.append(call)
        return call.delegate()

    monkeypatch.setenv("OPGRAFT_MOE_EXPERTS", "test-capture")
    yield seen
    dispatch._VARIANTS["moe"].pop("test-capture", None)


def run(inst, **args):
    orig = _Original()
    moe_seam.make_wrapper(triton_moe.TritonExperts, orig)(inst, **args)
    return orig


def test_block_fp8_reaches_the_kernel_with_vllms_scales(captured):
    qc = block_config()
    inst = experts(qc)
    args = call_args("block")
    run(inst, **args)
    (call,) = captured
    assert call.extra_reason == ""
    xs, s13, s2, block = call.fp8_scales
    assert xs is args["a1q_scale"] and s13 is qc.w1_scale and s2 is qc.w2_scale and block == (128, 128)
    assert call.hidden_states.dtype == F8 and call.output is args["output"]


def test_per_tensor_dynamic_fp8_reaches_the_kernel(captured):
    qc = tensor_config()
    run(experts(qc), **call_args("tensor"))
    (call,) = captured
    assert call.extra_reason == "" and call.fp8_scales[3] is None
    assert call.fp8_scales[1] is qc.w1_scale and call.fp8_scales[2] is qc.w2_scale


def test_fp8_on_cpu_reaches_the_guard(clean):
    run(experts(block_config()), **call_args("block"))
    run(experts(tensor_config()), **call_args("tensor"))
    s = dispatch.stats()["moe"]
    assert s["taken"] == 0 and s["delegated_by_reason"] == {"tensors are not on a CUDA device": 2}


def _reasons():
    return dispatch.stats()["moe"]["delegated_by_reason"]


def test_other_fp8_configurations_are_handed_back(clean):
    cases = [
        (tensor_config(a1_scale=torch.ones(1), a2_scale=torch.ones(1)), call_args("tensor"),
         "static FP8 activation scales (FlashInferExperts' path on sm_90)"),
        (tensor_config(per_act_token_quant=True), call_args("tensor", a1q_scale=torch.rand(T, 1)),
         "per-token FP8 activation scales"),
        (fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E, 2 * I, 1), w2_scale=torch.rand(E, H, 1),
                                       per_act_token_quant=True, per_out_ch_quant=True),
         call_args("tensor", a1q_scale=torch.rand(T, 1)), "per-channel FP8 weight scales"),
        (block_config(), call_args("block", hidden=torch.bfloat16),
         "FP8 config with bfloat16 hidden states and float8_e4m3fn weights"),
    ]
    for qc, args, want in cases:
        orig = run(experts(qc), **args)
        assert orig.calls == 1
        assert want in _reasons(), (want, _reasons())


def test_other_quantizations_are_handed_back_with_their_name(clean):
    w = torch.rand(E, 2 * I, 1)
    cases = [
        (fmc.int8_w8a8_moe_quant_config(w1_scale=w, w2_scale=torch.rand(E, H, 1), a1_scale=None, a2_scale=None,
                                        per_act_token_quant=True), torch.int8, "quantization INT8 w8a8"),
        (fmc.int8_w8a16_moe_quant_config(w1_scale=w, w2_scale=torch.rand(E, H, 1)), torch.int8,
         "quantization INT8 weight-only (w8a16)"),
        (fmc.int4_w4a16_moe_quant_config(w1_scale=w, w2_scale=torch.rand(E, H, 1)), torch.uint8,
         "quantization INT4 weight-only (w4a16)"),
        (fmc.fp8_w8a16_moe_quant_config(w1_scale=torch.rand(E), w2_scale=torch.rand(E)), F8,
         "quantization FP8 weight-only (w8a16)"),
        (fmc.mxfp4_w4a16_moe_quant_config(w1_scale=w, w2_scale=w), torch.uint8,
         "quantization MXFP4 weight-only (w4a16)"),
        (fmc.mxfp4_w4a8_moe_quant_config(w1_scale=w, w2_scale=w), torch.uint8,
         "quantization W4A8 (MXFP4 weights, fp8 activations)"),
        (fmc.nvfp4_moe_quant_config(g1_alphas=torch.rand(E), g2_alphas=torch.rand(E), a1_gscale=torch.rand(E),
                                    a2_gscale=torch.rand(E), w1_scale=w, w2_scale=w), torch.uint8,
         "quantization NVFP4"),
    ]
    for qc, wdt, want in cases:
        args = call_args("tensor", weights=wdt, hidden=torch.bfloat16, a1q_scale=None)
        args["a1q_scale"] = None
        orig = run(experts(qc), **args)
        assert orig.calls == 1, want
        assert want in _reasons(), (want, _reasons())


def test_swiglu_limits_bias_and_weight_on_input_are_handed_back(clean):
    qc = fmc.fp8_w8a8_moe_quant_config(w1_scale=torch.rand(E, 2, 2), w2_scale=torch.rand(E, 2, 1),
                                       block_shape=[128, 128], gemm1_clamp_limit=7.0)
    run(experts(qc), **call_args("block"))
    assert "SwiGLU with a clamp limit or alpha/beta" in _reasons()
    qc = block_config()
    qc._w1.bias = torch.zeros(E, 2 * I)
    run(experts(qc), **call_args("block"))
    assert "expert biases" in _reasons()
    run(experts(block_config()), **dict(call_args("block"), apply_router_weight_on_input=True))
    assert "router weight already applied to the input (vLLM's prepare step)" in _reasons()
    # bf16 too: vLLM's prepare step has weighted the input already
    unq = experts(fmc.FUSED_MOE_UNQUANTIZED_CONFIG)
    args = call_args("block", weights=torch.bfloat16, hidden=torch.bfloat16)
    args["a1q_scale"] = None
    run(unq, **dict(args, apply_router_weight_on_input=True))
    assert _reasons()["router weight already applied to the input (vLLM's prepare step)"] == 2


def test_subclasses_stay_vllms(clean):
    class Sub(triton_moe.TritonExperts):
        pass

    inst = Sub(moe_config(), block_config())
    run(inst, **call_args("block"))
    assert "experts class Sub" in _reasons()


def test_kill_switch_hands_fp8_back(clean, monkeypatch):
    """OPGRAFT_MOE_FP8=0 reaches the C guard, which hands FP8 back even where a GPU would take it;
    on this CPU the tensors' device decides first, so look at the guard directly."""
    from opgraft.ops import moe as ops

    monkeypatch.setenv("OPGRAFT_MOE_FP8", "0")
    import ctypes

    from opgraft import _lib

    qc = block_config()
    args = call_args("block")
    fp8 = ops.Fp8Scales(args["a1q_scale"], qc.w1_scale, qc.w2_scale, (128, 128))
    a = ops.moe_args(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"], args["topk_ids"],
                     args["output"], fp8=fp8, arch=90)
    reason = ctypes.create_string_buffer(256)
    assert _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, 256) == _lib.EUNSUPPORTED
    assert b"OPGRAFT_MOE_FP8 is off" in reason.value
    monkeypatch.delenv("OPGRAFT_MOE_FP8")
    assert _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, 256) == _lib.EUNSUPPORTED
    assert b"moe.fp8 is 0 on sm_90 at T=3" in reason.value  # the shipped rule: FP8 at one token only
    monkeypatch.setenv("OPGRAFT_TUNE_MOE_FP8", "1")
    _lib.lib().opgraft_tune_reload()
    try:
        assert _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, 256) == _lib.OK
    finally:
        monkeypatch.delenv("OPGRAFT_TUNE_MOE_FP8")
        _lib.lib().opgraft_tune_reload()


def test_quant_config_reading_matches_vllms_properties():
    """The facts the seam relies on, as this vLLM has them."""
    qc = block_config()
    assert qc.quant_dtype == F8 and qc.weight_quant_dtype == F8 and qc.block_shape == [128, 128]
    assert not qc.per_act_token_quant and not qc.per_out_ch_quant and qc.a1_scale is None
    assert qc.use_fp8_w8a8
    qc = tensor_config()
    assert qc.block_shape is None and qc.is_per_tensor and qc.a1_scale is None
    assert moe_seam._signature_matches(triton_moe.TritonExperts.__dict__["apply"])


def test_the_bench_builds_vllms_fp8_experts_with_their_workspace(clean):
    # vLLM's modular kernel takes its buffers from the workspace manager each GPU worker makes;
    # the bench, outside an engine, makes it once (without it: "WorkspaceManager not initialized").
    from opgraft.bench import moe as moe_bench
    from opgraft.presets import MoeShape
    from vllm.v1.worker import workspace

    monkey = pytest.MonkeyPatch()
    monkey.setattr(workspace, "_manager", None)
    try:
        shape = MoeShape("tiny", E, H, I, K)
        w13, s13, w2, s2 = moe_bench.make_weights_fp8(shape, "fp8-block", "cpu")
        fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, E, "triton", "cpu")
        assert fn is not None and why == ""
        made = workspace.current_workspace_manager()
        fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, E, "triton", "cpu")
        assert fn is not None and workspace.current_workspace_manager() is made  # made once
    finally:
        monkey.undo()


def test_the_bench_prepares_block_fp8_weights_for_flashinfer_as_vllm_does():
    # FlashInfer's CUTLASS MoE takes [up; gate] and NaNs on near-zero block scales on sm_90: the
    # bench swaps the halves and clamps the scales as prepare_fp8_moe_layer_for_fi does.
    from opgraft.bench import moe as moe_bench
    from opgraft.presets import MoeShape

    w13, s13, w2, s2 = moe_bench.make_weights_fp8(MoeShape("tiny", E, H, I, K), "fp8-block", "cpu")
    s13[0, 0, 0] = 1e-23
    w31, s31, s2c = moe_bench.flashinfer_block_weights(w13, s13, s2)
    assert w31.shape == w13.shape and s31.shape == s13.shape
    assert torch.equal(w31[:, :I].view(torch.uint8), w13[:, I:].view(torch.uint8))
    assert torch.equal(w31[:, I:].view(torch.uint8), w13[:, :I].view(torch.uint8))
    half = s13.shape[1] // 2
    assert torch.equal(s31[:, :half], s13[:, half:]) and s31[0, half, 0] == 1e-10
    assert torch.equal(s2c, s2.clamp(min=1e-10)) and s13[0, 0, 0] == 1e-23  # copies


def test_the_bench_says_why_flashinfer_cutlass_is_not_timed(clean, monkeypatch):
    from opgraft.bench import moe as moe_bench
    from opgraft.presets import MoeShape
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe import FlashInferExperts

    shape = MoeShape("tiny", E, H, I, K)
    w13, s13, w2, s2 = moe_bench.make_weights_fp8(shape, "fp8-block", "cpu")
    fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, E, "flashinfer_cutlass", "cpu")
    assert fn is None and "no usable FlashInfer CUTLASS MoE" in why  # no CUDA here
    fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-tensor", w13, s13, w2, s2, E, "flashinfer_cutlass", "cpu")
    assert fn is None and "static activation scales" in why
    fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, 2 * E, "flashinfer_cutlass", "cpu")
    assert fn is None and "expert map" in why
    monkeypatch.setattr(FlashInferExperts, "_supports_current_device", staticmethod(lambda: True))
    fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, E, "flashinfer_cutlass", "cpu")
    assert fn is not None and why == ""  # built as Fp8MoEMethod builds it; the kernel itself needs the GPU
    # Where FlashInfer would compile its module on the first call (minutes), only when asked to.
    monkeypatch.setattr(moe_bench, "flashinfer_cutlass_moe_built", lambda device: False)
    fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, E, "flashinfer_cutlass", "cpu")
    assert fn is None and "not built on this machine" in why and "--flashinfer-build" in why
    fn, why = moe_bench.vllm_fp8_experts(shape, "fp8-block", w13, s13, w2, s2, E, "flashinfer_cutlass", "cpu",
                                         flashinfer_build=True)
    assert fn is not None and why == ""


def test_flashinfer_cutlass_moe_built_says_none_without_a_gpu():
    from opgraft.bench import moe as moe_bench

    assert moe_bench.flashinfer_cutlass_moe_built("cpu") is None
