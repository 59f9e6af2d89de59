"""The optimize loop's host-side pieces: token ranges, the tune file round trip through the C
library, baked-table injection, verdicts and the plot."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from opgraft import _lib, cli
from opgraft.tune import inject_baked, make_entries, merge_tune_file, token_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = "moe:bf16:E128:H2048:I768:k8"


def test_token_ranges_cover_every_count_once():
    for tokens in ([1], [1, 8], [1, 2, 4, 8, 16, 32, 64], [8, 1, 8]):
        rs = token_ranges(tokens)
        covered = [t for lo, hi in rs for t in range(lo, hi + 1)]
        assert covered == list(range(1, 65)), (tokens, rs)
        for t, (lo, hi) in zip(sorted(set(tokens)), rs):
            assert lo <= t <= hi


def _winners():
    return make_entries([
        {"arch": 90, "gpu": "NVIDIA H200", "shape": SHAPE, "tokens": (1, 2),
         "values": {"moe.down.warps": 16, "moe.l2_fetch": 256}, "why": "test: 25.0 -> 24.0 us"},
        {"arch": 90, "gpu": "NVIDIA H200", "shape": SHAPE, "tokens": (3, 64),
         "values": {"moe.gate_up.warps": 2}, "why": "test"},
    ])


def test_tune_file_round_trip_through_the_c_library(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    merge_tune_file(str(path), _winners())
    monkeypatch.setenv("OPGRAFT_TUNE_FILE", str(path))
    _lib.lib().opgraft_tune_reload()
    try:
        assert _lib.tune_get("moe.down.warps", 90, "NVIDIA H200", SHAPE, 2) == (16, f"file:{path}")
        assert _lib.tune_get("moe.l2_fetch", 90, "NVIDIA H200", SHAPE, 1)[0] == 256
        assert _lib.tune_get("moe.gate_up.warps", 90, "NVIDIA H200", SHAPE, 40)[0] == 2
        # Another GPU, or a token count outside the entry, falls back to the op's rule.
        assert _lib.tune_get("moe.down.warps", 90, "NVIDIA H100", SHAPE, 2)[1] == "rule"
        assert _lib.tune_get("moe.l2_fetch", 90, "NVIDIA H200", SHAPE, 3)[1] == "rule"
        # Merging again replaces the entry with the same key instead of adding one.
        again = make_entries([{"arch": 90, "gpu": "NVIDIA H200", "shape": SHAPE, "tokens": (1, 2),
                               "values": {"moe.down.warps": 4}, "why": "newer"}])
        doc = merge_tune_file(str(path), again)
        assert len(doc["entries"]) == 2
        _lib.lib().opgraft_tune_reload()
        assert _lib.tune_get("moe.down.warps", 90, "NVIDIA H200", SHAPE, 2)[0] == 4
    finally:
        monkeypatch.delenv("OPGRAFT_TUNE_FILE")
        _lib.lib().opgraft_tune_reload()


def test_merge_refuses_to_overwrite_a_foreign_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        merge_tune_file(str(p), _winners())
    p.write_text(json.dumps({"something": "else"}))
    with pytest.raises(ValueError, match="not an opgraft tune file"):
        merge_tune_file(str(p), _winners())
    assert json.loads(p.read_text()) == {"something": "else"}


def test_inject_into_a_copy_of_the_baked_table_compiles_and_is_read(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "src"), src)
    for d in ("include", "kernels", "cmake"):
        shutil.copytree(os.path.join(ROOT, d), tmp_path / d)
    shutil.copy(os.path.join(ROOT, "CMakeLists.txt"), tmp_path)
    table = src / "ops" / "moe" / "table.c"
    before = table.read_text()
    assert inject_baked(str(table), _winners()) == 3
    assert inject_baked(str(table), _winners()) == 3  # idempotent: replaces its own rows
    after = table.read_text()
    assert after.count('"NVIDIA H200"') == 3 and before.split("/* BEGIN")[0] == after.split("/* BEGIN")[0]
    build = tmp_path / "build"
    r = subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(build), "-DOPGRAFT_BUILD_TESTS=OFF"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    code = ("import sys; sys.path.insert(0, 'python'); from opgraft import _lib;"
            f"print(_lib.tune_get('moe.down.warps', 90, 'NVIDIA H200', '{SHAPE}', 1))")
    env = dict(os.environ, OPGRAFT_LIBRARY=str(build / "libopgraft.so"))
    env.pop("OPGRAFT_TUNE_MOE_DOWN_WARPS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "(16, 'baked:sm_90')" in r.stdout


def test_verdicts():
    assert cli.verdict(100.0, 0.9 * 100e-6 * 4.5e12, 4.5) == "bandwidth"
    assert cli.verdict(25.0, 16e-6 * 4.5e12, 4.5) == "latency"
    assert cli.verdict(1000.0, 600e-6 * 4.5e12, 4.5) == "occupancy"


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"model": "M", "dtype": "bf16", "gpu": "G", "tokens": t, "impl": impl, "median_us": us,
             "bytes": 1e8 * t, "ceiling_tbps": 4.5} for t in (1, 2, 4) for impl, us in (("opgraft", 30.0 * t),
                                                                                       ("torch", 80.0 * t))]
    out = tmp_path / "p.png"
    assert cli.write_plot(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not cli.write_plot([], str(tmp_path / "none.png"))


def test_tune_and_profile_without_gpu_are_clear(tmp_path):
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-m", "opgraft.cli", "tune", "moe", "--tokens", "1"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "needs" not in r.stdout and "GPU" in r.stderr
    r = subprocess.run([sys.executable, "-m", "opgraft.cli", "profile", "moe", "--tokens", "1"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "no GPU here" in r.stderr


def test_bench_table_names_the_missing_builtin_and_the_decision():
    pytest.importorskip("torch")
    from opgraft.bench import moe as bench

    base = {"model": "M", "dtype": "bf16", "tokens": 1, "bytes": 1e8, "tbps": 3.0, "fraction_of_ceiling": 0.66,
            "rel_err": 2.4e-3, "builtin_missing": "vLLM is not importable here (ImportError: x)"}
    rows = [dict(base, impl="opgraft", median_us=30.0, speedup_vs_baseline=2.5, guard="take"),
            dict(base, impl="torch-gather-bmm", median_us=75.0, speedup_vs_baseline=1.0, guard="take")]
    text = bench.format_table(rows)
    assert text.splitlines()[0].startswith("vLLM builtin column missing: vLLM is not importable")
    line = [l for l in text.splitlines() if " opgraft " in l][0]
    assert line.rstrip().endswith("take")


def test_vllm_builtin_is_found_where_vllm_imports():
    pytest.importorskip("torch")
    from opgraft.bench import moe as bench

    fn, why = bench.vllm_builtin()
    try:
        import vllm.model_executor.layers.fused_moe.fused_moe  # noqa: F401
    except Exception:
        assert fn is None and "not importable" in why
    else:
        assert callable(fn) and why == ""


def test_time_calls_subtracts_the_traffic_between_calls(monkeypatch):
    """time_calls: with traffic between calls, the time of (traffic + call) minus the traffic
    alone; without, the calls back to back. A fake time_graph charges 5 per call, 3 per read."""
    pytest.importorskip("torch", reason="opgraft.bench measures with torch")
    from opgraft import bench

    cost = {"call": 5.0, "read": 3.0}
    log = []

    def fake_time_graph(step, calls_per_replay, reps=30, warmup=3):
        log.clear()
        step()
        return sum(cost[k] for k in log) / calls_per_replay

    monkeypatch.setattr(bench, "time_graph", fake_time_graph)
    schedule = [(i, None) for i in range(4)]
    call = lambda i, w: log.append("call")  # noqa: E731
    read = lambda: log.append("read")  # noqa: E731
    assert bench.time_calls(call, schedule) == pytest.approx(5.0)
    assert bench.time_calls(call, schedule, read) == pytest.approx(5.0)
    assert bench.between_traffic(0, "cpu") is None


def test_per_call_time_averages_each_calls_median():
    """Two calls of different sizes (10 and 20 us) over three replays, one replay of the first
    call stalled: each call's median over the replays, then their mean (15), where a median over
    all six spans would give the time of neither call's mean."""
    pytest.importorskip("torch")
    from opgraft import bench

    spans = [10.0, 20.0, 10.0, 20.0, 90.0, 20.0]
    assert bench.per_call_time(spans, 2) == pytest.approx(15.0)
    assert bench.per_call_time([10.0, 20.0, 20.0, 20.0], 2) == pytest.approx(17.5)
    with pytest.raises(bench.SpanError):
        bench.per_call_time(spans[:5], 2)
    with pytest.raises(bench.SpanError):
        bench.per_call_time([], 1)


def test_call_spans_charge_each_call_from_the_end_of_the_traffic():
    """call_spans: per [traffic, call] group, the end of the call's last activity minus the end
    of the traffic's; a call kernel that starts before the traffic ends (PDL) is charged only
    from that end; records that do not split into groups raise SpanError."""
    pytest.importorskip("torch", reason="opgraft.bench measures with torch")
    from opgraft import bench

    # two groups: traffic 0..100, call kernels 98..120 and 121..130 (starts early: PDL overlap);
    # traffic 130..230, call 231..260 and 240..250 (overlapping kernels).
    iv = [(0, 100_000), (98_000, 120_000), (121_000, 130_000),
          (130_000, 230_000), (231_000, 260_000), (240_000, 250_000)]
    assert bench.call_spans(iv, 1, 2) == pytest.approx([30.0, 30.0])
    with pytest.raises(bench.SpanError):
        bench.call_spans(iv[:5], 1, 2)
    with pytest.raises(bench.SpanError):
        bench.call_spans(iv, 0, 3)
    with pytest.raises(bench.SpanError):
        bench.call_spans([], 1, 1)


def test_timed_calls_picks_the_timing_and_says_which(monkeypatch):
    """timed_calls: back to back without traffic; span with traffic (the subtraction kept
    beside it); the subtraction, with the reason, when the span cannot be taken."""
    pytest.importorskip("torch", reason="opgraft.bench measures with torch")
    from opgraft import bench

    monkeypatch.setattr(bench, "time_calls", lambda call, sched, between, reps: 30.0 if between else 24.0)
    monkeypatch.setattr(bench, "time_calls_span", lambda call, sched, between, reps: 25.0)
    read = object()
    assert bench.timed_calls(None, [], None) == (24.0, {"timing": "back-to-back"})
    stat = {"statistic": "mean over the schedule's calls of each call's median"}
    assert bench.timed_calls(None, [], read) == (25.0, {"timing": "span", **stat, "median_us_subtract": 30.0})
    assert bench.timed_calls(None, [], read, timing="subtract") == (30.0, {"timing": "subtract"})
    assert bench.timed_calls(None, [], read, cross_check=False) == (25.0, {"timing": "span", **stat})

    def no_span(*a):
        raise bench.SpanError("7 device activities do not split")
    monkeypatch.setattr(bench, "time_calls_span", no_span)
    us, how = bench.timed_calls(None, [], read)
    assert us == 30.0 and how["timing"] == "subtract" and "do not split" in how["span_error"]


def test_device_intervals_keeps_device_records_in_start_order():
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from opgraft import bench

    def ev(dev, start, dur, annotation=False):
        return SimpleNamespace(device_type=lambda: dev, start_ns=lambda: start, duration_ns=lambda: dur,
                               is_user_annotation=lambda: annotation)

    events = [ev(DeviceType.CUDA, 500, 10), ev(DeviceType.CPU, 0, 1000), ev(DeviceType.CUDA, 100, 50),
              ev(DeviceType.CUDA, 200, 0), ev(DeviceType.CUDA, 90, 600, annotation=True)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert bench.device_intervals(prof) == [(100, 150), (500, 510)]


def test_bench_shape_rejects_an_unknown_timing():
    pytest.importorskip("torch")
    from opgraft.bench import moe as bench
    from opgraft.presets import resolve

    with pytest.raises(ValueError, match="timing"):
        bench.bench_shape(resolve("Qwen3-30B-A3B"), [1], timing="events", device="cpu")


def test_profiler_kernels_reads_either_time_attribute():
    from types import SimpleNamespace

    pytest.importorskip("torch", reason="opgraft.bench measures with torch")
    from opgraft import bench

    events = [SimpleNamespace(key="new", count=4, self_device_time_total=10.0),
              SimpleNamespace(key="old", count=2, self_cuda_time_total=3.0),
              SimpleNamespace(key="host only", count=5, self_device_time_total=0.0),
              # a host op of a CPU + CUDA profile: torch gives it its kernels' time as well
              SimpleNamespace(key="aten::mm", count=4, device_type="DeviceType.CPU", self_device_time_total=10.0,
                              self_cpu_time_total=40.0, cpu_time_total=45.0),
              # a record_function scope's span on the device (vLLM's "gpu_model_runner: forward")
              SimpleNamespace(key="gpu_model_runner: forward", count=1, is_user_annotation=True,
                              self_device_time_total=105000.0)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert bench.profiler_kernels(prof) == {"new": (4, 10.0), "old": (2, 3.0)}
    assert bench.profiler_host_ops(prof) == {"aten::mm": (4, 40.0, 45.0)}


def test_profiler_exposed_counts_each_overlap_once():
    from types import SimpleNamespace as NS

    pytest.importorskip("torch", reason="opgraft.bench measures with torch")
    from opgraft import bench

    def ev(key, start, end, **kw):
        return NS(key=key, time_range=NS(start=start, end=end), **kw)

    # qkv 0-10; attention launched at 2 by its trigger, waits, ends at 14; o launched at 12, ends
    # at 20; a gap; a memcpy 25-26; a host op and a scope over all of it are not kernels
    events = [ev("o", 12.0, 20.0), ev("qkv", 0.0, 10.0), ev("attention", 2.0, 14.0), ev("memcpy", 25.0, 26.0),
              ev("aten::mm", 0.0, 30.0, device_type="DeviceType.CPU"),
              ev("gpu_model_runner: forward", 0.0, 30.0, is_user_annotation=True), ev("empty", 5.0, 5.0)]
    exposed = bench.profiler_exposed(NS(events=lambda: events))
    assert exposed == {"qkv": 10.0, "attention": 4.0, "o": 6.0, "memcpy": 1.0}
    assert sum(exposed.values()) == 21.0  # the union of the spans: 0-20 and 25-26


def test_tunables_context_sets_and_clears_through_the_api(monkeypatch):
    pytest.importorskip("torch")
    from opgraft import _lib
    from opgraft.bench.moe import tunables

    monkeypatch.setenv("OPGRAFT_TUNE_MOE_PDL", "0")
    with tunables({"moe.pdl": 1, "moe.down_load": 4}):
        assert _lib.tune_get("moe.down_load", 90) == (4, "set")
        assert _lib.tune_get("moe.pdl", 90) == (1, "set")
    assert os.environ["OPGRAFT_TUNE_MOE_PDL"] == "0"
    assert _lib.tune_get("moe.pdl", 90) == (0, "env:OPGRAFT_TUNE_MOE_PDL")
    with pytest.raises(_lib.OpgraftError, match="moe.pdl"):
        with tunables({"moe.pdl": 7}):
            pass


def test_write_rows_keeps_device_ceiling_and_rows(tmp_path):
    pytest.importorskip("torch")
    import json

    from opgraft import bench

    path = tmp_path / "run.json"
    bench.write_rows(str(path), 4.5, [{"tokens": 1, "median_us": 25.0}], facts={"gpu": "test"})
    assert json.loads(path.read_text()) == {"device": {"gpu": "test"}, "ceiling_tbps": 4.5,
                                            "rows": [{"tokens": 1, "median_us": 25.0}]}


def test_gpu_facts_names_the_device_and_vllm(monkeypatch):
    """gpu_facts runs on the GPU host only; its imports and fields are checked here with the device
    properties faked."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from opgraft import bench

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132))
    facts = bench.gpu_facts()
    assert facts["gpu"] == "NVIDIA H200" and facts["arch"] == "sm_90" and facts["sms"] == 132
    assert set(bench.run_facts()) >= {"gpu", "arch", "driver", "torch", "vllm", "commit", "date"}


def test_token_ranges_take_an_upper_bound():
    assert token_ranges([1, 8], upper=8) == [(1, 2), (3, 8)]
    assert token_ranges([1, 8, 32], upper=4096) == [(1, 2), (3, 16), (17, 4096)]


class _FakeFixture:
    """A tuner point whose cost and correctness follow the tunables the library reports for it, so
    the loop is checked end to end through the real tunables API (no GPU)."""

    tune_key, tokens, label, bytes, tolerance = "linear:bf16:N4096:K2048", 1, "fake N4096 K2048 M=1", 16e6, 1e-2

    def __init__(self):
        self.forgotten = 0

    def forget_plans(self):
        self.forgotten += 1

    def _get(self, key):
        return _lib.tune_get(key, 90, "NVIDIA H200", self.tune_key, self.tokens)[0]

    def check(self):  # 16 warps would compute a wrong answer: the tuner must never pick them
        return 1.0 if self._get("linear.warps") == 16 else 1e-3

    def time(self):
        return 10.0 - 2.0 * (self._get("linear.warps") == 4) - 1.0 * (self._get("linear.pdl") == 1)


def test_tune_loop_keeps_only_correct_winners_and_clears_its_settings(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")

    class Props:
        major, minor, name = 9, 0, "NVIDIA H200"

    fx = _FakeFixture()
    monkeypatch.setattr(cli, "_gpu_status", lambda: (True, ""))
    monkeypatch.setattr(cli, "_tune_fixtures", lambda args, shape=None: [(fx, (1, 2))])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(_lib, "tune_space", lambda op: {"linear.warps": [2, 4, 8, 16], "linear.pdl": [0, 1]})
    out, report = tmp_path / "tune.json", tmp_path / "report.json"
    rc = cli.main(["tune", "linear", "--out", str(out), "--report", str(report)])
    assert rc == 0, capsys.readouterr().err
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["values"] == {k: v for k, v in {"linear.warps": 4, "linear.pdl": 1}.items() if fx._get(k) != v}
    assert entry["shape"] == fx.tune_key and entry["tokens"] == [1, 2] and entry["arch"] == 90
    (point,) = json.loads(report.read_text())["rows"]
    assert point["start"] == {k: fx._get(k) for k in ("linear.warps", "linear.pdl")}  # what ships
    assert point["best_us"] == 7.0 and point["best"] == {"linear.warps": 4, "linear.pdl": 1}
    # the candidates were set through the API and are gone afterwards; plans were re-made each time
    assert _lib.tune_get("linear.warps", 90, "NVIDIA H200", fx.tune_key, 1)[1] != "set"
    assert fx.forgotten >= 3


def test_tune_rejects_unknown_keys_and_no_rounds(capsys):
    rc = cli.main(["tune", "attention", "--keys", "attention.warps,attention.nope"])
    assert rc == 2 and "attention.nope" in capsys.readouterr().err
    rc = cli.main(["tune", "moe", "--dtype", "fp8-block", "--keys", "moe.fused"])
    assert rc == 2 and "moe.fused" in capsys.readouterr().err  # the FP8 kernels do not read it
    rc = cli.main(["tune", "linear", "--rounds", "0"])
    assert rc == 2 and "--rounds" in capsys.readouterr().err
    rc = cli.main(["tune", "linear", "--proj", "qkv,gate_up"])  # Qwen3-30B-A3B has no dense MLP
    assert rc == 2 and "gate_up" in capsys.readouterr().err


def test_inject_into_an_empty_table_puts_each_row_on_its_own_line(tmp_path):
    table = tmp_path / "table.c"
    table.write_text("static const og_tune_entry rows[] = {\n    /* BEGIN TUNED ROWS */\n    /* END TUNED ROWS */\n};\n")
    entries = make_entries([{"arch": 90, "gpu": None, "shape": "attention:bf16:D128:G8:bs16", "tokens": (1, 2),
                             "values": {"attention.warps": 8}, "why": "test"}])
    assert inject_baked(str(table), entries) == 1
    lines = table.read_text().splitlines()
    assert lines[1].strip() == "/* BEGIN TUNED ROWS */" and lines[2].strip().startswith("{90, NULL,")
    assert lines[3].strip() == "/* END TUNED ROWS */"
