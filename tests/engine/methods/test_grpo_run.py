"""GRPO runs: rollouts on the host, graded rewards that rise, metrics and samples, resume identity,
config errors, the CLI demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import demo
from engine.commands.cli import main
from engine.config import TrainConfig, method_options
from engine.errors import ConfigError
from engine.methods.grpo.train import ROLLOUTS_EVENT, SAMPLES_EVENT
from engine.metrics import ListSink
from engine.training.checkpoint import load_state
from engine.training.run import train
from tests.engine.tiny import tiny_model_folder

# an answer scores the share of its characters that are ASCII letters: a random tiny model's score
# about 0.15 and vary within every group, so GRPO has something to learn from (a Python grader, run
# in its own process)
GRADER = {
    "type": "python",
    "name": "letters",
    "source": (
        "def grade(sample, item):\n"
        "    text = sample['output_text']\n"
        "    return sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)\n"
    ),
}


def letters(text: str) -> float:
    return sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("grpo-run")
    tiny_model_folder(d / "model", "llama")
    rows = [
        {"messages": [{"role": "user", "content": f"what is {a} plus {b}?"}], "reference_answer": str(a + b)}
        for a in range(6)
        for b in range(4)
    ]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}
    ] * 8
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    return d


def config(d: Path, out: str, **over) -> TrainConfig:
    raw = {
        "model": {"path": str(d / "model"), "name": "tiny-llama"},
        "data": {"train": str(d / "prompts.jsonl"), "max_length": 48},
        "method": {
            "objective": "grpo",
            "lora_r": 8,
            "lora_alpha": 16,
            "grader": GRADER,
            "group_size": 6,
            "max_completion_tokens": 6,
            "beta": 0.0,
        },
        "hyper": {"max_steps": 4, "batch_size": 4, "learning_rate": 5e-2, "schedule": "constant"},
        "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 5},
        "output_dir": str(d / out),
    }
    for key, value in over.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return TrainConfig.parse(raw)


def rewards_of(sink: ListSink) -> list[float]:
    return [m["reward/mean"] for _, m in sink.records if "reward/mean" in m]


def test_the_mean_reward_rises_on_a_tiny_model(workspace: Path) -> None:
    # a full fine-tune: the tiny model's head is what turns its near-uniform answers around
    sink = ListSink()
    over = {"method": {"tuning": "full"}, "hyper": {"max_steps": 16, "learning_rate": 5e-2}}
    result = train(config(workspace, "rise", **over), sink)
    assert result.step == 16
    rewards = rewards_of(sink)
    assert len(rewards) == 16
    # measured: 0.12 0.26 0.19 0.14 ... 0.99 1.0 1.0 1.0 (first four steps 0.18, last four 1.0)
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert first < 0.4 and last > first + 0.3, rewards
    logged = {k for _, m in sink.records for k in m}
    for key in (
        "reward/min",
        "reward/max",
        "reward/letters",
        "grpo/kl",
        "grpo/clip_fraction",
        "completion/length",
    ):
        assert key in logged, key
    samples = [d for kind, _, d in sink.events if kind == SAMPLES_EVENT]
    assert len(samples) == 16 and samples[-1]["step"] == 16
    shown = samples[-1]["samples"][0]
    assert {"prompt", "completion", "reward", "error"} <= set(shown) and "plus" in shown["prompt"]
    assert shown["error"] is None and shown["reward"] == pytest.approx(letters(shown["completion"]), abs=1e-6)


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_a_grpo_run_resumes_bitwise(workspace: Path, tuning: str) -> None:
    method = {"tuning": tuning, "beta": 0.05 if tuning == "lora" else 0.0}
    whole = train(config(workspace, f"whole-{tuning}", method=method), ListSink())
    assert whole.step == 4
    part = train(config(workspace, f"part-{tuning}", method=method, hyper={"max_steps": 2}), ListSink())
    assert part.step == 2
    # the same output folder: the 4-step run resumes from the 2-step run's checkpoint
    resumed_sink = ListSink()
    resumed = train(config(workspace, f"part-{tuning}", method=method), resumed_sink)
    assert resumed.step == 4 and any(kind == "resume" for kind, _, _ in resumed_sink.events)
    a, _ = load_state(whole.checkpoint)
    b, _ = load_state(resumed.checkpoint)
    for key, value in a["masters"].items():
        assert value.equal(b["masters"][key]), key


def test_config_errors_name_the_field(workspace: Path) -> None:
    with pytest.raises(ConfigError, match=r"method\.grader: GRPO needs a grader"):
        config(workspace, "x", method={"grader": None})
    with pytest.raises(ConfigError) as bad:
        check = {"type": "string_check", "name": "c", "input": "a", "reference": "b", "operation": "equals"}
        config(workspace, "x", method={"grader": check})
    assert bad.value.field == "method.grader.operation" and '(got "equals")' in str(bad.value), bad.value
    # a field another method owns: the grader is GRPO's alone
    with pytest.raises(ConfigError, match=r"method\.grader: Extra inputs are not permitted") as other:
        config(workspace, "x", method={"objective": "sft", "grader": GRADER, "beta": 0.1})
    assert other.value.field == "method.grader"
    # a full fine-tune's KL term: its reference is a frozen copy of its initial weights
    assert config(workspace, "x", method={"tuning": "full", "beta": 0.1}).method.beta == 0.1
    # GRPO's default beta is 0 (no KL term, no reference pass), whatever trains
    assert method_options(objective="grpo", tuning="full", grader=GRADER).beta == 0
    assert (
        method_options(objective="grpo", grader=GRADER).beta == 0
        and method_options(objective="dpo").beta == 0.1
    )
    with pytest.raises(ConfigError, match=r"method\.base_bits=4: GRPO samples on the host"):
        config(workspace, "x", method={"base_bits": 4})
    with pytest.raises(ConfigError, match=r"data\.packing=true: GRPO samples whole completions"):
        config(workspace, "x", data={"packing": True})
    # micro-batches cut the sampled rows: 4 prompts x 6 answers fill 24, not 25
    assert config(workspace, "x", engine={"num_microbatches": 24}).engine.num_microbatches == 24
    with pytest.raises(ConfigError, match=r"exceeds hyper\.batch_size=4 x method\.group_size=6"):
        config(workspace, "x", engine={"num_microbatches": 25})
    with pytest.raises(ConfigError, match=r"data\.train: .*chat\.jsonl holds chat rows; GRPO trains on"):
        train(config(workspace, "x", data={"train": str(workspace / "chat.jsonl")}), ListSink())
    with pytest.raises(ConfigError, match=r"method\.max_completion_tokens=48 leaves no room"):
        train(config(workspace, "x", method={"max_completion_tokens": 48}), ListSink())


def test_committed_prompt_demo_data_is_what_the_generator_writes() -> None:
    train_rows = [json.loads(line) for line in demo.PROMPTS_TRAIN.read_text().splitlines()]
    heldout = [json.loads(line) for line in demo.PROMPTS_HELDOUT.read_text().splitlines()]
    assert train_rows == demo.make_prompt_rows(64, seed=5)
    assert heldout == demo.make_prompt_rows(16, seed=6)
    assert all(r["messages"][-1]["role"] == "user" and r["reference_answer"].isdigit() for r in train_rows)


def test_cli_demo_grpo_prints_the_rewards(tmp_path: Path, capsys) -> None:
    folder = tiny_model_folder(tmp_path / "model", "llama")
    argv = ["demo", "--grpo", "--model", str(folder), "--steps", "2", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "held-out mean reward:" in out and "after 2 GRPO steps" in out and "training reward" in out


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["sync", "async"])
def test_the_samples_come_from_the_weights_the_step_trains_with(async_optimizer: bool) -> None:
    # the sampler's model scores a batch exactly as the engine's next iteration does: with the
    # async optimizer that is the weights one step behind the masters (staleness 1), not the masters
    import copy

    from engine import EngineConfig, RoundPipe
    from engine.methods.rollouts import policy_model
    from engine.model.loss import token_logps
    from tests.engine.methods.test_grpo import lora_model, rollout_batch

    batch = rollout_batch(seed=4)
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=2, lr=0.05, async_optimizer=async_optimizer
    )
    with RoundPipe(copy.deepcopy(lora_model()), config) as rp:
        for _ in range(3):
            rp.forward_backward(**batch)
            rp.step()
        with policy_model(rp) as model:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sampled = token_logps(logits, batch["labels"])
            lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        engine = rp.token_logps(**batch)
        assert (sampled - engine).abs().max() < 1e-5
        masters = rp.master_state_dict(trainable_only=True)
        behind = max(abs(float((lora[n] - masters[n]).abs().max())) for n in lora)
        assert (behind > 0) == async_optimizer  # async: one step behind the masters
        # the model's parameters are the compute copy again, and training goes on unharmed
        rp.forward_backward(**batch)
        rp.step()
        rp.synchronize()


def test_rollouts_sample_on_the_cpu_of_a_cpu_host(workspace: Path) -> None:
    sink = ListSink()
    train(config(workspace, "where", hyper={"max_steps": 1}), sink)
    where = [(m, d) for kind, m, d in sink.events if kind == ROLLOUTS_EVENT]
    assert where == [("rollouts sample on the host's CPU (no GPU worker)", {"device": "cpu"})]
