"""Which RL objective the trainer optimizes (config only; torch-free so that config validation is fast).

The objectives themselves live in pipeline_rl/trainer/losses.py; docs/objectives.md has the formulas.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# How the per-token terms of an optimizer step are summed into one loss (docs/objectives.md, Normalization):
#   "sequences"     PipelineRL: sum over all tokens / number of sequences (every token weighs the same)
#   "sequence_mean" original GRPO: mean over each sequence's tokens, then mean over sequences
#   "tokens"        DAPO: sum over all tokens / number of tokens
Normalize = Literal["sequences", "sequence_mean", "tokens"]

# Algorithm defaults applied when a field is left at None: the published values of each method.
DEFAULT_IS_CAP = 5.0
# None: high = low (symmetric clip). decoupled: AReaL's eps_clip default, symmetric.
DEFAULT_CLIP_EPS = {"ppo": (0.2, None), "dapo": (0.2, 0.28), "decoupled": (0.2, None)}
DEFAULT_BEHAV_IMP_WEIGHT_CAP = 5.0  # what AReaL's decoupled-PPO recipes set
# decoupled: AReaL divides the token sum by the number of trained tokens.
DEFAULT_NORMALIZE: dict[str, Normalize] = {
    "grpo": "sequences",
    "ppo": "sequences",
    "dapo": "tokens",
    "decoupled": "tokens",
}

# Names used before the three normalizations were named apart. They are rejected, not mapped: "sequence"
# meant the per-sequence mean, which is easy to mistake for PipelineRL's "sequences".
RENAMED_NORMALIZE = {
    "sequence": (
        'algo.normalize="sequence" was renamed. Use "sequence_mean" for its behaviour (mean over each '
        "sequence's tokens, then over sequences), or \"sequences\" for PipelineRL's token sum / number "
        "of sequences (the grpo/ppo default)."
    ),
    "token": 'algo.normalize="token" was renamed to "tokens" (token sum / number of tokens, as before).',
}


class AlgoConfig(BaseModel):
    """Which RL objective the trainer optimizes. Fields left at None take the algorithm's default."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["grpo", "ppo", "dapo", "decoupled"] = Field(
        "grpo",
        description="Objective: simplified GRPO (REINFORCE + truncated IS), PPO-clip, DAPO, or AReaL's "
        "decoupled PPO (proximal policy apart from the behaviour policy).",
    )
    is_cap: float | None = Field(
        None, description="grpo only: cap of the importance weight exp(new - old); None means 5.0."
    )
    clip_eps_low: float | None = Field(
        None, description="ppo/dapo/decoupled: ratio is clipped below at 1 - clip_eps_low; None means 0.2."
    )
    clip_eps_high: float | None = Field(
        None,
        description="ppo/dapo/decoupled: ratio is clipped above at 1 + clip_eps_high; None: dapo 0.28, "
        "the others = clip_eps_low.",
    )
    behav_imp_weight_cap: float | None = Field(
        None,
        description="decoupled only: tokens whose behaviour weight exp(proximal - old) exceeds it are "
        "left out of the policy term (AReaL's semantics); None means 5.0.",
    )
    lag_correction: Literal["none", "decay"] = Field(
        "none",
        description="Per-token correction for staleness: none, or decay (each token's policy term times "
        "lag_decay ** lag, lag = versions between the weights that sampled the token and the trainer's).",
    )
    lag_decay: float | None = Field(
        None, description="lag_correction=decay: the factor per version of lag, in (0, 1), e.g. 0.9."
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the k3 KL to reference logprobs; 0 = off.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus; 0 = off.")
    normalize: Normalize | None = Field(
        None,
        description="Loss normalization: sequences | sequence_mean | tokens; None means sequences for "
        "grpo/ppo, tokens for dapo.",
    )

    @field_validator("normalize", mode="before")
    @classmethod
    def _reject_old_normalize_names(cls, value: object) -> object:
        if isinstance(value, str) and value in RENAMED_NORMALIZE:
            raise ValueError(RENAMED_NORMALIZE[value])
        return value

    @model_validator(mode="after")
    def _resolve_defaults(self) -> AlgoConfig:
        if self.name == "grpo":
            if self.clip_eps_low is not None or self.clip_eps_high is not None:
                raise ValueError(
                    "algo.clip_eps_low/clip_eps_high only apply to ppo, dapo and decoupled; grpo truncates "
                    "the importance weight with algo.is_cap instead. Remove them or set "
                    "algo.name=ppo|dapo|decoupled."
                )
            if self.is_cap is None:
                self.is_cap = DEFAULT_IS_CAP
            if self.is_cap <= 0:
                raise ValueError(f"algo.is_cap must be > 0 (got {self.is_cap}); the usual value is 5.0.")
        else:
            if self.is_cap is not None:
                hint = " and masks with algo.behav_imp_weight_cap" if self.name == "decoupled" else ""
                raise ValueError(
                    f"algo.is_cap only applies to grpo; {self.name} clips the ratio with "
                    f"algo.clip_eps_low/clip_eps_high{hint} instead. Remove is_cap or set algo.name=grpo."
                )
            default_low, default_high = DEFAULT_CLIP_EPS[self.name]
            if self.clip_eps_low is None:
                self.clip_eps_low = default_low
            if self.clip_eps_high is None:
                self.clip_eps_high = default_high if default_high is not None else self.clip_eps_low
            if not 0.0 < self.clip_eps_low < 1.0:
                raise ValueError(
                    f"algo.clip_eps_low must be in (0, 1) so that 1 - clip_eps_low stays positive "
                    f"(got {self.clip_eps_low}); typical values are 0.1-0.3."
                )
            if self.clip_eps_high <= 0.0:
                raise ValueError(f"algo.clip_eps_high must be > 0 (got {self.clip_eps_high}).")
            if self.name == "dapo" and self.clip_eps_high < self.clip_eps_low:
                raise ValueError(
                    f"dapo's clip-higher needs algo.clip_eps_high >= algo.clip_eps_low (got "
                    f"{self.clip_eps_high} < {self.clip_eps_low}); swap them or use algo.name=ppo."
                )
        self._resolve_behaviour_cap()
        self._check_lag_correction()
        if self.normalize is None:
            self.normalize = DEFAULT_NORMALIZE[self.name]
        return self

    def _resolve_behaviour_cap(self) -> None:
        if self.name != "decoupled":
            if self.behav_imp_weight_cap is not None:
                raise ValueError(
                    f"algo.behav_imp_weight_cap only applies to decoupled; {self.name} has no proximal "
                    "policy to weigh the behaviour policy against. Remove it or set algo.name=decoupled."
                )
            return
        if self.behav_imp_weight_cap is None:
            self.behav_imp_weight_cap = DEFAULT_BEHAV_IMP_WEIGHT_CAP
        if self.behav_imp_weight_cap <= 1.0:
            raise ValueError(
                f"algo.behav_imp_weight_cap must be > 1 (got {self.behav_imp_weight_cap}): at or below 1 "
                "it drops every token the proximal policy finds likelier than the sampler did, on-policy "
                "ones included. AReaL's recipes use 5.0."
            )

    def _check_lag_correction(self) -> None:
        if self.lag_correction == "none":
            if self.lag_decay is not None:
                raise ValueError(
                    "algo.lag_decay only applies with algo.lag_correction=decay; set lag_correction=decay "
                    "or remove lag_decay."
                )
            return
        if self.lag_decay is None or not 0.0 < self.lag_decay < 1.0:
            raise ValueError(
                f"algo.lag_correction=decay needs algo.lag_decay in (0, 1) (got {self.lag_decay}): a token "
                "k versions behind weighs lag_decay ** k, e.g. 0.9 (0.66 at lag 4). For no decay set "
                "algo.lag_correction=none."
            )
