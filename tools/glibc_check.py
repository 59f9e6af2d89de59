"""Whether shared libraries (or the ones inside a wheel) install where manylinux_2_28 wheels do: no
glibc symbol version newer than 2.28, and only libraries every such system has. Reads the ELF
files itself (no readelf or auditwheel needed).

    python -m tools.glibc_check FILE.so|FILE.whl ...

Exit 0 when every file passes, 1 with the reasons otherwise; a wheel's platform tag must also be
manylinux_2_28_x86_64 (or an older manylinux).
"""

from __future__ import annotations

import re
import struct
import sys
import zipfile

MAX_GLIBC = (2, 28)
# The system libraries a manylinux_2_28 wheel may need (PEP 600's policy, the part a C library uses).
ALLOWED = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libgcc_s.so.1",
           "ld-linux-x86-64.so.2", "libutil.so.1", "libresolv.so.2"}
SHT_DYNAMIC, SHT_GNU_VERNEED, DT_NEEDED = 6, 0x6FFFFFFE, 1


def elf_needs(data: bytes) -> tuple[list[str], dict]:
    """(DT_NEEDED libraries, {library: [version names]}) of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(sec, off):
        start = sections[sec][4] + off
        return data[start:data.index(b"\0", start)].decode()

    needed, versions = [], {}
    for _name, typ, _flags, _addr, off, size, link, info, _align, entsize in sections:
        if typ == SHT_DYNAMIC:
            for k in range(0, size, entsize):
                tag, val = struct.unpack_from("<qQ", data, off + k)
                if tag == DT_NEEDED:
                    needed.append(string(link, val))
        elif typ == SHT_GNU_VERNEED:
            at = off
            for _ in range(info):  # sh_info: the number of Verneed entries
                _ver, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", data, at)
                names, a = [], at + aux
                for _ in range(cnt):
                    _hash, _flags, _other, name_off, anext = struct.unpack_from("<IHHII", data, a)
                    names.append(string(link, name_off))
                    a += anext
                versions[string(link, file_off)] = names
                if not nxt:
                    break
                at += nxt
    return needed, versions


def problems(data: bytes, name: str) -> list[str]:
    """What keeps one ELF file from a manylinux_2_28 wheel ([] when nothing)."""
    needed, versions = elf_needs(data)
    out = [f"{name}: needs {lib}, which a manylinux_2_28 system need not have" for lib in needed if lib not in ALLOWED]
    for lib, names in versions.items():
        for v in names:
            if v == "GLIBC_PRIVATE":
                out.append(f"{name}: needs GLIBC_PRIVATE from {lib} (glibc's internals, of one build only)")
            m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", v)
            if m and (int(m[1]), int(m[2])) > MAX_GLIBC:
                out.append(f"{name}: needs {v} from {lib} (newer than glibc {MAX_GLIBC[0]}.{MAX_GLIBC[1]})")
    return out


def max_glibc(data: bytes) -> str:
    _, versions = elf_needs(data)
    vs = [tuple(int(x) for x in v[6:].split(".")) for names in versions.values() for v in names
          if re.fullmatch(r"GLIBC_[\d.]+", v)]
    return "GLIBC_" + ".".join(map(str, max(vs))) if vs else "none"


def wheel_problems(path: str) -> list[str]:
    out = []
    with zipfile.ZipFile(path) as z:
        wheel_meta = [n for n in z.namelist() if n.endswith(".dist-info/WHEEL")]
        tags = [line.split(":", 1)[1].strip() for n in wheel_meta for line in z.read(n).decode().splitlines()
                if line.startswith("Tag:")]
        for t in tags:
            m = re.fullmatch(r"[^-]+-[^-]+-manylinux_(\d+)_(\d+)_x86_64", t)
            if not m or (int(m[1]), int(m[2])) > MAX_GLIBC:
                out.append(f"{path}: tag {t} is not manylinux_2_28_x86_64 or older")
        if not tags:
            out.append(f"{path}: no Tag in its WHEEL file")
        for n in z.namelist():
            if re.search(r"\.so(\.\d+)*$", n):
                out += problems(z.read(n), f"{path}!{n}")
    return out


def main(argv=None) -> int:
    files = sys.argv[1:] if argv is None else argv
    if not files or any(f in ("-h", "--help") for f in files):
        print(__doc__.strip())
        return 0 if files else 2
    bad = []
    for f in files:
        try:
            if f.endswith(".whl"):
                found = wheel_problems(f)
                if not found:
                    print(f"{f}: tag and libraries fit manylinux_2_28_x86_64")
            else:
                with open(f, "rb") as fh:
                    data = fh.read()
                found = problems(data, f)
                if not found:
                    print(f"{f}: needs at most {max_glibc(data)}: fits manylinux_2_28_x86_64")
        except (OSError, ValueError, zipfile.BadZipFile, struct.error) as e:
            found = [f"{f}: cannot read it as ELF or wheel ({e})"]
        bad += found
    for b in bad:
        print(b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
