"""grow_model: a wider model that computes what the small one did (how bench vs-trl gets warm 25M/100M
models), checked by running both in Hugging Face transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model, grow_model


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    # Two query heads per key/value head, so the grouping of heads is exercised too.
    spec = TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96, num_layers=2)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "small", spec)


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(ids).logits


def _parameters(model_dir: Path) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_a_grown_model_without_noise_computes_the_same_logits(small, tmp_path):
    ids = torch.randint(4, 90, (3, 17), generator=torch.Generator().manual_seed(0))
    grown = grow_model(small, tmp_path / "x3", 3, noise=0.0)
    config = json.loads((grown / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        192,
        6,
        3,
    )
    assert config["head_dim"] == 32 and config["intermediate_size"] == 288
    # Random weights give logits of order 1; a wrong tiling or a missing 1/factor is off by that much.
    torch.testing.assert_close(_logits(grown, ids), _logits(small, ids), atol=1e-4, rtol=1e-4)
    # Outside the embedding (vocab x hidden, 3x) nearly every parameter sits in a matrix that grows 9x.
    vocab = config["vocab_size"]
    blocks_small, blocks_grown = _parameters(small) - vocab * 64, _parameters(grown) - vocab * 192
    assert 8.5 * blocks_small < blocks_grown < 9 * blocks_small


def test_an_untied_lm_head_is_grown_to_the_same_logits_too(tmp_path):
    spec = TinyModelSpec(
        hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96, tie_word_embeddings=False
    )
    small = build_tiny_model(tmp_path / "untied", spec)
    ids = torch.randint(4, 90, (2, 9), generator=torch.Generator().manual_seed(2))
    grown = grow_model(small, tmp_path / "x2", 2, noise=0.0)
    torch.testing.assert_close(_logits(grown, ids), _logits(small, ids), atol=1e-4, rtol=1e-4)


def test_noise_makes_the_copies_differ_but_keeps_the_function_close(small, tmp_path):
    ids = torch.randint(4, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    grown = grow_model(small, tmp_path / "x2", 2, noise=0.01, seed=5)
    again = grow_model(small, tmp_path / "x2-again", 2, noise=0.01, seed=5)
    model = AutoModelForCausalLM.from_pretrained(grown)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q[:, :64], q[:, 64:])  # the two copies of the input are read differently
    assert torch.equal(q, AutoModelForCausalLM.from_pretrained(again).model.layers[0].self_attn.q_proj.weight)
    difference = (_logits(grown, ids) - _logits(small, ids)).abs().max()
    assert 0 < difference < 0.1


def test_grow_refuses_a_factor_below_one(small, tmp_path):
    with pytest.raises(ValueError, match="factor must be >= 1"):
        grow_model(small, tmp_path / "x0", 0)
