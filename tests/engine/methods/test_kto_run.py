"""KTO runs: metrics, the stored reference, resume identity, and data that must be unpaired rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.methods.kto.train import REFERENCE_FILE
from engine.metrics import ListSink
from engine.training.checkpoint import load_state
from engine.training.run import train
from tests.engine.tiny import tiny_model_folder

KTO_METRICS = ("kto/kl", "kto/chosen_reward", "kto/rejected_reward", "kto/reward_margin")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kto-run")
    tiny_model_folder(d / "model", "qwen3")
    rows = [
        {
            "prompt": f"what is {a} plus {b}?",
            "completion": str(a + b + (a + b) % 2),
            "label": (a + b) % 2 == 0,
        }
        for a in range(6)
        for b in range(4)
    ]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [{"prompt": "hi", "chosen": "a", "rejected": "b"}] * 8
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return d


def config(d: Path, out: str, **over) -> TrainConfig:
    raw = {
        "model": {"path": str(d / "model"), "name": "tiny-qwen3"},
        "data": {"train": str(d / "rows.jsonl"), "validation_fraction": 0.2, "max_length": 64},
        "method": {"objective": "kto", "beta": 0.5, "lora_r": 4, "lora_alpha": 8, "undesirable_weight": 1.5},
        "hyper": {"max_steps": 4, "batch_size": 4, "learning_rate": 1e-2, "warmup_steps": 1},
        "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 5},
        "eval": {"every_steps": 2},
        "output_dir": str(d / out),
    }
    for key, value in over.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return TrainConfig.parse(raw)


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_a_kto_run_logs_its_metrics_and_resumes_bitwise(workspace: Path, tuning: str) -> None:
    method = {"tuning": tuning}
    sink = ListSink()
    straight = train(config(workspace, f"straight-{tuning}", method=method), sink)
    assert straight.status == "succeeded" and straight.step == 4
    for key in ("loss/train", "kto/kl", "kto/desirable", "kto/undesirable"):
        assert len(sink.series(key)) == 4, key
    counts = zip(sink.series("kto/desirable"), sink.series("kto/undesirable"), strict=True)
    assert all(d + u == 4.0 for d, u in counts)
    assert len(sink.series("loss/val")) == 2 and len(sink.series("kto/val_kl")) == 2
    # the first step: the policy is its reference and the KL estimate 0, so each row's loss is half
    # its weight: the mean of 0.5 (desirable) and 0.75 (undesirable, weight 1.5) by the labels drawn
    d, u = sink.series("kto/desirable")[0], sink.series("kto/undesirable")[0]
    assert sink.series("loss/train")[0] == pytest.approx((0.5 * d + 0.75 * u) / 4, abs=1e-5)
    assert sink.series("kto/kl")[0] == 0.0
    computed = [e for e in sink.events if e[0] == "reference"]
    assert len(computed) == 1 and computed[0][2]["rows"] == 24
    assert (workspace / f"straight-{tuning}" / REFERENCE_FILE).is_file()

    first = train(config(workspace, f"resumed-{tuning}", method=method, hyper={"max_steps": 2}))
    assert first.step == 2
    sink = ListSink()
    resumed = train(config(workspace, f"resumed-{tuning}", method=method), sink)
    kinds = [e[:2] for e in sink.events]
    assert ("resume", "resumed from step_000002") in kinds
    assert ("reference", f"reference log-probabilities read from {REFERENCE_FILE}") in kinds
    a, b = load_state(straight.checkpoint)[0]["masters"], load_state(resumed.checkpoint)[0]["masters"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all("lora_" in k for k in a) == (tuning == "lora")


def test_kto_trains_on_unpaired_rows_only(workspace: Path) -> None:
    with pytest.raises(ConfigError) as err:
        train(config(workspace, "bad-1", data={"train": str(workspace / "pairs.jsonl")}))
    assert err.value.field == "data.train" and "kto" in str(err.value)
    with pytest.raises(ConfigError) as err:
        config(workspace, "bad-2", data={"packing": True})
    assert err.value.field == "data.packing"
    with pytest.raises(ConfigError) as err:
        config(workspace, "bad-3", method={"desirable_weight": 0})
    assert err.value.field == "method.desirable_weight"
    with pytest.raises(ConfigError) as err:  # a field of another method
        config(workspace, "bad-4", method={"group_size": 4})
    assert err.value.field == "method.group_size"


def test_rows_of_the_same_tokens_may_carry_either_label(workspace: Path, tmp_path: Path) -> None:
    # the same prompt and completion on four lines, one of them labelled undesirable (as TRL's KTO
    # data may hold them): each row keeps its own label, found by its index in the batch
    rows = [{"prompt": "2 plus 2?", "completion": "4", "label": i != 1} for i in range(4)]
    path = tmp_path / "both.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sink = ListSink()
    data = {"train": str(path), "validation_fraction": 0.0}
    result = train(config(workspace, str(tmp_path / "out"), data=data, eval={"every_steps": None}), sink)
    assert result.status == "succeeded" and result.step == 4
    assert sink.series("kto/desirable") == [3.0] * 4 and sink.series("kto/undesirable") == [1.0] * 4
    # every row (and its mismatched row, the same completion) has the same log-ratio r, so a step's
    # loss is TRL's: (3 * (1 - sigmoid(beta (r - z))) + 1.5 * (1 - sigmoid(beta (z - r)))) / 4
    beta, weight = 0.5, 1.5
    chosen, rejected = sink.series("kto/chosen_reward"), sink.series("kto/rejected_reward")
    assert chosen == rejected
    assert chosen[-1] != 0.0  # the policy moved
    for loss, reward, kl in zip(sink.series("loss/train"), chosen, sink.series("kto/kl"), strict=True):
        r = reward / beta
        assert kl == pytest.approx(max(0.0, r), abs=1e-6)
        good = 1 - torch.sigmoid(torch.tensor(beta * (r - kl)))
        bad = 1 - torch.sigmoid(torch.tensor(beta * (kl - r)))
        assert loss == pytest.approx(float(3 * good + weight * bad) / 4, abs=1e-6)
