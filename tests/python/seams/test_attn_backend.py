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
    # Everything but the impl is FlashAttention's own (cache shape and layout, block sizes,
    # dtypes, head sizes, capabilities); the impl overrides three methods.
    assert {k for k in vars(cls) if not k.startswith("_")} == {"get_impl_cls"}
    assert {k for k in vars(cls.get_impl_cls()) if not k.startswith("_")} == {"forward", "process_weights_after_loading"}
    for h in (64, 96, 128, 256):
        assert cls.supports_head_size(h) == fa.FlashAttentionBackend.supports_head_size(h)
    assert cls.forward_includes_kv_cache_update is False  # vLLM still writes the cache first
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


def test_the_call_our_kernel_gets(recorder, monkeypatch):
    seen = []

    @dispatch.register_variant("attention", "test-capture")
    def capture(call):
        seen.append(call)
        return call.output

    try:
        monkeypatch.setenv("OPGRAFT_ATTENTION_VARIANT", "test-capture")
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
    finally:
        dispatch._VARIANTS["attention"].pop("test-capture", None)


def test_a_layer_whose_kernel_cannot_be_prepared_stays_flash_attentions(recorder):
    i = impl()
    i.process_weights_after_loading(torch.bfloat16)  # no GPU here: preparing fails, vLLM keeps the layer
    assert i._og_reason.startswith("kernel error")
    result, args = forward(i, metadata())
    assert_handed_back(recorder, result, args)
    assert list(reasons()) == [i._og_reason]
