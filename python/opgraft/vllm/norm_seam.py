"""Norm fusion seam: a post-grad pass that folds add + RMSNorm into the projection after it.

What is patched: `PostGradPassManager.configure(self, config)` in
vllm/compilation/passes/pass_manager.py and `VllmConfig._set_compile_ranges(self)` in
vllm/config/vllm.py (same signatures in vLLM 0.26.0, the pinned release, and 0.33.0, the newest;
both tested in CI). The wrapper calls vLLM's configure, then appends opgraft's
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
left to vLLM. The pass's uuid (part of the pass manager's Inductor cache key) hashes this module's
source; install() also adds a factor (OPGRAFT_NORM_FUSION_SEAM) to the environment factors of
vLLM's compile cache, as the linear seam does.

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
from .compat import add_compile_factor, remove_compile_factor, restore, switched_off

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
    global _fused_total
    with _lock:
        _fused_total = 0


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

    from .. import __version__

    try:  # the matcher lives outside the class: hash the whole module, not the class's source
        src = inspect.getsource(sys.modules[__name__])
    except (OSError, TypeError):
        src = ""
    return InductorPass.hash_source(f"opgraft {__version__}\n{src}")


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


def rows_allowed(N: int, K: int, dtype) -> int:
    """The most rows at which a [N, K] projection gets the add + RMSNorm form on this GPU: the
    linear op's linear.norm_rows (its rule, rows, tune file or environment), 0 without a GPU."""
    import torch

    from .. import _lib

    arch, gpu = _device()
    if not arch or dtype not in (torch.bfloat16, torch.float16):
        return 0
    key = f"linear:{'bf16' if dtype == torch.bfloat16 else 'fp16'}:N{int(N)}:K{int(K)}"
    try:
        return int(_lib.tune_get("linear.norm_rows", arch, gpu, key, 1)[0])
    except Exception:
        return 0


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


def _match(node, order, ops, max_tokens=None):
    """The nodes to rewrite if `node` starts the pattern, else None. max_tokens: the most rows
    the graph runs (its compile range), which the shape's linear.norm_rows must allow."""
    norm_op, linear_op = ops
    if node.op != "call_function" or node.target is not norm_op or node.kwargs:
        return None
    import torch
    from torch.fx import Node
    from torch.fx.experimental.symbolic_shapes import statically_known_true

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
    g0, g1 = gets.get(0), gets.get(1)
    if g0 is None or len(g0.users) != 1:
        return None
    lin = next(iter(g0.users))
    if lin.op != "call_function" or lin.target is not linear_op or not 2 <= len(lin.args) <= 3 \
            or lin.args[0] is not g0 or set(lin.kwargs) - {"bias"} or (len(lin.args) == 3 and lin.kwargs):
        return None
    W = lin.args[1]
    bias = lin.args[2] if len(lin.args) == 3 else lin.kwargs.get("bias")
    if not isinstance(W, Node) or not (bias is None or isinstance(bias, Node)):
        return None
    if any(n is not None and order.get(n, len(order)) >= order[node] for n in (W, bias)):  # W, bias: defined before
        return None

    def val(n):
        v = n.meta.get("val") if n is not None else None
        return v if isinstance(v, torch.Tensor) else None

    def same(a, b):
        return len(a) == len(b) and all(statically_known_true(p == q) for p, q in zip(a, b))

    xv, rv, nv, wv, bv = val(x), val(res), val(nw), val(W), val(bias)
    out = node.meta.get("val")
    if any(v is None for v in (xv, rv, nv, wv)) or (bias is not None and bv is None) or val(lin) is None \
            or not (isinstance(out, (tuple, list)) and len(out) == 2):
        return None
    dt = xv.dtype
    if dt not in (torch.bfloat16, torch.float16) or xv.dim() != 2 or not same(xv.shape, rv.shape) or rv.dtype != dt:
        return None
    if nv.dim() != 1 or nv.dtype != dt or not same(nv.shape, xv.shape[1:]):
        return None
    if wv.dim() != 2 or wv.dtype != dt or not same(wv.shape[1:], xv.shape[1:]):
        return None
    if bv is not None and (bv.dim() != 1 or bv.dtype != dt or not same(bv.shape, wv.shape[:1])):
        return None
    if max_tokens is not None:  # vLLM's weights have static shapes; a symbolic one is not fused
        N, K = wv.shape
        if not (isinstance(N, int) and isinstance(K, int)) or rows_allowed(N, K, dt) < max_tokens:
            return None
    return (x, res, nw, float(eps), W, bias), g0, g1, lin


def _rewrite(graph, node, fused_op, args, g0, g1, lin):
    with graph.inserting_after(node):
        fused = graph.call_function(fused_op, args)
    with graph.inserting_after(fused):
        y = graph.call_function(operator.getitem, (fused, 0))
    y.meta["val"] = lin.meta["val"]
    fused.meta["val"] = (y.meta["val"], node.meta["val"][1] if g1 is None else g1.meta["val"])
    lin.replace_all_uses_with(y)
    if g1 is not None:
        with graph.inserting_after(y):
            r = graph.call_function(operator.getitem, (fused, 1))
        r.meta["val"] = g1.meta["val"]
        g1.replace_all_uses_with(r)
    for dead in (lin, g0, g1, node):
        if dead is not None:
            graph.erase_node(dead)


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
        """fused_add_rms_norm -> getitem 0 -> opgraft.linear  ==>  opgraft.add_rms_norm_linear."""

        def __init__(self, config):
            super().__init__(config)
            self.fused = 0  # in all graphs this instance has seen
            self._ops = (torch.ops.vllm_ir.fused_add_rms_norm.default, torch.ops.opgraft.linear.default)
            self._fused_op = torch.ops.opgraft.add_rms_norm_linear.default

        def is_applicable_for_range(self, compile_range) -> bool:
            # Only graphs of decode-sized batches: vLLM compiles a separate graph for more tokens
            # (the endpoint _set_compile_ranges adds), which keeps vLLM's norm.
            end = _range_end(compile_range)
            return end is not None and end <= _op.MAX_ROWS

        @VllmInductorPass.time_and_log
        def __call__(self, graph):
            global _fused_total
            order = {n: i for i, n in enumerate(graph.nodes)}
            count = 0
            end = _current_range_end()
            for node in list(graph.nodes):
                m = _match(node, order, self._ops, end)
                if m is not None:
                    _rewrite(graph, node, self._fused_op, *m)
                    count += 1
            self.fused += count
            with _lock:
                _fused_total += count
            dispatch.logger.debug("opgraft: fused %d add + RMSNorm + linear pair(s) in this graph", count)

        def uuid(self):
            return _source_hash()

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


def qkv_rows(vllm_config) -> int:
    """linear.norm_rows of the model's qkv projection on this GPU (this rank's [N, K]), or 0."""
    try:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        K = mc.get_hidden_size()
        N = (mc.get_num_attention_heads(pc) + 2 * mc.get_num_kv_heads(pc)) * mc.get_head_size()
        return rows_allowed(N, K, mc.dtype)
    except Exception:
        return 0


def _make_set_compile_ranges(original):
    def _set_compile_ranges(self):
        original(self)
        # A graph for 1..E tokens (E: the qkv projection's linear.norm_rows), where the pass fuses,
        # and vLLM's own above E, as vLLM's rope + KV-cache fusion splits its ranges. Like vLLM's
        # own check of user endpoints, none at 1 (a one-size range): E = 1 fuses nothing.
        cc = self.compilation_config
        end = self.scheduler_config.max_num_batched_tokens if self.scheduler_config is not None else None
        e = qkv_rows(self) if self.model_config is not None else 0
        points = list(cc.compile_ranges_endpoints or [])
        if e >= 2 and end is not None and e < end and e not in points:
            cc.compile_ranges_endpoints = sorted(points + [e])

    setattr(_set_compile_ranges, _PATCH_ATTR, original)
    return _set_compile_ranges


def _compile_factor() -> str:
    from .. import __version__

    return f"opgraft {__version__}, norm fusion on"


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
    return True, "norm fusion seam installed (PostGradPassManager.configure adds the add + RMSNorm + linear pass)"


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
