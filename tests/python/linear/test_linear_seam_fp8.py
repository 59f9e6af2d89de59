"""The linear seam's block-FP8 path against the real vLLM's Fp8LinearMethod (0.26 and, in CI, the
newest): which layers it registers and why it hands others back, and the traced path through
opgraft::linear_fp8, whose hand-back runs the layer's own apply (found by its prefix).

vLLM picks its FP8 kernel per platform at construction (none exists for this machine's CPU
platform), so the method and its kernel are built without their constructors here: the kernel
is a subclass of vLLM's block-scaled kernel class whose apply_weights computes the block-FP8
product in torch and counts its calls.
"""

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.ops import linear as linear_op  # noqa: E402
from opgraft.vllm import linear_seam, register  # noqa: E402
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (  # noqa: E402
    Fp8BlockScaledMMLinearKernel,
)
from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod  # noqa: E402


class FakeBlockKernel(Fp8BlockScaledMMLinearKernel):
    calls = 0

    def __init__(self):  # vLLM's needs a layer config
        pass

    def process_weights_after_loading(self, layer):
        pass

    def apply_weights(self, layer, x, bias=None, **kw):
        FakeBlockKernel.calls += 1
        w = layer.weight.float() * layer.weight_scale_inv.repeat_interleave(128, 0)[: layer.weight.shape[0]] \
            .repeat_interleave(128, 1)[:, : layer.weight.shape[1]]
        y = x.float() @ w.T
        return (y + bias.float() if bias is not None else y).to(x.dtype)

    def apply_block_scaled_mm(self, A, B, As, Bs):  # pragma: no cover - abstract in vLLM
        raise NotImplementedError


class OtherKernel:  # not one of vLLM's block-scaled kernels
    def apply_weights(self, layer, x, bias=None):
        return x


FakeBlockKernel.__abstractmethods__ = frozenset()  # the rest of vLLM's abstract interface is never called


def method_and_layer(N=256, K=256, prefix="model.layers.0.self_attn.qkv_proj", block=(128, 128), kernel=None):
    m = object.__new__(Fp8LinearMethod)
    m.block_quant, m.use_marlin, m.act_q_static = True, False, False
    m.weight_block_size = list(block)
    m.out_dtype = torch.bfloat16
    m.fp8_linear = kernel if kernel is not None else FakeBlockKernel()
    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    layer.weight = torch.nn.Parameter((torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn),
                                      requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(torch.rand(-(-N // block[0]), K // block[1], generator=g) + 0.5,
                                                requires_grad=False)
    layer.prefix = prefix
    layer.quant_method = m
    return m, layer


@pytest.fixture
def fp8(clean_plugin, monkeypatch):
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))
    FakeBlockKernel.calls = 0
    register()
    assert linear_seam.fp8_installed()
    yield


def reasons():
    return dispatch.stats_of("linear").snapshot()["delegated_by_reason"]


def test_install_and_uninstall_restore_both_methods(clean_plugin):
    apply, pwal = Fp8LinearMethod.__dict__["apply"], Fp8LinearMethod.__dict__["process_weights_after_loading"]
    register()
    assert Fp8LinearMethod.__dict__["apply"] is not apply and linear_seam.fp8_installed()
    linear_seam.uninstall()
    assert Fp8LinearMethod.__dict__["apply"] is apply
    assert Fp8LinearMethod.__dict__["process_weights_after_loading"] is pwal


def test_kill_switch(clean_plugin, monkeypatch):
    monkeypatch.setenv("OPGRAFT_LINEAR_FP8", "0")
    register()
    assert linear_seam.installed() and not linear_seam.fp8_installed()


def test_registered_layer_hands_back_eagerly(fp8):
    m, layer = method_and_layer()
    m.process_weights_after_loading(layer)
    assert getattr(layer, linear_seam._FP8_REASON_ATTR) == ""
    assert linear_op.fp8_fallback(layer.weight) is not None
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = FakeBlockKernel().apply_weights(layer, x)
    FakeBlockKernel.calls = 0
    y = m.apply(layer, x)
    assert torch.equal(y, want) and FakeBlockKernel.calls == 1
    assert reasons() == {"tensors are not on a CUDA device": 1}


@pytest.mark.parametrize("change, reason", [
    (lambda m, l: setattr(m, "block_quant", False), "FP8 linear without block scales"),
    (lambda m, l: setattr(m, "use_marlin", True), "Marlin"),
    (lambda m, l: setattr(m, "fp8_linear", OtherKernel()), "OtherKernel is not a block-scaled one"),
    (lambda m, l: setattr(m, "weight_block_size", [128, 64]), "FP8 weight blocks [128, 64]"),
    (lambda m, l: setattr(l, "weight_scale_inv", torch.nn.Parameter(torch.ones(2, 2).half(), requires_grad=False)),
     "scales are not fp32 [2, 2]"),
])
def test_layer_reasons(fp8, change, reason):
    m, layer = method_and_layer()
    change(m, layer)
    # the seam's registration as its process_weights_after_loading runs it (vLLM's own step needs
    # per-tensor scales for a layer without block_quant)
    original = getattr(Fp8LinearMethod.__dict__["apply"], linear_seam._PATCH_ATTR)
    linear_seam._register_fp8_layer(m, layer, original, Fp8BlockScaledMMLinearKernel, lambda k: False)
    assert reason in getattr(layer, linear_seam._FP8_REASON_ATTR)
    x = torch.randn(2, 256).to(torch.bfloat16)
    m.apply(layer, x)
    assert sum(reasons().values()) == 1 and dispatch.stats_of("linear").snapshot()["taken"] == 0


@pytest.mark.parametrize("e8m0", [False, True])
def test_power_of_two_activation_scales(fp8, monkeypatch, e8m0):
    # DeepGEMM's E8M0 rounds the activation scales of DeepGEMM's own kernel to powers of two (ours
    # would differ: handed back); FlashInfer's block kernels quantize rows below 32 with fp32
    # scales whatever E8M0 did to the weight scales (taken).
    fi = pytest.importorskip("vllm.model_executor.kernels.linear.scaled_mm.flashinfer")
    import vllm.utils.deep_gemm as dg

    monkeypatch.setattr(dg, "is_deep_gemm_e8m0_used", lambda: e8m0)
    _, block_cls, e8m0_acts, why = linear_seam._fp8_target()
    assert not why
    fi_kernel = type("FakeFlashInferKernel", (fi.FlashInferFp8DeepGEMMDynamicBlockScaledKernel,),
                     {"__init__": lambda self: None, "__abstractmethods__": frozenset()})()
    original = getattr(Fp8LinearMethod.__dict__["apply"], linear_seam._PATCH_ATTR)
    for kernel, refused in ((FakeBlockKernel(), e8m0), (fi_kernel, False)):
        m, layer = method_and_layer(kernel=kernel, prefix=f"model.{type(kernel).__name__}")
        linear_seam._register_fp8_layer(m, layer, original, block_cls, e8m0_acts)
        reason = getattr(layer, linear_seam._FP8_REASON_ATTR)
        assert ("E8M0 activation scales" in reason if refused else reason == ""), reason
        assert (linear_op.fp8_fallback(layer.weight) is None) == refused


def test_layers_sharing_a_weight_are_both_handed_back(fp8):
    m1, l1 = method_and_layer()
    m2, l2 = method_and_layer(prefix="model.other")
    l2.weight = l1.weight
    m1.process_weights_after_loading(l1)
    m2.process_weights_after_loading(l2)
    for layer in (l1, l2):
        assert "another FP8 layer's" in getattr(layer, linear_seam._FP8_REASON_ATTR)
    assert linear_op.fp8_fallback(l1.weight) is None


def test_layers_with_one_prefix_are_told_apart_by_their_weights(fp8):
    """The registry keys a layer by its weight, so two layers of one name (two models in one
    process) each hand back to their own apply."""
    m1, l1 = method_and_layer()
    m2, l2 = method_and_layer()
    l2.weight = torch.nn.Parameter(l1.weight.detach().clone(), requires_grad=False)
    m1.process_weights_after_loading(l1)
    m2.process_weights_after_loading(l2)
    assert getattr(l1, linear_seam._FP8_REASON_ATTR) == getattr(l2, linear_seam._FP8_REASON_ATTR) == ""
    calls = []
    for layer, tag in ((l1, 1), (l2, 2)):
        fn = linear_op.fp8_fallback(layer.weight)
        assert fn is not None
        layer.weight_scale_inv.data.mul_(tag)  # what each layer's own apply reads
    x = torch.randn(2, 256).to(torch.bfloat16)
    for layer in (l1, l2):
        calls.append(torch.ops.opgraft.linear_fp8(x, layer.weight, layer.weight_scale_inv, None, 128, 128))
        assert torch.equal(calls[-1], FakeBlockKernel().apply_weights(layer, x))
    assert not torch.equal(calls[0], calls[1])


def test_unregistered_layer_is_handed_back(fp8):
    m, layer = method_and_layer()
    m.apply(layer, torch.randn(1, 256).to(torch.bfloat16))
    assert "not registered" in list(reasons())[0]


def test_traced_path_runs_the_op_and_its_registered_hand_back(fp8):
    """Dynamo traces apply into opgraft::linear_fp8 (a graph that finds the layer by its weight, a
    graph input); on CPU the op hands every call to the layer's own apply, found through the
    registry."""
    m, layer = method_and_layer()
    m.process_weights_after_loading(layer)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    f = torch.compile(lambda x: m.apply(layer, x), backend=backend, fullgraph=True, dynamic=True)
    for M in (2, 5, 12):
        x = torch.randn(M, 256).to(torch.bfloat16)
        FakeBlockKernel.calls = 0
        y = f(x)
        assert FakeBlockKernel.calls == 1
        assert torch.equal(y, FakeBlockKernel().apply_weights(layer, x))
    assert graphs and all("opgraft.linear_fp8" in g for g in graphs)
    assert linear_seam.trace_counts()["routed"] >= 1
    # The op without a registered path says so instead of guessing.
    linear_op.unregister_fp8_fallback(linear_op.fp8_key(layer.weight))
    with pytest.raises(RuntimeError, match="no path registered"):
        torch.ops.opgraft.linear_fp8(torch.randn(2, 256).to(torch.bfloat16), layer.weight, layer.weight_scale_inv,
                                     None, 128, 128)


def test_two_layers_trace_to_one_graph(fp8):
    """Each layer's traced call is the same graph but for its inputs (no per-layer constant such as
    a name), so vLLM's pieces of identical layers are one compile for Inductor."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    layers = []
    for i in range(2):
        m, layer = method_and_layer(prefix=f"model.layers.{i}.qkv_proj")
        m.process_weights_after_loading(layer)
        layers.append((m, layer))

    f = torch.compile(lambda x: (layers[0][0].apply(layers[0][1], x), layers[1][0].apply(layers[1][1], x)),
                      backend=backend, fullgraph=True)
    f(torch.randn(2, 256).to(torch.bfloat16))
    calls = [line for line in graphs[0].splitlines() if "torch.ops.opgraft.linear_fp8(" in line]
    assert len(calls) == 2
    assert not any("'" in c or '"' in c for c in calls), calls  # no string constant (a layer's name)


def test_compile_factor_names_the_ops_schemas(fp8):
    """A graph traced against one schema of the op is never loaded from vLLM's compile cache
    against another."""
    assert str(torch.ops.opgraft.linear_fp8.default._schema) in linear_seam._compile_factor()
