"""The end-to-end study's CPU-side logic: settings, model configs, parity and the comparison
table. (The study itself needs vLLM on a GPU: bench/results/ holds its runs.)"""

import argparse
import json
import os
from types import SimpleNamespace as NS

import pytest

from tools import e2e


def test_mode_env_sets_exactly_one_switch():
    base = {"OPGRAFT_DISABLE": "1", "OPGRAFT_MOE_EXPERTS": "x", "KEEP": "1"}
    assert e2e.mode_env("disabled", base)["OPGRAFT_DISABLE"] == "1"
    # stock a second time: the same environment as the first
    assert e2e.mode_env("disabled-again", base) == e2e.mode_env("disabled", base)
    p = e2e.mode_env("passthrough", base)
    assert "OPGRAFT_DISABLE" not in p and p["OPGRAFT_MOE_EXPERTS"] == "passthrough"
    o = e2e.mode_env("opgraft", base)
    assert "OPGRAFT_DISABLE" not in o and o["OPGRAFT_MOE_EXPERTS"] == "opgraft"
    assert e2e.mode_env("opgraft-again", base) == o
    assert o["KEEP"] == "1" and base["OPGRAFT_DISABLE"] == "1"  # the caller's dict is untouched
    with pytest.raises(ValueError):
        e2e.mode_env("fast", base)
    # a labelled setting: the setting its name starts with
    assert e2e.mode_env("opgraft-prologue", base) == o and e2e.mode_env("disabled-flashinfer", base)["OPGRAFT_DISABLE"] == "1"
    for bad in ("opgraft-", "opgraftx", "opgraft-Prologue", "opgraft_prologue", "-opgraft"):
        with pytest.raises(ValueError):
            e2e.mode_env(bad, base)


def test_labelled_settings_parse_and_compare_in_order(tmp_path):
    import argparse

    assert e2e._modes("disabled,opgraft,opgraft-prologue,opgraft-norm-moe") == [
        "disabled", "opgraft", "opgraft-prologue", "opgraft-norm-moe"]
    for bad in ("opgraft,opgraft", "fast", "opgraft-", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            e2e._modes(bad)
    assert e2e._setting_env("opgraft-both:OPGRAFT_NORM_FUSION_MOE=1") == ("opgraft-both", "OPGRAFT_NORM_FUSION_MOE", "1")
    for name in ("opgraft-prologue", "disabled", "opgraft", "e2e-summary", "notes"):
        (tmp_path / f"e2e-{name}.json").write_text("{}")
    assert e2e._modes_in(str(tmp_path)) == ["disabled", "opgraft", "opgraft-prologue"]


def test_builtin_configs_match_the_moe_presets():
    from opgraft.presets import PRESETS, from_config

    for name, cfg in e2e.MODEL_CONFIGS.items():
        shape = from_config(cfg)
        p = PRESETS[name.removesuffix("-FP8")]
        assert (shape.num_experts, shape.hidden, shape.inter, shape.top_k) == \
            (p.num_experts, p.hidden, p.inter, p.top_k)


def test_model_config_from_path_and_errors(tmp_path):
    good = tmp_path / "m"
    good.mkdir()
    (good / "config.json").write_text(json.dumps({"architectures": ["X"], "vocab_size": 10}))
    assert e2e.model_config(str(good))["architectures"] == ["X"]
    assert e2e.model_config(str(good / "config.json"))["vocab_size"] == 10
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "noarch.json").write_text("{}")
    for bad in [str(tmp_path / "missing"), str(tmp_path / "bad.json"), str(tmp_path / "noarch.json")]:
        with pytest.raises(SystemExit):
            e2e.model_config(bad)


def test_cli_rejects_bad_arguments():
    for argv in (["run", "--mode", "fast"], ["study", "--out-dir", "x", "--modes", "on,off"],
                 ["run", "--mode", "opgraft", "--batches", "1,x"],
                 ["run", "--mode", "opgraft", "--batches", "1,,8"],
                 ["run", "--mode", "opgraft", "--batches", "0"],
                 ["run", "--mode", "opgraft", "--output-len", "1"],
                 ["run", "--mode", "opgraft", "--tp", "0"],
                 ["run", "--mode", "opgraft", "--warmups", "0"],
                 ["run", "--mode", "opgraft", "--capture", "all"]):
        with pytest.raises(SystemExit) as ei:
            e2e.main(argv)
        assert ei.value.code == 2


def test_prompts_are_deterministic_and_in_range():
    a = e2e.prompts(3, 16, 1000, seed=1)
    assert a == e2e.prompts(3, 16, 1000, seed=1) and a != e2e.prompts(3, 16, 1000, seed=2)
    assert all(len(p) == 16 and all(100 <= t < 900 for t in p) for p in a)


def _run(mode, ids, lps, itl):
    return {"mode": mode, "model": "m", "status": "done", "startup_s": 1.0,
            "batches": {"1": {"itl_ms": e2e.summarize(itl), "decode_tok_s": e2e.summarize([1.0 / x for x in itl]),
                              "token_ids": ids, "logprobs": lps}}}


def test_parity_counts_positions_and_compares_logprobs_only_on_the_common_prefix():
    a = _run("disabled", [[1, 2, 3, 4]], [[-1.0, -2.0, -3.0, -4.0]], [2.0])
    b = _run("opgraft", [[1, 2, 9, 4]], [[-1.0, -2.5, -9.0, -4.0]], [1.5])
    p = e2e.parity(a, b)["1"]
    assert p["identical"] is False
    assert p["same_position_fraction"] == 0.75 and p["common_prefix_fraction"] == 0.5
    assert p["max_abs_logprob_diff_on_common_prefix"] == pytest.approx(0.5)  # not 6.0 (after divergence)
    same = e2e.parity(a, a)["1"]
    assert same["identical"] and same["max_abs_logprob_diff_on_common_prefix"] == 0.0


def test_compare_writes_summary_with_ratios(tmp_path, capsys):
    runs = {"disabled": _run("disabled", [[1, 2]], [[-1.0, -1.0]], [2.0, 2.2, 1.8]),
            "opgraft": _run("opgraft", [[1, 2]], [[-1.0, -1.01]], [1.5, 1.6, 1.4]),
            "passthrough": _run("passthrough", [[1, 2]], [[-1.0, -1.0]], [2.0, 2.0, 2.0]),
            "disabled-again": _run("disabled-again", [[1, 3]], [[-1.0, -1.2]], [2.0, 2.1, 1.9])}
    for m, r in runs.items():
        (tmp_path / f"e2e-{m}.json").write_text(json.dumps(r))
    s = e2e.compare(str(tmp_path))
    rows = {r["mode"]: r for r in s["rows"]}
    assert rows["opgraft"]["itl_vs_disabled"] == pytest.approx(0.75)
    assert rows["disabled"]["itl_ms_min"] == 1.8 and rows["disabled"]["itl_ms_max"] == 2.2
    assert rows["opgraft"]["first_token_ms"] is None  # no one-token runs in these rows
    assert s["parity_vs_disabled"]["passthrough"]["1"]["identical"] is True
    # stock against itself: the yardstick for the other settings' parity
    assert s["parity_vs_disabled"]["disabled-again"]["1"]["same_position_fraction"] == 0.5
    assert json.loads((tmp_path / "e2e-summary.json").read_text())["rows"] == s["rows"]
    assert "opgraft" in capsys.readouterr().out
    # a labelled setting, and what the graph rewrites did in each of its workers, in full; the
    # median of its one-token runs as the first token
    r = _run("opgraft-both", [[1, 2]], [[-1.0, -1.0]], [1.4])
    r["batches"]["1"]["t_1_s"] = [0.030, 0.017, 0.016]
    r["workers"] = [{"pid": 1, "linear": {"taken": 9} | {f"k{i}": i for i in range(60)}, "norm_fusion_fused": 2,
                     "norm_fusion_moe_fused": 1, "attention_prologue_fused": None}] * 2
    (tmp_path / "e2e-opgraft-both.json").write_text(json.dumps(r))
    s = e2e.compare(str(tmp_path))
    assert [x["mode"] for x in s["rows"]][-1] == "opgraft-both"
    assert s["rows"][-1]["first_token_ms"] == pytest.approx(17.0)
    out = capsys.readouterr().out
    assert "1st tok ms" in out and any(line.startswith("opgraft-both") and line.endswith(" 17.0")
                                       for line in out.splitlines())
    assert "graph rewrites opgraft-both (a rank each): norm+linear [2, 2], norm+MoE [1, 1]" in out
    assert "graph rewrites opgraft:" not in out and "attention prologue [" not in out
    # ... and against the setting it labels, run in the same study
    assert set(s["vs_base"]) == {"opgraft-both", "disabled-again"}
    v = s["vs_base"]["opgraft-both"]
    assert v["base"] == "opgraft" and v["itl_ratio"]["1"] == pytest.approx(1.4 / 1.5)
    assert v["parity"]["1"]["identical"] and v["parity"]["1"]["max_abs_logprob_diff_on_common_prefix"] == pytest.approx(0.01)
    assert "opgraft-both vs opgraft, B=1: ITL x0.933 (inside the reps' spread), identical=True same-position 1.0000" in out
    assert v["reps_apart"] == {"1": False} and v["t1_ratio"] == {} and v["prefill_gpu_ratio"] == {}
    # reps that do not overlap, and the first token and prefill GPU time where both have them
    r = _run("opgraft-both", [[1, 2]], [[-1.0, -1.0]], [1.2, 1.3, 1.35])
    prof = lambda us: [{"gpu_us_per_step": 1000.0, "kernels_per_step": 1, "kernels": [],
                        "prefill": {"gpu_us_per_step": us, "kernels_per_step": 1, "kernels": []}}]
    r["batches"]["1"].update(t_1_s=[0.09, 0.1, 0.2], profile=prof(990.0))
    (tmp_path / "e2e-opgraft-both.json").write_text(json.dumps(r))
    o = json.loads((tmp_path / "e2e-opgraft.json").read_text())
    o["batches"]["1"].update(t_1_s=[0.08, 0.08], profile=prof(900.0))
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(o))
    v = e2e.compare(str(tmp_path))["vs_base"]["opgraft-both"]
    assert v["reps_apart"] == {"1": True} and v["t1_ratio"]["1"] == pytest.approx(0.1 / 0.08)
    assert v["prefill_gpu_ratio"]["1"] == pytest.approx(1.1)
    assert "ITL x0.867 (reps apart), first token x1.250, prefill GPU x1.100, identical=True" in capsys.readouterr().out


def _setting_with_a_child(pidfile) -> str:
    """A program that starts a long-lived child (as vLLM starts its engine core), writes the
    child's pid, then hangs."""
    return ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")


def _wait_for(path, seconds=30):
    import time

    for _ in range(seconds * 10):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.1)
    pytest.fail(f"{path} never written")


def _assert_gone(pid, what):
    import time

    def alive():
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie (Z) waiting to be reaped is gone
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    for _ in range(50):
        if not alive():
            return
        time.sleep(0.1)
    pytest.fail(what)


def test_run_group_kills_the_whole_group_on_timeout(tmp_path):
    import os
    import sys
    import time

    pidfile = tmp_path / "child.pid"
    with open(tmp_path / "log", "w") as out:
        t = time.time()
        rc = e2e.run_group([sys.executable, "-c", _setting_with_a_child(pidfile)], dict(os.environ), out, timeout=2)
    assert rc == "timeout" and time.time() - t < 30
    _assert_gone(int(pidfile.read_text()), "the setting's child process survived the timeout")


def test_a_terminated_study_stops_its_setting(tmp_path):
    """SIGTERM to the study (`timeout` signals its process group, not the setting's session) exits
    it through run_group's cleanup, which stops the setting's process group: vLLM's engine must
    not outlive the study."""
    import argparse
    import os
    import signal
    import subprocess
    import sys

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    try:  # the study takes the handler (here it returns early: --env names a setting it does not run)
        args = argparse.Namespace(env=[("stock", "K", "V")], modes=["opgraft"])
        assert e2e.study(args) == 2
        assert signal.getsignal(signal.SIGTERM) is e2e._exit_on_term
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGHUP, before[1])
    pidfile = tmp_path / "child.pid"
    study = ("import os, signal, sys; from tools import e2e; "
             "signal.signal(signal.SIGTERM, e2e._exit_on_term); "
             f"e2e.run_group([sys.executable, '-c', {_setting_with_a_child(pidfile)!r}], dict(os.environ), "
             "open(os.devnull, 'w'), 60)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "python")]))
    proc = subprocess.Popen([sys.executable, "-c", study], env=env, cwd=root)
    child = _wait_for(pidfile)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    _assert_gone(child, "the setting's child process survived the study's SIGTERM")


def test_run_group_returns_exit_status(tmp_path):
    import os
    import sys

    with open(tmp_path / "log", "w") as out:
        assert e2e.run_group([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), out, 30) == 3


def test_mode_env_keeps_flashinfer_sampler_off_unless_asked():
    assert e2e.mode_env("opgraft", {})["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert e2e.mode_env("opgraft", {"VLLM_USE_FLASHINFER_SAMPLER": "1"})["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_worker_stats_reports_the_plugin_and_counters(monkeypatch):
    import importlib
    import sys

    dispatch = importlib.import_module("opgraft.dispatch")
    monkeypatch.delitem(sys.modules, "opgraft.dispatch")  # as in a process where the seam never ran
    s = e2e._worker_stats(object())
    assert s["pid"] > 0 and s["moe"] is None and isinstance(s["plugin"], str)
    monkeypatch.setitem(sys.modules, "opgraft.dispatch", dispatch)
    dispatch.stats_of("moe")  # the op's counters exist once its seam ran (not only after other tests)
    assert set(e2e._worker_stats()["moe"]) >= {"taken", "delegated"}
    rope = importlib.import_module("opgraft.vllm.rope_seam")
    assert e2e._worker_stats()["attention_prologue_fused"] == rope.fused_total()
    assert e2e._worker_stats()["qk_epilogue_fused"] == rope.qk_fused_total()
    monkeypatch.delitem(sys.modules, "opgraft.vllm.rope_seam")
    assert e2e._worker_stats()["attention_prologue_fused"] is None
    norm = importlib.import_module("opgraft.vllm.norm_seam")
    assert e2e._worker_stats()["norm_fusion_moe_fused"] == norm.fused_moe_total()


def test_compare_of_a_missing_or_empty_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        e2e.main(["compare", str(tmp_path / "missing")])
    assert ei.value.code == 2 and "no such folder" in capsys.readouterr().err
    assert e2e.main(["compare", str(tmp_path)]) == 0  # an empty study folder: empty table


def test_mode_env_respects_a_host_without_nvlink_multicast():
    assert e2e.mode_env("opgraft", {"NCCL_NVLS_ENABLE": "0"})["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM" not in e2e.mode_env("opgraft", {})


def test_worker_reinit_replaces_dummy_weights_deterministically_per_name():
    torch = pytest.importorskip("torch")

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = torch.nn.Module()
            self.input_layernorm.weight = torch.nn.Parameter(torch.zeros(64))
            self.proj = torch.nn.Linear(256, 64, bias=True)
            self.other = torch.nn.Linear(256, 64, bias=False)

    class Worker:
        def __init__(self):
            self.model = torch.nn.Module()
            self.model.layer = Layer()

        def get_model(self):
            return self.model

    a, b = Worker(), Worker()
    info = e2e._worker_reinit(a, 0.02)
    e2e._worker_reinit(b, 0.02)
    la, lb = a.model.layer, b.model.layer
    assert info["params"] == 4 and info["std"] == 0.02
    assert torch.equal(la.input_layernorm.weight, torch.ones(64))
    assert torch.equal(la.proj.bias, torch.zeros(64))
    assert torch.equal(la.proj.weight, lb.proj.weight)  # same name, same values in every process
    assert not torch.equal(la.proj.weight, la.other.weight)  # another name, other values
    assert abs(la.proj.weight.std().item() - 0.02) < 0.002


def test_model_dir_depends_only_on_the_config():
    cfg = e2e.model_config("Qwen3-30B-A3B")
    assert e2e.model_dir_for(cfg) == e2e.model_dir_for(dict(cfg))
    assert e2e.model_dir_for(cfg) != e2e.model_dir_for(e2e.model_config("Mixtral-8x7B"))


def test_cli_rejects_a_bad_init_std():
    with pytest.raises(SystemExit):
        e2e.main(["run", "--mode", "opgraft", "--init-std", "-1"])


def test_profile_rows_subtract_the_prefill_and_rank_by_time():
    pre = {"kernels": {"fused_moe_kernel": [96, 500.0], "attn": [48, 100.0]}}
    full = {"kernels": {"fused_moe_kernel": [96 + 960, 500.0 + 1300.0], "attn": [48 + 480, 100.0 + 400.0],
                        "moe_gate_up_bf16": [480, 2000.0]}}
    p = e2e.profile_rows(pre, full, steps=10)
    assert [k["kernel"] for k in p["kernels"]] == ["moe_gate_up_bf16", "fused_moe_kernel", "attn"]
    assert p["kernels"][1] == {"kernel": "fused_moe_kernel", "launches_per_step": 96.0, "us_per_step": 130.0}
    assert p["gpu_us_per_step"] == 200.0 + 130.0 + 40.0
    assert p["prefill"] == {"steps": 1, "gpu_us_per_step": 600.0, "kernels_per_step": 144,
                            "kernels": [{"kernel": "fused_moe_kernel", "launches_per_step": 96, "us_per_step": 500.0},
                                        {"kernel": "attn", "launches_per_step": 48, "us_per_step": 100.0}]}
    assert e2e.profile_rows({"error": "x"}, full, 10) == {"error": "x"}
    assert "busy_us_per_step" not in p and "exposed_us_per_step" not in p["kernels"][0]  # older workers


def test_profile_rows_give_each_kernel_its_exposed_time_and_the_busy_span():
    pre = {"kernels": {"attn": [48, 100.0]}, "exposed": {"attn": [100.0]}}
    full = {"kernels": {"attn": [96, 600.0], "qkv": [48, 400.0]}, "exposed": {"attn": [300.0], "qkv": [400.0]}}
    p = e2e.profile_rows(pre, full, steps=2)
    rows = {k["kernel"]: k for k in p["kernels"]}
    assert rows["attn"]["us_per_step"] == 250.0 and rows["attn"]["exposed_us_per_step"] == 100.0
    assert rows["qkv"]["exposed_us_per_step"] == 200.0
    assert p["gpu_us_per_step"] == 450.0 and p["busy_us_per_step"] == 300.0


def test_kernels_sharing_a_cut_name_are_summed_so_the_prefill_subtraction_holds():
    # FA3's prefill and decode kernels differ only past the cut: kept apart by the profiler, one
    # key here. Keeping one of them (a dict comprehension's last) lost the decode kernel's time.
    stem = "void cutlass::device_kernel<flash::FlashAttnFwdSm90<" + "x" * 200
    pre = e2e.short_names({stem + "<prefill>": (48, 42000.0)})
    full = e2e.short_names({stem + "<prefill>": (48, 42100.0), stem + "<decode>": (768, 13600.0),
                            "attn": (5, 1.0)})
    assert full == {stem[:160]: [816, 55700.0], "attn": [5, 1.0]}
    row = e2e.profile_rows({"kernels": pre}, {"kernels": full}, steps=16)["kernels"][0]
    assert row == {"kernel": stem[:160], "launches_per_step": 48.0, "us_per_step": 856.25}
    assert e2e.short_names({"op": (2, 1.0, 3.0), "op ": (1, 1.0, 1.0)}, width=2) == {"op": [3, 2.0, 4.0]}


def test_worker_profile_stop_without_start_is_an_error_not_an_exception():
    assert e2e._worker_profile(None, "stop")["error"] == "profiler not started"


def test_worker_profile_records_host_ops_when_asked():
    torch = pytest.importorskip("torch")
    x = torch.randn(32, 32)
    assert "error" not in e2e._worker_profile(None, "start", True)  # (without a GPU: the CPU's only)
    for _ in range(3):
        torch.mm(x, x)
    out = e2e._worker_profile(None, "stop", True)
    assert "error" not in out, out
    assert out["host"]["aten::mm"][0] == 3 and out["host"]["aten::mm"][1] > 0
    assert out["exposed"] == {} and "exposed_error" not in out  # torch's real events read; no kernels here


def test_host_ops_of_the_prefill_and_their_difference():
    pre = {"kernels": {"k": [1, 10.0]}, "host": {"aten::mm": [145, 900.0, 950.0],
                                                 "opgraft::linear": [145, 2900.0, 3850.0],
                                                 "gpu_model_runner: forward": [1, 5.0, 30000.0]}}
    ours = e2e.profile_rows(pre, {"kernels": {"k": [2, 20.0]}}, 1)["prefill"]["host"]
    assert ours == {"us": 3805.0, "calls": 291, "scopes": {"gpu_model_runner: forward": 30000.0},
                    "ops": [{"op": "opgraft::linear", "calls": 145, "us": 2900.0, "total_us": 3850.0},
                            {"op": "aten::mm", "calls": 145, "us": 900.0, "total_us": 950.0},
                            {"op": "gpu_model_runner: forward", "calls": 1, "us": 5.0, "total_us": 30000.0}]}
    base = e2e.profile_rows({"kernels": {}, "host": {"aten::mm": [145, 1000.0, 1000.0],
                                                     "gpu_model_runner: forward": [1, 5.0, 10000.0]}},
                            {"kernels": {}}, 1)["prefill"]
    d = e2e.host_diff(base["host"], ours)
    assert d["us_delta"] == 2800.0 and d["calls_delta"] == 145
    assert [r["op"] for r in d["ops"][:2]] == ["opgraft::linear", "aten::mm"] and d["ops"][1]["delta_us"] == -100.0
    assert d["scopes"] == [{"scope": "gpu_model_runner: forward", "base_us": 10000.0, "us": 30000.0,
                            "delta_us": 20000.0}]
    assert "host" not in e2e.profile_rows({"kernels": {}}, {"kernels": {}}, 1)["prefill"]


def test_cli_profile_host_needs_profile_steps():
    with pytest.raises(SystemExit):
        e2e.main(["run", "--mode", "opgraft", "--profile-host"])


def test_compare_prints_the_profile(tmp_path, capsys):
    prof = {"steps": 4, "gpu_us_per_step": 3500.0,
            "kernels": [{"kernel": "moe_gate_up_bf16", "launches_per_step": 48.0, "us_per_step": 900.0}]}
    run = {"mode": "opgraft", "batches": {"1": {"itl_ms": {"median": 4.0, "min": 4.0, "max": 4.0, "n": 1},
                                                "decode_tok_s": {"median": 250.0}, "token_ids": [[1]],
                                                "logprobs": [[-1.0]], "profile": [prof]}}}
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(run))
    e2e.compare(str(tmp_path))
    out = capsys.readouterr().out
    assert "profile opgraft B=1: GPU 3.500 ms per step (ITL 4.000 ms)" in out and "moe_gate_up_bf16" in out
    prof.update(busy_us_per_step=3000.0)
    prof["kernels"][0]["exposed_us_per_step"] = 850.0
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(run))
    e2e.compare(str(tmp_path))
    out = capsys.readouterr().out
    assert "GPU 3.500 ms per step, busy 3.000 ms (ITL 4.000 ms)" in out and "900.0 us (850.0 exposed)" in out


def _request_stats():
    """The class RequestOutput.metrics holds where vLLM is installed (its field names), else a
    plain namespace."""
    try:
        from vllm.v1.metrics.stats import RequestStateStats
        return RequestStateStats
    except ImportError:
        return NS


def test_prefill_steps_counts_the_scheduler_steps_that_took_the_prompts():
    stats = _request_stats()

    def outs(*stamps):
        return [NS(metrics=stats(scheduled_ts=t)) for t in stamps]

    assert e2e.prefill_steps(outs(5.25, 5.25, 5.25)) == 1
    assert e2e.prefill_steps(outs(5.25, 5.25, 5.31)) == 2
    assert e2e.prefill_steps(outs(5.25, 0.0)) is None  # a request without stats
    assert e2e.prefill_steps([NS(metrics=None)]) is None and e2e.prefill_steps([]) is None
    assert e2e.prefill_split(outs(5.31, 5.25, 5.25, 5.31, 5.25)) == [3, 2]  # in step order
    assert e2e.prefill_split(outs(5.25, 0.0)) is None and e2e.prefill_split([]) is None


def test_held_generate_holds_the_engine_core_until_the_batch_is_queued(capsys, monkeypatch):
    """The hold (a collective_rpc sleeping in the worker) reaches the core before the requests and
    lasts past the front end's adding them; a hold that fails or never returns is said, and the batch
    still runs."""
    import threading
    import time

    class FakeLLM:
        def __init__(self, fail=False):
            self.fail, self.events = fail, []

        def collective_rpc(self, fn, args=()):
            self.events.append(("hold", time.monotonic()))
            if self.fail:
                raise RuntimeError("no worker")
            return [fn(None, *args)]

        def generate(self, requests, params, use_tqdm=True):
            assert use_tqdm is False and threading.current_thread() is threading.main_thread()
            self.events.append(("generate", time.monotonic()))
            return [f"out{r}" for r in requests]

    llm = FakeLLM()
    t = time.monotonic()
    assert e2e.held_generate(llm, [1, 2], "sp", hold_s=0.2) == ["out1", "out2"]
    assert [e for e, _ in llm.events] == ["hold", "generate"]
    assert time.monotonic() - t >= 0.2  # returns once the hold is over
    assert llm.events[1][1] - llm.events[0][1] < 0.2  # the batch was added while the core was held
    assert capsys.readouterr().out == ""
    llm = FakeLLM(fail=True)
    assert e2e.held_generate(llm, [3], "sp", hold_s=0.01) == ["out3"]
    assert "not held (RuntimeError: no worker)" in capsys.readouterr().out
    never = threading.Event()
    llm = FakeLLM()
    llm.collective_rpc = lambda fn, args=(): never.wait()  # a hold that does not return
    monkeypatch.setattr(e2e, "HOLD_GRACE_S", 0.05)
    assert e2e.held_generate(llm, [4], "sp", hold_s=0.01) == ["out4"]
    assert "not held (TimeoutError: the hold had not returned 0.05 s after its end)" in capsys.readouterr().out
    never.set()


def test_profiled_pair_is_taken_again_until_both_prefills_went_alike():
    """A pair whose prompts went in different engine steps is profiled again, up to the bound; a
    pair without vLLM's stamps is taken as it is."""
    def runner(splits):
        calls = []

        def run(max_tokens):
            calls.append(max_tokens)
            return [f"prof{len(calls)}"], splits[len(calls) - 1]
        return run, calls

    run, calls = runner([[1, 7], [8], [1, 7], [1, 7]])
    runs, splits, tries = e2e.profiled_pair(run, 16)
    assert (runs, splits, tries) == ([["prof3"], ["prof4"]], [[1, 7], [1, 7]], 2) and calls == [1, 17, 1, 17]
    run, calls = runner([[8], [1, 7]] * 3)
    assert e2e.profiled_pair(run, 4, tries=3)[1:] == ([[8], [1, 7]], 3) and len(calls) == 6
    run, calls = runner([None, [8]])
    assert e2e.profiled_pair(run, 4)[1:] == ([None, [8]], 1) and calls == [1, 5]


def _split_run(mode, prefill_steps, t1s=(0.05,), t1_splits=None):
    """A study result at batch 8 whose profile records `prefill_steps` (and, with t1_splits, the
    one-token runs' steps)."""
    pre = {"steps": 1, "gpu_us_per_step": 30000.0, "kernels_per_step": 1788, "kernels": []}
    prof = {"steps": 4, "gpu_us_per_step": 3500.0, "kernels": [], "prefill": pre, "prefill_steps": prefill_steps}
    b = {"itl_ms": {"median": 4.0, "min": 4.0, "max": 4.0, "n": 1}, "decode_tok_s": {"median": 250.0},
         "token_ids": [[1]], "logprobs": [[-1.0]], "profile": [prof], "t_1_s": list(t1s)}
    if t1_splits is not None:
        b["t_1_phases_ms"] = [{"first_token": t * 1e3, "prefill_steps": n} for t, n in zip(t1s, t1_splits)]
    return {"mode": mode, "batches": {"8": b}}


def test_compare_says_where_prompts_went_in_several_engine_steps(tmp_path, capsys):
    """A prefill the engine core took in two steps is a forward more: said for the profiled
    prefills (alone against the run with decode steps, and against stock) and the one-token runs."""
    (tmp_path / "e2e-disabled.json").write_text(json.dumps(
        _split_run("disabled", {"alone": 1, "with_decode": 1}, [0.05, 0.05], [1, 1])))
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(
        _split_run("opgraft", {"alone": 2, "with_decode": 1}, [0.05, 0.08, 0.06], [1, 2, 1])))
    e2e.compare(str(tmp_path))
    out = capsys.readouterr().out
    assert "profile opgraft B=8: GPU 30.000 ms in the prefill alone in 2 engine steps" in out
    assert "profile opgraft B=8: the prompts went in 2 engine steps alone and 1 before the decode steps" in out
    assert "profile opgraft vs disabled B=8: the prefills above went in 1 and 2 engine steps" in out
    assert ("first token opgraft B=8: 1 of 3 one-token runs took their prompts in several engine steps; "
            "the median of the others 55.0 ms") in out
    assert "first token disabled" not in out and "disabled B=8: GPU 30.000 ms in the prefill alone," in out


def test_compare_says_where_prompts_went_in_other_steps_of_the_same_count(tmp_path, capsys):
    """Two engine steps each, split otherwise: said for the pair and against stock, with the tries
    (and whether the last pair went alike)."""
    def steps(alone, with_decode, tries):
        return {"alone": len(alone), "with_decode": len(with_decode), "tries": tries,
                "split": {"alone": alone, "with_decode": with_decode}}

    (tmp_path / "e2e-disabled.json").write_text(json.dumps(_split_run("disabled", steps([1, 7], [1, 7], 2))))
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(_split_run("opgraft", steps([4, 4], [1, 7], 3))))
    e2e.compare(str(tmp_path))
    out = capsys.readouterr().out
    assert ("profile opgraft B=8: the prompts went in steps of [4, 4] requests alone and [1, 7] before the "
            "decode steps") in out
    assert "profile opgraft B=8: 3 profiled pairs taken, none whose prompts went in the same engine steps" in out
    assert "profile opgraft vs disabled B=8: the prefills above went in steps of [1, 7] and [4, 4] requests" in out
    assert "profile disabled B=8: the prompts went" not in out
    assert "profile disabled B=8: 2 profiled pairs taken\n" in out  # the second pair went alike


def test_cli_rejects_profile_steps_beyond_the_output():
    with pytest.raises(SystemExit):
        e2e.main(["run", "--mode", "opgraft", "--output-len", "16", "--profile-steps", "16"])


def test_write_model_dir_replaces_the_config_whole(tmp_path):
    d = e2e.write_model_dir({"architectures": ["X"], "n": 1}, str(tmp_path))
    d2 = e2e.write_model_dir({"architectures": ["X"], "n": 2}, str(tmp_path))
    assert d == d2
    assert json.load(open(tmp_path / "model" / "config.json"))["n"] == 2
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]


def test_gpu_memory_asks_only_for_the_visible_gpus(monkeypatch):
    calls = []

    class R:
        stdout = "100\n"

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return R()

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert e2e.gpu_memory_used_mib() == [100]
    assert calls[-1][-1] == "--id=1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")  # UUIDs: ask for every GPU
    e2e.gpu_memory_used_mib()
    assert not any(a.startswith("--id") for a in calls[-1])


def test_compilation_config_turns_the_allreduce_fusion_off_only_for_tp_without_multicast():
    assert e2e.compilation_config([1, 2], 1, {"NCCL_NVLS_ENABLE": "0"}) == {"cudagraph_capture_sizes": [1, 2]}
    assert "pass_config" not in e2e.compilation_config([1], 2, {})
    cfg = e2e.compilation_config([1], 2, {"NCCL_NVLS_ENABLE": "0"})
    assert cfg["pass_config"] == {"fuse_allreduce_rms": False}


def test_capture_vllm_leaves_the_capture_sizes_to_vllm_at_serves_cap():
    # vLLM builds the list; the cap is serve's, not twice the study's max_num_seqs
    assert e2e.compilation_config(None, 1, {}) == {"max_cudagraph_capture_size": 512}


def test_capture_vllm_config_is_one_vllm_takes():
    config = pytest.importorskip("vllm.config")
    cfg = config.CompilationConfig(**e2e.compilation_config(None, 1, {}))
    assert cfg.max_cudagraph_capture_size == 512 and cfg.cudagraph_capture_sizes is None


def test_the_jit_monitor_keyword_is_one_vllm_takes():
    """Every JIT event logged where this vLLM can (0.26 on), through an engine argument it knows."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    kw = e2e._jit_monitor_every_event()
    assert kw in ({}, {"jit_monitor_verbose": True})
    assert arg_utils.EngineArgs(model="m", **kw).__dict__.get("jit_monitor_verbose", True) is True


def test_itl_floor_ignores_a_stalled_run():
    # reps: the one-token run of rep 0 and the full run of rep 2 stalled for seconds
    t1s, tns = [3.36, 0.23, 0.21], [4.13, 2.54, 3.80]
    assert e2e.itl_floor_ms(t1s, tns, 256) == round((2.54 - 0.21) / 255 * 1e3, 4)


def test_profile_diff_ranks_the_changes_and_counts_kernels():
    base = e2e.profile_rows({"kernels": {}}, {"kernels": {"fused_moe_kernel": [96, 960.0], "act": [48, 72.0],
                                                          "attn": [48, 400.0]}}, 1)
    ours = e2e.profile_rows({"kernels": {}}, {"kernels": {"moe_gate_up_bf16": [48, 620.0],
                                                          "moe_down_bf16": [48, 316.0], "attn": [48, 402.0]}}, 1)
    assert base["kernels_per_step"] == 192 and ours["kernels_per_step"] == 144
    d = e2e.profile_diff(base, ours)
    assert d["gpu_delta_us"] == round(1338.0 - 1432.0, 1) and d["kernels_delta"] == -48
    assert [k["kernel"] for k in d["kernels"][:2]] == ["fused_moe_kernel", "moe_gate_up_bf16"]
    assert d["kernels"][0]["delta_us"] == -960.0 and d["kernels"][-1]["kernel"] == "attn"


def test_compare_prints_the_profile_difference(tmp_path, capsys):
    def run(mode, kernels, prefill, t1, host):
        prof = e2e.profile_rows({"kernels": prefill, "host": host}, {"kernels": kernels}, 1)
        return {"mode": mode, "batches": {"8": {"itl_ms": {"median": 9.0, "min": 9.0, "max": 9.0, "n": 1},
                                                "decode_tok_s": {"median": 800.0}, "token_ids": [[1]],
                                                "logprobs": [[-1.0]], "profile": [prof], "t_1_s": t1}}}
    (tmp_path / "e2e-disabled.json").write_text(json.dumps(
        run("disabled", {"fused_moe_kernel": [96, 3000.0]}, {"nvjet_gemm": [144, 900.0]}, [0.07, 0.06],
            {"aten::mm": [144, 1000.0, 1000.0]})))
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(
        run("opgraft", {"moe_down_bf16": [48, 3500.0]}, {"nvjet_gemm": [144, 1000.0]}, [0.11],
            {"aten::mm": [144, 1000.0, 1000.0], "opgraft::linear": [144, 3000.0, 4000.0]})))
    (tmp_path / "e2e-opgraft-both.json").write_text(json.dumps(
        run("opgraft-both", {"moe_down_bf16": [48, 3400.0]}, {"nvjet_gemm": [144, 1000.0]}, [0.11], {})))
    e2e.compare(str(tmp_path))
    out = capsys.readouterr().out
    assert "profile opgraft-both vs opgraft B=8: GPU -100.0 us per step, kernels +0.0 per step" in out
    assert "profile opgraft vs opgraft" not in out and "profile disabled vs" not in out
    assert "profile opgraft vs disabled B=8: GPU +500.0 us per step, kernels -48.0 per step" in out
    assert "profile opgraft B=8: GPU 1.000 ms in the prefill alone, 144 kernels (one-token run 110.0 ms)" in out
    assert "profile opgraft vs disabled B=8: GPU +100.0 us per prefill, kernels +0.0 per prefill" in out
    assert ("profile opgraft vs disabled B=8: host +3000.0 us of self CPU time per prefill (1.00 -> 4.00 ms), "
            "calls +144") in out
    assert "+3000.0 us  (0.0 -> 3000.0, 0 -> 144 calls)  opgraft::linear" in out


def test_builtin_configs_load_as_hugging_face_configs(tmp_path):
    """vLLM reads the model folder's config.json through transformers: each built-in architecture
    (the FP8 ones with their quantization_config) must load there offline."""
    transformers = pytest.importorskip("transformers")
    for name, cfg in e2e.MODEL_CONFIGS.items():
        d = e2e.write_model_dir(cfg, str(tmp_path / name))
        hf = transformers.AutoConfig.from_pretrained(d)
        assert hf.architectures == cfg["architectures"], name
        if "quantization_config" in cfg:
            assert hf.quantization_config["weight_block_size"] == [128, 128], name


def _study_args(tmp_path, modes):
    return argparse.Namespace(
        modes=modes, out_dir=str(tmp_path), log_dir=None, model="Qwen3-30B-A3B", batches=[1], input_len=8,
        output_len=4, reps=1, warmups=1, init_std=0.02, profile_steps=0, profile_host=False, gpu_memory_utilization=0.5, tp=1,
        expert_parallel=False, mode_timeout=10, capture="study", moe_backend="auto", env=[], mode_moe_backend=[],
        cold_caches=False)


def test_study_fails_and_names_each_failed_setting(tmp_path, monkeypatch, capsys):
    """A setting that exits non-zero, or exits 0 without a finished result, fails the study, which
    names it with the last line of its log; one that finished is compared."""
    def fake_run_group(cmd, env, out, timeout):
        mode = cmd[cmd.index("--mode") + 1]
        path = cmd[cmd.index("--json") + 1]
        if mode == "disabled":
            out.write("tools.e2e run: needs vllm, which cannot be imported here\n")
            return 1
        if mode == "passthrough":
            with open(path, "w") as f:
                json.dump({"status": "started", "batches": {}}, f)
            out.write("engine died\n")
            return 0
        with open(path, "w") as f:
            json.dump({"status": "done", "batches": {}}, f)
        return 0

    monkeypatch.setattr(e2e, "run_group", fake_run_group)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    (tmp_path / "e2e-disabled.json").write_text(json.dumps({"status": "done", "batches": {}}))  # a stale one
    assert e2e.study(_study_args(tmp_path, ["disabled", "opgraft", "passthrough"])) == 1
    err = capsys.readouterr().err
    assert "setting disabled failed: exit 1: tools.e2e run: needs vllm" in err
    assert "setting passthrough failed: exit 0 but 'started': engine died" in err
    assert "opgraft failed" not in err and "2 of 3 settings failed" in err
    assert not (tmp_path / "e2e-disabled.json").exists()


def test_study_where_every_setting_failed_says_nothing_to_compare(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "run_group", lambda cmd, env, out, timeout: "timeout")
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    assert e2e.study(_study_args(tmp_path, ["disabled", "opgraft"])) == 1
    err = capsys.readouterr().err
    assert "setting disabled failed: timed out" in err and "setting opgraft failed: timed out" in err
    assert "2 of 2 settings failed: nothing to compare" in err


def test_study_that_ran_every_setting_succeeds(tmp_path, monkeypatch, capsys):
    """Each setting's rows are in e2e-summary.json as soon as it finished (a call cut off during the
    next setting keeps them), without a table printed for each."""
    seen = []

    def done(cmd, env, out, timeout):
        summary = tmp_path / "e2e-summary.json"
        seen.append([r["mode"] for r in json.loads(summary.read_text())["rows"]] if summary.exists() else None)
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(_run(cmd[cmd.index("--mode") + 1], [[1, 2]], [[-1.0, -1.0]], [1.0]), f)
        return 0

    monkeypatch.setattr(e2e, "run_group", done)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    assert e2e.study(_study_args(tmp_path, ["disabled", "opgraft", "opgraft-both"])) == 0
    assert seen == [None, ["disabled"], ["disabled", "opgraft"]]
    assert capsys.readouterr().out.count("ITL ms (median)") == 1


def test_model_config_that_is_not_utf8(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"architectures": ["\xff"]}')
    with pytest.raises(SystemExit, match=r"not UTF-8 text \(byte 0xff at offset 20\)"):
        e2e.model_config(str(tmp_path))


def test_study_passes_profile_host_to_each_setting(tmp_path, monkeypatch):
    cmds = []

    def fake_run_group(cmd, env, out, timeout):
        cmds.append(cmd)
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"status": "done", "batches": {}}, f)
        return 0

    monkeypatch.setattr(e2e, "run_group", fake_run_group)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    a = _study_args(tmp_path, ["disabled", "opgraft"])
    a.profile_steps, a.profile_host = 2, True
    assert e2e.study(a) == 0
    assert len(cmds) == 2 and all("--profile-host" in c for c in cmds)
    assert all(c[c.index("--warmups") + 1] == "1" for c in cmds)
    a.profile_host = False
    cmds.clear()
    e2e.study(a)
    assert cmds and not any("--profile-host" in c for c in cmds)
    a.capture = "vllm"
    cmds.clear()
    e2e.study(a)
    assert cmds and all(c[c.index("--capture") + 1] == "vllm" for c in cmds)
    a.moe_backend = "flashinfer_cutlass"
    cmds.clear()
    e2e.study(a)
    assert cmds and all(c[c.index("--moe-backend") + 1] == "flashinfer_cutlass" for c in cmds)


def test_one_token_phases_come_from_vllms_request_stats():
    stats = _request_stats()

    def out(queued, scheduled, first, latency):
        m = stats(queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first, first_token_latency=latency)
        return NS(metrics=m)

    ph = e2e.one_token_phases([out(10.0, 10.002, 10.012, 0.015), out(10.0, 10.002, 10.020, 0.021)], 0.030)
    assert ph == {"first_token": 21.0, "queue": 2.0, "engine": 18.0, "outside": 9.0}
    assert e2e.one_token_phases([NS(metrics=None)], 0.03) == {}
    assert e2e.one_token_phases([out(0, 0, 0, 0)], 0.03) == {}  # stats off: no timestamps


def test_study_env_reaches_only_its_setting(tmp_path, monkeypatch):
    """--env MODE:KEY=VALUE: one setting's environment only (a tunable's A/B in one study)."""
    envs = {}

    def fake_run_group(cmd, env, out, timeout):
        envs[cmd[cmd.index("--mode") + 1]] = env
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"status": "done", "batches": {}}, f)
        return 0

    monkeypatch.setattr(e2e, "run_group", fake_run_group)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    monkeypatch.delenv("OPGRAFT_TUNE_MOE_FP8_QUANTIZE", raising=False)
    a = _study_args(tmp_path, ["opgraft", "opgraft-again"])
    a.env = [e2e._setting_env("opgraft-again:OPGRAFT_TUNE_MOE_FP8_QUANTIZE=0")]
    assert e2e.study(a) == 0
    assert envs["opgraft-again"]["OPGRAFT_TUNE_MOE_FP8_QUANTIZE"] == "0"
    assert "OPGRAFT_TUNE_MOE_FP8_QUANTIZE" not in envs["opgraft"]
    assert envs["opgraft-again"]["OPGRAFT_MOE_EXPERTS"] == "opgraft"


def test_study_env_is_checked(tmp_path, capsys):
    for bad in ("OPGRAFT_X=1", "nosuch:OPGRAFT_X=1", "opgraft:OPGRAFT_X", "opgraft:=1", "opgraft:1X=2",
                "opgraft:OPGRAFT_DISABLE=1", "opgraft:OPGRAFT_MOE_EXPERTS=passthrough"):
        with pytest.raises(argparse.ArgumentTypeError):
            e2e._setting_env(bad)
    assert e2e._setting_env("disabled:VLLM_X=a=b") == ("disabled", "VLLM_X", "a=b")
    a = _study_args(tmp_path, ["opgraft"])
    a.env = [("disabled", "OPGRAFT_TUNE_MOE_FP8", "0")]
    assert e2e.study(a) == 2
    assert "--env names disabled, which --modes does not run" in capsys.readouterr().err


def test_study_moe_backend_per_setting(tmp_path, monkeypatch, capsys):
    """--mode-moe-backend MODE:BACKEND: that setting runs vLLM with another experts backend, the
    others with --moe-backend's; the table says which setting ran on what."""
    backend = {}

    def fake_run_group(cmd, env, out, timeout):
        mode, b = cmd[cmd.index("--mode") + 1], cmd[cmd.index("--moe-backend") + 1]
        backend[mode] = b
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"status": "done", "moe_backend": b,
                       "batches": {"1": {"itl_ms": {"median": 5.0, "min": 4.9, "max": 5.1, "n": 1},
                                         "decode_tok_s": {"median": 200.0}, "token_ids": [[1, 2]],
                                         "logprobs": [[-0.1, -0.2]]}}}, f)
        return 0

    monkeypatch.setattr(e2e, "run_group", fake_run_group)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    a = _study_args(tmp_path, ["disabled", "disabled-again", "opgraft"])
    a.mode_moe_backend = [e2e._setting_backend("disabled-again:flashinfer_cutlass")]
    assert e2e.study(a) == 0
    assert backend == {"disabled": "auto", "disabled-again": "flashinfer_cutlass", "opgraft": "auto"}
    out = capsys.readouterr().out
    assert "moe_backend disabled-again: flashinfer_cutlass" in out and "moe_backend disabled:" not in out
    rows = json.loads((tmp_path / "e2e-summary.json").read_text())["rows"]
    assert {r["mode"]: r["moe_backend"] for r in rows}["disabled-again"] == "flashinfer_cutlass"


def test_study_moe_backend_per_setting_is_checked(tmp_path, capsys):
    for bad in ("flashinfer_cutlass", "nosuch:triton", "disabled:", "disabled:a b", "disabled:x;y"):
        with pytest.raises(argparse.ArgumentTypeError):
            e2e._setting_backend(bad)
    assert e2e._setting_backend("opgraft:deep_gemm") == ("opgraft", "deep_gemm")
    a = _study_args(tmp_path, ["opgraft"])
    a.mode_moe_backend = [("disabled", "triton")]
    assert e2e.study(a) == 2
    assert "--mode-moe-backend names disabled, which --modes does not run" in capsys.readouterr().err
    a.mode_moe_backend = [("opgraft", "triton"), ("opgraft", "deep_gemm")]
    assert e2e.study(a) == 2
    assert "--mode-moe-backend names opgraft, more than once" in capsys.readouterr().err



_VLLM_COMPILE_LOG = """\
(EngineCore pid=5032) INFO 12-05 19:07:37 [backends.py:393] Compiling a graph for compile range (1, 2) takes 163.20 s
(EngineCore pid=5032) INFO 12-05 19:07:37 [backends.py:393] Compiling a graph for compile range (3, 1600) takes 163.55 s
(EngineCore pid=5032) INFO 12-05 19:07:44 [monitor.py:53] torch.compile took 190.19 s in total
"""
_VLLM_CACHED_LOG = """\
(Worker_TP0 pid=3709) INFO 12-03 12:50:07 [backends.py:292] Directly load the compiled graph(s) for compile range (1, 1600) from the cache, took 1.696 s
(Worker_TP1 pid=3710) INFO 12-03 12:50:07 [backends.py:292] Directly load the compiled graph(s) for compile range (1, 1600) from the cache, took 1.801 s
(Worker_TP0 pid=3709) INFO 12-03 12:50:09 [monitor.py:53] torch.compile took 7.10 s in total
"""


def test_compile_times_from_vllms_log_lines(tmp_path):
    """vLLM's own lines (as in bench/results' logs): each compile range, compiled or loaded from
    vLLM's cache (the slowest rank's), and the total."""
    log = tmp_path / "a.log"
    log.write_text("noise\n" + _VLLM_COMPILE_LOG)
    assert e2e.compile_times(str(log)) == {"compiled": {"1-2": 163.2, "3-1600": 163.55}, "total_s": 190.19}
    log.write_text(_VLLM_CACHED_LOG)
    assert e2e.compile_times(str(log)) == {"loaded": {"1-1600": 1.801}, "total_s": 7.1}
    log.write_text("no compile here\n")
    assert e2e.compile_times(str(log)) == {}
    assert e2e.compile_times(str(tmp_path / "missing.log")) == {}


def _study_with_logs(tmp_path, monkeypatch, logs: dict) -> dict:
    """A study whose settings (logs' keys) each finish, writing their log text; its summary."""
    def done(cmd, env, out, timeout):
        mode = cmd[cmd.index("--mode") + 1]
        out.write(logs[mode])
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(_run(mode, [[1, 2]], [[-1.0, -1.0]], [1.0]), f)
        return 0

    monkeypatch.setattr(e2e, "run_group", done)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    assert e2e.study(_study_args(tmp_path, list(logs))) == 0
    return json.loads((tmp_path / "e2e-summary.json").read_text())


def test_study_keeps_each_settings_compile_times(tmp_path, monkeypatch, capsys):
    summary = _study_with_logs(tmp_path, monkeypatch, {"disabled": _VLLM_CACHED_LOG, "opgraft": _VLLM_COMPILE_LOG})
    assert summary["compile"]["opgraft"]["compiled"] == {"1-2": 163.2, "3-1600": 163.55}
    assert summary["compile"]["disabled"] == {"loaded": {"1-1600": 1.801}, "total_s": 7.1}
    out = capsys.readouterr().out
    assert "torch.compile opgraft: 190.2 s in all" in out and "compiled 1-2 163.2 s" in out
    assert "torch.compile disabled: 7.1 s in all" in out and "loaded 1-1600 1.80 s" in out


def test_cold_caches_give_each_setting_empty_caches_of_its_own(tmp_path, monkeypatch, capsys):
    """--cold-caches: every cache variable points into a folder of the setting's own, empty when it
    starts and gone after it; --env still wins; the result and summary say so. Without it the
    settings keep the machine's caches."""
    seen = {}

    def done(cmd, env, out, timeout):
        mode = cmd[cmd.index("--mode") + 1]
        seen[mode] = {k: env.get(k) for k in e2e._CACHE_DIRS}
        if env.get("VLLM_CACHE_ROOT"):
            root = os.path.dirname(env["VLLM_CACHE_ROOT"])
            assert os.path.isdir(root) and not os.listdir(root)
            with open(os.path.join(root, "filled"), "w") as f:
                f.write("x")
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(_run(mode, [[1, 2]], [[-1.0, -1.0]], [1.0]), f)
        return 0

    monkeypatch.setattr(e2e, "run_group", done)
    monkeypatch.setattr(e2e, "wait_gpu_memory_free", lambda: None)
    for k in e2e._CACHE_DIRS:
        monkeypatch.delenv(k, raising=False)
    args = _study_args(tmp_path, ["disabled", "opgraft"])
    args.cold_caches = True
    args.env = [("opgraft", "TRITON_CACHE_DIR", "/kept")]
    assert e2e.study(args) == 0
    assert seen["opgraft"]["TRITON_CACHE_DIR"] == "/kept"
    d, o = seen["disabled"], seen["opgraft"]
    assert all(d.values()) and d["VLLM_CACHE_ROOT"] != o["VLLM_CACHE_ROOT"]
    assert len({os.path.dirname(v) for v in d.values()}) == 1
    assert not os.path.exists(os.path.dirname(d["VLLM_CACHE_ROOT"]))
    summary = json.loads((tmp_path / "e2e-summary.json").read_text())
    assert summary["caches"] == {"disabled": "cold", "opgraft": "cold"}
    assert "(cold caches)" in capsys.readouterr().out

    seen.clear()
    assert e2e.study(_study_args(tmp_path, ["disabled"])) == 0
    assert seen["disabled"] == {k: None for k in e2e._CACHE_DIRS}
    assert json.loads((tmp_path / "e2e-summary.json").read_text())["caches"] == {"disabled": "shared"}


_JIT_LOG = """\
(EngineCore pid=1990) INFO 12-05 21:48:46 [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=warn.
(EngineCore pid=1990) WARNING 12-05 21:48:50 [jit_monitor.py:135] Triton kernel JIT compilation during inference: fused_moe_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
opgraft e2e: timed runs of batch 1
opgraft e2e: timed runs done, batch 1
(EngineCore pid=1990) INFO 12-05 21:49:09 [loggers.py:310] Engine 000: throughput ...opgraft e2e: timed runs of batch 8
(EngineCore pid=1990) WARNING 12-05 21:49:10 [jit_monitor.py:135] Triton kernel JIT compilation during inference: fused_moe_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=1990) WARNING 12-05 21:49:11 [jit_monitor.py:135] Triton kernel JIT compilation during inference: fused_moe_kernel (BLOCK_SIZE_M=16). This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=1990) WARNING 12-05 21:49:12 [jit_monitor.py:135] CuTeDSL kernel JIT compilation during inference: ll_gemm. This causes a latency spike; consider extending warmup to cover this shape/config.
opgraft e2e: timed runs done, batch 8
(EngineCore pid=1990) WARNING 12-05 21:49:30 [jit_monitor.py:135] Triton kernel autotuning during inference: _w8a8_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
"""


def test_jit_events_are_placed_by_the_timed_runs_they_fell_in(tmp_path):
    """vLLM's JIT monitor lines (as in bench/results' logs), counted by kernel inside each batch
    size's timed runs, the rest as "other"; the activation line is no event."""
    log = tmp_path / "a.log"
    log.write_text(_JIT_LOG)
    assert e2e.jit_events(str(log)) == {
        "other": {"Triton kernel JIT compilation: fused_moe_kernel": 1, "Triton kernel autotuning: _w8a8_kernel": 1},
        "8": {"Triton kernel JIT compilation: fused_moe_kernel": 2, "CuTeDSL kernel JIT compilation: ll_gemm": 1}}
    log.write_text("no events\n" + _VLLM_COMPILE_LOG)
    assert e2e.jit_events(str(log)) == {}
    assert e2e.jit_events(str(tmp_path / "missing.log")) == {}


def test_study_reports_jit_events_in_the_timed_runs(tmp_path, monkeypatch, capsys):
    summary = _study_with_logs(tmp_path, monkeypatch, {"disabled": "", "opgraft": _JIT_LOG})
    assert list(summary["jit_events"]) == ["opgraft"]
    assert summary["jit_events"]["opgraft"]["8"]["Triton kernel JIT compilation: fused_moe_kernel"] == 2
    out = capsys.readouterr().out
    assert ("JIT after vLLM's warm-up, opgraft, B=8 timed runs: CuTeDSL kernel JIT compilation: ll_gemm x1; "
            "Triton kernel JIT compilation: fused_moe_kernel x2") in out
    assert "JIT after vLLM's warm-up, opgraft, elsewhere:" in out
    assert not any(line.startswith("JIT after vLLM's warm-up, disabled") for line in out.splitlines())


def test_busy_cores_from_two_readings_and_unreadable_ones(monkeypatch):
    monkeypatch.setattr(e2e.os, "cpu_count", lambda: 16)
    assert e2e.busy_cores((100, 1000), (150, 1400)) == 2.0  # 50 of 400 jiffies on 16 cores
    assert e2e.busy_cores(None, (1, 2)) is None and e2e.busy_cores((5, 10), (5, 10)) is None
    a = e2e.cpu_jiffies()  # this host's: busy never above total
    assert a is None or 0 <= a[0] <= a[1]


def test_wait_quiet_stops_at_a_quiet_window_or_at_its_limit(monkeypatch):
    monkeypatch.setattr(e2e.time, "sleep", lambda s: None)
    seen = iter([(0, 0), (100, 100), (100, 100), (101, 200)])  # a busy window, then a quiet one
    monkeypatch.setattr(e2e, "cpu_jiffies", lambda: next(seen))
    monkeypatch.setattr(e2e.os, "cpu_count", lambda: 16)
    q = e2e.wait_quiet(limit_s=60.0, cores=2.0)
    assert q["quiet"] is True and q["busy_cores"] == [16.0, 0.16]
    monkeypatch.setattr(e2e, "cpu_jiffies", lambda it=iter(range(0, 10 ** 6, 100)): (next(it), next(it)))
    q = e2e.wait_quiet(limit_s=0.0, cores=2.0)  # always busy: gives up at the limit, says so
    assert q["quiet"] is False and len(q["busy_cores"]) == 1
    monkeypatch.setattr(e2e, "cpu_jiffies", lambda: None)  # no /proc/stat: no wait
    assert e2e.wait_quiet()["quiet"] is False


def test_compare_prints_the_host_beside_the_reps(tmp_path, capsys):
    r = _run("opgraft", [[1, 2]], [[-1.0, -1.0]], [3.5, 3.1, 3.0])
    r["batches"]["1"].update(host_quiet={"waited_s": 1.0, "busy_cores": [0.4], "quiet": True},
                             host_busy_cores=[5.2, None, 1.1], itl_ms_all=[3.5, 3.1, 3.0])
    (tmp_path / "e2e-opgraft.json").write_text(json.dumps(r))
    e2e.compare(str(tmp_path))
    assert "host opgraft B=1: quiet after 1.0 s; busy cores a rep 1.1..5.2; ITL a rep 3.50 3.10 3.00" in capsys.readouterr().out


def test_kernels_group_into_the_ops_of_a_step_by_name():
    names = {
        "triton_red_fused_fused_add_rms_norm_moe_forward_0": "norms",
        "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<": "attention",
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16": "attention",
        "attention_decode_bf16": "attention",
        "fused_moe_kernel": "moe", "moe_gate_up_bf16": "moe",
        "void vllm::moe::topkGating<8, 128, 4, 16, 32, int": "moe",
        "void vllm::act_and_mul_kernel<c10::BFloat16": "moe",
        "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "projections",
        "void cublasLt::splitKreduce_kernel<32, 16, int": "projections",
        "linear_norm_gemv_qk_bf16": "projections",
        "triton_poi_fused_3": "inductor", "triton_red_fused_2": "inductor",
        "Memcpy HtoD (Pinned -> Device)": "other", "_compute_slot_mapping_kernel": "other",
    }
    assert {n: e2e.op_of(n) for n in names} == names
    rows = [{"kernel": "moe_down_bf16", "us_per_step": 10.0, "exposed_us_per_step": 8.0},
            {"kernel": "fused_moe_kernel", "us_per_step": 5.0, "exposed_us_per_step": 5.0},
            {"kernel": "attention_decode_bf16", "us_per_step": 4.0, "exposed_us_per_step": 1.5},
            {"kernel": "nvjet_x", "us_per_step": 3.0}]  # no exposed time: the op's is unknown
    assert e2e.op_times(rows) == {"attention": {"us": 4.0, "exposed": 1.5}, "moe": {"us": 15.0, "exposed": 13.0},
                                  "projections": {"us": 3.0, "exposed": None}}
    full = {"kernels": {"attention_decode_bf16": [96, 600.0], "linear_gemv_bf16": [48, 400.0]}}
    assert e2e.profile_rows({"kernels": {}}, full, steps=2)["ops"] == {
        "attention": {"us": 300.0, "exposed": None}, "projections": {"us": 200.0, "exposed": None}}


def test_op_ratios_take_exposed_time_where_both_sides_have_it():
    base = {"attention": {"us": 600.0, "exposed": 600.0}, "projections": {"us": 1000.0, "exposed": None},
            "inductor": {"us": 100.0, "exposed": 100.0}, "other": {"us": 0.0, "exposed": 0.0}}
    ours = {"attention": {"us": 900.0, "exposed": 300.0}, "projections": {"us": 700.0, "exposed": 500.0}}
    assert e2e.op_ratios(base, ours) == {"attention": 0.5, "projections": 0.7, "inductor": 0.0}
