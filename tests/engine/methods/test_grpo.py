"""GRPO through the engine equals a plain PyTorch GRPO loop on the unsplit model, given the same
completions and rewards; the advantages and the per-token objective written out by hand. The KL
term's reference is the base (a LoRA run's adapters off) or a frozen copy of the initial weights (a
full fine-tune's); with ``num_iterations`` each batch trains several steps against the
log-probabilities the policy had before the first."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.methods.grpo.train import GRPOObjective, divisor, group_advantages
from engine.model.loss import token_logps
from engine.parallel.objective import objective_metrics
from tests.engine.tiny import SPLIT_PLAN, VOCAB, bitwise_equal, max_diff, tiny_model

SGD_TOL = 1e-5
LR = 0.5
GROUP = 3
EPS, EPS_HIGH = 0.2, 0.28


def lora_model(family: str = "llama"):
    """A tiny model with a LoRA adapter whose B is not zero (the policy differs from the base)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(family, tied=False),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def rollout_batch(groups: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """``groups * GROUP`` rows: each group's prompt (4-6 tokens), then completions of 2-6 tokens,
    right-padded; labels on the completion tokens only."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(4, 7, (1,), generator=g)),), generator=g)
        for _ in range(GROUP):
            completion = torch.randint(0, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
            rows.append((prompt, completion))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.cat([p, c])
        labels[i, len(p) : n] = c
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def rewards_for(step: int, rows: int) -> torch.Tensor:
    """Fixed rewards in [0, 1], not all equal within a group."""
    return torch.rand(rows, generator=torch.Generator().manual_seed(100 + step))


def direct_advantages(rewards: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(rewards)
    for start in range(0, len(rewards), GROUP):
        r = rewards[start : start + GROUP]
        out[start : start + GROUP] = (r - r.mean()) / (r.std() + 1e-4)
    return out


def direct_grpo_loss(logps, old, ref, advantages, labels, *, beta: float, loss_type: str, max_tokens: int):
    """GRPO's loss written out from the papers: clipped ratio, k3 KL, and the three averagings."""
    mask = (labels[:, 1:] != -100).float()
    ratio = torch.exp(logps - old)
    a = advantages[:, None]
    per = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS_HIGH) * a)
    if beta:
        per = per + beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    per = per * mask
    if loss_type == "grpo":
        return (per.sum(1) / mask.sum(1)).mean()
    if loss_type == "dapo":
        return per.sum() / mask.sum()
    return per.sum() / (labels.shape[0] * max_tokens)


def logps_of(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_logps(logits, batch["labels"])


def reference_logps(model, batch, frozen=None) -> torch.Tensor:
    """The base model's (a LoRA model's adapters off), or with ``frozen`` that model's: a full
    fine-tune's copy of its initial weights."""
    with torch.no_grad():
        if frozen is not None:
            return logps_of(frozen, batch)
        with model.disable_adapter():
            return logps_of(model, batch)


def plain_grpo_loop(
    model, batches, olds, *, beta: float, loss_type: str, max_tokens: int = 8, iterations: int = 1
):
    """GRPO the ordinary way: the unsplit model, the whole batch, torch SGD. A full fine-tune's
    reference is a frozen copy of the initial model; with ``iterations`` (the paper's mu) each
    batch trains that many steps, its old log-probabilities taken before the first."""
    policy = copy.deepcopy(model)
    lora = any("lora_" in n for n, _ in policy.named_parameters())
    frozen = None if lora else copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step, (batch, old) in enumerate(zip(batches, olds, strict=True)):
        ref = reference_logps(policy, batch, frozen) if beta else None
        if iterations > 1:
            with torch.no_grad():
                old = logps_of(policy, batch)
        adv = direct_advantages(rewards_for(step, batch["input_ids"].shape[0]))
        for _ in range(iterations):
            logps = logps_of(policy, batch)
            loss = direct_grpo_loss(
                logps,
                logps.detach() if old is None else old,
                ref,
                adv,
                batch["labels"],
                beta=beta,
                loss_type=loss_type,
                max_tokens=max_tokens,
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in policy.state_dict().items()}


def engine_grpo_loop(
    model, batches, olds, config: EngineConfig, *, beta: float, loss_type: str, max_tokens=8, iterations=1
):
    with RoundPipe(copy.deepcopy(model), config) as rp:
        lora = any("lora_" in n for n in rp.master_state_dict(trainable_only=True))
        if beta and not lora:
            rp.keep_initial_weights()
        losses, metrics = [], []
        for step, (batch, old) in enumerate(zip(batches, olds, strict=True)):
            ref = rp.token_logps(**batch, adapters=False) if beta and lora else None
            if beta and not lora:
                ref = rp.token_logps(**batch, initial=True)
            if iterations > 1:
                old = rp.token_logps(**batch)
            adv = group_advantages(rewards_for(step, batch["input_ids"].shape[0]), GROUP)
            for _ in range(iterations):
                objective = GRPOObjective(
                    adv,
                    reference=ref,
                    old=old,
                    loss_type=loss_type,
                    epsilon=EPS,
                    epsilon_high=EPS_HIGH,
                    beta=beta,
                )
                it = rp.forward_backward_tokens(
                    objective, **batch, divisor=divisor(loss_type, batch["labels"], max_tokens)
                )
                losses.append(it.loss_sum() / it.total_tokens)
                metrics.append(objective_metrics([it]))
                rp.step()
        return losses, rp.master_state_dict(), metrics


@pytest.fixture(scope="module")
def batches() -> list[dict[str, torch.Tensor]]:
    return [rollout_batch(seed=s) for s in (1, 2, 3)]


def initial_olds(model, batches) -> list[torch.Tensor]:
    """The initial policy's token log-probabilities: later steps' ratios move away from 1."""
    with torch.no_grad():
        out = []
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            out.append(token_logps(logits, b["labels"]))
        return out


def test_advantages_are_group_relative() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, 3)
    assert torch.allclose(adv, direct_advantages(rewards), atol=1e-7)
    assert adv[0] > 0 > adv[1] and float(adv[:3].sum()).__abs__() < 1e-6
    assert torch.equal(adv[3:], torch.zeros(3))  # a group that scored alike teaches nothing
    assert torch.allclose(
        group_advantages(rewards, 3, scale=False)[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3])
    )
    with pytest.raises(ValueError, match="do not fill groups of 4"):
        group_advantages(rewards, 4)


@pytest.mark.parametrize(
    ("family", "lora", "beta", "loss_type", "ratio"),
    [
        ("llama", True, 0.1, "grpo", False),
        ("llama", True, 0.0, "dapo", True),
        ("llama", False, 0.0, "grpo", True),
        ("llama", False, 0.0, "dr_grpo", False),
        ("qwen3_moe", True, 0.05, "dapo", True),
        ("qwen3_moe", False, 0.0, "grpo", False),
    ],
    ids=[
        "llama-lora-kl",
        "llama-lora-dapo-ratio",
        "llama-full-ratio",
        "llama-full-drgrpo",
        "moe-lora-kl",
        "moe-full",
    ],
)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sync_grpo_equals_the_plain_grpo_loop(family, lora, beta, loss_type, ratio, workers, batches) -> None:
    model = lora_model(family) if lora else tiny_model(family)
    olds = initial_olds(model, batches) if ratio else [None] * len(batches)
    ref_losses, ref_state = plain_grpo_loop(model, batches, olds, beta=beta, loss_type=loss_type)
    initial = {k: v.detach().float() for k, v in model.state_dict().items()}
    assert max_diff(ref_state, initial) > 1e-3  # the loop really trained
    plans = ((workers, None), (min(workers + 2, 5), SPLIT_PLAN))
    for m, plan in plans if family == "llama" else plans[:1]:
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=m, optimizer="sgd", lr=LR, partition=plan
        )
        losses, state, metrics = engine_grpo_loop(
            model, batches, olds, config, beta=beta, loss_type=loss_type
        )
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL, (
            losses,
            ref_losses,
        )
        assert max_diff(state, ref_state) < SGD_TOL, (m, max_diff(state, ref_state))
        if ratio and not lora:  # a full fine-tune's later ratios moved far enough to be clipped
            assert max(x["grpo/clip_fraction"] for x in metrics) > 0
        elif not ratio:  # on-policy: every ratio is 1
            assert all(x["grpo/clip_fraction"] == 0 for x in metrics)
        assert (max(x["grpo/kl"] for x in metrics) > 0) == bool(beta)
        if lora:
            for k, v in initial.items():
                assert (not torch.equal(state[k], v)) == ("lora_" in k), k


@pytest.mark.parametrize(
    ("family", "beta", "loss_type", "iterations"),
    [
        ("llama", 0.1, "grpo", 1),
        ("llama", 0.05, "dapo", 2),
        ("llama", 0.2, "dr_grpo", 2),
        ("qwen3_moe", 0.1, "grpo", 2),
    ],
    ids=["llama-kl", "llama-kl-dapo-mu2", "llama-kl-drgrpo-mu2", "moe-kl-mu2"],
)
@pytest.mark.parametrize("workers", [1, 3])
def test_a_full_fine_tune_s_kl_term_equals_the_plain_grpo_loop(
    family, beta, loss_type, iterations, workers, batches
) -> None:
    # its reference is a frozen copy of its initial weights; with num_iterations (mu) each batch
    # trains mu steps against the log-probabilities from before the first
    model = tiny_model(family)
    olds = [None] * len(batches)
    kw = {"beta": beta, "loss_type": loss_type, "iterations": iterations}
    ref_losses, ref_state = plain_grpo_loop(model, batches, olds, **kw)
    assert len(ref_losses) == iterations * len(batches)
    initial = {k: v.detach().float() for k, v in model.state_dict().items()}
    assert max_diff(ref_state, initial) > 1e-3  # the loop really trained
    plans = ((workers, None), (min(workers + 2, 5), SPLIT_PLAN))
    for m, plan in plans if family == "llama" else plans[:1]:
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=m, optimizer="sgd", lr=LR, partition=plan
        )
        losses, state, metrics = engine_grpo_loop(model, batches, olds, config, **kw)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL, (
            losses,
            ref_losses,
        )
        assert max_diff(state, ref_state) < SGD_TOL, (m, max_diff(state, ref_state))
        clipped = [x["grpo/clip_fraction"] for x in metrics]
        # a batch's first step is on-policy (ratio 1); the later ones moved enough to be clipped
        assert all(c == 0 for c in clipped[::iterations]), clipped
        assert (max(clipped) > 0) == (iterations > 1), clipped
        kl = [x["grpo/kl"] for x in metrics]
        # the first step's weights are the reference: no KL yet; later steps moved away
        assert kl[0] == 0 and max(kl) > 0, kl


def test_the_initial_weights_stay_what_they_were(batches) -> None:
    # the copy is the reference model: the policy trains, the copy scores as the initial model
    model = tiny_model("llama")
    batch = batches[0]
    expected = initial_olds(model, [batch])[0]
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=LR)
    with RoundPipe(copy.deepcopy(model), config) as rp:
        with pytest.raises(ValueError, match=r"initial=True\): no initial weights kept"):
            rp.token_logps(**batch, initial=True)
        size = rp.keep_initial_weights()
        assert size == sum(p.numel() * 4 for p in model.parameters())  # fp32 compute on the CPU
        assert rp.keep_initial_weights() == size  # kept once
        for _ in range(2):
            rp.forward_backward(**batch)
            rp.step()
        moved = rp.token_logps(**batch)
        kept = rp.token_logps(**batch, initial=True)
        assert (kept - expected).abs().max() < 1e-6
        assert (moved - expected).abs().max() > 1e-3


def test_grpo_is_bitwise_identical_for_any_worker_count_and_partition(batches) -> None:
    model = lora_model()
    results = []
    for workers, plan in ((1, None), (2, SPLIT_PLAN), (3, SPLIT_PLAN), (3, None)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=LR, partition=plan
        )
        results.append(engine_grpo_loop(model, batches, [None] * 3, config, beta=0.1, loss_type="dapo"))
    losses0, state0, _ = results[0]
    for losses, state, _ in results[1:]:
        assert losses == losses0
        assert bitwise_equal(state, state0)


def test_token_logps_equal_the_full_logits_and_refuse_bad_input(batches) -> None:
    model = tiny_model("llama")
    batch = batches[0]
    expected = initial_olds(model, [batch])[0]
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu", "cpu"], num_microbatches=2)) as rp:
        got = rp.token_logps(**batch)
        assert got.shape == expected.shape and (got - expected).abs().max() < 1e-6
        assert bool((got[batch["labels"][:, 1:] == -100] == 0).all())
        with pytest.raises(ValueError, match="no LoRA adapter to turn off"):
            rp.token_logps(**batch, adapters=False)
        objective = GRPOObjective(torch.zeros(9))
        with pytest.raises(ValueError, match="divisor=0"):
            rp.forward_backward_tokens(objective, **batch, divisor=0)
    with pytest.raises(ValueError, match="needs the reference"):
        GRPOObjective(torch.zeros(9), beta=0.1)
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        GRPOObjective(torch.zeros(9), loss_type="ppo")
