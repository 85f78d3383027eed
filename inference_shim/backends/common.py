"""Engine-neutral types of the backends and the checks every backend runs before touching its engine.

ContractError (an error the client caused: the app answers its status with {"error", "detail"}),
SamplingRequest / ChoiceDelta (what the app hands a backend and what a backend yields back), and the
request checks shared by all backends: prompt room, served name, the context length a model allows
(resolve_max_model_len), and validate_update (everything an update request must pass BEFORE any
collective starts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from inference_shim.openai_protocol import VersionSpan
from inference_shim.protocol import AdapterSpec, WeightUpdateRequest, adapter_tensor_names
from inference_shim.tool_calls import OutputConstraint


class ContractError(Exception):
    """An error the client caused or must act on; the app turns it into `status` + ErrorResponse."""

    def __init__(
        self, status: int, error: str, detail: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(error if detail is None else f"{error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers  # sent with the answer, e.g. Retry-After on a 503


@dataclass
class SamplingRequest:
    """Engine-neutral generation parameters, built from an OpenAI request by the app."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    n: int
    seed: int | None
    stop: list[str]
    top_logprobs: int  # 0 = only the sampled token's logprob (always returned)
    ignore_eos: bool = False
    constraint: OutputConstraint | None = None  # structured output (Backend.structured_output only)
    base_model: bool = False  # `model` named the base alone (protocol.BASE_MODEL_SUFFIX): no adapter


@dataclass
class ChoiceDelta:
    """New tokens of one choice (streaming) or the whole choice (non-streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    version_spans: list[VersionSpan] | None = None  # set on the final piece of a choice
    token_strings: list[str] = field(default_factory=list)


def spans_from_versions(versions: list[int]) -> list[VersionSpan]:
    """Per-token weight versions as spans: [3, 3, 4] -> [0, 2) v3, [2, 3) v4."""
    spans: list[VersionSpan] = []
    for i, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1].end = i + 1
        else:
            spans.append(VersionSpan(version=version, start=i, end=i + 1))
    return spans


def served_name(model_dir: str, served_model_name: str | None) -> str:
    """The model's name in /v1/models and /capabilities: the one given, else the directory's name."""
    return served_model_name or Path(model_dir.rstrip("/")).name


# Where a Hugging Face config.json states the longest sequence (first found wins).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def model_positions(model_dir: str | Path) -> int | None:
    """The longest sequence the model's config.json allows (its text part's, for a multimodal config);
    None when the directory has no config.json or it names no such length."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for section in (config, config.get("text_config") or {}):
        for key in POSITION_KEYS:
            if isinstance(section.get(key), int) and section[key] > 0:
                return section[key]
    return None


def resolve_max_model_len(model_dir: str | Path, requested: int | None) -> int:
    """`--max-model-len` checked against the model: None means the model's own length; a larger value
    than the model's positions is refused here, before any engine starts. ValueError says what to do.

    A config whose rotary positions are scaled (rope_scaling) may allow more: that is left to the engine."""
    positions = model_positions(model_dir)
    if requested is None:
        if positions is None:
            raise ValueError(
                f"cannot read the model's length from {model_dir}/config.json: pass --max-model-len"
            )
        return positions
    if positions is not None and requested > positions and not _rope_stretched(model_dir):
        raise ValueError(
            f"--max-model-len {requested} is larger than the model allows ({positions} positions, "
            f"config.json of {model_dir}): pass --max-model-len {positions} or less, or leave it out"
        )
    return requested


def _rope_stretched(model_dir: str | Path) -> bool:
    """Whether config.json scales its rotary positions (rope_scaling / rope_parameters of a type other
    than default), which lets an engine serve more than max_position_embeddings."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return rope.get("rope_type", rope.get("type", "default")) != "default"


def prompt_room(prompt_ids: list[int], max_model_len: int) -> int:
    """Tokens left for the completion; a prompt that alone fills the context is the client's error."""
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ContractError(
            400, "prompt_too_long", f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}"
        )
    return room


def adapter_table(
    table: dict[str, tuple[str, list[int]]], spec: AdapterSpec
) -> dict[str, tuple[str, list[int]]]:
    """The tensors an adapter update must carry, from the model's tensor table: for every 2-D weight
    `<module>.weight` whose module's last name is a target, lora_A [rank, in] and lora_B [out, rank] in
    the weight's dtype (adapter_tensor_names). Raises ContractError 422 for a target no layer has."""
    targets = set(spec.target_modules)
    adapters: dict[str, tuple[str, list[int]]] = {}
    found: set[str] = set()
    for name, (dtype, shape) in table.items():
        module, _, leaf = name.rpartition(".")
        target = module.rpartition(".")[2]
        if leaf != "weight" or len(shape) != 2 or target not in targets or ".layers." not in f".{module}":
            continue
        found.add(target)
        a_name, b_name = adapter_tensor_names(module)
        adapters[a_name] = (dtype, [spec.rank, shape[1]])
        adapters[b_name] = (dtype, [shape[0], spec.rank])
    unknown = sorted(targets - found)
    if unknown:
        layers = sorted(
            {
                n.rpartition(".")[0].rpartition(".")[2]
                for n, (_, s) in table.items()
                if len(s) == 2 and ".layers." in n
            }
        )
        raise ContractError(
            422,
            "invalid_adapter",
            f"target module(s) {unknown} are no linear layer of this model's blocks; it has {layers}",
        )
    return adapters


def check_adapter(spec: AdapterSpec | None, max_rank: int | None) -> None:
    """An update's kind against the server's: adapters only where LoRA is on, within its largest rank;
    a LoRA server takes adapters only (a full update would leave an adapter trained for other weights).
    Raises ContractError 422."""
    if spec is None:
        if max_rank is not None:
            raise ContractError(
                422,
                "adapter_expected",
                "this server serves a LoRA adapter (--lora-max-rank): send the adapter "
                "(WeightUpdateRequest.adapter), or start it without --lora-max-rank for full weights",
            )
        return
    if max_rank is None:
        raise ContractError(
            422,
            "lora_not_enabled",
            "this server takes full weights only (/capabilities lora: none): start it with "
            "--lora-max-rank, or push the adapter merged into every weight",
        )
    if spec.rank > max_rank:
        raise ContractError(
            422,
            "lora_rank_too_large",
            f"adapter rank {spec.rank} is above this server's --lora-max-rank {max_rank}",
        )


def validate_update(
    req: WeightUpdateRequest,
    table: dict[str, tuple[str, list[int]]],
    current_version: int,
    pending_version: int | None,
    group_joined: bool,
    lora_max_rank: int | None = None,
) -> None:
    """All checks that must pass BEFORE any collective starts; raises ContractError (4xx) otherwise.
    `table` is the model's; an adapter update is checked against adapter_table() of it."""
    check_adapter(req.adapter, lora_max_rank)
    if req.adapter is not None:
        table = adapter_table(table, req.adapter)
    if not group_joined:
        raise ContractError(
            409, "no_process_group", "call POST /init_process_group before requesting an update"
        )
    if pending_version is not None:
        raise ContractError(
            409, "update_in_progress", f"version {pending_version} is still being received or applied"
        )
    if req.version <= current_version and not req.restore:
        raise ContractError(
            409,
            "stale_version",
            f"version {req.version} is not newer than the served version {current_version}",
        )
    seen: set[str] = set()
    problems: list[str] = []
    for meta in req.tensors:
        if meta.name in seen:
            problems.append(f"{meta.name}: sent twice")
        seen.add(meta.name)
        expected = table.get(meta.name)
        if expected is None:
            problems.append(f"{meta.name}: unknown tensor name")
            continue
        dtype, shape = expected
        if list(meta.shape) != list(shape):
            problems.append(f"{meta.name}: shape {meta.shape} != expected {shape}")
        if meta.dtype != dtype:
            problems.append(f"{meta.name}: dtype {meta.dtype} != expected {dtype}")
    missing = sorted(set(table) - seen)
    if missing:
        problems.append(
            f"missing {len(missing)} tensor(s), e.g. {missing[:3]}: an update must carry every "
            + ("adapter tensor of its targets" if req.adapter else "weight")
        )
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ContractError(422, "invalid_tensors", shown)
