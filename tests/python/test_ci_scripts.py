"""The CI scripts: what ci/test-deps.sh installs is announced with its command, and .ci/run runs
the README check before ending with the README's test command."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_test_deps_says_what_it_installs_and_how(tmp_path):
    """With cmocka and pytest missing (fake tools on PATH), the script names each package and
    prints each install command before running it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    _fake(bin_dir / "pkg-config", "exit 1\n")
    _fake(bin_dir / "id", "echo 0\n")
    _fake(bin_dir / "apt-get", f'echo "apt-get $*" >> {log}\n')
    cc = _fake(tmp_path / "cc", "exit 1\n")
    python = _fake(tmp_path / "python", f'[ "$1" = -c ] && exit 1\necho "python $*" >> {log}\n')
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CC=cc, PYTHON=python)
    r = subprocess.run(["bash", os.path.join(ROOT, "ci", "test-deps.sh")], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "installing the system package libcmocka-dev with apt-get" in r.stdout
    assert "+ env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcmocka-dev" in r.stdout
    assert "pytest is missing: installing it" in r.stdout and f"+ {python} -m pip install pytest>=7" in r.stdout
    assert log.read_text().splitlines() == ["apt-get install -y -q libcmocka-dev", "python -m pip install pytest>=7"]


def test_test_deps_installs_nothing_when_all_is_present(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir / "pkg-config", "exit 0\n")
    _fake(bin_dir / "apt-get", "exit 1\n")
    python = _fake(tmp_path / "python", '[ "$1" = -c ] && exit 0\nexit 1\n')
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=python)
    r = subprocess.run(["bash", os.path.join(ROOT, "ci", "test-deps.sh")], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and "+ " not in r.stdout, r.stdout + r.stderr
    assert "cmocka present" in r.stdout and "pytest present" in r.stdout


def test_pyproject_declares_torch_unpinned():
    """`pip install .` brings torch for the op layer, with no version bound that could make pip
    replace the torch a vLLM install already has."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import pytest

        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert "torch" in deps, deps


def test_ci_runs_the_readme_check_then_ends_with_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme.split("```")[1].splitlines()[1:]  # the first code block, after its language tag
    test_cmd = re.sub(r"\s*#.*$", "", block[1]).strip()
    assert test_cmd == "make test" and lines[-1] == test_cmd, (test_cmd, lines[-1])
    assert "bash ci/readme_check.sh" in lines and lines.index("bash ci/readme_check.sh") < len(lines) - 1


def test_the_readme_check_never_runs_inside_itself():
    r = subprocess.run(["bash", os.path.join(ROOT, "ci", "readme_check.sh")], capture_output=True, text=True,
                       env=dict(os.environ, OPGRAFT_README_CHECK="1"), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "readme check: skipped (already inside one)", r.stdout + r.stderr
