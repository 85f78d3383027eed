"""The typed run configuration: one RunConfig, validated once at startup, passed to every process.

The launcher composes pipeline_rl/conf/*.yaml with command-line overrides (pipeline_rl/launch/compose.py), validates the result
into RunConfig, fills in what only it knows (server URLs, run directory), and writes it to
<run_dir>/config.json. Every child process reads that file with `load_run_config` and never sees a raw
dict. Sections owned by other modules (streams, task, reward, algo, preprocess) are imported here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline_rl.algo_config import AlgoConfig
from pipeline_rl.preprocess.ops import PreprocessConfig
from pipeline_rl.stages.graph import GraphConfig, StagePlacement, graph_problems
from pipeline_rl.streams import StreamsConfig
from pipeline_rl.streams.config import redact_url
from pipeline_rl.tasks import RewardConfig, TaskConfig
from pipeline_rl.tracking.config import TrackingConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InferenceConfig(_Section):
    """Inference servers the launcher starts (or points at)."""

    backend: Literal["vllm", "sglang", "torch"] = Field(
        "vllm",
        description="Engine behind the shim; nothing else changes (torch: plain torch + transformers, "
        "fastest for tiny models on CPU).",
    )
    num_servers: int = Field(1, ge=1, description="Servers to start (one engine each).")
    urls: list[str] = Field(
        default_factory=list, description="Filled by the launcher; set to use running servers."
    )
    token: str | None = Field(
        None, description="Bearer token for control routes (launcher makes one if unset)."
    )
    api_key: str | None = Field(
        None,
        description="Bearer key for the servers' /v1/* (generation) routes. Unset: $PIPELINE_RL_API_KEY, "
        "else the launcher makes one per run when any server binds off loopback (kept in secrets/); on "
        "loopback only, /v1/* stays open so the servers answer plain curl.",
    )
    dtype: str = Field("float32", description="Engine weight dtype: float32 on CPU, bfloat16 on GPU.")
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="Longest prompt + completion per sequence; unset: the checkpoint's own (config.json).",
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded at once per server.")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="GPU only: share of each server's GPU memory vLLM may take (weights, activations, KV cache); "
        "lower it where a server shares its GPU with trainer ranks (placement.colocate).",
    )
    kv_after_update: Literal["recompute", "keep"] | None = Field(
        None,
        description="KV of in-flight requests after an update: keep (PipelineRL's) or recompute with the new "
        "weights. Unset: keep when mode=pipeline (docs/decisions.md, 'KV after an update'), recompute when mode=sync, where no "
        "request is in flight at an update.",
    )
    update_mode: Literal["inflight", "drain"] = Field(
        "inflight",
        description="How a server takes an update: inflight (applied between two decode steps; running "
        "requests continue on the new weights) or drain (received into staging while the server finishes "
        "its running requests on the old weights, then applied: no response mixes versions; docs/engines.md, "
        "'Drain-then-swap').",
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="update_mode=drain: the longest a server waits for its turn to drain (servers drain one at "
        "a time), and then for its running requests, before it ends the rest (their clients retry "
        "elsewhere) and applies.",
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="Deadline for a server to become healthy.")
    weight_transport: Literal["gloo", "nccl"] = Field("gloo", description="gloo on CPU, nccl on GPU.")


class ActorConfig(_Section):
    """Rollout generation: GRPO groups, sampling, lag control, routing."""

    num_actors: int = Field(1, ge=1, description="Actor processes, each on its own shard of the prompts.")
    attempts: int = Field(8, ge=1, description="Samples per prompt (one GRPO group).")
    max_tokens: int = Field(32, ge=1, description="Completion token limit per sample.")
    temperature: float = Field(
        1.0, ge=0.0, description="Sampling temperature (logprobs are at temperature 1)."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    max_lag: int = Field(4, ge=0, description="Most weight versions a sample may be behind when trained on.")
    max_buffered_groups: int = Field(
        64, ge=1, description="Most groups started (in flight or written) but not consumed."
    )
    max_in_flight_per_server: int = Field(64, ge=1, description="Concurrent requests per server.")
    request_timeout_s: float = Field(120.0, gt=0, description="Deadline of one generation request.")
    all_servers_down_deadline_s: float = Field(
        60.0, gt=0, description="Wait this long for any server, then exit."
    )
    stats_interval_s: float = Field(5.0, gt=0, description="Seconds between stats records.")
    seed: int = Field(
        0, description="Seed of the prompt stream, shared by all actors so their shards stay disjoint."
    )
    request_mode: Literal["n", "per_sample"] = Field(
        "n", description="One request with n=attempts per group, or one request per sample."
    )
    seed_requests: bool = Field(
        True,
        description="Send every request a sampling seed derived from the run's `seed`, the prompt and the "
        "sample: the same weights then sample the same tokens (false: the engine's own random stream).",
    )
    request_retries: int = Field(
        5, ge=0, description="Retries of one failed request on other servers before the actor exits."
    )
    health_probe_interval_s: float = Field(
        2.0, gt=0, description="How often an unhealthy server's /health is probed again."
    )
    trainer_wait_deadline_s: float = Field(
        900.0, gt=0, description="Longest lag/buffer wait without trainer progress before the actor exits."
    )
    round_tokens: int | None = Field(
        None,
        ge=1,
        description="mode=sync only: partial rollouts. Each round generates at most this many tokens per "
        "response; unfinished responses are carried to the next round and continued from their tokens with "
        "the new weights (docs/actor.md, 'Partial rollouts'). Unset: every round runs its answers to the end.",
    )


# The projections of the transformer blocks (Llama, Qwen2/3, Mistral, Gemma names) that vLLM serves
# adapters on: every linear layer of attention and MLP (docs/lora.md, "Targets").
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Section):
    """LoRA: train only a low-rank adapter (peft) and push only the adapter to the servers."""

    rank: int = Field(8, ge=1, le=512, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Names of the linear layers that get an adapter (the last part of the module name).",
    )


class TrainerConfig(_Section):
    """The learner: strategy, optimizer, batch, checkpoints, weight push."""

    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter instead of every weight (trainer.lora.rank=16 ... turns it on; "
        "docs/lora.md). Unset: full fine-tuning.",
    )

    strategy: Literal["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"] = Field(
        "ddp", description="ddp (gloo) on CPU; deepspeed_zero2/3 on CPU or GPU; fsdp on GPU."
    )
    num_processes: int = Field(1, ge=1, description="Trainer ranks (one partition of training_data each).")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup steps.")
    batch_size: int = Field(32, ge=1, description="Samples per optimizer step, over all ranks.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to run.")
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N steps (0 = no step cadence).")
    checkpoint_every_s: float = Field(
        300.0, ge=0, description="Checkpoint once this many seconds passed since the last one (0 = off)."
    )
    snapshot_every_s: float = Field(
        0.0,
        ge=0,
        description="Save the weights (Hugging Face format, or the peft adapter with trainer.lora; no "
        "optimizer) to run_dir/snapshots once this "
        "many seconds passed since the last one, for evaluating them after the run (0 = off).",
    )
    resume: bool = Field(
        False, description="Continue from the newest checkpoint that verifies (older ones are fallbacks)."
    )
    keep_checkpoints: int = Field(
        2,
        ge=2,
        description="Newest verified checkpoints kept (>= 2: one to fall back to); older are deleted.",
    )
    micro_batch_layout: Literal["padded", "packed", "shared_prefix"] = Field(
        "padded",
        description="How the model sees a packed micro-batch: right-padded rows with an attention mask; "
        "one packed row (attention over all its token pairs with sdpa; 4-7x slower on CPU); or one row per "
        "group of samples with the same prompt, the prompt computed once (the preprocessor then packs each "
        "group whole into one micro-batch; for long prompts and short answers; sdpa or eager attention). "
        "docs/trainer.md, 'Micro-batch layout'.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block's activations in the backward pass instead of keeping "
        "them: far less activation memory (what a 7B model on 80 GB GPUs needs) for about a third more compute.",
    )
    mixed_precision: Literal["no", "bf16"] = Field(
        "no",
        description="bf16: forward passes under torch.autocast(bfloat16); weights, gradients, optimizer "
        "state and the loss stay float32 (what accelerate and TRL call bf16 mixed precision).",
    )
    bucket_mb: int = Field(256, ge=1, description="Weight-broadcast bucket size in MiB.")
    push_timeout_s: float = Field(120.0, gt=0, description="Deadline of one weight push.")
    push_settle: Literal["background", "wait"] | None = Field(
        None,
        description="background: the trainer goes on once a push's bytes are sent, while the servers "
        "load and swap the new weights; a thread waits for their results, ejects a server that failed "
        "and then announces the version. wait: the trainer waits for every server's "
        "result after each push. Unset: background when mode=pipeline, wait when mode=sync (whose "
        "generation must start on the new weights).",
    )
    eject_failed_servers: bool = Field(
        True,
        description="A server that dies or stalls during a push leaves the weight group and the push goes on "
        "with the others; it rejoins (and gets the current weights) once it answers again. False: the "
        "trainer stops on a failed push.",
    )
    rejoin_check_s: float = Field(
        2.0, gt=0, description="How often (at step boundaries) rank 0 looks for servers to (re)admit."
    )
    weight_address: str = Field(
        "127.0.0.1",
        description="Address rank 0's weight-group store and gloo/NCCL rank listen on (set by --cluster: "
        "the trainer host's address, which the servers must reach).",
    )
    data_timeout_s: float = Field(600.0, gt=0, description="Deadline to receive the data of one step.")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by this (match the sampler).")
    seed: int = Field(0, description="Trainer seed.")


class EvalConfig(_Section):
    """Held-out accuracy (greedy) measured by the launcher before and after RL."""

    num_problems: int = Field(200, ge=1, description="Test problems per evaluation.")
    max_tokens: int | None = Field(
        None, ge=1, description="Completion limit during evaluation; unset: actor.max_tokens."
    )
    every_s: float = Field(0.0, ge=0, description="Also evaluate every N seconds during the run (0 = off).")


class PlacementConfig(_Section):
    """Which GPUs and cores each process of this node gets (the map is printed at start)."""

    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of this node; unset: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`."
    )
    colocate: bool = Field(
        False,
        description="Servers share the trainer's resources: on GPU they may wrap onto the trainer ranks' "
        "GPUs when there are too few for one each; on CPU the trainer and every server get all the "
        "node's cores (for mode=sync, where only one of them works at a time).",
    )
    pin_whole_server: bool = Field(
        False,
        description="On CPU, run every process of a vLLM server on its cores (taskset). Default: only "
        "the engine's worker, which does the model's compute, is bound to them (VLLM_CPU_OMP_THREADS_BIND); "
        "the server's HTTP and scheduler processes float over the node's cores like actors and "
        "preprocessors, and use the trainer's core while it waits.",
    )
    stages: dict[str, StagePlacement] = Field(
        default_factory=dict,
        description="Where each stage of a user-added kind (filter, map, score, reference) runs: "
        "{replicas: N} worker processes of its own, or {inside: <stage>} inside that stage's process. The "
        "builtin stages run where their sections say (actor.num_actors, num_preprocessors, trainer).",
    )


class RestartPolicy(_Section):
    """How the launcher restarts one process of a restartable role after it dies."""

    max_restarts: int = Field(
        3, ge=0, description="Restarts allowed per process over the run; the next death stops the run."
    )
    backoff_s: float = Field(
        1.0, ge=0, description="Wait before the first restart; doubles with each restart."
    )
    max_backoff_s: float = Field(30.0, ge=0, description="Cap of the doubling wait between restarts.")


class SupervisionConfig(_Section):
    """What the launcher does when a process dies, and how long each stage of the shutdown may take.

    Every role is restarted under its policy: a server comes back with --await-weights and rejoins the
    weight group at the trainer's next step boundary; the trainer resumes from its newest checkpoint (on
    one host: trainer ranks spread over several hosts are not restarted, their death stops the run).
    """

    server: RestartPolicy = Field(
        default_factory=RestartPolicy, description="Restart policy of each inference server."
    )
    trainer: RestartPolicy = Field(
        default_factory=RestartPolicy,
        description="Restart policy of the trainer (all its ranks; resumes from the newest checkpoint).",
    )
    actor: RestartPolicy = Field(default_factory=RestartPolicy, description="Restart policy of each actor.")
    preprocessor: RestartPolicy = Field(
        default_factory=RestartPolicy, description="Restart policy of each preprocessor."
    )
    stage: RestartPolicy = Field(
        default_factory=RestartPolicy,
        description="Restart policy of each worker of a user stage (placement.stages.<name>.replicas).",
    )
    redis: RestartPolicy = Field(
        default_factory=RestartPolicy, description="Restart policy of the launcher's private Redis."
    )
    stop_grace_s: float = Field(
        10.0, gt=0, description="Shutdown: SIGTERM-to-SIGKILL deadline of the actors, preprocessors, servers."
    )
    trainer_stop_s: float = Field(
        180.0, gt=0, description="Shutdown: time the trainer gets to finish its step and checkpoint."
    )


class RunConfig(_Section):
    """Everything one run needs. Written to <run_dir>/config.json by the launcher."""

    run_dir: str = Field("runs/latest", description="Where configs, logs, checkpoints and plots go.")
    model_path: str = Field(description="Hugging Face checkpoint directory to train (required).")
    platform: Literal["cpu", "gpu"] = Field(
        "cpu",
        description="Set by the platform group (platform=cpu|gpu|auto): gpu gives NCCL and bfloat16 engines; cpu "
        "also gives every process the CPU engine environment (a bounded KV cache, loopback addresses, offline hub).",
    )
    mode: Literal["pipeline", "sync"] = Field("pipeline", description="pipelined RL, or generate-then-train.")
    seed: int = Field(
        0, description="Global seed: engine seeds and the actor's per-request sampling seeds derive from it."
    )
    max_wall_s: float = Field(
        0.0, ge=0, description="Stop the run after this many seconds (0 = only max_steps)."
    )
    num_preprocessors: int = Field(1, ge=1, description="Preprocessor processes (one consumer group).")
    streams: StreamsConfig = Field(default_factory=lambda: StreamsConfig(backend="redis"))
    task: TaskConfig = Field(default_factory=TaskConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    graph: GraphConfig = Field(default_factory=GraphConfig)
    secrets_file: str | None = Field(
        None, description="Set by the launcher: the 0600 file holding the token and Redis password."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        problems = graph_problems(self.graph, self.placement.stages)
        if self.mode == "sync":
            problems += [
                f"stage {name!r} drops single samples, which mode=sync cannot refill (a round generates exactly "
                "one step's groups): make it a group filter (level: group) or use mode=pipeline"
                for name, s in self.graph.stages.items()
                if s.kind == "filter" and s.level == "sample"
            ]
        if problems:
            raise ValueError(f"graph {self.graph.name!r} cannot run: " + "; ".join(problems))
        if self.eval.max_tokens is None:  # here, not as a field default: it follows actor.max_tokens
            self.eval = self.eval.model_copy(update={"max_tokens": self.actor.max_tokens})
        length = self.inference.max_model_len  # None until the launcher reads the checkpoint's (resolve)
        if length is not None and "seq_length" not in self.preprocess.model_fields_set:
            self.preprocess = self.preprocess.model_copy(update={"seq_length": length})
        if length is not None and self.actor.max_tokens >= length:
            raise ValueError(
                f"actor.max_tokens ({self.actor.max_tokens}) must be below inference.max_model_len "
                f"({length}): raise max_model_len or lower max_tokens"
            )
        if length is not None and self.preprocess.seq_length < length:
            raise ValueError(
                f"preprocess.seq_length ({self.preprocess.seq_length}) must be >= inference.max_model_len "
                f"({length}) or long samples get truncated: raise seq_length"
            )
        if self.trainer.batch_size % self.actor.attempts:
            raise ValueError(
                f"trainer.batch_size ({self.trainer.batch_size}) must be a multiple of actor.attempts "
                f"({self.actor.attempts}) so that steps consume whole groups"
            )
        if self.inference.kv_after_update is None:
            # Here, not as a field default: the default depends on `mode`. A copy, so that an
            # InferenceConfig the caller passed in is not changed under it.
            kv = "keep" if self.mode == "pipeline" else "recompute"
            self.inference = self.inference.model_copy(update={"kv_after_update": kv})
        if self.trainer.push_settle is None:  # like kv_after_update: the default depends on `mode`
            settle = "background" if self.mode == "pipeline" else "wait"
            self.trainer = self.trainer.model_copy(update={"push_settle": settle})
        elif self.trainer.push_settle == "background" and self.mode == "sync":
            raise ValueError(
                "trainer.push_settle=background needs mode=pipeline: a sync round must generate with the "
                "new weights, so its push waits for them (set push_settle=wait or leave it unset)"
            )
        rt = self.actor.round_tokens
        if rt is not None and self.mode != "sync":
            raise ValueError(
                "actor.round_tokens (partial rollouts) needs mode=sync: a pipelined run never waits for a "
                "round's longest answer, its updates land while answers run (unset round_tokens)"
            )
        if rt is not None and rt >= self.actor.max_tokens:
            raise ValueError(
                f"actor.round_tokens ({rt}) must be below actor.max_tokens ({self.actor.max_tokens}): with "
                "it every answer fits one round, so nothing is ever carried (lower it or unset it)"
            )
        if self.platform == "cpu" and self.inference.weight_transport == "nccl":
            raise ValueError(
                "NCCL needs GPUs: with platform=cpu use inference.weight_transport=gloo (the default)"
            )
        if self.inference.backend == "sglang" and self.inference.weight_transport == "gloo":
            raise ValueError(
                "inference=sglang runs on NVIDIA GPUs only: add platform=gpu (NCCL weight transport)"
            )
        if self.inference.update_mode == "drain" and self.inference.backend == "sglang":
            raise ValueError(
                "inference.update_mode=drain needs inference=vllm or torch: SGLang receives an update inside "
                "its scheduler during the broadcast, so a drain would hold every server in it"
            )
        if self.trainer.lora is not None and self.inference.backend == "sglang":
            raise ValueError(
                "trainer.lora needs servers that take adapters in memory (inference=vllm or torch); "
                "inference=sglang takes full weights only (docs/lora.md, Engines)"
            )
        return self

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)


def secret_fields(cfg: RunConfig) -> dict:
    """The secrets of `cfg` (control-route token, Redis URL with its password) as a partial config.

    The launcher writes them to `secrets_file` (mode 0600) and `public_config` leaves them out of
    config.json, so the run directory can be read, shared and attached to bug reports without them.
    """
    secrets: dict = {}
    inference = {k: v for k in ("token", "api_key") if (v := getattr(cfg.inference, k))}
    if inference:
        secrets["inference"] = inference
    if cfg.streams.redis_url and redact_url(cfg.streams.redis_url) != cfg.streams.redis_url:
        secrets["streams"] = {"redis_url": cfg.streams.redis_url}
    return secrets


def public_config(cfg: RunConfig) -> RunConfig:
    """`cfg` without its secrets: no token or API key, the Redis URL without its password."""
    update: dict = {"inference": cfg.inference.model_copy(update={"token": None, "api_key": None})}
    if cfg.streams.redis_url:
        public_url = redact_url(cfg.streams.redis_url, "")
        update["streams"] = cfg.streams.model_copy(update={"redis_url": public_url})
    return cfg.model_copy(update=update)


def load_run_config(path: str | Path) -> RunConfig:
    """Read the config.json the launcher wrote, with the secrets from its `secrets_file` merged in.

    Child processes call this once at startup. A missing or unreadable secrets file is an error (a run
    without its token or Redis password would only fail later, less clearly).
    """
    data = json.loads(Path(path).read_text())
    if data.get("secrets_file"):
        try:
            secrets = json.loads(Path(data["secrets_file"]).read_text())
        except OSError as e:
            raise RuntimeError(
                f"{path} names secrets_file {data['secrets_file']!r}, which cannot be read ({e}): run this "
                "process as the user who launched the run, or relaunch"
            ) from None
        for section, values in secrets.items():
            data.setdefault(section, {}).update(values)
    return RunConfig.model_validate(data)
