"""`pipeline-rl` command: one entrypoint, one subcommand per process kind.

    pipeline-rl serve --model DIR [--port N] [--token T]     inference server (shim + engine)
    pipeline-rl tiny-model --out DIR [--hidden 64 ...]       build the tiny CPU model
    pipeline-rl tiny-model --out DIR --grow-from DIR2 --factor 5   DIR2 5x wider, same function
    pipeline-rl launch [key=value ...]                       a whole run (see README)
    pipeline-rl demo                                         the CPU demo
    pipeline-rl eval MODEL... [key=value ...] [--samples K]  held-out scores of checkpoints or runs
    pipeline-rl fleet list|add|remove [URL] --run-dir RUN    servers of a running job
    pipeline-rl export RUN_OR_CHECKPOINT (--merged OUT | --adapter OUT) [--base DIR]   a standalone model
    pipeline-rl actor|preprocess|stage|train --config RUN/config.json ...   one process (launcher uses these)
    pipeline-rl --help

Heavy modules (torch, vLLM) are imported inside the subcommand that needs them, so --help is instant.
"""

from __future__ import annotations

import argparse
import sys

# The server's command line lives in inference_shim/cli.py; `serve` is it, flag for flag.
from inference_shim import cli as server_cli


def _set_title(name: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(f"pipeline-rl {name}")
    except ImportError:
        pass


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run an inference server (HTTP contract in front of an engine)")
    server_cli.add_serve_arguments(p)


def _run_serve(args: argparse.Namespace) -> None:
    server_cli.run(args)


def _add_tiny_model(sub) -> None:
    p = sub.add_parser(
        "tiny-model", help="build a tiny tokenizer + Qwen2-style model (offline, deterministic)"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--grow-from",
        help="instead of a new model: DIR's model made --factor times wider, computing the same function "
        "(plus --noise); e.g. the warmed-up demo model at ~25M (--factor 5) or ~100M (--factor 10) parameters",
    )
    p.add_argument("--factor", type=int, default=5, help="with --grow-from: width multiplier")
    p.add_argument(
        "--noise", type=float, default=0.01, help="with --grow-from: noise, times each weight's std"
    )


def _run_tiny_model(args: argparse.Namespace) -> None:
    from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model, grow_model

    if args.grow_from:
        out = grow_model(args.grow_from, args.out, args.factor, noise=args.noise, seed=args.seed)
        origin = f"; {args.grow_from} grown {args.factor}x wide"
    else:
        spec = TinyModelSpec(
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate,
            max_position_embeddings=args.max_positions,
            seed=args.seed,
        )
        out, origin = build_tiny_model(args.out, spec), ""
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e6:.2f} MB of weights{origin})")


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's trained weights as a standalone model (LoRA merged) or as its peft adapter",
        description="Write a run's trained weights as a standalone directory (pipeline_rl/export.py).",
    )
    p.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT",
        help="a run directory (its newest verified checkpoint), a checkpoint (step_N) or a snapshot (vN)",
    )
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument(
        "--merged",
        metavar="OUT",
        help="a Hugging Face model: the adapter merged into its base (a full fine-tuning run: copied)",
    )
    out.add_argument("--adapter", metavar="OUT", help="the peft adapter directory (runs with trainer.lora)")
    p.add_argument(
        "--base",
        metavar="DIR",
        help="the base model the adapter was trained on (default: the adapter's, else the run's model_path)",
    )


def _run_export(args: argparse.Namespace) -> None:
    from pipeline_rl.export import ExportError, describe, export

    _set_title("export")
    try:
        result = export(
            args.source, args.merged or args.adapter, merged=args.merged is not None, base=args.base
        )
    except ExportError as e:
        sys.exit(f"pipeline-rl export: {e}")
    print(describe(result))


# Subcommands whose module parses its own arguments: name -> (help, "module:function(argv)").
PASSTHROUGH = {
    "launch": (
        "start a whole run: redis, servers and the graph's stages (actors, preprocessors, trainer, ...)",
        "pipeline_rl.launch.main:main",
    ),
    "demo": (
        "build + warm up the tiny model, then launch pipelined RL on arith",
        "pipeline_rl.demo.main:main",
    ),
    "actor": ("one actor process (started by the launcher)", "pipeline_rl.actor.main:main"),
    "preprocess": ("one preprocessor process (started by the launcher)", "pipeline_rl.preprocess.main:main"),
    "stage": (
        "one worker of a user stage of the graph (started by the launcher)",
        "pipeline_rl.stages.worker:main",
    ),
    "train": (
        "one trainer rank (run under accelerate launch by the launcher)",
        "pipeline_rl.trainer.main:main",
    ),
    "fleet": (
        "list, add or remove the servers of a running job",
        "pipeline_rl.launch.fleet_route:main",
    ),
    "eval": (
        "evaluate checkpoints or runs on a task's held-out split: pass@1, pass@k, maj@k, mean reward",
        "pipeline_rl.eval.main:main",
    ),
    "report": (
        "summary, sample ledger and plots of a run directory (finished or running)",
        "pipeline_rl.launch.report:main",
    ),
}


def _passthrough(name: str, target: str):
    def add(sub) -> None:
        p = sub.add_parser(name, help=PASSTHROUGH[name][0], add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)

    def run(args: argparse.Namespace) -> None:
        import importlib

        module_name, function = target.split(":")
        _set_title(name)
        getattr(importlib.import_module(module_name), function)(args.rest)

    return add, run


COMMANDS = {
    "serve": (_add_serve, _run_serve),
    "tiny-model": (_add_tiny_model, _run_tiny_model),
    "export": (_add_export, _run_export),
    **{name: _passthrough(name, target) for name, (_, target) in PASSTHROUGH.items()},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline-rl", description="Pipelined RL for LLMs with inflight weight updates."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in PASSTHROUGH:
            # The module parses its own flags (argparse's REMAINDER would stop at the first --flag).
            COMMANDS[argv[0]][1](argparse.Namespace(rest=argv[1:]))
            return
        args = build_parser().parse_args(argv)
        COMMANDS[args.command][1](args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
