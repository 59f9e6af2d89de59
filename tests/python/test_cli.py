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
    r = run("bench", "moe", "--tokens", "1,x")
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
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


def probe(*args):
    e = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.run([sys.executable, "-m", "tools.probe", *args], capture_output=True, text=True,
                          env=e, timeout=300, cwd=ROOT)


@no_gpu_only
def test_probe_without_gpu_says_so():
    r = probe("--tokens", "1")
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr


def test_probe_bad_arguments_are_clear_errors():
    r = probe("--contexts", "bench,nope")
    assert r.returncode == 2 and "comma-separated list of bench" in r.stderr
    r = probe("--tokens", "0")
    assert r.returncode == 2 and "integers in 1..64" in r.stderr
    r = probe("--layers", "0")
    assert r.returncode == 2 and "--layers must be in 1..256" in r.stderr
    r = probe("--model", "nope")
    assert r.returncode == 2 and "nope" in r.stderr
