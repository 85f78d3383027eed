"""Local dataset loading for the gsm8k and math tasks. Never downloads.

    splits = load_local_splits("/data/gsm8k.jsonl", hub_repo="openai/gsm8k", task="gsm8k")
    splits["train"]  # list of row dicts; "test" is present only when the data has a test split

`path` may be
- a JSON / JSONL / parquet file (one split: train),
- a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (its splits),
- a directory of split files as on the Hugging Face Hub (`train-*.parquet`, `test.jsonl`, ...,
  directly inside it or in `main/`, `data/` or `default/`), e.g. from `huggingface-cli download`.
When `path` is None, the Hub repo's snapshot is looked up in the local HF cache (`HF_HUB_CACHE`),
with `local_files_only=True`: nothing is fetched over the network. If none of these exist, a
`DatasetNotFoundError` names the path to provide. Only local files are read ("json"/"parquet" builders,
`load_from_disk`, a cache-only snapshot lookup), so this works the same with HF_DATASETS_OFFLINE=1.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SPLIT_SUBDIRS = ("", "main", "data", "default")


class DatasetNotFoundError(FileNotFoundError):
    """No local data for a dataset task; the message says which config field to set."""


def _read_files(files: list[Path]) -> list[dict[str, Any]]:
    import datasets

    builder = _FILE_BUILDERS[files[0].suffix]
    # The datasets cache would keep an Arrow copy of every file ever loaded; keep it in memory instead.
    with tempfile.TemporaryDirectory(prefix="pipeline-rl-data-") as cache_dir:
        ds = datasets.load_dataset(
            builder,
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=cache_dir,
            keep_in_memory=True,
        )
    return ds.to_list()


def _split_files(root: Path, split: str) -> list[Path]:
    for sub in _SPLIT_SUBDIRS:
        for suffix in _FILE_BUILDERS:
            files = sorted((root / sub).glob(f"{split}{suffix}")) + sorted(
                (root / sub).glob(f"{split}-*{suffix}")
            )
            if files:
                return files
    return []


def _load_dir(root: Path) -> dict[str, list[dict[str, Any]]]:
    if (root / "dataset_dict.json").exists() or (root / "state.json").exists():
        import datasets

        loaded = datasets.load_from_disk(str(root), keep_in_memory=True)
        if isinstance(loaded, datasets.DatasetDict):
            return {name: split.to_list() for name, split in loaded.items()}
        return {"train": loaded.to_list()}
    return {split: _read_files(files) for split in ("train", "test") if (files := _split_files(root, split))}


def _hub_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, repo_type="dataset", local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def load_local_splits(path: str | None, hub_repo: str, task: str) -> dict[str, list[dict[str, Any]]]:
    """Rows per split name from `path`, or from `hub_repo` in the local HF cache when `path` is None."""
    hint = (
        f"set task.dataset_path to a JSON/JSONL/parquet file or a save_to_disk directory with the {task} rows, "
        f"or put {hub_repo} in the local HF cache beforehand "
        f"(`huggingface-cli download {hub_repo} --repo-type dataset` on a machine with network)"
    )
    if path is None:
        root = _hub_snapshot(hub_repo)
        if root is None:
            raise DatasetNotFoundError(
                f"{task}: no dataset_path given and {hub_repo} is not in the HF cache: {hint}"
            )
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise DatasetNotFoundError(f"{task}: dataset_path {str(root)!r} does not exist: {hint}")
    if root.is_file():
        if root.suffix not in _FILE_BUILDERS:
            raise DatasetNotFoundError(f"{task}: {root} is not a .json, .jsonl or .parquet file: {hint}")
        return {"train": _read_files([root])}
    splits = _load_dir(root)
    if not splits.get("train"):
        raise DatasetNotFoundError(f"{task}: found no train split under {root}: {hint}")
    return splits
