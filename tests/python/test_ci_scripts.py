"""The CI scripts: what ci/test-deps.sh installs is announced with its command, .ci/run runs the
README check before ending with the README's test command, and ci/install_newest.py installs the
newest vLLM with its overrides."""

import os
import re
import subprocess

import pytest

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


def _install_newest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("install_newest", os.path.join(ROOT, "ci", "install_newest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _newest_files(tmp_path, reqs, overrides):
    r, o = tmp_path / "reqs.txt", tmp_path / "over.txt"
    r.write_text(reqs)
    o.write_text(overrides)
    return [str(r), str(o)]


def test_install_newest_puts_the_override_in_vllms_pin_place(tmp_path, monkeypatch):
    """vLLM's requirements are installed with the overridden line in place of its own (extras'
    lines dropped, the file's other lines kept), then the downloaded wheel without dependencies."""
    m = _install_newest()
    calls, written = [], []

    def run(cmd, check=False):
        calls.append(cmd[len(m.PIP):])
        if "-r" in cmd:
            written.append(open(cmd[cmd.index("-r") + 1]).read().splitlines())
        return subprocess.CompletedProcess(cmd, 0)

    requires = ["torch==2.14.0", "flashinfer-python==0.7.3", 'zentorch==2.14.0.2; extra == "zen"',
                "numpy; python_version >= '3.9'"]
    monkeypatch.setattr(m.subprocess, "run", run)
    monkeypatch.setattr(m, "_vllm_requires", lambda version, tmp: (requires, f"{tmp}/vllm-{version}-x.whl"))
    argv = _newest_files(tmp_path, "# newest\nvllm==0.34.0\npytest>=7\n", "# why\nFlashinfer_Python==0.7.4\n")
    assert m.main(argv) == 0
    assert written == [["torch==2.14.0", "Flashinfer_Python==0.7.4", "numpy; python_version >= '3.9'", "pytest>=7"]]
    assert calls[0][:3] == ["install", "-q", "-r"]
    assert calls[1][:3] == ["install", "-q", "--no-deps"] and calls[1][3].endswith("vllm-0.34.0-x.whl")


def test_install_newest_refuses_an_override_vllm_does_not_need(tmp_path, monkeypatch):
    m = _install_newest()
    monkeypatch.setattr(m.subprocess, "run", lambda *a, **k: pytest.fail("nothing may be installed"))
    monkeypatch.setattr(m, "_vllm_requires", lambda version, tmp: (["torch==2.14.0"], None))
    argv = _newest_files(tmp_path, "vllm==0.34.0\n", "flashinfer-python==0.7.4\n")
    with pytest.raises(SystemExit, match="does not require flashinfer-python: drop the override"):
        m.main(argv)
    with pytest.raises(SystemExit, match="one exact vllm==VERSION line"):
        m.main(_newest_files(tmp_path, "vllm>=0.34\n", "flashinfer-python==0.7.4\n"))


def test_install_newest_without_overrides_is_pip_install_r(tmp_path, monkeypatch):
    m = _install_newest()
    calls = []
    monkeypatch.setattr(m.subprocess, "run", lambda cmd, check=False: calls.append(cmd[len(m.PIP):]) or
                        subprocess.CompletedProcess(cmd, 0))
    argv = _newest_files(tmp_path, "vllm==0.35.0\npytest>=7\n", "# nothing to replace\n")
    assert m.main(argv) == 0 and calls == [["install", "-q", "-r", argv[0]]]


def test_newest_requirements_pin_one_vllm_that_ci_expects():
    """.ci/run reads the expected version with sed from the same file the installer pins."""
    m = _install_newest()
    reqs = m._lines(os.path.join(ROOT, "ci", "requirements-newest.txt"))
    pins = [r for r in reqs if m._name(r) == "vllm"]
    assert len(pins) == 1 and re.fullmatch(r"vllm==[0-9.]+", pins[0]), pins
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "ci/install_newest.py ci/requirements-newest.txt ci/newest-overrides.txt" in f.read()


def test_make_test_builds_the_c_tests_and_fails_without_any():
    """An earlier `cmake -DOPGRAFT_BUILD_TESTS=OFF` of the build folder must not make `make test` pass
    with no C test run."""
    r = subprocess.run(["make", "-n", "test", "BUILD=/nonexistent-build"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    cmds = r.stdout.splitlines()
    configure = [c for c in cmds if c.startswith("cmake -S")]
    ctests = [c for c in cmds if c.startswith("ctest")]
    assert configure and all("-DOPGRAFT_BUILD_TESTS=ON" in c for c in configure), configure
    assert len(ctests) == 2 and all("--no-tests=error" in c for c in ctests), ctests
