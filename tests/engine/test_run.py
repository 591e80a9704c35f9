"""Whole runs: resume identity, cancel, exports that transformers/peft load, the CLI."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import pytest
import torch

from engine.commands.cli import main
from engine.config import TrainConfig
from engine.kinds import EngineEvent
from engine.metrics import ListSink
from engine.training.checkpoint import load_state
from engine.training.checkpoint_layout import CheckpointKind, folder_bytes, list_checkpoints
from engine.training.run import learning_rate, train
from tests.engine.tiny import tiny_model_folder


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("run")
    tiny_model_folder(d / "model", "qwen3")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {a} plus {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
        for a in range(6)
        for b in range(4)
    ]
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def config(d: Path, out: str, **over) -> TrainConfig:
    raw = {
        "model": {"path": str(d / "model"), "name": "tiny-qwen3"},
        "data": {"train": str(d / "train.jsonl"), "validation_fraction": 0.2, "max_length": 64},
        "method": {"kind": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.1},
        "hyper": {
            "max_steps": 6,
            "batch_size": 4,
            "learning_rate": 5e-3,
            "warmup_steps": 2,
            "weight_decay": 0.01,
        },
        "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2},
        "checkpoint": {"every_steps": 3, "keep_last": 5},
        "eval": {"every_steps": 2},
        "output_dir": str(d / out),
    }
    for key, value in over.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return TrainConfig.parse(raw)


def masters(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_state(checkpoint)[0]["masters"]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(workspace: Path, method: str) -> None:
    straight = train(config(workspace, f"straight-{method}", method={"kind": method}))
    assert straight.status == "succeeded" and straight.step == 6
    # stop after 3 steps (max_steps=3), then run the same config to 6: it resumes from step 3
    first = train(config(workspace, f"resumed-{method}", method={"kind": method}, hyper={"max_steps": 3}))
    assert first.step == 3
    sink = ListSink()
    resumed = train(config(workspace, f"resumed-{method}", method={"kind": method}), sink)
    assert ("resume", "resumed from step_000003") in [e[:2] for e in sink.events]
    # the saved checkpoint told by the sink's typed call, not by an event
    kind = CheckpointKind.ADAPTER if method == "lora" else CheckpointKind.FULL
    assert [(c.step, c.path, c.kind) for c in sink.checkpoints] == [(6, resumed.checkpoint, kind)]
    assert sink.checkpoints[0].bytes == folder_bytes(resumed.checkpoint) > 0
    assert not [e for e in sink.events if e[0] == EngineEvent.CHECKPOINT]
    a, b = masters(straight.checkpoint), masters(resumed.checkpoint)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = load_state(straight.checkpoint)[1], load_state(resumed.checkpoint)[1]
    assert sa["batcher"] == sb["batcher"]


def test_lr_schedule() -> None:
    lrs = [learning_rate(s, total=10, peak=1.0, warmup=2, schedule="cosine") for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and lrs[-1] < 0.05
    assert all(x >= y for x, y in itertools.pairwise(lrs[1:]))
    assert learning_rate(5, total=10, peak=2.0, warmup=0, schedule="linear") == 1.0
    assert learning_rate(7, total=10, peak=2.0, warmup=3, schedule="constant") == 2.0


def test_cancel_stops_at_a_step_boundary_with_a_resumable_checkpoint(workspace: Path) -> None:
    cancel = threading.Event()

    class CancelAfter(ListSink):
        def log(self, metrics, step):
            super().log(metrics, step)
            if metrics.get("progress/step") == 2:
                cancel.set()

    result = train(config(workspace, "cancelled", checkpoint={"every_steps": 100}), CancelAfter(), cancel)
    assert result.status == "cancelled" and result.step == 2
    assert [s for s, _ in list_checkpoints(workspace / "cancelled" / "checkpoints")] == [2]
    # the same config continues from there and finishes like a run that never stopped
    done = train(config(workspace, "cancelled", checkpoint={"every_steps": 100}))
    assert done.status == "succeeded" and done.step == 6
    straight = train(config(workspace, "never-cancelled", checkpoint={"every_steps": 100}))
    a, b = masters(done.checkpoint), masters(straight.checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_exports_load_in_transformers_and_peft_with_the_engines_logits(workspace: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 17, 42, 8, 99, 5]])
    lora = train(config(workspace, "export-lora"))
    adapter_cfg = json.loads((lora.checkpoint / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == "tiny-qwen3"  # a name, not a path
    # reference: the base model with the engine's fp32 masters applied
    base = AutoModelForCausalLM.from_pretrained(workspace / "model")
    loaded = PeftModel.from_pretrained(base, lora.checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(workspace / "model")
    from peft import LoraConfig, get_peft_model

    ref = get_peft_model(
        reference, LoraConfig(r=4, lora_alpha=8, target_modules=list(adapter_cfg["target_modules"]))
    )
    ref.load_state_dict(
        masters(lora.checkpoint) | {k: v for k, v in ref.state_dict().items() if "lora_" not in k}
    )
    assert torch.equal(logits_of(loaded, ids), logits_of(ref, ids))
    assert not torch.equal(
        logits_of(loaded, ids), logits_of(AutoModelForCausalLM.from_pretrained(workspace / "model"), ids)
    )
    # merged into the base: a plain model folder with (up to float rounding) the same logits
    out = workspace / "merged"
    assert main(["export", str(lora.checkpoint), "--out", str(out), "--merged"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert (logits_of(merged, ids) - logits_of(loaded, ids)).abs().max() < 1e-5
    # full fine-tune: the folder itself is the model
    full = train(config(workspace, "export-full", method={"kind": "full"}))
    model = AutoModelForCausalLM.from_pretrained(full.checkpoint)
    state = masters(full.checkpoint)
    for name, value in model.state_dict().items():
        if name in state:
            assert torch.equal(value, state[name]), name
    assert (full.checkpoint / "tokenizer.json").is_file() and (
        full.checkpoint / "chat_template.jinja"
    ).is_file()


def test_cli_train_generate_and_bad_input(workspace: Path, tmp_path: Path, capsys) -> None:
    cfg = config(workspace, "cli").model_dump(mode="json")
    cfg["hyper"]["max_steps"] = 2
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 2/2" in out and "succeeded at step 2/2" in out
    ckpt = workspace / "cli" / "checkpoints" / "step_000002"
    assert main(["generate", str(ckpt), "--prompt", "what is 1 plus 2?", "--max-new-tokens", "4"]) == 0
    # bad input: exit code 2, one line naming the field and the value
    cfg["hyper"]["learning_rate"] = -1
    path.write_text(json.dumps(cfg))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading progress bars
    assert err.startswith("roundhouse train: hyper.learning_rate: Input should be greater than 0 (got -1)")
    bad = tmp_path / "bad.jsonl"
    # (a chat row that ends with the user's turn would be a prompt row, GRPO's)
    bad.write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n{oops\n')
    assert main(["validate-data", str(bad)]) == 2
    out = capsys.readouterr().out
    assert (
        "line 1: messages[0]: expected role 'user', got 'assistant'" in out and "line 2: invalid JSON" in out
    )
    assert main(["validate-data", str(workspace / "train.jsonl"), "--model", str(workspace / "model")]) == 0
    assert "format chat, 24 rows, 0 errors" in capsys.readouterr().out


def test_config_errors_name_the_field_and_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"engine.num_microbatches=8 exceeds hyper.batch_size=4"):
        TrainConfig.parse(
            {"data": {"train": "x.jsonl"}, "hyper": {"batch_size": 4}, "engine": {"num_microbatches": 8}}
        )
    # the default micro-batch count fits a batch smaller than it; one the caller set does not
    small = TrainConfig.parse({"data": {"train": "x.jsonl"}, "hyper": {"batch_size": 2}})
    assert small.engine.num_microbatches == 2
    assert TrainConfig.parse(small.model_dump()).engine.num_microbatches == 2
    kinds = r"method.kind='qlora': must be \"lora\", \"full\", \"dpo\", \"orpo\", \"kto\" or \"grpo\""
    with pytest.raises(ValueError, match=kinds):
        TrainConfig.parse({"data": {"train": "x.jsonl"}, "method": {"kind": "qlora"}})
    with pytest.raises(ValueError, match=r"data: Field required"):
        TrainConfig.parse({})
    with pytest.raises(ValueError, match=r"hyper.lr: Extra inputs are not permitted"):
        TrainConfig.parse({"data": {"train": "x.jsonl"}, "hyper": {"lr": 1}})
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  train: d/train.jsonl\noutput_dir: out\n")
    c = TrainConfig.load(p)
    assert c.data.train == str(tmp_path / "d" / "train.jsonl") and c.output_dir == str(tmp_path / "out")
    assert c.model.path == "demo"


def test_a_run_puts_lora_on_the_experts_and_exports_an_adapter_peft_loads(workspace: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tiny_model_folder(workspace / "moe-model", "qwen3_moe")
    cfg = config(
        workspace,
        "moe-lora",
        model={"path": str(folder), "name": "tiny-qwen3-moe"},
        method={"lora_dropout": 0.0, "target_parameters": ["experts"]},
        hyper={"max_steps": 2},
        checkpoint={"every_steps": 2},
    )
    result = train(cfg)
    assert result.status == "succeeded" and result.step == 2
    adapter_cfg = json.loads((result.checkpoint / "adapter_config.json").read_text())
    # the family's attention projections (the run kept the default targets) and its experts
    assert set(adapter_cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(adapter_cfg["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    state = masters(result.checkpoint)
    assert any(".experts." in k and "lora_" in k for k in state)
    ids = torch.tensor([[3, 17, 42, 8, 99, 5]])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), result.checkpoint)
    ref = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=adapter_cfg["target_modules"],
            target_parameters=adapter_cfg["target_parameters"],
        ),
    )
    ref.load_state_dict(state | {k: v for k, v in ref.state_dict().items() if "lora_" not in k})
    assert torch.equal(logits_of(loaded, ids), logits_of(ref, ids))


def test_lora_target_parameters_are_checked_against_the_model() -> None:
    from engine.errors import ConfigError
    from engine.training.run import lora_target_parameters
    from tests.engine.tiny import tiny_model

    moe = tiny_model("qwen3_moe")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert lora_target_parameters(["experts"], moe) == experts
    assert lora_target_parameters(["experts", "experts.down_proj"], moe) == [*experts, "experts.down_proj"]
    assert lora_target_parameters([], tiny_model("llama")) == []
    cases = [
        (
            ["experts"],
            tiny_model("llama"),
            "method.target_parameters: 'experts': LlamaForCausalLM has no expert weights",
        ),
        (
            ["mlp.experts.up_proj"],
            moe,
            "method.target_parameters: 'mlp.experts.up_proj' names no parameter of Qwen3MoeForCausalLM "
            "(its expert weights: mlp.experts.gate_up_proj, mlp.experts.down_proj)",
        ),
        (
            ["input_layernorm.weight"],
            moe,
            "method.target_parameters: 'input_layernorm.weight' is not a weight matrix or a stack of "
            "expert matrices (1-D)",
        ),
    ]
    for names, model, message in cases:
        with pytest.raises(ConfigError) as exc:
            lora_target_parameters(names, model)
        assert str(exc.value) == message and exc.value.field == "method.target_parameters"
    # in the run configuration: the names' spelling, and no dropout (peft cannot apply it there)
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse({"data": {"train": "x.jsonl"}, "method": {"target_parameters": ["mlp experts"]}})
    assert exc.value.field == "method.target_parameters" and "'mlp experts': each entry must be" in str(
        exc.value
    )
    with pytest.raises(ConfigError) as exc:
        TrainConfig.parse(
            {"data": {"train": "x.jsonl"}, "method": {"target_parameters": ["experts"], "lora_dropout": 0.1}}
        )
    assert exc.value.field == "method.lora_dropout"
