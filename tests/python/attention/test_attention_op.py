"""The attention op's torch layer on CPU tensors: the argument struct from vLLM's FlashAttention
views (pointers, strides, batch), the guard's decisions on those arguments, the C fp64 oracle
against the bench's independent torch fp64 reference, the custom op's fake, and the dispatch's
hand-backs (no GPU needed)."""
import ctypes
import dataclasses
import weakref

import pytest

torch = pytest.importorskip("torch")

from opgraft import _lib, dispatch  # noqa: E402
from opgraft.bench import attention as attn_bench  # noqa: E402
from opgraft.ops import attention as ops  # noqa: E402


def problem(lens=(5, 0, 40), hq=8, hk=2, d=64, dtype="bf16", **kw):
    return attn_bench.make_problem(list(lens), hq, hk, d, dtype, device="cpu", **kw)


def args_of(p, out=None, arch=90, **kw):
    a = ops.attention_args(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, out, p.scale, p.softcap,
                           p.window_left, p.sinks, **kw)
    a.arch = arch
    return a


def guard(a):
    reason = ctypes.create_string_buffer(256)
    st = _lib.lib().opgraft_attention_supports(ctypes.byref(a), reason, len(reason))
    return st, reason.value.decode()


def test_args_follow_vllm_views():
    p = problem(block_size=16)
    kv, k, v = p.kv_cache, p.key_cache, p.value_cache
    B, Hk, bs, D2 = kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[3]
    a = args_of(p)
    assert (a.batch, a.num_heads, a.num_kv_heads, a.head_size, a.block_size) == (3, 8, 2, 64, 16)
    assert a.num_blocks == B and a.max_blocks == p.block_table.shape[1]
    # NHD: physically [block, token, head, K|V]; V is D elements after K
    assert list(a.k_stride) == [bs * Hk * D2, Hk * D2, D2, 1] == list(a.v_stride)
    assert a.v_cache - a.k_cache == 64 * 2
    assert list(a.q_stride) == [8 * 64, 64, 1]
    assert a.dtype == a.kv_dtype == _lib.DTYPE_BF16 and a.query_len == 1
    assert a.seq_lens_dtype == a.block_table_dtype == _lib.DTYPE_INT32
    assert guard(a) == (_lib.OK, "")
    hnd = problem(layout="HND")
    a = args_of(hnd)
    assert list(a.k_stride) == [Hk * bs * D2, D2, bs * D2, 1]
    assert guard(a) == (_lib.OK, "")


def new_rows(p, rows=None):
    """New keys and values as vLLM's attention layer passes them: views of a fused qkv output."""
    rows = rows or p.seq_lens.shape[0]
    hq, hk, d = p.query.shape[1], p.key_cache.shape[2], p.key_cache.shape[3]
    fused = torch.zeros((rows, (hq + 2 * hk) * d), dtype=p.query.dtype)
    key = fused[:, hq * d:(hq + hk) * d].view(rows, hk, d)
    value = fused[:, (hq + hk) * d:].view(rows, hk, d)
    return key, value, torch.arange(rows, dtype=torch.int64)


def test_args_of_a_call_that_writes_the_cache():
    p = problem()
    key, value, slots = new_rows(p, rows=4)  # a padded batch: more token rows than sequences
    a = args_of(p, key=key, value=value, slot_mapping=slots)
    assert a.k_new == key.data_ptr() and a.v_new == value.data_ptr() and a.slot_mapping == slots.data_ptr()
    assert list(a.k_new_stride) == [(8 + 4) * 64, 64] == list(a.v_new_stride)
    assert a.slot_mapping_dtype == _lib.DTYPE_INT64 and a.slot_count == 4
    assert guard(a) == (_lib.OK, "")
    assert guard(args_of(p, key=key, value=value, slot_mapping=slots.int())) == (
        _lib.EUNSUPPORTED, "slot mapping dtype int32 (int64 expected)")
    # shapes that are not a cache row's, a strided head dim, a missing part, too few rows
    for kw in (dict(key=key[:, :1]), dict(value=value[:, :, :32]), dict(key=key.transpose(1, 2)),
               dict(slot_mapping=None), dict(key=key.float()), dict(key=key[:2], value=value[:2]),
               dict(slot_mapping=slots.view(2, 2))):
        call = dict(key=key, value=value, slot_mapping=slots)
        call.update(kw)
        assert args_of(p, **call).dtype == -1, kw
    # the plan's layout includes the new rows' strides, not their pointers
    k1 = ops._layout_key(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale, 0.0, -1, None,
                         0, 1, key, value, slots)
    k2 = ops._layout_key(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale, 0.0, -1, None,
                         0, 1, *new_rows(p, rows=4))
    k0 = ops._layout_key(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale, 0.0, -1, None,
                         0, 1)
    assert k1 == k2 != k0


def test_inconsistent_tensors_are_refused():
    p = problem()
    bad = [
        dict(value_cache=p.value_cache[:-1]),
        dict(seq_lens=p.seq_lens.view(3, 1)),
        dict(query=p.query[:2]),
        dict(block_table=p.block_table[:2]),
        dict(seq_lens=torch.zeros(6, dtype=torch.int32)[::2]),
    ]
    for change in bad:
        t = dict(query=p.query, key_cache=p.key_cache, value_cache=p.value_cache, block_table=p.block_table,
                 seq_lens=p.seq_lens)
        t.update(change)
        a = ops.attention_args(t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["seq_lens"], None,
                               p.scale)
        assert a.dtype == -1, change


def test_guard_reasons_from_tensors():
    p = problem()
    cases = [
        (dict(key_cache=p.key_cache.view(torch.uint8)[..., :64], value_cache=p.value_cache.view(torch.uint8)[..., :64]),
         "FP8 KV cache"),
        (dict(seq_lens=p.seq_lens.long()), "seq_lens dtype int64"),
        (dict(block_table=p.block_table.long()), "block table dtype int64"),
        (dict(query=p.query.to(torch.float16)), "differs from the query"),
        (dict(query=p.query.float()), "dtype fp32"),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases.append((dict(key_cache=p.key_cache.to(torch.float8_e4m3fn), value_cache=p.value_cache.to(torch.float8_e4m3fn)),
                      "FP8 KV cache"))
    for change, needle in cases:
        t = dict(query=p.query, key_cache=p.key_cache, value_cache=p.value_cache, block_table=p.block_table,
                 seq_lens=p.seq_lens)
        t.update(change)
        a = ops.attention_args(t["query"], t["key_cache"], t["value_cache"], t["block_table"], t["seq_lens"], None,
                               p.scale)
        a.arch = 90
        st, why = guard(a)
        assert st == _lib.EUNSUPPORTED and needle in why, (needle, why)
    st, why = guard(args_of(p, query_len=2))
    assert st == _lib.EUNSUPPORTED and "2 query tokens per sequence" in why
    st, why = guard(args_of(p, flags=_lib.ATTN_ENCODER))
    assert "encoder or cross attention" in why
    st, why = guard(args_of(problem(), arch=75))
    assert "sm_75" in why
    a = args_of(problem())
    a.head_size = 96
    assert "head size 96" in guard(a)[1]


def test_cpu_tensors_are_handed_back():
    p = problem()
    assert ops.supports(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale) == (
        False, "tensors are not on a CUDA device")


@pytest.mark.parametrize("kw", [
    dict(),
    dict(dtype="fp16", layout="HND", window_left=30),
    dict(hq=4, hk=4, d=128, softcap=30.0),
    dict(hq=16, hk=1, d=256, sinks="fp32", lens=(1, 17, 0, 200)),
    dict(hq=32, hk=2, d=64, sinks="dtype", window_left=15, block_size=32, q_pad=64),
])
def test_c_oracle_matches_the_torch_reference(kw):
    p = problem(**kw)
    c = ops.reference_cpu(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale, p.softcap,
                          p.window_left, p.sinks)
    t = attn_bench.reference(p)
    assert c.shape == t.shape
    assert float((c - t).norm() / t.norm()) < 1e-12
    for b, L in enumerate(p.seq_lens.tolist()):
        if L <= 0:
            assert bool((c[b] == 0).all())


class _Remote(torch.Tensor):
    """A CPU tensor whose .cpu() makes a fresh copy, as a CUDA tensor's does."""

    def cpu(self):
        return self.as_subclass(torch.Tensor).clone()


def test_c_oracle_keeps_its_copies_alive_through_the_call(monkeypatch):
    # The argument struct holds addresses only: a copy dropped before the C call is read freed.
    p = problem(hq=16, hk=1, d=64, sinks="fp32", lens=(1, 17, 0, 200))
    made, real = [], torch.Tensor.clone

    def clone(self, *a, **kw):
        out = real(self, *a, **kw)
        made.append(weakref.ref(out))
        return out

    lib = _lib.lib()

    class Lib:
        def __getattr__(self, name):
            return getattr(lib, name)

        def opgraft_attention_reference(self, *a):
            assert made and all(r() is not None for r in made), "a CPU copy was freed before the oracle ran"
            return lib.opgraft_attention_reference(*a)

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    shim = Lib()
    monkeypatch.setattr(ops._lib, "lib", lambda: shim)
    remote = lambda x: x.as_subclass(_Remote)
    got = ops.reference_cpu(*(remote(x) for x in (p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens)),
                            p.scale, p.softcap, p.window_left, remote(p.sinks))
    monkeypatch.undo()
    assert float((got - attn_bench.reference(p)).norm() / attn_bench.reference(p).norm()) < 1e-12


def test_unused_blocks_are_nan_so_a_stray_read_shows():
    p = problem(lens=(20,))
    used = set(p.block_table[0, :2].tolist())
    spare = [b for b in range(p.key_cache.shape[0]) if b not in used]
    assert spare and bool(torch.isnan(p.key_cache[spare[0]].float()).all())


def test_custom_op_and_fake():
    assert hasattr(torch.ops.opgraft, "paged_decode_attention")
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = problem()
    with FakeTensorMode() as mode:
        ft = [mode.from_tensor(x) for x in (p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens)]
        out = torch.ops.opgraft.paged_decode_attention(*ft, p.scale)
    assert tuple(out.shape) == (3, 8, 64)


def _call(p, out, reason=""):
    seen = []

    def delegate():
        seen.append(True)
        return out

    call = dispatch.AttentionCall(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, out, p.scale, 0.0, -1,
                                  None, 0, delegate, extra_reason=reason)
    return call, seen


def test_dispatch_hands_back_and_counts(monkeypatch):
    dispatch.reset_stats()
    p = problem()
    out = torch.empty_like(p.query)
    call, seen = _call(p, out, "prefill or mixed batch (max_query_len > 1)")
    assert dispatch.dispatch("attention", call) is out and seen
    call, seen = _call(p, out)
    assert dispatch.dispatch("attention", call) is out and seen  # CPU tensors: the guard says no
    monkeypatch.setenv("OPGRAFT_ATTENTION_VARIANT", "passthrough")
    call, seen = _call(p, out)
    dispatch.dispatch("attention", call)
    s = dispatch.stats()["attention"]
    assert s["taken"] == 0 and s["delegated_by_reason"] == {
        "prefill or mixed batch (max_query_len > N)": 1, "tensors are not on a CUDA device": 1,
        "passthrough variant": 1}
    monkeypatch.setenv("OPGRAFT_ATTENTION_VARIANT", "no-such")
    assert dispatch.selected_variant("attention") == "passthrough"
    assert dispatch.VARIANT_ENV["attention"] == "OPGRAFT_ATTENTION_VARIANT"
    dispatch.reset_stats()


def test_dispatch_plans_a_taken_call_once(monkeypatch):
    # The dispatch path resolves the plan and runs it; the layout key is not built a second time.
    dispatch.reset_stats()
    p = problem()
    out = torch.empty_like(p.query)
    planned, ran = [], []
    plan = ops.Plan(None, "")
    plan.handle = 1  # stands for a C plan (never freed: reset below)

    def plan_for(*a, **k):
        planned.append(a)
        return plan

    monkeypatch.setattr(ops, "plan_for", plan_for)
    monkeypatch.setattr(ops, "run", lambda pl, o, *a: ran.append(pl) or o)
    try:
        call, _ = _call(p, out)
        assert dispatch.dispatch("attention", call) is out
        assert len(planned) == 1 and ran == [plan]
        assert dispatch.stats()["attention"]["taken"] == 1
    finally:
        plan.handle = None
        dispatch.reset_stats()


def test_prepare_refuses_what_the_guard_refuses():
    ok, why = ops.prepare(8, 2, 64, torch.float32, "cpu")
    assert not ok and "float32" in why


def test_a_plan_is_per_batch():
    """The guard's batch limit and the tuned rows depend on the batch, so two batches of one layout
    never share a plan (a plan made at batch 1 must not run batch 64)."""
    p1 = attn_bench.make_problem([5], 8, 2, 64, device="cpu")
    p2 = attn_bench.make_problem([5, 7], 8, 2, 64, device="cpu")
    k1 = ops._layout_key(p1.query, p1.key_cache, p1.value_cache, p1.block_table, p1.seq_lens, None, p1.scale, 0.0,
                         -1, None, 0, 1)
    k2 = ops._layout_key(p2.query, p2.key_cache, p2.value_cache, p2.block_table, p2.seq_lens, None, p2.scale, 0.0,
                         -1, None, 0, 1)
    assert (k1[0], k2[0]) == (1, 2) and k1 != k2


def test_prepare_loads_every_capture_size_and_needs_only_batch_one(monkeypatch):
    seen = []

    def one(*args, update=False, qk_norm=False, rope_style=0, flags=0):
        batch = args[-1]
        seen.append(batch)
        return (True, "") if batch <= 32 else (False, f"batch {batch} > attention.max_batch 32")

    monkeypatch.setattr(ops, "_prepare_one", one)
    assert ops.prepare(32, 4, 128, torch.bfloat16, "cpu", batches=(64, 8, 2, 8)) == (True, "")
    assert seen == [1, 2, 8, 64]  # batch 1 first; a size the guard refuses does not fail the layer
    seen.clear()
    monkeypatch.setattr(ops, "_prepare_one", lambda *a, **k: seen.append(a[-1]) or (False, "no NVRTC"))
    assert ops.prepare(32, 4, 128, torch.bfloat16, "cpu", batches=(8,)) == (False, "no NVRTC")
    assert seen == [1]


def prologue(p, rows=None, norm=True, rope=_lib.ROPE_NEOX):
    """Qwen3's q/k RMSNorm and NeoX rotary embedding for p's rows, positions L-1."""
    rows = rows or p.seq_lens.shape[0]
    pro = attn_bench.make_prologue(p.query.dtype, p.query.shape[2], rows, "cpu", norm, rope, rope_rows=512)
    lens = p.seq_lens.tolist() + [1] * (rows - p.seq_lens.shape[0])
    pro.positions.copy_(torch.tensor([max(L - 1, 0) for L in lens], dtype=torch.int64))
    return pro


def test_args_of_a_call_with_q_k_norm_and_rotary_embedding():
    p = problem()
    key, value, slots = new_rows(p, rows=4)
    pro = prologue(p, rows=4)
    a = args_of(p, key=key, value=value, slot_mapping=slots, pro=pro)
    assert a.q_norm_weight == pro.q_norm_weight.data_ptr() and a.k_norm_weight == pro.k_norm_weight.data_ptr()
    assert a.qk_norm_dtype == _lib.DTYPE_BF16 and a.qk_norm_eps == pro.eps
    assert a.rope_style == _lib.ROPE_NEOX and a.cos_sin_cache == pro.cos_sin_cache.data_ptr()
    assert (a.cos_sin_dtype, a.cos_sin_stride, a.rope_rows) == (_lib.DTYPE_BF16, 64, 512)
    assert a.positions == pro.positions.data_ptr() and a.positions_dtype == _lib.DTYPE_INT64
    assert guard(a) == (_lib.OK, "")
    assert guard(args_of(p, key=key, value=value, slot_mapping=slots, pro=pro._replace(q_norm_weight=None,
                                                                                       k_norm_weight=None))) == (_lib.OK, "")
    # tensors that do not fit the heads, or a prologue without the new keys: refused before the guard
    for change in (dict(q_norm_weight=pro.q_norm_weight[:32]), dict(k_norm_weight=pro.k_norm_weight.view(2, 32)),
                   dict(k_norm_weight=None), dict(cos_sin_cache=pro.cos_sin_cache[:, :32]),
                   dict(positions=pro.positions[:2]), dict(positions=None), dict(cos_sin_cache=pro.cos_sin_cache[0]),
                   dict(cos_sin_cache=torch.zeros(512, 128, dtype=torch.bfloat16))):
        assert args_of(p, key=key, value=value, slot_mapping=slots, pro=pro._replace(**change)).dtype == -1, change
    assert args_of(p, pro=pro).dtype == -1
    # dtypes and strides the guard refuses, with its reasons
    for change, needle in ((dict(q_norm_weight=pro.q_norm_weight.float(), k_norm_weight=pro.k_norm_weight.float()),
                            "q/k norm weight dtype fp32"),
                           (dict(positions=pro.positions.int()), "positions dtype int32"),
                           (dict(cos_sin_cache=pro.cos_sin_cache.float()), "cos/sin cache dtype fp32"),
                           (dict(cos_sin_cache=torch.zeros(512, 68, dtype=torch.bfloat16)[:, :64]), "row stride 68"),
                           (dict(rope_style=3), "unknown rotary embedding style 3")):
        st, why = guard(args_of(p, key=key, value=value, slot_mapping=slots, pro=pro._replace(**change)))
        assert st == _lib.EUNSUPPORTED and needle in why, (needle, why)
    # a plan's layout has the prologue's form (not its pointers)
    lk = lambda pro: ops._layout_key(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, None, p.scale,
                                     0.0, -1, None, 0, 1, key, value, slots, pro)
    assert lk(pro) == lk(prologue(p, rows=4)) != lk(None)
    assert lk(pro) != lk(pro._replace(rope_style=_lib.ROPE_GPTJ)) != lk(pro._replace(eps=1e-5))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(dtype="fp16", layout="HND", window_left=30, rope=_lib.ROPE_GPTJ),
    dict(hq=4, hk=4, d=128, norm=False),
    dict(hq=16, hk=1, d=256, sinks="fp32", lens=(1, 17, 0, 200), rope=_lib.ROPE_NONE),
])
def test_c_oracle_with_the_prologue_matches_torch(kw):
    """The C oracle normalizes and rotates the query and the new key as the GPU check's torch code
    (vLLM's ops, in fp32 rounded once) does: the stored keys within the GPU check's tolerance, the
    output within the dtype's tolerance of torch's fp64 attention on them."""
    norm, rope = kw.pop("norm", True), kw.pop("rope", _lib.ROPE_NEOX)
    p = problem(**kw)
    B = p.seq_lens.shape[0]
    key, value, _ = new_rows(p)
    torch.manual_seed(0)
    key.copy_(torch.randn(key.shape).to(key.dtype)), value.copy_(torch.randn(value.shape).to(value.dtype))
    bs = p.key_cache.shape[1]
    slots = torch.tensor([int(p.block_table[b, (L - 1) // bs]) * bs + (L - 1) % bs if L > 0 else -1
                          for b, L in enumerate(p.seq_lens.tolist())], dtype=torch.int64)
    pro = prologue(p, norm=norm, rope=rope)
    got = ops.reference_cpu(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.scale, p.softcap,
                            p.window_left, p.sinks, key=key, value=value, slot_mapping=slots, pro=pro)
    want_k = attn_bench.qk_prologue_torch(key, pro.k_norm_weight, pro)
    ulp = 2.0 ** (-7 if key.dtype == torch.bfloat16 else -10)
    for b, slot in enumerate(slots.tolist()):
        if slot >= 0:
            stored, want = p.key_cache[slot // bs, slot % bs].float(), want_k[b].float()
            assert bool(((stored - want).abs() <= 2 * ulp * want.abs().amax(-1, keepdim=True) + 1e-6).all()), b
            assert torch.equal(p.value_cache[slot // bs, slot % bs], value[b])
    q = attn_bench.qk_prologue_torch(p.query, pro.q_norm_weight, pro)
    want = attn_bench.reference(dataclasses.replace(p, query=q))
    assert float((got - want).norm() / want.norm()) < attn_bench.TOLERANCE[kw.get("dtype", "bf16")]
    if norm or rope:  # and the prologue changed something
        plain = attn_bench.reference(p)
        assert float((got - plain).norm() / plain.norm()) > 0.05


def test_a_run_sets_the_plans_argument_struct_as_attention_args_would():
    """run_args (the struct of a prologue plan's run: the plan's copied, the call's pointers set)
    is byte for byte attention_args of the call."""
    p = problem(sinks="fp32")
    key, value, slots = new_rows(p, rows=4)
    pro = prologue(p, rows=4)
    out = torch.empty((4, 8, 64), dtype=torch.bfloat16)
    args = lambda p, key, value, slots, out, pro, n: ops.attention_args(
        p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, out, p.scale, p.softcap, p.window_left,
        p.sinks, n, key=key, value=value, slot_mapping=slots, pro=pro)
    planned = args(p, key, value, slots, out, pro, 0)
    q = problem(sinks="fp32", seed=5)  # the same layout, other tensors
    key2, value2, slots2 = new_rows(q, rows=4)
    pro2, out2 = prologue(q, rows=4), torch.empty_like(out)
    got = ops.run_args(planned, q.query, q.key_cache, q.value_cache, q.block_table, q.seq_lens, out2, q.sinks, 77,
                       key2, value2, slots2, pro2)
    assert bytes(got) == bytes(args(q, key2, value2, slots2, out2, pro2, 77)) != bytes(planned)


def test_the_prologue_alone_refuses_inconsistent_and_cpu_tensors():
    """ops.attention.qk_prologue (the library's opgraft_attention_prologue_run, whose guard
    test_attention_guard.c checks): tensors that do not describe one call, and CPU tensors, are
    refused before the library is called (a GPU would read host pointers)."""
    D, rows = 128, 5
    qkv = torch.randn((rows, (32 + 2 * 4) * D)).to(torch.bfloat16)
    q, k = qkv[:, :32 * D].view(rows, 32, D), qkv[:, 32 * D:36 * D].view(rows, 4, D)
    pro = attn_bench.make_prologue(torch.bfloat16, D, rows, "cpu")
    for bad in ((q, k[:3], pro), (q, k.half(), pro), (q, k, pro._replace(positions=pro.positions[:2])),
                (q, k, pro._replace(q_norm_weight=pro.q_norm_weight[:64]))):
        with pytest.raises(_lib.OpgraftError, match="do not describe one call"):
            ops.qk_prologue(*bad)
    with pytest.raises(_lib.OpgraftError, match="not on a CUDA device") as e:
        ops.qk_prologue(q, k, pro)
    assert e.value.status == _lib.EUNSUPPORTED
