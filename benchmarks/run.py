"""`python -m benchmarks NAME... [--quick]`: run benchmarks, print their tables, write each result as
data (benchmarks/results/NAME.json, with the exact command) and regenerate docs/benchmarks.md and the
README's figures table from the results files (benchmarks/page.py); raw measurements and server logs
go under artifacts/bench/.

    python -m benchmarks weight-sync          # weight push vs raw gloo vs memcpy, 1 and 2 servers
    python -m benchmarks inflight             # generation throughput with/without weight updates
    python -m benchmarks pipeline-vs-sync     # pipelined vs synchronous RL (benchmarks/pipeline_vs_sync.py)
    python -m benchmarks streams              # per-sample cost of the stream path vs raw Redis
    python -m benchmarks shim                 # shim vs vLLM's own OpenAI server, 1/8/64 concurrent
    python -m benchmarks multihost            # push fan-out to 1/2/4 simulated hosts over shaped links (root)
    python -m benchmarks recovery             # per fault kind: recovery time, throughput dip, samples lost
    python -m benchmarks trainer-step         # one trainer step at the demo's sizes: phases, layouts, plain loop
    python -m benchmarks vs-trl               # TRL's GRPOTrainer vs our pipelined and sync modes (own venv)
    python -m benchmarks lag                  # pipelined learning per second and per sample vs max_lag, KV policy
    python -m benchmarks engine-profile       # py-spy of a vLLM-CPU server's processes at the demo's load
    python -m benchmarks warmup-seeds         # the demo's supervised warm-up across seeds, with and without decay
    python -m benchmarks tracking-cost        # a run's samples/s with TensorBoard, W&B and MLflow on vs off
    python -m benchmarks ray-cost             # a run on a one-node Ray cluster vs the local launcher; Ray's idle cost
    python -m benchmarks lora-cost            # LoRA adapter push vs full push vs vLLM's reload; tokens/s under pushes
    python -m benchmarks lora-demo            # the demo task with a LoRA adapter vs full fine-tuning, 3 seeds
    python -m benchmarks rollout-strategies   # in-flight, drain-then-swap, sync, sync + partial rollouts; long tail
    python -m benchmarks soak                 # 30 min under >= 20 random faults: nothing lost, nothing twice
    python -m benchmarks demo                 # `make demo` in a fresh clone of this checkout, added to the recorded runs
    python -m benchmarks all                  # every one, in that order, sharing servers
    python -m benchmarks inflight streams     # several, sharing servers
    python -m benchmarks shim --quick         # tiny sizes: a smoke test (writes artifacts/bench-quick/)

`--quick` results go to artifacts/bench-quick/ (results/, benchmarks.md) unless --results-dir and --doc
say otherwise, so a smoke run never overwrites the real figures. A benchmark that fails does not stop the
ones after it; the command exits non-zero naming the failures.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import ARTIFACTS, DEFAULT_DOC, DEFAULT_IMG_DIR, QUICK_DIR, RESULTS_DIR, BenchContext


def _weight_sync(ctx: BenchContext) -> dict:
    if ctx.options.get("hosts"):  # `weight-sync --hosts 1,2,4`: the push across simulated hosts
        return _multihost(ctx)
    from benchmarks import weight_sync

    return weight_sync.run(ctx)


def _inflight(ctx: BenchContext) -> dict:
    from benchmarks import inflight

    return inflight.run(ctx)


def _streams(ctx: BenchContext) -> dict:
    from benchmarks import streams

    return streams.run(ctx)


def _shim(ctx: BenchContext) -> dict:
    from benchmarks import shim

    return shim.run(ctx)


def _multihost(ctx: BenchContext) -> dict:
    from benchmarks import multihost

    return multihost.run(ctx)


def _recovery(ctx: BenchContext) -> dict:
    from benchmarks import recovery

    return recovery.run(ctx)


def _pipeline_vs_sync(ctx: BenchContext) -> dict:
    from benchmarks import pipeline_vs_sync

    return pipeline_vs_sync.run(ctx)


def _vs_trl(ctx: BenchContext) -> dict:
    from benchmarks import vs_trl

    return vs_trl.run(ctx)


def _lag(ctx: BenchContext) -> dict:
    from benchmarks import lag

    return lag.run(ctx)


def _engine_profile(ctx: BenchContext) -> dict:
    from benchmarks import engine_profile

    return engine_profile.run(ctx)


def _warmup_seeds(ctx: BenchContext) -> dict:
    from benchmarks import warmup_seeds

    return warmup_seeds.run(ctx)


def _demo(ctx: BenchContext) -> dict:
    from benchmarks import demo

    return demo.run(ctx)


def _tracking_cost(ctx: BenchContext) -> dict:
    from benchmarks import tracking_cost

    return tracking_cost.run(ctx)


def _ray_cost(ctx: BenchContext) -> dict:
    from benchmarks import ray_cost

    return ray_cost.run(ctx)


def _lora_cost(ctx: BenchContext) -> dict:
    from benchmarks import lora_cost

    return lora_cost.run(ctx)


def _lora_demo(ctx: BenchContext) -> dict:
    from benchmarks import lora_demo

    return lora_demo.run(ctx)


def _rollout_strategies(ctx: BenchContext) -> dict:
    from benchmarks import rollout_strategies

    return rollout_strategies.run(ctx)


def _soak(ctx: BenchContext) -> dict:
    from benchmarks import soak

    return soak.run(ctx)


def _trainer_step(ctx: BenchContext) -> dict:
    from benchmarks import trainer_step

    return trainer_step.run(ctx)


BENCHMARKS: dict[str, Callable[[BenchContext], dict]] = {
    "weight-sync": _weight_sync,
    "inflight": _inflight,
    "pipeline-vs-sync": _pipeline_vs_sync,
    "streams": _streams,
    "shim": _shim,
    "multihost": _multihost,
    "recovery": _recovery,
    "trainer-step": _trainer_step,
    "vs-trl": _vs_trl,
    "lag": _lag,
    "engine-profile": _engine_profile,
    "warmup-seeds": _warmup_seeds,
    "tracking-cost": _tracking_cost,
    "ray-cost": _ray_cost,
    "lora-cost": _lora_cost,
    "lora-demo": _lora_demo,
    "rollout-strategies": _rollout_strategies,
    "soak": _soak,
    "demo": _demo,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument(
        "names",
        nargs="+",
        choices=[*BENCHMARKS, "all"],
        metavar="NAME",
        help=f"{', '.join(BENCHMARKS)} or all",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats: a smoke test")
    p.add_argument(
        "--repeats", type=int, default=None, help="interleaved repeats (default 5; 2 with --quick)"
    )
    p.add_argument(
        "--doc", type=Path, default=None, help="the page to regenerate (default docs/benchmarks.md)"
    )
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where each result is written as NAME.json (default benchmarks/results; quick: artifacts/bench-quick/results)",
    )
    p.add_argument("--img-dir", type=Path, default=None, help="where plots go (default docs/img)")
    p.add_argument(
        "--out-dir", type=Path, default=None, help="raw JSON + server logs (default artifacts/bench)"
    )
    g = p.add_argument_group("servers and the stand-in trainer (to evaluate a fix before it lands)")
    g.add_argument(
        "--server-env",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="extra environment for every server; VALUE a/b gives server 0 a, server 1 b "
        "(e.g. VLLM_CPU_OMP_THREADS_BIND=0/1)",
    )
    g.add_argument(
        "--kv-after-update",
        choices=["recompute", "keep"],
        default=None,
        help="servers the bench starts itself (inflight, shim, ...); lag: run only this policy. Runs through "
        "the launcher (pipeline-vs-sync, vs-trl) take --override inference.kv_after_update=...",
    )
    g.add_argument(
        "--apply-weights",
        choices=["prepared", "reload"],
        default=None,
        help="shim servers' way of applying an update (vLLM): prepared beside the live model (default) or "
        "vLLM's reload path inside the pause",
    )
    g.add_argument(
        "--trainer-threads",
        type=int,
        default=None,
        help="torch threads of the pushing process (default: half the cores, as pipeline_rl/launch/ gives a trainer)",
    )
    g = p.add_argument_group("weight-sync")
    g.add_argument(
        "--sizes",
        default=None,
        help="model sizes, e.g. 10mb,100mb,500mb (benchmarks/models.py); multihost uses the first; "
        "vs-trl: demo,25m,100m",
    )
    g.add_argument("--buckets-mib", default=None, help="bucket sizes to sweep, e.g. 16,64,256")
    g = p.add_argument_group("pipeline-vs-sync, vs-trl, lag, warmup-seeds")
    g.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="runs per mode, seeds 0..N-1 (default 3; 1 with --quick, warmup-seeds 2)",
    )
    g.add_argument(
        "--first-seed",
        type=int,
        default=None,
        help="seeds K..K+N-1 instead: more seeds in a second run (e.g. --seeds 3 --first-seed 3)",
    )
    g.add_argument(
        "--run-s",
        type=int,
        default=None,
        help="wall seconds of each run (default 300, vs-trl 200; 60 / 20 with --quick)",
    )
    g.add_argument(
        "--recipe",
        default=None,
        choices=["arith", "remainder", "longtail"],
        help="pipeline-vs-sync, warmup-seeds, lag: the demo recipe to run (default arith; remainder: long "
        "answers; longtail: long-tailed answer lengths)",
    )
    g.add_argument(
        "--recipes",
        default=None,
        help="rollout-strategies: the recipes to run, e.g. longtail (default longtail,arith)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="skip the runs an earlier, stopped run of the benchmark finished (rollout-strategies, lag, and "
        "the other multi-seed benchmarks)",
    )
    g.add_argument("--tag", default=None, help="lag: a name for this study's results (e.g. with --override)")
    g.add_argument(
        "--systems",
        default=None,
        help="vs-trl: trl and our launch variants to compare (pipeline_vs_sync.VARIANTS), "
        "default pipeline,sync-colocated-sp-bf16,trl",
    )
    g.add_argument(
        "--override",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a launch override every run of ours gets last, e.g. trainer.micro_batch_layout=padded (one "
        "row per sample, the trainer's default layout); repeatable",
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="warmup-seeds: the steps of every variant's warm-up (default: each variant's own; 3 with --quick)",
    )
    g.add_argument(
        "--lags", default=None, help="lag: the actor.max_lag values to run, e.g. 0,2,8 (default 0,1,2,4,8)"
    )
    g = p.add_argument_group("demo")
    g.add_argument(
        "--record",
        default=None,
        metavar="RUN_DIR",
        help="record this finished demo run instead of running one",
    )
    g = p.add_argument_group("multihost")
    g.add_argument(
        "--hosts",
        default=None,
        help="numbers of server hosts to push to, e.g. 1,2,4 (weight-sync --hosts runs multihost)",
    )
    g.add_argument("--rates", default=None, help="link rates (tbf), e.g. 1gbit,10gbit")
    g.add_argument("--chunk-kib", type=int, default=None, help="chunk size of the chain relay")
    g = p.add_argument_group("inflight, streams, shim")
    g.add_argument(
        "--model", default=None, help="model size for generation (default 10mb; tiny with --quick)"
    )
    g.add_argument("--window-s", type=float, default=None, help="seconds per measurement window")
    g.add_argument(
        "--update-every-s", default=None, help="inflight: seconds between updates, e.g. 1,3 (the default)"
    )
    g.add_argument(
        "--concurrency",
        default=None,
        help="shim: concurrency levels, e.g. 1,8,64; engine-profile: sequences in flight to sweep",
    )
    return p


def _options(args: argparse.Namespace) -> dict:
    def ints(text: str | None) -> list[int] | None:
        return [int(x) for x in text.split(",")] if text else None

    options = {
        "sizes": args.sizes.split(",") if args.sizes else None,
        "buckets_mib": ints(args.buckets_mib),
        "model": args.model,
        "window_s": args.window_s,
        "update_every_s": args.update_every_s,
        "concurrency": ints(args.concurrency),
        "server_env": args.server_env,
        "kv_after_update": args.kv_after_update,
        "apply_weights": args.apply_weights,
        "trainer_threads": args.trainer_threads,
        "hosts": ints(args.hosts),
        "rates": args.rates.split(",") if args.rates else None,
        "chunk_kib": args.chunk_kib,
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "run_s": args.run_s,
        "recipe": args.recipe,
        "recipes": args.recipes.split(",") if args.recipes else None,
        "resume": args.resume or None,
        "tag": args.tag,
        "systems": args.systems.split(",") if args.systems else None,
        "lags": ints(args.lags),
        "warmup_steps": args.warmup_steps,
        "overrides": args.override,
        "record": args.record,
    }
    return {k: v for k, v in options.items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    names = _expand(args.names)
    from benchmarks.servers import ServerPool

    out_dir = args.out_dir or (QUICK_DIR if args.quick else ARTIFACTS / "bench")
    ctx = BenchContext(
        quick=args.quick,
        repeats=args.repeats or (2 if args.quick else 5),
        command="python -m benchmarks " + shlex.join(argv),
        doc_path=args.doc or (QUICK_DIR / "benchmarks.md" if args.quick else DEFAULT_DOC),
        img_dir=args.img_dir or (QUICK_DIR / "img" if args.quick else DEFAULT_IMG_DIR),
        results_dir=args.results_dir or (QUICK_DIR / "results" if args.quick else RESULTS_DIR),
        out_dir=out_dir,
        pool=ServerPool(out_dir / "logs"),
        options=_options(args),
    )
    started = time.monotonic()
    failed: list[str] = []
    # SIGTERM (a test's timeout, a CI cancel) must still stop the servers, which run in their own
    # sessions: turn it into SystemExit so the pool's `with` block tears them down.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with ctx.pool:
        _prestart(ctx, names)
        for name in names:
            ctx.log(f"running {name}")
            try:
                BENCHMARKS[name](ctx)
            except Exception:  # noqa: BLE001 - report, then run the others; the exit code says it failed
                ctx.log(f"{name} FAILED:\n{traceback.format_exc()}")
                failed.append(name)
    ctx.log(f"done in {time.monotonic() - started:.0f} s; results in {ctx.doc_path}")
    if failed:
        sys.exit(f"python -m benchmarks: failed: {', '.join(failed)} (tracebacks above)")


def _expand(requested: list[str]) -> list[str]:
    """Benchmark names in BENCHMARKS' order (the page's); `all` = every one."""
    wanted = set(BENCHMARKS) if "all" in requested else set(requested)
    return [name for name in BENCHMARKS if name in wanted]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _prestart(ctx: BenchContext, names: list[str]) -> None:
    """Start the servers the benchmarks will need now, so their ~35 s startups overlap.

    Full runs prestart only the first benchmark's servers: weight-sync's big models need the memory.
    """
    import importlib

    for name in names if ctx.quick else names[:1]:
        try:
            needed = importlib.import_module(f"benchmarks.{name.replace('-', '_')}").servers_needed(ctx)
        except Exception as e:  # noqa: BLE001 - the benchmark itself will fail and report it
            ctx.log(f"not prestarting servers for {name}: {type(e).__name__}: {e}")
            continue
        for spec, count in needed:
            ctx.pool.prestart(spec, count)


if __name__ == "__main__":
    main()
