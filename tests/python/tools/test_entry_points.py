"""Every command, run where torch (and vLLM) cannot be imported: one clear line and a non-zero exit
where it needs them, its help and its CPU path where it does not; never a traceback. torch is
hidden by an import hook, so these run the same whether it is installed or not."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

HIDE = """
import runpy, sys
class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Hidden())
mod = sys.argv[1]
sys.argv = [mod] + sys.argv[2:]
runpy.run_module(mod, run_name="__main__", alter_sys=True)
"""


def run_hidden(module, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
    return subprocess.run([sys.executable, "-c", HIDE, module, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


NEEDS_TORCH = [
    ("tools.probe", "--tokens", "1"),
    ("tools.trace", "--tokens", "1"),
    ("tools.gpucheck", "--quick"),
    ("tools.e2e", "run", "--mode", "opgraft"),
    ("tools.sweep", "--tokens", "1"),
    ("tools.read_sizes",),
    ("tools.attn_o",),
    ("tools.moe_route",),
]


@pytest.mark.parametrize("cmd", NEEDS_TORCH, ids=[c[0] + " " + c[1] if len(c) > 1 else c[0] for c in NEEDS_TORCH])
def test_a_tool_without_torch_says_so_in_one_line(cmd):
    r = run_hidden(*cmd)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs torch" in lines[0] and "pip install torch" in lines[0], r.stderr


@pytest.mark.parametrize("module", ["tools.probe", "tools.trace", "tools.gpucheck", "tools.e2e", "tools.sweep",
                                    "tools.read_sizes", "tools.attn_o", "tools.moe_route",
                                    "opgraft.cli"])
def test_help_works_without_torch(module):
    r = run_hidden(module, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout and not r.stderr, r.stderr


@pytest.mark.parametrize("args", [("--variants", "pdl9"), ("--extra", "x=linear.pdl"), ("--extra", "=linear.pdl:1")])
def test_attn_o_refuses_bad_variants_before_torch(args):
    r = run_hidden("tools.attn_o", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "tools.attn_o: error:" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [("--extra", "x=moe.pdl_in"), ("--extra", "=moe.pdl_in:1"),
                                  ("--extra", "x=moe.pdl_in:1@kernel")])
def test_moe_route_refuses_bad_extras_before_torch(args):
    r = run_hidden("tools.moe_route", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "tools.moe_route: error:" in r.stderr, r.stderr


def test_the_cli_without_torch():
    r = run_hidden("opgraft.cli", "tune", "moe", "--tokens", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "torch is not installed" in r.stderr, r.stderr
    r = run_hidden("opgraft.cli", "bench", "moe", "--tokens", "1", "--no-baseline")
    assert r.returncode == 0 and "no GPU here (torch is not installed)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = run_hidden("opgraft.cli", "profile", "moe", "--tokens", "1")
    assert r.returncode == 0 and "no GPU here (torch is not installed)" in r.stderr, r.stderr
    r = run_hidden("opgraft.cli", "doctor")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "torch" in r.stdout and "not installed" in r.stdout
