"""`pipeline-rl export RUN_OR_CHECKPOINT (--merged OUT | --adapter OUT) [--base DIR]`: a run's trained
weights as a standalone directory that other tools load without this project.

    pipeline-rl export runs/20261201-120000 --merged out/model      # newest verified checkpoint, merged
    pipeline-rl export runs/X/checkpoints/step_00000040 --adapter out/adapter
    pipeline-rl export runs/X/snapshots/v00000012 --merged out/v12 --base /models/Qwen2.5-1.5B-Instruct

RUN_OR_CHECKPOINT is a run directory (its newest checkpoint that verifies, as resume picks it), a
checkpoint directory (step_N, verified first) or a snapshot directory (snapshots/vN: the model
directory itself). What a checkpoint's model/ holds depends on the run:
  - full fine-tuning: a Hugging Face model (config.json + safetensors + tokenizer files);
  - trainer.lora: a peft adapter (adapter_config.json + adapter_model.safetensors + tokenizer files).

--merged OUT writes a Hugging Face model (safetensors, the base model's dtype as saved, tokenizer files):
AutoModelForCausalLM.from_pretrained and vLLM load it. An adapter is applied to its base model and merged
into it (peft merge_and_unload; needs the `lora` extra); a full fine-tuning checkpoint is copied as is.
The base is --base if given, else adapter_config.json's base_model_name_or_path, else the run's
config.json model_path: the first that is a model directory.

--adapter OUT writes the peft adapter directory as trained (adapter_config.json,
adapter_model.safetensors, tokenizer files): PeftModel.from_pretrained(base, OUT) and vLLM's
`--lora-modules NAME=OUT` load it. With --base, its base_model_name_or_path names that directory (for
tools that find the base from the adapter). A full fine-tuning run has no adapter: refused.

OUT must not exist or be an empty directory. Everything is written to OUT.tmp, made durable, and renamed
to OUT: a crash leaves no half-written OUT. Bad input raises ExportError, whose message says what to do.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.run_dir import CHECKPOINTS, SNAPSHOTS
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.checkpoint import MODEL_CONFIG_FILES
from pipeline_rl.trainer.lora import ADAPTER_CONFIG, ADAPTER_NAME, ADAPTER_WEIGHTS, is_adapter_dir

BASE_KEY = "base_model_name_or_path"


class ExportError(Exception):
    """Bad input to export (the message says which path and what to do); the CLI prints it, no traceback."""


@dataclass
class Source:
    """The model directory to export and the run it belongs to (None when the layout does not say)."""

    model_dir: Path
    run_dir: Path | None

    @property
    def is_adapter(self) -> bool:
        return is_adapter_dir(self.model_dir)


@dataclass
class Exported:
    """What export() wrote."""

    out: Path
    kind: str  # "merged", "copied" (full fine-tuning, --merged) or "adapter"
    model_dir: Path
    base: Path | None
    tensors: int
    bytes: int


def resolve(path: str | Path) -> Source:
    """The model directory that RUN_OR_CHECKPOINT names (see the module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path} is not a directory (expected a run, checkpoint or snapshot directory)")
    in_checkpoints = path.parent.name == CHECKPOINTS and path.name.startswith("step_")
    if in_checkpoints or (path / checkpoint.MANIFEST).exists() or (path / checkpoint.STATE).exists():
        try:
            checkpoint.verify(path)
        except checkpoint.CheckpointError as e:
            raise ExportError(f"checkpoint {path} does not verify: {e}") from None
        return Source(path / "model", _run_of(path))
    if is_adapter_dir(path) or _is_model_config(path / "config.json"):
        return Source(path, _run_of(path))
    if (path / CHECKPOINTS).is_dir() or (path / "config.json").is_file():
        try:
            found = checkpoint.latest_checkpoint(path)
        except checkpoint.CheckpointError as e:
            raise ExportError(str(e)) from None
        if found is None:
            raise ExportError(f"run {path} has no checkpoint yet ({path / CHECKPOINTS} holds no step_N)")
        return Source(found / "model", path)
    raise ExportError(
        f"{path} is neither a run directory (config.json, checkpoints/), a checkpoint (manifest.json) "
        "nor a model or adapter directory (config.json or adapter_config.json)"
    )


def _is_model_config(path: Path) -> bool:
    """A Hugging Face model's config.json (a run directory's config.json is the run config)."""
    try:
        return "model_type" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def _run_of(path: Path) -> Path | None:
    """The run of RUN/checkpoints/step_N, RUN/checkpoints/step_N/model or RUN/snapshots/vN (if it has
    its config.json), else None."""
    if path.parent.name in (CHECKPOINTS, SNAPSHOTS):
        run = path.parent.parent
    elif path.name == "model" and path.parent.parent.name == CHECKPOINTS:
        run = path.parent.parent.parent
    else:
        return None
    return run if (run / "config.json").is_file() else None


def base_model(source: Source, adapter_config: dict, override: str | Path | None) -> Path:
    """The base an adapter applies to: --base, else the adapter's base_model_name_or_path, else the
    run's model_path; the first that is a model directory, else ExportError naming each and --base."""
    if override is not None:
        if not (Path(override) / "config.json").is_file():
            raise ExportError(f"--base {override}: no model there (no config.json)")
        return Path(override)
    candidates = [(f"{ADAPTER_CONFIG}'s {BASE_KEY}", adapter_config.get(BASE_KEY))]
    if source.run_dir is not None:
        # The raw file, not load_run_config: only model_path is needed, and a run copied to another
        # machine may lack its secrets file.
        try:
            model_path = json.loads((source.run_dir / "config.json").read_text()).get("model_path")
        except (OSError, ValueError) as e:
            raise ExportError(f"{source.run_dir / 'config.json'} is unreadable: {e}") from None
        candidates.append(("the run's config.json model_path", model_path))
    for _, candidate in candidates:
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate)
    tried = "; ".join(f"{what}: {value or '(not set)'}" for what, value in candidates)
    raise ExportError(
        f"the base model of the adapter in {source.model_dir} is not on this machine (tried {tried}); "
        "pass --base DIR, the model the run trained"
    )


def read_adapter_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{model_dir / ADAPTER_CONFIG} is unreadable: {e}") from None
    if not (model_dir / ADAPTER_WEIGHTS).is_file():
        raise ExportError(f"{model_dir} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    return config


def check_out(out: Path) -> None:
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} already exists and is not an empty directory: name a new OUT")


def export(source: str | Path, out: str | Path, *, merged: bool, base: str | Path | None = None) -> Exported:
    """Write the model that `source` names to `out`: merged (a Hugging Face model) or as the adapter."""
    out = Path(os.path.abspath(out))  # OUT.tmp is a sibling: OUT needs a name ("." has none)
    check_out(out)
    src = resolve(source)
    if not src.is_adapter:
        if not _is_model_config(src.model_dir / "config.json"):
            raise ExportError(f"{src.model_dir} holds neither a model (config.json) nor an adapter")
        if not merged:
            raise ExportError(
                f"{src.model_dir} is a full model: this run trained every weight (no trainer.lora); "
                "use --merged"
            )
        _write_atomically(out, lambda tmp: shutil.copytree(src.model_dir, tmp, dirs_exist_ok=True))
        return _report(out, "copied", src.model_dir, None)
    adapter_config = read_adapter_config(src.model_dir)
    if merged:
        base_dir = base_model(src, adapter_config, base)
        _write_atomically(out, lambda tmp: _merge(src.model_dir, base_dir, tmp))
        return _report(out, "merged", src.model_dir, base_dir)
    if base is not None:
        base_model(src, adapter_config, base)  # a --base that is no model is refused here too
        adapter_config[BASE_KEY] = str(Path(base).resolve())

    def write_adapter(tmp: Path) -> None:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
        shutil.copy2(src.model_dir / ADAPTER_WEIGHTS, tmp / ADAPTER_WEIGHTS)
        # The base's config files describe a model: an adapter with them would pass for one.
        checkpoint.copy_tokenizer_files(src.model_dir, tmp, skip=MODEL_CONFIG_FILES)

    _write_atomically(out, write_adapter)
    return _report(out, "adapter", src.model_dir, Path(base) if base is not None else None)


def _merge(model_dir: Path, base: Path, out: Path) -> None:
    """Base + adapter, merged, saved as a Hugging Face model in the base's saved dtype."""
    try:
        from peft import PeftConfig, PeftModel
    except ImportError:
        raise ExportError(
            "merging an adapter needs peft: pip install 'pipeline-rl[lora]' (or export it with --adapter)"
        ) from None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    try:
        # load_adapter (not PeftModel.from_pretrained, which only warns) returns the keys that did not
        # match: an adapter trained on another model is refused instead of merged in part.
        peft_model = PeftModel(model, PeftConfig.from_pretrained(model_dir), low_cpu_mem_usage=True)
        result = peft_model.load_adapter(model_dir, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True)
    except (RuntimeError, ValueError) as e:
        raise ExportError(
            f"the adapter in {model_dir} does not fit the base model {base} ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}): pass --base DIR, the model the run trained"
        ) from None
    mismatched = list(result.missing_keys) + list(result.unexpected_keys)
    if mismatched:
        raise ExportError(
            f"the adapter in {model_dir} does not fit the base model {base}: {len(mismatched)} adapter "
            f"tensors have no place in it or are missing (e.g. {mismatched[0]}); pass --base DIR, the "
            "model the run trained"
        )
    peft_model.merge_and_unload().save_pretrained(out)
    checkpoint.copy_tokenizer_files(model_dir, out)
    checkpoint.copy_tokenizer_files(base, out)  # fills in what the checkpoint lacks, never overwrites
    # transformers would load a directory with this file as an adapter on its base, not as this model.
    (out / ADAPTER_CONFIG).unlink(missing_ok=True)


def _write_atomically(out: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) into OUT.tmp; fsync it; replace the (absent or empty) OUT by it. No OUT on failure."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed export
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        checkpoint._sync_tree(tmp)
        if out.is_dir():
            out.rmdir()  # empty (check_out), so the rename below can take its place
        os.replace(tmp, out)
        checkpoint._fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _report(out: Path, kind: str, model_dir: Path, base: Path | None) -> Exported:
    from safetensors import safe_open

    tensors = 0
    for path in out.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            tensors += len(list(f.keys()))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return Exported(out, kind, model_dir, base, tensors, size)


def describe(result: Exported) -> str:
    """One line for the terminal: what was written, from what, how big."""
    what = {
        "merged": f"{result.model_dir} merged into {result.base}",
        "copied": f"{result.model_dir}, copied (full fine-tuning)",
        "adapter": f"the adapter {result.model_dir}",
    }[result.kind]
    return f"wrote {result.out}: {what}; {result.tensors} tensors, {result.bytes:,} bytes"
