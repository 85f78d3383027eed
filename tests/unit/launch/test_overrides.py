"""Command-line overrides are YAML values, except where a field takes strings only: there the text typed is
the value, so `trainer.mixed_precision=no` means "no", not YAML's False (pipeline_rl/launch/compose.py)."""

from __future__ import annotations

import pytest

from pipeline_rl.launch.compose import ConfigError, compose


def test_a_string_field_gets_the_text_that_yaml_would_read_as_a_bool_number_or_date() -> None:
    cfg = compose(
        [
            "trainer.mixed_precision=no",
            "inference.token=yes",
            "model_path=2024",
            "run_dir=1.5",
            "streams.files_dir=2024-01-01",
        ]
    )
    assert cfg.trainer.mixed_precision == "no"
    assert cfg.inference.token == "yes"  # str | None
    assert cfg.model_path == "2024"
    assert cfg.run_dir == "1.5"
    assert str(cfg.streams.files_dir) == "2024-01-01"  # Path | None


def test_other_fields_still_get_yaml_values() -> None:
    cfg = compose(
        [
            "model_path=m",
            "inference.token=null",
            "trainer.learning_rate=1e-5",
            "actor.max_lag=3",
            "eval.every_s=0",
        ]
    )
    assert cfg.inference.token is None
    assert cfg.trainer.learning_rate == 1e-5 and cfg.actor.max_lag == 3 and cfg.eval.every_s == 0


def test_a_wrong_string_is_still_refused_with_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match="'no' or 'bf16'"):
        compose(["model_path=m", "trainer.mixed_precision=maybe"])
    with pytest.raises(ConfigError, match="trainer.mixed_precision"):
        compose(["model_path=m", "trainer.mixed_precision=1"])
