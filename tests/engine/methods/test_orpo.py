"""ORPO through the engine equals a plain PyTorch ORPO loop on the unsplit model; the loss math."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.methods.orpo import train as orpo
from engine.methods.orpo.train import OrpoStats, orpo_losses
from engine.metrics import ListSink
from tests.engine.methods.test_dpo import direct_logps, lora_model, pair_batch
from tests.engine.tiny import SPLIT_PLAN, bitwise_equal, max_diff, tiny_model

SGD_TOL = 1e-5
BETA = 0.5  # the odds-ratio loss's weight (the paper's lambda); larger than 0.1 so it moves visibly
LR = 0.5


def direct_orpo(logps: torch.Tensor, labels: torch.Tensor, beta: float) -> torch.Tensor:
    """The mean ORPO loss over pairs, written out from the paper's formula.

    ``P(y|x)`` is the length-normalised likelihood ``exp(mean token log-probability)``;
    ``odds = P / (1 - P)``; the loss is the chosen answer's NLL (per token) plus
    ``beta * -log sigmoid(log(odds_chosen / odds_rejected))``.
    """
    tokens = (labels[:, 1:] != -100).sum(dim=1).float()
    p = torch.exp(logps / tokens)
    odds = p / (1 - p)
    ratio = torch.log(odds[0::2]) - torch.log(odds[1::2])
    nll = -(logps[0::2] / tokens[0::2])
    return (nll - beta * torch.log(torch.sigmoid(ratio))).mean()


def plain_orpo_loop(model, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """ORPO the ordinary way: the unsplit model, the whole batch, torch SGD, no reference."""
    policy = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches:
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = direct_orpo(direct_logps(logits, batch["labels"]), batch["labels"], BETA)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in policy.state_dict().items()}


def engine_orpo_loop(model, batches, config: EngineConfig, sink=None):
    with RoundPipe(copy.deepcopy(model), config, sink=sink) as rp:
        stats = []
        for batch in batches:
            stats.append(orpo.forward_backward(rp, **batch, beta=BETA))
            rp.step()
        return stats, rp.master_state_dict()


@pytest.fixture(scope="module")
def pair_batches() -> list[dict[str, torch.Tensor]]:
    return [pair_batch(pairs=5, seed=s) for s in (4, 5, 6)]


def test_the_loss_matches_the_papers_formula() -> None:
    batch = pair_batch(pairs=4, seed=9)
    labels = batch["labels"]
    tokens = (labels[:, 1:] != -100).sum(dim=1)
    logps = -torch.rand(8, generator=torch.Generator().manual_seed(0)) * tokens  # mean in (-1, 0)
    expected = direct_orpo(logps, labels, BETA)
    assert orpo_losses(logps, tokens, BETA).mean().item() == pytest.approx(expected.item(), abs=1e-6)
    stats = OrpoStats.of(logps, tokens, BETA)
    assert stats.loss == pytest.approx(expected.item(), abs=1e-6)
    assert stats.pairs == 4 and 0.0 <= stats.reward_accuracy <= 1.0
    # the gradient pushes the chosen answers' log-probabilities up and the rejected ones down
    p = logps.clone().requires_grad_(True)
    orpo_losses(p, tokens, BETA).sum().backward()
    assert p.grad is not None and bool((p.grad[0::2] < 0).all()) and bool((p.grad[1::2] > 0).all())
    with pytest.raises(ValueError, match=r"\[2 \* pairs\]"):
        orpo_losses(logps[:5], tokens[:5], BETA)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sync_orpo_equals_the_plain_orpo_loop(lora: bool, workers: int, pair_batches) -> None:
    model = lora_model() if lora else tiny_model("llama")
    ref_losses, ref_state = plain_orpo_loop(model, pair_batches)
    initial = {k: v.detach().float() for k, v in model.state_dict().items()}
    assert max_diff(ref_state, initial) > 1e-3  # the loop really trained
    for m, plan in ((workers, None), (min(workers + 2, 5), SPLIT_PLAN)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=m, optimizer="sgd", lr=LR, partition=plan
        )
        stats, state = engine_orpo_loop(model, pair_batches, config)
        losses = [s.loss for s in stats]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL, (
            losses,
            ref_losses,
        )
        assert max_diff(state, ref_state) < SGD_TOL, (m, max_diff(state, ref_state))
        if lora:  # only the adapter moved
            for k, v in initial.items():
                assert (not torch.equal(state[k], v)) == ("lora_" in k), k


def test_orpo_is_bitwise_identical_for_any_worker_count_and_partition(pair_batches) -> None:
    model = lora_model()
    results = []
    for workers, plan in ((1, None), (2, SPLIT_PLAN), (3, SPLIT_PLAN), (3, None)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=LR, partition=plan
        )
        results.append(engine_orpo_loop(model, pair_batches, config))
    stats0, state0 = results[0]
    for stats, state in results[1:]:
        assert [s.loss for s in stats] == [s.loss for s in stats0]
        assert bitwise_equal(state, state0)


def test_orpo_metrics_reach_the_sink_with_the_step(pair_batches) -> None:
    sink = ListSink()
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=LR)
    stats, _ = engine_orpo_loop(tiny_model("llama"), pair_batches[:1], config, sink=sink)
    logged = {k: v for _, metrics in sink.records for k, v in metrics.items()}
    for key, value in stats[0].metrics().items():
        assert logged[key] == pytest.approx(value, abs=1e-6), key
    assert logged["orpo/pairs"] == 5.0
    assert logged["loss/train"] == pytest.approx(stats[0].loss, abs=1e-6)
    labels = pair_batches[0]["labels"]
    assert logged["tokens/label"] == float((labels[:, 1:] != -100).sum())


def test_orpo_refuses_bad_input_and_evaluates_without_training(pair_batches) -> None:
    batch = pair_batch(pairs=2)
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd")
    with RoundPipe(tiny_model("llama"), config) as rp:
        with pytest.raises(ValueError, match=r"batch of 2 pairs \(4 rows\) cannot fill num_microbatches=3"):
            orpo.forward_backward(rp, **batch, beta=0.1)
        with pytest.raises(ValueError, match="beta=0: must be a finite number > 0"):
            orpo.forward_backward(rp, **batch, beta=0)
        before = rp.master_state_dict()
        stats = orpo.evaluate(rp, **batch, beta=0.1)
        assert stats.pairs == 2 and math.isfinite(stats.loss)
        assert bitwise_equal(rp.master_state_dict(), before)


def test_every_registered_method_has_its_run_and_objective() -> None:
    from engine.methods import METHODS
    from engine.methods.base import MethodRun
    from engine.parallel.objective import Objective
    from engine.parallel.pairs import PairScores

    for entry in METHODS.values():
        assert issubclass(entry.run_class(), MethodRun), entry.name
        objective = entry.objective_class()
        assert issubclass(objective, Objective), entry.name
        # a method on pairs scores whole sequences; a supervised one scores tokens
        assert issubclass(objective, PairScores) == (entry.data_format == "preference"), entry.name
        assert objective.per_sequence == (entry.data_format == "preference"), entry.name
