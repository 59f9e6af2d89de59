"""MoE experts variants, the decision to take or hand back a call, and the counters behind
opgraft.stats(). Knows torch (through ops) but not vLLM: the vLLM seam wraps vLLM's own
implementation as the `delegate` callable.

A variant is a function (call: ExpertsCall) -> tensor. `passthrough` always delegates, so it is
bitwise identical to vLLM; `opgraft` runs our kernel where the guard says yes and delegates
otherwise. OPGRAFT_MOE_EXPERTS selects one (default: opgraft).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("opgraft")

_VARIANTS: dict[str, Callable[["ExpertsCall"], Any]] = {}
DEFAULT_VARIANT = "opgraft"


def register_experts_variant(name: str):
    """Decorator: registers fn(call) -> output tensor under name (replacing an older one)."""

    def deco(fn):
        _VARIANTS[name] = fn
        return fn

    return deco


def variants() -> list[str]:
    return sorted(_VARIANTS)


def selected_variant() -> str:
    """The variant named by OPGRAFT_MOE_EXPERTS; an unknown name warns once and falls back to
    passthrough (never to our kernel: a typo must not change numerics silently)."""
    name = os.environ.get("OPGRAFT_MOE_EXPERTS", DEFAULT_VARIANT).strip() or DEFAULT_VARIANT
    if name not in _VARIANTS:
        _warn_once(f"OPGRAFT_MOE_EXPERTS={name!r} is not a registered variant ({', '.join(variants())}); "
                   "using passthrough")
        return "passthrough"
    return name


@dataclass
class ExpertsCall:
    """One experts computation after routing, in fused_experts terms."""

    hidden_states: Any
    w13: Any
    w2: Any
    topk_weights: Any
    topk_ids: Any
    activation: str
    apply_router_weight_on_input: bool
    expert_map: Any
    delegate: Callable[[], Any]  # runs vLLM's own implementation of this very call
    extra_reason: str = ""  # a reason the seam already knows it must hand back ("" if none)
    output: Any = None  # where to write [T, H]; None: return a new tensor
    workspace: Any = None  # scratch the caller lends us (used when large and aligned enough)


class _Stats:
    def __init__(self):
        self._lock = threading.Lock()
        self.taken = 0
        self.taken_with_expert_map = 0  # of those, calls of an expert-parallel rank
        self.delegated: Counter = Counter()

    def take(self, expert_map: bool = False):
        with self._lock:
            self.taken += 1
            self.taken_with_expert_map += bool(expert_map)

    def delegate(self, reason: str):
        with self._lock:
            self.delegated[reason] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"moe": {"taken": self.taken, "taken_with_expert_map": self.taken_with_expert_map,
                            "delegated": sum(self.delegated.values()),
                            "delegated_by_reason": dict(self.delegated)}}

    def reset(self):
        with self._lock:
            self.taken = 0
            self.taken_with_expert_map = 0
            self.delegated.clear()


STATS = _Stats()
_warned: set = set()
_warned_lock = threading.Lock()


def _warn_once(msg: str) -> None:
    with _warned_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    logger.warning("%s", msg)


def _info_once(msg: str) -> None:
    with _warned_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    logger.info("%s", msg)


def dispatch(call: ExpertsCall):
    return _VARIANTS[selected_variant()](call)


@register_experts_variant("passthrough")
def _passthrough(call: ExpertsCall):
    STATS.delegate("passthrough variant")
    return call.delegate()


def _reason_key(reason: str) -> str:
    """Groups reasons that differ only in numbers, e.g. '12 tokens > moe.max_tokens 8'."""
    return reason if "tokens" not in reason else "tokens > moe.max_tokens"


@register_experts_variant("opgraft")
def _opgraft(call: ExpertsCall):
    if call.extra_reason:
        STATS.delegate(call.extra_reason)
        return call.delegate()
    from . import ops  # torch is imported only once a call arrives

    ok, reason = ops.moe_supports(call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids,
                                  call.apply_router_weight_on_input, call.expert_map, call.activation)
    if not ok:
        STATS.delegate(_reason_key(reason))
        _info_once(f"MoE call handed back to vLLM: {reason}")
        return call.delegate()
    try:
        if call.output is None and call.expert_map is None:
            out = ops.moe_experts(call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids,
                                  call.apply_router_weight_on_input)
        else:
            dst = call.output if call.output is not None else call.hidden_states.new_empty(call.hidden_states.shape)
            ops.moe_experts_into(dst, call.hidden_states, call.w13, call.w2, call.topk_weights,
                                 call.topk_ids, call.apply_router_weight_on_input,
                                 workspace=ops.usable_workspace(call.workspace), expert_map=call.expert_map)
            out = None if call.output is not None else dst
    except Exception as e:  # a kernel that cannot run (no NVRTC, compile error) must not stop vLLM
        STATS.delegate(f"kernel error: {type(e).__name__}")
        _warn_once(f"opgraft MoE kernel failed, handing calls back to vLLM: {e}")
        return call.delegate()
    STATS.take(expert_map=call.expert_map is not None)
    return out


def stats() -> dict:
    """Counters of MoE calls taken by our kernel and handed back (by reason) in this process."""
    return STATS.snapshot()


def _summary_at_exit():
    s = STATS.snapshot()["moe"]
    logger.warning("opgraft stats (pid %d): MoE calls taken %d, handed back %d %s", os.getpid(), s["taken"],
                   s["delegated"], s["delegated_by_reason"])


def install_exit_summary() -> None:
    """With OPGRAFT_STATS=1, logs the counters when the process exits."""
    if os.environ.get("OPGRAFT_STATS", "0") not in ("", "0"):
        atexit.register(_summary_at_exit)
