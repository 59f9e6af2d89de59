"""The wheel installs where vLLM's manylinux_2_28 wheels do: libopgraft needs no glibc symbol
version newer than 2.28 and only the system libraries every such system has, and the wheel is
tagged so (tools/glibc_check.py reads the ELF files itself)."""

import os
import platform
import shutil
import subprocess

import pytest

from opgraft import _lib
from tools import glibc_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
linux_x86_64 = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                                  reason="the manylinux_2_28_x86_64 build is for Linux x86_64")


@linux_x86_64
def test_libopgraft_needs_no_glibc_newer_than_2_28():
    path = _lib.lib()._name
    with open(path, "rb") as f:
        data = f.read()
    assert glibc_check.problems(data, path) == []
    needed, versions = glibc_check.elf_needs(data)
    assert "libc.so.6" in needed and "GLIBC_2.2.5" in versions["libc.so.6"]
    # dlopen and pthread_once come from where glibc 2.28 has them.
    assert "libdl.so.2" in needed and "libpthread.so.0" in needed


@linux_x86_64
def test_the_check_sees_a_library_built_against_a_newer_glibc(tmp_path):
    """A library that calls dlopen, built here without care: on a glibc >= 2.34 host it needs
    GLIBC_2.34, and the check must say so."""
    libc = platform.libc_ver()
    cc = shutil.which("cc") or shutil.which("gcc")
    if libc[0] != "glibc" or tuple(int(x) for x in libc[1].split(".")[:2]) < (2, 34) or not cc:
        pytest.skip("needs a C compiler and glibc >= 2.34")
    src = tmp_path / "x.c"
    src.write_text("#include <dlfcn.h>\nvoid *f(const char *p) { return dlopen(p, RTLD_NOW); }\n")
    so = tmp_path / "libx.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src)], check=True, capture_output=True)
    found = glibc_check.problems(so.read_bytes(), "libx.so")
    assert any("GLIBC_2.34" in p for p in found), found
    assert glibc_check.main([str(so)]) == 1


def test_the_wheel_is_tagged_manylinux_2_28_on_linux_x86_64():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        skb = tomllib.load(f)["tool"]["scikit-build"]
    linux = [o for o in skb.get("overrides", []) if o.get("if", {}).get("platform-machine") == "^x86_64$"
             and o["if"].get("platform-system") == "^linux$"]
    assert linux and linux[0]["wheel"]["tags"] == ["py3-none-manylinux_2_28_x86_64"], skb.get("overrides")


def test_a_wheel_with_the_wrong_tag_is_refused(tmp_path):
    import zipfile

    whl = tmp_path / "x-1-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("x-1.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-linux_x86_64\n")
    assert glibc_check.wheel_problems(str(whl)) == [f"{whl}: tag py3-none-linux_x86_64 is not manylinux_2_28_x86_64 "
                                                    "or older"]
