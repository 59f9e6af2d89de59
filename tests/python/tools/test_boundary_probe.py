"""tools/boundary_probe.cu (a GPU probe built with nvcc, not with the library) still compiles for
sm_90, so the NOTES figures it produced can be measured again. Skipped where nvcc is missing."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_boundary_probe_compiles_for_sm90(tmp_path):
    exe = tmp_path / "boundary_probe"
    r = subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(exe), os.path.join(ROOT, "tools", "boundary_probe.cu")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert exe.exists() and os.access(exe, os.X_OK)
