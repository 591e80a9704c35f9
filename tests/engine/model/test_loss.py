"""The chunked output-layer loss: the unchunked loss and gradients, without full logits."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig
from engine.errors import ConfigError
from engine.model.adapter import AdaptedModel, OutputLayer
from engine.model.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    causal_lm_correct,
    causal_lm_loss_sum,
    check_chunk_tokens,
    chunked_causal_lm_loss_and_correct,
    chunked_causal_lm_loss_sum,
)
from tests.engine.tiny import tiny_model

TOL = 1e-5


class LargestOutput(TorchDispatchMode):
    """Records the largest numel of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _inputs(
    b: int, s: int, d: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, d, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, : s // 2] = -100  # a prompt
    labels[-1, -3:] = -100  # padding
    head = torch.nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=g) * 0.1)
    return hidden, labels, head


def _loss_and_grads(
    hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Linear, chunk: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head.zero_grad()
    h = hidden.clone().requires_grad_(True)
    if chunk is None:
        loss = causal_lm_loss_sum(head(h), labels)
    else:
        loss = chunked_causal_lm_loss_sum(h, labels, head, chunk_tokens=chunk)
    loss.backward()
    assert h.grad is not None and head.weight.grad is not None
    return loss.detach(), h.grad, head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 5, 11, 22, 7, 1000])  # 2 x 11 = 22 positions
def test_chunked_equals_unchunked(chunk: int) -> None:
    hidden, labels, head = _inputs(2, 12, 16, 50)
    ref = _loss_and_grads(hidden, labels, head, None)
    got = _loss_and_grads(hidden, labels, head, chunk)
    assert torch.allclose(got[0], ref[0], rtol=TOL, atol=TOL), (got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert (a - b).abs().max().item() < TOL


@pytest.mark.parametrize("path", ["gradients", "recompute", "no_grad"])
@pytest.mark.parametrize("chunk", [1, 5, 22, 1000])
def test_counting_right_predictions_is_exact_and_changes_nothing(chunk: int, path: str) -> None:
    hidden, labels, head = _inputs(2, 12, 16, 50)
    with torch.no_grad():  # every other position's label is the model's own prediction
        predicted = head(hidden).argmax(dim=-1)
    labels[:, 1::2] = predicted[:, :-1:2]
    labels[0, 1] = -100  # a predicted position that is not a label token
    expected = int(causal_lm_correct(head(hidden), labels))
    assert 5 < expected < int((labels[:, 1:] != -100).sum())
    # the recompute path: a head whose tensors are unknown
    call = (lambda x: head(x)) if path == "recompute" else head
    results = []
    for count in (False, True):
        head.zero_grad()
        h = hidden.clone().requires_grad_(path != "no_grad")
        with torch.set_grad_enabled(path != "no_grad"):
            if count:
                loss, correct = chunked_causal_lm_loss_and_correct(h, labels, call, chunk_tokens=chunk)
                assert correct.dtype == torch.int64 and not correct.requires_grad
                assert int(correct) == expected
            else:
                loss = chunked_causal_lm_loss_sum(h, labels, call, chunk_tokens=chunk)
        if path != "no_grad":
            loss.backward()
            assert h.grad is not None and head.weight.grad is not None
            results.append((loss.detach(), h.grad, head.weight.grad.clone()))
        else:
            results.append((loss,))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_output_layer_counts_next_to_its_loss_sum() -> None:
    model = tiny_model("llama")
    out = AdaptedModel(model, loss_chunk_tokens=5).layers[-1].module
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 32, generator=g)
    labels = torch.randint(0, 96, (2, 9), generator=g)
    with torch.no_grad():
        labels[:, 1:] = torch.where(labels[:, 1:] % 2 == 0, out(hidden)[:, :-1].argmax(-1), labels[:, 1:])
        both = out(hidden, labels, count_correct=True)
        assert both.shape == (2,)
        assert torch.equal(both[0], out(hidden, labels))
        assert int(both[1]) == int(causal_lm_correct(out(hidden), labels)) > 0


def test_all_ignored_and_single_position() -> None:
    hidden, labels, head = _inputs(2, 6, 8, 20)
    labels[:] = -100
    assert chunked_causal_lm_loss_sum(hidden, labels, head, chunk_tokens=4).item() == 0.0
    one = chunked_causal_lm_loss_sum(hidden[:, :1], labels[:, :1], head, chunk_tokens=4)
    assert one.item() == 0.0


def test_no_grad_matches() -> None:
    hidden, labels, head = _inputs(3, 9, 8, 30)
    with torch.no_grad():
        ref = causal_lm_loss_sum(head(hidden), labels)
        got = chunked_causal_lm_loss_sum(hidden, labels, head, chunk_tokens=4)
    assert torch.allclose(got, ref, rtol=TOL, atol=TOL)


def test_peak_intermediate_is_bounded_by_the_chunk() -> None:
    b, s, d, vocab, chunk = 2, 64, 8, 1000, 16
    hidden, labels, head = _inputs(b, s, d, vocab)

    def largest(chunk_tokens: int | None) -> int:
        h = hidden.clone().requires_grad_(True)
        with LargestOutput() as mode:
            if chunk_tokens is None:
                loss = causal_lm_loss_sum(head(h), labels)
            else:
                loss = chunked_causal_lm_loss_sum(h, labels, head, chunk_tokens=chunk_tokens)
            loss.backward()
        return mode.largest

    assert largest(None) >= b * (s - 1) * vocab
    assert largest(chunk) <= chunk * vocab


# Granite divides its logits and Gemma 3 (tied) soft-caps them: inside every chunk's head
@pytest.mark.parametrize(
    ("family", "tied"), [("llama", False), ("llama", True), ("granite", None), ("gemma3", None)]
)
def test_output_layer_matches_the_model(family: str, tied: bool | None) -> None:
    model = tiny_model(family, tied=tied)
    adapted = AdaptedModel(model, loss_chunk_tokens=5)
    out = adapted.layers[-1].module
    assert isinstance(out, OutputLayer) and out.chunk_tokens == 5
    assert (out.logit_softcap is not None) == (family == "gemma3")
    assert (out.logits_divisor is not None) == (family == "granite")
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=g)
    labels = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    labels[1, :3] = -100

    def run(chunked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad()
        h = hidden.clone().requires_grad_(True)
        loss = out(h, labels) if chunked else causal_lm_loss_sum(out(h), labels)
        loss.backward()
        assert h.grad is not None and model.lm_head.weight.grad is not None
        return loss.detach(), h.grad, model.lm_head.weight.grad.clone()

    ref, got = run(False), run(True)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() < TOL


def test_chunk_size_is_validated() -> None:
    assert EngineConfig().loss_chunk_tokens == DEFAULT_LOSS_CHUNK_TOKENS
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError) as err:
            EngineConfig(loss_chunk_tokens=bad)  # type: ignore[arg-type]
        assert err.value.field == "EngineConfig.loss_chunk_tokens"
        assert "loss_chunk_tokens" in str(err.value)
        with pytest.raises(ConfigError, match="loss_chunk_tokens"):
            check_chunk_tokens(bad)  # type: ignore[arg-type]


def test_backward_after_functional_call_uses_the_bound_tensors() -> None:
    # the executor calls the output layer through functional_call on a meta-tensor copy; the
    # chunks' recompute runs in backward, after functional_call has put the meta tensors back
    model = tiny_model("llama", tied=False)
    out = AdaptedModel(model, loss_chunk_tokens=4).layers[-1].module
    meta = copy.deepcopy(out).to("meta")
    tensors = {k: v.detach().clone().requires_grad_(True) for k, v in out.state_dict(keep_vars=True).items()}
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, model.config.hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, model.config.vocab_size, (2, 6), generator=g)
    loss = functional_call(meta, tensors, (hidden, labels), tie_weights=False, strict=False)
    loss.backward()
    ref = causal_lm_loss_sum(functional_call(out, tensors, (hidden.detach(),)), labels)
    assert torch.allclose(loss, ref, rtol=TOL, atol=TOL)
    assert tensors["lm_head.weight"].grad is not None and hidden.grad is not None


class CountingHead(torch.nn.Module):
    """A linear head that counts its calls and the rows it saw."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = head
        self.calls = 0
        self.rows = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.rows += h.shape[0]
        out: torch.Tensor = self.inner(h)
        return out


def test_with_gradients_the_head_runs_once_per_chunk_and_matches_the_recompute_path() -> None:
    hidden, labels, linear = _inputs(2, 12, 16, 50)
    counted = CountingHead(linear)
    h = hidden.clone().requires_grad_(True)
    loss = chunked_causal_lm_loss_sum(h, labels, counted, chunk_tokens=5)
    (loss * 0.25).backward()  # the incoming gradient scales what forward kept
    assert counted.calls == 5 and counted.rows == 22  # 22 positions in chunks of 5, no second pass
    assert h.grad is not None and linear.weight.grad is not None
    one_pass = (loss.detach(), h.grad.clone(), linear.weight.grad.clone())

    # a bare callable with no tensors named: the chunks run again in backward (checkpoint)
    linear.zero_grad()
    counted.calls = 0
    h2 = hidden.clone().requires_grad_(True)
    again = chunked_causal_lm_loss_sum(h2, labels, lambda x: counted(x), chunk_tokens=5)
    (again * 0.25).backward()
    assert counted.calls == 10
    assert h2.grad is not None and linear.weight.grad is not None
    assert torch.equal(again.detach(), one_pass[0])
    assert (h2.grad - one_pass[1]).abs().max().item() < TOL
    assert (linear.weight.grad - one_pass[2]).abs().max().item() < TOL


def test_a_head_with_dropout_draws_its_mask_once_and_the_gradients_use_that_mask() -> None:
    hidden, labels, linear = _inputs(2, 10, 16, 40)
    drop = torch.nn.Sequential(torch.nn.Dropout(0.5), linear)
    drop.train()
    h = hidden.clone().requires_grad_(True)
    torch.manual_seed(7)
    loss = chunked_causal_lm_loss_sum(h, labels, drop, chunk_tokens=6)
    loss.backward()
    assert h.grad is not None and linear.weight.grad is not None
    grad_weight = linear.weight.grad
    linear.weight.grad = None
    # the same masks drawn in the same order, outside the chunked loss
    torch.manual_seed(7)
    ref_h = hidden.clone().requires_grad_(True)
    flat = ref_h[:, :-1].reshape(-1, 16)
    targets = labels[:, 1:].reshape(-1)
    parts = [
        torch.nn.functional.cross_entropy(
            drop(flat[i : i + 6]).float(), targets[i : i + 6], ignore_index=-100, reduction="sum"
        )
        for i in range(0, flat.shape[0], 6)
    ]
    ref = sum(parts[1:], parts[0])
    ref.backward()
    assert ref_h.grad is not None and linear.weight.grad is not None
    assert torch.allclose(loss, ref, rtol=TOL, atol=TOL)
    assert (h.grad - ref_h.grad).abs().max().item() < TOL
    assert (grad_weight - linear.weight.grad).abs().max().item() < TOL
