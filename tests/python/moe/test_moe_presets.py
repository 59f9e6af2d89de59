import json

import pytest

from opgraft.presets import PRESETS, ConfigError, from_config, resolve


def test_presets_carry_public_config_values():
    q = PRESETS["Qwen3-30B-A3B"]
    assert (q.num_experts, q.hidden, q.inter, q.top_k) == (128, 2048, 768, 8)
    m = PRESETS["Mixtral-8x7B"]
    assert (m.num_experts, m.hidden, m.inter, m.top_k) == (8, 4096, 14336, 2)
    k = PRESETS["Kimi-K2"]
    assert (k.num_experts, k.hidden, k.inter, k.top_k) == (384, 7168, 2048, 8)
    assert q.expert_bytes() == 3 * 768 * 2048 * 2


def test_resolve_is_case_insensitive():
    assert resolve("qwen3-30b-a3b") is PRESETS["Qwen3-30B-A3B"]


@pytest.mark.parametrize(
    "cfg, expect",
    [
        ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "hidden_size": 2048,
          "moe_intermediate_size": 768, "intermediate_size": 6144, "num_experts_per_tok": 8}, (128, 2048, 768, 8)),
        ({"num_local_experts": 8, "hidden_size": 4096, "intermediate_size": 14336, "num_experts_per_tok": 2},
         (8, 4096, 14336, 2)),
        ({"n_routed_experts": 256, "hidden_size": 7168, "moe_intermediate_size": 2048, "intermediate_size": 18432,
          "num_experts_per_tok": 8}, (256, 7168, 2048, 8)),
        ({"architectures": ["X"], "text_config": {"num_experts": 16, "hidden_size": 512, "moe_intermediate_size": 256,
                                                  "num_experts_per_tok": 2}}, (16, 512, 256, 2)),
    ],
)
def test_from_config_reads_each_family(cfg, expect):
    s = from_config(cfg)
    assert (s.num_experts, s.hidden, s.inter, s.top_k) == expect


@pytest.mark.parametrize(
    "cfg, msg",
    [
        ([], "must be a JSON object"),
        ({"hidden_size": 4096, "intermediate_size": 11008}, "not a MoE config"),
        ({"num_experts": 8, "hidden_size": -1, "intermediate_size": 64, "num_experts_per_tok": 2}, "positive"),
        ({"num_experts": 8, "hidden_size": True, "intermediate_size": 64, "num_experts_per_tok": 2}, "positive"),
        ({"num_experts": 8, "hidden_size": "4096", "intermediate_size": 64, "num_experts_per_tok": 2}, "positive"),
        ({"num_experts": 2, "hidden_size": 64, "intermediate_size": 64, "num_experts_per_tok": 4}, "experts"),
    ],
)
def test_from_config_rejects_malformed(cfg, msg):
    with pytest.raises(ConfigError, match=msg):
        from_config(cfg)


def test_resolve_reads_config_files(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_experts": 64, "hidden_size": 2048, "moe_intermediate_size": 1024,
                             "num_experts_per_tok": 8}))
    assert resolve(str(p)).num_experts == 64
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="unknown model"):
        resolve("no-such-model")


def test_per_rank_shapes():
    q = PRESETS["Qwen3-30B-A3B"]
    assert q.per_rank(1) is q
    s = q.per_rank(8)
    assert (s.num_experts, s.hidden, s.inter, s.top_k, s.name) == (128, 2048, 96, 8, "Qwen3-30B-A3B/tp8")
    with pytest.raises(ConfigError, match="does not split"):
        q.per_rank(5)


def test_resolve_takes_a_model_folder_holding_config_json(tmp_path):
    """vLLM users name a model by its folder: --model takes one wherever it is taken."""
    d = tmp_path / "Tiny-MoE"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["TinyMoe"], "num_experts": 4, "hidden_size": 64,
                                               "moe_intermediate_size": 32, "num_experts_per_tok": 2}))
    shape = resolve(str(d))
    assert (shape.name, shape.num_experts, shape.top_k) == ("TinyMoe", 4, 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json: cannot read"):
        resolve(str(empty))


def test_a_config_that_is_not_utf8_is_a_clear_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b'{"architectures": ["X\xff\xfe"]}')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff at offset 21\)"):
        resolve(str(p))


def test_malformed_configs_are_clear_errors(tmp_path):
    """A FIFO, JSON nested past the parser's depth and sizes past 2^31 are errors that say so, not
    a hang, a traceback or a size wrapped around by ctypes."""
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        resolve(str(fifo))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        resolve(str(deep))
    base = {"num_experts": 64, "hidden_size": 2048, "moe_intermediate_size": 1024, "num_experts_per_tok": 8}
    with pytest.raises(ConfigError, match="hidden must be a positive integer below 2"):
        from_config({**base, "hidden_size": 2**64 + 2048})


def test_moe_layer_count_takes_only_counts():
    from opgraft.presets import moe_layer_count

    cfg = {"num_hidden_layers": 8, "first_k_dense_replace": 2, "mlp_only_layers": [5]}
    assert moe_layer_count(cfg) == 5
    for bad in ({"first_k_dense_replace": "3"}, {"mlp_only_layers": 5}, {"mlp_only_layers": [[1]]},
                {"num_hidden_layers": 10**11}, {"num_hidden_layers": True}):
        assert moe_layer_count({**cfg, **bad}) is None, bad
