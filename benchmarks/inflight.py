"""inflight: generation throughput of a server under steady load while weights are pushed
into it, against the same load with no updates, in interleaved windows of one run.

    python -m benchmarks inflight                       # 10 MB model, 32 streams, windows of 10 s
    python -m benchmarks inflight --update-every-s 2,5  # other trainer step times
    python -m benchmarks inflight --quick               # tiny model, short windows: smoke test

Load: 32 closed-loop streaming chat requests (64 tokens, ignore_eos) run through the whole benchmark.
Windows rotate between the modes: `none` (no updates), `every K s` for each K of --update-every-s
(default 1 and 3: a push every K seconds, a trainer that takes K s per optimizer step; the demo's trainer
takes ~2 s per step, most of it waiting for data: between the two defaults) and
`back-to-back` (the next push starts when the last one ends, the worst case). The goal is judged at the demo's cadence, DEMO_STEP_S; every cadence is reported. Pushes come from a separate process (benchmarks/pusher.py). Between windows a short settle gap
is not counted, so the re-prefill after a window's last update never lands in the next window.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from benchmarks.common import (
    BenchContext,
    StealMeter,
    goal_line,
    markdown_table,
    median,
    percentile,
    publish,
    rotate,
    section,
)
from benchmarks.load import ClosedLoop, served_model
from benchmarks.models import bench_model
from benchmarks.servers import ServerSpec

CONCURRENCY = 32
MAX_TOKENS = 64
SETTLE_S = 1.0
# The demo trainer's step (~2 s, most of it waiting for data), rounded up.
DEMO_STEP_S = 3.0


def _settings(ctx: BenchContext) -> dict:
    return {
        "model": ctx.options.get("model") or ("tiny" if ctx.quick else "10mb"),
        "window_s": ctx.options.get("window_s") or (2.0 if ctx.quick else 10.0),
        "every_s": [float(x) for x in str(ctx.options.get("update_every_s") or "1,3").split(",")],
        "concurrency": CONCURRENCY,
    }


def servers_needed(ctx: BenchContext) -> list[tuple[ServerSpec, int]]:
    return [(ctx.server("shim", bench_model(_settings(ctx)["model"])), 1)]


class Pusher:
    """benchmarks/pusher.py as an asyncio subprocess: send a command, await its JSON answer."""

    def __init__(self, model: Path, url: str, threads: int | None) -> None:
        self.model, self.url, self.threads = model, url, threads

    async def __aenter__(self) -> Pusher:
        threads = ["--threads", str(self.threads)] if self.threads else []
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.pusher", "--model", str(self.model), "--url", self.url, *threads,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await self._answer()  # {"ready": true}: joined the weight group
        return self

    async def _answer(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=600)
        if not line:
            raise RuntimeError(
                f"benchmarks.pusher exited with {await self.proc.wait()} (see its stderr above)"
            )
        return json.loads(line)

    async def run(self, every_s: float, duration_s: float) -> list[dict]:
        command = {"cmd": "run", "every_s": every_s, "duration_s": duration_s}
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        await self.proc.stdin.drain()
        return (await self._answer())["pushes"]

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.write(b'{"cmd": "quit"}\n')
            await self.proc.stdin.drain()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=60)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _measure(ctx: BenchContext, url: str, model_dir: Path, s: dict) -> dict:
    load = ClosedLoop(url, await served_model(url), s["concurrency"], MAX_TOKENS, stream=True, ramp_s=2.0)
    every: dict[str, float | None] = {"none": None}
    every |= {f"every {k:g} s": k for k in s["every_s"]}
    every["back-to-back"] = 0.0
    modes = list(every)
    windows: list[dict] = []
    async with Pusher(model_dir, url, ctx.trainer_threads()) as pusher:
        task = asyncio.create_task(load.run())
        await pusher.run(0.0, 0.001)  # one untimed push: the pusher's buffers, the server's first apply
        await asyncio.sleep(max(2.0, s["window_s"] / 2))  # the load reaches steady state
        for rep in range(ctx.repeats):
            ctx.log(f"inflight: repeat {rep + 1}/{ctx.repeats}")
            for mode in rotate(modes, rep):
                t0 = time.monotonic()
                if every[mode] is None:
                    await asyncio.sleep(s["window_s"])
                    pushes = []
                else:
                    pushes = await pusher.run(every[mode], s["window_s"])
                t1 = time.monotonic()
                windows.append({"mode": mode, "rep": rep, "t0": t0, "t1": t1, "pushes": pushes})
                await asyncio.sleep(SETTLE_S)
        load.stop()
        await task
    for w in windows:
        gaps = load.gaps_between(w["t0"], w["t1"])
        w["tokens_per_s"] = load.tokens_between(w["t0"], w["t1"]) / (w["t1"] - w["t0"])
        w["max_gap_s"] = max(gaps, default=float("nan"))
        w["p99_gap_s"] = percentile(gaps, 99)
        w["timeline"] = load.tokens_per_bin(w["t0"], w["t1"], 0.25)
    return {"modes": modes, "windows": windows, "errors": load.errors[:20], "error_count": len(load.errors)}


def _table(data: dict) -> tuple[str, list[dict]]:
    rows, summary = [], []
    base = median([w["tokens_per_s"] for w in data["windows"] if w["mode"] == "none"])
    for mode in data["modes"]:
        ws = [w for w in data["windows"] if w["mode"] == mode]
        pushes = [p for w in ws for p in w["pushes"]]
        pauses = [p["pause_seconds"] for p in pushes]
        tps = median([w["tokens_per_s"] for w in ws])
        row = {
            "mode": mode,
            "tokens_per_s": tps,
            "of_none": tps / base if base else float("nan"),  # no token in the baseline's windows: no ratio
            "updates_per_window": len(pushes) / len(ws),
            "pause_p50": percentile(pauses, 50),
            "pause_p99": percentile(pauses, 99),
            "push_p50": percentile([p["total_seconds"] for p in pushes], 50),
            "gap_p99": median([w["p99_gap_s"] for w in ws]),
            "gap_max": max(w["max_gap_s"] for w in ws),
        }
        summary.append(row)
        rows.append(
            [
                mode,
                tps,
                f"{100 * row['of_none']:.1f}%" if base else "-",
                row["updates_per_window"],
                row["push_p50"] * 1000 if pushes else None,
                row["pause_p50"] * 1000 if pushes else None,
                row["pause_p99"] * 1000 if pushes else None,
                row["gap_p99"] * 1000,
                row["gap_max"] * 1000,
            ]
        )
    headers = [
        "updates",
        "tokens/s (median)",
        "of none",
        "updates / window",
        "push ms p50",
        "pause ms p50",
        "pause ms p99",
        "inter-token gap ms p99",
        "longest gap ms",
    ]
    return markdown_table(headers, rows), summary


def _plot(ctx: BenchContext, data: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = data["windows"][: len(data["modes"])]  # the first repeat's windows, one per mode
    fig, axes = plt.subplots(len(rep), 1, figsize=(8, 2.2 * len(rep)), sharex=True, sharey=True)
    for ax, w in zip(axes, rep, strict=True):
        xs = [t for t, _ in w["timeline"]]
        ax.step(xs, [v for _, v in w["timeline"]], where="post", color="C0")
        for p in w["pushes"]:
            # The pause ends when the push reports; draw it there (within a few ms of the real spot).
            ax.axvspan(
                p["end"] - w["t0"] - p["pause_seconds"], p["end"] - w["t0"], color="C3", alpha=0.4, lw=0
            )
        ax.set_title(f"{w['mode']}: {w['tokens_per_s']:.0f} tokens/s", fontsize=9)
        ax.set_ylabel("tokens/s")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("seconds into window (red: generation paused for an update)")
    fig.tight_layout()
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.img_dir / "inflight.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def run(ctx: BenchContext) -> dict:
    s = _settings(ctx)
    model_dir = bench_model(s["model"])
    url = ctx.pool.urls(ctx.server("shim", model_dir), 1)[0]
    steal = StealMeter()
    data = asyncio.run(_measure(ctx, url, model_dir, s))
    table, summary = _table(data)
    by_mode = {r["mode"]: r for r in summary}
    judged = min(s["every_s"], key=lambda k: abs(k - DEMO_STEP_S))
    kept = "; ".join(
        f"{mode}: {100 * by_mode[mode]['of_none']:.1f}%" for mode in data["modes"] if mode != "none"
    )
    share = by_mode[f"every {judged:g} s"]["of_none"]
    goals = [
        goal_line(
            "throughput with an update after every step >= 95% of none",
            None if share != share else share >= 0.95,  # nan: the baseline's windows saw no token
            f"judged at one update every {judged:g} s (the demo trainer's step time); share of the "
            f"no-update throughput kept: {kept}.",
        )
    ]
    intro = (
        f"Model `{s['model']}` (benchmarks/models.py), {s['concurrency']} concurrent streaming chat requests of "
        f"{MAX_TOKENS} tokens (ignore_eos) for the whole run; windows of {s['window_s']:g} s, "
        f"{ctx.repeats} repeats per mode in rotated order, medians. Pushes (256 MiB buckets, "
        f"`kv_after_update={ctx.options.get('kv_after_update') or 'recompute'}`, pusher torch threads: "
        f"{ctx.trainer_threads()}) come from a separate process (benchmarks/pusher.py). "
        "Client requests start spread over 2 s so the batch holds requests of mixed ages. "
        "Tokens/s and inter-token gaps are "
        "measured by the client, per request and per SSE chunk; `pause` is the server's "
        f"UpdateResult.pause_seconds. Client errors: {data['error_count']}."
    )
    markdown = section(ctx, "inflight", intro, [table], goals, _plot(ctx, data), steal.percent())
    publish(ctx, "inflight", markdown)
    data["summary"] = summary
    data["settings"] = s
    ctx.save_json("inflight", data)
    return data
