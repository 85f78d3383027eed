"""Client-side load for the generation benchmarks: closed-loop workers against an OpenAI-style server,
with every token's arrival time recorded where the client sees it.

    load = ClosedLoop(url, model, concurrency=32, max_tokens=64, stream=True)
    task = asyncio.create_task(load.run())
    ... windows ...
    load.stop(); await task
    load.tokens_between(t0, t1); load.gaps_between(t0, t1); load.latencies_between(t0, t1)

Each worker re-issues a chat completion as soon as its previous one finished (ignore_eos and a fixed
max_tokens, so every request costs the engine the same). Streaming requests record one event per SSE
chunk that carries tokens; an inter-token gap is the time between two such chunks of one request
(time to first token is not a gap: that is queueing and prefill). Times are time.monotonic(), which
is shared by every process on the machine, so windows can be cut by times taken in another process.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common import median, percentile
from inference_shim.client import AsyncShimClient, ShimError


def prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct short arithmetic prompts (the demo task's flavour), the same for every server."""
    rng = random.Random(seed)
    return [f"Compute {rng.randint(10, 999)}+{rng.randint(10, 999)} and show the steps." for _ in range(n)]


@dataclass
class Completed:
    start: float
    end: float
    tokens: int


@dataclass
class ClosedLoop:
    url: str
    model: str
    concurrency: int
    max_tokens: int = 64
    stream: bool = True
    temperature: float = 1.0
    n: int = 1  # completions per request (the actor asks for a whole group at once: n = group size)
    logprobs: bool = True
    seed: int = 0
    # Worker i sends its first request ramp_s * i / concurrency after start. With ignore_eos and a fixed
    # max_tokens, requests admitted together finish together forever after; spreading the starts gives
    # the steady mix of request ages a real actor produces, instead of cohorts that make throughput
    # over a window jump by a whole cohort's tokens.
    ramp_s: float = 0.0
    # Recorded by run(): token-carrying chunk arrivals (time, tokens), gaps (time of the later chunk,
    # gap seconds), finished requests, errors.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    gap_times: list[float] = field(default_factory=list)
    gap_values: list[float] = field(default_factory=list)
    completed: list[Completed] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._prompts = prompts(256, self.seed)
        self._issued = 0

    def stop(self) -> None:
        self._stop.set()

    def _request(self) -> tuple[list[dict], dict]:
        """The next request: (messages, sampling parameters)."""
        prompt = self._prompts[self._issued % len(self._prompts)]
        self._issued += 1
        params = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": self.temperature,
            "logprobs": self.logprobs,
        }
        if self.n > 1:
            params["n"] = self.n
        return [{"role": "user", "content": prompt}], params

    async def run(self) -> None:
        client = AsyncShimClient(self.url, timeout_s=600.0)
        try:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.concurrency)))
        finally:
            await client.aclose()

    async def _worker(self, client: AsyncShimClient, index: int) -> None:
        await asyncio.sleep(self.ramp_s * index / self.concurrency)
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                tokens = await (self._streamed(client) if self.stream else self._plain(client))
            except (httpx.HTTPError, ShimError, ValueError) as e:
                cause = e.__cause__ or e.__context__
                detail = f" (from {type(cause).__name__}: {cause})" if cause else ""
                self.errors.append(f"{type(e).__name__}: {e}{detail} after {time.monotonic() - start:.2f} s")
                await asyncio.sleep(0.1)
                continue
            self.completed.append(Completed(start, time.monotonic(), tokens))

    async def _plain(self, client: AsyncShimClient) -> int:
        messages, params = self._request()
        response = await client.chat(messages, **params)
        if response.usage is None:
            raise ValueError("the response has no usage")
        return response.usage.completion_tokens

    async def _streamed(self, client: AsyncShimClient) -> int:
        total, last = 0, None
        messages, params = self._request()
        async for chunk in client.chat_stream(messages, **params):
            now = time.monotonic()
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            # The shim sends token_ids per chunk; a server without them sends one token per chunk.
            n = len(choice.token_ids or ()) or (1 if choice.delta.content else 0)
            if n == 0:
                continue
            self.chunk_times.append(now)
            self.chunk_tokens.append(n)
            if last is not None:
                self.gap_times.append(now)
                self.gap_values.append(now - last)
            last = now
            total += n
        return total

    # ------------------------------------------------------------------ windows
    def tokens_between(self, t0: float, t1: float) -> int:
        """Tokens that arrived at the client in [t0, t1) (streaming) or in requests finished then."""
        if self.stream:
            lo, hi = bisect.bisect_left(self.chunk_times, t0), bisect.bisect_left(self.chunk_times, t1)
            return sum(self.chunk_tokens[lo:hi])
        return sum(c.tokens for c in self.completed if t0 <= c.end < t1)

    def gaps_between(self, t0: float, t1: float) -> list[float]:
        lo, hi = bisect.bisect_left(self.gap_times, t0), bisect.bisect_left(self.gap_times, t1)
        return self.gap_values[lo:hi]

    def completed_between(self, t0: float, t1: float) -> list[Completed]:
        return [c for c in self.completed if t0 <= c.end < t1]

    def tokens_per_bin(self, t0: float, t1: float, bin_s: float) -> list[tuple[float, float]]:
        """(bin start - t0, tokens/s) over [t0, t1): for timeline plots."""
        bins = []
        t = t0
        while t < t1:
            bins.append((t - t0, self.tokens_between(t, min(t + bin_s, t1)) / bin_s))
            t += bin_s
        return bins


async def closed_loop_window(
    url: str, model: str, concurrency: int, seconds: float, *, max_tokens: int, ramp_s: float, n: int = 1
) -> dict:
    """Closed-loop non-streaming load (`concurrency` requests of `n` completions each) for `seconds` after
    a ramp; requests that finish inside the window count."""
    load = ClosedLoop(url, model, concurrency, max_tokens, stream=False, ramp_s=ramp_s, n=n)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(ramp_s * 1.5)  # every worker is in its loop and the batch has mixed ages
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    t1 = time.monotonic()
    load.stop()
    await task  # outstanding requests finish before the next window starts
    done = load.completed_between(t0, t1)
    latencies = [c.end - c.start for c in done]
    return {
        "requests": len(done),
        "tokens_per_s": sum(c.tokens for c in done) / (t1 - t0),
        "latency_p50": median(latencies),
        "latency_p99": percentile(latencies, 99),
        "errors": load.errors[:5],
        "error_count": len(load.errors),
    }


async def served_model(url: str) -> str:
    client = AsyncShimClient(url)
    try:
        return (await client.models())[0]
    finally:
        await client.aclose()
