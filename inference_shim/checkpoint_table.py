"""The tensor table of a Hugging Face checkpoint: {name: (dtype, shape)}, read without loading weights.

Every backend validates a weight update against this table (inference_shim.backends.base.validate_update):
the trainer must send exactly the checkpoint's names and shapes.
"""

from __future__ import annotations

from pathlib import Path

# The `dtype` field of a safetensors header, spelled as the format spells it (data, not references) ->
# the torch dtype names the contract uses (protocol.DTYPE_SIZES; docs/contract.md, "GET /capabilities", `dtypes`).
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def checkpoint_tensor_table(model_dir: str | Path) -> dict[str, tuple[str, list[int]]]:
    """{HF tensor name: (dtype, shape)} read from the safetensors headers, without loading any weights."""
    from safetensors import safe_open

    table: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                table[name] = (_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower()), list(sl.get_shape()))
    if not table:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir}: is it a Hugging Face model directory?"
        )
    return table
