"""Partial rollouts in sync mode (actor.round_tokens): the arithmetic of a round, tested without servers.

A sync round generates with one weight version and then waits for the trainer's step. With a token cap
per round, no request of a round asks for more than `round_tokens` tokens; an answer cut there is
carried (the `carried` topic) and continued in the next round from its exact token ids, with the new
weights, until it ends or reaches actor.max_tokens. So a round never waits for the longest answer of a
step, only for `round_tokens` of it (verl's partial rollouts). docs/actor.md, "Partial rollouts".

The round's rule (Actor._run_rounds), with G = groups per optimizer step and B = actor.max_buffered_groups:
  - the groups carried from the previous round continue first;
  - a new group starts while the groups written and not yet consumed, in flight, and cut this round
    are fewer than B (so at most B groups are ever started and not consumed, as without a cap);
  - the round ends when nothing is in flight and no new group may start; if G groups then wait for
    the trainer, the actor waits for the version that step publishes, else the next round starts at
    once with the same weights (the trainer still lacks a batch).
With B > G a round has more answers than a step needs, so it does not wait for its long ones: they
continue in the next round, on the next version. Lag: a sample that ran in k rounds spans at most k
versions; once written, at most B - 1 groups are ahead of it, so it trains within ceil(B / G) steps:
lag <= k - 2 + ceil(B / G) (k - 1 with B = G). The launcher sets actor.max_lag from the longest k,
ceil(max_tokens / round_tokens) (max_rounds, lag_bound).
"""

from __future__ import annotations

import math

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.messages import PartialSample


def max_rounds(max_tokens: int, round_tokens: int) -> int:
    """The most rounds one answer can run in: each round adds at least one token until max_tokens, and
    a cut answer got exactly round_tokens that round."""
    return math.ceil(max_tokens / round_tokens)


def segment_tokens(sample: PartialSample, max_tokens: int, round_tokens: int, max_model_len: int) -> int:
    """How many tokens this round's request for `sample` may ask for (0: it cannot grow any more)."""
    room = max_model_len - len(sample.prompt_token_ids) - len(sample.token_ids)
    return max(0, min(round_tokens, max_tokens - len(sample.token_ids), room))


def extend(
    sample: PartialSample,
    token_ids: list[int],
    logprobs: list[float],
    spans: list[VersionSpan],
    text: str,
    finish_reason: str,
    server: str,
    asked: int,
    max_tokens: int,
    max_model_len: int,
) -> None:
    """Append one request's output to `sample`; it stays unfinished (finish_reason None) only when the
    round's cap cut it: the engine stopped for length after exactly `asked` tokens and the answer may
    still grow."""
    offset = len(sample.token_ids)
    sample.token_ids += token_ids
    sample.logprobs += logprobs
    sample.version_spans = merge_spans(
        sample.version_spans,
        [VersionSpan(version=s.version, start=s.start + offset, end=s.end + offset) for s in spans],
    )
    sample.text += text
    sample.server = server
    sample.segments += 1
    cut = finish_reason == "length" and len(token_ids) >= asked
    may_grow = segment_tokens(sample, max_tokens, 1, max_model_len) > 0
    sample.finish_reason = None if cut and may_grow else finish_reason


def merge_spans(first: list[VersionSpan], then: list[VersionSpan]) -> list[VersionSpan]:
    """`first` followed by `then`, a span continuing the same version across the seam made one."""
    out = [s.model_copy() for s in first]
    for span in then:
        if out and out[-1].version == span.version and out[-1].end == span.start:
            out[-1] = VersionSpan(version=span.version, start=out[-1].start, end=span.end)
        else:
            out.append(span.model_copy())
    return out


def lag_bound(max_tokens: int, round_tokens: int, groups_per_step: int, max_buffered_groups: int) -> int:
    """The most versions a sample can be behind when trained (module docstring)."""
    steps_waiting = math.ceil(max_buffered_groups / groups_per_step)
    return max(0, max_rounds(max_tokens, round_tokens) - 2 + steps_waiting)


def may_start_new(in_flight: int, cut: int, waiting: int, max_buffered_groups: int) -> bool:
    """Whether a round may start one more new group: `in_flight` groups generating now, `cut` groups
    this round carried already, `waiting` groups written and not yet consumed by the trainer."""
    return waiting + in_flight + cut < max_buffered_groups
