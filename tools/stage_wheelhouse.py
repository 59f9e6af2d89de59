#!/usr/bin/env python3
"""Stage a Python wheelhouse for an air-gapped host whose file transfers are size-limited.

Runs on a machine WITH package-index access (Python 3.9+, standard library only; pip is called as
a program). It resolves a requirement such as ``vllm==0.26.0`` for the TARGET interpreter and
platform (not this machine's), downloads the wheels the target lacks, packs them into one tar,
splits the tar into parts of at most ``--part-size`` bytes and writes a manifest with the sha256 of
every wheel, of the tar and of every part. ``unstage_wheelhouse.sh`` (beside this file, copied
into the parts folder) checks and installs them on the target. docs/AIRGAP.md is the user guide.

Subcommands::

    build  resolve, download the chosen wheels with pip, pack + split -> DIR/parts/, manifest.json
    plan   the same resolution, printed (names, versions, sizes, part count); nothing downloaded
    pack   pack + split an existing folder of wheels (no resolution)
    resplit  cut staged parts into parts of another size (every part and the tar checked)

How it resolves. pip's own resolver cannot be told "the target already has torch": it would
download torch, triton and the CUDA wheels again. So the resolution is done here, with the
backtracking engine pip itself uses (resolvelib, vendored in pip) over the index's metadata
(PEP 691 JSON listing; each wheel's METADATA from its PEP 658 ``.metadata`` file, else read out of
the remote zip with HTTP Range requests, a few KiB each). A dependency's ``Requires-Dist`` line
counts when its environment marker holds for the target (python_version, sys_platform,
platform_machine, ...; ``extra == "x"`` only where a parent asked for ``[x]``). A name on the
have-list is cut from the graph: never downloaded, its own dependencies not followed; where the
have-list gives its version, that version is the only candidate, so the resolver picks releases
of the other packages that accept it (and, if none can, resolves without it and reports the
conflict). A name matched by ``--exclude`` is cut the same way and listed as dropped with the
reason given. ``build`` then fetches each chosen ``name==version`` with
``pip download --no-deps --only-binary=:all: --python-version ... --platform ...`` (in parallel)
and checks that pip delivered that version.

Only the standard library and pip are needed (``packaging`` and ``resolvelib`` are taken from
pip's vendored copies when not installed).

Exit status: 0 on success, 1 on a resolution/download error, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import email.parser
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

TOOL_VERSION = 1
PART_PREFIX = "wheelhouse.tar.part"
TAR_NAME = "wheelhouse.tar"
MANIFEST_NAME = "manifest.json"
UNSTAGE_SCRIPT = "unstage_wheelhouse.sh"
ROOT_PARENT = "<requirement>"


# --------------------------------------------------------------------------------------------
# Names, versions
# --------------------------------------------------------------------------------------------

def normalize(name: str) -> str:
    """PEP 503 normalized project name: lowercase, runs of -_. become one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


_VERSION_RE = re.compile(
    r"^\s*v?(?:(?P<epoch>\d+)!)?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre_l>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>\d*))?"
    r"(?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d*))?"
    r"(?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d*))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?\s*$",
    re.IGNORECASE,
)


def version_key(text: str) -> Optional[tuple]:
    """A sort key for a PEP 440 version, or None when ``text`` is not one.

    Enough for environment markers and for ordering: epoch, release (trailing zeros ignored),
    pre-release < final < post-release, dev releases first.  Local labels are ignored.
    """
    m = _VERSION_RE.match(text)
    if not m:
        return None
    release = [int(x) for x in m.group("release").split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre_rank = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
    if m.group("pre_l"):
        pre = (pre_rank[m.group("pre_l").lower()], int(m.group("pre_n") or 0))
    elif m.group("dev_l") and not (m.group("post_l") or m.group("post_n1")):
        pre = (-1, 0)  # 1.0.dev1 < 1.0a1
    else:
        pre = (3, 0)  # final
    post_n = m.group("post_n1") or m.group("post_n2")
    post = int(post_n or 0) if (m.group("post_l") or m.group("post_n1")) else -1
    dev = int(m.group("dev_n") or 0) if m.group("dev_l") else float("inf")
    return (int(m.group("epoch") or 0), tuple(release), pre, post, dev)


def _release(text: str) -> List[int]:
    m = _VERSION_RE.match(text)
    return [int(x) for x in m.group("release").split(".")] if m else []


# --------------------------------------------------------------------------------------------
# Environment markers (PEP 508), a small evaluator of our own
# --------------------------------------------------------------------------------------------

class MarkerError(ValueError):
    pass


_MARKER_VARS = {
    "python_version", "python_full_version", "os_name", "sys_platform", "platform_release",
    "platform_system", "platform_version", "platform_machine", "platform_python_implementation",
    "implementation_name", "implementation_version", "extra",
    # legacy spellings (PEP 345 / setuptools) that still appear in old metadata
    "os.name", "sys.platform", "platform.version", "platform.machine",
    "platform.python_implementation", "python_implementation",
}
_LEGACY = {
    "os.name": "os_name", "sys.platform": "sys_platform", "platform.version": "platform_version",
    "platform.machine": "platform_machine",
    "python_implementation": "platform_python_implementation",
    "platform.python_implementation": "platform_python_implementation",
}
_TOKEN_RE = re.compile(
    r"""\s*(?:(?P<str>'[^']*'|"[^"]*")|(?P<op>===|==|!=|<=|>=|~=|<|>)|(?P<lp>\()|(?P<rp>\))"""
    r"""|(?P<word>[A-Za-z_][A-Za-z0-9_.]*))"""
)


def _tokenize(text: str) -> List[Tuple[str, str]]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            raise MarkerError("cannot parse marker %r at %r" % (text, text[pos:]))
        pos = m.end()
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "word":
            if value in ("and", "or", "in", "not"):
                kind = value
            elif value in _MARKER_VARS:
                kind = "var"
            else:
                raise MarkerError("unknown marker variable %r in %r" % (value, text))
        tokens.append((kind, value))
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return tokens


def _compare(lhs: str, op: str, rhs: str, version_like: bool) -> bool:
    if op in ("in", "not in"):
        return (lhs in rhs) == (op == "in")
    if op == "===":
        return lhs == rhs
    if version_like:
        wildcard = rhs.endswith(".*")
        if wildcard and op in ("==", "!="):
            want = _release(rhs[:-2])
            have = _release(lhs)
            same = have[: len(want)] + [0] * max(0, len(want) - len(have)) == want
            return same == (op == "==")
        lk, rk = version_key(lhs), version_key(rhs)
        if lk is not None and rk is not None:
            if op == "~=":
                want = _release(rhs)
                if len(want) < 2:
                    raise MarkerError("~= needs at least two release segments: %r" % rhs)
                return lk >= rk and _release(lhs)[: len(want) - 1] == want[:-1]
            return {"==": lk == rk, "!=": lk != rk, "<": lk < rk, "<=": lk <= rk,
                    ">": lk > rk, ">=": lk >= rk}[op]
    if op == "==":
        return lhs == rhs
    if op == "!=":
        return lhs != rhs
    # PEP 508: ordering operators on non-versions fall back to string comparison only for
    # python_* fields in old tools; treat them as plain string comparisons like packaging<22.
    return {"<": lhs < rhs, "<=": lhs <= rhs, ">": lhs > rhs, ">=": lhs >= rhs,
            "~=": False}[op]


def evaluate_marker(marker: str, env: Dict[str, str]) -> bool:
    """Evaluate a PEP 508 marker string against ``env`` (a dict of marker variables).

    ``extra`` is compared by normalized name.  Supports and/or/parentheses, all comparison
    operators, ``in`` / ``not in`` and the legacy dotted variable names.
    """
    tokens = _tokenize(marker)
    pos = 0

    def peek(k: int = 0) -> Optional[Tuple[str, str]]:
        return tokens[pos + k] if pos + k < len(tokens) else None

    def take() -> Tuple[str, str]:
        nonlocal pos
        if pos >= len(tokens):
            raise MarkerError("unexpected end of marker %r" % marker)
        pos += 1
        return tokens[pos - 1]

    def value(tok: Tuple[str, str]) -> Tuple[str, Optional[str]]:
        kind, text = tok
        if kind == "str":
            return text[1:-1], None
        if kind == "var":
            var = _LEGACY.get(text, text)
            return env.get(var, ""), var
        raise MarkerError("expected a variable or a string in %r" % marker)

    def expr() -> bool:
        tok = peek()
        if tok and tok[0] == "lp":
            take()
            result = or_expr()
            if take()[0] != "rp":
                raise MarkerError("missing ')' in %r" % marker)
            return result
        lhs, lvar = value(take())
        op_tok = take()
        if op_tok[0] == "op":
            op = op_tok[1]
        elif op_tok[0] == "in":
            op = "in"
        elif op_tok[0] == "not" and peek() and peek()[0] == "in":
            take()
            op = "not in"
        else:
            raise MarkerError("expected an operator in %r" % marker)
        rhs, rvar = value(take())
        if "extra" in (lvar, rvar):
            lhs, rhs = normalize(lhs), normalize(rhs)
        version_vars = {"python_version", "python_full_version", "implementation_version",
                        "platform_release"}
        version_like = bool({lvar, rvar} & version_vars)
        return _compare(lhs, op, rhs, version_like)

    def and_expr() -> bool:
        result = expr()
        while peek() and peek()[0] == "and":
            take()
            rhs = expr()
            result = result and rhs
        return result

    def or_expr() -> bool:
        result = and_expr()
        while peek() and peek()[0] == "or":
            take()
            rhs = and_expr()
            result = result or rhs
        return result

    result = or_expr()
    if pos != len(tokens):
        raise MarkerError("trailing text in marker %r" % marker)
    return result


def target_environment(python_version: str, machine: str = "x86_64",
                       system: str = "Linux") -> Dict[str, str]:
    """Marker variables for a CPython target (python_version like '3.12' or '3.12.3')."""
    parts = python_version.split(".")
    short = ".".join(parts[:2])
    full = python_version if len(parts) >= 3 else short + ".0"
    return {
        "python_version": short,
        "python_full_version": full,
        "os_name": "posix" if system != "Windows" else "nt",
        "sys_platform": {"Linux": "linux", "Darwin": "darwin",
                         "Windows": "win32"}.get(system, system.lower()),
        "platform_system": system,
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
        "platform_python_implementation": "CPython",
        "implementation_name": "cpython",
        "implementation_version": full,
        "extra": "",
    }


def machine_from_platform(tag: str) -> str:
    for arch in ("x86_64", "aarch64", "ppc64le", "s390x", "armv7l", "i686"):
        if tag.endswith(arch):
            return arch
    return tag.rsplit("_", 1)[-1]


# --------------------------------------------------------------------------------------------
# Requirements (PEP 508)
# --------------------------------------------------------------------------------------------

_REQ_RE = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*"
    r"(?:\[(?P<extras>[^\]]*)\])?\s*"
    r"(?:@\s*(?P<url>[^\s;]+)\s*|(?P<spec>\(?[^;()]*\)?))?\s*"
    r"(?:;\s*(?P<marker>.*))?$"
)


@dataclass
class Requirement:
    name: str                      # as written
    specs: List[str]               # individual clauses, e.g. ['>=1.0', '<2']
    extras: Set[str]               # normalized
    marker: Optional[str] = None
    url: Optional[str] = None

    @property
    def key(self) -> str:
        return normalize(self.name)


def parse_requirement(text: str) -> Requirement:
    m = _REQ_RE.match(text)
    if not m:
        raise ValueError("cannot parse requirement %r" % text)
    spec = (m.group("spec") or "").strip()
    if spec.startswith("(") and spec.endswith(")"):
        spec = spec[1:-1]
    specs = [s.replace(" ", "") for s in spec.split(",") if s.strip()]
    extras = {normalize(e.strip()) for e in (m.group("extras") or "").split(",") if e.strip()}
    marker = (m.group("marker") or "").strip() or None
    return Requirement(m.group("name"), specs, extras, marker, m.group("url"))


def marker_applies(req: Requirement, env: Dict[str, str], extras: Iterable[str] = ()) -> bool:
    """True if ``req`` is needed on the target when its parent was asked for ``extras``.

    A line with no marker always applies; otherwise it applies if it holds with extra="" or
    with any one of the requested extras (so ``extra == "x"`` lines count only when x is asked).
    """
    if not req.marker:
        return True
    for extra in [""] + sorted(extras):
        if evaluate_marker(req.marker, dict(env, extra=extra)):
            return True
    return False


# --------------------------------------------------------------------------------------------
# Optional packaging (for specifier checks and plan); pip always vendors a copy
# --------------------------------------------------------------------------------------------

def _import_packaging():
    try:
        from packaging.specifiers import SpecifierSet  # type: ignore
        from packaging.version import Version  # type: ignore
        from packaging import tags as ptags  # type: ignore
        return SpecifierSet, Version, ptags
    except Exception:
        pass
    try:
        from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore
        from pip._vendor.packaging.version import Version  # type: ignore
        from pip._vendor.packaging import tags as ptags  # type: ignore
        return SpecifierSet, Version, ptags
    except Exception:
        return None


def spec_satisfied(version: Optional[str], specs: Iterable[str]) -> Optional[bool]:
    """True/False if ``version`` satisfies all ``specs``; None when that cannot be decided
    (version unknown, or no packaging library importable)."""
    specs = [s for s in specs if s]
    if not specs:
        return True
    if not version:
        return None
    pk = _import_packaging()
    if pk is None:
        return None
    SpecifierSet = pk[0]
    try:
        return SpecifierSet(",".join(specs)).contains(version, prereleases=True)
    except Exception:
        return None


# --------------------------------------------------------------------------------------------
# Have-list (what the target already has) and excludes
# --------------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


def parse_have_text(text: str) -> Dict[str, Optional[str]]:
    """Names (and versions where given) of packages the target already has.

    Accepts any of: ``pip freeze`` / ``pip list --format=freeze`` lines (name==version,
    ``name @ url``), ``pip list`` columns (name version, header lines ignored),
    ``pip list --format=json``, or names separated by commas, spaces or newlines.
    ``#`` starts a comment.
    """
    text = text.strip()
    have: Dict[str, Optional[str]] = {}
    if text.startswith("["):
        for row in json.loads(text):
            have[normalize(row["name"])] = row.get("version")
        return have
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or set(line) <= set("-= "):
            continue
        if " @ " in line:
            have[normalize(line.split(" @ ", 1)[0].strip())] = None
            continue
        cols = line.split()
        if (len(cols) >= 2 and "," not in line and "==" not in line and _NAME_RE.match(cols[0])
                and version_key(cols[1]) is not None):
            have[normalize(cols[0])] = cols[1]  # pip list: name version [location]
            continue
        if cols[:2] == ["Package", "Version"]:
            continue
        for item in re.split(r"[,\s]+", line):
            item = item.strip().rstrip(".")
            if not item:
                continue
            if "==" in item:
                name, ver = item.split("==", 1)
                have[normalize(name)] = ver.strip() or None
            elif _NAME_RE.match(item):
                have.setdefault(normalize(item), None)
    return have


def load_have(values: Iterable[str]) -> Dict[str, Optional[str]]:
    """Each value is a file (see parse_have_text) or a literal comma-separated list."""
    have: Dict[str, Optional[str]] = {}
    for value in values:
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as fh:
                parsed = parse_have_text(fh.read())
        else:
            parsed = parse_have_text(value)
        for name, ver in parsed.items():
            if ver or name not in have:
                have[name] = ver
    return have


def parse_excludes(values: Iterable[str]) -> List[Tuple[str, str]]:
    """``PATTERN`` or ``PATTERN=REASON``; PATTERN is a glob over normalized names."""
    out = []
    for value in values:
        pattern, _, reason = value.partition("=")
        out.append((normalize(pattern.strip()), reason.strip() or "excluded"))
    return out


def match_exclude(name: str, excludes: List[Tuple[str, str]]) -> Optional[str]:
    for pattern, reason in excludes:
        if fnmatch.fnmatchcase(name, pattern):
            return reason
    return None


def parse_strips(values: Iterable[str]) -> List[Tuple[str, str, str]]:
    """``NAME:MEMBER_GLOB[=REASON]``: drop files matching MEMBER_GLOB (a glob over the paths
    inside the wheel, e.g. ``vllm/vllm_flash_attn/_vllm_fa2_C*.so``) from the wheel of package
    NAME (a glob over normalized names)."""
    out = []
    for value in values:
        spec, _, reason = value.partition("=")
        name, sep, member = spec.partition(":")
        if not sep or not name.strip() or not member.strip():
            raise ValueError("--strip wants NAME:MEMBER_GLOB[=REASON], got %r" % value)
        out.append((normalize(name.strip()), member.strip(), reason.strip() or "stripped"))
    return out


def strip_wheel(path: str, strips: List[Tuple[str, str, str]]) -> List[dict]:
    """Rewrites the wheel at ``path`` without the members that ``strips`` name for its package,
    and without their lines in ``*.dist-info/RECORD`` (so pip neither installs nor lists them).
    Returns one record per removed file; the wheel is left untouched when nothing matches.
    The rewrite goes to a temporary file that replaces the wheel only once complete."""
    fname = os.path.basename(path)
    name = normalize(fname[:-4].split("-")[0])
    rules = [(m, r) for n, m, r in strips if fnmatch.fnmatchcase(name, n)]
    if not rules:
        return []
    removed: List[dict] = []
    with zipfile.ZipFile(path) as zin:
        infos = zin.infolist()
        drop = {}
        for info in infos:
            for member, reason in rules:
                if fnmatch.fnmatchcase(info.filename, member):
                    drop[info.filename] = reason
                    break
        if not drop:
            return []
        tmp = path + ".strip-tmp"
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
                for info in infos:
                    if info.filename in drop:
                        removed.append({"wheel": fname, "path": info.filename,
                                        "size": info.file_size,
                                        "compressed_size": info.compress_size,
                                        "reason": drop[info.filename]})
                        continue
                    data = zin.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode("utf-8").splitlines(keepends=True)
                        data = "".join(ln for ln in lines
                                       if ln.split(",", 1)[0] not in drop).encode("utf-8")
                    zout.writestr(info, data, compress_type=info.compress_type)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return removed


# --------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------

@dataclass
class WheelInfo:
    name: str               # normalized
    version: str
    filename: str
    requires: List[str]     # raw Requires-Dist lines
    requires_python: Optional[str] = None
    path: Optional[str] = None
    size: int = 0


def parse_metadata(text: str) -> Tuple[str, str, List[str], Optional[str]]:
    msg = email.parser.HeaderParser().parsestr(text)
    return (msg.get("Name", ""), msg.get("Version", ""), msg.get_all("Requires-Dist") or [],
            msg.get("Requires-Python"))


def read_wheel(path: str) -> WheelInfo:
    """Name, version and Requires-Dist of a wheel file, from its .dist-info/METADATA."""
    fname = os.path.basename(path)
    stem = fname[:-4].split("-")
    with zipfile.ZipFile(path) as zf:
        candidates = [n for n in zf.namelist()
                      if re.match(r"^[^/]+\.dist-info/METADATA$", n)]
        if not candidates:
            raise ValueError("%s has no .dist-info/METADATA" % fname)
        want = normalize(stem[0])
        candidates.sort(key=lambda n: normalize(n.split("-")[0]) != want)
        text = zf.read(candidates[0]).decode("utf-8", "replace")
    name, version, requires, rp = parse_metadata(text)
    return WheelInfo(normalize(name or stem[0]), version or stem[1], fname, requires, rp, path,
                     os.path.getsize(path))


# --------------------------------------------------------------------------------------------
# The dependency walk
# --------------------------------------------------------------------------------------------

@dataclass
class Node:
    specs: Set[str] = field(default_factory=set)
    extras: Set[str] = field(default_factory=set)
    required_by: Set[str] = field(default_factory=set)
    url: Optional[str] = None
    spec_from: Dict[str, Set[str]] = field(default_factory=dict)  # parent -> its clauses


@dataclass
class Graph:
    needed: Dict[str, Node] = field(default_factory=dict)    # to download
    present: Dict[str, Node] = field(default_factory=dict)   # target already has
    dropped: Dict[str, Node] = field(default_factory=dict)   # --exclude
    unresolved: Set[str] = field(default_factory=set)        # needed, metadata not known yet


def walk(roots: List[Requirement], metadata: Dict[str, WheelInfo], env: Dict[str, str],
         have: Dict[str, Optional[str]], excludes: List[Tuple[str, str]]) -> Graph:
    """Walk the requirement graph from ``roots`` over the metadata known so far.

    Pure: no I/O.  A name in ``have`` or matched by ``excludes`` ends its branch.  A needed name
    with no entry in ``metadata`` is listed in ``unresolved`` (to be downloaded next round).
    """
    g = Graph()
    expanded: Dict[str, Set[str]] = {}  # name -> extras ("" = the base) whose deps were queued
    # queue entries: (requirement, parent, marker already known to apply)
    queue: List[Tuple[Requirement, str, bool]] = [(r, ROOT_PARENT, False) for r in roots]
    while queue:
        req, parent, applies = queue.pop(0)
        if not applies and not marker_applies(req, env):
            continue
        key = req.key
        reason = match_exclude(key, excludes)
        if reason is not None:
            node = g.dropped.setdefault(key, Node())
        elif key in have:
            node = g.present.setdefault(key, Node())
        else:
            node = g.needed.setdefault(key, Node())
        node.specs.update(req.specs)
        node.extras.update(req.extras)
        node.required_by.add(parent)
        node.spec_from.setdefault(parent, set()).update(req.specs)
        if req.url:
            node.url = req.url
        if reason is not None or key in have:
            continue
        info = metadata.get(key)
        if info is None:
            g.unresolved.add(key)
            continue
        done = expanded.get(key, set())
        new = ({""} | node.extras) - done
        if not new:
            continue
        expanded[key] = done | new
        for line in info.requires:
            child = parse_requirement(line)
            if not child.marker:
                if "" in new:
                    queue.append((child, key, True))
                continue
            now = any(evaluate_marker(child.marker, dict(env, extra=e)) for e in new)
            before = any(evaluate_marker(child.marker, dict(env, extra=e)) for e in done)
            if now and not before:
                queue.append((child, key, True))
    g.unresolved = {k for k in g.unresolved if k not in metadata}
    return g


# --------------------------------------------------------------------------------------------
# Platforms
# --------------------------------------------------------------------------------------------

def expand_platforms(platforms: List[str]) -> List[str]:
    """manylinux_2_N_ARCH also accepts every older manylinux tag (glibc is backward compatible):
    manylinux_2_28_x86_64 -> manylinux_2_28 ... manylinux_2_5, manylinux2014, manylinux2010,
    manylinux1 (pip matches --platform tags exactly, so all are listed).  Other tags are kept."""
    out: List[str] = []
    for tag in platforms:
        m = re.match(r"^manylinux_2_(\d+)_(\w+)$", tag)
        if not m:
            out.append(tag)
            continue
        top, arch = int(m.group(1)), m.group(2)
        out += ["manylinux_2_%d_%s" % (n, arch) for n in range(top, 4, -1)]
        if top >= 17:
            out.append("manylinux2014_" + arch)
        if arch in ("x86_64", "i686"):
            out += ["manylinux2010_" + arch] if top >= 12 else []
            out += ["manylinux1_" + arch]
    seen: Set[str] = set()
    return [t for t in out if not (t in seen or seen.add(t))]


# --------------------------------------------------------------------------------------------
# Download (pip, one package per call, in parallel)
# --------------------------------------------------------------------------------------------

@dataclass
class Target:
    python_version: str
    platforms: List[str]
    implementation: str = "cp"

    @property
    def env(self) -> Dict[str, str]:
        return target_environment(self.python_version, machine_from_platform(self.platforms[0]))


def pip_download(pip_cmd: List[str], requirement: str, target: Target, dest: str,
                 extra_args: List[str]) -> str:
    """Download one wheel (no dependencies) into ``dest``; returns its path."""
    os.makedirs(dest, exist_ok=True)
    cmd = list(pip_cmd) + ["download", "--no-deps", "--only-binary=:all:", "--progress-bar",
                           "off", "--disable-pip-version-check", "--python-version",
                           target.python_version, "--implementation", target.implementation]
    for plat in target.platforms:
        cmd += ["--platform", plat]
    cmd += ["-d", dest] + list(extra_args) + [requirement]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join(proc.stdout.strip().splitlines()[-8:])
        raise RuntimeError("pip download %s failed (exit %d):\n%s" % (requirement,
                                                                     proc.returncode, tail))
    return os.path.join(dest, wheels[0])


# --------------------------------------------------------------------------------------------
# Pack + split
# --------------------------------------------------------------------------------------------

class SplitWriter:
    """A write-only file object that spreads its bytes over numbered parts of at most
    ``part_size`` bytes each, hashing the whole stream and every part as it goes. Parts of an
    earlier split in the folder are removed first (they would not belong to the new manifest)."""

    def __init__(self, directory: str, part_size: int, prefix: str = PART_PREFIX):
        if part_size <= 0:
            raise ValueError("part size must be positive")
        self.directory, self.part_size, self.prefix = directory, part_size, prefix
        self.total = 0
        self.sha = hashlib.sha256()
        self.parts: List[Dict[str, object]] = []
        self._fh = None
        self._part_sha = None
        self._part_len = 0
        os.makedirs(directory, exist_ok=True)
        for old in os.listdir(directory):
            if old.startswith(prefix):
                os.remove(os.path.join(directory, old))

    def _open_next(self) -> None:
        name = "%s%03d" % (self.prefix, len(self.parts))
        self._fh = open(os.path.join(self.directory, name), "wb")
        self._part_sha = hashlib.sha256()
        self._part_len = 0
        self.parts.append({"file": name})

    def _close_part(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self.parts[-1].update(size=self._part_len, sha256=self._part_sha.hexdigest())
            self._fh = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while len(view):
            if self._fh is None:
                self._open_next()
            room = self.part_size - self._part_len
            chunk = view[:room]
            self._fh.write(chunk)
            self._part_sha.update(chunk)
            self.sha.update(chunk)
            self._part_len += len(chunk)
            self.total += len(chunk)
            view = view[len(chunk):]
            if self._part_len >= self.part_size:
                self._close_part()
        return len(data)

    def tell(self) -> int:
        return self.total

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        self._close_part()
        width = len(str(max(0, len(self.parts) - 1)))
        if width > 3:  # more than 1000 parts: widen every number so the names sort
            for i, part in enumerate(self.parts):
                new = "%s%0*d" % (self.prefix, width, i)
                os.replace(os.path.join(self.directory, part["file"]),
                           os.path.join(self.directory, new))
                part["file"] = new


def _tarinfo(arcname: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(arcname)
    ti.size, ti.mode, ti.mtime = size, 0o644, 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack(wheel_paths: List[str], parts_dir: str, part_size: int) -> Tuple[List[dict], dict,
                                                                         List[dict]]:
    """Write ``wheels/<file>`` entries for every wheel into a deterministic tar, streamed
    straight into parts (the whole tar is never written).  Returns (wheels, tar, parts)
    records for the manifest."""
    wheels = []
    writer = SplitWriter(parts_dir, part_size)
    with tarfile.open(fileobj=writer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(wheel_paths, key=os.path.basename):
            fname = os.path.basename(path)
            size = os.path.getsize(path)
            h = hashlib.sha256()

            class _Hashing:
                def __init__(self, fh):
                    self.fh = fh

                def read(self, n=-1):
                    data = self.fh.read(n)
                    h.update(data)
                    return data

            with open(path, "rb") as fh:
                tar.addfile(_tarinfo("wheels/" + fname, size), _Hashing(fh))
            stem = fname[:-4].split("-")
            wheels.append({"file": fname, "name": normalize(stem[0]), "version": stem[1],
                           "size": size, "sha256": h.hexdigest()})
    writer.close()
    return wheels, {"name": TAR_NAME, "size": writer.total, "sha256": writer.sha.hexdigest()}, \
        writer.parts


def parse_size(text: str) -> int:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError("bad size %r (e.g. 64M, 1K, 1048576)" % text)
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = int(float(m.group(1)) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return "%.1f %s" % (n, unit) if unit != "B" else "%d B" % n
        n /= 1024.0
    return str(n)


def write_manifest(out_dir: str, parts_dir: str, manifest: dict) -> str:
    text = json.dumps(manifest, indent=2, sort_keys=False) + "\n"
    for d in (out_dir, parts_dir):
        tmp = os.path.join(d, MANIFEST_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, os.path.join(d, MANIFEST_NAME))
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), UNSTAGE_SCRIPT)
    if os.path.isfile(here):
        shutil.copy2(here, os.path.join(parts_dir, UNSTAGE_SCRIPT))
    return os.path.join(parts_dir, MANIFEST_NAME)


def graph_records(g: Graph, have: Dict[str, Optional[str]]) -> Tuple[List[dict], List[dict]]:
    """Manifest records of the skipped (present on the target) and dropped packages."""
    present = []
    for name, node in sorted(g.present.items()):
        ver = have.get(name)
        ok = spec_satisfied(ver, node.specs)
        rec = {"name": name, "version_on_target": ver, "specifiers": sorted(node.specs),
               "extras_requested": sorted(node.extras), "required_by": sorted(node.required_by),
               "status": {True: "ok", False: "conflict", None: "unverified"}[ok],
               "specifiers_by": {p: ",".join(sorted(s)) for p, s in sorted(node.spec_from.items())
                                 if s}}
        if ok is False:
            rec["unmet"] = {p: ",".join(sorted(s)) for p, s in sorted(node.spec_from.items())
                            if spec_satisfied(ver, s) is False}
        present.append(rec)
    dropped = [{"name": n, "reason": None, "specifiers": sorted(node.specs),
                "required_by": sorted(node.required_by)} for n, node in sorted(g.dropped.items())]
    return present, dropped


# --------------------------------------------------------------------------------------------
# plan: resolution from index metadata only (PEP 691 JSON + PEP 658 .metadata)
# --------------------------------------------------------------------------------------------

def _ssl_context() -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    return ssl.create_default_context(cafile=cafile if cafile and os.path.isfile(cafile) else None)


def _http_get(url: str, accept: Optional[str] = None, timeout: float = 60) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=timeout, context=_ssl_context()) as resp:
        return resp.read()


class _HTTPRangeFile:
    """A read-only, seekable file over HTTP Range requests, enough for zipfile to read one
    member of a remote wheel without downloading it (fetched in cached 256 KiB blocks)."""

    BLOCK = 256 * 1024

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0
        self.blocks: Dict[int, bytes] = {}

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _block(self, i: int) -> bytes:
        if i not in self.blocks:
            lo = i * self.BLOCK
            hi = min(self.size, lo + self.BLOCK) - 1
            req = urllib.request.Request(self.url, headers={"Range": "bytes=%d-%d" % (lo, hi)})
            with urllib.request.urlopen(req, timeout=60, context=_ssl_context()) as resp:
                data = resp.read()
                if resp.status != 206 and len(data) != hi - lo + 1:
                    raise RuntimeError("server ignored the Range request for %s" % self.url)
            self.blocks[i] = data if resp.status == 206 else data[lo:hi + 1]
        return self.blocks[i]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            i, off = divmod(self.pos, self.BLOCK)
            chunk = self._block(i)[off: off + end - self.pos]
            if not chunk:
                break
            out += chunk
            self.pos += len(chunk)
        return bytes(out)


def remote_wheel_metadata(url: str, size: int) -> str:
    """METADATA of a remote wheel: PEP 658 ``<url>.metadata`` when the index serves it, else the
    member read out of the zip through HTTP Range requests (a few hundred KiB at most)."""
    try:
        return _http_get(url + ".metadata").decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code not in (403, 404):
            raise
    if not size:
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=60, context=_ssl_context()) as resp:
            size = int(resp.headers["Content-Length"])
    with zipfile.ZipFile(_HTTPRangeFile(url, size)) as zf:
        names = [n for n in zf.namelist() if re.match(r"^[^/]+\.dist-info/METADATA$", n)]
        if not names:
            raise RuntimeError("no METADATA in %s" % url)
        return zf.read(names[0]).decode("utf-8", "replace")


def _wheel_compatible(filename: str, supported: Dict[Tuple[str, str, str], int]) -> Optional[int]:
    """Rank of the best supported tag of a wheel file name (lower is better), None if none."""
    parts = filename[:-4].split("-")
    if len(parts) < 5:
        return None
    ranks = [supported[(py, abi, plat)]
             for py in parts[-3].split(".") for abi in parts[-2].split(".")
             for plat in parts[-1].split(".") if (py, abi, plat) in supported]
    return min(ranks) if ranks else None


# --------------------------------------------------------------------------------------------
# Resolution over the index (resolvelib; pip vendors it)
# --------------------------------------------------------------------------------------------

def _import_resolvelib():
    try:
        import resolvelib  # type: ignore
        return resolvelib
    except ImportError:
        pass
    try:
        from pip._vendor import resolvelib  # type: ignore
        return resolvelib
    except ImportError:
        return None


@dataclass(eq=False)
class Candidate:
    name: str                 # normalized
    version: object           # packaging Version
    extras: frozenset
    file: dict                # the index's file record (filename, url, size, hashes, ...)


def _ident(name: str, extras: Iterable[str]) -> str:
    extras = sorted(extras)
    return "%s[%s]" % (name, ",".join(extras)) if extras else name


def _split_ident(identifier: str) -> Tuple[str, frozenset]:
    if identifier.endswith("]"):
        name, _, rest = identifier.partition("[")
        return name, frozenset(rest[:-1].split(","))
    return identifier, frozenset()


class IndexClient:
    """Reads a PEP 691 JSON simple index: the compatible wheels of each project (one per
    version, the best tag for the target) and each wheel's METADATA (PEP 658 file, else the
    member read through HTTP Range requests).  Fetches run in a thread pool and are cached, so
    the resolver can ask for a project's list ahead of need (``prefetch``)."""

    def __init__(self, index_url: str, target: Target, jobs: int = 8):
        pk = _import_packaging()
        if pk is None:
            raise RuntimeError("resolution needs the 'packaging' library (pip vendors one; is "
                               "pip installed for %s?)" % sys.executable)
        self.SpecifierSet, self.Version, ptags = pk
        self.index_url = index_url.rstrip("/")
        self.target = target
        self.pyfull = target.env["python_full_version"]
        short = tuple(int(x) for x in target.python_version.split(".")[:2])
        self.supported: Dict[Tuple[str, str, str], int] = {}
        interp = "%s%d%d" % (target.implementation, short[0], short[1])
        tags = list(ptags.cpython_tags(short, platforms=target.platforms)) + list(
            ptags.compatible_tags(short, interp, platforms=target.platforms))
        for i, t in enumerate(tags):
            self.supported.setdefault((t.interpreter, t.abi, t.platform), i)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, jobs))
        self.lock = threading.Lock()
        self._projects: Dict[str, concurrent.futures.Future] = {}
        self._meta: Dict[str, concurrent.futures.Future] = {}
        self.fetched_metadata = 0

    def _future(self, cache, key, fn, *args):
        with self.lock:
            fut = cache.get(key)
            if fut is None:
                fut = cache[key] = self.pool.submit(fn, *args)
        return fut

    def prefetch(self, name: str) -> None:
        self._future(self._projects, name, self._load_project, name)

    def candidates(self, name: str) -> List[Tuple[object, dict]]:
        """(Version, file) for every version that has a wheel for the target, newest first."""
        return self._future(self._projects, name, self._load_project, name).result()

    def _load_project(self, name: str) -> List[Tuple[object, dict]]:
        try:
            data = json.loads(_http_get("%s/%s/" % (self.index_url, name),
                                        "application/vnd.pypi.simple.v1+json"))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise RuntimeError("%s is not on the index %s" % (name, self.index_url))
            raise
        best: Dict[object, Tuple[int, dict]] = {}
        arch = machine_from_platform(self.target.platforms[0])
        other_tags: Set[str] = set()
        for f in data.get("files", []):
            fn = f["filename"]
            if not fn.endswith(".whl") or f.get("yanked"):
                continue
            rank = _wheel_compatible(fn, self.supported)
            if rank is None:
                if arch in fn:
                    other_tags.add(fn[:-4].split("-")[-1])
                continue
            try:
                rp = f.get("requires-python")
                if rp and not self.SpecifierSet(rp).contains(self.pyfull, prereleases=True):
                    continue
                ver = self.Version(fn.split("-")[1])
            except Exception:
                continue
            if ver not in best or rank < best[ver][0]:
                best[ver] = (rank, f)
        if not best:
            hint = (" (%s wheels exist only for: %s; a newer --platform may fit)"
                    % (arch, ", ".join(sorted(other_tags)[-6:])) if other_tags else "")
            raise RuntimeError("no wheel of %s for python %s on %s%s" % (
                name, self.target.python_version, self.target.platforms[0], hint))
        return [(v, best[v][1]) for v in sorted(best, reverse=True)]

    def prefetch_metadata(self, cand: Candidate) -> None:
        url = cand.file["url"].split("#", 1)[0]
        self._future(self._meta, url, self._load_metadata, url, int(cand.file.get("size") or 0))

    def metadata(self, cand: Candidate) -> List[str]:
        """Requires-Dist lines of a candidate's wheel."""
        url = cand.file["url"].split("#", 1)[0]
        return self._future(self._meta, url, self._load_metadata, url,
                            int(cand.file.get("size") or 0)).result()

    def _load_metadata(self, url: str, size: int) -> List[str]:
        self.fetched_metadata += 1
        return parse_metadata(remote_wheel_metadata(url, size))[2]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _make_provider(resolvelib, index, env, have, excludes, SpecifierSet, Version,
                   pinned_have):
    class Provider(resolvelib.AbstractProvider):
        """Candidates = compatible wheels on the index, newest first; dependencies = the
        wheel's Requires-Dist for the target's markers, minus what the target has (have-list)
        and what was excluded.  Extras follow pip's scheme: ``name[x]`` is its own identifier
        whose candidate depends on ``name==same version`` plus the extra's lines."""

        def identify(self, requirement_or_candidate):
            obj = requirement_or_candidate
            if isinstance(obj, Candidate):
                return _ident(obj.name, obj.extras)
            return _ident(obj.key, obj.extras)

        def get_preference(self, identifier, resolutions, candidates, information,
                           backtrack_causes=None, **kwargs):
            causes = backtrack_causes
            infos = list(information[identifier])
            pinned = any(s.startswith("==") and "*" not in s
                         for i in infos for s in i.requirement.specs)
            cause_names = set()
            for c in causes or ():
                cause_names.add(self.identify(c.requirement))
                if c.parent is not None:
                    cause_names.add(self.identify(c.parent))
            return (identifier not in cause_names, not pinned, identifier)

        def find_matches(self, identifier, requirements, incompatibilities):
            name, extras = _split_ident(identifier)
            reqs = list(requirements[identifier])
            for r in reqs:
                if r.url:
                    raise RuntimeError("%s comes from a URL (%s): stage that wheel with `pack`"
                                       % (r.name, r.url))
            bad = {str(c.version) for c in incompatibilities[identifier]}
            specs = [s for r in reqs for s in r.specs]
            spec = SpecifierSet(",".join(specs))
            if name in pinned_have:  # the target's own version, the only candidate
                v = Version(pinned_have[name])
                return [Candidate(name, v, extras, {})] if spec.contains(
                    v, prereleases=True) and str(v) not in bad else []
            found = [(v, f) for v, f in index.candidates(name)
                     if str(v) not in bad and spec.contains(v, prereleases=True)]
            finals = [x for x in found if not x[0].is_prerelease]
            wants_pre = any(re.search(r"\d(a|b|rc|dev)\d*", s) for s in specs)
            chosen = found if (wants_pre or not finals) else finals
            out = [Candidate(name, v, extras, f) for v, f in chosen]
            if out:
                index.prefetch_metadata(out[0])
            return out

        def is_satisfied_by(self, requirement, candidate):
            return SpecifierSet(",".join(requirement.specs)).contains(candidate.version,
                                                                      prereleases=True)

        def get_dependencies(self, candidate):
            if candidate.name in pinned_have:
                return []  # installed on the target with whatever it needs
            deps = []
            if candidate.extras:
                deps.append(Requirement(candidate.name, ["==%s" % candidate.version], set()))
            for line in index.metadata(candidate):
                r = parse_requirement(line)
                if candidate.extras:
                    if not r.marker or not any(evaluate_marker(r.marker, dict(env, extra=e))
                                               for e in candidate.extras):
                        continue
                elif not marker_applies(r, env):
                    continue
                if match_exclude(r.key, excludes) is not None or (
                        r.key in have and r.key not in pinned_have):
                    continue
                index.prefetch(r.key)
                deps.append(Requirement(r.name, r.specs, r.extras, None, r.url))
            return deps

    return Provider()


def resolve(roots: List[Requirement], target: Target, have: Dict[str, Optional[str]],
            excludes: List[Tuple[str, str]], index, log: Callable[[str], None] = print,
            max_rounds: int = 20000, respect_have_versions: bool = True
            ) -> Tuple[Graph, Dict[str, WheelInfo]]:
    """Backtracking resolution (resolvelib, as pip uses) of ``roots`` for the target, with every
    have-listed and excluded name cut out of the graph.  ``index`` is an IndexClient or
    anything with the same candidates/metadata/prefetch methods.  Returns the graph walked over
    the final pins (needed / present / dropped, with who required what) and the WheelInfo of
    each needed package (file = the index's chosen wheel)."""
    resolvelib = _import_resolvelib()
    pk = _import_packaging()
    if resolvelib is None or pk is None:
        raise RuntimeError("resolution needs resolvelib and packaging (pip vendors both)")
    env = target.env
    todo = [r for r in roots if marker_applies(r, env) and r.key not in have
            and match_exclude(r.key, excludes) is None]
    for r in todo:
        index.prefetch(r.key)
    # First try with the target's known versions as fixed pins, so that a package whose newest
    # release conflicts with them is taken at an older release that fits; if none fits, resolve
    # without them (the conflict is then reported as a warning).
    known = {n: v for n, v in have.items() if v and version_key(v) is not None} \
        if respect_have_versions else {}
    attempts = [known, {}] if known else [{}]
    for attempt, pinned_have in enumerate(attempts):
        provider = _make_provider(resolvelib, index, env, have, excludes, pk[0], pk[1],
                                  pinned_have)
        try:
            result = resolvelib.Resolver(provider, resolvelib.BaseReporter()).resolve(
                todo, max_rounds=max_rounds)
            break
        except resolvelib.ResolutionImpossible as exc:
            lines = []
            for cause in exc.causes:
                parent = cause.parent
                lines.append("%s%s required by %s" % (
                    cause.requirement.name, ",".join(cause.requirement.specs),
                    ROOT_PARENT if parent is None else "%s %s" % (parent.name, parent.version)))
            msg = "\n  ".join(sorted(set(lines)))
            if attempt + 1 < len(attempts):
                log("no resolution fits the target's known versions:\n  %s\nresolving again "
                    "without them (conflicts will be listed)" % msg)
                continue
            raise RuntimeError("no set of versions satisfies every requirement:\n  " + msg)
        except resolvelib.ResolutionTooDeep:
            raise RuntimeError("resolution did not settle in %d rounds" % max_rounds)
    metadata: Dict[str, WheelInfo] = {}
    for cand in result.mapping.values():
        if cand.extras or not cand.file:
            continue
        metadata[cand.name] = WheelInfo(cand.name, str(cand.version), cand.file["filename"],
                                        index.metadata(cand), cand.file.get("requires-python"),
                                        None, int(cand.file.get("size") or 0))
    g = walk(roots, metadata, env, have, excludes)
    if g.unresolved:
        raise RuntimeError("internal error: unresolved after resolution: %s"
                           % ", ".join(sorted(g.unresolved)))
    return g, {k: metadata[k] for k in g.needed}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _common_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requirement", "-r", action="append", required=True,
                   help="a PEP 508 requirement to stage, e.g. 'vllm==0.26.0' (repeatable; "
                        "extras like 'vllm[audio]==0.26.0' are followed)")
    p.add_argument("--have", action="append", default=[],
                   help="packages the target already has: a file (pip freeze / pip list / "
                        "pip list --format=json / names) or a comma-separated list (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN[=REASON]",
                   help="drop packages whose normalized name matches this glob, with the reason "
                        "recorded in the manifest (repeatable)")
    p.add_argument("--python-version", default="3.12",
                   help="target interpreter, 3.12 or 3.12.3 (default 3.12)")
    p.add_argument("--platform", action="append", default=None,
                   help="newest platform tag the target accepts (repeatable); manylinux_2_N_ARCH "
                        "also adds every older manylinux tag (default manylinux_2_28_x86_64)")
    p.add_argument("--implementation", default="cp")
    p.add_argument("--index-url", default=None,
                   help="PEP 691 simple index (default $PIP_INDEX_URL, else PyPI); build passes "
                        "it on to pip")
    p.add_argument("--jobs", "-j", type=int, default=8, help="parallel fetches (default 8)")


def _target(args) -> Target:
    return Target(args.python_version, expand_platforms(args.platform
                                                         or ["manylinux_2_28_x86_64"]),
                  args.implementation)


def _roots(args) -> List[Requirement]:
    return [parse_requirement(r) for r in args.requirement]


def _excludes_reasons(excludes, dropped_records):
    for rec in dropped_records:
        rec["reason"] = match_exclude(rec["name"], excludes)


def _resolve_for(args, log) -> Tuple[Target, Dict[str, Optional[str]], List[Tuple[str, str]],
                                      Graph, Dict[str, WheelInfo], float]:
    target = _target(args)
    have = load_have(args.have)
    excludes = parse_excludes(args.exclude)
    index_url = args.index_url or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    log("target: python %s, %s (+%d older tags); have-list: %d names; excludes: %s; index: %s"
        % (target.python_version, target.platforms[0], len(target.platforms) - 1, len(have),
           ", ".join(p for p, _ in excludes) or "none", index_url))
    t0 = time.time()
    index = IndexClient(index_url, target, args.jobs)
    try:
        g, meta = resolve(_roots(args), target, have, excludes, index, log)
    finally:
        index.close()
    dt = time.time() - t0
    log("resolved %d packages to download in %.1f s (%d metadata files read)"
        % (len(meta), dt, index.fetched_metadata))
    return target, have, excludes, g, meta, dt


def _print_skips(present: List[dict], dropped: List[dict], verbose: bool) -> None:
    print("skipped, already on the target: %d%s" % (len(present), (": " + " ".join(
        p["name"] for p in present)) if verbose else ""))
    for p in present:
        if p["status"] == "conflict":
            print("  WARNING: target has %s %s, but %s" % (
                p["name"], p["version_on_target"], "; ".join(
                    "%s needs %s" % (k, v) for k, v in p["unmet"].items())))
    unverified = [p for p in present if p["status"] == "unverified" and p["specifiers"]]
    if unverified:
        print("  version on the target unknown, so not checked here (unstage checks them there): "
              + ", ".join("%s%s" % (p["name"], ",".join(p["specifiers"])) for p in unverified))
    print("dropped: %s" % ("; ".join("%s (%s; required by %s)" % (
        d["name"], d["reason"], ", ".join(d["required_by"])) for d in dropped) or "none"))


def cmd_plan(args) -> int:
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    target, have, excludes, g, meta, dt = _resolve_for(args, log)
    present, dropped = graph_records(g, have)
    _excludes_reasons(excludes, dropped)
    rows = [{"name": n, "version": meta[n].version, "file": meta[n].filename,
             "size": meta[n].size, "required_by": sorted(g.needed[n].required_by)}
            for n in sorted(meta)]
    total = sum(r["size"] for r in rows)
    est_tar = total + 1024 * (len(rows) + 1) + 10240  # headers (+pax), padding, end blocks
    parts = -(-est_tar // args.part_size)
    if args.json:
        json.dump({"download": rows, "skipped_present": present, "dropped": dropped,
                   "total_bytes": total, "estimated_parts": parts}, sys.stdout, indent=2)
        print()
        return 0
    w = max([len(r["name"]) for r in rows] + [4])
    print("would download %d wheels:" % len(rows))
    for r in sorted(rows, key=lambda r: (-r["size"], r["name"])):
        print("  %-*s %-16s %10s  <- %s" % (w, r["name"], r["version"], human(r["size"]),
                                            ", ".join(r["required_by"])))
    _print_skips(present, dropped, args.verbose)
    print("total %s, about %d part(s) of at most %s" % (human(total), parts,
                                                       human(args.part_size)))
    return 0


def _apply_strips(paths: List[str], strips: List[Tuple[str, str, str]], log) -> List[dict]:
    removed: List[dict] = []
    for path in paths:
        got = strip_wheel(path, strips)
        for r in got:
            log("  stripped %s from %s (%s): %s" % (r["path"], r["wheel"],
                                                   human(r["compressed_size"]), r["reason"]))
        removed += got
    for name, member, _ in strips:
        if not any(fnmatch.fnmatchcase(r["path"], member) for r in removed):
            log("  note: --strip %s:%s matched no file (already stripped, or not in this version)"
                % (name, member))
    return removed


def cmd_build(args) -> int:
    t_start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    target, have, excludes, g, meta, _ = _resolve_for(args, log)
    t_res = time.time()
    out = os.path.abspath(args.out)
    wheels_dir = os.path.join(out, "wheels")
    parts_dir = os.path.join(out, "parts")
    tmp_root = os.path.join(out, ".download")
    os.makedirs(wheels_dir, exist_ok=True)
    os.makedirs(tmp_root, exist_ok=True)
    pip_cmd = shlex.split(args.pip) if args.pip else [sys.executable, "-m", "pip"]
    pip_args = list(args.pip_arg) + (["--index-url", args.index_url] if args.index_url else [])
    warnings: List[str] = []

    def fetch(name: str) -> WheelInfo:
        want = meta[name]
        final = os.path.join(wheels_dir, want.filename)
        if os.path.isfile(final) and args.reuse:
            got = final
        else:
            dest = tempfile.mkdtemp(prefix=name + "-", dir=tmp_root)
            try:
                got = pip_download(pip_cmd, "%s==%s" % (name, want.version), target, dest,
                                   pip_args)
                final = os.path.join(wheels_dir, os.path.basename(got))
                os.replace(got, final)
            finally:
                shutil.rmtree(dest, ignore_errors=True)
        info = read_wheel(final)
        if normalize(info.version) != normalize(want.version) and info.version != want.version:
            raise RuntimeError("pip gave %s, resolution chose %s" % (info.filename, want.version))
        if sorted(info.requires) != sorted(want.requires):
            warnings.append("%s: Requires-Dist in the wheel differs from the index metadata"
                            % info.filename)
        log("  got %-66s %10s" % (info.filename, human(info.size)))
        return info

    log("downloading %d wheels with pip (%d at a time) ..." % (len(meta), args.jobs))
    errors = []
    got: Dict[str, WheelInfo] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futs = {pool.submit(fetch, n): n for n in sorted(meta, key=lambda n: -meta[n].size)}
            for fut in concurrent.futures.as_completed(futs):
                try:
                    got[futs[fut]] = fut.result()
                except Exception as exc:  # report every failure, not just the first
                    errors.append("%s: %s" % (futs[fut], exc))
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    if errors:
        print("error: %d download(s) failed:\n  %s" % (len(errors), "\n  ".join(sorted(errors))),
              file=sys.stderr)
        return 1
    t_dl = time.time()
    paths = [os.path.join(wheels_dir, got[n].filename) for n in sorted(got)]
    stripped = _apply_strips(paths, parse_strips(args.strip), log)
    stale = sorted(set(os.listdir(wheels_dir)) - {os.path.basename(p) for p in paths})
    if stale:
        log("not packed (left in %s by an earlier run): %s" % (wheels_dir, " ".join(stale)))
    log("packing %d wheels into parts of at most %s ..." % (len(paths), human(args.part_size)))
    wheels, tar, parts = pack(paths, parts_dir, args.part_size)
    t_pack = time.time()
    for w in wheels:
        node = g.needed.get(w["name"])
        w["required_by"] = sorted(node.required_by) if node else []
    present, dropped = graph_records(g, have)
    _excludes_reasons(excludes, dropped)
    manifest = {
        "format": TOOL_VERSION,
        "tool": "stage_wheelhouse.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "requirements": list(args.requirement),
        "target": {"python_version": target.python_version, "implementation":
                   target.implementation, "platforms": target.platforms,
                   "marker_environment": target.env},
        "wheels": wheels,
        "wheels_total_bytes": sum(w["size"] for w in wheels),
        "tar": tar,
        "part_size": args.part_size,
        "parts": parts,
        "skipped_present": present,
        "dropped": dropped,
        "stripped": stripped,
        "warnings": warnings,
        "timings_s": {"resolve": round(t_res - t_start, 1), "download": round(t_dl - t_res, 1),
                      "pack_split": round(t_pack - t_dl, 1),
                      "total": round(t_pack - t_start, 1)},
    }
    write_manifest(out, parts_dir, manifest)
    if not args.keep_wheels:
        for p in paths:
            os.remove(p)
    for w in warnings:
        log("WARNING: " + w)
    _print_skips(present, dropped, True)
    log("timings: resolve %.1f s, download %.1f s, pack+split %.1f s, total %.1f s"
        % (t_res - t_start, t_dl - t_res, t_pack - t_dl, t_pack - t_start))
    log("%d wheels, %s; tar %s, sha256 %s" % (len(wheels), human(manifest["wheels_total_bytes"]),
                                              human(tar["size"]), tar["sha256"]))
    log("%d parts of at most %s in %s (with %s and %s)" % (
        len(parts), human(args.part_size), parts_dir, MANIFEST_NAME, UNSTAGE_SCRIPT))
    return 0


def cmd_pack(args) -> int:
    t0 = time.time()
    out = os.path.abspath(args.out)
    parts_dir = os.path.join(out, "parts")
    paths = sorted(os.path.join(args.wheels, f) for f in os.listdir(args.wheels)
                   if f.endswith(".whl"))
    if not paths:
        print("error: no .whl files in %s" % args.wheels, file=sys.stderr)
        return 1
    stripped = _apply_strips(paths, parse_strips(args.strip), print)
    wheels, tar, parts = pack(paths, parts_dir, args.part_size)
    manifest = {"format": TOOL_VERSION, "tool": "stage_wheelhouse.py pack", "stripped": stripped,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "requirements": [], "wheels": wheels,
                "wheels_total_bytes": sum(w["size"] for w in wheels), "tar": tar,
                "part_size": args.part_size, "parts": parts, "skipped_present": [],
                "dropped": [], "timings_s": {"pack_split": round(time.time() - t0, 1)}}
    write_manifest(out, parts_dir, manifest)
    print("%d wheels, %s; %d parts of at most %s in %s" % (
        len(wheels), human(manifest["wheels_total_bytes"]), len(parts), human(args.part_size),
        parts_dir))
    return 0


def cmd_resplit(args) -> int:
    """Cuts a staged tar into parts of another size (a transfer's room shrank: what it carries
    besides the part grew), from the parts alone; every part and the whole tar are checked
    against the manifest on the way, and the wheels are not needed."""
    src = os.path.abspath(args.parts)
    out = os.path.abspath(args.out)
    parts_dir = os.path.join(out, "parts")
    if os.path.realpath(parts_dir) == os.path.realpath(src):
        raise ValueError("--out %s would write its parts over the parts being read" % out)
    with open(os.path.join(src, MANIFEST_NAME), encoding="utf-8") as fh:
        manifest = json.load(fh)
    old = manifest.get("parts") or []
    missing = [p["file"] for p in old if not os.path.isfile(os.path.join(src, p["file"]))]
    if not old or missing:
        raise RuntimeError("%s: parts missing: %s" % (src, " ".join(missing) or "(none listed)"))
    writer = SplitWriter(parts_dir, args.part_size)
    try:
        for p in old:
            h = hashlib.sha256()
            with open(os.path.join(src, p["file"]), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    writer.write(block)
            if h.hexdigest() != p["sha256"]:
                raise RuntimeError("%s: sha256 differs from the manifest's" % p["file"])
        writer.close()
        if (writer.total, writer.sha.hexdigest()) != (manifest["tar"]["size"], manifest["tar"]["sha256"]):
            raise RuntimeError("the parts make a tar of %d bytes, sha256 %s; the manifest says %d, %s"
                               % (writer.total, writer.sha.hexdigest(), manifest["tar"]["size"],
                                  manifest["tar"]["sha256"]))
    except BaseException:
        writer.close()
        for p in writer.parts:  # no half-written set of parts left behind
            with contextlib.suppress(OSError):
                os.remove(os.path.join(parts_dir, p["file"]))
        raise
    manifest.update(part_size=args.part_size, parts=writer.parts,
                    resplit={"from_part_size": manifest.get("part_size"), "from_parts": len(old),
                             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    write_manifest(out, parts_dir, manifest)
    print("%d parts of at most %s in %s (from %d), tar sha256 %s" % (
        len(writer.parts), human(args.part_size), parts_dir, len(old), writer.sha.hexdigest()))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See docs/AIRGAP.md for the whole procedure.")
    sub = ap.add_subparsers(dest="cmd")
    size_help = "largest part in bytes; K/M/G suffixes are binary (default 64M = 64 MiB)"

    b = sub.add_parser("build", help="resolve, download, pack and split")
    _common_target_args(b)
    b.add_argument("--out", required=True, help="output folder (wheels/, parts/, manifest.json)")
    b.add_argument("--part-size", type=parse_size, default=parse_size("64M"), help=size_help)
    b.add_argument("--pip", default=None,
                   help="pip command to run (default: this interpreter's -m pip)")
    b.add_argument("--pip-arg", action="append", default=[],
                   help="extra argument for every pip download, e.g. --pip-arg=--index-url=URL "
                        "(repeatable)")
    b.add_argument("--keep-wheels", action="store_true",
                   help="keep OUT/wheels after packing (default: delete them; the parts hold them)")
    b.add_argument("--reuse", action="store_true",
                   help="use a wheel already in OUT/wheels (from --keep-wheels) instead of "
                        "downloading it again")
    b.add_argument("--strip", action="append", default=[], metavar="NAME:MEMBER_GLOB[=REASON]",
                   help="drop files matching MEMBER_GLOB from package NAME's wheel (and from its "
                        "RECORD), with the reason recorded in the manifest (repeatable)")
    b.set_defaults(func=cmd_build)

    p = sub.add_parser("plan", help="print what build would download (index metadata only)")
    _common_target_args(p)
    p.add_argument("--part-size", type=parse_size, default=parse_size("64M"), help=size_help)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verbose", "-v", action="store_true", help="list every skipped package")
    p.set_defaults(func=cmd_plan)

    k = sub.add_parser("pack", help="pack + split an existing folder of wheels")
    k.add_argument("--wheels", required=True, help="folder of .whl files")
    k.add_argument("--out", required=True)
    k.add_argument("--part-size", type=parse_size, default=parse_size("64M"), help=size_help)
    k.add_argument("--strip", action="append", default=[], metavar="NAME:MEMBER_GLOB[=REASON]",
                   help="drop files matching MEMBER_GLOB from package NAME's wheel (and from its "
                        "RECORD), with the reason recorded in the manifest (repeatable)")
    k.set_defaults(func=cmd_pack)

    r = sub.add_parser("resplit", help="cut staged parts into parts of another size (no wheels "
                                       "needed; every part and the tar checked)")
    r.add_argument("--parts", required=True, help="folder with the parts and their manifest.json")
    r.add_argument("--out", required=True, help="output folder (parts/, manifest.json)")
    r.add_argument("--part-size", type=parse_size, required=True, help="largest new part, K/M/G binary")
    r.set_defaults(func=cmd_resplit)

    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, MarkerError) as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
