"""Attention seam: the resolved platform's get_attn_backend_cls.

What is patched: `get_attn_backend_cls` of the class of `vllm.platforms.current_platform` (vLLM
0.26.0, the pinned release, and 0.33.0, the newest, both tested in CI: a classmethod,
`(selected_backend, attn_selector_config, num_heads=None) -> str`, the class path of the backend). Why: it is the one place every attention layer's backend is chosen,
and our decode-attention backend will plug in here while reusing vLLM's KV-cache layout. How: by
default the wrapper returns exactly what vLLM chose; OPGRAFT_ATTN_BACKEND=module:Class makes it
return that class instead. It must be installed before the first model is built (vLLM caches the
choice), which the general-plugin hook guarantees.
Remove it: delete this module's install() call in opgraft/vllm/__init__.py.
"""

from __future__ import annotations

import os

_PATCH_ATTR = "_opgraft_original_get_attn_backend_cls"


def requested_backend() -> str | None:
    """OPGRAFT_ATTN_BACKEND as a dotted class path, or None. Raises ValueError if malformed."""
    spec = os.environ.get("OPGRAFT_ATTN_BACKEND", "").strip()
    if not spec:
        return None
    mod, sep, cls = spec.partition(":")
    ident = lambda s: bool(s) and all(p.isidentifier() for p in s.split("."))
    if not sep or not ident(mod) or not cls.isidentifier():
        raise ValueError(f"OPGRAFT_ATTN_BACKEND={spec!r} must look like package.module:ClassName")
    return f"{mod}.{cls}"


def _platform_class():
    from vllm.platforms import current_platform

    return type(current_platform)


def install() -> tuple[bool, str]:
    try:
        cls = _platform_class()
    except Exception as e:
        return False, f"cannot resolve vllm's current platform ({type(e).__name__}: {e})"
    original = cls.__dict__.get("get_attn_backend_cls")
    if original is None:
        for base in cls.__mro__[1:]:
            if "get_attn_backend_cls" in base.__dict__:
                original = base.__dict__["get_attn_backend_cls"]
                break
    if not isinstance(original, classmethod):
        return False, "vllm's Platform.get_attn_backend_cls is not a classmethod (another vLLM version?)"
    if hasattr(original.__func__, _PATCH_ATTR):
        return True, "attention seam already installed"
    try:
        override = requested_backend()
    except ValueError as e:
        return False, str(e)
    func = original.__func__

    def get_attn_backend_cls(klass, *args, **kwargs):
        if override is not None:
            return override
        return func(klass, *args, **kwargs)

    setattr(get_attn_backend_cls, _PATCH_ATTR, original)
    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    what = f"injecting {override}" if override else "pass-through"
    return True, f"attention seam installed on {cls.__name__} ({what})"


def uninstall() -> None:
    try:
        cls = _platform_class()
    except Exception:
        return
    current = cls.__dict__.get("get_attn_backend_cls")
    if isinstance(current, classmethod) and hasattr(current.__func__, _PATCH_ATTR):
        original = getattr(current.__func__, _PATCH_ATTR)
        if any("get_attn_backend_cls" in b.__dict__ and b.__dict__["get_attn_backend_cls"] is original
               for b in cls.__mro__[1:]):
            del cls.get_attn_backend_cls  # the original lives on a base class
        else:
            cls.get_attn_backend_cls = original


def installed() -> bool:
    try:
        current = _platform_class().__dict__.get("get_attn_backend_cls")
    except Exception:
        return False
    return isinstance(current, classmethod) and hasattr(current.__func__, _PATCH_ATTR)
