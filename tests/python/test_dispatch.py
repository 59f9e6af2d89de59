"""The dispatch counters and variant selection (no GPU, no vLLM)."""
from opgraft import dispatch


def test_stats_count_per_op_and_kind():
    s = dispatch.OpStats()
    s.take()
    s.take("expert_map")
    s.delegate("2 tokens > moe.max_tokens 1")
    s.delegate("9 tokens > moe.max_tokens 8")
    assert s.snapshot() == {"taken": 2, "taken_by_kind": {"expert_map": 1}, "delegated": 2,
                            "delegated_by_reason": {"N tokens > moe.max_tokens N": 2}}
    s.reset()
    assert s.snapshot()["taken_by_kind"] == {}


def test_reason_keys_keep_names_with_digits():
    assert dispatch.reason_key("sm_75 is older than sm_80") == "sm_75 is older than sm_80"
    assert dispatch.reason_key("top_k 6 > 2 experts") == "top_k N > N experts"
    assert dispatch.reason_key("head size 96 (64, 128, 256 supported)") == "head size N (N, N, N supported)"


def test_stats_are_kept_per_op():
    dispatch.reset_stats()
    dispatch.stats_of("moe").take()
    dispatch.stats_of("toy").delegate("why")
    s = dispatch.stats()
    assert s["moe"]["taken"] == 1 and s["toy"]["delegated_by_reason"] == {"why": 1}
    dispatch.reset_stats()


def test_python_side_warnings_are_prefixed_without_a_handler():
    """With no logging handler configured, Python prints a warning's bare message: each one the
    package gives starts with "opgraft:", as the library's own messages do."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, 'python'); from opgraft import dispatch; "
            "print(dispatch.selected_variant('moe'))")
    env = dict(os.environ, OPGRAFT_MOE_EXPERTS="bogus")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "passthrough", r.stderr
    assert r.stderr.startswith("opgraft: OPGRAFT_MOE_EXPERTS='bogus' is not a registered variant"), r.stderr
