"""The attention backend against the real vLLM classes (the pinned 0.26 and the newest; CI runs
this file with both): registration in vLLM's backend registry and its undoing, the subclass
keeping FlashAttention's name, builder, cache layout and capabilities, and the impl's forward
handing every call it cannot take to FlashAttentionImpl.forward with the very same arguments.
Metadata objects are vLLM's own FlashAttentionMetadata, built on CPU."""

import os

import pytest

if os.environ.get("OPGRAFT_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from opgraft import dispatch  # noqa: E402
from opgraft.vllm import _reset_for_tests, attn_seam, register, summary  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import flash_attn as fa  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402

FLASH = AttentionBackendEnum.FLASH_ATTN


@pytest.fixture
def clean(clean_plugin):
    FLASH.clear_override()
    yield
    FLASH.clear_override()


def test_registration_points_flash_attn_at_our_subclass(clean):
    assert FLASH.get_class() is fa.FlashAttentionBackend
    register()
    cls = FLASH.get_class()
    assert cls is attn_seam.OpgraftFlashAttentionBackend and attn_seam.backend_registered()
    assert issubclass(cls, fa.FlashAttentionBackend) and cls is not fa.FlashAttentionBackend
    assert cls.get_name() == "FLASH_ATTN"
    assert cls.get_builder_cls() is fa.FlashAttentionMetadataBuilder  # and so its CUDA-graph support
    assert issubclass(cls.get_impl_cls(), fa.FlashAttentionImpl)
    # Everything but the impl and who writes the cache is FlashAttention's own (cache shape and
    # layout, block sizes, dtypes, head sizes, capabilities); the impl overrides two methods.
    assert {k for k in vars(cls) if not k.startswith("_")} == {"get_impl_cls", "forward_includes_kv_cache_update"}
    assert {k for k in vars(cls.get_impl_cls()) if not k.startswith("_")} == {"forward", "forward_prologue",
                                                                         "process_weights_after_loading"}
    for h in (64, 96, 128, 256):
        assert cls.supports_head_size(h) == fa.FlashAttentionBackend.supports_head_size(h)
    assert fa.FlashAttentionBackend.forward_includes_kv_cache_update is False
    assert cls.forward_includes_kv_cache_update is True  # our forward writes the cache: vLLM's layer does not
    from vllm.utils.import_utils import resolve_obj_by_qualname

    module, qualname = cls.full_cls_name()
    assert resolve_obj_by_qualname(f"{module}.{qualname}") is cls
    assert "FLASH_ATTN decode on opgraft's kernel" in summary()
    _reset_for_tests()
    assert FLASH.get_class() is fa.FlashAttentionBackend and not FLASH.is_overridden()


def test_an_earlier_override_is_restored(clean):
    register_backend(FLASH, "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend")
    register()
    assert attn_seam.backend_registered()
    _reset_for_tests()
    assert FLASH.is_overridden() and FLASH.get_path() == "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def test_kill_switch_keeps_vllms_backend(clean, monkeypatch):
    monkeypatch.setenv("OPGRAFT_ATTENTION", "0")
    register()
    assert not attn_seam.backend_registered() and FLASH.get_class() is fa.FlashAttentionBackend
    assert "decode kernel off (OPGRAFT_ATTENTION=0)" in summary()


def test_injection_still_works_with_the_backend_registered(clean, monkeypatch):
    monkeypatch.setenv("OPGRAFT_ATTN_BACKEND", "my_pkg.attn:MyBackend")
    register()
    from vllm.platforms import current_platform

    assert type(current_platform).get_attn_backend_cls(None, None) == "my_pkg.attn.MyBackend"
    assert attn_seam.backend_registered()


# ---- the impl --------------------------------------------------------------------------------

B, HQ, HK, D, BS = 3, 8, 2, 64, 16


def impl(**kw):
    args = dict(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HK, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto")
    args.update(kw)
    return attn_seam.OpgraftFlashAttentionImpl(**args)


def tensors(dtype=torch.bfloat16):
    kv = torch.randn((12, BS, HK, 2 * D)).to(dtype).permute(0, 2, 1, 3)  # vLLM's NHD cache
    q = torch.randn((B + 1, HQ, D)).to(dtype)
    k = torch.randn((B + 1, HK, D)).to(dtype)
    v = torch.randn((B + 1, HK, D)).to(dtype)
    out = torch.empty((B + 1, HQ, D), dtype=dtype)
    return q, k, v, kv, out


def metadata(**over):
    fields = fa.FlashAttentionMetadata.__dataclass_fields__
    base = dict(num_actual_tokens=B, max_query_len=1, query_start_loc=torch.arange(B + 1, dtype=torch.int32),
                max_seq_len=40, seq_lens=torch.tensor([40, 0, 7], dtype=torch.int32),
                block_table=torch.randint(0, 12, (B, 4), dtype=torch.int32), slot_mapping=torch.arange(B),
                use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
                suffix_kv_lens=None)
    base.update(over)
    return fa.FlashAttentionMetadata(**{k: v for k, v in base.items() if k in fields})


class Recorder:
    """Stands in for FlashAttentionImpl.forward, recording the arguments it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, impl_self, *args, **kwargs):
        self.calls.append((impl_self, args, kwargs))
        return "vllm's output"


@pytest.fixture
def recorder(clean, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", lambda self, *a, **k: rec(self, *a, **k))
    return rec


def forward(i, md, layer=None, **kw):
    q, k, v, kv, out = tensors()
    args = (layer or object(), q, k, v, kv, md, out)
    return i.forward(*args, **kw), args


def reasons():
    return dispatch.stats()["attention"]["delegated_by_reason"]


def assert_handed_back(rec, result, args, n=1):
    assert result == "vllm's output" and len(rec.calls) == n
    got_self, got_args, _ = rec.calls[-1]
    assert isinstance(got_self, fa.FlashAttentionImpl)
    assert len(got_args) == 9 and all(a is b for a, b in zip(got_args, args))


def test_calls_it_cannot_take_go_to_flash_attention_unchanged(recorder):
    i = impl()
    n = 0
    expected = {}
    cases = [(None, "no attention metadata (profile run)"),
             (metadata(max_query_len=2), "prefill or mixed batch (max_query_len > N)"),
             (metadata(causal=torch.ones(B, dtype=torch.int32)), "non-causal or per-sequence causal attention"),
             (metadata(rswa_prefix_lens=torch.zeros(B, dtype=torch.int32)), "reference sliding-window attention (R-SWA)")]
    if "use_cascade" in fa.FlashAttentionMetadata.__dataclass_fields__:  # 0.26; 0.33 has no cascade
        cases.append((metadata(use_cascade=True), "cascade attention"))
    for name in ("mm_prefix_range_tensor", "mm_prefix_query_range_tensor"):
        if name in fa.FlashAttentionMetadata.__dataclass_fields__:
            cases.append((metadata(**{name: torch.zeros((B, 1, 2), dtype=torch.int32)}), "multimodal prefix ranges"))
    for md, why in cases:
        result, args = forward(i, md)
        n += 1
        assert_handed_back(recorder, result, args, n)
        expected[why] = expected.get(why, 0) + 1
    result, args = forward(i, metadata(), output_scale=torch.ones(1))
    n += 1
    assert_handed_back(recorder, result, args, n)
    assert recorder.calls[-1][1][7] is not None  # output_scale passed on
    expected["fused output quantization"] = 1
    # a decode batch reaches the op layer, which refuses CPU tensors
    result, args = forward(i, metadata())
    n += 1
    assert_handed_back(recorder, result, args, n)
    expected["tensors are not on a CUDA device"] = 1
    assert reasons() == expected


@pytest.mark.parametrize("kw, needle", [
    (dict(kv_cache_dtype="fp8"), "KV cache dtype fp8"),
    (dict(alibi_slopes=[0.5] * HQ), "ALiBi"),
    (dict(head_size=96), "head size N (N, N or N supported)"),
    (dict(attn_type=AttentionType.ENCODER_DECODER), "attention (decoder self-attention only)"),
    (dict(sliding_window=8, attn_type=AttentionType.ENCODER_ONLY), "attention (decoder self-attention only)"),
])
def test_layers_it_cannot_take(recorder, kw, needle):
    try:
        i = impl(**kw)
    except (AssertionError, NotImplementedError, ValueError) as e:  # vLLM itself refuses it here
        pytest.skip(f"vLLM refuses this layer on this machine: {e}")
    result, args = forward(i, metadata())
    assert_handed_back(recorder, result, args)
    (why,) = reasons()
    assert needle in why


def test_a_two_sided_window_is_handed_back(recorder):
    i = impl(sliding_window=64)
    i.sliding_window = (63, 63)
    result, args = forward(i, metadata())
    assert_handed_back(recorder, result, args)
    assert reasons() == {"a two-sided sliding window": 1}


def test_passthrough_variant(recorder, monkeypatch):
    monkeypatch.setenv("OPGRAFT_ATTENTION_VARIANT", "passthrough")
    result, args = forward(impl(), metadata())
    assert_handed_back(recorder, result, args)
    assert reasons() == {"passthrough variant": 1}


@pytest.fixture
def seen(monkeypatch):
    """The calls the seam hands our kernel, kept by a variant that records them instead."""
    calls = []

    @dispatch.register_variant("attention", "test-capture")
    def capture(call):
        calls.append(call)
        return call.output

    monkeypatch.setenv("OPGRAFT_ATTENTION_VARIANT", "test-capture")
    yield calls
    dispatch._VARIANTS["attention"].pop("test-capture", None)


def test_the_call_our_kernel_gets(recorder, seen):
    sinks = torch.randn(HQ)
    i = impl(sliding_window=4096, logits_soft_cap=30.0)
    i.sinks = sinks  # vLLM asserts FA3 support of sinks at construction; the impl keeps them as given
    md = metadata(max_seq_len=40)
    q, k, v, kv, out = tensors()
    assert i.forward(object(), q, k, v, kv, md, out) is out
    (call,) = seen
    kc, vc = kv.transpose(1, 2).split(D, dim=-1)  # FlashAttentionImpl.forward's views
    assert call.key_cache.data_ptr() == kc.data_ptr() and call.key_cache.stride() == kc.stride()
    assert call.value_cache.data_ptr() == vc.data_ptr() and call.value_cache.shape == vc.shape
    assert call.query is q and call.output is out
    assert call.block_table is md.block_table and call.seq_lens is md.seq_lens
    assert call.scale == i.scale and call.softcap == 30.0 and call.sinks is sinks
    expected_left = i.sliding_window[0]
    if getattr(md, "sliding_window", None) is not None:  # 0.26: the group's window wins
        expected_left = md.sliding_window[0]
    assert call.window_left == expected_left and call.max_seq_len == 40
    assert not recorder.calls
    # the views are reused for the same cache tensor
    i.forward(object(), q, k, v, kv, md, out)
    assert seen[1].key_cache is call.key_cache
    if "sliding_window" in fa.FlashAttentionMetadata.__dataclass_fields__:
        i.forward(object(), q, k, v, kv, metadata(sliding_window=(127, 0)), out)
        assert seen[2].window_left == 127


def test_a_layer_whose_kernel_cannot_be_prepared_stays_flash_attentions(recorder):
    i = impl()
    i.process_weights_after_loading(torch.bfloat16)  # no GPU here: preparing fails, vLLM keeps the layer
    assert i._og_reason.startswith("kernel error")
    result, args = forward(i, metadata())
    assert_handed_back(recorder, result, args)
    assert list(reasons()) == [i._og_reason]


# ---- the KV-cache write: forward owes it -------------------------------------------------------

LAYER = "model.layers.0.self_attn.attn"


class WriteRecorder:
    """Stands in for FlashAttentionImpl.do_kv_cache_update and forward, recording their order."""

    def __init__(self):
        self.events = []

    def update(self, impl_self, layer, key, value, kv_cache, slots):
        self.events.append(("write", layer, key, value, kv_cache, slots))

    def forward(self, impl_self, *args):
        self.events.append(("attention",) + args)
        return "vllm's output"


@pytest.fixture
def writes(clean, monkeypatch):
    from types import SimpleNamespace

    from vllm import forward_context as fc

    rec = WriteRecorder()
    monkeypatch.setattr(fa.FlashAttentionImpl, "do_kv_cache_update", lambda self, *a: rec.update(self, *a))
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", lambda self, *a, **k: rec.forward(self, *a))
    rec.slots = torch.arange(B, dtype=torch.int64)
    ctx = SimpleNamespace(slot_mapping={LAYER: rec.slots})
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
    return rec


def layer_named(name=LAYER):
    from types import SimpleNamespace

    return SimpleNamespace(layer_name=name)


def test_a_handed_back_call_writes_the_cache_then_runs_flash_attention(writes):
    i = impl()
    for md in (None, metadata(max_query_len=4), metadata()):  # profile run, prefill, decode on CPU (refused)
        writes.events.clear()
        q, k, v, kv, out = tensors()
        layer = layer_named()
        assert i.forward(layer, q, k, v, kv, md, out) == "vllm's output"
        (w, a) = writes.events
        assert w[0] == "write" and w[1] is layer and w[2] is k and w[3] is v and w[4] is kv and w[5] is writes.slots
        assert a[0] == "attention" and a[1] is layer and a[2] is q and a[5] is kv and a[6] is md and a[7] is out


def test_no_write_without_a_slot_mapping_or_for_a_layer_sharing_a_cache(writes):
    q, k, v, kv, out = tensors()
    i = impl()
    i.forward(layer_named("model.layers.9.self_attn.attn"), q, k, v, kv, None, out)  # not in the mapping
    i.forward(layer_named(), q, None, None, kv, None, out)  # no new keys (vLLM's layer would not write)
    shared = impl(kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    shared.forward(layer_named(), q, k, v, kv, None, out)
    assert [e[0] for e in writes.events] == ["attention"] * 3


def test_the_call_our_kernel_gets_carries_the_write(writes, seen):
    q, k, v, kv, out = tensors()
    assert impl().forward(layer_named(), q, k, v, kv, metadata(), out) is out
    (call,) = seen
    assert call.key is k and call.value is v and call.slot_mapping is writes.slots
    assert not writes.events  # the kernel writes; nothing of vLLM's ran
    call.delegate()  # a hand-back from there: vLLM's write, then its attention
    assert [e[0] for e in writes.events] == ["write", "attention"]
    seen.clear()
    impl(kv_sharing_target_layer_name="x").forward(layer_named(), q, k, v, kv, metadata(), out)
    assert seen[0].key is None and seen[0].slot_mapping is None


def test_with_the_qk_epilogue_a_writing_call_carries_the_after_qkv_hint(writes, seen, monkeypatch):
    from opgraft import _lib

    q, k, v, kv, out = tensors()
    impl().forward(layer_named(), q, k, v, kv, metadata(), out)
    monkeypatch.setenv("OPGRAFT_QK_EPILOGUE", "1")  # read when a layer's impl is made
    impl().forward(layer_named(), q, k, v, kv, metadata(), out)
    impl(kv_sharing_target_layer_name="x").forward(layer_named(), q, k, v, kv, metadata(), out)
    monkeypatch.setenv("OPGRAFT_ATTENTION_PROLOGUE", "0")  # the rewrite lives in that seam
    attn_seam._classes.clear()  # read when the classes are built
    try:
        impl().forward(layer_named(), q, k, v, kv, metadata(), out)
    finally:
        attn_seam._classes.clear()
    assert [c.flags for c in seen] == [0, _lib.ATTN_AFTER_QKV, 0, 0]


def test_the_cache_write_kill_switch_keeps_vllms_write_op(writes, monkeypatch):
    monkeypatch.setenv("OPGRAFT_ATTENTION_CACHE_WRITE", "0")
    attn_seam._classes.clear()  # the flag is read when the classes are built
    try:
        assert attn_seam.OpgraftFlashAttentionBackend.forward_includes_kv_cache_update is False
        q, k, v, kv, out = tensors()
        impl().forward(layer_named(), q, k, v, kv, metadata(), out)
        assert [e[0] for e in writes.events] == ["attention"]  # vLLM's layer wrote before forward
    finally:
        attn_seam._classes.clear()


# ---- the prologue: q and k before vLLM's q/k norm and rotary embedding (rope_seam's op) ----------


def prologue_call():
    from opgraft import _lib
    from opgraft.ops.attention import QKPrologue

    qkv = torch.randn((B + 1, (HQ + 2 * HK) * D)).to(torch.bfloat16)
    q, k = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D]
    v = qkv[:, (HQ + HK) * D:].view(B + 1, HK, D)
    w = torch.ones(D, dtype=torch.bfloat16)
    pro = QKPrologue(w, w, 1e-6, torch.randn((64, D)).to(torch.bfloat16), torch.arange(B + 1), _lib.ROPE_NEOX)
    kv = torch.randn((12, BS, HK, 2 * D)).to(torch.bfloat16).permute(0, 2, 1, 3)
    return q, k, v, kv, torch.empty((B + 1, HQ, D), dtype=torch.bfloat16), pro


@pytest.fixture
def vllm_prologue(monkeypatch):
    """rope_seam.vllm_prologue recorded: returns new q and k tensors it made."""
    from opgraft.vllm import rope_seam

    calls = []

    def fake(q, k, pro, head_size, v=None):
        calls.append((q, k, pro, head_size, v))
        return q + 1, k + 1

    monkeypatch.setattr(rope_seam, "vllm_prologue", fake)
    return calls


def test_a_prologue_call_it_cannot_take_gets_vllms_norm_and_rotary_then_forward(writes, vllm_prologue):
    i = impl()
    for md in (None, metadata(max_query_len=4), metadata()):  # profile run, prefill, decode on CPU (refused)
        writes.events.clear(), vllm_prologue.clear(), dispatch.reset_stats()
        q, k, v, kv, out, pro = prologue_call()
        assert i.forward_prologue(layer_named(), q, k, v, kv, md, out, pro) == "vllm's output"
        ((gq, gk, gpro, hs, gv),) = vllm_prologue
        assert gq is q and gk is k and gpro is pro and hs == D and gv is v
        (w, a) = writes.events  # then forward: vLLM's write of the normed, rotated key, then attention
        assert torch.equal(w[2], (k + 1).view(B + 1, HK, D)) and w[3] is v and w[5] is writes.slots
        assert torch.equal(a[2], (q + 1).view(B + 1, HQ, D)) and a[6] is md and a[7] is out
        assert sum(dispatch.stats()["attention"]["delegated_by_reason"].values()) == 1  # counted once


def test_a_prologue_call_our_kernel_takes(writes, vllm_prologue, monkeypatch):
    from opgraft.ops import attention as ops

    runs = []
    from types import SimpleNamespace

    monkeypatch.setattr(ops, "plan_for", lambda *a, **k: SimpleNamespace(handle=1, reason=""))  # no C plan
    monkeypatch.setattr(ops, "run", lambda *a: runs.append(a))
    i = impl()
    q, k, v, kv, out, pro = prologue_call()
    md = metadata()
    assert i.forward_prologue(layer_named(), q, k, v, kv, md, out, pro) is out
    ((plan, o, query, kc, vc, bt, lens, scale, cap, left, sinks, hint, key, value, slots, p),) = runs
    assert o is out and bt is md.block_table and lens is md.seq_lens and hint == md.max_seq_len
    assert query.shape == (B + 1, HQ, D) and query.data_ptr() == q.data_ptr()  # raw, as a view
    assert key.shape == (B + 1, HK, D) and key.data_ptr() == k.data_ptr() and value is v and p is pro
    assert slots is writes.slots and not vllm_prologue and not writes.events
    assert dispatch.stats()["attention"]["taken"] == 1
