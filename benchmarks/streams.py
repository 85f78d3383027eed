"""streams: per-sample cost of the stream path (serialize, XADD, read, ack) against a raw
redis-py round trip of the same bytes, and against the time a server takes to generate one sample.

    python -m benchmarks streams            # RolloutGroups of 8x64, 8x512 and 32x1024 tokens
    python -m benchmarks streams --quick    # 8x64 only, a few messages: smoke test

Stream path = pipeline_rl.streams: Writer.write(RolloutGroup) (model_dump + msgpack + XADD), then
GroupReader.read (XREADGROUP + msgpack + pydantic validation) and ack (XACK). Raw = redis-py XADD /
XREADGROUP / XACK of the already-encoded bytes: the floor any Redis transport pays. Two access patterns:
`1 by 1` (read and ack each group as written: latency-bound) and `batched` (write groups one by one,
read and ack 32 at a time: what a preprocessor does). Generation time per sample is measured in the
same run on the generation benchmarks' server (32 concurrent non-streaming requests of 64 tokens),
as wall time per completed sample: the amortized cost the stream path has to stay far below.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

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
from benchmarks.load import ClosedLoop, served_model
from benchmarks.models import bench_model
from benchmarks.servers import ServerSpec

GEN_CONCURRENCY = 32
GEN_TOKENS = 64
BATCH = 32
PROMPT_TOKENS = 32
SLICES = 4


def _settings(ctx: BenchContext) -> dict:
    return {
        "model": ctx.options.get("model") or ("tiny" if ctx.quick else "10mb"),
        "window_s": ctx.options.get("window_s") or (2.0 if ctx.quick else 10.0),
        # (samples per group, completion tokens per sample)
        "payloads": [(8, 64)] if ctx.quick else [(8, 64), (8, 512), (32, 1024)],
    }


def servers_needed(ctx: BenchContext) -> list[tuple[ServerSpec, int]]:
    return [(ctx.server("shim", bench_model(_settings(ctx)["model"])), 1)]


def rollout_group(samples: int, tokens: int, seed: int = 0):
    """A RolloutGroup shaped like the actor's: token ids, logprobs, version spans, text, reward."""
    from inference_shim.openai_protocol import VersionSpan
    from pipeline_rl.messages import RolloutGroup, Sample

    rng = random.Random(seed)
    group_id = f"0:{seed}"
    return RolloutGroup(
        group_id=group_id,
        task="arith",
        prompt_index=seed,
        actor_id=0,
        samples=[
            Sample(
                sample_id=f"{group_id}/{i}",
                prompt_token_ids=[rng.randrange(100) for _ in range(PROMPT_TOKENS)],
                completion_token_ids=[rng.randrange(100) for _ in range(tokens)],
                completion_logprobs=[-rng.random() * 5 for _ in range(tokens)],
                version_spans=[
                    VersionSpan(version=7, start=0, end=tokens // 2),
                    VersionSpan(version=8, start=tokens // 2, end=tokens),
                ],
                finish_reason="length",
                reward=float(rng.random() > 0.5),
                completion_text="".join(rng.choice("0123456789+= ") for _ in range(tokens)),
                server="http://127.0.0.1:8000",
            )
            for i in range(samples)
        ],
    )


def _messages_per_round(payload_bytes: int, quick: bool) -> int:
    # ~16 MB of payload per round (bounded), so small messages get enough repetitions to time.
    return 64 if quick else max(64, min(1024, 16_000_000 // payload_bytes))


class StreamPaths:
    """The two paths over one private Redis, each on its own fresh topic per round."""

    def __init__(self, redis_url: str) -> None:
        import redis

        from pipeline_rl.streams import StreamsConfig

        self.cfg = StreamsConfig(
            backend="redis", redis_url=redis_url, run_name=f"bench{uuid.uuid4().hex[:6]}"
        )
        self.raw = redis.Redis.from_url(redis_url)

    def stream_round(self, group, n: int, batch: int) -> float:
        """Seconds for n groups through Writer -> GroupReader -> ack, reading `batch` at a time."""
        from pipeline_rl.streams import make_reader, make_writer

        topic = f"r{uuid.uuid4().hex[:8]}"
        writer = make_writer(self.cfg, topic)
        reader = make_reader(self.cfg, topic, group="prep", consumer="prep0")
        reader.read(count=1, block_s=0)  # the reader's one-time look at its own pending entries
        start = time.perf_counter()
        done = 0
        while done < n:
            k = min(batch, n - done)
            for _ in range(k):
                writer.write(group)
            entries = reader.read(count=k, block_s=1.0)
            reader.ack([e.id for e in entries])
            done += len(entries)
        seconds = time.perf_counter() - start
        self.raw.delete(f"{self.cfg.run_name}:{topic}")
        return seconds

    def raw_round(self, payload: bytes, n: int, batch: int) -> float:
        """Seconds for n payloads through redis-py XADD -> XREADGROUP -> XACK, `batch` at a time."""
        key = f"{self.cfg.run_name}:raw{uuid.uuid4().hex[:8]}"
        self.raw.xgroup_create(key, "prep", id="0", mkstream=True)
        start = time.perf_counter()
        done = 0
        while done < n:
            k = min(batch, n - done)
            for _ in range(k):
                self.raw.xadd(key, {b"d": payload})
            reply = self.raw.xreadgroup("prep", "prep0", {key: ">"}, count=k, block=1000)
            ids = [entry_id for entry_id, _ in reply[0][1]]
            self.raw.xack(key, "prep", *ids)
            done += len(ids)
        seconds = time.perf_counter() - start
        self.raw.delete(key)
        return seconds


def _codec_us(group, repeats: int = 20) -> tuple[float, float]:
    """Median µs to encode (model_dump + msgpack) and to decode (msgpack + pydantic) one group."""
    import msgpack

    from pipeline_rl.messages import decode_message

    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = msgpack.packb(group.model_dump(mode="json"), use_bin_type=True)
        t1 = time.perf_counter()
        decode_message(msgpack.unpackb(payload, raw=False))
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return median(enc) * 1e6, median(dec) * 1e6


async def _generation_window(url: str, seconds: float) -> dict:
    ramp_s = min(2.0, seconds / 2)
    load = ClosedLoop(url, await served_model(url), GEN_CONCURRENCY, GEN_TOKENS, stream=False, ramp_s=ramp_s)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(1.5 * ramp_s)  # every worker has a request in flight, of mixed ages
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    t1 = time.monotonic()
    load.stop()
    await task
    done = load.completed_between(t0, t1)
    return {
        "samples": len(done),
        "seconds": t1 - t0,
        "per_sample_s": (t1 - t0) / len(done) if done else float("nan"),
        "latency_s": median([c.end - c.start for c in done]),
        "errors": len(load.errors),
    }


def run(ctx: BenchContext) -> dict:
    import msgpack

    from pipeline_rl.streams import RedisServer

    s = _settings(ctx)
    url = ctx.pool.urls(ctx.server("shim", bench_model(s["model"])), 1)[0]
    steal = StealMeter()
    groups = {p: rollout_group(*p) for p in s["payloads"]}
    payloads = {p: msgpack.packb(g.model_dump(mode="json"), use_bin_type=True) for p, g in groups.items()}
    times: dict[tuple, list[float]] = {}
    gen: list[dict] = []
    with RedisServer() as server:
        paths = StreamPaths(server.url)
        variants = [(path, mode) for path in ("stream", "raw") for mode in ("1 by 1", "batched")]
        for rep in range(ctx.repeats):
            ctx.log(f"streams: repeat {rep + 1}/{ctx.repeats}")
            gen.append(asyncio.run(_generation_window(url, s["window_s"])))
            for p in s["payloads"]:
                n = _messages_per_round(len(payloads[p]), ctx.quick)
                # The repeat's messages go in SLICES slices, the variants alternating within each, so
                # a burst of load from elsewhere on the machine hits every variant alike.
                spent = dict.fromkeys(variants, 0.0)
                for k in range(SLICES):
                    for path, mode in rotate(variants, rep + k):
                        batch = 1 if mode == "1 by 1" else BATCH
                        if path == "stream":
                            spent[(path, mode)] += paths.stream_round(groups[p], n // SLICES, batch)
                        else:
                            spent[(path, mode)] += paths.raw_round(payloads[p], n // SLICES, batch)
                for (path, mode), seconds in spent.items():
                    per_sample = seconds / (n // SLICES * SLICES) / p[0]
                    times.setdefault((p, path, mode), []).append(per_sample)
    per_sample_gen = median([g["per_sample_s"] for g in gen])
    rows, summary = [], []
    for p in s["payloads"]:
        enc, dec = _codec_us(groups[p])
        # Generation time grows ~linearly with completion length: scale the measured 64-token time.
        gen_for_p = per_sample_gen * p[1] / GEN_TOKENS
        for mode in ("1 by 1", "batched"):
            stream_us = median(times[(p, "stream", mode)]) * 1e6
            raw_us = median(times[(p, "raw", mode)]) * 1e6
            row = {
                "samples": p[0],
                "tokens": p[1],
                "kb_per_group": len(payloads[p]) / 1e3,
                "mode": mode,
                "stream_us": stream_us,
                "raw_us": raw_us,
                "of_gen": stream_us / 1e6 / gen_for_p,
                "gen_measured": p[1] == GEN_TOKENS,
            }
            summary.append(row)
            rows.append(
                [
                    f"{p[0]} x {p[1]}",
                    row["kb_per_group"],
                    mode,
                    stream_us,
                    raw_us,
                    f"{stream_us / raw_us:.1f}x",
                    (enc + dec) / p[0],
                    gen_for_p * 1e6,
                    f"{100 * row['of_gen']:.3f}%" + ("" if row["gen_measured"] else " (est.)"),
                ]
            )
    table = markdown_table(
        [
            "group (samples x tokens)",
            "KB / group",
            "read/ack",
            "stream µs / sample",
            "raw redis µs / sample",
            "stream / raw",
            "encode+decode µs / sample",
            "generation µs / sample",
            "stream / generation",
        ],
        rows,
    )
    matched = [r for r in summary if r["gen_measured"]]
    worst = max(matched, key=lambda r: r["of_gen"])
    goals = [
        goal_line(
            "stream overhead < 1% of per-sample generation time",
            worst["of_gen"] < 0.01,
            f"Worst measured case ({worst['samples']} x {worst['tokens']}, {worst['mode']}): "
            f"{worst['stream_us']:.0f} µs per sample = {100 * worst['of_gen']:.2f}% of "
            f"{per_sample_gen * 1e6:.0f} µs generation per sample. Each sample crosses two such hops in a "
            "run (rollouts, then training_data), so the pipeline's share is about twice this.",
        )
    ]
    intro = (
        f"Per-sample medians of {ctx.repeats} interleaved repeats, one process, private redis-server. "
        f"Generation per sample: model `{s['model']}`, {GEN_CONCURRENCY} concurrent requests of {GEN_TOKENS} "
        f"tokens, {s['window_s']:g} s windows taken between the stream rounds of the same run: "
        f"{per_sample_gen * 1e6:.0f} µs per sample (wall time / samples; median request latency "
        f"{median([g['latency_s'] for g in gen]) * 1000:.0f} ms). For longer completions the generation "
        "time is scaled linearly from the 64-token measurement (marked est.)."
    )
    markdown = section(ctx, "streams", intro, [table], goals, (), steal.percent())
    publish(ctx, "streams", markdown)
    data = {
        "summary": summary,
        "generation": gen,
        "settings": {**s, "payloads": [list(p) for p in s["payloads"]]},
    }
    ctx.save_json("streams", data)
    return data
