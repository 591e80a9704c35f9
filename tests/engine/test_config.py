"""Configuration errors carry their field (``ConfigError.field``) besides the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import ConfigError
from engine.config import COMPUTE_DTYPES, EngineConfig, TrainConfig
from engine.data.batches import Batcher
from engine.data.encode import load_encoded
from engine.model.loading import resolve_model_path


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"devices": []}, "EngineConfig.devices"),
        ({"num_microbatches": 0}, "EngineConfig.num_microbatches"),
        ({"lr": float("nan")}, "EngineConfig.lr"),
        ({"betas": (0.9, 1.0)}, "EngineConfig.betas"),
        ({"compute_dtype": "int8"}, "EngineConfig.compute_dtype"),
        ({"calibration_steps": -1}, "EngineConfig.calibration_steps"),
    ],
)
def test_engine_config_errors_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}=") as exc:
        EngineConfig(**kwargs)
    assert exc.value.field == field
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"data": {"train": "x.jsonl"}, "hyper": {"learning_rate": -1}}, "hyper.learning_rate"),
        ({}, "data"),
        ({"data": {"train": "x.jsonl"}, "hyper": {"epochs": None}}, "hyper.epochs"),
        (
            {"data": {"train": "x.jsonl"}, "hyper": {"batch_size": 4}, "engine": {"num_microbatches": 8}},
            "engine.num_microbatches",
        ),
    ],
)
def test_train_config_errors_name_the_first_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(raw)
    assert exc.value.field == field


def test_train_config_lists_every_problem_and_names_the_first() -> None:
    raw = {"data": {"train": "x.jsonl"}, "hyper": {"learning_rate": -1, "batch_size": 0}}
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(raw)
    assert exc.value.field == "hyper.batch_size"
    assert str(exc.value) == (
        "hyper.batch_size: Input should be greater than or equal to 1 (got 0); "
        "hyper.learning_rate: Input should be greater than 0 (got -1)"
    )


def test_compute_dtypes_are_the_engine_dtypes() -> None:
    from engine.parallel.host import DTYPES

    assert tuple(DTYPES) == COMPUTE_DTYPES


def test_model_and_data_errors_name_the_config_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a Hugging Face model folder") as exc:
        resolve_model_path(str(tmp_path), tmp_path)
    assert exc.value.field == "model.path"
    notes = tmp_path / "val.txt"
    notes.write_text("hello\n")
    with pytest.raises(ConfigError, match=r"unsupported file type '\.txt'") as exc:
        load_encoded(str(notes), None, field="data.validation")
    assert exc.value.field == "data.validation"
    bad = tmp_path / "train.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(ConfigError, match="1 invalid rows: line 1: invalid JSON") as exc:
        load_encoded(str(bad), None)
    assert exc.value.field == "data.train"
    with pytest.raises(ConfigError, match=r"hyper\.batch_size=2 is larger than the 0") as exc:
        Batcher([], 2, seed=0, pad_id=0)
    assert exc.value.field == "hyper.batch_size"
