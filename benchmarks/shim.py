"""shim: latency and throughput of chat completions through our shim against vLLM's own
OpenAI server on the same model, at 1, 8 and 64 concurrent requests, interleaved in one run.

    python -m benchmarks shim                 # 10 MB model, concurrency 1,8,64, windows of 15 s
    python -m benchmarks shim --model tiny    # the engine's fastest case: the shim's share is largest
    python -m benchmarks shim --quick         # tiny model, concurrency 1,8, short windows: smoke test

Our shim runs the engine in-process (AsyncLLM), so "straight to the engine" means the same engine behind
vLLM's own HTTP layer: `python -m vllm.entrypoints.openai.api_server` with the same dtype, max model
length, max_num_seqs, seed and eager mode. Both get identical requests (same prompts, temperature 1,
logprobs, ignore_eos, a fixed max_tokens), non-streaming, from closed-loop clients. Both servers stay
up; only the one being measured has load.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.common import (
    BenchContext,
    StealMeter,
    goal_line,
    markdown_table,
    median,
    publish,
    rotate,
    section,
)
from benchmarks.load import closed_loop_window, served_model
from benchmarks.models import bench_model
from benchmarks.servers import ServerSpec

MAX_TOKENS = 64
KINDS = ("shim", "vllm")


def _settings(ctx: BenchContext) -> dict:
    return {
        "model": ctx.options.get("model") or ("tiny" if ctx.quick else "10mb"),
        "window_s": ctx.options.get("window_s") or (2.0 if ctx.quick else 15.0),
        "concurrency": ctx.options.get("concurrency") or ([1, 8] if ctx.quick else [1, 8, 64]),
        "ramp_s": 0.5 if ctx.quick else 2.0,
    }


def servers_needed(ctx: BenchContext) -> list[tuple[ServerSpec, int]]:
    model = bench_model(_settings(ctx)["model"])
    return [(ctx.server(kind, model), 1) for kind in KINDS]


async def _measure(ctx: BenchContext, urls: dict[str, str], s: dict) -> list[dict]:
    names = {kind: await served_model(url) for kind, url in urls.items()}
    for kind in KINDS:  # warm-up, not counted: first requests compile/allocate
        await closed_loop_window(
            urls[kind],
            names[kind],
            max(s["concurrency"]),
            min(3.0, s["window_s"]),
            max_tokens=MAX_TOKENS,
            ramp_s=0.0,
        )
    windows = []
    for rep in range(ctx.repeats):
        ctx.log(f"shim: repeat {rep + 1}/{ctx.repeats}")
        for concurrency in s["concurrency"]:
            for kind in rotate(KINDS, rep):
                result = await closed_loop_window(
                    urls[kind],
                    names[kind],
                    concurrency,
                    s["window_s"],
                    max_tokens=MAX_TOKENS,
                    ramp_s=s["ramp_s"],
                )
                windows.append({"kind": kind, "concurrency": concurrency, "rep": rep, **result})
    return windows


def _summary(windows: list[dict], levels: list[int]) -> list[dict]:
    summary = []
    for c in levels:
        row: dict = {"concurrency": c}
        for kind in KINDS:
            ws = [w for w in windows if w["kind"] == kind and w["concurrency"] == c]
            row[kind] = {
                "latency_p50": median([w["latency_p50"] for w in ws]),
                "latency_p99": median([w["latency_p99"] for w in ws]),
                "tokens_per_s": median([w["tokens_per_s"] for w in ws]),
                "requests": sum(w["requests"] for w in ws),
            }
        # Paired per repeat (the two windows of a repeat ran back to back), then the median.
        ratios = []
        for rep in sorted({w["rep"] for w in windows}):
            pair = {w["kind"]: w for w in windows if w["concurrency"] == c and w["rep"] == rep}
            if len(pair) == 2:
                ratios.append(pair["shim"]["latency_p50"] / pair["vllm"]["latency_p50"])
        row["latency_ratio"] = median(ratios)
        row["throughput_ratio"] = row["shim"]["tokens_per_s"] / row["vllm"]["tokens_per_s"]
        summary.append(row)
    return summary


def _table(summary: list[dict]) -> str:
    rows = []
    for r in summary:
        rows.append(
            [
                str(r["concurrency"]),
                r["shim"]["latency_p50"] * 1000,
                r["vllm"]["latency_p50"] * 1000,
                f"{100 * (r['latency_ratio'] - 1):+.1f}%",
                r["shim"]["latency_p99"] * 1000,
                r["vllm"]["latency_p99"] * 1000,
                r["shim"]["tokens_per_s"],
                r["vllm"]["tokens_per_s"],
                f"{100 * r['throughput_ratio']:.1f}%",
            ]
        )
    headers = [
        "concurrent",
        "shim ms p50",
        "vLLM ms p50",
        "shim latency added",
        "shim ms p99",
        "vLLM ms p99",
        "shim tokens/s",
        "vLLM tokens/s",
        "shim / vLLM throughput",
    ]
    return markdown_table(headers, rows)


def _plot(ctx: BenchContext, summary: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for kind, color in (("shim", "C3"), ("vllm", "C0")):
        label = "our shim" if kind == "shim" else "vLLM OpenAI server"
        ax1.plot(xs, [r[kind]["latency_p50"] * 1000 for r in summary], marker="o", color=color, label=label)
        ax2.plot(xs, [r[kind]["tokens_per_s"] for r in summary], marker="o", color=color, label=label)
    for ax, ylabel in ((ax1, "median latency (ms)"), (ax2, "completion tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.img_dir / "shim.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _first_error(windows: list[dict]) -> str:
    for w in windows:
        if w["errors"]:
            return f" (first, {w['kind']} at {w['concurrency']} concurrent: `{w['errors'][0]}`)"
    return ""


def run(ctx: BenchContext) -> dict:
    s = _settings(ctx)
    model = bench_model(s["model"])
    urls = {kind: ctx.pool.urls(ctx.server(kind, model), 1)[0] for kind in KINDS}
    steal = StealMeter()
    windows = asyncio.run(_measure(ctx, urls, s))
    summary = _summary(windows, s["concurrency"])
    top = max(summary, key=lambda r: r["concurrency"])
    goals = [
        goal_line(
            "shim adds <= 2% latency at 64 concurrent requests",
            (top["latency_ratio"] - 1) <= 0.02 if top["concurrency"] >= 64 else None,
            f"At {top['concurrency']} concurrent requests the shim's median latency is "
            f"{100 * (top['latency_ratio'] - 1):+.1f}% vs vLLM's own server (paired per repeat), throughput "
            f"{100 * top['throughput_ratio']:.1f}% of it.",
        )
    ]
    errors = sum(w["error_count"] for w in windows)
    intro = (
        f"Model `{s['model']}`, non-streaming chat completions of {MAX_TOKENS} tokens (ignore_eos, "
        f"temperature 1, logprobs), closed-loop clients whose first requests are spread over "
        f"{s['ramp_s']:g} s (the window opens {1.5 * s['ramp_s']:g} s after the start), windows of "
        f"{s['window_s']:g} s, {ctx.repeats} repeats with the two servers in rotated order, medians; "
        "`shim latency added` is the median of the per-repeat ratios of median latencies. "
        f"Client errors: {errors}{_first_error(windows)}."
    )
    markdown = section(ctx, "shim", intro, [_table(summary)], goals, _plot(ctx, summary), steal.percent())
    publish(ctx, "shim", markdown)
    data = {"summary": summary, "windows": windows, "settings": s}
    ctx.save_json("shim", data)
    return data
