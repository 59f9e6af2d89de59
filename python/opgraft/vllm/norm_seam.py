"""Norm fusion seam: a post-grad pass that folds add + RMSNorm into the projection after it (and,
in unquantized MoE models, into a MoE layer's router gate).

What is patched: `PostGradPassManager.configure(self, config)` in
vllm/compilation/passes/pass_manager.py and `VllmConfig._set_compile_ranges(self)` in
vllm/config/vllm.py (same signatures in vLLM 0.26.0, the pinned release, and 0.34.0, both tested
in CI, and 0.33.0). The wrapper calls vLLM's configure, then appends opgraft's
pass with `self.add`, so it runs after vLLM's own fusions (which get the first pick of the norms
they match: all-reduce + RMSNorm, RMSNorm + quant) and before vLLM lowers its IR ops.

Why there: Llama/Qwen3-style decoder layers run `hidden, residual = norm(hidden, residual)` and then
a projection of `hidden` (qkv, gate_up). In vLLM's traced graph, after its pre-grad pass has
turned `maybe_inplace` into the functional overload, that is
    (n, r) = vllm_ir.fused_add_rms_norm.default(x, residual, norm_weight, eps)
    y = opgraft.linear.default(n, W, bias)          # n's only user (the linear seam's op)
which the pass rewrites to `(y, r) = opgraft.add_rms_norm_linear.default(x, residual,
norm_weight, eps, W, bias)`: our GEMV kernel does the add + RMSNorm in its prologue, one launch
instead of two a layer. The op computes the same function (vLLM's norm, then opgraft::linear)
where the kernel does not take the call.

Which graphs: the kernel's prologue (every block normalizes the rows) pays only for a few rows
(linear.norm_rows, the linear op's rule: 2 for Qwen3-30B-A3B's qkv on sm_90, 0 off sm_90;
bench/NOTES.md v42). vLLM compiles one graph per range of token counts; install() also wraps
`VllmConfig._set_compile_ranges` to add an endpoint at the model's qkv linear.norm_rows (the
mechanism vLLM's own rope + KV-cache fusion uses), and the pass runs only in graphs whose range ends
there or below, on layers whose [N, K] allows that many rows (no endpoint at 1, which vLLM itself
refuses for user endpoints: a model whose qkv allows one row is not fused). Prefills and larger
batches run a graph of their own with vLLM's norm.

How: the pass walks the graph and rewrites only the exact pattern: 2-D x and residual of one
shape, bf16/fp16; norm weight [K] and W [N, K] of x's dtype; no variance_size; the normed output
used by that one linear and nothing else; W and bias defined before the norm. Anything else is
left to vLLM. The pass's uuid (part of the pass manager's Inductor cache key) hashes opgraft's
source (compat.package_tag); install() also adds a factor (OPGRAFT_NORM_FUSION_SEAM) to the environment factors of
vLLM's compile cache, as the linear seam does.

MoE layers (OPGRAFT_NORM_FUSION_MOE=1 every MoE model, 0 none; unset: a model whose qkv projection
gets the q/k epilogue, rope_seam.qk_model. Alone it measured no faster; with the attention prologue
batch-1 ITL fell 3-6% but the pair doubled a batch-1 first token under vLLM's serve capture sizes
(bench/NOTES.md v46, v48); with the epilogue, batch-1 ITL x0.974 / x0.972 in both orders, the
first token no later, the same tokens (H100, Qwen3-30B-A3B, v64)): the norm before
a Qwen3-MoE-style layer feeds vLLM's moe_forward(n, n, None, None, layer_name, 0) (the router
gate runs inside the runner, eagerly, so no pass sees norm and gate together), which after
functionalization is auto_functionalized(vllm.moe_forward.default, hidden_states=n, ...). The
pass rewrites norm + that call to `(out, r) = opgraft.add_rms_norm_moe.default(x, residual,
norm_weight, eps, layer_name)`. The op finds the runner as moe_forward does; our linear kernel's
add + RMSNorm form computes the router logits and writes the normalized rows (block 0), and the
runner's own _forward_impl runs on those rows with its gate replaced, for that call, by a module
returning the logits made, so routing, experts and parallel steps stay vLLM's. Only graphs where
every MoE runner of the model has its own unquantized router gate (no fused shared-expert gate)
of the hidden states' dtype and whose range the gates' linear.norm_rows covers (where those rows
are more than the qkv's, _set_compile_ranges adds that endpoint too); the op hands a call its
kernel does not take to vLLM's norm and moe_forward's own call.

It needs the linear seam (the pattern is made of its op): install() refuses without it, and with
OPGRAFT_LINEAR_VARIANT=passthrough (no linear op in the graph). OPGRAFT_NORM_FUSION=0 installs
nothing.
Remove it: delete the ("norm fusion", norm_seam) entry of the seam list in opgraft/vllm/__init__.py.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import threading

from .. import dispatch
from . import linear_seam
from .compat import add_compile_factor, package_tag, remove_compile_factor, restore, switch, switched_off

_PATCH_ATTR = "_opgraft_original_configure"
COMPILE_FACTOR = "OPGRAFT_NORM_FUSION_SEAM"

_lock = threading.Lock()
_fused_total = 0
_pass_cls = None


def disabled() -> str:
    """Why the seam must not be installed ("" if it may): OPGRAFT_NORM_FUSION=0, or the linear
    seam switched off (nothing to fuse into; deliberate, so no warning)."""
    if switched_off("OPGRAFT_NORM_FUSION"):
        return "norm fusion disabled by OPGRAFT_NORM_FUSION=0"
    if linear_seam.disabled():
        return "norm fusion off with the linear seam (OPGRAFT_LINEAR=0)"
    return ""


def fused_total() -> int:
    """Norm + linear pairs the pass has fused in this process."""
    with _lock:
        return _fused_total


def _reset_fused_total() -> None:
    global _fused_total, _fused_moe_total
    with _lock:
        _fused_total = _fused_moe_total = 0


def _target():
    """(PostGradPassManager, "") or (None, why)."""
    try:
        import torch
        import vllm.ir.ops  # noqa: F401  (registers the vllm_ir ops)
        from vllm.compilation.passes.pass_manager import PostGradPassManager
        from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass  # noqa: F401
    except Exception as e:
        return None, f"cannot import vllm's post-grad pass manager ({type(e).__name__}: {e})"
    mgr = PostGradPassManager
    if not callable(mgr.__dict__.get("configure")) or not callable(getattr(mgr, "add", None)):
        return None, "vllm's PostGradPassManager.configure/add are not where opgraft expects them"
    op = getattr(torch.ops.vllm_ir, "fused_add_rms_norm", None) if hasattr(torch.ops, "vllm_ir") else None
    if op is None or "default" not in op.overloads():
        return None, "vllm's torch.ops.vllm_ir.fused_add_rms_norm is not where opgraft expects it"
    return PostGradPassManager, ""


def _signature_matches(fn) -> bool:
    try:
        return tuple(inspect.signature(fn).parameters)[1:] == ("config",)
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=1)  # vLLM asks for the uuid at every compile
def _source_hash() -> str:
    from vllm.compilation.passes.inductor_pass import InductorPass

    return InductorPass.hash_source(package_tag())  # the whole package: the pass, its matcher and op


@functools.lru_cache(maxsize=1)  # asked once a fused layer when a graph compiles; the GPU stays
def _device() -> tuple[int, str | None]:
    """(arch, GPU name) of this process's GPU through vLLM's platform (NVML: no CUDA context in the
    process that builds the config), (0, None) without one."""
    try:
        from vllm.platforms import current_platform

        cap = current_platform.get_device_capability()
        arch = cap.to_int() if hasattr(cap, "to_int") else cap[0] * 10 + cap[1]
        return int(arch), current_platform.get_device_name()
    except Exception:
        return 0, None


def linear_tunable(key: str, N: int, K: int, dtype) -> int:
    """A graph-time key of the linear op (read when vLLM's graph is traced, not by the kernel) for a
    [N, K] projection of dtype on this GPU at one row: its rule, rows, tune file or environment; 0
    without a GPU or for another dtype."""
    import torch

    from .. import _lib

    arch, gpu = _device()
    if not arch or dtype not in (torch.bfloat16, torch.float16):
        return 0
    shape = f"linear:{'bf16' if dtype == torch.bfloat16 else 'fp16'}:N{int(N)}:K{int(K)}"
    try:
        return int(_lib.tune_get(key, arch, gpu, shape, 1)[0])
    except Exception:
        return 0


def rows_allowed(N: int, K: int, dtype) -> int:
    """The most rows at which a [N, K] projection gets the add + RMSNorm form on this GPU: the
    linear op's linear.norm_rows."""
    return linear_tunable("linear.norm_rows", N, K, dtype)


def _range_end(compile_range) -> int | None:
    """The most tokens a graph compiled for compile_range runs (None: not known)."""
    end = getattr(compile_range, "end", None)
    return end if isinstance(end, int) else None


def _current_range_end() -> int | None:
    try:
        from vllm.compilation.passes.inductor_pass import get_pass_context

        return _range_end(get_pass_context().compile_range)
    except Exception:  # no pass context (a pass called outside vLLM's compile)
        return None


def _val(n):
    import torch

    v = n.meta.get("val") if n is not None else None
    return v if isinstance(v, torch.Tensor) else None


def _norm_parts(node, norm_op):
    """((x, residual, norm_weight, eps), getitem 0, getitem 1 or None, the one user of getitem 0)
    if node is the norm with 2-D x and residual of one shape, bf16/fp16, a norm weight [K] of their
    dtype and no variance_size, whose normalized rows feed one node; else None."""
    if node.op != "call_function" or node.target is not norm_op or node.kwargs:
        return None
    import torch
    from torch.fx import Node

    args = node.args[:4] if len(node.args) == 5 and node.args[4] is None else node.args
    if len(args) != 4:
        return None
    x, res, nw, eps = args
    if not all(isinstance(a, Node) for a in (x, res, nw)) or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    gets = {}
    for u in node.users:
        i = u.args[1] if u.target is operator.getitem and len(u.args) == 2 and not u.kwargs else None
        if u.op != "call_function" or i not in (0, 1) or i in gets:
            return None
        gets[i] = u
    g0 = gets.get(0)
    if g0 is None or len(g0.users) != 1:
        return None
    xv, rv, nv, out = _val(x), _val(res), _val(nw), node.meta.get("val")
    if any(v is None for v in (xv, rv, nv)) or not (isinstance(out, (tuple, list)) and len(out) == 2):
        return None
    dt = xv.dtype
    if dt not in (torch.bfloat16, torch.float16) or xv.dim() != 2 or not _same(xv.shape, rv.shape) or rv.dtype != dt:
        return None
    if nv.dim() != 1 or nv.dtype != dt or not _same(nv.shape, xv.shape[1:]):
        return None
    return (x, res, nw, float(eps)), g0, gets.get(1), next(iter(g0.users))


def _same(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(p == q) for p, q in zip(a, b))


def _defined_before(order, node, *deps) -> bool:
    return all(not isinstance(n, type(node)) or order.get(n, len(order)) < order[node] for n in deps)


def _match(node, order, ops, max_tokens=None):
    """The rewrite if `node` starts norm -> linear, else None: (args, getitem 1, the replaced
    node, dead nodes). max_tokens: the most rows the graph runs (its compile range), which the
    shape's linear.norm_rows must allow. ops: (norm, linear[, linear_qk]): a linear_qk call (the
    q/k epilogue's projection, rope_seam) matches too, its other arguments passed on after bias."""
    norm_op, linear_op = ops[:2]
    qk_op = ops[2] if len(ops) > 2 else None
    parts = _norm_parts(node, norm_op)
    if parts is None:
        return None
    from torch.fx import Node

    (x, res, nw, eps), g0, g1, lin = parts
    extra = ()
    if qk_op is not None and lin.op == "call_function" and lin.target is qk_op:
        if len(lin.args) != 12 or lin.kwargs or lin.args[0] is not g0:
            return None
        extra = tuple(lin.args[3:])
        if not _defined_before(order, node, *(a for a in extra if isinstance(a, Node))):
            return None
    elif lin.op != "call_function" or lin.target is not linear_op or not 2 <= len(lin.args) <= 3 \
            or lin.args[0] is not g0 or set(lin.kwargs) - {"bias"} or (len(lin.args) == 3 and lin.kwargs):
        return None
    W = lin.args[1]
    bias = lin.args[2] if len(lin.args) >= 3 else lin.kwargs.get("bias")
    if not isinstance(W, Node) or not (bias is None or isinstance(bias, Node)) or not _defined_before(order, node, W, bias):
        return None
    xv, wv, bv = _val(x), _val(W), _val(bias)
    dt = xv.dtype
    if wv is None or (bias is not None and bv is None) or _val(lin) is None:
        return None
    if wv.dim() != 2 or wv.dtype != dt or not _same(wv.shape[1:], xv.shape[1:]):
        return None
    if bv is not None and (bv.dim() != 1 or bv.dtype != dt or not _same(bv.shape, wv.shape[:1])):
        return None
    if max_tokens is not None:  # vLLM's weights have static shapes; a symbolic one is not fused
        N, K = wv.shape
        if not (isinstance(N, int) and isinstance(K, int)) or rows_allowed(N, K, dt) < max_tokens:
            return None
    return (x, res, nw, eps, W, bias, *extra), g1, lin, [lin, g0, g1, node]


def _rewrite(graph, node, fused_op, args, g1, replaced, dead):
    """fused_op(args) in place of node, its output 0 in place of `replaced` and 1 of getitem 1;
    then the dead nodes erased, users first."""
    with graph.inserting_after(node):
        fused = graph.call_function(fused_op, args)
    with graph.inserting_after(fused):
        y = graph.call_function(operator.getitem, (fused, 0))
    y.meta["val"] = replaced.meta["val"]
    fused.meta["val"] = (y.meta["val"], node.meta["val"][1] if g1 is None else g1.meta["val"])
    replaced.replace_all_uses_with(y)
    if g1 is not None:
        with graph.inserting_after(y):
            r = graph.call_function(operator.getitem, (fused, 1))
        r.meta["val"] = g1.meta["val"]
        g1.replace_all_uses_with(r)
    for d in dead:
        if d is not None:
            graph.erase_node(d)


# ---- add + RMSNorm into a MoE layer's router gate ---------------------------------------------

MOE_OP_NAME = "opgraft::add_rms_norm_moe"
_MOE_KWARGS = {"router_logits", "shared_experts_input", "input_ids", "layer_name", "hidden_dim_unpadded"}
_fused_moe_total = 0
_moe_refusals = set()
_moe_form = False


def moe_switch() -> bool | None:
    """OPGRAFT_NORM_FUSION_MOE: True (1), False (0), None (unset or malformed, which warns once)."""
    return switch("OPGRAFT_NORM_FUSION_MOE", dispatch._warn_once)


def num_experts(vllm_config) -> int:
    """The experts of vllm_config's model (0: not a MoE model, or no model config)."""
    try:
        return int(vllm_config.model_config.get_num_experts() or 0)
    except Exception:
        return 0


def moe_enabled(vllm_config=None) -> bool:
    """Does the pass also put the add + RMSNorm before a MoE layer into the layer's router gate: the
    switch where set, else for a model that gets the q/k epilogue (why: the module's docstring).
    No config: the switch alone."""
    on = moe_switch()
    if on is not None or vllm_config is None:
        return bool(on)
    from . import rope_seam

    return rope_seam.installed() and rope_seam.qk_model(vllm_config)


def moe_form_on() -> bool:
    """Does the newest pass built in this process put the norm into every MoE layer's router gate
    (the MoE form on, and each layer of the model taking it: moe_rows)? vLLM builds the pass
    manager's passes (VllmBackend.configure_post_pass) right before it splits that backend's graph,
    where the attention prologue seam asks."""
    return _moe_form


def _model_takes_form(config) -> bool:
    """Does every MoE layer of config's model take the MoE form at one row at least (moe_rows)?"""
    try:
        mc = config.model_config
        return _moe_rows_noted(mc.dtype, mc.get_hidden_size(), config) > 0
    except Exception:
        return False


def fused_moe_total() -> int:
    """Add + RMSNorm + MoE layer pairs the pass has fused in this process."""
    with _lock:
        return _fused_moe_total


@functools.lru_cache(maxsize=1)
def _linear_classes():
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return LinearBase, UnquantizedLinearMethod


def gate_reason(runner, dtype) -> str:
    """Why the norm cannot go into this MoE runner's router gate ("" if it can): the runner must run
    its gate itself, a vLLM linear layer with unquantized 2-D weights of the hidden states' dtype
    (not fused with a shared expert's gate)."""
    import torch

    linear_base, unquantized = _linear_classes()
    gate = getattr(runner, "gate", None)
    if gate is None:
        return "the MoE runner has no router gate of its own"
    if getattr(runner, "_fse_fuse_gate", False):
        return "router gate fused with a shared expert's gate"
    if not isinstance(gate, linear_base) or type(getattr(gate, "quant_method", None)) is not unquantized:
        return f"router gate {type(gate).__name__} is not an unquantized vLLM linear layer"
    w = getattr(gate, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != dtype:
        return "router gate weight is not 2-D in the hidden states' dtype"
    return ""


def _gate_bias(gate):
    return None if getattr(gate, "skip_bias_add", False) else getattr(gate, "bias", None)


def _moe_runners(config=None) -> list:
    """The model's MoE runners (the layers of vLLM's moe_forward op), from the forward context a
    compile runs in, or else config's (default: the current config's); [] where neither is there."""
    try:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
    except Exception:
        return []
    layers = None
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            layers = get_forward_context().no_compile_layers
    except Exception:
        layers = None
    if layers is None:
        try:
            from vllm.config import get_current_vllm_config_or_none

            cfg = config if config is not None else get_current_vllm_config_or_none()
            layers = cfg.compilation_config.static_forward_context if cfg is not None else None
        except Exception:
            layers = None
    return [v for v in (layers or {}).values() if isinstance(v, MoERunnerInterface)]


def moe_rows(dtype, K: int, config=None) -> tuple[int, str]:
    """(rows, "") with rows the most at which every MoE layer of the model gets the add + RMSNorm
    form on its router gate (the linear.norm_rows of its [E, K]), or (0, why not). config: where
    to find the layers outside a forward context (default: the current config)."""
    from ..ops.linear import MAX_ROWS

    runners = _moe_runners(config)
    if not runners:
        return 0, "no MoE layers found"
    rows = MAX_ROWS
    for r in runners:
        why = gate_reason(r, dtype)
        if not why and r.gate.weight.shape[1] != K:
            why = f"router gate of {r.gate.weight.shape[1]} inputs, hidden states of {K}"
        if why:
            return 0, f"{getattr(r, 'layer_name', type(r).__name__)}: {why}"
        rows = min(rows, rows_allowed(r.gate.weight.shape[0], K, dtype))
    return rows, "" if rows else "linear.norm_rows 0 for the router gate's shape"


def _moe_rows_noted(dtype, K: int, config=None) -> int:
    rows, why = moe_rows(dtype, K, config)
    if why and why not in _moe_refusals:
        _moe_refusals.add(why)
        dispatch.logger.info("opgraft: the add + RMSNorm before MoE layers stays vLLM's: %s", why)
    return rows


def _moe_call(af, g0, moe_op):
    """The layer name (a str, or the graph's LayerName node) if af is vLLM's
    moe_forward(g0, g0, None, None, layer_name, 0) in its functionalized form (auto_functionalized,
    vLLM's default, or its v2), else None."""
    import torch

    if af.op != "call_function" or len(af.args) != 1 or af.args[0] is not moe_op:
        return None
    kw = dict(af.kwargs)
    if af.target is torch.ops.higher_order.auto_functionalized:
        if kw.pop("hidden_states", None) is not g0:
            return None
    elif af.target is getattr(torch.ops.higher_order, "auto_functionalized_v2", None):
        bases = kw.pop("_all_bases", None)
        if kw.pop("_hidden_states_base_index", None) != 0 or not isinstance(bases, (list, tuple)) \
                or len(bases) != 1 or bases[0] is not g0:
            return None
    else:
        return None
    if set(kw) != _MOE_KWARGS or kw["router_logits"] is not g0 or kw["shared_experts_input"] is not None \
            or kw["input_ids"] is not None or kw["hidden_dim_unpadded"] != 0 or kw["layer_name"] is None:
        return None
    return kw["layer_name"]


def _match_moe(node, order, ops, max_tokens=None, rows_of=None):
    """The rewrite if `node` starts norm -> moe_forward (as _match's). rows_of(dtype, K): the most
    rows at which the model's router gates take the form (moe_rows), which must cover max_tokens
    (or 1 without a range)."""
    norm_op, moe_op = ops
    parts = _norm_parts(node, norm_op)
    if parts is None:
        return None
    (x, res, nw, eps), g0, g1, af = parts
    name = _moe_call(af, g0, moe_op)
    if name is None or not _defined_before(order, node, name):
        return None
    outs, dead = [], []
    for u in af.users:
        i = u.args[1] if u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2 else None
        if i == 0 and not outs and _val(u) is not None:
            outs.append(u)
        elif i == 1 and not u.users:  # the mutated hidden states, unused
            dead.append(u)
        else:
            return None
    dt, K = _val(x).dtype, _val(nw).shape[0]  # K a parameter's: static where x's may be symbolic
    if not outs or not isinstance(K, int) or rows_of is None or rows_of(dt, K) < (max_tokens or 1):
        return None
    return (x, res, nw, eps, name), g1, outs[0], [outs[0], *dead, af, g0, g1, node]


@functools.lru_cache(maxsize=1)
def _router_logits_class():
    import torch

    class RouterLogits(torch.nn.Module):
        """A runner's router gate for one call: its output, made already (with the norm)."""

        def __init__(self, logits):
            super().__init__()
            self.logits = logits

        def forward(self, hidden_states):
            return self.logits, None

    return RouterLogits


def _experts_from_logits(runner, h, logits):
    """The runner's own forward (vLLM's _forward_impl: routing, experts, its parallel steps) on the
    normalized h, its router gate's output being logits."""
    gate = runner.gate
    runner.gate = _router_logits_class()(logits)
    try:
        return runner._forward_impl(h, h, None, None)
    finally:
        runner.gate = gate


def _add_rms_norm_moe(x, residual, norm_weight, eps: float, layer_name):
    """(moe_forward of vLLM's add + RMSNorm of x and residual, x + residual). Where the layer's
    router gate takes it, one launch of our linear kernel does the norm and the gate and writes the
    normalized rows, which the layer's experts then read; otherwise vLLM's norm, then the layer as
    moe_forward runs it."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import get_layer_from_name
    from vllm.utils.torch_utils import _resolve_layer_name

    from ..ops import linear

    runner = get_layer_from_name(_resolve_layer_name(layer_name))  # once a call: it may count layers
    why = gate_reason(runner, x.dtype) if x.dim() == 2 else "hidden states not 2-D"
    if not why:
        gate = runner.gate
        made = linear.norm_linear_or_none(x, residual, norm_weight, eps, gate.weight, _gate_bias(gate), normed=True)
        if made is not None:
            logits, r, h = made
            return _experts_from_logits(runner, h, logits), r
    else:
        dispatch.stats_of("linear").delegate(f"router gate: {why}")
    h, r = linear.add_rms_norm(x, residual, norm_weight, eps)
    return runner._forward_impl(h, h, None, None), r


@functools.lru_cache(maxsize=1)
def moe_op():
    """torch.ops.opgraft.add_rms_norm_moe.default, registered on first use (its layer name is of
    vLLM's type: str, or LayerName with torch >= 2.11)."""
    import torch
    from vllm.utils.torch_utils import LayerNameType

    def add_rms_norm_moe(x, residual, norm_weight, eps, layer_name):
        return _add_rms_norm_moe(x, residual, norm_weight, eps, layer_name)

    T = torch.Tensor  # types, not strings: the schema is inferred from them
    add_rms_norm_moe.__annotations__ = dict(x=T, residual=T, norm_weight=T, eps=float, layer_name=LayerNameType,
                                            **{"return": tuple[T, T]})
    custom = torch.library.custom_op(MOE_OP_NAME, mutates_args=())(add_rms_norm_moe)
    custom.register_fake(lambda x, residual, norm_weight, eps, layer_name: (torch.empty_like(x),
                                                                            torch.empty_like(x)))
    return torch.ops.opgraft.add_rms_norm_moe.default


def _moe_forward():
    """torch.ops.vllm.moe_forward.default, or None where vLLM has no such op."""
    try:
        import torch
        from vllm.model_executor.layers.fused_moe.runner import moe_runner  # noqa: F401  (registers the op)

        return torch.ops.vllm.moe_forward.default
    except Exception:
        return None


def pass_class():
    """The pass (a VllmInductorPass subclass), defined on first use: vLLM is imported only here."""
    global _pass_cls
    with _lock:  # one class per process: configure recognizes its pass by it
        if _pass_cls is None:
            _pass_cls = _define_pass_class()
        return _pass_cls


def _define_pass_class():
    import torch
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

    from ..ops import linear as _op  # noqa: F401  (registers opgraft::linear, opgraft::add_rms_norm_linear)

    class OpgraftNormLinearFusionPass(VllmInductorPass):
        """fused_add_rms_norm -> getitem 0 -> opgraft.linear  ==>  opgraft.add_rms_norm_linear (and
        -> opgraft.linear_qk  ==>  opgraft.add_rms_norm_linear_qk)."""

        def __init__(self, config):
            global _moe_form
            super().__init__(config)
            self.fused = 0  # in all graphs this instance has seen
            self.fused_moe = 0
            self._ops = (torch.ops.vllm_ir.fused_add_rms_norm.default, torch.ops.opgraft.linear.default,
                         torch.ops.opgraft.linear_qk.default)
            self._fused_op = torch.ops.opgraft.add_rms_norm_linear.default
            self._fused_qk_op = torch.ops.opgraft.add_rms_norm_linear_qk.default
            self.moe = moe_enabled(config) and _moe_forward() is not None
            _moe_form = self.moe and _model_takes_form(config)
            if self.moe:
                self._moe_ops = (self._ops[0], _moe_forward())
                self._moe_fused_op = moe_op()

        def is_applicable_for_range(self, compile_range) -> bool:
            # Only graphs of decode-sized batches: vLLM compiles a separate graph for more tokens
            # (the endpoint _set_compile_ranges adds), which keeps vLLM's norm.
            end = _range_end(compile_range)
            return end is not None and end <= _op.MAX_ROWS

        @VllmInductorPass.time_and_log
        def __call__(self, graph):
            global _fused_total, _fused_moe_total
            order = {n: i for i, n in enumerate(graph.nodes)}
            count = moe_count = 0
            end = _current_range_end()
            rows_of = functools.lru_cache(maxsize=None)(_moe_rows_noted) if self.moe else None
            for node in list(graph.nodes):
                m = _match(node, order, self._ops, end)
                if m is not None:
                    _rewrite(graph, node, self._fused_op if len(m[0]) == 6 else self._fused_qk_op, *m)
                    count += 1
                elif self.moe and (m := _match_moe(node, order, self._moe_ops, end, rows_of)) is not None:
                    _rewrite(graph, node, self._moe_fused_op, *m)
                    moe_count += 1
            self.fused += count
            self.fused_moe += moe_count
            with _lock:
                _fused_total += count
                _fused_moe_total += moe_count
            dispatch.logger.debug("opgraft: fused %d add + RMSNorm + linear pair(s) and %d add + RMSNorm + MoE "
                                  "pair(s) in this graph", count, moe_count)

        def uuid(self):
            return _source_hash() + (" moe" if self.moe else "")

    return OpgraftNormLinearFusionPass


def _make_configure(original):
    def configure(self, config):
        original(self, config)
        cls = pass_class()
        if not any(isinstance(p, cls) for p in self.passes):
            self.add(cls(config))

    configure.__doc__ = (original.__doc__ or "") + "\n\n(wrapped by opgraft: see opgraft/vllm/norm_seam.py)"
    setattr(configure, _PATCH_ATTR, original)
    return configure


def qkv_shape(vllm_config):
    """(N, K, dtype) of the model's qkv projection on this rank, or None."""
    try:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        K = mc.get_hidden_size()
        N = (mc.get_num_attention_heads(pc) + 2 * mc.get_num_kv_heads(pc)) * mc.get_head_size()
        return int(N), int(K), mc.dtype
    except Exception:
        return None


def qkv_rows(vllm_config) -> int:
    """linear.norm_rows of the model's qkv projection on this GPU (this rank's [N, K]), or 0."""
    shape = qkv_shape(vllm_config)
    return rows_allowed(*shape) if shape else 0


def router_rows(vllm_config) -> int:
    """linear.norm_rows of the model's MoE router gate [experts, hidden] on this GPU, or 0 (no
    experts, or the MoE form off)."""
    try:
        mc, E = vllm_config.model_config, num_experts(vllm_config)
        return rows_allowed(E, mc.get_hidden_size(), mc.dtype) if E > 0 and moe_enabled(vllm_config) else 0
    except Exception:
        return 0


def _make_set_compile_ranges(original):
    def _set_compile_ranges(self):
        original(self)
        # A graph for 1..E tokens (E: the qkv projection's linear.norm_rows), where the pass fuses,
        # and vLLM's own above E, as vLLM's rope + KV-cache fusion splits its ranges; with the MoE
        # form, one more endpoint at the router gate's rows where they are more (its range fuses
        # the router's norm only). Like vLLM's own check of user endpoints, none at 1 (a one-size
        # range): E = 1 fuses nothing.
        cc = self.compilation_config
        end = self.scheduler_config.max_num_batched_tokens if self.scheduler_config is not None else None
        ends = {qkv_rows(self), router_rows(self)} if self.model_config is not None else set()
        points = list(cc.compile_ranges_endpoints or [])
        new = [e for e in ends if e >= 2 and end is not None and e < end and e not in points]
        if new:
            cc.compile_ranges_endpoints = sorted(points + new)

    setattr(_set_compile_ranges, _PATCH_ATTR, original)
    return _set_compile_ranges


def _compile_factor() -> str:
    return f"{package_tag()}, norm fusion on{_moe_said()}"


def _moe_said() -> str:
    on = moe_switch()
    return ", MoE layers too" if on else "" if on is False else ", MoE layers with the q/k epilogue"


def _add_compile_factor() -> None:
    add_compile_factor(COMPILE_FACTOR, _compile_factor)


def _remove_compile_factor() -> None:
    remove_compile_factor(COMPILE_FACTOR, _compile_factor)


def install() -> tuple[bool, str]:
    """Patches PostGradPassManager.configure once; returns (installed, message)."""
    cls, why = _target()
    if cls is None:
        return False, why
    current = cls.__dict__["configure"]
    if hasattr(current, _PATCH_ATTR):
        return True, "norm fusion seam already installed"
    if not _signature_matches(current):
        return False, "vllm's PostGradPassManager.configure has an unexpected signature (another vLLM version?)"
    if not linear_seam.installed():
        return False, "the linear seam is not installed (the fused pattern is made of its op)"
    if dispatch.selected_variant("linear") == "passthrough":
        return False, "the linear variant is passthrough (no linear op in the graph to fuse into)"
    try:
        pass_class()
        if moe_switch() is not False:  # registered with the seam: a graph loaded from vLLM's compile cache may call it
            moe_op()
    except Exception as e:
        return False, f"the fusion pass cannot be built ({type(e).__name__}: {e})"
    from vllm.config import VllmConfig

    ranges = VllmConfig.__dict__.get("_set_compile_ranges")
    if not callable(ranges):
        return False, "vllm's VllmConfig._set_compile_ranges is not where opgraft expects it"
    cls.configure = _make_configure(current)
    if not hasattr(ranges, _PATCH_ATTR):
        VllmConfig._set_compile_ranges = _make_set_compile_ranges(ranges)
    _add_compile_factor()
    return True, ("norm fusion seam installed (PostGradPassManager.configure adds the add + RMSNorm + linear pass"
                  f"{_moe_said()})")


def _loaded_class():
    """PostGradPassManager if its module is loaded (never loaded: never patched), else None."""
    return getattr(sys.modules.get("vllm.compilation.passes.pass_manager"), "PostGradPassManager", None)


def uninstall() -> None:
    restore(_loaded_class(), "configure", _PATCH_ATTR)
    restore(getattr(sys.modules.get("vllm.config"), "VllmConfig", None), "_set_compile_ranges", _PATCH_ATTR)
    _remove_compile_factor()


def installed() -> bool:
    cls = _loaded_class()
    return cls is not None and hasattr(cls.__dict__.get("configure"), _PATCH_ATTR)
