"""The dims of public models each op's bench knows by name (from each model's config.json on its
public model card), and a reader for any Hugging Face config.json. No torch here: the CLI reads
these on machines without it."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoeShape:
    name: str
    num_experts: int  # E
    hidden: int  # H
    inter: int  # I (per expert, moe_intermediate_size)
    top_k: int  # k

    def expert_bytes(self, elem_bytes: int = 2) -> int:
        """Bytes of one expert's weights: w13 [2I, H] and w2 [H, I]."""
        return 3 * self.inter * self.hidden * elem_bytes

    def as_dict(self) -> dict:
        return asdict(self)

    def tune_key(self, dtype: str = "bf16") -> str:
        """The shape field of tunable rows and tune-file entries (as the library builds it)."""
        return f"moe:{dtype}:E{self.num_experts}:H{self.hidden}:I{self.inter}:k{self.top_k}"

    def per_rank(self, tp: int = 1) -> "MoeShape":
        """The shape one rank sees under vLLM's tensor parallelism: each expert's I split tp ways."""
        if tp == 1:
            return self
        if tp < 1 or self.inter % tp:
            raise ConfigError(f"{self.name}: intermediate size {self.inter} does not split {tp} ways")
        return MoeShape(f"{self.name}/tp{tp}", self.num_experts, self.hidden, self.inter // tp, self.top_k)


# config.json fields: num_experts / num_local_experts / n_routed_experts, hidden_size,
# moe_intermediate_size (or intermediate_size for Mixtral), num_experts_per_tok.
PRESETS = {
    p.name: p
    for p in [
        MoeShape("Qwen3-30B-A3B", 128, 2048, 768, 8),
        MoeShape("Qwen3-235B-A22B", 128, 4096, 1536, 8),
        MoeShape("Mixtral-8x7B", 8, 4096, 14336, 2),
        MoeShape("Mixtral-8x22B", 8, 6144, 16384, 2),
        MoeShape("DeepSeek-V3", 256, 7168, 2048, 8),
        MoeShape("Kimi-K2", 384, 7168, 2048, 8),
        MoeShape("OLMoE-1B-7B", 64, 2048, 1024, 8),
    ]
}


class ConfigError(ValueError):
    pass


def _first(cfg: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return None


def from_config(cfg: dict, name: str = "config") -> MoeShape:
    """MoE dims from a Hugging Face config dict (text_config is looked into for multimodal models)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: the top level must be a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        merged = dict(cfg["text_config"])
        merged.setdefault("architectures", cfg.get("architectures"))
        cfg = merged
    fields = {
        "num_experts": _first(cfg, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
        "hidden": _first(cfg, ("hidden_size", "d_model")),
        "inter": _first(cfg, ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")),
        "top_k": _first(cfg, ("num_experts_per_tok", "moe_top_k", "top_k", "num_experts_per_token")),
    }
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ConfigError(f"{name}: not a MoE config (missing {', '.join(missing)})")
    for k, v in fields.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 1 << 31:
            raise ConfigError(f"{name}: {k} must be a positive integer below 2^31, got {v!r}")
    if fields["top_k"] > fields["num_experts"]:
        raise ConfigError(f"{name}: num_experts_per_tok {fields['top_k']} > {fields['num_experts']} experts")
    label = (cfg.get("architectures") or [name])[0] if isinstance(cfg.get("architectures"), list) else name
    if isinstance(cfg.get("_name_or_path"), str) and cfg["_name_or_path"].strip("/"):
        label = cfg["_name_or_path"].rstrip("/").rsplit("/", 1)[-1]  # the model's own name, as HF writes it
    return MoeShape(str(label), fields["num_experts"], fields["hidden"], fields["inter"], fields["top_k"])


def moe_layer_count(cfg: dict) -> int | None:
    """How many decoder layers are MoE layers in a Hugging Face config (None if unknown)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]

    def count(v) -> bool:  # a non-negative int a model could have (bool is an int to Python)
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 16

    n = cfg.get("num_hidden_layers")
    if not count(n) or n == 0:
        return None
    dense = cfg.get("mlp_only_layers") or []
    first_dense = cfg.get("first_k_dense_replace") or 0
    if not isinstance(dense, list) or not all(count(i) for i in dense) or not count(first_dense):
        return None
    dense = set(dense)
    step = cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq") or 1
    if not count(step) or step == 0:
        step = 1
    return sum(1 for i in range(n) if i >= first_dense and i not in dense and (i + 1) % step == 0)


def load_config(path: str) -> dict:
    try:
        # O_NONBLOCK: a FIFO must not wait for a writer; only a regular file is read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"{path}: not a regular file")
            data = f.read((1 << 24) + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > 1 << 24:
        raise ConfigError(f"{path}: larger than 16 MiB: not a Hugging Face config.json")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
                          "not a Hugging Face config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply") from None


def _preset(model: str) -> MoeShape | None:
    for name, shape in PRESETS.items():
        if name.lower() == model.lower():
            return shape
    return None


def config_path(model: str) -> str | None:
    """The config.json a --model value names: the file itself, or the one inside a model folder (as
    vLLM users name models); None for a preset name or a value that names no file."""
    if _preset(model) is not None:
        return None
    if os.path.isdir(model):
        return os.path.join(model, "config.json")
    if model.endswith(".json") or os.sep in model or os.path.exists(model):
        return model
    return None


def resolve(model: str) -> MoeShape:
    """A preset name (case-insensitive), the path of a config.json, or a model folder holding one."""
    shape = _preset(model)
    if shape is not None:
        return shape
    path = config_path(model)
    if path:
        return from_config(load_config(path), model)
    raise ConfigError(f"unknown model {model!r}: use one of {', '.join(PRESETS)}, a config.json path or a model "
                      "folder holding one")


# ---- the linear op: the projections vLLM's unquantized linear layers run, per rank ----------


@dataclass(frozen=True)
class LinearShape:
    """One projection: weight [out_features, in_features] (N, K), as one rank holds it."""

    model: str
    proj: str  # qkv, o, gate_up, down, router, lm_head
    out_features: int  # N
    in_features: int  # K

    def weight_bytes(self, elem_bytes: int = 2) -> int:
        return self.out_features * self.in_features * elem_bytes

    def tune_key(self, dtype: str = "bf16") -> str:
        """The shape field of tunable rows and tune-file entries (as the library builds it)."""
        return f"linear:{dtype}:N{self.out_features}:K{self.in_features}"


def projections(model: str, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int, inter: int = 0,
                experts: int = 0, tp: int = 1) -> list[LinearShape]:
    """A decoder layer's projections and the lm_head on one of tp ranks, as vLLM shards them:
    QKVParallelLinear (q heads split, kv heads split or replicated when fewer than tp), the
    row-parallel o and down projections, the merged gate_up of a dense MLP (inter > 0), the
    replicated router gate of a MoE layer (experts > 0), and ParallelLMHead (the vocabulary padded
    to a multiple of 64, then split)."""
    name = model if tp == 1 else f"{model}/tp{tp}"
    kv = max(1, kv_heads // tp) * head_dim
    out = [LinearShape(name, "qkv", heads * head_dim // tp + 2 * kv, hidden),
           LinearShape(name, "o", hidden, heads * head_dim // tp)]
    if inter:
        out += [LinearShape(name, "gate_up", 2 * inter // tp, hidden), LinearShape(name, "down", hidden, inter // tp)]
    if experts:
        out.append(LinearShape(name, "router", experts, hidden))
    out.append(LinearShape(name, "lm_head", (vocab + 63) // 64 * 64 // tp, hidden))
    return out


# config.json fields: hidden_size, num_attention_heads, num_key_value_heads, head_dim,
# vocab_size, intermediate_size (dense MLPs), num_experts / num_local_experts (router gates).
LINEAR_PRESETS = {
    "Qwen3-30B-A3B": projections("Qwen3-30B-A3B", 2048, 32, 4, 128, 151936, experts=128),
    "Qwen3-235B-A22B": projections("Qwen3-235B-A22B", 4096, 64, 4, 128, 151936, experts=128),
    "Mixtral-8x7B": projections("Mixtral-8x7B", 4096, 32, 8, 128, 32000, experts=8),
    "Llama-3-8B": projections("Llama-3-8B", 4096, 32, 8, 128, 128256, inter=14336),
    "Llama-3-70B/tp8": projections("Llama-3-70B", 8192, 64, 8, 128, 128256, inter=28672, tp=8),
}


# Block-FP8 projections (128x128 blocks): Qwen3-30B-A3B-FP8's qkv, o and router gate (config.json:
# hidden 2048, 32 q / 4 kv heads of 128, 128 experts) and DeepSeek-V3's dense q_a, kv_a, q_b and o
# projections (hidden 7168, q_lora_rank 1536, kv_lora_rank 512 + qk_rope_head_dim 64, 128 heads of
# qk 192 / v 128).
LINEAR_FP8_PRESETS = {
    "Qwen3-30B-A3B-FP8": [s for s in projections("Qwen3-30B-A3B-FP8", 2048, 32, 4, 128, 151936, experts=128)
                          if s.proj != "lm_head"],
    "DeepSeek-V3": [LinearShape("DeepSeek-V3", "q_a", 1536, 7168), LinearShape("DeepSeek-V3", "kv_a", 576, 7168),
                    LinearShape("DeepSeek-V3", "q_b", 128 * 192, 1536), LinearShape("DeepSeek-V3", "o", 7168, 128 * 128)],
}


@dataclass(frozen=True)
class AttnShape:
    name: str
    heads_q: int
    heads_kv: int
    head_size: int


# Per-rank attention heads; head-64 and head-256 stand for the other head sizes the kernel builds.
ATTENTION_PRESETS = {
    "Qwen3-30B-A3B": AttnShape("Qwen3-30B-A3B", 32, 4, 128),
    "Llama-3-8B": AttnShape("Llama-3-8B", 32, 8, 128),
    "head-64": AttnShape("head-64", 16, 2, 64),
    "head-256": AttnShape("head-256", 8, 4, 256),
}

# (preset, batch, context): Qwen3-30B-A3B at batch 1/8 x 192 tokens (a short prompt's decode, where
# the split count changes: vLLM's Triton backend led ours there at batch 1, bench/NOTES.md v55) and
# at batch 1/8/64 x 1K/8K/32K, then the other head shapes.
ATTENTION_POINTS = [("Qwen3-30B-A3B", b, 192) for b in (1, 8)] + [
    ("Qwen3-30B-A3B", b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)] + [
    ("Llama-3-8B", 1, 1024), ("Llama-3-8B", 8, 8192), ("head-64", 8, 8192), ("head-256", 1, 1024),
    ("head-256", 8, 8192)]
