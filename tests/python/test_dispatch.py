"""The MoE dispatch counters (no GPU, no vLLM)."""
from opgraft import dispatch


def test_stats_count_expert_parallel_calls_apart():
    s = dispatch._Stats()
    s.take()
    s.take(expert_map=True)
    s.delegate("2 tokens > moe.max_tokens 1")
    assert s.snapshot()["moe"] == {"taken": 2, "taken_with_expert_map": 1, "delegated": 1,
                                   "delegated_by_reason": {"2 tokens > moe.max_tokens 1": 1}}
    s.reset()
    assert s.snapshot()["moe"]["taken_with_expert_map"] == 0
