"""The vLLM plugin against the real vLLM installed from PyPI (no fakes of vLLM).

vLLM's CPU-only import path works here: the platform resolves to UnspecifiedPlatform, so the
platform gate is opened with OPGRAFT_FORCE_PLATFORM=1 where a test needs the seams installed.
Process-wide effects (vLLM's plugin loader runs once per process) are tested in subprocesses.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI installs vLLM: a failed import must fail, not skip)
else:
    vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.vllm import _reset_for_tests, attn_seam, compat, moe_seam, register, summary  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import triton_moe  # noqa: E402


def entry_point_from_pyproject() -> str:
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    m = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\s*\n\s*opgraft\s*=\s*"([^"]+)"', text)
    assert m, "pyproject.toml must declare the vllm.general_plugins entry point"
    return m.group(1)


@pytest.fixture
def dist_dir(tmp_path):
    """A dist-info with pyproject's entry point, as `pip install` would write it."""
    d = tmp_path / "site" / "opgraft-0.1.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: opgraft\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\nopgraft = {entry_point_from_pyproject()}\n")
    return str(tmp_path / "site")


PROBE = textwrap.dedent("""
    import json
    import vllm.logger
    if hasattr(vllm.logger, "configure_logging"):
        # Newer vLLM (0.33) configures its logging per process from the engine config, before it
        # loads the plugins, instead of at import: do what its engine process does.
        from vllm.config import LoggingConfig
        vllm.logger.configure_logging(LoggingConfig())
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.platforms import current_platform
    before = (TritonExperts.__dict__["apply"], type(current_platform).__dict__.get("get_attn_backend_cls"))
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    load_general_plugins()
    after = (TritonExperts.__dict__["apply"], type(current_platform).__dict__.get("get_attn_backend_cls"))
    from opgraft.vllm import summary
    print(json.dumps({"moe_patched": before[0] is not after[0],
                      "moe_wrapped_once": getattr(after[0], "_opgraft_original_apply", None) is before[0],
                      "attn_patched": before[1] is not after[1], "summary": summary()}))
""")


def run_probe(dist_dir, **env):
    e = dict(os.environ)
    for k in ("OPGRAFT_DISABLE", "OPGRAFT_FORCE_PLATFORM", "VLLM_PLUGINS", "OPGRAFT_ATTN_BACKEND"):
        e.pop(k, None)
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join([dist_dir, os.path.join(ROOT, "python"), e.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout + r.stderr


def test_vllm_loader_discovers_and_calls_register(dist_dir):
    res, err = run_probe(dist_dir, OPGRAFT_FORCE_PLATFORM="1")
    assert res["moe_patched"] and res["moe_wrapped_once"] and res["attn_patched"], res
    assert "MoE experts seam installed" in res["summary"]
    assert err.count("opgraft 0.1.0:") == 1  # one line through vLLM's logger


def test_kill_switch_leaves_vllm_untouched(dist_dir):
    res, err = run_probe(dist_dir, OPGRAFT_FORCE_PLATFORM="1", OPGRAFT_DISABLE="1")
    assert not res["moe_patched"] and not res["attn_patched"]
    assert "disabled by OPGRAFT_DISABLE" in res["summary"]


def test_vllm_plugins_filter_is_respected(dist_dir):
    res, _ = run_probe(dist_dir, OPGRAFT_FORCE_PLATFORM="1", VLLM_PLUGINS="some_other_plugin")
    assert not res["moe_patched"] and res["summary"] == ""
    res, _ = run_probe(dist_dir, OPGRAFT_FORCE_PLATFORM="1", VLLM_PLUGINS="opgraft")
    assert res["moe_patched"]


def test_platform_gate_closes_on_a_machine_without_cuda(dist_dir):
    res, err = run_probe(dist_dir)
    assert not res["moe_patched"] and not res["attn_patched"]
    assert "is not CUDA: nothing patched" in res["summary"]


@pytest.fixture
def clean(clean_plugin):
    pass


def test_register_twice_is_harmless(clean):
    original = triton_moe.TritonExperts.__dict__["apply"]
    register()
    wrapped = triton_moe.TritonExperts.__dict__["apply"]
    register()
    assert triton_moe.TritonExperts.__dict__["apply"] is wrapped
    assert wrapped._opgraft_original_apply is original
    # Even a second install after a reset of the flag does not wrap the wrapper.
    assert moe_seam.install() == (True, "MoE experts seam already installed")
    _reset_for_tests()
    assert triton_moe.TritonExperts.__dict__["apply"] is original


def test_moved_api_warns_and_patches_nothing(clean, monkeypatch, caplog):
    monkeypatch.delattr(triton_moe, "TritonExperts")
    with caplog.at_level("WARNING"):
        register()
    assert "moe seam not installed" in caplog.text
    assert "not where opgraft expects it" in summary()


def test_unexpected_signature_is_not_patched(clean, monkeypatch):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, new_argument):
        pass

    monkeypatch.setattr(triton_moe.TritonExperts, "apply", apply)
    installed, why = moe_seam.install()
    assert not installed and "unexpected signature" in why
    assert triton_moe.TritonExperts.__dict__["apply"] is apply


def test_attention_seam_passes_through_or_injects(clean, monkeypatch):
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.get_attn_backend_cls
    try:
        expected = original(None, None)
    except Exception as e:  # the base platform may refuse; the wrapper must refuse alike
        expected = type(e)
    register()
    try:
        got = cls.get_attn_backend_cls(None, None)
    except Exception as e:
        got = type(e)
    assert got == expected
    _reset_for_tests()
    monkeypatch.setenv("OPGRAFT_ATTN_BACKEND", "my_pkg.attn:MyBackend")
    register()
    assert cls.get_attn_backend_cls(None, None) == "my_pkg.attn.MyBackend"
    _reset_for_tests()
    assert not attn_seam.installed()


@pytest.mark.parametrize("bad", ["no_colon", "a.b:", ":Cls", "a-b:Cls", "a.b:Cls.x"])
def test_malformed_attention_backend_is_refused(clean, monkeypatch, bad):
    monkeypatch.setenv("OPGRAFT_ATTN_BACKEND", bad)
    installed, why = attn_seam.install()
    assert not installed and "OPGRAFT_ATTN_BACKEND" in why


class _Recorder:
    """Stands in for vLLM's original apply inside our wrapper, recording what it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, expert_self, output, *args):
        self.calls.append((expert_self, output, args))
        output.fill_(7.0)


def _experts_instance():
    inst = triton_moe.TritonExperts.__new__(triton_moe.TritonExperts)
    return inst


def _call_args(T=2, H=64, I=32, E=4, k=2, device="cpu"):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w1 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    tw = torch.rand(T, k, generator=g)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    out = torch.zeros(T, H, dtype=torch.bfloat16)
    return dict(output=out, hidden_states=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids,
                activation=MoEActivation.SILU, global_num_experts=E, expert_map=None, a1q_scale=None, a2_scale=None,
                workspace13=None, workspace2=None, expert_tokens_meta=None, apply_router_weight_on_input=False)


def _wrapped(rec):
    return moe_seam.make_wrapper(triton_moe.TritonExperts, rec)


def _inst_without_attrs(monkeypatch):
    inst = _experts_instance()
    for attr in ("quant_config", "w1_bias", "w2_bias", "_lora_context"):
        try:
            getattr(inst, attr)
        except Exception:
            monkeypatch.setattr(triton_moe.TritonExperts, attr, None, raising=False)
    return inst


def test_passthrough_hands_vllm_the_identical_call(clean, monkeypatch):
    monkeypatch.setenv("OPGRAFT_MOE_EXPERTS", "passthrough")
    rec = _Recorder()
    inst = _inst_without_attrs(monkeypatch)
    args = _call_args()
    _wrapped(rec)(inst, **args)
    (got_self, got_out, got_rest), = rec.calls
    assert got_self is inst and got_out is args["output"]
    names = moe_seam._APPLY_PARAMS[1:]
    assert all(a is args[n] for a, n in zip(got_rest, names))
    assert torch.all(args["output"] == 7.0)
    assert dispatch.stats()["moe"] == {"taken": 0, "taken_by_kind": {}, "delegated": 1,
                                       "delegated_by_reason": {"passthrough variant": 1}}


def test_guard_refusal_delegates_and_counts(clean, monkeypatch):
    rec = _Recorder()
    inst = _inst_without_attrs(monkeypatch)
    _wrapped(rec)(inst, **_call_args())  # CPU tensors: the guard says no
    assert len(rec.calls) == 1
    s = dispatch.stats()["moe"]
    assert s["taken"] == 0 and s["delegated_by_reason"] == {"tensors are not on a CUDA device": 1}


def test_a_prefill_is_handed_back_before_anything_is_built(clean, monkeypatch):
    from opgraft.ops import moe as moe_op

    assert moe_seam._MAX_TOKENS == moe_op.MAX_TOKENS
    rec = _Recorder()
    inst = _inst_without_attrs(monkeypatch)
    monkeypatch.setattr(moe_seam, "_seam_reason", lambda *a, **k: pytest.fail("a prefill reached the seam's checks"))
    args = _call_args(T=moe_op.MAX_TOKENS + 1)
    _wrapped(rec)(inst, **args)
    (got_self, got_out, got_rest), = rec.calls
    assert got_self is inst and got_out is args["output"]
    assert dispatch.stats()["moe"]["delegated_by_reason"] == {"N tokens > N (kernel limit)": 1}


def test_seam_level_refusals(clean, monkeypatch):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    rec = _Recorder()
    inst = _inst_without_attrs(monkeypatch)
    w = _wrapped(rec)
    w(inst, **dict(_call_args(), expert_map=torch.arange(4, dtype=torch.int32), global_num_experts=8))
    w(inst, **dict(_call_args(), activation=MoEActivation.GELU))
    w(inst, **dict(_call_args(), global_num_experts=8))
    # Expert parallelism with a consistent map reaches the guard (here: CPU tensors, so no).
    w(inst, **dict(_call_args(), expert_map=torch.tensor([-1, 0, 1, -1, 2, 3, -1, -1], dtype=torch.int32),
                   global_num_experts=8))
    reasons = dispatch.stats()["moe"]["delegated_by_reason"]
    assert len(rec.calls) == 4
    assert reasons == {"expert_map length differs from the global experts": 1, "activation gelu": 1,
                       "local experts differ from global experts": 1, "tensors are not on a CUDA device": 1}


def test_unknown_variant_falls_back_to_passthrough(clean, monkeypatch, caplog):
    monkeypatch.setenv("OPGRAFT_MOE_EXPERTS", "no-such-variant")
    assert dispatch.selected_variant() == "passthrough"
    assert "not a registered variant" in caplog.text


def test_register_experts_variant(clean, monkeypatch):
    seen = []

    @dispatch.register_experts_variant("test-variant")
    def v(call):
        seen.append(call.topk_ids.shape)
        return call.delegate()

    try:
        monkeypatch.setenv("OPGRAFT_MOE_EXPERTS", "test-variant")
        rec = _Recorder()
        _wrapped(rec)(_inst_without_attrs(monkeypatch), **_call_args())
        assert seen == [torch.Size([2, 2])] and len(rec.calls) == 1
    finally:
        dispatch._VARIANTS.pop("test-variant", None)


def test_tested_vllm_version_is_the_installed_one():
    # CI also runs these tests against the newest vLLM and says which one it installed.
    expected = os.environ.get("OPGRAFT_EXPECT_VLLM") or compat.TESTED_VLLM
    assert compat.vllm_version_is(expected), (expected, compat.vllm_version())
    assert not compat.vllm_version_is("0.1")
