"""Typed messages that travel on the streams (Redis or files). Torch-free: actor, preprocessor,
trainer and tools all import it.

Every message has a `kind` literal, so a reader can decode any topic with one discriminated union
(`decode_message`) and send anything it does not recognise to the dead-letter topic.

Topics (see pipeline_rl/streams):
  rollouts            RolloutGroup        actor -> preprocessor
  training_data/<r>   TrainingPackage     preprocessor -> trainer rank r (one partition per rank)
  trainer_events      WeightVersionEvent  trainer -> actors (lag control), launcher (progress)
                      PreprocessorProgress preprocessors -> actors (groups dropped count as consumed)
  stats               StatsRecord         everyone -> launcher / plots
                      CompletionSample    actors -> launcher (the trackers' tables; tracking on only)
  dead_letter         DeadLetter          any consumer that met a message it could not decode
  carried             CarriedGroup        actor -> itself (sync partial rollouts: a group whose answers
                                          a round cut, continued in the next round)
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from inference_shim.openai_protocol import VersionSpan


class Sample(BaseModel):
    """One completion of a prompt, exactly as the server produced it (token ids, not re-tokenized text)."""

    sample_id: str = Field(
        description="'<group_id>/<index>': unique over the whole run, across restarts (the ledger's key)."
    )
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float] = Field(description="Sampler logprob of each completion token.")
    version_spans: list[VersionSpan] = Field(description="Which weight version produced which tokens.")
    finish_reason: str
    reward: float
    completion_text: str = ""
    server: str = ""
    completion_mask: list[int] | None = Field(
        default=None,
        description="Multi-turn episodes: 1 for a token the model sampled, 0 for one the environment added "
        "between turns (trained on: the model's only). None: every completion token is the model's.",
    )

    def token_versions(self) -> list[int]:
        """Per-token weight version, expanded from the spans (-1 where no span covers a token: the
        environment's tokens of a multi-turn episode)."""
        versions = [-1] * len(self.completion_token_ids)
        for span in self.version_spans:
            for i in range(span.start, span.end):
                versions[i] = span.version
        return versions


class RolloutGroup(BaseModel):
    """All `attempts` samples of one prompt (a GRPO group). Written only when complete."""

    kind: Literal["rollout_group"] = "rollout_group"
    group_id: str = Field(
        description="'<actor_id>-<incarnation>:<prompt_index>': a restarted actor starts its prompts at 0 "
        "again, so the incarnation (random, per process start) keeps ids unique across restarts."
    )
    task: str
    prompt_index: int
    actor_id: int
    incarnation: str = Field("", description="The writing actor process's start nonce (in group_id too).")
    samples: list[Sample]
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)


class PartialSample(BaseModel):
    """One answer of a carried group as far as it got: what the server sampled so far, exactly."""

    prompt_token_ids: list[int]
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    version_spans: list[VersionSpan] = Field(default_factory=list)
    text: str = ""
    server: str = ""
    finish_reason: str | None = Field(None, description="None while unfinished.")
    segments: int = Field(0, description="Rounds it ran in.")
    episode: dict[str, Any] | None = Field(
        None, description="Multi-turn tasks: the episode so far (pipeline_rl.actor.episode.Episode.to_dict)."
    )


class CarriedGroup(BaseModel):
    """A group a sync round with partial rollouts cut (actor.round_tokens): on the `carried` topic until
    the next round continues it, so a killed actor's successor picks it up (docs/actor.md)."""

    kind: Literal["carried_group"] = "carried_group"
    group_id: str
    problem: dict[str, Any] = Field(description="The tasks.Problem it answers, as data.")
    start_version: int
    started_at: float
    rounds: int = Field(description="Rounds it has run in so far.")
    samples: list[PartialSample]
    created_at: float = Field(default_factory=time.time)

    def sample_ids(self) -> list[str]:
        """The ids its samples get when written (the actor's '<group_id>/<index>')."""
        return [f"{self.group_id}/{i}" for i in range(len(self.samples))]


class TrainingSample(BaseModel):
    """One sequence ready for the trainer: prompt + completion tokens with per-token training fields."""

    kind: Literal["training_sample"] = "training_sample"
    sample_id: str
    group_id: str
    input_ids: list[int]
    labels_mask: list[int] = Field(description="1 for completion tokens that are trained on, else 0.")
    advantages: list[float] = Field(description="Per token (0 where labels_mask is 0).")
    old_logprobs: list[float] = Field(description="Sampler logprob per token (0 where labels_mask is 0).")
    ref_logprobs: list[float] | None = None
    token_versions: list[int] = Field(description="Weight version that produced each token (-1 on prompt).")
    reward: float
    group_reward_mean: float = 0.0
    completion_length: int = 0
    finish_reason: str = ""
    created_at: float = Field(default_factory=time.time)


class WeightVersionEvent(BaseModel):
    """Published by trainer rank 0 after every optimizer step whose weights reached every server."""

    kind: Literal["weight_version"] = "weight_version"
    version: int
    step: int
    samples_consumed: int = Field(description="Training samples consumed in total (all ranks) so far.")
    groups_consumed: int = 0
    servers: list[str] | None = Field(
        default=None,
        description="The servers this version was pushed to (the weight group); actors send requests only "
        "to these. None: not said (every server).",
    )
    time: float = Field(default_factory=time.time)


class TrainingPackage(BaseModel):
    """One trainer rank's share of one optimizer step, written by a preprocessor to training_data/<rank>.

    Every package of a batch (one per rank) carries the same batch_id; ranks agree on which batch_id to
    train next (rank 0 decides), so packages from several preprocessors may interleave in a partition.
    """

    kind: Literal["training_package"] = "training_package"
    batch_id: str = Field(description="'<preprocessor_id>:<sequence>': the same on every rank's package.")
    rank: int
    num_ranks: int
    micro_batches: list[list[TrainingSample]] = Field(description="Packed; padding micro-batches allowed.")
    batch_samples: int = Field(description="Real (non-padding) samples in the whole batch, all ranks.")
    batch_tokens: int = Field(description="Trained (masked-in) tokens in the whole batch, all ranks.")
    batch_groups: int = Field(description="Groups in the whole batch, all ranks.")
    group_ids: list[str] = Field(
        default_factory=list,
        description="Every group of the whole batch (all ranks): a restarted preprocessor skips these.",
    )
    entry_ids: list[str] = Field(
        default_factory=list,
        description="The rollouts entry id of each group in group_ids (same order): a restarted "
        "preprocessor tells a redelivered entry (same id: acked silently) from a duplicate (counted).",
    )
    created_at: float = Field(default_factory=time.time)


class PreprocessorProgress(BaseModel):
    """Published on trainer_events by each preprocessor, and by each worker of a user stage of the graph
    (under id `<stage><index>`): totals since the run started.

    Actors count consumed groups as (groups trained) + (groups dropped here), so dropped groups
    (e.g. DAPO dynamic sampling) never leave the actors waiting for a backlog that cannot drain.
    """

    kind: Literal["preprocessor_progress"] = "preprocessor_progress"
    preprocessor_id: str
    groups_in: int
    groups_dropped: int
    samples_out: int
    samples_dropped: int = Field(
        0,
        description="Samples dropped from groups that went on (a filter's or the preprocessor's single "
        "drops): a step then takes more groups, which the actors' lag limit counts (actor/gate.py).",
    )
    time: float = Field(default_factory=time.time)


class StatsRecord(BaseModel):
    kind: Literal["stats"] = "stats"
    source: str = Field(description="e.g. 'actor0', 'trainer', 'preprocessor0'.")
    values: dict[str, float | int | str | None]
    time: float = Field(default_factory=time.time)


class CompletionSample(BaseModel):
    """A completion an actor shares for the trackers' tables of sampled completions (on the stats stream;
    a few per tracking.samples_every_steps trainer steps, only when tracking is on)."""

    kind: Literal["completion_sample"] = "completion_sample"
    source: str = Field(description="e.g. 'actor0'.")
    step: int = Field(description="The trainer's latest version when the group was written.")
    prompt: str
    completion: str
    reward: float
    grade: str | None = None
    weight_versions: list[int] = Field(description="The weight versions that produced its tokens.")
    time: float = Field(default_factory=time.time)


class DeadLetter(BaseModel):
    kind: Literal["dead_letter"] = "dead_letter"
    topic: str
    stream_id: str
    error: str
    raw: str = Field(description="The undecodable payload (truncated), for a person to look at.")
    time: float = Field(default_factory=time.time)


Message = Annotated[
    RolloutGroup
    | TrainingSample
    | TrainingPackage
    | WeightVersionEvent
    | PreprocessorProgress
    | StatsRecord
    | CompletionSample
    | DeadLetter
    | CarriedGroup,
    Field(discriminator="kind"),
]
_message_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def decode_message(data: dict[str, Any]) -> Message:
    """Validate a decoded payload into its typed message; raises pydantic.ValidationError if malformed."""
    return _message_adapter.validate_python(data)
