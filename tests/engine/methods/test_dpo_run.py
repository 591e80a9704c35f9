"""DPO runs: metrics, the stored reference, resume identity, config errors, the CLI and the demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import demo
from engine.commands.cli import main
from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.methods.dpo.train import REFERENCE_FILE
from engine.metrics import ListSink
from engine.training.checkpoint import load_state
from engine.training.run import train
from tests.engine.tiny import tiny_model_folder

DPO_METRICS = ("dpo/reward_margin", "dpo/reward_accuracy", "dpo/chosen_reward", "dpo/rejected_reward")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dpo-run")
    tiny_model_folder(d / "model", "qwen3")
    pairs = [
        {"prompt": f"what is {a} plus {b}?", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(6)
        for b in range(4)
    ]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    chat = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}
    ] * 8
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    return d


def config(d: Path, out: str, **over) -> TrainConfig:
    raw = {
        "model": {"path": str(d / "model"), "name": "tiny-qwen3"},
        "data": {"train": str(d / "pairs.jsonl"), "validation_fraction": 0.2, "max_length": 64},
        "method": {"kind": "dpo", "beta": 0.5, "lora_r": 4, "lora_alpha": 8},
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
def test_a_dpo_run_logs_its_metrics_and_resumes_bitwise(workspace: Path, tuning: str) -> None:
    method = {"dpo_tuning": tuning}
    sink = ListSink()
    straight = train(config(workspace, f"straight-{tuning}", method=method), sink)
    assert straight.status == "succeeded" and straight.step == 4
    for key in ("loss/train", *DPO_METRICS, "dpo/pairs"):
        assert len(sink.series(key)) == 4, key
    assert sink.series("dpo/pairs") == [4.0] * 4
    assert len(sink.series("loss/val")) == 2 and len(sink.series("dpo/val_reward_accuracy")) == 2
    # the first step: the policy is its reference (a LoRA adapter starts at zero; full starts there)
    assert sink.series("loss/train")[0] == pytest.approx(0.693147, abs=1e-5)
    assert sink.series("dpo/reward_margin")[0] == pytest.approx(0.0, abs=1e-5)
    assert all(k in straight.metrics for k in ("loss/train", "loss/val", *DPO_METRICS))
    computed = [e for e in sink.events if e[0] == "reference"]
    assert len(computed) == 1 and "pairs from" in computed[0][1] and computed[0][2]["pairs"] == 24
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
    if tuning == "lora":
        assert all("lora_" in k for k in a)
    else:
        assert any("embed_tokens" in k for k in a)


def test_a_changed_dataset_recomputes_the_stored_reference(workspace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(config(workspace, str(out), hyper={"max_steps": 1}, eval={"every_steps": None}))
    stored = torch.load(out / REFERENCE_FILE, weights_only=True)
    rows = (workspace / "pairs.jsonl").read_text().splitlines()[:12]
    other = tmp_path / "fewer.jsonl"
    other.write_text("\n".join(rows) + "\n")
    sink = ListSink()
    cfg = config(workspace, str(out), data={"train": str(other)}, hyper={"max_steps": 2})
    train(cfg, sink)
    message = next(e[1] for e in sink.events if e[0] == "reference")
    assert "read from" not in message
    again = torch.load(out / REFERENCE_FILE, weights_only=True)
    assert again["fingerprint"] != stored["fingerprint"]
    assert again["train"].shape[0] < stored["train"].shape[0]


def test_method_and_data_must_agree(workspace: Path) -> None:
    with pytest.raises(ConfigError) as err:
        train(config(workspace, "bad-1", data={"train": str(workspace / "chat.jsonl")}))
    assert err.value.field == "data.train" and "dpo" in str(err.value)
    with pytest.raises(ConfigError) as err:
        train(config(workspace, "bad-2", method={"kind": "lora"}))
    assert err.value.field == "data.train" and "preference" in str(err.value)
    with pytest.raises(ConfigError) as err:
        train(config(workspace, "bad-3", data={"packing": True}))
    assert err.value.field == "data.packing"


def test_cli_train_takes_the_method_flags(workspace: Path, tmp_path: Path, capsys) -> None:
    raw = config(workspace, str(tmp_path / "cli"), method={"kind": "lora"}).model_dump(mode="json")
    raw["hyper"]["max_steps"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    argv = ["train", str(path), "--method", "dpo", "--beta", "0.3", "--dpo-tuning", "full"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "succeeded at step 2/2" in out
    trainer = load_state(tmp_path / "cli" / "checkpoints" / "step_000002")[1]
    assert trainer["method"] == "dpo"
    assert trainer["config"]["method"]["beta"] == 0.3 and trainer["config"]["method"]["tuning"] == "full"
    assert main(["train", str(path), "--beta", "0"]) == 2
    assert "method.beta" in capsys.readouterr().err


def test_the_dpo_demo_raises_the_preferred_answer_on_a_tiny_model(tmp_path: Path) -> None:
    from engine.demo.dpo import describe, run_demo

    folder = tiny_model_folder(tmp_path / "model", "llama")
    # eight demo pairs, five epochs: the pairs shown are the pairs trained on
    small = tmp_path / "pairs.jsonl"
    small.write_text("\n".join(demo.PREFERENCE_TRAIN.read_text().splitlines()[:8]) + "\n")
    result = run_demo(
        folder, steps=10, workers=2, output_dir=tmp_path / "out", train=small, learning_rate=5e-3, beta=0.5
    )
    before, after = result.train_before, result.train_after
    assert len(before.prompts) == 8 and result.steps == 10
    # the preferred answers gained on the rejected ones (measured: the mean margin -0.09 -> +1.3)
    assert after.margin > before.margin + 0.5, (before.margin, after.margin)
    gained = (after.chosen - before.chosen) - (after.rejected - before.rejected)
    assert int((gained > 0).sum()) >= 6, gained
    text = "\n".join(describe(result))
    assert "preferred '9'" in text and "held-out pairs" in text


def test_committed_preference_demo_data_is_what_the_generator_writes() -> None:
    train_rows = [json.loads(line) for line in demo.PREFERENCE_TRAIN.read_text().splitlines()]
    heldout = [json.loads(line) for line in demo.PREFERENCE_HELDOUT.read_text().splitlines()]
    assert train_rows == demo.make_preference_rows(48, seed=3)
    assert heldout == demo.make_preference_rows(16, seed=4)
    assert all(r["chosen"] != r["rejected"] for r in train_rows + heldout)


def test_cli_demo_dpo_prints_the_likelihoods(tmp_path: Path, capsys) -> None:
    folder = tiny_model_folder(tmp_path / "model", "llama")
    argv = ["demo", "--dpo", "--model", str(folder), "--steps", "2", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "log-likelihood of each answer, before -> after" in out and "after 2 DPO steps" in out
