"""The next-token loss of a causal LM, computed in chunks of tokens.

The output layer never holds the logits of a whole micro-batch: ``[tokens, vocab]`` in fp32 is
the largest tensor of a long-sequence step (8 x 4096 tokens x 152k vocab is 20 GB). Each chunk
of ``chunk_tokens`` positions goes through the LM head, the fp32 cross entropy and — under
``torch.utils.checkpoint`` — is recomputed in backward, so the logits that live at any time are
one chunk's. The same holds for a whole sequence's log-probability (``chunked_sequence_logps``,
what the preference methods score). Going through the head module (not a hand-written
``hidden @ weight.T``) keeps whatever the head is: a tied embedding weight, a LoRA-wrapped
``lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.errors import ConfigError

IGNORE_INDEX = -100
# positions per chunk: bounds the output layer's logits at chunk x vocab (fp32 4096 x 152k = 2.5 GB)
DEFAULT_LOSS_CHUNK_TOKENS = 4096


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


def _chunk_loss(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    # hidden [n, d] -> logits [n, vocab] in the head's dtype, the loss in fp32 (as the unchunked one)
    logits = head(hidden).float()
    return nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss_sum(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    preserve_rng_state: bool = False,
) -> torch.Tensor:
    """Sum of the next-token cross entropy over label tokens != -100 (fp32), chunk by chunk.

    Equals ``causal_lm_loss_sum(head(hidden), labels)`` up to the order of the fp32 sum, but
    the logits alive at any time (forward and backward) are at most ``chunk_tokens x vocab``.

    Args:
        hidden: ``[b, s, d]``, the final norm's output.
        labels: ``[b, s]``; position ``t`` of ``hidden`` predicts ``labels[:, t + 1]``.
        head: the LM head, ``[n, d] -> [n, vocab]``. With autograd on it is called again in
            backward (per chunk), so it must not depend on state that changes in between.
        chunk_tokens: positions (over the flattened ``b x (s - 1)``) per chunk.
        preserve_rng_state: the head draws random numbers (dropout): replay them in backward.

    Returns:
        A 0-d fp32 tensor.

    Raises:
        ConfigError: ``chunk_tokens`` < 1.
    """
    check_chunk_tokens(chunk_tokens)
    # [b, s - 1, d] -> [n, d]: position t predicts token t + 1
    flat = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(flat.device)
    total: torch.Tensor | None = None
    for start in range(0, max(flat.shape[0], 1), chunk_tokens):
        h, y = flat[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            part = checkpoint(
                _chunk_loss, head, h, y, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )
        else:
            part = _chunk_loss(head, h, y)
        total = part if total is None else total + part
    if total is None:
        raise RuntimeError("chunked loss: no chunk was computed")
    return total


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
    return torch.cat(parts).view(b, s - 1).sum(dim=1)
