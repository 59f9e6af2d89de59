"""Attention prologue seam: vLLM's q/k RMSNorm and rotary embedding done by opgraft's attention kernel.

Why: in a decode step of Qwen3-style models every layer runs, between the qkv projection and
attention, the q/k RMSNorm and the rotary embedding as two Inductor kernels of their own (about
2.8 us a layer at batch 1 on an H200, bench/NOTES.md v42). Our decode kernel already loads the
query and the new key and writes the key to the cache; with the prologue (ABI 11) it normalizes
and rotates them in registers first, so those kernels go.

Why not a post-grad pass: vLLM splits the Dynamo graph at its attention ops before Inductor sees
it (vllm/compilation/backends.py, split_graph), so the norm and rotary embedding are compiled in the
piece before the attention op and no Inductor pass sees both. The rewrite runs on the Dynamo
graph, right before that split.

What is patched (vLLM 0.26.0, the pinned release, and 0.34.0, both tested in CI, and 0.33.0):
1. `vllm.compilation.backends.split_graph(graph, splitting_ops)` (a module function that
   VllmBackend.__call__ looks up at call time): where vLLM splits at
   vllm::unified_attention_with_output, the wrapper first rewrites each
       q, k, v = split(qkv); q = view(rms_norm(view(q))); k = ... (the norm optional)
       _C.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)   # in place
       unified_attention_with_output(view(q), view(k), v, output, layer_name)
   into opgraft::rope_attention(q, k, v, output, layer_name, positions, cos_sin_cache, head_size,
   is_neox, q_norm_weight, k_norm_weight, eps) with the raw q and k (layer_name of vLLM's type,
   LayerNameType, passed through), and splits at that op too.
   Anything else (another user of the normed or rotated tensors, a KV-cache update op of its own,
   output scales, a partial rotary dimension) is left as it is.
2. `VllmConfig._set_compile_ranges` (called in VllmConfig.__post_init__): adds "+rotary_embedding"
   to compilation_config.custom_ops unless the user wrote "-rotary_embedding", so the rotary
   embedding is one op in the graph (vLLM does the same for its own q/k norm + rope fusion,
   enable_qk_norm_rope_fusion; its native form is some twenty nodes a tensor).
The op (registered here: it needs vLLM's forward context) finds the layer through vLLM's
get_attention_context; OpgraftFlashAttentionImpl.forward_prologue runs our kernel with the
prologue for decode batches it takes, and otherwise the norm and rotary embedding and then the
layer's forward, which is stock vLLM's order. A layer of another backend gets the same. That norm
and rotary embedding (every prefill's: the rewrite holds in every compile range) is our kernel
alone (ABI 13, one pass) where the library takes it, else vLLM's ops: a copy of q|k|v and its
fused_qk_norm_rope cost a prefill 2-2.6% of its GPU time against Inductor's two kernels (v45).

When: unset, together with the norm fusion's MoE form, in graphs with MoE layers: that form is on
with OPGRAFT_NORM_FUSION_MOE=1 or, unset, for the models that get the q/k epilogue below, which
then takes the graphs it rewrites; so off by default elsewhere. The pair measured batch-1 ITL 3-6%
below opgraft without it on Qwen3-30B-A3B, either part alone no faster (the prologue alone up to 5% slower at batch 1):
bench/NOTES.md v46; but its first token at batch 1 was twice opgraft's without it under vLLM's
serve capture sizes (v48: the prefill's norm and rotary leave vLLM's graphs for this op, whose
host path per layer costs more than Inductor's kernels in a replayed graph).
OPGRAFT_ATTENTION_PROLOGUE=1 takes every model, 0 none. It needs the attention
seam with its KV-cache write (OPGRAFT_ATTENTION and OPGRAFT_ATTENTION_CACHE_WRITE not 0). A factor
(OPGRAFT_ATTENTION_PROLOGUE_SEAM) joins vLLM's compile-cache key.
The q/k epilogue form (OPGRAFT_QK_EPILOGUE=1 every model, 0 none; unset: each projection whose
[N, K] has the linear op's linear.qk_epilogue on this GPU: a row for Qwen3-30B-A3B's qkv on the
H100; sm_90; bench/NOTES.md v61, v63): the same wrapper first rewrites opgraft::linear(x, W, bias)
-> split -> norms -> rotary into opgraft::linear_qk (ops/linear.py), the qkv projection whose
kernel normalizes and rotates its query and key heads in its epilogue (kernels/linear/linear.cu,
OG_QKPRO); vLLM's attention call stays and gets the split of that output. The op is not a splitting
op: a prefill keeps it inside vLLM's graph pieces (the linear op, then the prologue alone, above
linear.max_rows), so no eager host path is added; decode attention then follows the projection
directly, as the early start needs (linear.trigger on qkv; the backend's writing layers pass the
OPGRAFT_ATTN_AFTER_QKV hint, so attention takes attention.pdl_pro). It needs the linear seam (its
op is what is matched). Where it rewrote nothing, the prologue form above may still apply. Its
decision joins the factor.
Remove it: delete the ("attention prologue", rope_seam) entry of the seam list in
opgraft/vllm/__init__.py.
"""

from __future__ import annotations

import functools
import sys
import threading

from .. import _lib, dispatch
from . import attn_seam
from .compat import add_compile_factor, package_tag, remove_compile_factor, restore, switch, tunables_tag

_PATCH_ATTR = "_opgraft_original_split_graph"
_RANGES_ATTR = "_opgraft_rope_original_set_compile_ranges"
COMPILE_FACTOR = "OPGRAFT_ATTENTION_PROLOGUE_SEAM"
OP_NAME = "opgraft::rope_attention"
_ATTN_OP = "vllm::unified_attention_with_output"
_ROPE_OP = "_C::rotary_embedding"
_NORM_OP = "vllm_ir::rms_norm"
_MOE_OP = "vllm::moe_forward"

_lock = threading.Lock()
_fused_total = 0  # attention calls given the prologue
_qk_fused_total = 0  # qkv projections given the q/k epilogue


def switch_state() -> bool | None:
    """OPGRAFT_ATTENTION_PROLOGUE: True (1: every model), False (0: none), None (unset or malformed,
    which warns once: with the norm fusion's MoE form)."""
    return switch("OPGRAFT_ATTENTION_PROLOGUE", dispatch._warn_once)


def enabled() -> bool:
    """May the seam be installed (the switch is not 0)?"""
    return switch_state() is not False


def wanted(vllm_config) -> bool:
    """Does this config's model get a rewrite (so its rotary embedding must be one op): the q/k
    epilogue (qk_model), or the prologue: the switch where it is set, else where the norm fusion's
    MoE form is on for a model with experts (the pair, NOTES v46)."""
    if qk_model(vllm_config):
        return True
    on = switch_state()
    if on is not None:
        return on
    from . import norm_seam

    return norm_seam.num_experts(vllm_config) > 0 and norm_seam.installed() and norm_seam.moe_enabled(vllm_config)


def _graph_wanted(graph) -> bool:
    """In this graph (where vLLM splits at attention): the switch where it is set, else where the
    pass built for this graph puts the norm into every MoE layer's router gate and the graph has a
    MoE layer."""
    on = switch_state()
    if on is not None:
        return on
    from . import norm_seam

    return norm_seam.moe_form_on() and any(_is(n, _MOE_OP) for n in graph.graph.nodes)


def disabled() -> str:
    """Why the seam must not be installed ("" if it may)."""
    if not enabled():
        return "attention prologue off (OPGRAFT_ATTENTION_PROLOGUE=0)"
    if not attn_seam.kernel_enabled():
        return "attention prologue off with the attention kernel (OPGRAFT_ATTENTION=0)"
    if not attn_seam.cache_write_enabled():
        return "attention prologue off with the kernel's KV-cache write (OPGRAFT_ATTENTION_CACHE_WRITE=0)"
    return ""


def fused_total() -> int:
    """Attention calls the rewrite has given the prologue in this process."""
    with _lock:
        return _fused_total


def qk_fused_total() -> int:
    """qkv projections the q/k epilogue rewrite has given the norm and rotary embedding in this process."""
    with _lock:
        return _qk_fused_total


# ---- the op ------------------------------------------------------------------------------------


def _has_fused() -> bool:
    import torch

    return hasattr(torch.ops._C, "fused_qk_norm_rope")


def vllm_prologue(q, k, pro, head_size: int, v=None):
    """vLLM's q/k RMSNorm and rotary embedding of the raw q [T, Hq*D] and k [T, Hk*D] (v [T, Hk, D]
    beside them): new tensors, the caller's untouched. With both parts, where vLLM's _C library has
    it: one copy of q|k|v and vLLM's fused_qk_norm_rope on it (the kernel vLLM's own
    enable_qk_norm_rope_fusion runs); otherwise its rms_norm op (vllm_ir) and its rotary_embedding op
    (_C, in place on copies)."""
    import torch

    T, neox = q.shape[0], pro.rope_style == _lib.ROPE_NEOX
    if pro.q_norm_weight is not None and v is not None and _has_fused():
        try:
            from vllm import _custom_ops

            hq, hk = q.shape[1] // head_size, k.shape[1] // head_size
            buf = torch.cat((q, k, v.reshape(T, -1)), dim=-1)
            _custom_ops.fused_qk_norm_rope(buf, hq, hk, hk, head_size, pro.eps, pro.q_norm_weight, pro.k_norm_weight,
                                           pro.cos_sin_cache, neox, pro.positions[:T])
            return buf[:, :hq * head_size], buf[:, hq * head_size:(hq + hk) * head_size]
        except Exception as e:  # not in this vLLM build, or a shape it refuses: the ops one by one
            dispatch._warn_once(f"vLLM's fused_qk_norm_rope unavailable for the attention prologue's hand-back: {e}")
    if pro.q_norm_weight is not None:
        q = torch.ops.vllm_ir.rms_norm(q.reshape(T, -1, head_size), pro.q_norm_weight, pro.eps, None).reshape(T, -1)
        k = torch.ops.vllm_ir.rms_norm(k.reshape(T, -1, head_size), pro.k_norm_weight, pro.eps, None).reshape(T, -1)
    else:
        q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
    torch.ops._C.rotary_embedding(pro.positions, q, k, head_size, pro.cos_sin_cache, neox)
    return q, k


@functools.lru_cache(maxsize=1)
def _modules():
    """vLLM's attention module and torch utils, and our attention op's module, imported once: the op
    runs once a layer in every prefill, where an import statement costs microseconds a call."""
    import vllm.model_executor.layers.attention.attention as vllm_attention
    from vllm.utils import torch_utils

    from ..ops import attention as ours

    return vllm_attention, torch_utils, ours


def _rope_attention(q, k, v, output, layer_name, positions, cos_sin_cache, head_size: int, is_neox: bool,
                    q_norm_weight, k_norm_weight, eps: float) -> None:
    vllm_attention, torch_utils, ours = _modules()
    md, layer, kv_cache, _ = vllm_attention.get_attention_context(torch_utils._resolve_layer_name(layer_name))
    pro = ours.QKPrologue(q_norm_weight, k_norm_weight, eps, cos_sin_cache, positions,
                          _lib.ROPE_NEOX if is_neox else _lib.ROPE_GPTJ)
    fwd = getattr(layer.impl, "forward_prologue", None)
    if fwd is not None:
        fwd(layer, q, k, v, kv_cache, md, output, pro)
    else:
        unfused(layer.impl, layer, q, k, v, kv_cache, md, output, pro, head_size)


def prologue(q, k, pro, head_size: int, v=None):
    """The norm and rotary embedding of the rows the decode kernel does not take (a prefill's): our
    kernel alone (ops.attention.qk_prologue: one pass, the decode kernel's bits) on CUDA tensors,
    else, or where the library refuses the call, vLLM's (vllm_prologue). New tensors [T, heads*D]."""
    if q.is_cuda:
        T = q.shape[0]
        try:
            qn, kn = _modules()[2].qk_prologue(q.view(T, -1, head_size), k.view(T, -1, head_size), pro)
            return qn.view(T, -1), kn.view(T, -1)
        except _lib.OpgraftError as e:
            dispatch._info_once(f"attention prologue alone handed back to vLLM's norm and rotary: {e}")
        except Exception as e:
            dispatch._warn_once(f"attention prologue alone failed, vLLM's norm and rotary instead: {e}")
    return vllm_prologue(q, k, pro, head_size, v)


def unfused(impl, layer, q, k, v, kv_cache, md, output, pro, head_size: int):
    """vLLM's order: the norm and rotary embedding (prologue), then the impl's forward."""
    qn, kn = prologue(q, k, pro, head_size, v)
    T = q.shape[0]
    return impl.forward(layer, qn.view(T, -1, head_size), kn.view(T, -1, head_size), v, kv_cache, md, output)


_op_lib = None  # the torch.library.Library the op lives in: the op lives as long as it


@functools.lru_cache(maxsize=1)
def op():
    """torch.ops.opgraft.rope_attention.default, registered on first use (it mutates output, as
    vLLM's attention op does, and returns nothing). Defined through a Library fragment, as vLLM's
    direct_register_custom_op does, not torch.library.custom_op: every prefill calls it eagerly, and
    a call costs 2.7 us of host time that way against 8.7-14.5 (CPU, bench/NOTES.md v47)."""
    global _op_lib
    import torch
    from vllm.utils.torch_utils import LayerNameType  # vLLM's layer-name type: str, or LayerName (torch >= 2.11)

    def rope_attention(q, k, v, output, layer_name, positions, cos_sin_cache, head_size, is_neox, q_norm_weight,
                       k_norm_weight, eps):
        _rope_attention(q, k, v, output, layer_name, positions, cos_sin_cache, head_size, is_neox, q_norm_weight,
                        k_norm_weight, eps)

    T, opt = torch.Tensor, torch.Tensor | None  # types, not strings: the schema is inferred from them
    rope_attention.__annotations__ = dict(q=T, k=T, v=T, output=T, layer_name=LayerNameType, positions=T,
                                          cos_sin_cache=T, head_size=int, is_neox=bool, q_norm_weight=opt,
                                          k_norm_weight=opt, eps=float, **{"return": None})
    ns, name = OP_NAME.split("::")
    _op_lib = torch.library.Library(ns, "FRAGMENT")
    _op_lib.define(name + torch.library.infer_schema(rope_attention, mutates_args=("output",)))
    for key in ("CUDA", "CPU"):  # as the linear op's (ops/linear.py)
        _op_lib.impl(name, rope_attention, key)
    torch.library.register_fake(OP_NAME, lambda *args: None, lib=_op_lib)
    return torch.ops.opgraft.rope_attention.default


# ---- the rewrite -------------------------------------------------------------------------------


def _is(node, name: str) -> bool:
    """Is node a call of the op `name` ("ns::op"), as a packet or its default overload?"""
    import torch

    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name == name
    if isinstance(t, torch._ops.OpOverload):
        return t.name() == name and t._overloadname == "default"
    return False


def _is_view(node) -> bool:
    return node.op == "call_method" and node.target in ("view", "reshape") and not node.kwargs


def _val(node):
    import torch

    v = node.meta.get("example_value", node.meta.get("val")) if hasattr(node, "meta") else None
    return v if isinstance(v, torch.Tensor) else None


def _raw(t, rope, attn_view):
    """For a rotated tensor t (rope's q or k): (raw tensor, norm weight, eps, dead nodes) where t is
    raw or view(rms_norm(view(raw), w, eps)), its only users rope and attn_view; else None."""
    if set(t.users) != {rope, attn_view}:
        return None
    if not (_is_view(t) and isinstance(t.args[0], type(t)) and _is(t.args[0], _NORM_OP)):
        return t, None, None, []
    norm = t.args[0]
    if set(norm.users) != {t} or norm.kwargs or len(norm.args) not in (3, 4) or \
            (len(norm.args) == 4 and norm.args[3] is not None):
        return None
    head, w, eps = norm.args[:3]
    if not (isinstance(head, type(t)) and _is_view(head) and set(head.users) == {norm}) or \
            not isinstance(eps, float) or not isinstance(head.args[0], type(t)):
        return None
    return head.args[0], w, eps, [t, norm, head]


def _match(node):
    """The rewrite of an attention node, or None: (args of opgraft::rope_attention, dead nodes)."""
    if not _is(node, _ATTN_OP):
        return None
    args = list(node.args) + [None] * (8 - len(node.args))
    for i, name in enumerate(("query", "key", "value", "output", "layer_name", "output_scale",
                              "output_block_scale", "kv_cache_dummy_dep")):
        if name in node.kwargs:
            args[i] = node.kwargs[name]
    if len(node.args) > 8 or set(node.kwargs) - {"output_scale", "output_block_scale", "kv_cache_dummy_dep"} or \
            any(a is not None for a in args[5:]):
        return None
    qv, kv, v, out, name = args[:5]  # name: vLLM's, as it is (a str, or a LayerName graph input)
    Node = type(node)
    if not all(isinstance(a, Node) for a in (qv, kv, v, out)) or not (_is_view(qv) and _is_view(kv)):
        return None
    qr, kr = qv.args[0], kv.args[0]
    if not (isinstance(qr, Node) and isinstance(kr, Node)) or set(qv.users) != {node} or set(kv.users) != {node}:
        return None
    ropes = [u for u in qr.users if _is(u, _ROPE_OP)]
    if len(ropes) != 1:
        return None
    rope = ropes[0]
    if rope.kwargs or len(rope.args) != 6 or rope.args[1] is not qr or rope.args[2] is not kr or rope.users:
        return None
    positions, _, _, head_size, cache, neox = rope.args
    if not (isinstance(positions, Node) and isinstance(cache, Node) and isinstance(head_size, int)
            and isinstance(neox, bool)):
        return None
    qm, km = _raw(qr, rope, qv), _raw(kr, rope, kv)
    if qm is None or km is None or (qm[1] is None) != (km[1] is None) or qm[2] != km[2]:
        return None
    q, k = qm[0], km[0]
    qval, kval, cval = _val(q), _val(k), _val(cache)
    if qval is None or kval is None or cval is None or qval.dim() != 2 or kval.dim() != 2 or \
            cval.dim() != 2 or cval.shape[-1] != head_size:  # rotary_dim == head_size only
        return None
    eps = qm[2] if qm[2] is not None else 0.0
    return ((q, k, v, out, name, positions, cache, head_size, neox, qm[1], km[1], eps),
            [node, qv, kv, rope, *qm[3], *km[3]])


def _rewrite_each(gm, match, apply) -> int:
    """apply(graph, node, m) for every node of gm's graph that match(node) takes (m), then the graph
    checked and recompiled if anything changed; returns how many."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        m = match(node)
        if m is not None:
            apply(graph, node, m)
            count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _give_prologue(graph, node, m) -> None:
    args, dead = m
    with graph.inserting_before(node):
        fused = graph.call_function(op(), args)
    fused.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
    for d in dead:  # the attention call first, then what only it used
        graph.erase_node(d)


def rewrite(gm) -> int:
    """Rewrites every matching attention call of the Dynamo graph module gm; returns how many."""
    return _rewrite_each(gm, _match, _give_prologue)


# ---- the q/k epilogue form: the norm and rotary embedding in the qkv projection ---------------

_LINEAR_OP = "opgraft::linear"


def qk_switch() -> bool | None:
    """OPGRAFT_QK_EPILOGUE: True (1: the q/k norm and rotary embedding go into the kernel of every
    qkv projection the rewrite matches, instead of the attention kernel), False (0: none), None
    (unset or malformed, which warns once: by the linear op's linear.qk_epilogue, qk_on)."""
    return switch("OPGRAFT_QK_EPILOGUE", dispatch._warn_once)


def qk_on(N: int, K: int, dtype) -> bool:
    """Does a [N, K] qkv projection of dtype get the q/k epilogue: the switch where set, else the
    linear op's linear.qk_epilogue for the shape on this GPU (its rows; 0 by the rule)."""
    on = qk_switch()
    if on is not None:
        return on
    from . import norm_seam

    return norm_seam.linear_tunable("linear.qk_epilogue", N, K, dtype) > 0


def qk_model(vllm_config) -> bool:
    """Does this config's model get the q/k epilogue (qk_on of its qkv projection on this rank)?"""
    on = qk_switch()
    if on is not None or vllm_config is None:
        return bool(on)
    from . import norm_seam

    shape = norm_seam.qkv_shape(vllm_config)
    return shape is not None and qk_on(*shape)


def _split_parts(q, k, v_view):
    """(linear node, its split sizes) where q and k are getitems 0 and 1 of one split of an
    opgraft::linear call's output along its last dimension and v_view views getitem 2; else None."""
    import operator

    Node = type(q)
    if not (q.op == k.op == "call_function" and q.target is operator.getitem and k.target is operator.getitem):
        return None
    split = q.args[0]
    if k.args[0] is not split or (q.args[1], k.args[1]) != (0, 1) or not isinstance(split, Node):
        return None
    if not (split.op == "call_method" and split.target == "split") or len(split.args) != 2 or \
            split.kwargs not in ({"dim": -1}, {"dim": 1}):
        return None
    lin, sizes = split.args
    if not (isinstance(lin, Node) and _is(lin, _LINEAR_OP)) or not isinstance(sizes, (list, tuple)) or \
            len(sizes) != 3 or not all(isinstance(n, int) for n in sizes) or set(lin.users) != {split}:
        return None
    if not (_is_view(v_view) and isinstance(v_view.args[0], Node) and v_view.args[0].target is operator.getitem
            and v_view.args[0].args == (split, 2)):
        return None
    return lin, list(sizes)


def _match_qk(node, order):
    """The q/k epilogue rewrite of an attention node, or None: (the linear node, the args of
    opgraft::linear_qk, (attention's q view, raw q), (its k view, raw k), dead nodes)."""
    m = _match(node)
    if m is None:
        return None
    (q, k, v, out, name, positions, cache, head_size, neox, qw, kw, eps), dead = m
    qv, kv = dead[1], dead[2]  # attention's views of the rotated q and k
    parts = _split_parts(q, k, v)
    if parts is None:
        return None
    lin, sizes = parts
    D = head_size
    if sizes[0] % D or sizes[1] % D or sizes[1] != sizes[2]:
        return None
    x, w = lin.args[0], lin.args[1]
    wv = _val(w)
    if not qk_switch() and (wv is None or wv.dim() != 2 or not qk_on(wv.shape[0], wv.shape[1], wv.dtype)):
        return None
    bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    Node = type(node)
    late = [t for t in (positions, cache, qw, kw) if isinstance(t, Node) and order.get(t, len(order)) > order[lin]]
    # Dynamo reads a parameter's data (_get_data_attr of a graph input) where the model first uses
    # it, after the projection: such a read can move before it; anything else leaves the call alone.
    if not all(t.op == "call_function" and all(isinstance(a, Node) and a.op in ("placeholder", "get_attr")
                                               for a in t.all_input_nodes) for t in late):
        return None
    args = (x, w, bias, positions, cache, qw, kw, eps, D, sizes[0] // D, sizes[1] // D,
            _lib.ROPE_NEOX if neox else _lib.ROPE_GPTJ)
    return lin, args, (qv, q), (kv, k), dead[3:], late


def _give_epilogue(graph, node, m) -> None:
    import torch

    lin, args, (qv, q), (kv, k), dead, late = m
    for t in late:
        lin.prepend(t)
    with graph.inserting_after(lin):
        fused = graph.call_function(torch.ops.opgraft.linear_qk.default, args)
    fused.meta.update({key: v for key, v in lin.meta.items()
                       if key in ("example_value", "val", "stack_trace", "nn_module_stack")})
    lin.replace_all_uses_with(fused)
    graph.erase_node(lin)
    qv.replace_input_with(qv.args[0], q)
    kv.replace_input_with(kv.args[0], k)
    for d in dead:  # the rotary embedding first, then the norms' nodes, users first
        graph.erase_node(d)


def rewrite_qk(gm) -> int:
    """Gives every matching qkv projection of the Dynamo graph module gm its q/k epilogue: the
    projection becomes opgraft::linear_qk, whose output's split feeds attention directly (vLLM's
    norm and rotary embedding nodes gone); returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return _rewrite_each(gm, lambda node: _match_qk(node, order), _give_epilogue)


def _apply(rewrite_fn, graph, what: str) -> int:
    """rewrite_fn(graph); a graph it does not understand stays vLLM's (warned once, 0)."""
    try:
        n = rewrite_fn(graph)
    except Exception as e:
        dispatch._warn_once(f"{what} rewrite skipped ({type(e).__name__}: {e})")
        n = 0
    dispatch.logger.debug("opgraft: %s rewrite: %d call(s) take the q/k norm and rotary embedding", what, n)
    return n


def _make_split_graph(original):
    def split_graph(graph, splitting_ops):
        global _fused_total, _qk_fused_total
        ops = list(splitting_ops or [])
        at_attention = any(s == _ATTN_OP or s == _ATTN_OP + ".default" for s in ops)
        n = 0
        if at_attention and qk_switch() is not False:  # by each projection's shape where unset
            n = _apply(rewrite_qk, graph, "q/k epilogue")
            with _lock:
                _qk_fused_total += n
        if at_attention and not n and _graph_wanted(graph):
            n = _apply(rewrite, graph, "attention prologue")
            with _lock:
                _fused_total += n
            ops.append(OP_NAME)
        return original(graph, ops)

    split_graph.__doc__ = (original.__doc__ or "") + "\n\n(wrapped by opgraft: see opgraft/vllm/rope_seam.py)"
    setattr(split_graph, _PATCH_ATTR, original)
    return split_graph


def _make_set_compile_ranges(original):
    def _set_compile_ranges(self):
        original(self)
        cc = self.compilation_config
        if "-rotary_embedding" not in cc.custom_ops and "+rotary_embedding" not in cc.custom_ops and wanted(self):
            cc.custom_ops.append("+rotary_embedding")

    setattr(_set_compile_ranges, _RANGES_ATTR, original)
    return _set_compile_ranges


def _compile_factor() -> str:
    """The switches, and where the q/k epilogue is decided by shape, what that decision reads (a
    graph traced with one answer must not be reused with another)."""
    from . import norm_seam

    qk = qk_switch()
    if qk is None:  # only then does the decision read the GPU and the tunables
        arch, gpu = norm_seam._device()
        epilogue = f"by linear.qk_epilogue on {gpu} sm_{arch}, {tunables_tag()}"
    else:
        epilogue = "on" if qk else "off"
    prologue = {True: "on", False: "off", None: "with the MoE norm form"}[switch_state()]
    return f"{package_tag()}, q/k epilogue {epilogue}, attention prologue {prologue}"


def _backends():
    return sys.modules.get("vllm.compilation.backends")


def install() -> tuple[bool, str]:
    """Patches split_graph and VllmConfig._set_compile_ranges once; returns (installed, message)."""
    try:
        import vllm.compilation.backends as backends
        from vllm.config import VllmConfig
    except Exception as e:
        return False, f"cannot import vllm's compilation backend ({type(e).__name__}: {e})"
    current = getattr(backends, "split_graph", None)
    ranges = VllmConfig.__dict__.get("_set_compile_ranges")
    if not callable(current) or not callable(ranges):
        return False, "vllm's split_graph or VllmConfig._set_compile_ranges is not where opgraft expects it"
    if hasattr(current, _PATCH_ATTR):
        return True, "attention prologue seam already installed"
    if not attn_seam.backend_registered():
        return False, "the attention seam's backend is not registered (the prologue runs in its kernel)"
    try:
        op()
        from vllm.model_executor.layers.attention.attention import get_attention_context  # noqa: F401
    except Exception as e:
        return False, f"the prologue op cannot be registered ({type(e).__name__}: {e})"
    backends.split_graph = _make_split_graph(current)
    VllmConfig._set_compile_ranges = _make_set_compile_ranges(ranges)
    add_compile_factor(COMPILE_FACTOR, _compile_factor)
    from . import norm_seam

    if qk_switch():
        return True, "attention prologue seam installed (q/k norm and rotary embedding in the qkv projection's kernel)"
    return True, ("attention prologue seam installed (q/k norm and rotary embedding in the attention kernel, "
                  + ("every model)" if switch_state() else
                     {True: "with the MoE norm form)", False: "with the MoE norm form, off)",
                      None: "with the MoE norm form where the q/k epilogue rewrote nothing)"}[norm_seam.moe_switch()])
                  + ("; in the qkv projection's kernel instead where linear.qk_epilogue is on" if qk_switch() is None
                     else ""))


def uninstall() -> None:
    restore(_backends(), "split_graph", _PATCH_ATTR)
    restore(getattr(sys.modules.get("vllm.config"), "VllmConfig", None), "_set_compile_ranges", _RANGES_ATTR)
    remove_compile_factor(COMPILE_FACTOR, _compile_factor)


def installed() -> bool:
    backends = _backends()
    return backends is not None and hasattr(getattr(backends, "split_graph", None), _PATCH_ATTR)
