"""Whether our kernel takes a call or hands it back, per op, and the counters behind stats().

Knows neither torch nor vLLM at import: a seam (opgraft.vllm.*) wraps vLLM's own implementation
of a call as its `delegate` and hands the call here; torch is imported with the op module when the
first call arrives.

Each op has variants, functions (call) -> output: `passthrough` always delegates (bitwise what
vLLM does), `opgraft` runs our kernel where the op's guard says yes. An environment variable per
op selects one (VARIANT_ENV: OPGRAFT_MOE_EXPERTS, OPGRAFT_LINEAR_VARIANT, OPGRAFT_ATTENTION_VARIANT);
the default is opgraft.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("opgraft")

DEFAULT_VARIANT = "opgraft"
# The environment variable that picks each op's variant.
VARIANT_ENV = {"moe": "OPGRAFT_MOE_EXPERTS", "linear": "OPGRAFT_LINEAR_VARIANT",
               "attention": "OPGRAFT_ATTENTION_VARIANT"}

_VARIANTS: dict[str, dict[str, Callable[[Any], Any]]] = {}


def register_variant(op: str, name: str):
    """Decorator: registers fn(call) -> output under (op, name), replacing an older one."""

    def deco(fn):
        _VARIANTS.setdefault(op, {})[name] = fn
        return fn

    return deco


def register_experts_variant(name: str):
    """The MoE op's register_variant (kept for callers of the first release)."""
    return register_variant("moe", name)


def variants(op: str = "moe") -> list[str]:
    return sorted(_VARIANTS.get(op, {}))


def selected_variant(op: str = "moe") -> str:
    """The variant the op's environment variable names; an unknown name warns once and falls back
    to passthrough (never to our kernel: a typo must not change numerics silently)."""
    env = VARIANT_ENV.get(op, f"OPGRAFT_{op.upper()}_VARIANT")
    name = os.environ.get(env, DEFAULT_VARIANT).strip() or DEFAULT_VARIANT
    if name not in _VARIANTS.get(op, {}):
        _warn_once(f"{env}={name!r} is not a registered variant ({', '.join(variants(op))}); using passthrough")
        return "passthrough"
    return name


class OpStats:
    """Calls of one op taken by our kernel, and handed back by reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self.taken = 0
        self.taken_by_kind: Counter = Counter()  # e.g. "expert_map" for an expert-parallel rank's calls
        self.delegated: Counter = Counter()

    def take(self, kind: str = ""):
        with self._lock:
            self.taken += 1
            if kind:
                self.taken_by_kind[kind] += 1

    def delegate(self, reason: str):
        with self._lock:
            self.delegated[reason_key(reason)] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"taken": self.taken, "taken_by_kind": dict(self.taken_by_kind),
                    "delegated": sum(self.delegated.values()), "delegated_by_reason": dict(self.delegated)}

    def reset(self):
        with self._lock:
            self.taken = 0
            self.taken_by_kind.clear()
            self.delegated.clear()


_stats: dict[str, OpStats] = {}
_stats_lock = threading.Lock()


def stats_of(op: str) -> OpStats:
    with _stats_lock:
        s = _stats.get(op)
        if s is None:
            s = _stats[op] = OpStats()
        return s


@functools.lru_cache(maxsize=1024)  # a hand-back's reason repeats call after call
def reason_key(reason: str) -> str:
    """Groups reasons that differ only in their numbers: '12 tokens > moe.max_tokens 8' and
    '9 tokens > moe.max_tokens 8' count as 'N tokens > moe.max_tokens N'."""
    return re.sub(r"(?<![\w.])\d+(?![\w])", "N", reason)


_warned: set = set()
_warned_lock = threading.Lock()


# The "opgraft: " prefix names the source where no logging handler is configured (Python prints
# the bare message then), as _lib does for the library's own messages.
def _warn_once(msg: str) -> None:
    with _warned_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    logger.warning("opgraft: %s", msg)


def _info_once(msg: str) -> None:
    with _warned_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    logger.info("opgraft: %s", msg)


def variant_fn(op: str, name: str) -> Callable[[Any], Any]:
    """The registered variant `name` of op (a plain lookup, which Dynamo can trace)."""
    return _VARIANTS[op][name]


def dispatch(op: str, call) -> Any:
    """Runs call with the op's selected variant."""
    return _VARIANTS[op][selected_variant(op)](call)


def handed_back(op: str, reason: str, call) -> Any:
    """Counts and logs (once per reason) a call handed back to vLLM, and runs vLLM's own."""
    stats_of(op).delegate(reason)
    _info_once(f"{op} call handed back to vLLM: {reason}")
    return call.delegate()


def kernel_failed(op: str, e: Exception, call) -> Any:
    """A kernel that cannot run (no NVRTC, a compile error) must not stop vLLM: hand back."""
    stats_of(op).delegate(f"kernel error: {type(e).__name__}")
    _warn_once(f"{op} kernel failed, handing calls back to vLLM: {e}")
    return call.delegate()


# ---- the MoE experts op ---------------------------------------------------------------------


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
    # FP8 weights and hidden states: (hidden_scale, w13_scale, w2_scale, block_shape or None for
    # per-tensor scales), as opgraft.ops.moe.Fp8Scales takes them; None for bf16/fp16.
    fp8_scales: Any = None


@dataclass
class RoutedExpertsCall:
    """One MoE layer's routing and experts from the router's logits: vLLM's softmax top-k
    (renormalized or not) and the SwiGLU experts, both done by our kernels. Its delegate is vLLM's
    own routing followed by the experts call (which the experts seam sees as an ExpertsCall), so a
    hand-back is counted under "moe_route" and the experts call under "moe" as before."""

    hidden_states: Any
    w13: Any
    w2: Any
    router_logits: Any
    top_k: int
    renormalize: bool
    delegate: Callable[[], Any]
    extra_reason: str = ""
    # FP8 weights: (w13_scale, w2_scale, block_shape), and the layer's own activation quantization
    # (() -> (e4m3 hidden states, their scales)), run only once the plan takes the call
    fp8_weights: Any = None
    quantize: Callable[[], Any] | None = None


_fp8_like_cache: dict = {}  # (T, H, block_k, device) -> moe.fp8_activations_like's tensors


def _moe_routed(call: RoutedExpertsCall):
    if call.extra_reason:
        return handed_back("moe_route", call.extra_reason, call)
    from .ops import moe

    out = call.hidden_states.new_empty(call.hidden_states.shape)
    x, fp8 = call.hidden_states, None

    def plan_of(x, fp8):
        return moe.plan_for_routed(x, call.w13, call.w2, call.router_logits, call.top_k, call.renormalize, out,
                                   fp8=fp8)

    try:
        if call.quantize is not None:
            # FP8 weights: the kernel quantizes the 16-bit hidden states itself where its plan
            # says so; else the layer's own quantization, once the e4m3 form's plan takes the call
            s13, s2, block = call.fp8_weights
            fp8 = moe.Fp8Scales(None, s13, s2, block)
            plan = plan_of(x, fp8)
            if plan.handle is None:
                h = call.hidden_states
                bk = None if block is None else block[1]
                key = (*h.shape, bk, h.device)
                if key not in _fp8_like_cache:
                    _fp8_like_cache[key] = moe.fp8_activations_like(h, bk)
                plan = plan_of(_fp8_like_cache[key][0], moe.Fp8Scales(_fp8_like_cache[key][1], s13, s2, block))
                if plan.handle is None:
                    return handed_back("moe_route", plan.reason, call)
                x, xs = call.quantize()
                fp8 = moe.Fp8Scales(xs, s13, s2, block)
                plan = plan_of(x, fp8)
        else:
            plan = plan_of(x, None)
        if plan.handle is None:
            return handed_back("moe_route", plan.reason, call)
        moe.run_routed(plan, out, x, call.w13, call.w2, call.router_logits, call.top_k, call.renormalize, fp8=fp8)
    except Exception as e:
        return kernel_failed("moe_route", e, call)
    kind = "" if fp8 is None else "+fp8-block" if fp8.block_shape is not None else "+fp8-tensor"
    quant = "+kernel-quant" if fp8 is not None and fp8.hidden_scale is None else ""
    stats_of("moe").take("routed" + kind + quant)
    return out


def dispatch_routed(call: RoutedExpertsCall) -> Any:
    """Our routing and experts with the MoE op's opgraft variant; under any other variant vLLM
    routes and the experts call goes to that variant."""
    if selected_variant("moe") != "opgraft":
        return call.delegate()
    return _moe_routed(call)


@register_variant("moe", "passthrough")
def _moe_passthrough(call: ExpertsCall):
    stats_of("moe").delegate("passthrough variant")
    return call.delegate()


@register_variant("moe", "opgraft")
def _moe_opgraft(call: ExpertsCall):
    if call.extra_reason:
        return handed_back("moe", call.extra_reason, call)
    from .ops import moe  # torch is imported only once a call arrives

    fp8 = None
    if call.fp8_scales is not None:
        if call.output is None:  # the output dtype is the caller's
            return handed_back("moe", "an FP8 call without an output tensor", call)
        fp8 = moe.Fp8Scales(*call.fp8_scales)
    dst = call.output if call.output is not None else call.hidden_states.new_empty(call.hidden_states.shape)
    try:
        plan = moe.plan_for(call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, dst,
                            call.apply_router_weight_on_input, call.expert_map, call.activation, fp8=fp8)
        if plan.handle is None:
            return handed_back("moe", plan.reason, call)
        moe.run(plan, dst, call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids,
                call.apply_router_weight_on_input, call.workspace, call.expert_map, fp8)
    except Exception as e:
        return kernel_failed("moe", e, call)
    kind = [] if fp8 is None else ["fp8-block" if fp8.block_shape is not None else "fp8-tensor"]
    if call.expert_map is not None:
        kind.append("expert_map")
    stats_of("moe").take("+".join(kind))
    return None if call.output is not None else dst


# ---- the linear op -------------------------------------------------------------------------


@dataclass
class LinearCall:
    """One unquantized linear call, y = x weight^T (+ bias), as vLLM's linear method makes it.

    The seam (opgraft.vllm.linear_seam) builds it, possibly while Dynamo traces the model, so the
    variants below only route: the counting is the seam's and the op's (see linear_seam)."""

    x: Any
    weight: Any
    bias: Any
    delegate: Callable[[], Any]  # vLLM's own implementation of this very call
    ours: Callable[[], Any]  # torch.ops.opgraft.linear on these tensors (decides per call at run time)
    extra_reason: str = ""  # a reason the seam already knows it must hand back ("" if none)


@register_variant("linear", "passthrough")
def _linear_passthrough(call: LinearCall):
    return call.delegate()


@register_variant("linear", "opgraft")
def _linear_opgraft(call: LinearCall):
    return call.delegate() if call.extra_reason else call.ours()
# ---- the paged decode-attention op -----------------------------------------------------------


@dataclass
class AttentionCall:
    """One decode-attention call in vLLM's FlashAttention terms: the KV cache as the K and V views
    FlashAttentionImpl.forward splits from it, the metadata's lengths and block table, and where
    the output goes (rows 0 .. batch-1, batch = len(seq_lens)). With key, value and slot_mapping
    the call also owes the cache its new keys and values (vLLM's KV-cache write): our kernel stores
    them, and the delegate does vLLM's write before its attention. With pro (an ops.attention
    QKPrologue) the query and key are before vLLM's q/k norm and rotary embedding, which our kernel
    applies and the delegate must do itself."""

    query: Any
    key_cache: Any
    value_cache: Any
    block_table: Any
    seq_lens: Any
    output: Any
    scale: float
    softcap: float
    window_left: int
    sinks: Any
    max_seq_len: int
    delegate: Callable[[], Any]  # runs vLLM's own implementation of this very call
    extra_reason: str = ""  # a reason the seam already knows it must hand back ("" if none)
    key: Any = None
    value: Any = None
    slot_mapping: Any = None
    pro: Any = None
    flags: int = 0  # hints for the launch (_lib.ATTN_AFTER_QKV), never a need


@register_variant("attention", "passthrough")
def _attention_passthrough(call: AttentionCall):
    stats_of("attention").delegate("passthrough variant")
    return call.delegate()


@register_variant("attention", "opgraft")
def _attention_opgraft(call: AttentionCall):
    if call.extra_reason:
        return handed_back("attention", call.extra_reason, call)
    from .ops import attention  # torch is imported only once a call arrives

    try:
        plan = attention.plan_for(call.query, call.key_cache, call.value_cache, call.block_table, call.seq_lens,
                                  call.output, call.scale, call.softcap, call.window_left, call.sinks, call.flags,
                                  key=call.key, value=call.value, slot_mapping=call.slot_mapping, pro=call.pro)
        if plan.handle is None:
            return handed_back("attention", plan.reason, call)
        attention.run(plan, call.output, call.query, call.key_cache, call.value_cache, call.block_table,
                      call.seq_lens, call.scale, call.softcap, call.window_left, call.sinks, call.max_seq_len,
                      call.key, call.value, call.slot_mapping, call.pro, call.flags)
    except Exception as e:
        return kernel_failed("attention", e, call)
    stats_of("attention").take()
    return call.output


def stats() -> dict:
    """Counters of calls taken by our kernels and handed back (by reason) in this process, by op."""
    with _stats_lock:
        ops = sorted(_stats)
    return {op: stats_of(op).snapshot() for op in ops}


def reset_stats() -> None:
    with _stats_lock:
        for s in _stats.values():
            s.reset()


def _summary_at_exit():
    for op, s in stats().items():
        logger.warning("opgraft: stats (pid %d): %s calls taken %d, handed back %d %s", os.getpid(), op, s["taken"],
                       s["delegated"], s["delegated_by_reason"])


def install_exit_summary() -> None:
    """With OPGRAFT_STATS=1, logs the counters when the process exits."""
    from .vllm.compat import switched_on

    if switched_on("OPGRAFT_STATS"):
        atexit.register(_summary_at_exit)
