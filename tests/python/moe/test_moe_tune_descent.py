import math
import os

import pytest

from opgraft.tune import coordinate_descent


def test_finds_the_minimum_of_a_separable_cost():
    space = {"a": [1, 2, 4, 8], "b": [0, 1, 2]}
    target = {"a": 4, "b": 2}
    cost = lambda c: 10 + abs(c["a"] - target["a"]) + 3 * abs(c["b"] - target["b"])
    best, best_cost, history = coordinate_descent(cost, space, {"a": 1, "b": 0})
    assert best == target and best_cost == 10
    assert history[0] == ({"a": 1, "b": 0}, cost({"a": 1, "b": 0}))


def test_an_incorrect_configuration_never_wins():
    space = {"a": [1, 2, 3]}
    # a=3 would be fastest but fails the correctness gate (inf).
    cost = lambda c: {1: 5.0, 2: 4.0, 3: math.inf}[c["a"]]
    best, best_cost, _ = coordinate_descent(cost, space, {"a": 1})
    assert best == {"a": 2} and best_cost == 4.0


def test_small_gains_are_noise():
    space = {"a": [1, 2]}
    cost = lambda c: {1: 100.0, 2: 99.5}[c["a"]]
    best, _, _ = coordinate_descent(cost, space, {"a": 1}, min_gain=0.01)
    assert best == {"a": 1}


def test_each_configuration_is_measured_once():
    calls = []
    space = {"a": [1, 2], "b": [1, 2]}

    def cost(c):
        calls.append(tuple(sorted(c.items())))
        return c["a"] + c["b"]

    coordinate_descent(cost, space, {"a": 2, "b": 2}, rounds=3)
    assert len(calls) == len(set(calls))


def test_nothing_correct_raises():
    with pytest.raises(RuntimeError, match="correctness"):
        coordinate_descent(lambda c: math.inf, {"a": [1, 2]}, {"a": 1})


def test_the_moe_space_comes_from_the_ops_table():
    from opgraft import _lib

    space = _lib.tune_space("moe")
    assert set(space) <= set(_lib.tune_keys())
    assert space["moe.gate_up.warps"] == [1, 2, 4, 8, 16]
    # thresholds and switches are not the tuner's to change
    assert "moe.max_tokens" not in space and "moe.expert_map" not in space
    for k, values in space.items():
        lo, hi = _lib.tune_range(k)
        assert all(lo <= v <= hi for v in values), k


def test_a_presets_tune_key_selects_its_baked_rows():
    # the key format must be the library's: Kimi-K2's sm_90 rows set gate_up's warps at 9..16 tokens
    from opgraft import _lib
    from opgraft.presets import PRESETS

    key = PRESETS["Kimi-K2"].tune_key()
    assert key == "moe:bf16:E384:H7168:I2048:k8"
    assert _lib.tune_get("moe.gate_up.warps", 90, None, key, 12) == (4, "baked:sm_90")
    assert _lib.tune_get("moe.gate_up.warps", 90, None, key, 1) == (8, "rule")
    assert _lib.tune_get("moe.max_tokens", 90, None, key, 1) == (12, "baked:sm_90")
    assert _lib.tune_get("moe.gate_up.warps", 90, None, "moe:bf16:E1:H64:I64:k1", 1) == (4, "rule")


def test_configure_sets_tunables_through_the_api(monkeypatch):
    pytest.importorskip("torch")
    from opgraft import _lib
    from opgraft.bench import moe as moe_bench

    monkeypatch.setenv("OPGRAFT_TUNE_MOE_GATE_UP_WARPS", "16")
    moe_bench.configure({"moe.gate_up.warps": 2})
    assert _lib.tune_get("moe.gate_up.warps", 90, None, None, 1) == (2, "set")
    assert os.environ["OPGRAFT_TUNE_MOE_GATE_UP_WARPS"] == "16"  # the environment is left alone
    moe_bench.configure({})
    assert _lib.tune_get("moe.gate_up.warps", 90, None, None, 1)[1] == "env:OPGRAFT_TUNE_MOE_GATE_UP_WARPS"
