"""The ctypes layer against the real libopgraft built by `make` (no GPU needed)."""

import ctypes
import dataclasses
import logging
import os
import subprocess
import sys

import pytest

from opgraft import _lib, cli
from opgraft.presets import PRESETS


def test_version_matches_the_package():
    import opgraft

    assert _lib.lib().opgraft_version_string().decode() == opgraft.__version__


def test_status_strings():
    l = _lib.lib()
    assert l.opgraft_status_name(_lib.EUNSUPPORTED) == b"OPGRAFT_EUNSUPPORTED"
    assert b"hand the call back" in l.opgraft_strerror(_lib.EUNSUPPORTED)
    assert l.opgraft_strerror(12345) == b"unknown status"


def test_nvrtc_is_found_here():
    info = _lib.runtime_info()
    assert info["nvrtc_path"], info["nvrtc_error"]
    assert info["nvrtc_version"] >= 12000


def test_struct_layout_matches_the_c_abi():
    # The guard names a too-small struct_size: one byte less than ours must be refused for that
    # reason, and ours must not be.
    a = cli.moe_args_struct(PRESETS["Qwen3-30B-A3B"], 1, "bf16", 90)
    reason = ctypes.create_string_buffer(256)
    assert _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, 256) == _lib.OK, reason.value
    a.struct_size -= 1
    assert _lib.lib().opgraft_moe_supports(ctypes.byref(a), reason, 256) == _lib.EUNSUPPORTED
    assert b"struct_size" in reason.value


def test_guard_reasons():
    shape = PRESETS["Qwen3-30B-A3B"]
    assert cli.guard_decision(shape, 1, "bf16", 90) == (True, "")
    # Qwen3-30B-A3B on sm_90 takes up to 8 tokens (measured end to end); 9 go back to vLLM.
    assert cli.guard_decision(shape, 8, "bf16", 90) == (True, "")
    ok, why = cli.guard_decision(shape, 9, "bf16", 90)
    assert not ok and "9 tokens > moe.max_tokens 8" in why
    # One rank's shape under tensor parallel 2 and under expert parallel 2 (64 of 128 experts):
    # also measured end to end, up to 8 tokens.
    for rank_shape in (shape.per_rank(2), dataclasses.replace(shape, num_experts=64)):
        assert cli.guard_decision(rank_shape, 8, "bf16", 90) == (True, "")
        ok, why = cli.guard_decision(rank_shape, 9, "bf16", 90)
        assert not ok and "9 tokens > moe.max_tokens 8" in why, rank_shape
    # Mixtral-8x7B (end to end) and Qwen3-235B-A22B (op level against vLLM's kernel) up to 8 tokens,
    # Kimi-K2 (op level) up to 12; every other shape takes the rule's 8 on sm_90, 1 elsewhere.
    for name, n in (("Mixtral-8x7B", 8), ("Qwen3-235B-A22B", 8), ("Kimi-K2", 12), ("DeepSeek-V3", 8),
                    ("OLMoE-1B-7B", 8)):
        assert cli.guard_decision(PRESETS[name], n, "bf16", 90) == (True, ""), name
        ok, why = cli.guard_decision(PRESETS[name], n + 1, "bf16", 90)
        assert not ok and f"{n + 1} tokens > moe.max_tokens {n}" in why, name
    ok, why = cli.guard_decision(PRESETS["OLMoE-1B-7B"], 2, "bf16", 80)
    assert not ok and "2 tokens > moe.max_tokens 1" in why
    ok, why = cli.guard_decision(shape, 1, "bf16", 75)
    assert not ok and "sm_75" in why


def test_tunable_precedence_env_over_baked(monkeypatch):
    v, src = _lib.tune_get("moe.max_tokens", 90)
    assert src == "rule"
    monkeypatch.setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", "3")
    assert _lib.tune_get("moe.max_tokens", 90) == (3, "env:OPGRAFT_TUNE_MOE_MAX_TOKENS")
    ok, why = cli.guard_decision(PRESETS["Qwen3-30B-A3B"], 4, "bf16", 90)
    assert not ok and "moe.max_tokens 3" in why
    with pytest.raises(_lib.OpgraftError, match="unknown tunable"):
        _lib.tune_get("no.such.key")


def test_malformed_env_value_warns_through_python_logging():
    # A fresh process: each warning is given once per process.
    code = (
        "import logging, sys; sys.path.insert(0, 'python'); logging.basicConfig(level=logging.WARNING);"
        "from opgraft import _lib; print(_lib.tune_get('moe.max_tokens', 90))"
    )
    env = dict(os.environ, OPGRAFT_TUNE_MOE_MAX_TOKENS="eight")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "OPGRAFT_TUNE_MOE_MAX_TOKENS" in r.stderr and "not an integer" in r.stderr
    assert "'rule'" in r.stdout


def test_every_preset_kernel_compiles_without_spills_for_sm90():
    for name in ("Qwen3-30B-A3B", "Kimi-K2"):
        for T in (1, 8):
            for k in cli.compile_report(PRESETS[name], T, "bf16", 90):
                assert k["registers"] > 0 and k["spill_bytes"] == 0, (name, T, k)


def test_the_fused_kernel_compiles_without_spills(monkeypatch):
    monkeypatch.setenv("OPGRAFT_TUNE_MOE_FUSED", "1")
    for name in ("Qwen3-30B-A3B", "Mixtral-8x7B"):
        for T in (1, 8, 16, 64):
            ks = cli.compile_report(PRESETS[name], T, "bf16", 90)
            assert [k["kernel"] for k in ks] == ["moe_gate_up_bf16", "moe_down_bf16", "moe_fused_bf16"]
            assert all(k["spill_bytes"] == 0 for k in ks), (name, T, ks)


def test_oracle_selfcheck_agrees_with_a_python_loop():
    assert cli.oracle_selfcheck(seed=3) < 1e-12


def test_the_c_oracle_follows_an_expert_map():
    torch = pytest.importorskip("torch")
    from opgraft.ops import moe as ops

    g = torch.Generator().manual_seed(5)
    T, H, I, G, k = 4, 64, 32, 6, 2
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = torch.randn(G, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(G, H, I, generator=g).to(torch.bfloat16)
    tw = torch.rand(T, k, generator=g)
    ids = torch.tensor([[0, 1], [4, 2], [5, 3], [1, 4]], dtype=torch.int32)
    local = torch.tensor([1, 4])  # this rank holds global experts 1 and 4
    emap = torch.full((G,), -1, dtype=torch.int32)
    emap[local] = torch.arange(2, dtype=torch.int32)
    got = ops.moe_reference_cpu(x, w13[local].contiguous(), w2[local].contiguous(), tw, ids, expert_map=emap)
    only_local = torch.where((ids == 1) | (ids == 4), ids, torch.full_like(ids, -1))
    want = ops.moe_reference_cpu(x, w13, w2, tw, only_local)
    assert torch.equal(got, want) and want.abs().sum() > 0
    # A map of the wrong dtype is not passed on: the guard refuses the call.
    a = ops.moe_args(x, w13[local], w2[local], tw, ids, None, False, emap.long())
    assert a.dtype == -1


def test_gpu_check_cases_set_only_known_tunables():
    pytest.importorskip("torch")
    from tools.checks import moe as moe_checks

    keys = set(_lib.tune_keys())
    cases = [c for c in moe_checks.cases() if c["tunables"]]
    assert cases, "the GPU check has cases for non-default tunables"
    for c in cases:
        assert set(c["tunables"]) <= keys, c["name"]


def test_an_empty_tune_variable_counts_as_unset():
    """OPGRAFT_TUNE_MOE_MAX_TOKENS= (set, empty) is the same as not set: no warning, the rule's value."""
    code = (
        "import logging, sys; sys.path.insert(0, 'python'); logging.basicConfig(level=logging.DEBUG);"
        "from opgraft import _lib; print(_lib.tune_get('moe.max_tokens', 90))"
    )
    env = dict(os.environ, OPGRAFT_TUNE_MOE_MAX_TOKENS="")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "OPGRAFT_TUNE" not in r.stderr, r.stderr
    assert r.stdout.strip() == "(8, 'rule')"
