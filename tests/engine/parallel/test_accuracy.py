"""Token accuracy: the engine's count of right predictions equals the unsplit model's."""

from __future__ import annotations

import copy

import torch

from engine import EngineConfig, RoundPipe
from engine.metrics import ListSink
from engine.model.loss import causal_lm_correct
from tests.engine.tiny import SPLIT_PLAN, tiny_batch, tiny_model


def _plain(model: torch.nn.Module, weights: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
    """The unsplit model at ``weights`` on the whole batch: its loss and right predictions."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(weights)
    with torch.no_grad():
        out = ref(**batch)
    return out.loss.item(), int(causal_lm_correct(out.logits, batch["labels"]))


def test_train_and_validation_accuracy_equal_the_unsplit_model() -> None:
    model = tiny_model("qwen3")
    batch = tiny_batch(seed=0)
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    sink = ListSink()
    # the fused stage on one worker, forward and recompute stages on the other, 3 micro-batches
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="adamw", lr=1e-1, partition=SPLIT_PLAN
    )
    expected = []
    with RoundPipe(copy.deepcopy(model), config, sink=sink) as rp:
        for _ in range(6):  # the same batch again and again: it is learnt
            _, right = _plain(model, rp.master_state_dict(), batch)
            expected.append(right / tokens)
            rp.forward_backward(**batch)
            rp.step()
        rp.synchronize()
        # an evaluation (validation's path) on the batch learnt: forward stages and the fused forward
        loss, right = _plain(model, rp.master_state_dict(), batch)
        mean, counted, total = rp.evaluate_counts(**batch)
        assert rp.evaluate(**batch) == mean
    assert sink.series("accuracy/train") == expected
    assert 0 < expected[0] < 0.1 < expected[-1]  # counts that grow, not 0 on both sides
    assert 0 < counted == right and total == tokens
    assert abs(mean - loss) < 1e-5
