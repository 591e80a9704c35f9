"""The next-token loss of a causal LM, computed in chunks of tokens.

The output layer never holds the logits of a whole micro-batch: ``[tokens, vocab]`` in fp32 is
the largest tensor of a long-sequence step (8 x 4096 tokens x 152k vocab is 20 GB). Each chunk
of ``chunk_tokens`` positions goes through the LM head and the fp32 cross entropy, so the logits
that live at any time are one chunk's.

The loss sum (``chunked_causal_lm_loss_sum``) takes each chunk's gradients, for the hidden states
and the head's trainable tensors, in the same pass as its forward: the loss is a scalar, so its
backward only scales them by the incoming gradient, and the head never runs twice (no recompute,
and a head that draws random numbers, LoRA dropout, draws them once). A whole sequence's
log-probability (``chunked_sequence_logps``, what the preference methods score) has one incoming
gradient per row, so its chunks run again in backward under ``torch.utils.checkpoint``. Going
through the head module (not a hand-written ``hidden @ weight.T``) keeps whatever the head is: a
tied embedding weight, a LoRA-wrapped ``lm_head``.

The same pass can count the label tokens the model predicts right (``argmax(logits) == label``),
from each chunk's logits as they are (``chunked_causal_lm_loss_and_correct``): the token accuracy
costs one argmax per chunk and no second head pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.errors import ConfigError

IGNORE_INDEX = -100
# positions per chunk: bounds the output layer's logits at chunk x vocab (fp32 2048 x 152k = 1.2 GB,
# and as much again for their gradient)
DEFAULT_LOSS_CHUNK_TOKENS = 2048


def check_chunk_tokens(chunk_tokens: int, *, field: str = "loss_chunk_tokens") -> int:
    """Validate a chunk size.

    Raises:
        ConfigError: ``chunk_tokens`` is not an integer >= 1 (``field`` names the setting).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(field, f"{field}={chunk_tokens!r}: must be an integer >= 1", value=chunk_tokens)
    return chunk_tokens


def finish_logits(
    logits: torch.Tensor, *, divisor: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """What a family's ``*ForCausalLM`` does to the LM head's output, with the same operations.

    ``divisor`` (Granite's ``logits_scaling``): ``logits / divisor``. ``softcap`` (Gemma 3's
    ``final_logit_softcapping``): ``tanh(logits / softcap) * softcap``.
    """
    if divisor is not None:
        logits = logits / divisor
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return logits


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross entropy over label tokens != -100 (fp32), from full logits.

    ``logits [b, s, vocab]`` predict ``labels`` shifted by one, as the model's own loss does.
    The unchunked reference of ``chunked_causal_lm_loss_sum``.
    """
    shift_logits = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    return nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Number of label tokens != -100 whose logits' argmax is the label (int64), from full logits.

    The unchunked reference of ``chunked_causal_lm_loss_and_correct``'s count.
    """
    predicted = logits[:, :-1, :].argmax(dim=-1)
    return (predicted == labels[:, 1:].to(predicted.device)).sum()


def _chunk_loss(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor, count: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # hidden [n, d] -> logits [n, vocab] in the head's dtype, the loss in fp32 (as the unchunked one);
    # with ``count``, the label tokens whose logits' argmax is the label (-100 never equals one)
    logits = head(hidden).float()
    loss = nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if not count:
        return loss, None
    with torch.no_grad():
        return loss, (logits.argmax(dim=-1) == labels).sum()


class _LossWithGradients(torch.autograd.Function):
    """The chunked loss sum whose gradients are taken chunk by chunk in forward.

    Inputs: ``flat [n, d]``, ``targets [n]``, the chunk size, the incoming gradient expected in
    backward, whether to count the right predictions, the head and the head's tensors that need a
    gradient (so that autograd routes their gradients here). Outputs: the loss sum and the count
    (int64, 0 when not counted; not differentiable). Forward takes each chunk's gradients for
    that expected incoming gradient, so they round exactly as autograd's own backward would;
    backward multiplies them by the ratio of the incoming gradient to the expected one (1:
    unchanged), exact since the loss is a scalar, and without reading anything back from the
    device.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        flat: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        grad_scale: float,
        count: bool,
        head: Callable[[torch.Tensor], torch.Tensor],
        *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        expected = torch.tensor(grad_scale, dtype=torch.float32, device=flat.device)
        wants_hidden = bool(ctx.needs_input_grad[0])
        grad_hidden = torch.zeros_like(flat)
        grad_weights: list[torch.Tensor | None] = [None] * len(weights)
        total: torch.Tensor | None = None
        correct = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, max(flat.shape[0], 1), chunk_tokens):
            with torch.enable_grad():
                h = flat[start : start + chunk_tokens].detach().requires_grad_(wants_hidden)
                part, right = _chunk_loss(head, h, targets[start : start + chunk_tokens], count)
                if right is not None:
                    correct = correct + right
                wants = [h] if wants_hidden else []
                wants += list(weights)
                found: tuple[torch.Tensor | None, ...] = ()
                if part.requires_grad:
                    found = torch.autograd.grad(part, wants, expected, allow_unused=True)
            if wants_hidden and found and found[0] is not None:
                grad_hidden[start : start + chunk_tokens] = found[0]
            of_weights: tuple[torch.Tensor | None, ...] = found[len(found) - len(weights) :] if found else ()
            for i, g in enumerate(of_weights):
                before = grad_weights[i]
                if g is not None:
                    grad_weights[i] = g if before is None else before + g
            part = part.detach()
            total = part if total is None else total + part
        if total is None:
            raise RuntimeError("chunked loss: no chunk was computed")
        ctx.kept = (grad_hidden, grad_weights, expected)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor, _grad_correct: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weights, expected = ctx.kept
        del ctx.kept
        ratio = grad.float() / expected  # exactly 1 when backward brings the expected gradient

        def scaled(g: torch.Tensor) -> torch.Tensor:
            return g * ratio.to(g.dtype)

        hidden = scaled(grad_hidden) if ctx.needs_input_grad[0] else None
        weights = tuple(None if g is None else scaled(g) for g in grad_weights)
        return (hidden, None, None, None, None, None, *weights)


def chunked_causal_lm_loss_sum(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    weights: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    preserve_rng_state: bool = False,
) -> torch.Tensor:
    """Sum of the next-token cross entropy over label tokens != -100 (fp32), chunk by chunk.

    Equals ``causal_lm_loss_sum(head(hidden), labels)`` up to the order of the fp32 sum, but
    the logits alive at any time (forward and backward) are at most ``chunk_tokens x vocab``.

    With autograd on and the head's tensors known (``weights``, or ``head`` is a module), each
    chunk's gradients are taken as it is computed and the head runs once. Otherwise every chunk
    runs again in backward under ``torch.utils.checkpoint``.

    Args:
        hidden: ``[b, s, d]``, the final norm's output.
        labels: ``[b, s]``; position ``t`` of ``hidden`` predicts ``labels[:, t + 1]``.
        head: the LM head, ``[n, d] -> [n, vocab]``.
        chunk_tokens: positions (over the flattened ``b x (s - 1)``) per chunk.
        weights: every tensor ``head`` uses (those that need a gradient get it through the
            returned loss). None: ``head``'s parameters when it is a module, else unknown (the
            recompute path).
        grad_scale: the gradient the caller will back-propagate into the returned loss (e.g. its
            ``1 / tokens``): with it the gradients round as autograd's would; any other incoming
            gradient is still exact up to one rounding.
        preserve_rng_state: the recompute path only: replay the head's random numbers in backward.

    Returns:
        A 0-d fp32 tensor.

    Raises:
        ConfigError: ``chunk_tokens`` < 1.
    """
    loss, _ = _chunked_loss(
        hidden, labels, head, chunk_tokens, weights, grad_scale, preserve_rng_state, count=False
    )
    return loss


def chunked_causal_lm_loss_and_correct(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    weights: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    preserve_rng_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_causal_lm_loss_sum`` and, from the same logits, the number of label tokens
    != -100 whose logits' argmax is the label (``causal_lm_correct``: the token accuracy's
    numerator; an argmax tie goes to the lower token id, as ``torch.argmax``).

    Args: as ``chunked_causal_lm_loss_sum``.

    Returns:
        The 0-d fp32 loss sum (differentiable as ``chunked_causal_lm_loss_sum``'s) and the 0-d
        int64 count (not differentiable).

    Raises:
        ConfigError: ``chunk_tokens`` < 1.
    """
    loss, correct = _chunked_loss(
        hidden, labels, head, chunk_tokens, weights, grad_scale, preserve_rng_state, count=True
    )
    if correct is None:
        raise RuntimeError("chunked loss: the right predictions were not counted")
    return loss, correct


def _chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    chunk_tokens: int,
    weights: Sequence[torch.Tensor] | None,
    grad_scale: float,
    preserve_rng_state: bool,
    *,
    count: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_chunk_tokens(chunk_tokens)
    # [b, s - 1, d] -> [n, d]: position t predicts token t + 1
    flat = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(flat.device)
    if weights is None and isinstance(head, nn.Module):
        weights = list(head.parameters())
    grad = torch.is_grad_enabled()
    if grad and weights is not None:
        trained = list({id(w): w for w in weights if w.requires_grad}.values())
        if flat.requires_grad or trained:
            loss, counted = _LossWithGradients.apply(
                flat, targets, chunk_tokens, float(grad_scale), count, head, *trained
            )
            return loss, counted if count else None
    total: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    for start in range(0, max(flat.shape[0], 1), chunk_tokens):
        h, y = flat[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if grad:
            part, right = checkpoint(
                _chunk_loss, head, h, y, count, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )
        else:
            part, right = _chunk_loss(head, h, y, count)
        total = part if total is None else total + part
        if right is not None:
            correct = right if correct is None else correct + right
    if total is None:
        raise RuntimeError("chunked loss: no chunk was computed")
    return total, correct


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row sum of the log-probabilities of the label tokens (fp32), from full logits.

    ``logits [b, s, vocab]`` predict ``labels [b, s]`` shifted by one, as the model's own loss
    does. The unchunked reference of ``chunked_sequence_logps``.

    Returns:
        ``[b]`` fp32; 0 for a row without label tokens.
    """
    b, s = labels.shape
    shift = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(shift.device)
    nll = nn.functional.cross_entropy(shift, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(b, s - 1).sum(dim=1)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-probability of every label token (fp32), from full logits: ``[b, s - 1]``, position
    ``t`` the probability of ``labels[:, t + 1]`` (0 where that label is -100). The unchunked
    reference of ``chunked_token_logps``."""
    b, s = labels.shape
    shift = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(shift.device)
    nll = nn.functional.cross_entropy(shift, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(b, s - 1)


def _chunk_token_logps(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    # hidden [n, d] -> logits [n, vocab] -> [n] log-probability of each target (0 where -100)
    logits = head(hidden).float()
    return -nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def chunked_sequence_logps(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    preserve_rng_state: bool = False,
) -> torch.Tensor:
    """Per-row sum of the label tokens' log-probabilities, the logits computed chunk by chunk.

    Equals ``sequence_logps(head(hidden), labels)`` but the logits alive at any time (forward
    and backward) are at most ``chunk_tokens x vocab``; what is kept per position is one float.

    Args:
        hidden: ``[b, s, d]``, the final norm's output.
        labels: ``[b, s]``; position ``t`` of ``hidden`` predicts ``labels[:, t + 1]``.
        head: the LM head, ``[n, d] -> [n, vocab]`` (called again per chunk in backward).
        chunk_tokens: positions (over the flattened ``b x (s - 1)``) per chunk.
        preserve_rng_state: the head draws random numbers (dropout): replay them in backward.

    Returns:
        ``[b]`` fp32.

    Raises:
        ConfigError: ``chunk_tokens`` < 1.
    """
    # a fixed summation order, whatever the chunking
    return chunked_token_logps(
        hidden, labels, head, chunk_tokens=chunk_tokens, preserve_rng_state=preserve_rng_state
    ).sum(dim=1)


def chunked_token_logps(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    preserve_rng_state: bool = False,
) -> torch.Tensor:
    """The log-probability of every label token, the logits computed chunk by chunk.

    Equals ``token_logps(head(hidden), labels)``; what a per-token objective (GRPO's clipped
    ratio) scores. Each chunk runs again in backward (``torch.utils.checkpoint``), so the logits
    alive at any time are at most ``chunk_tokens x vocab``.

    Args: as ``chunked_sequence_logps``.

    Returns:
        ``[b, s - 1]`` fp32, 0 where the label is -100.

    Raises:
        ConfigError: ``chunk_tokens`` < 1.
    """
    check_chunk_tokens(chunk_tokens)
    b, s = labels.shape
    flat = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(flat.device)
    parts = []
    for start in range(0, max(flat.shape[0], 1), chunk_tokens):
        h, y = flat[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            part = checkpoint(
                _chunk_token_logps, head, h, y, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )
        else:
            part = _chunk_token_logps(head, h, y)
        parts.append(part)
    # [b * (s - 1)] -> [b, s - 1] -> [b]: a fixed summation order, whatever the chunking
    return torch.cat(parts).view(b, s - 1)
