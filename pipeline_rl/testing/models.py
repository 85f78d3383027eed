"""Model checkpoints for tests and benchmarks: tiny random checkpoints of several Hugging Face
architectures, each shaped like a real one, and reading a checkpoint's tensors as a trainer pushes them.

    path = build_checkpoint("llama", Path("/tmp/llama"))           # tokenizer + config + weights, seconds
    named = load_named_tensors(path)                                 # [(hf_name, tensor), ...] in file order
    python -m pipeline_rl.testing.models --out /tmp/zoo              # every architecture, one directory each

Each checkpoint has a byte-level BPE tokenizer trained here with `tokenizers` (on a small corpus of
arithmetic word problems, so gsm8k-style prompts tokenize into real merges), its own chat template and
end-of-turn token, float32 weights drawn from a seeded generator (the same bytes every time), tied
embeddings on some architectures and untied on others, and on some a `vocab_size` padded past the
tokenizer's size, as real checkpoints are. Sizes keep head_dim at 32, what vLLM-CPU's attention needs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

# Chat templates in each family's own format; {{ eos }} is the architecture's end-of-turn token.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}[INST] {{ message['content'] }} [/INST]{% endif %}{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Architecture:
    """What differs between the families: config class, special tokens, template, head tying, vocab."""

    model_type: str
    config_class: str  # in transformers
    model_class: str
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str  # end of an assistant turn: what generation stops on
    pad: str
    chat_template: str
    tie_word_embeddings: bool
    extra_vocab: int  # config vocab_size = the tokenizer's size + this (rows no token ever maps to)
    extra_config: dict = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        chat_template=LLAMA3_TEMPLATE,
        tie_word_embeddings=False,
        extra_vocab=64,  # a vocab_size larger than the tokenizer, as Llama 3's and Qwen's checkpoints
    ),
    "qwen3": Architecture(
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        tie_word_embeddings=True,
        extra_vocab=0,
    ),
    "mistral": Architecture(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        ("<s>", "</s>", "<unk>", "[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        pad="<unk>",
        chat_template=MISTRAL_TEMPLATE,
        tie_word_embeddings=False,
        extra_vocab=0,
        extra_config={"sliding_window": None},
    ),
    # Phi-3 stores attention as one fused qkv_proj and the MLP's gate and up as one gate_up_proj: the
    # stacked case of loading and pushing weights by name.
    "phi3": Architecture(
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
        bos=None,
        eos="<|end|>",
        pad="<|endoftext|>",
        chat_template=PHI3_TEMPLATE,
        tie_word_embeddings=True,
        extra_vocab=53,  # Phi-3-mini: 32064 rows for 32011 tokens
    ),
}

CORPUS_WORDS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? She sold 48/2 = 24 clips in May. "
    "Natalia sold 48+24 = 72 clips altogether. #### 72 Weng earns $12 an hour for babysitting. Yesterday, "
    "she just did 50 minutes of babysitting. How much did she earn? answer: the total is 10 dollars. "
    "What is 3 + 4? Reply with the number. Each box holds 6 apples; there are 7 boxes, so 6*7 = 42. "
)


def train_tokenizer(arch: Architecture, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on CORPUS_WORDS, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(arch.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    digits = " ".join(str(n) for n in range(200))
    tokenizer.train_from_iterator([CORPUS_WORDS * 4, digits], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=arch.bos,
        eos_token=arch.eos,
        pad_token=arch.pad,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = arch.chat_template
    return wrapped


def build_checkpoint(
    name: str,
    out_dir: Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """A tiny random checkpoint of architecture `name` (ARCHITECTURES) in Hugging Face format."""
    import torch
    import transformers
    from transformers import GenerationConfig

    arch = ARCHITECTURES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(arch)
    tokenizer.save_pretrained(out)
    size = len(tokenizer)
    vocab_size = size + arch.extra_vocab
    heads = hidden_size // head_dim
    config = getattr(transformers, arch.config_class)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **arch.extra_config,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, arch.model_class)(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    return out


def load_named_tensors(model_dir: Path) -> list[tuple[str, object]]:
    """The checkpoint's tensors by Hugging Face name, in file order: what a trainer would push."""
    from safetensors.torch import load_file

    named: list[tuple[str, object]] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        named.extend(load_file(str(path)).items())
    return named


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline_rl.testing.models", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="one subdirectory per architecture goes here")
    parser.add_argument("--only", default=",".join(ARCHITECTURES), help="comma-separated architectures")
    args = parser.parse_args(argv)
    for name in args.only.split(","):
        path = build_checkpoint(name, args.out / name)
        config = json.loads((path / "config.json").read_text())
        print(f"{name}: {path} ({config['architectures'][0]}, vocab_size {config['vocab_size']})")


if __name__ == "__main__":
    main()
