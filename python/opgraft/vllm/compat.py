"""vLLM version helpers. The seams are written against the pinned release (TESTED_VLLM) and check
for the symbols they patch, so a moved API leaves opgraft a no-op with one warning."""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import uuid

# How a switch is turned off: OPGRAFT_X=0 (or false, no, off; any case, spaces ignored).
OFF = ("0", "false", "no", "off")


def switched_off(name: str) -> bool:
    """Is the environment switch `name` set to one of OFF? (Unset or anything else: on.)"""
    return os.environ.get(name, "").strip().lower() in OFF


def switched_on(name: str) -> bool:
    """Is the environment switch `name` set, and not to one of OFF? (Unset or blank: off.)"""
    return os.environ.get(name, "").strip().lower() not in ("", *OFF)


def switch(name: str, warn) -> bool | None:
    """A switch with a default: True for 1 (or true, yes, on), False for one of OFF, None when unset
    (the caller's default). Anything else calls warn(message) and is None too."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in OFF:
        return False
    if value:
        warn(f"{name}={value!r} is neither on (1) nor off (0): left at its default")
    return None


# The vLLM release opgraft is tested against: the newest that pins torch 2.11.0 (its wheel's
# METADATA: Requires-Dist torch==2.11.0; built for CUDA 13.0).
TESTED_VLLM = "0.26.0"
# CI runs the plugin's tests against the newest release too (ci/requirements-newest.txt, installed
# as ci/newest-overrides.txt says).


def vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return ""


def _release(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


def vllm_version_is(spec: str) -> bool:
    """True when the installed vLLM's release equals spec ("0.26.0"), or starts with it ("0.26")."""
    have, want = _release(vllm_version()), _release(spec)
    return bool(have) and have[: len(want)] == want


def _env_factor_table():
    """vLLM's table of environment variables hashed into its compile-cache key, or None."""
    try:
        import vllm.envs as envs
    except Exception:
        return None
    table = getattr(envs, "environment_variables", None)
    return table if isinstance(table, dict) else None


def source_digest(root: str) -> str:
    """sha256 of the .py files under root: their relative paths and bytes, in sorted order."""
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        paths += [os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/") for n in files if n.endswith(".py")]
    h = hashlib.sha256()
    for rel in sorted(paths):
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def package_tag() -> str:
    """"opgraft VERSION (source DIGEST)": part of every seam's compile-cache factor, because a
    traced graph holds what the seams decided at trace time (which calls go to opgraft's ops), so
    a graph traced by other opgraft code must not be loaded, even under the same version number."""
    from .. import __version__

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        digest = source_digest(root)[:16]
    except OSError:  # an unreadable install: a key of its own per process, so no cached graph is reused
        digest = f"unreadable, {uuid.uuid4().hex}"
    return f"opgraft {__version__} (source {digest})"


@functools.lru_cache(maxsize=4)
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def tunables_tag() -> str:
    """What a graph-time tunable reads beside the shape and the GPU: the library (its baked rows),
    the tune file and the OPGRAFT_TUNE_ environment, as one digest, for a compile-cache factor."""
    from .. import _lib

    h = hashlib.sha256()
    try:
        h.update(_file_digest(_lib.lib()._name).encode())
    except Exception as e:  # no library: every graph-time key is 0, and says why
        h.update(f"no library: {type(e).__name__}".encode())
    # Bytes throughout: a value that is not UTF-8 must not make vLLM drop this factor from its key.
    env = os.environb
    path = env.get(b"OPGRAFT_TUNE_FILE", b"")
    if path:
        try:  # as the library reads it: a regular file only, and a FIFO must not wait for a writer
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                h.update(b"\0" + f.read() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else b"\0not a file " + path)
        except OSError:
            h.update(b"\0unreadable " + path)
    for k in sorted(k for k in env if k.startswith(b"OPGRAFT_TUNE_") and k != b"OPGRAFT_TUNE_FILE"):
        h.update(b"\0" + k + b"=" + env[k])
    return f"tunables {h.hexdigest()[:16]}"


def add_compile_factor(key: str, fn) -> None:
    """Adds fn (-> str) under key to the factors of vLLM's compile-cache key: a graph traced with
    a seam's state is then never reused with another."""
    table = _env_factor_table()
    if table is not None:
        table[key] = fn


def remove_compile_factor(key: str, fn) -> None:
    table = _env_factor_table()
    if table is not None and table.get(key) is fn:
        del table[key]


def restore(owner, name: str, marker: str) -> None:
    """Puts back what a seam wrapped at owner.name (a class or module; None: never loaded, never
    wrapped), if the wrapper there is the seam's: one whose attribute `marker` holds the original."""
    current = owner.__dict__.get(name) if owner is not None else None
    if current is not None and hasattr(current, marker):
        setattr(owner, name, getattr(current, marker))
