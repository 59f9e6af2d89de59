import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, env=None):
    e = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "opgraft.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300, cwd=ROOT)


def gpu_present():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


no_gpu_only = pytest.mark.skipif(gpu_present(), reason="a GPU is present: `make gpu-test` covers the GPU path")


@no_gpu_only
def test_bench_without_gpu_says_so_and_reports_what_it_can():
    r = run("bench", "moe", "--model", "Mixtral-8x7B", "--tokens", "1,9", "--json")
    assert r.returncode == 0, r.stderr
    assert "no GPU here" in r.stderr
    data = json.loads(r.stdout)
    rows = {row["tokens"]: row for row in data["rows"]}
    assert rows[1]["guard"] == "take"
    assert rows[9]["guard"].startswith("delegate: 9 tokens > moe.max_tokens")
    # the shipped sm_90 table runs Mixtral-8x7B at T=1 as two kernels (moe.fused 0)
    assert {k["kernel"] for k in rows[1]["kernels"]} == {"moe_gate_up_bf16", "moe_down_bf16"}
    assert data["oracle_selfcheck_rel_diff"] < 1e-12


@no_gpu_only
def test_bench_table_on_a_config_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"architectures": ["TinyMoe"], "num_experts": 4, "hidden_size": 64,
                             "moe_intermediate_size": 32, "num_experts_per_tok": 2}))
    r = run("bench", "moe", "--model", str(p), "--tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "TinyMoe" in r.stdout and "moe_gate_up_bf16" in r.stdout


@no_gpu_only
def test_fp8_bench_without_gpu_reports_the_fp8_guard_and_kernels():
    r = run("bench", "moe", "--model", "DeepSeek-V3", "--dtype", "fp8-block", "--ep", "8", "--tokens", "1,9", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["tokens"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows[1]["model"] == "DeepSeek-V3/ep8" and rows[1]["guard"] == "take"
    assert rows[9]["guard"].startswith("delegate: 9 tokens > moe.max_tokens")
    assert {k["kernel"] for k in rows[1]["kernels"]} == {"moe_gate_up_fp8_bf16", "moe_down_fp8_bf16"}
    assert all(k["spill_bytes"] == 0 for k in rows[1]["kernels"])
    r = run("bench", "moe", "--model", "Mixtral-8x7B", "--dtype", "fp8-tensor", "--tp", "8", "--tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    assert row["guard"] == "take" and row["model"] == "Mixtral-8x7B/tp8"


def test_bad_arguments_are_clear_errors():
    for bad in ("1,x", "1,,2", "1,2,", ","):
        r = run("bench", "moe", "--tokens", bad)
        assert r.returncode == 2 and "comma-separated integers" in r.stderr, bad
    r = run("bench", "moe", "--model", "nope")
    assert r.returncode == 2 and "unknown model" in r.stderr
    r = run("bench", "moe", "--layers", "0")
    assert r.returncode == 2 and "--layers must be >= 1" in r.stderr
    r = run("bench", "moe", "--max-tokens", "65")
    assert r.returncode == 2 and "--max-tokens must be in 1..64" in r.stderr
    r = run("bench", "moe", "--between-mib", "-1")
    assert r.returncode == 2 and "--between-mib must be in 0..4096" in r.stderr
    r = run("bench", "moe", "--ep", "2")
    assert r.returncode == 2 and "--ep takes the FP8 dtypes" in r.stderr
    r = run("bench", "moe", "--dtype", "fp8-block", "--model", "Kimi-K2", "--ep", "7")
    assert r.returncode == 2 and "do not split 7 ways" in r.stderr
    r = run("bench", "moe", "--dtype", "fp8-block", "--layers", "2")
    assert r.returncode == 2 and "--layers is for bf16/fp16" in r.stderr


def test_bad_shapes_lists_and_libraries_are_clear():
    """Each a one-line error (rc 2) or, for doctor, a line that says what is wrong: no traceback."""
    shape = "HQ, HKV and D must be integers in 1..65536"
    for args, want in [(("bench", "attention", "--model", "0/0/0"), shape),
                       (("bench", "attention", "--model", "32/8/-128"), shape),
                       (("bench", "attention", "--model", "99999999999999999999/8/128"), shape),
                       (("bench", "attention", "--context", "1,,2"), "comma-separated integers"),
                       (("bench", "linear", "--rows", "0"), "--rows values must be between 1 and 8"),
                       (("tune", "moe", "--keys", ","), "--keys takes comma-separated names")]:
        r = run(*args)
        assert r.returncode == 2 and want in r.stderr, (args, r.stderr[-300:])
    libm = "/lib/x86_64-linux-gnu/libm.so.6"
    if os.path.exists(libm):
        r = run("doctor", env={"OPGRAFT_LIBRARY": libm})
        assert r.returncode == 0 and "Traceback" not in r.stderr
        assert "is not the libopgraft this package needs: it lacks opgraft_version" in r.stdout
    r = run("doctor", env={"OPGRAFT_DISABLE": "false"})
    assert r.returncode == 0 and "OPGRAFT_DISABLE is set" not in r.stdout


def probe(*args):
    e = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.run([sys.executable, "-m", "tools.probe", *args], capture_output=True, text=True,
                          env=e, timeout=300, cwd=ROOT)


@no_gpu_only
def test_probe_without_gpu_says_so():
    r = probe("--tokens", "1")
    assert r.returncode == 2 and ("no CUDA GPU" in r.stderr or "needs torch" in r.stderr), r.stderr


def test_probe_bad_arguments_are_clear_errors():
    r = probe("--contexts", "bench,nope")
    assert r.returncode == 2 and "comma-separated list of bench" in r.stderr
    r = probe("--tokens", "0")
    assert r.returncode == 2 and "integers in 1..64" in r.stderr
    r = probe("--layers", "0")
    assert r.returncode == 2 and "--layers must be in 1..256" in r.stderr
    r = probe("--model", "nope")
    assert r.returncode == 2 and "nope" in r.stderr


@no_gpu_only
def test_bench_and_profile_write_the_cpu_rows_to_a_json_file(tmp_path):
    out = tmp_path / "rows.json"
    r = run("bench", "moe", "--model", "Mixtral-8x7B", "--tokens", "1,9", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["gpu"] is None and [row["tokens"] for row in data["rows"]] == [1, 9]
    assert "rows written to" in r.stderr and "Mixtral-8x7B" in r.stdout  # the table too
    out2 = tmp_path / "profile.json"
    r = run("profile", "moe", "--tokens", "1", "--json", str(out2))
    assert r.returncode == 0, r.stderr
    assert json.loads(out2.read_text())["rows"][0]["tokens"] == 1


@no_gpu_only
def test_linear_and_attention_benches_write_the_cpu_rows_to_a_json_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPGRAFT_TUNE_ATTENTION_MAX_BATCH", "4096")  # what the attention bench sets (kept here)
    out = tmp_path / "linear.json"
    rc, table, err = in_process(capsys, "bench", "linear", "--models", "Qwen3-30B-A3B", "--rows", "1,8",
                                "--json", str(out))
    assert rc == 0 and "rows written to" in err and "router" in table, err
    rows = json.loads(out.read_text())["rows"]
    assert [r["proj"] for r in rows] == ["qkv", "o", "router", "lm_head"]
    assert rows[0]["guard"] == {"1": "take", "8": "take"} and rows[0]["N"] == 5120
    out = tmp_path / "attention.json"
    rc, _, err = in_process(capsys, "bench", "attention", "--model", "Qwen3-30B-A3B", "--batch", "1", "--context",
                            "1024", "--json", str(out))
    assert rc == 0 and "rows written to" in err, err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["guard"] == "take" and row["heads_kv"] == 4


@no_gpu_only
def test_linear_bench_fp8_block_cpu_rows(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    rc, table, err = in_process(capsys, "bench", "linear", "--dtype", "fp8-block", "--models", "Qwen3-30B-A3B-FP8",
                                "--rows", "1,8", "--json", str(out))
    assert rc == 0 and "Qwen3-30B-A3B-FP8" in table, err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["proj"], r["N"], r["K"]) for r in rows] == [("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048)]
    assert all(r["dtype"] == "fp8-block" and r["guard"] == {"1": "take", "8": "take"} for r in rows)
    assert "bn=128 bk=128" in rows[0]["config"]
    rc, _, err = in_process(capsys, "bench", "linear", "--dtype", "fp8-block", "--models", "Qwen3-30B-A3B")
    assert rc == 2 and "takes names from Qwen3-30B-A3B-FP8, DeepSeek-V3" in err, err


@no_gpu_only
def test_bench_plot_without_gpu_says_it_is_not_written(tmp_path):
    r = run("bench", "moe", "--tokens", "1", "--plot", str(tmp_path / "p.png"))
    assert r.returncode == 0 and "p.png: not written: nothing is timed without a GPU" in r.stderr, r.stderr
    assert not (tmp_path / "p.png").exists()


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such" / "rows.json")
    for args in (["bench", "moe", "--json", missing], ["bench", "moe", "--plot", str(tmp_path / "no" / "p.png")],
                 ["bench", "moe", "--json", str(tmp_path)], ["profile", "moe", "--json", missing],
                 ["tune", "moe", "--out", missing]):
        rc, _, err = in_process(capsys, *args)
        assert rc == 2, (args, err)
        assert "no such directory" in err or "is a directory" in err, (args, err)
        assert "no GPU here" not in err and "read ceiling" not in err, (args, err)


def test_bench_writes_the_rows_measured_before_a_failure(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from opgraft import bench, cli
    from opgraft.bench import moe as moe_bench

    monkeypatch.setattr(cli, "_gpu_status", lambda: (True, ""))
    monkeypatch.setattr(bench, "measure_read_ceiling", lambda device: 4.5)
    monkeypatch.setattr(moe_bench, "make_weights", lambda *a, **k: (None, None))

    def bench_shape(shape, tokens, dtype, **kw):
        if tokens[0] == 2:
            raise RuntimeError("CUDA error: out of memory")
        return [{"model": shape.name, "dtype": dtype, "tokens": tokens[0], "impl": "opgraft", "median_us": 10.0,
                 "bytes": 1e6, "tbps": 0.1, "fraction_of_ceiling": 0.02, "speedup_vs_baseline": 1.0,
                 "rel_err": 1e-3, "guard": "take"}]

    monkeypatch.setattr(moe_bench, "bench_shape", bench_shape)
    out = tmp_path / "rows.json"
    assert cli.main(["bench", "moe", "--tokens", "1,2,4", "--json", str(out)]) == 1
    assert [row["tokens"] for row in json.loads(out.read_text())["rows"]] == [1]


def test_linear_and_attention_benches_keep_the_rows_measured_before_a_failure(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from opgraft import bench, cli
    from opgraft.bench import attention as attn_bench
    from opgraft.bench import linear as linear_bench

    monkeypatch.setattr(cli, "_gpu_status", lambda: (True, ""))
    monkeypatch.setattr(bench, "measure_read_ceiling", lambda device: 4.5)

    def bench_models(models, *a, **k):
        if models[0] != "Qwen3-30B-A3B":
            raise RuntimeError("CUDA error: out of memory")
        return [{"model": models[0], "proj": "qkv", "N": 5120, "K": 2048, "M": 1, "impl": "opgraft",
                 "median_us": 8.0, "bytes": 2.1e7, "tbps": 2.6, "fraction_of_ceiling": 0.57, "speedup": 1.1,
                 "rel_err": 1e-3, "guard": "take"}]

    def bench_rows(ceiling, points, *a, **k):
        (name, batch, context), = points
        if context != 1024:
            raise KeyboardInterrupt
        return [{"model": name, "batch": batch, "context": context, "impl": "opgraft", "median_us": 9.7,
                 "bytes": 1e6, "tbps": 0.1, "fraction_of_ceiling": 0.02, "rel_err": 1e-3}]

    monkeypatch.setattr(linear_bench, "bench_models", bench_models)
    monkeypatch.setattr(attn_bench, "bench_rows", bench_rows)
    out = tmp_path / "linear.json"
    assert cli.main(["bench", "linear", "--models", "Qwen3-30B-A3B,Llama-3-8B", "--json", str(out)]) == 1
    assert [r["model"] for r in json.loads(out.read_text())["rows"]] == ["Qwen3-30B-A3B"]
    out = tmp_path / "attention.json"
    assert cli.main(["bench", "attention", "--model", "Qwen3-30B-A3B", "--batch", "1", "--context", "1024,8192",
                     "--json", str(out)]) == 130
    assert [r["context"] for r in json.loads(out.read_text())["rows"]] == [1024]
    capsys.readouterr()
    missing = str(tmp_path / "no" / "such" / "rows.json")
    for op in ("linear", "attention"):
        rc, _, err = in_process(capsys, "bench", op, "--json", missing)
        assert rc == 2 and "no such directory" in err and "read ceiling" not in err, (op, err)


@no_gpu_only
def test_the_cpu_table_aligns_for_a_long_model_name(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"architectures": ["AVeryLongMixtureOfExpertsForCausalLM"], "num_experts": 4,
                             "hidden_size": 64, "moe_intermediate_size": 32, "num_experts_per_tok": 2}))
    r = run("bench", "moe", "--model", str(p), "--tokens", "1,2")
    assert r.returncode == 0, r.stderr
    head, *rows = [line for line in r.stdout.splitlines() if line.startswith(("model", "AVery"))]
    assert len(rows) == 2
    for line in rows:
        assert line.index(" bf16 ") == head.index(" dt ") and line.split()[2] in ("1", "2"), (head, line)


def test_the_gpu_table_aligns_for_a_long_model_name():
    pytest.importorskip("torch")
    from opgraft.bench import moe as bench

    row = {"model": "AVeryLongMixtureOfExpertsForCausalLM/tp2", "dtype": "bf16", "tokens": 1, "impl": "opgraft",
           "median_us": 30.0, "bytes": 1e8, "tbps": 3.0, "fraction_of_ceiling": 0.66, "speedup_vs_baseline": 1.2,
           "rel_err": 2.4e-3, "guard": "take"}
    head, _, line = bench.format_table([row, dict(row, model="M", impl="torch-gather-bmm")]).splitlines()[:3]
    assert line.index(" bf16 ") == head.index(" dt ") and line.split()[1] == "bf16"


def in_process(capsys, *args):
    """(exit status, stdout, stderr) of the command run in this process (no interpreter start)."""
    from opgraft import cli

    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _doctor_lines(capsys, monkeypatch, **env):
    for k in ("OPGRAFT_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OPGRAFT_DISABLE", "1")  # the seams' report is not what these check
    rc, out, err = in_process(capsys, "doctor")
    assert rc == 0, err
    return {line[:22].strip(): line[22:].strip() for line in out.splitlines() if len(line) > 22}


def test_doctor_reports_the_kernel_cache_as_the_library_sees_it(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    # A fresh machine: the library creates ~/.cache/opgraft and can write there.
    line = _doctor_lines(capsys, monkeypatch, HOME=str(home))["kernel cache"]
    assert line == f"{home}/.cache/opgraft (writable)", line
    assert (home / ".cache" / "opgraft").is_dir()
    f = tmp_path / "file"
    f.write_text("x")
    line = _doctor_lines(capsys, monkeypatch, HOME=str(home), OPGRAFT_CACHE_DIR=str(f))["kernel cache"]
    assert line.startswith(f"{f} (not usable: {f} is not a directory;") and "kept in memory only" in line, line
    for n in (950, 2000):  # too long for a cache file's path; too long for the library's buffer
        long = str(tmp_path) + "/d" * ((n - len(str(tmp_path))) // 2)
        line = _doctor_lines(capsys, monkeypatch, HOME=str(home), OPGRAFT_CACHE_DIR=long)["kernel cache"]
        assert "(not usable: the cache path is too long" in line, line
    # HOME unset: libopgraft still loads; the cache has no directory.
    lines = _doctor_lines(capsys, monkeypatch)
    assert lines["kernel cache"].startswith("none (not usable: no cache directory: set OPGRAFT_CACHE_DIR"), lines
    assert lines["libopgraft"].endswith(")") and "version" in lines["libopgraft"], lines["libopgraft"]


def test_a_config_that_is_not_utf8_is_one_clear_line(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_bytes(b'{"num_experts": 4, "hidden_size": 64, "name": "\xff"}')
    for args in (["doctor", "--model", str(p)], ["bench", "moe", "--model", str(p)],
                 ["profile", "moe", "--model", str(tmp_path)]):
        rc, _, err = in_process(capsys, *args)
        assert rc == 2 and "Traceback" not in err, (args, err)
        assert err.strip().splitlines()[-1] == f"error: {p}: not UTF-8 text (byte 0xff at offset 47): " \
                                               "not a Hugging Face config.json", err


@no_gpu_only
def test_model_takes_a_model_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["TinyMoe"], "num_experts": 4,
                                                      "hidden_size": 64, "moe_intermediate_size": 32,
                                                      "num_experts_per_tok": 2, "num_hidden_layers": 3}))
    rc, out, err = in_process(capsys, "bench", "moe", "--model", str(tmp_path), "--tokens", "1")
    assert rc == 0 and "TinyMoe" in out, err
    rc, out, err = in_process(capsys, "doctor", "--model", str(tmp_path))
    assert rc == 0 and "3 MoE layers" in out, out + err


def _help_entries(text):
    """{option header: its help text} of an argparse help page's options."""
    entries, key = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            head, _, rest = line.strip().partition("  ")
            key = head
            entries[key] = rest.strip()
        elif key and line.startswith("      "):
            entries[key] += " " + line.strip()
        elif not line.strip() or not line.startswith(" "):
            key = None
    return entries


@pytest.mark.parametrize("cmd", [["bench", "moe"], ["profile", "moe"], ["tune", "moe"], ["tune", "attention"],
                                 ["tune", "linear"], ["doctor"]],
                         ids=lambda c: " ".join(c))
def test_every_option_that_takes_a_value_says_its_default(cmd, capsys):
    from opgraft import cli

    with pytest.raises(SystemExit) as ei:
        cli.main([*cmd, "--help"])
    assert ei.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    # "--tokens TOKENS", "--dtype {bf16,fp16}", "--json [FILE]"; not "-h, --help" or a flag
    valued = {k: v for k, v in entries.items() if " " in k.split(", ")[-1]}
    assert valued, entries
    for opt, text in valued.items():
        assert "(default: " in text or "default: " in text, (opt, text)


def test_version(capsys):
    from opgraft import cli
    import opgraft

    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out.strip() == f"opgraft {opgraft.__version__}"


def test_bench_attention_without_gpu_reports_guard_and_compile():
    r = run("bench", "attention", "--model", "Qwen3-30B-A3B", "--batch", "1", "--context", "1024", "--json")
    assert r.returncode == 0, r.stderr
    assert "no GPU here" in r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    assert row["guard"] == "take" and row["heads_q"] == 32 and row["heads_kv"] == 4
    assert row["kernel"]["name"] == "attention_decode_bf16" and row["kernel"]["spill_bytes"] == 0
    r = run("bench", "attn", "--model", "32/4/96", "--batch", "2", "--context", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"][0]["guard"].startswith("delegate: head size 96")
    r = run("bench", "attention", "--model", "nonsense")
    assert r.returncode == 2 and "neither a preset" in r.stderr


def test_bench_attention_prologue(monkeypatch, capsys):
    """--prologue: without a GPU the guard and compile of the variant with q/k norm and rotary
    embedding; with one, the prologue rows with their own implementations."""
    r = run("bench", "attention", "--prologue", "--model", "Qwen3-30B-A3B", "--batch", "1", "--context", "1024",
            "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    assert row["guard"] == "take" and row["kernel"]["spill_bytes"] == 0
    pytest.importorskip("torch")
    from opgraft import bench, cli
    from opgraft.bench import attention as attn_bench

    monkeypatch.setattr(cli, "_gpu_status", lambda: (True, ""))
    monkeypatch.setattr(bench, "measure_read_ceiling", lambda device: 4.5)
    seen = []

    def bench_rows(ceiling, points, dtype, reps, between, hint, impls, progress=None, shapes=None, prologue=False):
        seen.append((impls, prologue))
        return []

    monkeypatch.setattr(attn_bench, "bench_rows", bench_rows)
    assert cli.main(["bench", "attention", "--prologue", "--model", "Qwen3-30B-A3B", "--batch", "1", "--context",
                     "1024"]) == 0
    assert seen == [(attn_bench.PROLOGUE_IMPLS, True)]
    rc, _, err = in_process(capsys, "bench", "attention", "--prologue", "--impls", "vllm-fa3")
    assert rc == 2 and "unknown --impls vllm-fa3" in err


def test_bench_attention_prologue_rows(monkeypatch, capsys):
    """--prologue-rows: without a GPU it says there is nothing to run (exit 0); with one, the
    prologue-alone rows of each model and row count, with their own implementations."""
    r = run("bench", "attention", "--prologue-rows", "128")
    assert r.returncode == 0 and "prologue-alone bench" in r.stderr, r.stderr
    r = run("bench", "attention", "--prologue-rows", "0")
    assert r.returncode == 2 and "--prologue-rows" in r.stderr
    pytest.importorskip("torch")
    from opgraft import bench, cli
    from opgraft.bench import attention as attn_bench

    monkeypatch.setattr(cli, "_gpu_status", lambda: (True, ""))
    monkeypatch.setattr(bench, "measure_read_ceiling", lambda device: 4.5)
    seen = []

    def alone(shape, rows, dtype, ceiling, reps, between, impls, progress=None):
        seen.append((shape.name, rows, impls))
        return []

    monkeypatch.setattr(attn_bench, "bench_prologue_alone", alone)
    assert cli.main(["bench", "attention", "--prologue-rows", "128,1024", "--model", "Qwen3-30B-A3B"]) == 0
    assert seen == [("Qwen3-30B-A3B", n, attn_bench.PROLOGUE_ALONE_IMPLS) for n in (128, 1024)]
    rc, _, err = in_process(capsys, "bench", "attention", "--prologue-rows", "8", "--impls", "opgraft-fused")
    assert rc == 2 and "unknown --impls opgraft-fused" in err


def test_doctor_says_what_happens_to_block_fp8_layers(capsys, monkeypatch):
    pytest.importorskip("vllm")
    for k in ("OPGRAFT_DISABLE", "OPGRAFT_LINEAR", "OPGRAFT_LINEAR_FP8"):
        monkeypatch.delenv(k, raising=False)
    for env, want in ((None, "ready: Fp8LinearMethod layers"), ("0", "off (OPGRAFT_LINEAR_FP8=0)")):
        if env is not None:
            monkeypatch.setenv("OPGRAFT_LINEAR_FP8", env)
        rc, out, err = in_process(capsys, "doctor")
        lines = {line[:22].strip(): line[22:].strip() for line in out.splitlines() if len(line) > 22}
        assert rc == 0 and lines["block-FP8 linear"].startswith(want), (out, err)


def test_doctor_says_whether_the_attention_prologue_is_on(capsys, monkeypatch):
    pytest.importorskip("vllm")
    for k in ("OPGRAFT_DISABLE", "OPGRAFT_ATTENTION", "OPGRAFT_ATTENTION_CACHE_WRITE", "OPGRAFT_ATTENTION_PROLOGUE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("OPGRAFT_NORM_FUSION_MOE", raising=False)
    for env, want in ((None, "ready: q/k RMSNorm and rotary embedding in the attention kernel (with the MoE norm form "
                             "where no q/k epilogue takes the graph; OPGRAFT_NORM_FUSION_MOE=1 turns both on)"),
                      ("0", "attention prologue off (OPGRAFT_ATTENTION_PROLOGUE=0)"),
                      ("1", "ready: q/k RMSNorm and rotary embedding in the attention kernel (every model")):
        if env is not None:
            monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", env)
        rc, out, err = in_process(capsys, "doctor")
        lines = {line[:22].strip(): line[22:].strip() for line in out.splitlines() if len(line) > 22}
        assert rc == 0 and lines["attention prologue"].startswith(want), (out, err)


@no_gpu_only
def test_a_missing_library_is_one_error_line_with_rc_1_in_every_command(tmp_path):
    env = {"OPGRAFT_LIBRARY": str(tmp_path / "libopgraft.so")}
    for args in (("bench", "moe", "--tokens", "1"), ("bench", "linear", "--models", "Qwen3-30B-A3B", "--rows", "1"),
                 ("bench", "attention", "--batch", "1", "--context", "16"), ("tune", "linear"),
                 ("doctor", "--model", "Qwen3-30B-A3B")):
        r = run(*args, env=env)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (args, r.returncode, r.stderr[-400:])
        assert r.stderr.strip().splitlines()[-1].startswith("error: libopgraft not found"), (args, r.stderr[-400:])


def test_a_reader_that_leaves_ends_the_command_quietly():
    """stdout a pipe whose reader has gone (`opgraft doctor | head -1`): rc 1, no traceback."""
    code = ("import os, sys\n"
            "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from opgraft import cli\n"
            "sys.exit(cli.main(['doctor']))\n")
    e = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OPGRAFT_DISABLE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-600:]


def test_vllms_log_lines_stay_off_stdout(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_STREAM", raising=False)
    in_process(capsys, "doctor")
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"


def test_a_config_over_16_mib_says_so(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text('{"num_experts": 8, "hidden_size": 64, "pad": "' + "x" * (1 << 24) + '"}')
    rc, _, err = in_process(capsys, "bench", "moe", "--model", str(p))
    assert rc == 2 and err.strip().splitlines()[-1] == f"error: {p}: larger than 16 MiB: not a Hugging Face config.json"


@no_gpu_only
def test_bench_attention_checks_its_options_without_a_gpu(capsys):
    for args, want in [(("--reps", "0"), "--reps must be at least 1"), (("--hint", "-5"), "--hint at least 0"),
                       (("--impls", "opgraft,nope"), "unknown --impls nope")]:
        rc, _, err = in_process(capsys, "bench", "attention", "--batch", "1", "--context", "16", *args)
        assert rc == 2 and want in err, (args, err[-300:])


def test_tune_refuses_an_out_file_it_could_not_merge_into_before_any_work(tmp_path, capsys):
    for text in (b"{", b"\xff\xfe", b'{"version": 1, "entries": [5]}', b'{"version": 1, "entries": [{"tokens": 5}]}',
                 b'{"version": 2, "entries": []}'):
        p = tmp_path / "tune.json"
        p.write_bytes(text)
        rc, _, err = in_process(capsys, "tune", "linear", "--out", str(p))
        assert rc == 2 and "refusing to overwrite it" in err and "Traceback" not in err, (text, err[-300:])
        assert p.read_bytes() == text


@no_gpu_only
def test_the_compile_report_of_a_shape_past_the_kernels_limits_is_its_short_reason(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_experts": 65536, "hidden_size": 4096, "moe_intermediate_size": 14336,
                             "num_experts_per_tok": 2}))
    rc, out, err = in_process(capsys, "bench", "moe", "--model", str(p), "--tokens", "1")
    assert rc == 0 and "65536 experts (1..4096 supported)" in out, out
    assert "NVRTC" not in out and "shape outside the kernel's limits" in out, out
