"""Whether bf16 mixed precision pays on this machine's CPU: one check for the trainer and the benchmarks.

torch runs bf16 matmuls on the CPU through oneDNN, which needs AVX-512 (or AMX) on x86 and BF16 on Arm.
Without them (an AVX2-only x86) it falls back to a slow path: on a 2-core AVX2 EPYC a 512x2560 by
2560x2560 matmul took 18 s in bf16 against 0.16 s in float32 (114x), the default 256x1024 one 50-77x,
so a bf16 step there takes minutes (docs/benchmarks.md, F19). See for yourself on any machine:

    .venv/bin/python -m pipeline_rl.trainer.precision [--rows 512 --width 2560]
"""

from __future__ import annotations

import statistics
import time

import torch

# How much slower torch's bf16 matmuls ran than float32 on an AVX2 EPYC (F19: 49.5x, 76.5x, 113.8x).
BF16_FALLBACK_SLOWDOWN = "50-114x"


def cpu_capability() -> str:
    """torch's name for the vector instructions it uses on this CPU: AVX512, AVX2, DEFAULT, SVE256..."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_has_native_bf16() -> bool:
    """True where oneDNN runs bf16 matmuls natively on this CPU (torch's own check)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the op (or without oneDNN)
        return cpu_capability().startswith("AVX512")


def check_mixed_precision(mixed_precision: str, device: torch.device) -> None:
    """Refuse bf16 mixed precision on a CPU that has no native bf16: its matmuls would take many times
    longer than in float32, a run that looks hung. Raises ValueError saying what to set instead."""
    if mixed_precision != "bf16" or device.type != "cpu" or cpu_has_native_bf16():
        return
    raise ValueError(
        f"trainer.mixed_precision=bf16 needs a CPU with native bf16 (AVX-512 or AMX on x86, BF16 on Arm); "
        f"this one has {cpu_capability()}, where torch's bf16 matmuls ran {BF16_FALLBACK_SLOWDOWN} slower than "
        "float32 (python -m pipeline_rl.trainer.precision measures it): set trainer.mixed_precision=no"
    )


def matmul_seconds(dtype: torch.dtype, rows: int = 256, width: int = 1024, repeats: int = 3) -> float:
    """Median seconds of one [rows, width] @ [width, width] matmul in `dtype` on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(rows, width).to(dtype)
        b = torch.randn(width, width).to(dtype)
        a @ b  # warm-up: oneDNN picks and caches its kernel on the first call
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="This CPU's bf16 support, and a matmul timed in both dtypes."
    )
    parser.add_argument("--rows", type=int, default=256, help="rows of the left matrix")
    parser.add_argument(
        "--width", type=int, default=1024, help="columns of the left, both sides of the right"
    )
    args = parser.parse_args(argv)
    fp32 = matmul_seconds(torch.float32, args.rows, args.width)
    bf16 = matmul_seconds(torch.bfloat16, args.rows, args.width)
    shape = f"{args.rows}x{args.width} @ {args.width}x{args.width}"
    native = "yes" if cpu_has_native_bf16() else "no"
    print(f"torch CPU capability: {cpu_capability()}; native bf16: {native}")
    print(f"{shape} on one thread: float32 {fp32:.3f} s, bfloat16 {bf16:.3f} s ({bf16 / fp32:.1f}x)")


if __name__ == "__main__":
    main()
