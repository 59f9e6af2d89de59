"""Attention seam: vLLM's FlashAttention backend, with decode-only batches on opgraft's kernel.

What is patched (vLLM 0.26.0, the pinned release, and 0.34.0, both tested in CI, and 0.33.0):
1. The FLASH_ATTN entry of vLLM's attention-backend registry
   (vllm/v1/attention/backends/registry.py): register_backend(AttentionBackendEnum.FLASH_ATTN,
   "opgraft.vllm.attn_seam.OpgraftFlashAttentionBackend"). The CUDA platform's selector resolves
   every backend through AttentionBackendEnum.get_class(), which honours that override, so every
   layer that would get FlashAttention gets our subclass instead. Undone by restoring the entry
   (clear_override(), or the override that was there before).
2. The resolved platform's get_attn_backend_cls (a classmethod, `(selected_backend,
   attn_selector_config, num_heads=None) -> str` in both versions): returns exactly what vLLM chose,
   unless OPGRAFT_ATTN_BACKEND=module:Class names a backend to return instead.
Both must happen before the first model is built: vLLM caches the selector's choice
(vllm/v1/attention/selector.py, _cached_get_attn_backend); the general-plugin hook runs first.
OPGRAFT_ATTENTION=0 leaves the registry alone (FlashAttention as shipped);
OPGRAFT_ATTENTION_VARIANT=passthrough keeps our class but hands every call back;
OPGRAFT_ATTENTION_CACHE_WRITE=0 keeps vLLM's separate KV-cache write (below).
Remove it: delete this module's install() call in opgraft/vllm/__init__.py.

Why a subclass: it keeps everything of vLLM's backend but one method. OpgraftFlashAttentionBackend
is FlashAttentionBackend with get_impl_cls() returning OpgraftFlashAttentionImpl: the same name
("FLASH_ATTN", which vLLM compares in places), the same metadata builder (and so its CUDA-graph
support, AttentionCGSupport.ALWAYS with FA3), the same KV-cache shape, stride order, block sizes,
supported dtypes and head sizes. OpgraftFlashAttentionImpl.forward runs our kernel for decode-only
batches it can take and otherwise calls FlashAttentionImpl.forward with the same arguments (the
same bits as stock vLLM); process_weights_after_loading also compiles and loads our kernel, so
that a forward under CUDA graph capture only makes a plan.

Facts this relies on, read in both versions' v1/attention/backends/flash_attn.py:
- The cache is `(num_blocks, num_kv_heads, block_size, 2 * head_size)` logically, K and V packed
  in the last dim; physically [block, token, head, K|V] (NHD, stride order (0, 2, 1, 3)) or
  [block, head, token, K|V] (HND). forward() takes `kv_cache.transpose(1, 2).split(head_size, -1)`:
  K and V views [num_blocks, block_size, kv_heads, head_size] head_size elements apart; we take
  the same views and pass their strides (never a layout).
- The KV write is FlashAttentionImpl.do_kv_cache_update (reshape_and_cache_flash), which the
  attention layer runs as an op of its own before forward (unified_kv_cache_update, with the
  forward context's slot_mapping[layer_name]) unless the backend's forward_includes_kv_cache_update
  is True, or the layer shares another layer's cache (kv_sharing_target_layer_name). Our backend
  sets it True (OPGRAFT_ATTENTION_CACHE_WRITE=0: False, vLLM's write as shipped), so forward owes
  the write: a decode batch our kernel takes has it stored by the kernel (one kernel fewer a
  layer); every call handed back runs do_kv_cache_update with the same arguments first, then
  FlashAttentionImpl.forward, which is stock vLLM's order. The model runner reads the flag only to
  decide whether slot mappings are padded to the CUDA-graph batch (padding rows hold -1, which
  both writes skip). vLLM's RoPE + KV-cache fusion passes (pass_config.fuse_rope_kvcache and
  fuse_qk_norm_rope_kvcache, off by default) rewrite the separate write op, so under our backend
  they find nothing to fuse; OPGRAFT_ATTENTION_CACHE_WRITE=0 keeps the op for them.
- FlashAttentionMetadata: max_query_len (1 for a decode-only batch), seq_lens int32 [num_reqs]
  (CUDA-graph padding rows have seq_len 0 and block-table row 0), block_table int32 [num_reqs,
  max_blocks], max_seq_len (an int; max_model_len while capturing), causal; 0.26 also use_cascade
  and sliding_window (the KV group's window, which forward prefers over the layer's), 0.33 neither
  (no cascade; the layer's window). A decode-only batch schedules one token per request, so
  query row i is request i's (query_start_loc[i] = i for the requests with tokens).
- FlashAttention semantics: window (left, right) = (sliding_window - 1, 0) for a causal decoder
  (keys j >= seq_len - 1 - left); softcap s -> softcap * tanh(s / softcap) after the scale; sinks
  (s_aux, one logit per query head) add exp(sink) to the softmax denominator; a row with no keys
  is zero. Padded rows get zeros from our kernel (FlashAttention writes nothing there: their query
  length is 0); nothing reads them.
"""

from __future__ import annotations

import logging
import os

from .. import dispatch
from .compat import switched_off

logger = logging.getLogger("opgraft")

_PATCH_ATTR = "_opgraft_original_get_attn_backend_cls"
BACKEND_PATH = "opgraft.vllm.attn_seam.OpgraftFlashAttentionBackend"
_HEAD_SIZES = (64, 128, 256)

# The registry entry FLASH_ATTN had before install() (None: vLLM's default), to restore it.
_previous_override: list = []


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


def cache_write_enabled() -> bool:
    """OPGRAFT_ATTENTION_CACHE_WRITE=0 (or false/no/off) keeps vLLM's KV-cache write as an op of its own."""
    return not switched_off("OPGRAFT_ATTENTION_CACHE_WRITE")


def kernel_enabled() -> bool:
    """OPGRAFT_ATTENTION=0 (or false/no/off) keeps vLLM's FlashAttention backend as shipped."""
    return not switched_off("OPGRAFT_ATTENTION")


# ---- the backend -----------------------------------------------------------------------------

_classes: dict = {}


def _static_reason(impl) -> str:
    """Why no call of this layer can take our kernel ("" if some can), from its configuration."""
    from vllm.v1.attention.backend import AttentionType

    if impl.attn_type != AttentionType.DECODER:
        return f"{getattr(impl.attn_type, 'value', impl.attn_type)} attention (decoder self-attention only)"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"KV cache dtype {impl.kv_cache_dtype} (FP8 and other quantized caches are vLLM's)"
    if impl.head_size not in _HEAD_SIZES:
        return f"head size {impl.head_size} (64, 128 or 256 supported)"
    if getattr(impl, "dcp_world_size", 1) > 1:
        return "decode context parallelism"
    try:
        import vllm.envs as envs

        if envs.VLLM_BATCH_INVARIANT:
            return "batch-invariant mode (VLLM_BATCH_INVARIANT): our split count follows the batch"
    except Exception:
        pass
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        if cfg is not None and getattr(cfg.parallel_config, "enable_dbo", False):
            return "dual-batch overlap (two streams would share the kernel's workspace)"
    except Exception:
        pass
    return ""


def _window_of(impl, md) -> tuple[int, int]:
    """The (left, right) window FlashAttentionImpl.forward would pass for this call."""
    window = getattr(md, "sliding_window", None)  # 0.26: the KV group's window wins
    if window is None:
        window = impl.sliding_window
    return (-1, -1) if window is None else (int(window[0]), int(window[1]))


_PREFILL = "prefill or mixed batch (max_query_len > 1)"


def _call_reason(impl, md, output_scale, output_block_scale, kv_cache) -> str:
    """Why a call of one query token a sequence (forward hands the others back first) goes to
    FlashAttention ("" if our kernel may take it)."""
    if md is None:
        return "no attention metadata (profile run)"
    if output_scale is not None or output_block_scale is not None:
        return "fused output quantization"
    if getattr(md, "use_cascade", False):
        return "cascade attention"
    if md.causal is not True:
        return "non-causal or per-sequence causal attention"
    if getattr(md, "mm_prefix_range_tensor", None) is not None or getattr(md, "mm_prefix_query_range_tensor",
                                                                          None) is not None:
        return "multimodal prefix ranges"
    if getattr(md, "rswa_prefix_lens", None) is not None:
        return "reference sliding-window attention (R-SWA)"
    if _window_of(impl, md)[1] > 0:
        return "a two-sided sliding window"
    if kv_cache is None or kv_cache.dim() != 4:
        return "KV cache is not vLLM's 4-D FlashAttention cache"
    return ""


def _current_config():
    """vLLM's current config (set while the model is built and loaded), or None."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        return get_current_vllm_config_or_none()
    except Exception:
        return None


def _build():
    """Defines the backend classes on top of the installed vLLM's (once)."""
    if _classes:
        return _classes
    from vllm import forward_context as fc
    from vllm.v1.attention.backends import flash_attn as fa

    writes = cache_write_enabled()
    from .. import _lib
    from . import rope_seam

    rope_prologue = not rope_seam.disabled()  # and, per model, rope_seam.wanted

    def slot_mapping_of(layer):
        """The slot mapping vLLM's own KV write would use for this layer's call (None: no write)."""
        if not fc.is_forward_context_available():
            return None
        slots = fc.get_forward_context().slot_mapping
        return slots.get(layer.layer_name) if isinstance(slots, dict) else None

    class OpgraftFlashAttentionImpl(fa.FlashAttentionImpl):
        """FlashAttentionImpl with decode-only batches on opgraft's paged decode kernel."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._og_reason = _static_reason(self)
            self._og_kv = None  # (kv_cache, key view, value view) of the last call
            # forward writes the cache (vLLM's layer skips its write op), unless the layer shares one
            self._og_writes = writes and self.kv_sharing_target_layer_name is None
            # With the q/k epilogue the qkv projection's kernel runs just before each decode call
            # (rope_seam): a launch hint (attention.pdl_pro). A layer the rewrite does not match gets
            # Inductor's kernels between the two, where the hint is a wait like any other.
            after = self._og_writes and rope_prologue and rope_seam.qk_model(_current_config())
            self._og_flags = _lib.ATTN_AFTER_QKV if after else 0

        def process_weights_after_loading(self, act_dtype):
            super().process_weights_after_loading(act_dtype)
            if self._og_reason or dispatch.selected_variant("attention") != "opgraft":
                return
            try:
                import torch

                from ..ops import attention

                block_size, sizes = 16, (1, 2, 4, 8, 16, 24, 32)  # vLLM's first capture sizes, if it has none
                prologue = False
                try:
                    cfg = _current_config()
                    block_size = int(getattr(cfg.cache_config, "block_size", None) or 16) if cfg else 16
                    # a plan is per batch, and the decode graphs are captured at these batches
                    captured = getattr(cfg.compilation_config, "cudagraph_capture_sizes", None) if cfg else None
                    if captured:
                        sizes = tuple(int(b) for b in captured if 0 < int(b) <= attention.MAX_BATCH)
                    prologue = rope_prologue and cfg is not None and rope_seam.wanted(cfg)
                except Exception:
                    pass
                left = _window_of(self, None)[0]
                sinks_dtype = self.sinks.dtype if self.sinks is not None else None
                device = torch.device("cuda", torch.cuda.current_device())
                ok, why = attention.prepare(self.num_heads, self.num_kv_heads, self.head_size, act_dtype, device,
                                            self.logits_soft_cap, left, sinks_dtype, block_size, batches=sizes,
                                            update=self._og_writes, flags=self._og_flags)
                if not ok:
                    self._og_reason = why
                elif self._og_writes and prologue:  # the layer's norm is not known here: both NeoX forms
                    for norm in (True, False):
                        attention.prepare(self.num_heads, self.num_kv_heads, self.head_size, act_dtype, device,
                                          self.logits_soft_cap, left, sinks_dtype, block_size, batches=sizes,
                                          update=True, qk_norm=norm, rope_style=_lib.ROPE_NEOX)
            except Exception as e:  # no NVRTC, a compile error: this layer stays FlashAttention's
                self._og_reason = f"kernel error: {type(e).__name__}"
                dispatch._warn_once(f"opgraft attention kernel could not be prepared, handing calls back: {e}")

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            parent = super().forward
            slots = slot_mapping_of(layer) if self._og_writes and key is not None and value is not None else None

            def delegate():  # vLLM's write (when forward owes it), then vLLM's attention
                if slots is not None:
                    self.do_kv_cache_update(layer, key, value, kv_cache, slots)
                return parent(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)

            md = attn_metadata
            if md is not None and md.max_query_len != 1:  # a prefill or mixed batch: at once (TTFT)
                dispatch.stats_of("attention").delegate(self._og_reason or _PREFILL)
                return delegate()
            reason = self._og_reason or _call_reason(self, md, output_scale, output_block_scale, kv_cache)
            if reason:
                call = dispatch.AttentionCall(query, None, None, None, None, output, self.scale, 0.0, -1, None, 0,
                                              delegate, extra_reason=reason)
                return dispatch.dispatch("attention", call)
            kv = self._kv_views(kv_cache)
            call = dispatch.AttentionCall(query, kv[1], kv[2], md.block_table, md.seq_lens, output, self.scale,
                                          float(self.logits_soft_cap or 0.0), _window_of(self, md)[0], self.sinks,
                                          int(md.max_seq_len), delegate, key=None if slots is None else key,
                                          value=None if slots is None else value, slot_mapping=slots,
                                          flags=self._og_flags if slots is not None else 0)
            return dispatch.dispatch("attention", call)

        def forward_prologue(self, layer, q, k, v, kv_cache, attn_metadata, output, pro):
            """The call of opgraft::rope_attention (rope_seam): q [T, Hq*D] and k [T, Hk*D] before
            vLLM's q/k norm and rotary embedding (pro). A decode batch our kernel takes gets them in
            the kernel; any other call gets vLLM's norm and rotary embedding, then forward() (which
            counts it)."""
            T, D = q.shape[0], self.head_size
            md = attn_metadata
            slots = slot_mapping_of(layer) if self._og_writes else None
            if (md is not None and md.max_query_len == 1 and slots is not None and not self._og_reason
                    and not _call_reason(self, md, None, None, kv_cache)
                    and dispatch.selected_variant("attention") == "opgraft"):
                from ..ops import attention

                kv = self._kv_views(kv_cache)
                query, key = q.view(T, -1, D), k.view(T, -1, D)
                cache = (kv[1], kv[2], md.block_table, md.seq_lens)
                opts = (self.scale, float(self.logits_soft_cap or 0.0), _window_of(self, md)[0], self.sinks)
                try:
                    plan = attention.plan_for(query, *cache, output, *opts, key=key, value=v, slot_mapping=slots,
                                              pro=pro)
                    if plan.handle is not None:
                        attention.run(plan, output, query, *cache, *opts, int(md.max_seq_len), key, v, slots, pro)
                        dispatch.stats_of("attention").take()
                        return output
                    dispatch._info_once(f"attention prologue handed back to vLLM's norm and rotary: {plan.reason}")
                except Exception as e:
                    dispatch._warn_once(f"attention prologue kernel failed, vLLM's norm and rotary instead: {e}")
            return rope_seam.unfused(self, layer, q, k, v, kv_cache, attn_metadata, output, pro, D)

        def _kv_views(self, kv_cache):
            """(kv_cache, K view, V view): the views FlashAttentionImpl.forward splits, kept for the
            last cache seen."""
            kv = self._og_kv
            if kv is None or kv[0] is not kv_cache:
                key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
                self._og_kv = kv = (kv_cache, key_cache, value_cache)
            return kv

    class OpgraftFlashAttentionBackend(fa.FlashAttentionBackend):
        """FlashAttentionBackend whose impl runs decode-only batches on opgraft's kernel."""

        forward_includes_kv_cache_update = writes

        @staticmethod
        def get_impl_cls():
            return OpgraftFlashAttentionImpl

    for cls in (OpgraftFlashAttentionImpl, OpgraftFlashAttentionBackend):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__  # resolvable by path, picklable
    _classes.update(OpgraftFlashAttentionImpl=OpgraftFlashAttentionImpl,
                    OpgraftFlashAttentionBackend=OpgraftFlashAttentionBackend)
    return _classes


def __getattr__(name):
    """The backend classes are built on first access (they need vLLM): vLLM resolves
    BACKEND_PATH through this module's attributes."""
    if name in ("OpgraftFlashAttentionImpl", "OpgraftFlashAttentionBackend"):
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- install / uninstall ---------------------------------------------------------------------


def _platform_class():
    from vllm.platforms import current_platform

    return type(current_platform)


def _registry():
    from vllm.v1.attention.backends import registry

    return registry


def _register_backend() -> tuple[bool, str]:
    """Points FLASH_ATTN at our subclass; (done, message)."""
    if not kernel_enabled():
        return False, "decode kernel off (OPGRAFT_ATTENTION=0)"
    try:
        reg = _registry()
        entry = reg.AttentionBackendEnum.FLASH_ATTN
        _build()
    except Exception as e:
        return False, f"cannot load vLLM's FlashAttention backend ({type(e).__name__}: {e})"
    if entry.get_path() == BACKEND_PATH:
        return True, "FLASH_ATTN already runs opgraft's decode kernel"
    _previous_override[:] = [entry.get_path() if entry.is_overridden() else None]
    reg.register_backend(entry, BACKEND_PATH)
    return True, f"FLASH_ATTN decode on opgraft's kernel (variant {dispatch.selected_variant('attention')})"


def _unregister_backend() -> None:
    try:
        entry = _registry().AttentionBackendEnum.FLASH_ATTN
    except Exception:
        return
    if entry.is_overridden() and entry.get_path() == BACKEND_PATH:
        previous = _previous_override[0] if _previous_override else None
        if previous:
            _registry().register_backend(entry, previous)
        else:
            entry.clear_override()
    _previous_override.clear()


def backend_registered() -> bool:
    try:
        return _registry().AttentionBackendEnum.FLASH_ATTN.get_path() == BACKEND_PATH
    except Exception:
        return False


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
    _, backend_msg = _register_backend()
    return True, f"attention seam installed on {cls.__name__} ({what}); {backend_msg}"


def uninstall() -> None:
    _unregister_backend()
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
