"""opgraft's vLLM plugin (entry point group `vllm.general_plugins`, name `opgraft`).

vLLM calls register() in every process it starts (API server, engine core, each worker), maybe
more than once. register() imports nothing heavy until it knows it will patch, patches each seam
at most once, and logs one line per process saying what it installed or why it did nothing.

Gates: OPGRAFT_DISABLE=1 patches nothing; a platform that is not CUDA, or a GPU older than sm_80,
patches nothing (OPGRAFT_FORCE_PLATFORM=1 skips the platform gate, for tests on machines without
a GPU). vLLM's own VLLM_PLUGINS filter decides whether register() is called at all.
"""

from __future__ import annotations

import logging
import threading

from .compat import TESTED_VLLM, switched_on, vllm_version, vllm_version_is

_lock = threading.Lock()
_done = False
_summary = ""

MIN_CAPABILITY = 80


def _logger():
    """vLLM configures the handlers of its "vllm" logger tree: log under it."""
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.opgraft")
    except Exception:
        return logging.getLogger("opgraft")


def platform_gate() -> tuple[bool, str]:
    """(True, "") if this process runs on a CUDA GPU we support."""
    if switched_on("OPGRAFT_FORCE_PLATFORM"):
        return True, ""
    try:
        from vllm.platforms import current_platform
    except Exception as e:
        return False, f"vllm.platforms cannot be imported ({type(e).__name__})"
    if not current_platform.is_cuda():
        return False, f"platform {type(current_platform).__name__} is not CUDA"
    try:
        cap = current_platform.get_device_capability()
    except Exception:
        cap = None
    if cap is None:
        return False, "no CUDA device capability"
    cc = cap.to_int() if hasattr(cap, "to_int") else cap[0] * 10 + cap[1]
    if cc < MIN_CAPABILITY:
        return False, f"GPU sm_{cc} is older than sm_{MIN_CAPABILITY}"
    return True, ""


def register() -> None:
    """vLLM general-plugin entry point: install opgraft's seams in this process."""
    global _done, _summary
    with _lock:
        if _done:
            return
        _done = True
        log = _logger()
        if switched_on("OPGRAFT_DISABLE"):
            _summary = "disabled by OPGRAFT_DISABLE: nothing patched"
            log.info("opgraft: %s", _summary)
            return
        ok, why = platform_gate()
        if not ok:
            _summary = f"{why}: nothing patched"
            log.info("opgraft: %s", _summary)
            return
        from .. import _lib, dispatch

        # libopgraft's warnings (malformed tunables, cache trouble) and the dispatch messages go
        # through vLLM's logging configuration.
        _lib.logger = dispatch.logger = log

        parts = []
        for name, seam in seams():
            off = getattr(seam, "disabled", lambda: "")()
            if off:  # a seam's own kill switch: nothing installed, nothing to warn about
                parts.append(off)
                continue
            installed, msg = seam.install()
            parts.append(msg)
            if not installed:
                log.warning("opgraft: %s seam not installed: %s; that seam stays vLLM's", name, msg)
        dispatch.install_exit_summary()
        version_note = "" if vllm_version_is(TESTED_VLLM) else f" (tested with vLLM {TESTED_VLLM}, found {vllm_version() or 'unknown'})"
        _summary = ("; ".join(parts) + f"; MoE variant {dispatch.selected_variant()}, linear variant "
                    f"{dispatch.selected_variant('linear')}{version_note}")
        log.info("opgraft %s: %s", _version(), _summary)


def seams():
    """The seams register() installs, in order: (name, module with install/uninstall/installed and
    optionally disabled() -> why not)."""
    from . import attn_seam, linear_seam, moe_seam, norm_seam, rope_seam, route_seam

    return (("moe", moe_seam), ("moe routing", route_seam), ("attention", attn_seam), ("linear", linear_seam),
            ("norm fusion", norm_seam), ("attention prologue", rope_seam))


def _version() -> str:
    from .. import __version__

    return __version__


def summary() -> str:
    """What register() did in this process ("" before it ran)."""
    return _summary


def _reset_for_tests() -> None:
    """Undoes register(): restores vLLM's methods and lets register() run again."""
    global _done, _summary
    with _lock:
        for _, seam in reversed(seams()):  # last installed first: wrappers of one method unwind in order
            seam.uninstall()
        _done = False
        _summary = ""
