"""Tiny models with random bf16 weights and an offline tokenizer.

:func:`build_tiny_qwen2`: Qwen2-shaped (one full-attention KV-cache group).
:func:`build_tiny_gemma3`: Gemma-3-shaped text model whose layers alternate sliding-window
and full attention: with vLLM's hybrid KV-cache manager, two KV-cache groups, and null
blocks in the sliding-window group for blocks outside the window.
:func:`build_tiny_deepseek_v2`: DeepSeek-V2-Lite-shaped attention (MLA: one latent cache
per layer, kv_lora_rank 512 + rope 64), dense MLPs only.

Deterministic: same files for the same arguments (seeded weights, a BPE
tokenizer trained on the interpreter's own standard library sources).  No
download, no torch needed to build it.

    python -m tests.support.tiny_model OUT_DIR [--layers N] [--hidden H] [--gemma3 | --mla]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import struct
import sysconfig
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyQwen2:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 2048
    max_positions: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _corpus():
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    for f in files[:120]:
        with open(f, encoding="utf-8", errors="replace") as fh:
            yield fh.read()


def _build_tokenizer(out: str, cfg: TinyQwen2) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab, special_tokens=SPECIAL,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>",
                                   model_max_length=cfg.max_positions)
    fast.save_pretrained(out)
    return int(tok.get_vocab_size())


def _bf16_bytes(a: np.ndarray) -> bytes:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    return u.astype("<u2").tobytes()


def _save_safetensors(path: str, tensors: dict) -> None:
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = _bf16_bytes(a)
        header[name] = {"dtype": "BF16", "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


Linear = Callable[..., np.ndarray]


def _linear_init(rng: np.random.Generator) -> Linear:
    """``lin(out, in, scale=1.0)``: a weight of unit-variance outputs times ``scale``."""
    def lin(o: int, i: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((o, i), dtype=np.float32) * (scale / np.sqrt(i))
    return lin


def _gated_mlp(prefix: str, cfg: TinyQwen2, lin: Linear) -> dict:
    """One layer's gate/up/down projections (drawn in this order)."""
    return {prefix + "mlp.gate_proj.weight": lin(cfg.intermediate, cfg.hidden),
            prefix + "mlp.up_proj.weight": lin(cfg.intermediate, cfg.hidden),
            prefix + "mlp.down_proj.weight": lin(cfg.hidden, cfg.intermediate)}


def _build_weights(out: str, cfg: TinyQwen2, vocab: int) -> None:
    rng = np.random.default_rng(cfg.seed)
    lin = _linear_init(rng)

    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, cfg.hidden), dtype=np.float32),
         "model.norm.weight": np.ones(cfg.hidden, np.float32),
         "lm_head.weight": lin(vocab, cfg.hidden, 4.0)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(cfg.hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(cfg.hidden, np.float32)
        for n, rows in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)):
            t[p + f"self_attn.{n}_proj.weight"] = lin(rows * cfg.head_dim, cfg.hidden)
            t[p + f"self_attn.{n}_proj.bias"] = 0.1 * rng.standard_normal(
                rows * cfg.head_dim, dtype=np.float32)
        t[p + "self_attn.o_proj.weight"] = lin(cfg.hidden, cfg.heads * cfg.head_dim)
        t.update(_gated_mlp(p, cfg, lin))
    _save_safetensors(os.path.join(out, "model.safetensors"), t)


def _build_config(out: str, cfg: TinyQwen2, vocab: int) -> None:
    conf = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": cfg.layers, "hidden_act": "silu",
        "rope_theta": 10000.0, "attention_dropout": 0.0,
    }
    _write_config(out, conf)


#: in every tiny model's config: bf16 weights, token 0 begins, ends and pads a text
COMMON_CONFIG = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
                 "torch_dtype": "bfloat16", "dtype": "bfloat16", "initializer_range": 0.02,
                 "use_cache": True}


def _write_config(out: str, conf: dict) -> None:
    """``config.json`` (``conf`` and :data:`COMMON_CONFIG`) and a greedy
    ``generation_config.json`` (token 0 ends a text)."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**COMMON_CONFIG, **conf}, f, indent=2, sort_keys=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 0, "do_sample": False}, f)


def build_tiny_qwen2(out: str, cfg: TinyQwen2 = TinyQwen2()) -> str:
    """Write the model into ``out`` (created) unless it is already complete there."""
    return _build(out, cfg, _build_config, _build_weights)


def build_qwen2_config_only(out: str, cfg: TinyQwen2) -> str:
    """The tokenizer and ``config.json`` of :func:`build_tiny_qwen2`, no weight file: for
    vLLM's ``load_format="dummy"`` (it draws the weights itself, with a fixed seed, so two
    engines hold the same ones), for shapes whose weights would take minutes to write."""
    return _build(out, cfg, _build_config, lambda *_: None)


@dataclass(frozen=True)
class TinyGemma3(TinyQwen2):
    """Layers alternate sliding-window (``window`` tokens) and full attention."""

    window: int = 48
    #: bumped when the weights' recipe changes (a kept model directory is then rebuilt)
    recipe: int = 2


def _gemma3_layer_types(cfg: TinyGemma3) -> list:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.layers)]


def _build_gemma3_config(out: str, cfg: TinyGemma3, vocab: int) -> None:
    conf = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_positions, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": False,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 100000.0}},
        "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": cfg.head_dim,
        "sliding_window": cfg.window, "layer_types": _gemma3_layer_types(cfg),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }
    _write_config(out, conf)


def _build_gemma3_weights(out: str, cfg: TinyGemma3, vocab: int) -> None:
    rng = np.random.default_rng(cfg.seed)
    lin = _linear_init(rng)

    # Gemma's RMSNorm multiplies by (1 + weight): zeros are the identity; the embedding is
    # scaled by sqrt(hidden) in the model, so it is drawn small here
    # (a separate LM head, and attention outputs weighted 3x the embedding in the residual:
    # the tokens then depend on the KV cache, so that a load that did not happen is seen)
    zeros = np.zeros(cfg.hidden, np.float32)
    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, cfg.hidden), dtype=np.float32)
         / np.sqrt(cfg.hidden), "model.norm.weight": zeros,
         "lm_head.weight": lin(vocab, cfg.hidden, 4.0)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            t[p + f"{norm}.weight"] = zeros
        t[p + "post_attention_layernorm.weight"] = np.full(cfg.hidden, 2.0, np.float32)
        t[p + "self_attn.q_norm.weight"] = np.zeros(cfg.head_dim, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.zeros(cfg.head_dim, np.float32)
        for n, rows in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)):
            t[p + f"self_attn.{n}_proj.weight"] = lin(rows * cfg.head_dim, cfg.hidden)
        t[p + "self_attn.o_proj.weight"] = lin(cfg.hidden, cfg.heads * cfg.head_dim)
        t.update(_gated_mlp(p, cfg, lin))
    _save_safetensors(os.path.join(out, "model.safetensors"), t)


def build_tiny_gemma3(out: str, cfg: TinyGemma3 = TinyGemma3()) -> str:
    """Write the hybrid (sliding-window + full attention) model into ``out`` unless it is
    already complete there."""
    return _build(out, cfg, _build_gemma3_config, _build_gemma3_weights)


@dataclass(frozen=True)
class TinyDeepseekV2(TinyQwen2):
    """Multi-head latent attention with DeepSeek-V2-Lite's dimensions (no query LoRA), so
    that vLLM's MLA kernels take it; every layer's MLP dense (``first_k_dense_replace``)."""

    kv_heads: int = 4  # MLA: one latent per token, heads only in the projections
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128


def _build_deepseek_v2_config(out: str, cfg: TinyDeepseekV2, vocab: int) -> None:
    conf = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
        "moe_intermediate_size": cfg.intermediate // 4, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "first_k_dense_replace": cfg.layers, "moe_layer_freq": 1, "routed_scaling_factor": 1.0,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": None,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False,
    }
    _write_config(out, conf)


def _build_deepseek_v2_weights(out: str, cfg: TinyDeepseekV2, vocab: int) -> None:
    rng = np.random.default_rng(cfg.seed)
    lin = _linear_init(rng)

    ones = np.ones(cfg.hidden, np.float32)
    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, cfg.hidden), dtype=np.float32),
         "model.norm.weight": ones, "lm_head.weight": lin(vocab, cfg.hidden, 4.0)}
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones
        t[p + "post_attention_layernorm.weight"] = ones
        t[p + "self_attn.q_proj.weight"] = lin(cfg.heads * qk_head, cfg.hidden)
        t[p + "self_attn.kv_a_proj_with_mqa.weight"] = lin(
            cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden)
        t[p + "self_attn.kv_a_layernorm.weight"] = np.ones(cfg.kv_lora_rank, np.float32)
        t[p + "self_attn.kv_b_proj.weight"] = lin(
            cfg.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        t[p + "self_attn.o_proj.weight"] = lin(cfg.hidden, cfg.heads * cfg.v_head_dim, 3.0)
        t.update(_gated_mlp(p, cfg, lin))
    _save_safetensors(os.path.join(out, "model.safetensors"), t)


def build_tiny_deepseek_v2(out: str, cfg: TinyDeepseekV2 = TinyDeepseekV2()) -> str:
    """Write the MLA model into ``out`` unless it is already complete there."""
    return _build(out, cfg, _build_deepseek_v2_config, _build_deepseek_v2_weights)


def _build(out: str, cfg: TinyQwen2, config: Any, weights: Any) -> str:
    stamp = os.path.join(out, ".complete")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == repr(cfg):
                return out
    os.makedirs(out, exist_ok=True)
    vocab = _build_tokenizer(out, cfg)
    config(out, cfg, vocab)
    weights(out, cfg, vocab)
    with open(stamp, "w") as f:
        f.write(repr(cfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--gemma3", action="store_true",
                      help="the hybrid sliding-window + full attention model")
    kind.add_argument("--mla", action="store_true",
                      help="the DeepSeek-V2-shaped model (multi-head latent attention)")
    a = ap.parse_args()
    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate)
    if a.mla:
        shape["kv_heads"] = shape["heads"]
        print(build_tiny_deepseek_v2(a.out, TinyDeepseekV2(**shape)))
    elif a.gemma3:
        print(build_tiny_gemma3(a.out, TinyGemma3(**shape)))
    else:
        print(build_tiny_qwen2(a.out, TinyQwen2(**shape)))


if __name__ == "__main__":
    main()
