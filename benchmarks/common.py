"""What every benchmark shares: options, statistics, machine facts, tables, and the docs/benchmarks.md writer.

Rules every benchmark follows (docs/benchmarks.md, "Method"): A and B are measured interleaved in one run,
each at least `repeats` times, and reported as medians; every figure is also given as a ratio against a
ceiling measured in that same run, because these VMs are noisy (CPU steal up to ~25%).

Not run directly; `python -m benchmarks NAME [--quick]` (benchmarks/run.py) builds a BenchContext and calls the
benchmark's run(ctx).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # benchmarks run from a checkout
ARTIFACTS = REPO_ROOT / "artifacts"
DEFAULT_DOC = REPO_ROOT / "docs" / "benchmarks.md"
DEFAULT_IMG_DIR = REPO_ROOT / "docs" / "img"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
README = REPO_ROOT / "README.md"
# Quick (smoke) runs never overwrite the real figures: they write here unless told otherwise.
QUICK_DIR = ARTIFACTS / "bench-quick"

MB = 1e6
MiB = 1024 * 1024


@dataclass
class BenchContext:
    """One invocation of `python -m benchmarks`: where results go and how big the run is."""

    quick: bool
    repeats: int
    command: str  # the exact command line, written into the docs next to the results
    doc_path: Path  # the page regenerated from the results files
    img_dir: Path
    results_dir: Path  # <name>.json per benchmark result
    out_dir: Path  # raw JSON results and server logs
    pool: object  # benchmarks.servers.ServerPool (typed loosely: servers.py imports this module)
    options: dict = field(default_factory=dict)  # benchmark-specific overrides from the command line

    def server(self, kind: str, model: Path):
        """The ServerSpec for `kind` ("shim" or "vllm") on `model`, with this run's server overrides."""
        from benchmarks.servers import ServerSpec

        extra: tuple[str, ...] = ()
        if kind == "shim" and self.options.get("kv_after_update"):
            extra += ("--kv-after-update", self.options["kv_after_update"])
        if kind == "shim" and self.options.get("apply_weights"):
            extra += ("--apply-weights", self.options["apply_weights"])
        env = tuple(tuple(item.split("=", 1)) for item in self.options.get("server_env", ()))
        return ServerSpec(kind, model, extra=extra, env=env)

    def trainer_threads(self) -> int:
        """torch threads of the process that plays the trainer.

        Default: what pipeline_rl/launch/plan.py gives the trainer (OMP_NUM_THREADS = its cores = half the machine's,
        at least one), so the benchmarks measure pushes as a launched run makes them.
        """
        return self.options.get("trainer_threads") or max(1, (os.cpu_count() or 2) // 2)

    def log(self, message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)

    def save_json(self, name: str, data: object) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{name}.json"
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        return path


# ---------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on the sorted values; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def rotate(items: Sequence, i: int) -> list:
    """items rotated by i: repeat i measures the variants in a different order, so no variant always
    runs first (after an idle gap) or last."""
    k = i % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def run_interleaved(
    ctx: BenchContext, names: Sequence[str], seeds: int, one_run, json_name: str
) -> tuple[dict[str, list[dict]], list[str]]:
    """one_run(name, seed) -> measured dict, for every name once per seed (seeds first_seed(ctx) onwards),
    the order rotating with the seed. Returns each name's measured runs and a line per failed run.

    A run that fails (a crashed launch, a missing result file) is logged and recorded, and the others go
    on: a benchmark of hours must not lose its finished runs to one bad one. The JSON (runs and failures)
    is rewritten after every run, so a benchmark stopped halfway keeps what it measured, and `--resume`
    takes the runs it finished (each names its seed) instead of running them again."""
    results, failures = _previous_runs(ctx, names, json_name)
    first = first_seed(ctx)
    for i in range(first, first + seeds):
        for name in rotate(list(names), i):
            if any(r.get("seed") == i for r in results[name]):
                continue
            try:
                measured = {**one_run(name, i), "seed": i}
            except Exception as exc:  # any one run's failure is recorded, not fatal; Ctrl-C still stops
                failures.append(f"{name} seed {i}: {exc}")
                ctx.log(f"{name} seed {i} FAILED (the others go on): {exc}")
            else:
                results[name].append(measured)
                failures = [f for f in failures if not f.startswith(f"{name} seed {i}:")]
                ctx.log(
                    f"{name} seed {i}: { {k: v for k, v in measured.items() if not k.startswith('curve')} }"
                )
            ctx.save_json(json_name, {"runs": results, "failures": failures})
    return results, failures


def _previous_runs(ctx: BenchContext, names: Sequence[str], json_name: str) -> tuple[dict, list[str]]:
    """With --resume, the runs (of these names, with their seed recorded) and failures of the benchmark's
    last JSON; otherwise none."""
    results: dict[str, list[dict]] = {name: [] for name in names}
    path = ctx.out_dir / f"{json_name}.json"
    if not ctx.options.get("resume") or not path.exists():
        return results, []
    previous = json.loads(path.read_text())
    for name in names:
        results[name] = [r for r in previous.get("runs", {}).get(name, []) if "seed" in r]
    return results, list(previous.get("failures", []))


def first_seed(ctx: BenchContext) -> int:
    """The first seed of a multi-seed benchmark (--first-seed; 0 unless a run adds seeds to an earlier one)."""
    return ctx.options.get("first_seed") or 0


def seeds_text(ctx: BenchContext, seeds: int) -> str:
    """How a results section names its seeds: "3 seed(s)", or "3 seed(s) (3-5)" past the first run's."""
    first = first_seed(ctx)
    return f"{seeds} seed(s)" + (f" ({first}-{first + seeds - 1})" if first else "")


def failures_note(failures: Sequence[str]) -> str:
    """The sentence a results section carries when runs failed (empty when none did)."""
    if not failures:
        return ""
    return f" **{len(failures)} run(s) failed and are left out:** " + "; ".join(failures) + "."


# ---------------------------------------------------------------------------------------------------
# Machine facts (so a reader can tell a quiet run from a noisy one)
# ---------------------------------------------------------------------------------------------------
def _cpu_times() -> tuple[int, int]:
    """(total, steal) jiffies from /proc/stat's aggregate line; (0, 0) where it does not exist."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0, 0
    values = [int(v) for v in fields]
    steal = values[7] if len(values) > 7 else 0
    return sum(values[:8]), steal


class StealMeter:
    """CPU steal (the hypervisor running someone else) over an interval, in percent of CPU time."""

    def __init__(self) -> None:
        self._start = _cpu_times()

    def percent(self) -> float:
        total, steal = _cpu_times()
        d_total = total - self._start[0]
        return 100.0 * (steal - self._start[1]) / d_total if d_total > 0 else 0.0


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the kernel's estimate of what can be allocated without swap)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bf16_text() -> str:
    """torch's vector instructions on this CPU and whether it runs bf16 natively: without, bf16 matmuls are
    far slower (pipeline_rl/trainer/precision.py), which changes what a benchmark can run."""
    from pipeline_rl.trainer.precision import cpu_capability, cpu_has_native_bf16

    return f"{cpu_capability()}, {'native' if cpu_has_native_bf16() else 'no native'} bf16"


def machine_line(steal_percent: float | None = None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    parts = [
        f"{os.cpu_count()} CPUs ({cpu}, {bf16_text()})",
        f"{mem_gib:.0f} GiB RAM",
        f"load avg at end {load}",
    ]
    if steal_percent is not None:
        parts.append(f"CPU steal during run {steal_percent:.1f}%")
    return "; ".join(parts)


def cpu_of(machine: str) -> str:
    """'2 CPUs (Intel(R) Xeon(R) Processor @ 2.80GHz, AVX512, no native bf16); ...' -> 'Intel Xeon, AVX512,
    no native bf16': the CPU kind a reader compares runs by."""
    match = re.search(r"\((.*?)\)(;|$)", machine)
    text = match.group(1) if match else machine.split(";")[0]
    text = re.sub(r"\((R|TM)\)|\bProcessor\b|@ [\d.]+GHz|\b\d+-Core\b", "", text)
    return re.sub(r"\s+", " ", re.sub(r"\s+,", ",", text)).strip(" ,")


def cpu_of_this_machine() -> str:
    return cpu_of(machine_line())


# ---------------------------------------------------------------------------------------------------
# Tables and the results
# ---------------------------------------------------------------------------------------------------
def fmt(value: float | int | str | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if value != value:  # nan
        return "-"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.1f}"
    return f"{value:.{digits}g}"


@dataclass
class Table:
    """One results table as data (headers and formatted cells); str() is its markdown."""

    headers: list[str]
    rows: list[list[str]]

    def __str__(self) -> str:
        return render_table(self.headers, self.rows)

    def to_json(self) -> dict:
        return {"headers": self.headers, "rows": self.rows}


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], pad: bool = True) -> str:
    """A markdown table; pad=False leaves cells unaligned (for tables of long text cells)."""
    if not pad:
        lines = ["| " + " | ".join(map(str, row)) + " |" for row in [headers, *rows]]
        lines.insert(1, "|" + "|".join("---" for _ in headers) + "|")
        return "\n".join(lines)
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    """A results table: numbers formatted by fmt(), kept as data for the results file."""
    return Table([str(h) for h in headers], [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows])


GOAL_STATUS = {True: "met", False: "missed", None: "not measured"}


@dataclass
class Goal:
    """A goal's verdict in one run: what was aimed at, met/missed/not measured, and the measured detail."""

    name: str
    status: str  # one of GOAL_STATUS's values
    detail: str

    def __str__(self) -> str:
        return f"- **Goal — {self.name}: {self.status.upper()}.** {self.detail}"

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail}


def goal_line(name: str, met: bool | None, detail: str) -> Goal:
    return Goal(name, GOAL_STATUS[met], detail)


def section(
    ctx: BenchContext,
    title: str,
    intro: str,
    tables: Sequence[Table | str],
    goals: Sequence[Goal | str],
    images: Sequence[Path] = (),
    steal_percent: float | None = None,
) -> dict:
    """One benchmark's result as data: command, date, machine, intro, tables, goals and notes, plots.

    Tables may be interleaved with captions (strings). Goals (goal_line) are kept as data for the
    README's table of current figures; other notes (markdown lines) follow the goals."""
    return {
        "title": title,
        "quick": ctx.quick,
        "command": ctx.command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_line(steal_percent),
        "intro": intro.strip(),
        "tables": [table.to_json() if isinstance(table, Table) else {"text": table} for table in tables],
        "goals": [goal.to_json() for goal in goals if isinstance(goal, Goal)],
        "notes": [str(goal) for goal in goals if not isinstance(goal, Goal)],
        "images": [os.path.relpath(image, REPO_ROOT) for image in images],
    }


def publish(ctx: BenchContext, name: str, result: dict) -> None:
    """Write the result as data (<results_dir>/<name>.json), print it, and regenerate the page from every
    results file (benchmarks/page.py)."""
    from benchmarks import page

    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.results_dir / f"{name}.json"
    path.write_text(json.dumps({"name": name, **result}, indent=2, ensure_ascii=False) + "\n")
    print("\n" + page.render_section({"name": name, **result}, ctx.doc_path.parent), flush=True)
    # The README's figures are the project's own results only: a quick run or one written elsewhere
    # (--results-dir, --doc) leaves it alone.
    official = not ctx.quick and ctx.results_dir == RESULTS_DIR and ctx.doc_path == DEFAULT_DOC
    page.write_page(ctx.results_dir, ctx.doc_path, readme=README if official else None)
    ctx.log(f"wrote {path} and {ctx.doc_path}")


def run_to_end(cmd: Sequence[str], log_path: Path, timeout_s: float, env: dict | None = None) -> int:
    """Run a benchmark's child (a whole RL run, TRL) in its own session from the repository root, output
    to log_path; its exit code. A timeout, Ctrl-C or SIGTERM of the benchmark stops the child's whole
    process tree first (a run left behind would skew every measurement after it)."""
    from inference_shim.procs import start_child, stop_process_tree

    proc = start_child(cmd, env=env, log_path=log_path, cwd=REPO_ROOT, append_log=False)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124
    finally:
        stop_process_tree(proc, grace_s=30)
