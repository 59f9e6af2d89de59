"""The linear seam against the real vLLM installed from PyPI (0.26 and, in CI, the newest): what it
patches, what it hands back (bit for bit), and the traced path through opgraft::linear.

vLLM's CPU-only import path works here (UnspecifiedPlatform, whose GEMM is vLLM's default
torch.nn.functional.linear). The tests that trace the op's path add "cpu" to the seam's device
types; the op then hands every call to torch itself. vLLM's layers need a tensor-parallel group,
so the tests that build them run in a subprocess with a one-process gloo group.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.vllm import _reset_for_tests, linear_seam, register, summary  # noqa: E402
from vllm.model_executor.layers import linear as vllm_linear  # noqa: E402
from vllm.model_executor.layers import vocab_parallel_embedding as vllm_vpe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ULM, UEM = vllm_linear.UnquantizedLinearMethod, vllm_vpe.UnquantizedEmbeddingMethod


@pytest.fixture
def clean(clean_plugin):
    linear_seam._reset_trace_counts()


def layer_of(N=48, K=64, dtype=torch.bfloat16, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(N, K, generator=g).to(dtype), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(N, generator=g).to(dtype), requires_grad=False) if bias else None
    return layer


def x_of(M=3, K=64, dtype=torch.bfloat16, seed=1):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reasons():
    return dispatch.stats_of("linear").snapshot()["delegated_by_reason"]


def test_register_patches_both_methods_once(clean):
    import vllm.envs as envs

    originals = ULM.__dict__["apply"], UEM.__dict__["apply"]
    register()
    assert linear_seam.installed()
    for cls, orig in zip((ULM, UEM), originals):
        assert cls.__dict__["apply"] is not orig and cls.__dict__["apply"]._opgraft_original_apply is orig
    assert "linear seam installed" in summary() and "linear variant opgraft" in summary()
    assert linear_seam.install() == (True, "linear seam already installed")
    assert ULM.__dict__["apply"]._opgraft_original_apply is originals[0]  # not wrapped twice
    # The seam's state is part of vLLM's compile-cache key from now on.
    factors = envs.compile_factors()
    assert factors.get(linear_seam.COMPILE_FACTOR, "").startswith("opgraft ")
    _reset_for_tests()
    assert (ULM.__dict__["apply"], UEM.__dict__["apply"]) == originals
    assert linear_seam.COMPILE_FACTOR not in envs.compile_factors()


def test_kill_switch_installs_nothing(clean, monkeypatch):
    monkeypatch.setenv("OPGRAFT_LINEAR", "0")
    original = ULM.__dict__["apply"]
    register()
    assert ULM.__dict__["apply"] is original and not linear_seam.installed()
    assert "linear seam disabled by OPGRAFT_LINEAR=0" in summary()


def test_unexpected_signature_is_not_patched(clean, monkeypatch):
    def apply(self, layer, x, bias=None, new_argument=None):
        pass

    monkeypatch.setattr(ULM, "apply", apply)
    installed, why = linear_seam.install()
    assert not installed and "unexpected signature" in why
    assert ULM.__dict__["apply"] is apply


def test_quantized_methods_never_reach_the_seam(clean):
    """Every linear method of vLLM's quantization configs either defines its own apply (the seam's
    wrapper is not on its path) or is a subclass of the unquantized one, which the wrapper hands
    back by its type."""
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    for name in QUANTIZATION_METHODS:
        try:
            get_quantization_config(name)  # imports the config's module and its methods
        except Exception:
            pass
    register()
    wrapper = ULM.__dict__["apply"]
    seen, todo = set(), [LinearMethodBase]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in seen:
                seen.add(s)
                todo.append(s)
    assert len(seen) > 10
    reached = [c for c in seen if c is not ULM and getattr(c, "apply", None) is wrapper]
    assert all(issubclass(c, ULM) for c in reached), reached
    for c in reached:  # inherited apply: handed back by type
        layer, x = layer_of(), x_of()
        try:
            c.__new__(c).apply(layer, x, layer.bias)
        except Exception:
            pass  # vLLM's method may need the state its constructor makes; the reason is counted first
        assert f"linear method {c.__name__}" in reasons(), c


def test_cpu_calls_are_vllms_bit_for_bit(clean):
    register()
    for cls in (ULM, UEM):
        m = cls()
        layer, x = layer_of(), x_of()
        got = m.apply(layer, x, layer.bias)
        want = cls.__dict__["apply"]._opgraft_original_apply(m, layer, x, layer.bias)
        assert torch.equal(got, want) and torch.equal(got, torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert torch.equal(m.apply(layer, x), torch.nn.functional.linear(x, layer.weight))
    assert reasons() == {"tensors are not on a CUDA device": 4}


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtypes are not one of bf16 or fp16"),
    ("mixed", "dtypes are not one of bf16 or fp16"),
    ("3d", "x is not two-dimensional"),
    ("k12", "in_features is not a multiple of 8"),
    ("bias_shape", "bias is not [out_features]"),
    ("subclass", "linear method Sub"),
    ("other_gemm", "vLLM's GEMM is not torch.nn.functional.linear here"),
    ("batch_invariant", "VLLM_BATCH_INVARIANT"),
    ("passthrough", "passthrough variant"),
])
def test_seam_level_hand_backs(clean, monkeypatch, case, reason):
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))  # only the case's reason remains
    register()
    layer, x, bias = layer_of(), x_of(), None
    cls = ULM
    if case == "fp32":
        layer, x = layer_of(dtype=torch.float32), x_of(dtype=torch.float32)
    elif case == "mixed":
        x = x_of(dtype=torch.float16)
        layer.weight.data = layer.weight.data.float().half()
        bias = layer.bias.float()
    elif case == "3d":
        x = x_of(M=6).view(2, 3, 64)
    elif case == "k12":
        layer, x = layer_of(K=12), x_of(K=12)
    elif case == "bias_shape":
        bias = layer.bias[:10]
    elif case == "subclass":
        cls = type("Sub", (ULM,), {})
    elif case == "other_gemm":
        if "_gemm_impl" not in ULM().__dict__:
            monkeypatch.setattr(vllm_linear, "dispatch_unquantized_gemm", lambda *a: lambda l, x, w, b=None: None)
    elif case == "batch_invariant":
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    elif case == "passthrough":
        monkeypatch.setenv("OPGRAFT_LINEAR_VARIANT", "passthrough")
    m = cls()
    if case == "other_gemm" and "_gemm_impl" in m.__dict__:
        m._gemm_impl = lambda l, x, w, b=None: None  # 0.33: the GEMM chosen at construction
    calls = []
    wrapped = linear_seam.make_wrapper(ULM, lambda *a: calls.append(a) or "vllm's result")
    assert wrapped(m, layer, x, bias) == "vllm's result"
    (got,) = calls
    assert got[0] is m and got[1] is layer and got[2] is x and got[3] is bias
    assert reasons() == {dispatch.reason_key(reason): 1}


def test_the_op_path_eager(clean, monkeypatch):
    """A call the seam takes goes to the op, which (CPU tensors) hands it to torch: the bits of
    vLLM's own call, and the op's reason counted."""
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))
    register()
    layer = layer_of()
    for M in (1, 4, 20):
        x = x_of(M=M)
        assert torch.equal(ULM().apply(layer, x, layer.bias), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert torch.equal(UEM().apply(layer, x), torch.nn.functional.linear(x, layer.weight))
    assert reasons() == {"tensors are not on a CUDA device": 4, "rows N > N (kernel limit)": 2}


def test_vllms_cuda_gemm_is_taken_unless_it_has_a_skinny_plan(clean, monkeypatch):
    """vLLM 0.34 picks cuda_unquantized_gemm on CUDA: torch's linear unless the layer was given a
    skinny-GEMM plan at load (use_skinny_gemm), whose calls stay vLLM's."""
    from vllm.model_executor.layers import utils as vllm_utils

    cuda_gemm = getattr(vllm_utils, "cuda_unquantized_gemm", None)
    if cuda_gemm is None:
        pytest.skip("this vLLM has no cuda_unquantized_gemm (before 0.34)")
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(vllm_vpe, "dispatch_unquantized_gemm", lambda *a: cuda_gemm)
    register()
    m = ULM()
    m._gemm_impl = cuda_gemm
    layer, x = layer_of(), x_of()
    for method in (m, UEM()):
        assert torch.equal(method.apply(layer, x, layer.bias), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert reasons() == {"tensors are not on a CUDA device": 2}  # both reached the op
    layer.use_skinny_gemm = True
    calls = []
    wrapped = linear_seam.make_wrapper(ULM, lambda *a: calls.append(a) or "vllm's result")
    assert wrapped(m, layer, x, None) == "vllm's result" and len(calls) == 1
    assert reasons()["vLLM's skinny GEMM has a plan for this layer"] == 1


def test_the_op_path_under_torch_compile(clean, monkeypatch):
    """Dynamo traces the wrapper once: the graph holds opgraft::linear (no branch on the symbolic
    row count), the trace counts one routed call, and each run decides at run time."""
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))
    register()
    layer, method = layer_of(), ULM()

    class Model(torch.nn.Module):
        def forward(self, x):
            return method.apply(layer, x, layer.bias) + 1

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    model = Model()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for M in (3, 8, 30):
        x = x_of(M=M, seed=M)
        assert torch.equal(compiled(x), torch.nn.functional.linear(x, layer.weight, layer.bias) + 1)
    assert len(graphs) == 1 and "opgraft.linear" in graphs[0]
    assert linear_seam.trace_counts() == {"routed": 1}
    assert reasons() == {"tensors are not on a CUDA device": 2, "rows N > N (kernel limit)": 1}


def test_hand_back_under_torch_compile_is_counted_at_trace(clean, monkeypatch):
    monkeypatch.setenv("OPGRAFT_LINEAR_VARIANT", "passthrough")
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))
    register()
    layer, method = layer_of(), ULM()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: method.apply(layer, x, layer.bias), backend=backend, fullgraph=True, dynamic=True)
    for M in (2, 5):
        x = x_of(M=M)
        assert torch.equal(f(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert len(graphs) == 1 and "opgraft.linear" not in graphs[0]
    assert reasons() == {"passthrough variant (at trace)": 1}
    assert linear_seam.trace_counts() == {"routed": 0}


LAYERS_PROBE = textwrap.dedent("""
    import json, os, socket, sys
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    out = {}
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                       ReplicatedLinear, RowParallelLinear)
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        torch.manual_seed(0)
        dt = torch.bfloat16
        layers = {
            "qkv": QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=dt),
            "gate_up": MergedColumnParallelLinear(64, [96, 96], bias=False, params_dtype=dt),
            "o": RowParallelLinear(64, 48, bias=True, params_dtype=dt),
            "router": ReplicatedLinear(64, 8, bias=False, params_dtype=dt),
        }
        head = ParallelLMHead(136, 64, params_dtype=dt)
        for l in [*layers.values(), head]:
            for p in l.parameters():
                p.data.normal_()
        logits = LogitsProcessor(136)
        xs = {M: torch.randn(M, 64).to(dt) for M in (1, 3, 9)}

        def run():
            r = {}
            for M, x in xs.items():
                for name, l in layers.items():
                    r[f"{name} M={M}"] = l(x)[0]
                r[f"lm_head M={M}"] = logits(head, x)
            return r

        stock = run()
        from opgraft import dispatch
        from opgraft.vllm import linear_seam, register, summary
        if os.environ.get("PROBE_CPU_OP") == "1":
            linear_seam.DEVICE_TYPES = ("cuda", "cpu")
        register()
        ours = run()
        out["installed"] = linear_seam.installed()
        out["summary"] = summary()
        out["equal"] = {k: bool(torch.equal(stock[k], ours[k])) for k in stock}
        out["reasons"] = dispatch.stats_of("linear").snapshot()["delegated_by_reason"]
        if os.environ.get("PROBE_CPU_OP") == "1":  # a real layer's forward traced by Dynamo
            graphs = []
            def backend(gm, example_inputs):
                graphs.append(str(gm.graph))
                return gm.forward
            f = torch.compile(layers["qkv"], backend=backend, fullgraph=True, dynamic=True)
            out["compiled_equal"] = all(bool(torch.equal(f(x)[0], stock[f"qkv M={M}"])) for M, x in xs.items() if M > 1)
            out["graph_has_op"] = bool(graphs) and all("opgraft.linear" in g for g in graphs)
    print(json.dumps(out))
""")


def run_layers_probe(**env):
    e = dict(os.environ)
    for k in ("OPGRAFT_DISABLE", "OPGRAFT_LINEAR", "OPGRAFT_LINEAR_VARIANT", "VLLM_PLUGINS"):
        e.pop(k, None)
    e.update(env, OPGRAFT_FORCE_PLATFORM="1")
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), e.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", LAYERS_PROBE], capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_real_layers_hand_back_bit_for_bit():
    """vLLM's QKV, merged gate_up, row-parallel, replicated (router) layers and the lm_head through
    LogitsProcessor, with the seam installed: CPU calls are handed back with vLLM's bits."""
    res = run_layers_probe()
    assert res["installed"] and "linear seam installed" in res["summary"]
    assert all(res["equal"].values()), res["equal"]
    # calls of more rows than the kernel takes (a prefill's) are handed back before anything else
    assert res["reasons"] == {"tensors are not on a CUDA device": 10, "rows N > N (kernel limit)": 5}


def test_real_layers_through_the_op():
    """The same layers through opgraft::linear (CPU tensors allowed into the op's path): eager and
    compiled, vLLM's bits; the op's run-time reasons counted."""
    res = run_layers_probe(PROBE_CPU_OP="1")
    assert all(res["equal"].values()), res["equal"]
    assert res["compiled_equal"] and res["graph_has_op"]
    assert res["reasons"] == {"tensors are not on a CUDA device": 10, "rows N > N (kernel limit)": 5}


def test_gemm_collective_fusion_keeps_vllms_matmuls(clean, monkeypatch):
    """With 0.26's AsyncTP pass (pass_config.fuse_gemm_comms), which pattern-matches aten.mm, the
    traced calls stay vLLM's."""
    monkeypatch.setattr(linear_seam, "_gemm_comms_fused", lambda: True)
    monkeypatch.setattr(linear_seam, "DEVICE_TYPES", ("cuda", "cpu"))
    register()
    layer, method = layer_of(), ULM()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: method.apply(layer, x, layer.bias), backend=backend, fullgraph=True, dynamic=True)
    x = x_of(M=3)
    assert torch.equal(f(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert "opgraft.linear" not in graphs[0]
    assert reasons() == {"fuse_gemm_comms (vLLM's GEMM + collective fusion) is on (at trace)": 1}


def test_gemm_collective_fusion_is_read_from_vllms_config():
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig, set_current_vllm_config

    assert linear_seam._gemm_comms_fused() is False  # no current config
    pass_config = CompilationConfig().pass_config
    if not hasattr(pass_config, "fuse_gemm_comms"):
        pytest.skip("this vLLM has no GEMM + collective fusion pass")
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        assert linear_seam._gemm_comms_fused() is bool(cfg.compilation_config.pass_config.fuse_gemm_comms)
        cfg.compilation_config.pass_config.fuse_gemm_comms = True
        assert linear_seam._gemm_comms_fused() is True
