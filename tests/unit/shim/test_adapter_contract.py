"""Adapter updates' checks (contract 2.1), engine-free: which tensors an adapter must carry for a model's
tensor table, which updates a server refuses before any collective, and which servers a trainer refuses
to push to.

    .venv/bin/python -m pytest -q tests/unit/shim/test_adapter_contract.py
"""

from __future__ import annotations

import pytest

from inference_shim.backends.common import ContractError, adapter_table, validate_update
from inference_shim.protocol import AdapterSpec, Capabilities, TensorMeta, WeightUpdateRequest
from inference_shim.weight_sender import LoraMismatch, check_lora

TABLE = {
    "model.embed_tokens.weight": ("float32", [100, 64]),
    "model.layers.0.self_attn.q_proj.weight": ("float32", [64, 64]),
    "model.layers.0.self_attn.q_proj.bias": ("float32", [64]),
    "model.layers.0.self_attn.k_proj.weight": ("float32", [32, 64]),
    "model.layers.0.mlp.down_proj.weight": ("float32", [64, 128]),
    "model.layers.0.input_layernorm.weight": ("float32", [64]),
    "model.norm.weight": ("float32", [64]),
    "lm_head.weight": ("float32", [100, 64]),
}
PREFIX = "base_model.model.model.layers.0."


def test_an_adapter_carries_a_and_b_of_every_targeted_block_layer_in_peft_names():
    spec = AdapterSpec(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "down_proj"])
    assert adapter_table(TABLE, spec) == {
        f"{PREFIX}self_attn.q_proj.lora_A.weight": ("float32", [4, 64]),
        f"{PREFIX}self_attn.q_proj.lora_B.weight": ("float32", [64, 4]),
        f"{PREFIX}self_attn.k_proj.lora_A.weight": ("float32", [4, 64]),
        f"{PREFIX}self_attn.k_proj.lora_B.weight": ("float32", [32, 4]),
        f"{PREFIX}mlp.down_proj.lora_A.weight": ("float32", [4, 128]),
        f"{PREFIX}mlp.down_proj.lora_B.weight": ("float32", [64, 4]),
    }


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens", "input_layernorm", "v_proj"])
def test_a_target_that_is_no_linear_layer_of_the_blocks_is_refused_listing_the_layers(target):
    with pytest.raises(ContractError) as raised:
        adapter_table(TABLE, AdapterSpec(rank=4, alpha=8, target_modules=["q_proj", target]))
    assert (raised.value.status, raised.value.error) == (422, "invalid_adapter")
    assert "['down_proj', 'k_proj', 'q_proj']" in raised.value.detail


def _request(adapter: AdapterSpec | None, tensors: dict[str, tuple[str, list[int]]]) -> WeightUpdateRequest:
    metas = [TensorMeta(name=n, dtype=d, shape=s) for n, (d, s) in tensors.items()]
    return WeightUpdateRequest(version=1, tensors=metas, adapter=adapter)


def _refusal(req: WeightUpdateRequest, max_rank: int | None) -> str | None:
    try:
        validate_update(req, TABLE, 0, None, True, max_rank)
    except ContractError as e:
        assert e.status == 422
        return e.error
    return None


def test_what_a_server_takes_depends_on_its_lora_setting():
    spec = AdapterSpec(rank=4, alpha=8, target_modules=["q_proj"])
    adapter = _request(spec, adapter_table(TABLE, spec))
    full = _request(None, TABLE)
    assert _refusal(adapter, 8) is None and _refusal(full, None) is None
    assert _refusal(adapter, None) == "lora_not_enabled"
    assert _refusal(full, 8) == "adapter_expected"
    assert _refusal(adapter, 2) == "lora_rank_too_large"
    half = dict(list(adapter_table(TABLE, spec).items())[:1])  # lora_A without its lora_B
    assert _refusal(_request(spec, half), 8) == "invalid_tensors"
    wide = {n: (d, [s[0], s[1] + 1]) for n, (d, s) in adapter_table(TABLE, spec).items()}
    assert _refusal(_request(spec, wide), 8) == "invalid_tensors"


def _caps(lora: str, rank: int | None) -> Capabilities:
    return Capabilities(
        backend="x", engine_version="0", model="m", workers=1, transports=["gloo"], pause_modes=[],
        dtypes=["float32"], per_token_versions=True, staged_receive=True, max_model_len=64,
        lora=lora, lora_max_rank=rank,
    )  # fmt: skip


def test_a_trainer_pushes_only_to_servers_that_take_its_kind_of_update():
    spec = AdapterSpec(rank=16, alpha=32, target_modules=["q_proj"])
    check_lora(spec, ["a"], [_caps("in_memory", 16)])
    check_lora(None, ["a"], [_caps("none", None)])
    with pytest.raises(LoraMismatch, match=r"http://b \(lora in_memory, max rank 8\).*--lora-max-rank 16"):
        check_lora(spec, ["http://a", "http://b"], [_caps("in_memory", 64), _caps("in_memory", 8)])
    with pytest.raises(LoraMismatch, match="http://c"):
        check_lora(spec, ["http://c"], [_caps("none", None)])
    with pytest.raises(LoraMismatch, match="set trainer.lora"):
        check_lora(None, ["http://a"], [_caps("in_memory", 8)])
