"""DPO through the engine equals a plain PyTorch DPO loop; the loss math; whole pairs per micro-batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.methods.dpo import train as dpo
from engine.methods.dpo.train import PairStats, dpo_loss_sum, dpo_losses, pair_rewards
from engine.metrics import ListSink
from engine.model.loss import chunked_sequence_logps, sequence_logps
from engine.parallel.pairs import split_pairs
from tests.engine.tiny import SPLIT_PLAN, VOCAB, bitwise_equal, max_diff, tiny_model

SGD_TOL = 1e-5
BETA = 0.5  # larger than the usual 0.1: the tiny models' rewards move visibly in 3 steps
LR = 0.5


def pair_batch(pairs: int = 5, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """``pairs`` random prompts, each with two answers of different lengths, right-padded:
    row ``2i`` the chosen and ``2i + 1`` the rejected answer of pair ``i``, labels on the answers."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2 * pairs, seq, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i in range(pairs):
        n_prompt = int(torch.randint(2, 5, (1,), generator=g))
        prompt = torch.randint(0, VOCAB, (n_prompt,), generator=g)
        for k in (0, 1):
            n = int(torch.randint(n_prompt + 2, seq + 1, (1,), generator=g))
            answer = torch.randint(0, VOCAB, (n - n_prompt,), generator=g)
            row = 2 * i + k
            ids[row, :n] = torch.cat([prompt, answer])
            mask[row, :n] = 1
            labels[row, n_prompt:n] = answer
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def direct_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row sum of log softmax picked at the next label (written out, not the module's)."""
    logp = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)
    targets = labels[:, 1:]
    keep = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum(dim=-1)


def direct_dpo(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """The mean DPO loss over pairs, from the paper's formula."""
    margin = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    return -torch.log(torch.sigmoid(beta * margin)).mean()


def lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model("llama", tied=False),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    # peft initialises B to zero: a non-zero adapter makes the policy differ from the base
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def plain_dpo_loop(model, batches, *, lora: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """DPO the ordinary way: the unsplit model, the whole batch, torch SGD. The reference is the
    base with the adapter disabled (peft's ``disable_adapter()``) or a frozen initial copy."""
    policy = copy.deepcopy(model)
    frozen = None if lora else copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.no_grad():
            if lora:
                with policy.disable_adapter():
                    reference = direct_logps(policy(**inputs).logits, batch["labels"])
            else:
                assert frozen is not None
                reference = direct_logps(frozen(**inputs).logits, batch["labels"])
        loss = direct_dpo(direct_logps(policy(**inputs).logits, batch["labels"]), reference, BETA)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in policy.state_dict().items()}


def engine_dpo_loop(model, batches, config: EngineConfig, *, lora: bool, sink=None):
    """The same through RoundPipe: reference log-probabilities once up front, then DPO steps."""
    with RoundPipe(copy.deepcopy(model), config, sink=sink) as rp:
        references = [rp.sequence_logps(**b, adapters=not lora) for b in batches]
        stats = []
        for batch, reference in zip(batches, references, strict=True):
            stats.append(dpo.forward_backward(rp, **batch, reference_logps=reference, beta=BETA))
            rp.step()
        return stats, rp.master_state_dict()


@pytest.fixture(scope="module")
def pair_batches() -> list[dict[str, torch.Tensor]]:
    return [pair_batch(pairs=5, seed=s) for s in (1, 2, 3)]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sync_dpo_equals_the_plain_dpo_loop(lora: bool, workers: int, pair_batches) -> None:
    model = lora_model() if lora else tiny_model("llama")
    ref_losses, ref_state = plain_dpo_loop(model, pair_batches, lora=lora)
    initial = {k: v.detach().float() for k, v in model.state_dict().items()}
    assert max_diff(ref_state, initial) > 1e-3  # the loop really trained
    for m, plan in ((workers, None), (min(workers + 2, 5), SPLIT_PLAN)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=m, optimizer="sgd", lr=LR, partition=plan
        )
        stats, state = engine_dpo_loop(model, pair_batches, config, lora=lora)
        losses = [s.loss for s in stats]
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        weight_diff = max_diff(state, ref_state)
        assert loss_diff < SGD_TOL, (m, losses, ref_losses)
        assert weight_diff < SGD_TOL, (m, weight_diff)
        if lora:  # only the adapter moved
            for k, v in initial.items():
                assert (not torch.equal(state[k], v)) == ("lora_" in k), k


def test_dpo_is_bitwise_identical_for_any_worker_count_and_partition(pair_batches) -> None:
    model = lora_model()
    results = []
    for workers, plan in ((1, None), (2, SPLIT_PLAN), (3, SPLIT_PLAN), (3, None)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=LR, partition=plan
        )
        results.append(engine_dpo_loop(model, pair_batches, config, lora=True))
    stats0, state0 = results[0]
    for stats, state in results[1:]:
        assert [s.loss for s in stats] == [s.loss for s in stats0]
        assert bitwise_equal(state, state0)


def test_async_dpo_takes_its_first_two_gradients_at_the_initial_weights(pair_batches) -> None:
    model = lora_model()
    sync = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=LR)
    lagged = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=LR, async_optimizer=True
    )
    sync_stats, _ = engine_dpo_loop(model, pair_batches, sync, lora=True)
    async_stats, async_state = engine_dpo_loop(model, pair_batches, lagged, lora=True)
    with RoundPipe(copy.deepcopy(model), sync) as rp:  # batch 2 at the initial weights
        second = dpo.evaluate(
            rp,
            **pair_batches[1],
            reference_logps=rp.sequence_logps(**pair_batches[1], adapters=False),
            beta=BETA,
        )
    assert async_stats[0].loss == sync_stats[0].loss
    assert abs(async_stats[1].loss - second.loss) < SGD_TOL
    assert abs(async_stats[2].loss - sync_stats[2].loss) > 1e-6  # it really lagged
    assert all(math.isfinite(v) for v in async_state["base_model.model.lm_head.weight"].flatten().tolist())


def test_dpo_metrics_reach_the_sink_with_the_step(pair_batches) -> None:
    sink = ListSink()
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=LR)
    stats, _ = engine_dpo_loop(lora_model(), pair_batches, config, lora=True, sink=sink)
    assert sink.series("loss/train") == [s.loss for s in stats]
    assert sink.series("dpo/reward_margin") == pytest.approx([s.reward_margin for s in stats])
    assert sink.series("dpo/reward_accuracy") == [s.reward_accuracy for s in stats]
    assert sink.series("dpo/chosen_reward") == pytest.approx([s.chosen_reward for s in stats])
    assert sink.series("dpo/rejected_reward") == pytest.approx([s.rejected_reward for s in stats])
    assert sink.series("dpo/pairs") == [5.0, 5.0, 5.0]
    labels = [int((b["labels"][:, 1:] != -100).sum()) for b in pair_batches]
    assert sink.series("tokens/label") == labels


def test_the_preferred_answer_gains_on_the_rejected_one(pair_batches) -> None:
    model = tiny_model("qwen3")
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=LR)
    batch = pair_batches[0]
    with RoundPipe(copy.deepcopy(model), config) as rp:
        before = rp.sequence_logps(**batch)
        for _ in range(6):
            dpo.forward_backward(rp, **batch, reference_logps=before, beta=BETA)
            rp.step()
        after = rp.sequence_logps(**batch)
        stats = dpo.evaluate(rp, **batch, reference_logps=before, beta=BETA)
    gain = (after[0::2] - before[0::2]) - (after[1::2] - before[1::2])
    assert bool((gain > 0).all()), gain
    assert stats.reward_accuracy == 1.0 and stats.reward_margin > 0
    assert stats.loss < math.log(2)  # below the loss of a policy equal to its reference


# -- the adapter switch --------------------------------------------------------------------


def test_sequence_logps_without_adapters_is_the_base_and_the_switch_is_restored() -> None:
    model = lora_model()
    batch = pair_batch(pairs=3, seed=7)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        with_adapter = direct_logps(model(**inputs).logits, batch["labels"])
        with model.disable_adapter():
            base = direct_logps(model(**inputs).logits, batch["labels"])
    assert (with_adapter - base).abs().max() > 1e-3
    config = EngineConfig(devices=["cpu"] * 3, num_microbatches=3, partition=SPLIT_PLAN)
    with RoundPipe(copy.deepcopy(model), config) as rp:
        on = rp.sequence_logps(**batch)
        off = rp.sequence_logps(**batch, adapters=False)
        again = rp.sequence_logps(**batch)
        for worker in rp.workers:  # every worker's copies have their adapters on again
            from engine.parallel.pairs import lora_layers

            layers = lora_layers(worker.modules)
            assert layers and not any(layer.disable_adapters for layer in layers)
    assert (on - with_adapter).abs().max() < 1e-5
    assert (off - base).abs().max() < 1e-5
    assert torch.equal(on, again)


def test_sequence_logps_refuses_to_turn_off_adapters_a_model_does_not_have() -> None:
    batch = pair_batch(pairs=2)
    with (
        RoundPipe(tiny_model("llama"), EngineConfig(num_microbatches=2)) as rp,
        pytest.raises(ValueError, match="no LoRA adapter"),
    ):
        rp.sequence_logps(**batch, adapters=False)


# -- the loss math ---------------------------------------------------------------------------


def test_sequence_logps_and_its_chunked_form_equal_the_direct_formula() -> None:
    torch.manual_seed(0)
    batch = pair_batch(pairs=3, seq=10)
    hidden = torch.randn(6, 10, 16, requires_grad=True)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    expected = direct_logps(head(hidden), batch["labels"])
    assert torch.allclose(sequence_logps(head(hidden), batch["labels"]), expected, atol=1e-5)
    (grad_expected,) = torch.autograd.grad(expected.sum(), hidden)
    for chunk in (1, 7, 54, 4096):
        got = chunked_sequence_logps(hidden, batch["labels"], head, chunk_tokens=chunk)
        assert got.shape == (6,) and torch.allclose(got, expected, atol=1e-5), chunk
        (grad,) = torch.autograd.grad(got.sum(), hidden)
        assert torch.allclose(grad, grad_expected, atol=1e-6), chunk
    # a row without label tokens scores 0
    labels = batch["labels"].clone()
    labels[2] = -100
    assert sequence_logps(head(hidden), labels)[2].item() == 0.0


def test_dpo_loss_and_rewards_equal_the_formula() -> None:
    policy = torch.tensor([-3.0, -5.0, -7.5, -2.0, -1.0, -1.25])
    reference = torch.tensor([-4.0, -4.5, -7.0, -3.0, -1.5, -1.0])
    beta = 0.2
    chosen, rejected = pair_rewards(policy, reference, beta)
    assert torch.allclose(chosen, torch.tensor([0.2, -0.1, 0.1]))
    assert torch.allclose(rejected, torch.tensor([-0.1, 0.2, -0.05]))
    losses = dpo_losses(policy, reference, beta)
    expected = [math.log1p(math.exp(-(c - r))) for c, r in ((0.2, -0.1), (-0.1, 0.2), (0.1, -0.05))]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert dpo_loss_sum(policy, reference, beta).item() == pytest.approx(sum(expected), abs=1e-6)
    stats = PairStats.of(policy, reference, beta)
    assert stats.loss == pytest.approx(sum(expected) / 3, abs=1e-6)
    assert stats.reward_margin == pytest.approx((0.3 - 0.3 + 0.15) / 3, abs=1e-6)
    assert stats.reward_accuracy == pytest.approx(2 / 3)
    assert stats.chosen_reward == pytest.approx(0.2 / 3, abs=1e-6)
    assert stats.rejected_reward == pytest.approx(0.05 / 3, abs=1e-6)
    assert stats.pairs == 3
    assert set(stats.metrics()) == {
        "dpo/reward_margin",
        "dpo/reward_accuracy",
        "dpo/chosen_reward",
        "dpo/rejected_reward",
    }
    # the gradient pushes the chosen log-probabilities up and the rejected ones down
    p = policy.clone().requires_grad_(True)
    dpo_loss_sum(p, reference, beta).backward()
    assert p.grad is not None and bool((p.grad[0::2] < 0).all()) and bool((p.grad[1::2] > 0).all())
    with pytest.raises(ValueError, match=r"\[2 \* pairs\]"):
        pair_rewards(policy[:5], reference[:5], beta)


# -- whole pairs per micro-batch ---------------------------------------------------------------


def test_split_pairs_cuts_only_between_pairs() -> None:
    batch = pair_batch(pairs=7)
    reference = torch.arange(14, dtype=torch.float32)
    for m in range(1, 8):
        mbs, refs = split_pairs(batch["input_ids"], batch["labels"], batch["attention_mask"], reference, m)
        assert len(mbs) == m == len(refs)
        assert all(mb.input_ids.shape[0] % 2 == 0 and mb.input_ids.shape[0] > 0 for mb in mbs)
        assert torch.equal(torch.cat([mb.input_ids for mb in mbs]), batch["input_ids"])
        assert torch.equal(torch.cat([mb.labels for mb in mbs]), batch["labels"])
        assert torch.equal(torch.cat(refs), reference)
        assert [r.shape[0] for r in refs] == [mb.input_ids.shape[0] for mb in mbs]


def test_split_pairs_names_what_cannot_be_split() -> None:
    batch = pair_batch(pairs=3)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    ref = torch.zeros(6)
    with pytest.raises(ValueError, match="has 5 rows: a preference batch needs an even number"):
        split_pairs(ids[:5], labels[:5], mask[:5], ref[:5], 1)
    with pytest.raises(ValueError, match=r"batch of 3 pairs \(6 rows\) cannot fill num_microbatches=4"):
        split_pairs(ids, labels, mask, ref, 4)
    with pytest.raises(ValueError, match=r"reference_logps has shape \(5,\): expected \(6,\)"):
        split_pairs(ids, labels, mask, ref[:5], 2)
    with pytest.raises(ValueError, match="must be finite"):
        split_pairs(ids, labels, mask, torch.tensor([0.0, 1.0, float("nan"), 0.0, 0.0, 0.0]), 2)
    empty = labels.clone()
    empty[3] = -100
    with pytest.raises(ValueError, match=r"row 3 \(the rejected answer of pair 1\) has no label token"):
        split_pairs(ids, empty, mask, ref, 2)


def test_the_engine_refuses_a_batch_it_cannot_keep_in_pairs() -> None:
    batch = pair_batch(pairs=2)
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd")
    with RoundPipe(tiny_model("llama"), config) as rp:
        ref = torch.zeros(4)
        with pytest.raises(ValueError, match=r"batch of 2 pairs \(4 rows\) cannot fill num_microbatches=3"):
            dpo.forward_backward(rp, **batch, reference_logps=ref, beta=0.1)
        odd = {k: v[:3] for k, v in batch.items()}
        with pytest.raises(ValueError, match="has 3 rows"):
            dpo.forward_backward(rp, **odd, reference_logps=ref[:3], beta=0.1)
        with pytest.raises(ValueError, match="beta=0: must be a finite number > 0"):
            dpo.forward_backward(rp, **batch, reference_logps=ref, beta=0)
        # the engine is still usable: evaluation takes fewer pairs than micro-batches
        stats = dpo.evaluate(rp, **batch, reference_logps=rp.sequence_logps(**batch), beta=0.1)
        assert stats.pairs == 2 and stats.loss == pytest.approx(math.log(2), abs=1e-6)


def test_the_heads_recompute_replays_its_dropout_under_the_generator_lock(pair_batches, monkeypatch) -> None:
    # LoRA with dropout on the LM head: the per-sequence loss runs the head's chunks again in
    # backward, setting the CPU generator's state; other workers draw from that generator, so
    # every run of a chunk (forward and replay) must hold its lock
    import threading

    from peft import LoraConfig, get_peft_model

    from engine.model import loss as loss_module
    from engine.parallel import executor

    owners: dict[str, threading.Thread | None] = {}

    class OwnedLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __enter__(self) -> None:
            self.lock.acquire()
            owners["cpu"] = threading.current_thread()

        def __exit__(self, *exc: object) -> None:
            owners["cpu"] = None
            self.lock.release()

    shared = OwnedLock()
    monkeypatch.setattr(executor, "rng_lock", lambda device: shared)
    runs = {"chunks": 0, "unlocked": 0}
    chunk = loss_module._chunk_token_logps

    def watched(*args, **kwargs):
        runs["chunks"] += 1
        runs["unlocked"] += owners.get("cpu") is not threading.current_thread()
        return chunk(*args, **kwargs)

    monkeypatch.setattr(loss_module, "_chunk_token_logps", watched)
    model = get_peft_model(
        tiny_model("llama", tied=False),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "lm_head"]),
    )
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=4, optimizer="sgd", lr=LR)
    with RoundPipe(copy.deepcopy(model), config) as rp:
        reference = rp.sequence_logps(**pair_batches[0], adapters=False)  # evaluation: no dropout
        runs.update(chunks=0, unlocked=0)
        dpo.forward_backward(rp, **pair_batches[0], reference_logps=reference, beta=BETA)
        rp.step()
        rp.synchronize()
    # each micro-batch's chunk ran twice (forward, replay), every run under the lock
    assert runs["chunks"] == 2 * config.num_microbatches and runs["unlocked"] == 0, runs
