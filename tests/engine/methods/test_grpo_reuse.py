"""GRPO runs with a full fine-tune's KL term (its reference a frozen copy of the initial weights)
and with ``num_iterations`` (each batch of completions trained several steps) equal a plain
PyTorch loop on the unsplit model, given the run's own completions and rewards; the batcher
serves each batch that many times; a run checkpointed between two steps on one batch resumes
bitwise."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from engine.config import method_options
from engine.data.batches import Batcher
from engine.data.prompts import PromptItem
from engine.errors import ConfigError
from engine.kinds import EngineEvent
from engine.methods.grpo.train import GRPORun
from engine.methods.rollouts import RolloutBatch
from engine.metrics import ListSink
from engine.model.loading import load_model
from engine.training.checkpoint import load_method_state, load_state
from engine.training.run import train
from tests.engine.methods.test_grpo import EPS, EPS_HIGH, direct_grpo_loss, logps_of
from tests.engine.methods.test_grpo_run import GRADER, config
from tests.engine.tiny import max_diff, tiny_model_folder

TOL = 1e-5
LR = 0.5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A tiny model and 24 arithmetic prompts (``test_grpo_run.config``'s layout)."""
    d = tmp_path_factory.mktemp("grpo-reuse")
    tiny_model_folder(d / "model", "llama")
    rows = [
        {"messages": [{"role": "user", "content": f"what is {a} plus {b}?"}], "reference_answer": str(a + b)}
        for a in range(6)
        for b in range(4)
    ]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def plain_grpo_run(folder: Path, batches: list[RolloutBatch], *, beta: float, iterations: int):
    """The run's batches trained the ordinary way: the whole model, the whole batch, torch SGD; the
    KL term's reference a frozen copy of the initial model, each batch ``iterations`` steps
    against the log-probabilities the policy had before the first."""
    policy = load_model(folder, dtype="float32")
    frozen = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.SGD(policy.parameters(), lr=LR)
    losses = []
    for b in batches:
        rows = b.rows
        with torch.no_grad():
            ref = logps_of(frozen, rows) if beta else None
            old = logps_of(policy, rows)
        # each group's advantages by hand: (r - mean) / (std + 1e-4)
        grouped = b.rewards.view(-1, b.rollout.group_size)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
        for _ in range(iterations):
            logps = logps_of(policy, rows)
            loss = direct_grpo_loss(
                logps,
                old if iterations > 1 else logps.detach(),
                ref,
                adv,
                rows["labels"],
                beta=beta,
                loss_type="grpo",
                max_tokens=6,
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in policy.state_dict().items()}


def full_run(d: Path, out: str, *, beta: float, iterations: int, **over):
    method = {
        "tuning": "full",
        "beta": beta,
        "num_iterations": iterations,
        "epsilon": EPS,  # direct_grpo_loss's clip
        "epsilon_high": EPS_HIGH,
    }
    hyper = {"optimizer": "sgd", "learning_rate": LR, "max_grad_norm": None, **over.pop("hyper", {})}
    return config(d, out, method=method, hyper=hyper, **over)


@pytest.mark.parametrize(
    ("beta", "iterations"), [(0.1, 1), (0.0, 2), (0.1, 2)], ids=["full-kl", "full-mu2", "full-kl-mu2"]
)
def test_a_grpo_run_equals_the_plain_loop_on_its_completions(
    workspace: Path,
    beta: float,
    iterations: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches: list[RolloutBatch] = []
    collect = GRPORun.collect

    def recorded(self: GRPORun, engine, prompts):  # the run's own completions and rewards
        batch = collect(self, engine, prompts)
        batches.append(batch)
        return batch

    monkeypatch.setattr(GRPORun, "collect", recorded)
    sink = ListSink()
    result = train(full_run(workspace, f"plain-{beta}-{iterations}", beta=beta, iterations=iterations), sink)
    assert result.step == 4 and len(batches) == 4 // iterations  # one batch of completions per mu steps
    for b in batches:  # each batch's prompts, as the batcher served them, trained mu times
        assert b.used == iterations
    ref_losses, ref_state = plain_grpo_run(workspace / "model", batches, beta=beta, iterations=iterations)
    losses = [m["loss/train"] for _, m in sink.records if "loss/train" in m]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL, (losses, ref_losses)
    state, _ = load_state(result.checkpoint)
    assert max_diff(state["masters"], ref_state) < TOL
    initial = {k: v.float() for k, v in load_model(workspace / "model").state_dict().items()}
    assert max_diff(ref_state, initial) > 1e-3  # it really trained
    logged = [m for _, m in sink.records]
    clipped = [m["grpo/clip_fraction"] for m in logged if "grpo/clip_fraction" in m]
    kl = [m["grpo/kl"] for m in logged if "grpo/kl" in m]
    assert len(clipped) == 4 and (max(kl) > 0) == bool(beta), kl
    assert (max(clipped) > 0) == (iterations > 1), clipped  # the ratio moves only on reused batches
    # the rewards and samples of each batch, once
    assert len([m for m in logged if "reward/mean" in m]) == len(batches)
    assert [d["step"] for kind, _, d in sink.events if kind == "samples"] == list(range(1, 5, iterations))
    kept = [d for kind, _, d in sink.events if kind == EngineEvent.REFERENCE]
    assert (len(kept) == 1) == bool(beta) and (not kept or kept[0]["bytes"] > 0)


def test_a_run_checkpointed_between_two_steps_on_a_batch_resumes_bitwise(workspace: Path) -> None:
    kw = {"beta": 0.05, "iterations": 2}
    whole = train(full_run(workspace, "whole-mu2", **kw), ListSink())
    assert whole.step == 4
    part = train(full_run(workspace, "part-mu2", **kw, hyper={"max_steps": 3}), ListSink())
    assert part.step == 3  # the second batch trained once of twice: the checkpoint keeps it
    kept = load_method_state(part.checkpoint)["rollout_batch"]
    assert kept["used"] == 1 and kept["old"] is not None and kept["reference"] is not None
    sink = ListSink()
    resumed = train(full_run(workspace, "part-mu2", **kw), sink)
    assert resumed.step == 4 and any(kind == "resume" for kind, _, _ in sink.events)
    assert not [d for kind, _, d in sink.events if kind == "samples"]  # step 4 sampled nothing
    assert load_method_state(resumed.checkpoint) == {}  # its batch is used up
    a, _ = load_state(whole.checkpoint)
    b, _ = load_state(resumed.checkpoint)
    for key, value in a["masters"].items():
        assert value.equal(b["masters"][key]), key


def test_the_batcher_serves_each_batch_num_iterations_times() -> None:
    prompts = [PromptItem(i, [i + 1, i + 2], f"p{i}", {}) for i in range(7)]
    once = Batcher(prompts, 3, seed=4, pad_id=0)
    twice = Batcher(prompts, 3, seed=4, pad_id=0, repeat=2)
    assert (once.steps_per_epoch, twice.steps_per_epoch) == (2, 4)
    rows = [once.next()["rows"].tolist() for _ in range(4)]  # two epochs
    served = [twice.next()["rows"].tolist() for _ in range(5)]
    assert served == [rows[0], rows[0], rows[1], rows[1], rows[2]]
    resumed = Batcher(prompts, 3, seed=4, pad_id=0, repeat=2)
    resumed.load_state_dict(Batcher(prompts, 3, seed=4, pad_id=0, repeat=2).state_dict() | {"position": 3})
    assert resumed.next()["rows"].tolist() == rows[1]  # the second time of the second batch
    with pytest.raises(ValueError, match="repeat=0"):
        Batcher(prompts, 3, seed=4, pad_id=0, repeat=0)


def test_num_iterations_is_checked_and_a_full_fine_tune_takes_a_kl_term(workspace: Path) -> None:
    spec = method_options(objective="grpo", tuning="full", grader=GRADER, beta=0.04, num_iterations=4)
    assert (spec.beta, spec.num_iterations) == (0.04, 4)
    assert method_options(objective="grpo", grader=GRADER).num_iterations == 1
    for bad in (0, 17):
        with pytest.raises(ConfigError) as refused:
            config(workspace, "x", method={"num_iterations": bad})
        assert refused.value.field == "method.num_iterations" and str(bad) in str(refused.value)
