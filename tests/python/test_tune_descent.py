import math

import pytest

from opgraft.tune import MOE_SPACE, coordinate_descent


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


def test_the_moe_space_names_real_tunables():
    from opgraft import _lib

    keys = set(_lib.tune_keys())
    assert set(MOE_SPACE) <= keys
