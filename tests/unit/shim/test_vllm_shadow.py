"""A prepared update's shadow (inference_shim/vllm_shadow.py) frees its memory by reference counting alone.

A vLLM worker makes a full garbage collection rarely (and a slow one, in a heap holding vLLM's objects),
so anything of an update that sits in a reference cycle stays until then. The shadow's builder once was
a recursive closure, a cycle that held every fresh tensor of the update: after the swap those tensors
share the live weights' memory, so each update kept a model copy alive and a worker's floor grew with
every weight group (benchmarks/diag/worker_memory.py, docs/decisions.md#weight-transfer). These tests build shadows of
a small torch model with what vLLM's parameters carry (a weight_loader bound to their module, tied
weights) and check, with the collector off, that nothing of an update outlives it.

    .venv/bin/python -m pytest -q tests/unit/test_vllm_shadow.py
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")

from inference_shim.vllm_shadow import ShadowUpdate, _shadow_tree  # noqa: E402


class Layer(torch.nn.Module):
    """A linear layer whose weight carries a loader bound to the layer, as vLLM's parameters do."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n, n), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.copy_(loaded)


class Model(torch.nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.embed = Layer(n)
        self.layers = torch.nn.ModuleList([Layer(n), Layer(n)])
        self.head = Layer(n)
        self.head.weight = self.embed.weight  # tied, like tie_word_embeddings


@pytest.fixture
def no_collector():
    """Reference counting only, as in a worker between its rare full collections."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _shadow_tensors(pairs) -> list[torch.Tensor]:
    return [t for _, shadow in pairs for t in shadow._parameters.values() if t is not None]


def _load(pairs) -> None:
    """What the model's load_weights does to the shadow in prepare(): new values in every fresh tensor."""
    for value, tensor in enumerate(dict.fromkeys(_shadow_tensors(pairs)), start=1):
        tensor.fill_(value)


def test_a_discarded_shadow_is_freed_without_a_garbage_collection(no_collector):
    model = Model()
    pairs: list = []
    _shadow_tree(model, pairs)
    fresh = _shadow_tensors(pairs)
    # every live module has a shadow; a tied weight has one fresh tensor, shared by both shadows
    assert len(pairs) == len(list(model.modules()))
    assert len({id(t) for t in fresh}) == 3  # embed (= head), layers.0, layers.1
    shadows = {id(live): shadow for live, shadow in pairs}
    assert shadows[id(model.head)]._parameters["weight"] is shadows[id(model.embed)]._parameters["weight"]
    # the fresh weight's loader writes the shadow, never the live module
    assert shadows[id(model.embed)]._parameters["weight"].weight_loader.__self__ is shadows[id(model.embed)]

    refs = [weakref.ref(t) for t in fresh] + [weakref.ref(shadow) for _, shadow in pairs]
    del fresh, shadows
    ShadowUpdate(pairs).discard()
    del pairs
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} objects of a discarded shadow wait for a garbage collection"


def test_after_a_swap_the_live_model_holds_the_new_weights_and_nothing_else_of_the_update(no_collector):
    model = Model()
    live_params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    pairs: list = []
    _shadow_tree(model, pairs)
    _load(pairs)
    assert all(float(p.abs().sum()) == 0 for p in live_params.values())  # the live model was not touched

    refs = [weakref.ref(t) for t in _shadow_tensors(pairs)] + [weakref.ref(s) for _, s in pairs]
    ShadowUpdate(pairs).swap_in()
    del pairs

    # the same Parameter objects (vLLM and tied modules keep them), now on the new memory
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[name] is p for name, p in live_params.items())
    assert model.head.weight is model.embed.weight
    # every element of each weight holds that weight's new value (_load's order: embed, layers.0, layers.1)
    values = {name: p.unique().tolist() for name, p in after.items()}
    expected = {
        "embed.weight": [1.0],
        "layers.0.weight": [2.0],
        "layers.1.weight": [3.0],
        "head.weight": [1.0],
    }
    assert values == expected
    assert model.embed.weight.weight_loader.__self__ is model.embed  # the live loader, unchanged
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} objects of a swapped update wait for a garbage collection"
