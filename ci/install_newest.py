"""Install the newest vLLM's environment for CI's plugin tests (run with that environment's python).

    python ci/install_newest.py ci/requirements-newest.txt ci/newest-overrides.txt

Without overrides this is `pip install -r REQUIREMENTS`. With them, the pinned vLLM's own
requirements are installed with each overridden distribution's line in place of vLLM's (a pin
that has no files on PyPI), then vLLM itself without its dependencies. An environment that already
has that vLLM is brought up to the same requirements without downloading it again.
"""
import email.parser
import glob
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
import zipfile

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return [r for r in (ln.split("#", 1)[0].strip() for ln in f) if r]


def _name(req: str) -> str:
    """The normalized distribution name at the start of a requirement (PEP 503)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise SystemExit(f"install_newest: cannot read a distribution name in {req!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _vllm_requires(version: str, tmp: str) -> tuple[list[str], str | None]:
    """vLLM's Requires-Dist lines and the wheel to install (None: that version is installed)."""
    try:
        if md.version("vllm") == version:
            return md.requires("vllm") or [], None
    except md.PackageNotFoundError:
        pass
    subprocess.run(PIP + ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, f"vllm=={version}"],
                   check=True)
    wheels = glob.glob(os.path.join(tmp, f"vllm-{version}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"install_newest: expected one vllm {version} wheel, found {wheels}")
    with zipfile.ZipFile(wheels[0]) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return msg.get_all("Requires-Dist") or [], wheels[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    reqs, overrides = _lines(argv[0]), _lines(argv[1])
    if not overrides:
        return subprocess.run(PIP + ["install", "-q", "-r", argv[0]]).returncode
    pins = [r for r in reqs if _name(r) == "vllm"]
    version = pins[0].partition("==")[2].strip() if len(pins) == 1 else ""
    if not re.fullmatch(r"[0-9][0-9A-Za-z.+]*", version):
        raise SystemExit(f"install_newest: overrides need one exact vllm==VERSION line in {argv[0]}")
    by_name = {_name(o): o for o in overrides}
    with tempfile.TemporaryDirectory() as tmp:
        requires, wheel = _vllm_requires(version, tmp)
        # Extras' requirements (marker `extra == ...`) are not vLLM's own.
        deps = [r for r in requires if not re.search(r"\bextra\s*==", r)]
        missing = set(by_name) - {_name(d) for d in deps}
        if missing:
            raise SystemExit(f"install_newest: vllm {version} does not require {', '.join(sorted(missing))}: "
                             "drop the override")
        deps = [by_name.get(_name(d), d) for d in deps] + [r for r in reqs if _name(r) != "vllm"]
        req_file = os.path.join(tmp, "requirements.txt")
        with open(req_file, "w") as f:
            f.write("\n".join(deps) + "\n")
        subprocess.run(PIP + ["install", "-q", "-r", req_file], check=True)
        if wheel:
            subprocess.run(PIP + ["install", "-q", "--no-deps", wheel], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
