"""Whether bf16 mixed precision pays on this machine's CPU: one check for the trainer and the benchmarks.

torch runs bf16 matmuls on the CPU through oneDNN, which computes in bf16 only where the CPU has bf16
instructions: AVX512_BF16 or AMX-BF16 on x86, BF16 on Arm. Elsewhere it converts, and a bf16 matmul
takes several times to two orders of magnitude float32's time (more without AVX-512), also where
torch's own check says bf16 is supported (docs/trainer.md, "Mixed precision"). See for yourself on any
machine:

    .venv/bin/python -m pipeline_rl.trainer.precision [--rows 512 --width 2560]
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

# How much slower torch's bf16 matmuls run than float32 on CPUs without bf16 instructions, over the CPU
# kinds measured (with AVX-512 at the low end, AVX2 only at the high end; `python -m
# pipeline_rl.trainer.precision` measures this machine).
BF16_FALLBACK_SLOWDOWN = "3-114x"
# x86 CPU flags (Linux /proc/cpuinfo) of the instructions that compute in bf16.
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")  # platform.machine(), lower-cased


def cpu_capability() -> str:
    """torch's name for the vector instructions it uses on this CPU: AVX512, AVX2, DEFAULT, SVE256..."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_has_native_bf16() -> bool:
    """True where this CPU computes bf16 matmuls in bf16: on x86 Linux it lists AVX512_BF16 or AMX-BF16
    among its flags (torch's own check also says yes for plain AVX-512, where oneDNN converts to float32
    and is slower than float32); elsewhere torch's check, which on an x86 Mac with AVX-512 and no bf16
    says yes too. Linux before 5.2 does not list avx512_bf16, so a bf16 CPU there reads as without."""
    flags = x86_cpu_flags()
    if flags is not None:
        return any(flag in flags for flag in X86_BF16_FLAGS)
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the op (or without oneDNN)
        return False


def x86_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The first CPU's flags (Linux lists the same for every CPU) from /proc/cpuinfo on x86 Linux; None
    on other machines or without the file."""
    if platform.machine().lower() not in X86_MACHINES:
        return None
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def check_mixed_precision(mixed_precision: str, device: torch.device) -> None:
    """Refuse bf16 mixed precision on a CPU that has no bf16 instructions: its matmuls take 3 to over 100
    times longer than in float32 (the latter a run that looks hung). Raises ValueError saying what to set
    instead."""
    if mixed_precision != "bf16" or device.type != "cpu" or cpu_has_native_bf16():
        return
    raise ValueError(
        f"trainer.mixed_precision=bf16 needs a CPU with bf16 instructions (AVX512_BF16 or AMX-BF16 on x86, "
        "BF16 on Arm); "
        f"this one ({cpu_capability()}) has none, and without them torch's bf16 matmuls ran "
        f"{BF16_FALLBACK_SLOWDOWN} slower than float32 (python -m pipeline_rl.trainer.precision measures it "
        "here): set trainer.mixed_precision=no"
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
