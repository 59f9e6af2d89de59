"""The attention op's GPU check module (tools/checks/attention.py) on a machine without a GPU: its
cases cover every value of each axis the issue lists, their names are unique, and the plumbing of
a case runs up to the guard (which refuses CPU tensors)."""
import pytest

torch = pytest.importorskip("torch")

from tools.checks import attention as check  # noqa: E402


def test_every_axis_value_is_covered():
    cases = [c for c in check.cases() if not c.get("alone")]
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names))
    batches = {len(c["lens"]) for c in cases}
    contexts = {L for c in cases for L in c["lens"]}
    groups = {c["hq"] // c["hk"] for c in cases}
    heads = {c["d"] for c in cases}
    assert {1, 3, 8, 64} <= batches
    assert {1, 15, 16, 17, 1000, 8192, 32768} <= contexts
    assert {1, 4, 8} <= groups and {64, 128, 256} <= heads
    assert any(0 in c["lens"] and len(set(c["lens"])) > 3 for c in cases)  # ragged with padded rows
    assert any(c["graph"] for c in cases) and any(c["window"] >= 0 for c in cases)
    assert any(c["softcap"] > 0 for c in cases) and any(c["sinks"] for c in cases)
    assert any(c["dtype"] == "fp16" for c in cases) and any(c["layout"] == "HND" for c in cases)


def test_a_case_runs_up_to_the_guard_on_cpu():
    c = check._case("tiny", [5, 0, 17], 8, 2, 64, window=7, sinks="fp32", q_pad=16)
    r = check._run_case(c, "cpu")
    assert r["supported"] is False and r["reason"] == "tensors are not on a CUDA device" and r["passed"] is False


@pytest.mark.parametrize("only", ["fan-in 32, a partial", "fan-in 32, 17 splits"])
def test_a_fan_in_32_case_is_selected_alone(only):
    # tools/gpucheck.py's --only keeps the cases whose name contains the text (case-sensitive)
    assert len([c for c in check.cases() if only in c["name"]]) == 1


def test_a_prologue_case_runs_up_to_the_guard_on_cpu():
    c = check._case("tiny prologue", [5, 0, 17], 8, 2, 64, qk_norm=True, rope=1)
    assert c["update"]
    r = check._run_case(c, "cpu")
    assert r["supported"] is False and r["reason"] == "tensors are not on a CUDA device" and r["passed"] is False
    assert any(c["qk_norm"] and c["rope"] == 1 and c["graph"] for c in check.cases())
    assert any(c["rope"] == 2 for c in check.cases()) and any(c["qk_norm"] and not c["rope"] for c in check.cases())


def test_prologue_alone_cases_cover_its_variants_and_run_up_to_the_guard_on_cpu():
    alone = [c for c in check.cases() if c.get("alone")]
    assert {c["d"] for c in alone} == {64, 128, 256} and {c["rope"] for c in alone} == {0, 1, 2}
    assert any(not c["qk_norm"] for c in alone) and any(c["dtype"] == "fp16" for c in alone)
    assert any((c["hq"] + c["hk"]) * c["d"] // 8 % 32 for c in alone)  # a warp only partly in the row
    r = check.run_case(check._alone("tiny alone", 5, 8, 2, 64), "cpu")
    assert r["supported"] is False and "not on a CUDA device" in r["reason"] and r["passed"] is False
