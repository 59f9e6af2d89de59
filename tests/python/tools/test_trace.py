"""tools.trace's reading of the per-block phase times (no GPU: a synthetic trace region)."""

from tools import trace


def region(blocks, entries):
    """A flat [3][blocks][8] u64 region with {(kernel, block, slot): ns}."""
    buf = [0] * (3 * blocks * 8)
    for (k, b, s), t in entries.items():
        buf[(k * blocks + b) * 8 + s] = t
    return buf


def test_summarize_phases_from_the_first_start():
    buf = region(4, {
        (0, 0, 0): 1000, (0, 0, 1): 2000, (0, 0, 7): 11000,  # gate_up block 0
        (0, 1, 0): 1500, (0, 1, 1): 2500, (0, 1, 7): 15000,  # gate_up block 1
        (0, 2, 0): 1200, (0, 2, 1): 2200, (0, 2, 7): 12000,  # gate_up block 2
        (1, 0, 0): 9000, (1, 0, 1): 9500, (1, 0, 3): 16000, (1, 0, 7): 20000,  # down block 0
    })
    s = trace.summarize(buf, 4)
    assert set(s) == {"gate_up", "down"}
    assert s["gate_up"]["start"] == {"n": 3, "min": 0.0, "median": 0.2, "max": 0.5}
    assert s["gate_up"]["end"]["max"] == 14.0 and s["gate_up"]["end"]["median"] == 11.0
    assert s["down"]["released"] == {"n": 1, "min": 15.0, "median": 15.0, "max": 15.0}
    assert "gate_up tiles done" not in s["gate_up"]  # slot 2 is the fused kernel's


def test_summarize_empty_region():
    assert trace.summarize([0] * (3 * 2 * 8), 2) == {}


def test_combine_takes_the_median_of_each_statistic_and_only_common_phases():
    a = {"down": {"start": {"n": 2, "min": 1.0, "median": 2.0, "max": 3.0},
                  "end": {"n": 2, "min": 9.0, "median": 9.5, "max": 10.0}}}
    b = {"down": {"start": {"n": 2, "min": 1.5, "median": 2.5, "max": 3.5}}}
    c = {"down": {"start": {"n": 2, "min": 0.5, "median": 1.5, "max": 9.0},
                  "end": {"n": 2, "min": 8.0, "median": 8.5, "max": 9.0}}}
    out = trace.combine([a, b, c])
    assert out == {"down": {"start": {"n": 2, "min": 1.0, "median": 2.0, "max": 3.5}}}
    table = trace.format_table(out)
    assert "down" in table and "start" in table and "3.50" in table


def test_per_sm_counts_blocks_per_sm_and_the_hand_over_to_down():
    # SM 0 (slot 6 = 1) runs gate_up blocks 0 and 1 (last end 15000), SM 1 runs block 2 (12000);
    # down block 0 starts on SM 1 at 12500, down block 1 on SM 0 at 16000.
    buf = region(4, {
        (0, 0, 0): 1000, (0, 0, 6): 1, (0, 0, 7): 11000,
        (0, 1, 0): 1500, (0, 1, 6): 1, (0, 1, 7): 15000,
        (0, 2, 0): 1200, (0, 2, 6): 2, (0, 2, 7): 12000,
        (1, 0, 0): 12500, (1, 0, 6): 2, (1, 0, 7): 20000,
        (1, 1, 0): 16000, (1, 1, 6): 1, (1, 1, 7): 21000,
    })
    s = trace.per_sm(buf, 4)
    assert s["gate_up"] == {"1 blocks": {"sms": 1, "last_end_median": 11.0},
                            "2 blocks": {"sms": 1, "last_end_median": 14.0}}
    assert s["down"]["sm_handover"] == {"n": 2, "min": 0.5, "median": 0.75, "max": 1.0}


def test_per_sm_without_sm_records_is_empty_and_combine_sm_takes_medians():
    buf = region(2, {(0, 0, 0): 1000, (0, 0, 7): 5000})
    assert trace.per_sm(buf, 2) == {}
    runs = [{"down": {"sm_handover": {"min": v, "max": 2 * v}}} for v in (1.0, 3.0, 2.0)]
    assert trace.combine_sm(runs) == {"down": {"sm_handover": {"max": 4.0, "min": 2.0}}}
    assert trace.combine_sm([{}, {"down": {}}]) == {}


def test_raw_records_are_relative_to_the_first_start():
    buf = region(2, {(0, 0, 0): 1000, (0, 0, 6): 5, (0, 0, 7): 4000, (1, 1, 0): 3000, (1, 1, 3): 3500})
    assert trace.raw_records(buf, 2) == [[0, 0, 4, 0, 0, 0, 3000], [1, 1, -1, 2000, 0, 2500, 0]]
    assert trace.raw_records([0] * 48, 2) == []
