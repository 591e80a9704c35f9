"""KTO through the engine equals a plain PyTorch KTO loop on the unsplit model (TRL's definitions:
summed completion log-probabilities, the KL estimate from mismatched rows clamped at 0 and
detached, the mean of the weighted sigmoid losses); bitwise for any worker count; its loss math
against TRL's formulas written out; the rows' mismatched completions."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.data.sequences import Encoded, EncodedUnpaired
from engine.methods.kto import train as kto
from engine.methods.kto.train import kl_estimate, kto_losses, mismatched
from tests.engine.methods.test_dpo import direct_logps, lora_model
from tests.engine.tiny import SPLIT_PLAN, VOCAB, bitwise_equal, max_diff, tiny_model

SGD_TOL = 1e-5
BETA = 0.5
LR = 0.5
WEIGHTS = (1.0, 1.5)  # desirable, undesirable: unequal, so each weight is checked


def row(prompt: torch.Tensor, answer: torch.Tensor, seq: int) -> tuple[torch.Tensor, ...]:
    n = len(prompt) + len(answer)
    ids = torch.zeros(seq, dtype=torch.long)
    labels = torch.full((seq,), -100, dtype=torch.long)
    mask = torch.zeros(seq, dtype=torch.long)
    ids[:n] = torch.cat([prompt, answer])
    labels[len(prompt) : n] = answer
    mask[:n] = 1
    return ids, labels, mask


def kto_batch(rows: int = 6, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """``rows`` random prompts, each with a completion and a label (alternating, so both kinds are
    in every batch); each row's mismatched row is its prompt with the previous row's completion."""
    g = torch.Generator().manual_seed(seed)
    prompts, answers = [], []
    for _ in range(rows):
        n_prompt = int(torch.randint(2, 5, (1,), generator=g))
        prompts.append(torch.randint(0, VOCAB, (n_prompt,), generator=g))
        n = int(torch.randint(2, seq - n_prompt - 1, (1,), generator=g))
        answers.append(torch.randint(0, VOCAB, (n,), generator=g))
    main = [row(prompts[i], answers[i], seq) for i in range(rows)]
    kl = [row(prompts[i], answers[i - 1], seq) for i in range(rows)]
    return {
        "input_ids": torch.stack([r[0] for r in main]),
        "labels": torch.stack([r[1] for r in main]),
        "attention_mask": torch.stack([r[2] for r in main]),
        "kl_input_ids": torch.stack([r[0] for r in kl]),
        "kl_labels": torch.stack([r[1] for r in kl]),
        "kl_attention_mask": torch.stack([r[2] for r in kl]),
        "desirable": torch.tensor([i % 2 == 0 for i in range(rows)]),
    }


def trl_kto_loss(policy, reference, policy_kl, reference_kl, desirable) -> torch.Tensor:
    """TRL's KTO loss (``kto_loss``, loss_type "kto"), written out from its definitions."""
    kl = (policy_kl - reference_kl).mean().clamp(min=0).detach()
    chosen = policy[desirable] - reference[desirable]
    rejected = policy[~desirable] - reference[~desirable]
    chosen_losses = 1 - torch.sigmoid(BETA * (chosen - kl))
    rejected_losses = 1 - torch.sigmoid(BETA * (kl - rejected))
    return torch.cat([WEIGHTS[0] * chosen_losses, WEIGHTS[1] * rejected_losses]).nanmean()


def logps_of(model, batch, prefix: str = "") -> torch.Tensor:
    ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"]
    return direct_logps(model(input_ids=ids, attention_mask=mask).logits, batch[f"{prefix}labels"])


def plain_kto_loop(model, batches, *, lora: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """KTO the ordinary way: the unsplit model, the whole batch, torch SGD; the reference the base
    with the adapter disabled or a frozen copy of the initial weights."""
    policy = copy.deepcopy(model)
    frozen = None if lora else copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches:
        with torch.no_grad():
            if lora:
                with policy.disable_adapter():
                    reference, reference_kl = logps_of(policy, batch), logps_of(policy, batch, "kl_")
            else:
                assert frozen is not None
                reference, reference_kl = logps_of(frozen, batch), logps_of(frozen, batch, "kl_")
            policy_kl = logps_of(policy, batch, "kl_")
        loss = trl_kto_loss(logps_of(policy, batch), reference, policy_kl, reference_kl, batch["desirable"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in policy.state_dict().items()}


def engine_kto_loop(model, batches, config: EngineConfig, *, lora: bool):
    """The same through RoundPipe: the reference's log-probabilities once up front (the base, or
    the initial weights), then KTO steps."""
    with RoundPipe(copy.deepcopy(model), config) as rp:
        references = []
        for b in batches:
            own = {k: b[k] for k in ("input_ids", "labels", "attention_mask")}
            kl = {k: b[f"kl_{k}"] for k in ("input_ids", "labels", "attention_mask")}
            references.append(
                (rp.sequence_logps(**own, adapters=not lora), rp.sequence_logps(**kl, adapters=not lora))
            )
        stats = []
        for batch, (reference, reference_kl) in zip(batches, references, strict=True):
            stats.append(
                kto.forward_backward(
                    rp,
                    **batch,
                    reference_logps=reference,
                    kl_reference_logps=reference_kl,
                    beta=BETA,
                    desirable_weight=WEIGHTS[0],
                    undesirable_weight=WEIGHTS[1],
                )
            )
            rp.step()
        return stats, rp.master_state_dict()


@pytest.fixture(scope="module")
def batches() -> list[dict[str, torch.Tensor]]:
    return [kto_batch(rows=6, seed=s) for s in (1, 2, 3)]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_kto_equals_the_plain_kto_loop(lora: bool, workers: int, batches) -> None:
    model = lora_model() if lora else tiny_model("llama")
    ref_losses, ref_state = plain_kto_loop(model, batches, lora=lora)
    initial = {k: v.detach().float() for k, v in model.state_dict().items()}
    assert max_diff(ref_state, initial) > 1e-4  # the loop really trained
    for m, plan in ((workers, None), (min(workers + 2, 6), SPLIT_PLAN)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=m, optimizer="sgd", lr=LR, partition=plan
        )
        stats, state = engine_kto_loop(model, batches, config, lora=lora)
        losses = [s.loss for s in stats]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL, (
            m,
            losses,
            ref_losses,
        )
        assert max_diff(state, ref_state) < SGD_TOL, (m, max_diff(state, ref_state))
        assert stats[0].desirable == 3 and stats[0].undesirable == 3
        assert any(s.kl > 0 for s in stats) or all(s.kl == 0 for s in stats)
        if lora:  # only the adapter moved
            for k, v in initial.items():
                assert (not torch.equal(state[k], v)) == ("lora_" in k), k


def test_kto_is_bitwise_identical_for_any_worker_count_and_partition(batches) -> None:
    model = lora_model()
    results = []
    for workers, plan in ((1, None), (2, SPLIT_PLAN), (3, SPLIT_PLAN), (3, None)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=LR, partition=plan
        )
        results.append(engine_kto_loop(model, batches, config, lora=True))
    stats0, state0 = results[0]
    for stats, state in results[1:]:
        assert [s.loss for s in stats] == [s.loss for s in stats0]
        assert bitwise_equal(state, state0)


def test_the_kl_estimate_is_clamped_and_the_losses_are_trls() -> None:
    assert kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([0.0, 0.0])) == 0.0
    assert kl_estimate(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5])) == pytest.approx(1.0)
    logratio = torch.tensor([0.3, -0.2, 1.0, -1.5])
    desirable = torch.tensor([True, False, True, False])
    got = kto_losses(logratio, desirable, 0.25, beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)
    want = torch.tensor(
        [
            2.0 * (1 - torch.sigmoid(torch.tensor(0.1 * (0.3 - 0.25)))),
            0.5 * (1 - torch.sigmoid(torch.tensor(0.1 * (0.25 + 0.2)))),
            2.0 * (1 - torch.sigmoid(torch.tensor(0.1 * (1.0 - 0.25)))),
            0.5 * (1 - torch.sigmoid(torch.tensor(0.1 * (0.25 + 1.5)))),
        ]
    )
    assert torch.allclose(got, want, atol=1e-7)
    # a policy equal to its reference with no KL: every loss is half its weight
    same = kto_losses(torch.zeros(2), torch.tensor([True, False]), 0.0, beta=0.1, undesirable_weight=3.0)
    assert same.tolist() == [0.5, 1.5]


def test_each_row_is_mismatched_with_the_previous_completion_of_its_chunk() -> None:
    def unpaired(line: int, prompt: list[int], completion: list[int], label: bool) -> EncodedUnpaired:
        ids, labels = prompt + completion, [-100] * len(prompt) + completion
        return EncodedUnpaired(line, Encoded(line, ids, labels, length=len(ids), truncated=False), label)

    rows = [unpaired(i, [10 + i, 20 + i], [30 + i] * (i + 1), i % 2 == 0) for i in range(5)]
    kl = mismatched(rows, chunk=2, max_length=64)
    # chunks [0, 1], [2, 3], [4]: each takes the other's completion; a chunk of one its own
    assert [k.input_ids for k in kl] == [
        [10, 20, 31, 31],
        [11, 21, 30],
        [12, 22, 33, 33, 33, 33],
        [13, 23, 32, 32, 32],
        [14, 24, 34, 34, 34, 34, 34],
    ]
    assert all(k.labels[:2] == [-100, -100] for k in kl)
    cut = mismatched(rows, chunk=5, max_length=4)
    assert [len(k.input_ids) for k in cut] == [4, 3, 4, 4, 4] and cut[0].truncated
