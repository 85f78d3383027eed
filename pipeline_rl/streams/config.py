"""Configuration and naming rules of the streams layer.

`StreamsConfig` is the typed config block (`streams:` in the YAML). Topic and group names are checked
here once, because the files backend turns them into paths and Redis into keys.

    cfg = StreamsConfig(backend="redis", redis_url="redis://:PASSWORD@127.0.0.1:6390/0", run_name="exp1")
    cfg = StreamsConfig(backend="files", files_dir="runs/exp1/streams")

A Redis URL may carry a password; print or log it only through `redact_url`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Topic names used by the pipeline (see pipeline_rl/messages.py for what travels on each).
ROLLOUTS = "rollouts"
TRAINING_DATA = "training_data"
TRAINER_EVENTS = "trainer_events"
STATS = "stats"
DEAD_LETTER = "dead_letter"
CARRIED = "carried"
CARRY_GROUP = "carry"  # the consumer group of `carried`: the actor that continues a cut group

_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.@:-]*"
_TOPIC_RE = re.compile(rf"{_NAME}(/{_NAME})*")
_NAME_RE = re.compile(_NAME)


def redact_url(url: str, mask: str = "***") -> str:
    """`url` with its password replaced by `mask` (mask "": user and password removed), for logs and
    messages; a URL without a password comes back unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    userinfo = f"{parts.username or ''}:{mask}@" if mask else ""
    return urlunsplit(parts._replace(netloc=userinfo + host))


def training_partition(rank: int) -> str:
    """Topic of trainer rank `rank`'s partition of the training data, e.g. 'training_data/0'."""
    if rank < 0:
        raise ValueError(f"trainer rank must be >= 0, got {rank}")
    return f"{TRAINING_DATA}/{rank}"


def check_topic(topic: str) -> str:
    """Return `topic` if it is a valid topic name ('name' or 'name/partition'), else raise ValueError."""
    # The files backend maps topics to directories: no '..', no absolute paths, no hidden names.
    if not _TOPIC_RE.fullmatch(topic):
        raise ValueError(
            f"invalid topic name {topic!r}: use letters, digits and _.@:- in '/'-separated parts "
            "that do not start with '.', e.g. 'rollouts' or 'training_data/0'"
        )
    return topic


def check_name(name: str, what: str = "name") -> str:
    """Return `name` if it is a valid group/consumer/run name, else raise ValueError."""
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid {what} {name!r}: use letters, digits and _.@:- (not starting with '.')")
    return name


class StreamsConfig(BaseModel):
    """Where the streams live and how they behave. One instance is shared by every process of a run."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["redis", "files"] = Field(
        default="redis", description="'redis' (Redis streams) or 'files' (JSONL segments, no server needed)."
    )
    redis_url: str | None = Field(
        default=None,
        description="e.g. 'redis://:PASSWORD@127.0.0.1:6390/0'. Unset: the launcher starts a private "
        "redis-server with a generated password.",
    )
    redis_bind: str = Field(
        default="127.0.0.1",
        description="Address the launcher's private redis-server listens on; this node's cluster address "
        "only when processes on other nodes use it.",
    )
    files_dir: Path | None = Field(
        default=None, description="Root directory of the files backend; required when backend='files'."
    )
    run_name: str = Field(
        default="default",
        description="Namespace of every key/directory, so several runs can share one Redis or directory.",
    )
    trim_keep_last: int = Field(
        default=1000,
        ge=0,
        description="Trimming always keeps at least this many newest entries of a topic (latest(), debugging).",
    )
    trim_every: int = Field(
        default=1000,
        ge=0,
        description="A writer trims its topic after every this many writes; 0 = only on explicit trim().",
    )
    retry_deadline_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a Redis call retries a lost connection (backoff), or a file lock is awaited.",
    )
    op_timeout_s: float = Field(
        default=30.0,
        gt=1,
        description="Socket timeout of one Redis call; blocking reads must ask for less than this.",
    )
    claim_idle_s: float | None = Field(
        default=60.0,
        gt=0,
        description="Group readers take over entries another consumer left unacked this long; None = never.",
    )
    claim_every_s: float = Field(
        default=5.0, ge=0, description="How often a group reader looks for idle entries to take over."
    )
    segment_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1,
        description="Files backend: start a new segment file once the current one is this big.",
    )
    files_fsync: bool = Field(
        default=True,
        description="Files backend: fsync appended data and group state (acks) before returning.",
    )
    poll_interval_s: float = Field(
        default=0.02, gt=0, description="Files backend: how often a blocking read looks for new lines."
    )

    @model_validator(mode="after")
    def _check(self) -> StreamsConfig:
        check_name(self.run_name, "streams.run_name")
        if self.backend == "files" and self.files_dir is None:
            raise ValueError(
                "streams.backend='files' needs streams.files_dir (a directory for the JSONL files)"
            )
        return self
