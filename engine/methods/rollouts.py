"""Rollouts: sampling a group of completions per prompt with the policy being trained.

The engine's host copy of the weights is the model's own parameters (``RoundPipe``): after
``synchronize()`` the model samples on the host, with dropout off, with the weights the next
training iteration computes with (``policy_model``: for LoRA only the adapters change between
steps; the frozen base is the same tensors throughout). The sampling is seeded per step, so a
resumed run samples what an uninterrupted one would, and does not touch the process's random
stream.

Each completion draws from a random stream of its own, keyed by the step's seed, its prompt's
index in the whole batch and its index in the group (``stream_seed``): a prompt's completions are
the same whether it is sampled alone, with the batch's other prompts, or in any split of the batch
across boxes, while the batch still samples in one ``generate`` call. ``generate`` runs greedy over
scores in which ``RowSampler`` has already picked each row's token from the sampling distribution
(temperature, then nucleus ``top_p``; no top-k), by inverse transform with that row's uniform
draw for the step.

On a box with GPU workers the rollouts run on the first GPU when the whole model fits there (the
workers are idle meanwhile: a step samples, then trains); otherwise, and on a CPU host, on the
host's CPU (``rollout_device``; the run's ``rollouts`` event says which and why).

A completion ends at the first stop token (kept: the policy learns to stop) or after
``max_new_tokens``; each becomes one training row, its prompt's tokens unlabelled.

A ``RolloutBatch`` is a batch's completions with what GRPO's updates read from them (rewards,
advantages, the reference's and the sampling policy's log-probabilities), kept for the
``num_iterations`` steps that train on it; a checkpoint taken between them keeps it too
(``state_dict``), so a resumed run trains on the completions an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.data.batches import collate
from engine.data.encode import Encoded
from engine.data.prompts import PromptItem
from engine.errors import ConfigError
from engine.inference.chat import stop_ids
from engine.roundpipe import RoundPipe


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled.

    Attributes:
        group_size: completions per prompt (GRPO's G).
        max_new_tokens: the longest completion, in tokens.
        temperature: the softmax temperature (> 0).
        top_p: nucleus sampling's probability mass (1: off).
    """

    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Rollout:
    """A step's sampled completions, group by group (prompt ``i``'s in rows ``i*G .. i*G+G-1``).

    Attributes:
        items: the prompts, one per group.
        completions: each row's completion token ids (its stop token included when it stopped).
        texts: each row's completion as text (special tokens removed), what graders read.
        finished: each row stopped on a stop token (else it ran out of ``max_new_tokens``).
    """

    items: list[PromptItem]
    completions: list[list[int]]
    texts: list[str]
    finished: list[bool]

    @property
    def group_size(self) -> int:
        return len(self.completions) // max(len(self.items), 1)

    def row_items(self) -> list[dict[str, Any]]:
        """The fields of each row's prompt (``item`` to a grader), row by row."""
        g = self.group_size
        return [self.items[r // g].fields for r in range(len(self.completions))]

    def batch(self, pad_id: int) -> dict[str, torch.Tensor]:
        """The rows to train on: prompt then completion, labels on the completion's tokens only."""
        rows = []
        g = self.group_size
        for r, completion in enumerate(self.completions):
            prompt = self.items[r // g].input_ids
            ids = list(prompt) + list(completion)
            labels = [-100] * len(prompt) + list(completion)
            rows.append(Encoded(r, ids, labels, len(ids), False))
        return collate(rows, pad_id)


@dataclass
class RolloutBatch:
    """A batch's completions and what the steps that train on them read.

    Attributes:
        prompts: the prompts' indices among the run's training prompts (the batch's ``rows``).
        rollout: the completions, group by group.
        rows: ``rollout.batch``'s training rows (``input_ids``, ``labels``, ``attention_mask``).
        rewards: ``[rows]`` each completion's reward.
        errors: each completion's grader error (None: graded).
        advantages: ``[rows]`` each completion's advantage.
        reference: ``[rows, T]`` the reference's token log-probabilities (None: no KL term).
        old: ``[rows, T]`` the sampling policy's, taken before the first update (None: one
            update a batch, whose ratio is 1).
        metrics: the rollout's metrics (rewards, lengths, grader errors).
        used: the steps that trained on it so far.
    """

    prompts: list[int]
    rollout: Rollout
    rows: dict[str, torch.Tensor]
    rewards: torch.Tensor
    errors: list[str | None]
    advantages: torch.Tensor
    reference: torch.Tensor | None
    old: torch.Tensor | None
    metrics: dict[str, float]
    used: int = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything but the prompts' items (the run's own), as ``torch.load(weights_only=True)``
        reads it back."""
        r = self.rollout
        return {
            "prompts": list(self.prompts),
            "completions": [list(c) for c in r.completions],
            "texts": list(r.texts),
            "finished": list(r.finished),
            "rows": dict(self.rows),
            "rewards": self.rewards,
            "errors": list(self.errors),
            "advantages": self.advantages,
            "reference": self.reference,
            "old": self.old,
            "metrics": dict(self.metrics),
            "used": self.used,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], prompts: Sequence[PromptItem]) -> RolloutBatch:
        """The batch ``state_dict`` saved, its prompts' items taken from the run's ``prompts``."""
        items = [prompts[i] for i in state["prompts"]]
        rollout = Rollout(items, state["completions"], state["texts"], state["finished"])
        return cls(
            prompts=list(state["prompts"]),
            rollout=rollout,
            rows=dict(state["rows"]),
            rewards=state["rewards"],
            errors=list(state["errors"]),
            advantages=state["advantages"],
            reference=state["reference"],
            old=state["old"],
            metrics=dict(state["metrics"]),
            used=int(state["used"]),
        )


def model_bytes(model: Any) -> int:
    """Bytes of a model's parameters and buffers as they are held."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def rollout_device(engine: RoundPipe, *, headroom: float = 0.75) -> tuple[torch.device, str]:
    """Where the rollouts run, and why: the first GPU worker when the whole model fits in
    ``headroom`` of its free memory (the workers are idle while it samples, their cache emptied),
    else the host's CPU.

    Returns:
        ``(device, reason)``; the reason is one line for the run's events.
    """
    need = model_bytes(engine.adapted.hf_model)
    gpus = [d for d in engine.devices if d.type == "cuda"]
    if not gpus:
        return torch.device("cpu"), "rollouts sample on the host's CPU (no GPU worker)"
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(gpus[0])
    gb = 1024**3
    if need <= headroom * free:
        return gpus[
            0
        ], f"rollouts sample on {gpus[0]}: the model's {need / gb:.1f} GiB fit in {free / gb:.1f} GiB free"
    return torch.device("cpu"), (
        f"rollouts sample on the host's CPU: the model's {need / gb:.1f} GiB do not fit in "
        f"{headroom:.0%} of {gpus[0]}'s {free / gb:.1f} GiB free"
    )


@contextlib.contextmanager
def _placed(model: Any, device: torch.device) -> Iterator[None]:
    """The model's parameters and buffers copied to ``device`` for the while (the host tensors
    are put back after, untouched); nothing happens for the CPU."""
    if device.type == "cpu":
        yield
        return
    moved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    buffers: list[tuple[Any, str, torch.Tensor]] = []
    try:
        for p in model.parameters():
            moved.append((p, p.data))
            p.data = p.data.to(device, non_blocking=True)
        for module in model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None:
                    buffers.append((module, name, b))
                    module._buffers[name] = b.to(device, non_blocking=True)
        yield
    finally:
        for p, data in moved:
            p.data = data
        for module, name, b in buffers:
            module._buffers[name] = b


@contextlib.contextmanager
def policy_model(engine: RoundPipe, device: torch.device | None = None) -> Iterator[Any]:
    """The model with the weights the next ``forward_backward`` computes with, in eval mode,
    without gradients: the samples come from the policy whose gradient the step takes (with the
    async optimizer, the weights one step behind the masters, as every async step's).

    The trained parameters are pointed at that version's compute buffer for the while (nothing
    is copied; for LoRA they are the adapters alone) and pointed back after. On a GPU
    (``device``, ``rollout_device``'s choice) the model is copied there for the while.

    Raises:
        ConfigError: a 4-bit base (its dense weights are not kept on the host to sample with).
    """
    engine.synchronize()
    host = engine.host
    if any(t.packed is not None for t in host.tensors):
        raise ConfigError(
            "method.base_bits",
            "method.base_bits=4: GRPO samples on the host with the model's own weights, and a 4-bit base "
            "keeps none there; use base_bits 16",
            value=4,
        )
    version = engine.next_version()
    model = engine.adapted.hf_model
    params = dict(model.named_parameters())
    swapped = []
    for t in host.trainable:
        source = t.source(version)
        for name in t.names:
            p = params.get(name)
            if p is not None and p.data_ptr() != source.data_ptr():
                swapped.append((p, p.data))
                p.data = source
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _placed(model, device or torch.device("cpu")):
            yield model
    finally:
        model.train(was_training)
        for p, data in swapped:
            p.data = data


def _left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def stream_seed(seed: int, prompt: int, completion: int) -> int:
    """The seed of one completion's random stream: the step's ``seed``, the prompt's index in the
    whole batch and the completion's index in its group, mixed into 64 bits."""
    key = f"{seed}/{prompt}/{completion}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def distribution(
    scores: torch.Tensor, *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution each row's next token is drawn from: ``softmax(scores / temperature)``
    cut to its nucleus, the most likely tokens until their mass reaches ``top_p`` (the most likely
    one always kept; the rest get probability 0).

    Args:
        scores: ``[rows, vocab]`` the next token's scores (logits after any other processor).

    Returns:
        ``(probs, tokens)``: ``[rows, vocab]`` probabilities (not renormalised: ``draw`` scales by
        each row's mass) and, when ``top_p`` < 1, the token of each column (the row's tokens
        ranked most likely first, ties in vocabulary order); None: column ``k`` is token ``k``.
    """
    probs = torch.softmax(scores / temperature, dim=-1)
    if top_p >= 1.0:
        return probs, None
    ranked, tokens = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = ranked.cumsum(dim=-1, dtype=torch.float64) - ranked  # the mass ranked above each
    return ranked.masked_fill(before >= top_p, 0.0), tokens


def draw(probs: torch.Tensor, uniforms: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token by inverse transform: the first column whose cumulative probability (in
    float64) exceeds the row's uniform draw (``[rows]`` in [0, 1]) times the row's mass; a column
    of probability 0 is never drawn.

    Returns:
        ``[rows]`` the tokens (``tokens``' entries at the drawn columns when given).
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    mass = cdf[:, -1]
    # below the mass (a draw of 1 too): the first column past the target has a probability > 0
    target = torch.minimum(uniforms.to(cdf) * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    column = torch.searchsorted(cdf, target.unsqueeze(1), right=True)
    return (column if tokens is None else tokens.gather(1, column)).squeeze(1)


class RowSampler:
    """A logits processor that samples each row's next token with the row's own random stream
    and leaves ``generate`` (run greedy) nothing to choose: the picked token's score 0, every
    other -inf.

    Args:
        uniforms: ``[rows, max_new_tokens]`` each row's uniform draws, one per generated token.
        start: the prompt's width in ``generate``'s input (the first new token's position).
    """

    def __init__(self, uniforms: torch.Tensor, *, start: int, temperature: float, top_p: float) -> None:
        self.uniforms, self.start = uniforms, start
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.start
        if not 0 <= step < self.uniforms.shape[1] or scores.shape[0] != self.uniforms.shape[0]:
            raise RuntimeError(
                f"RowSampler holds draws for {self.uniforms.shape[0]} rows x {self.uniforms.shape[1]} "
                f"tokens; asked for token {step} of {scores.shape[0]} rows"
            )
        probs, tokens = distribution(scores, temperature=self.temperature, top_p=self.top_p)
        token = draw(probs, self.uniforms[:, step].to(scores.device), tokens)
        picked = torch.full_like(scores, float("-inf"))
        return picked.scatter_(1, token.unsqueeze(1), 0.0)


def _indices(indices: Sequence[int] | None, count: int) -> list[int]:
    if indices is None:
        return list(range(count))
    found = [int(i) for i in indices]
    if len(found) != count:
        raise ValueError(f"indices: {len(found)} given for {count} prompts; one index per prompt")
    if any(i < 0 for i in found) or len(set(found)) != len(found):
        raise ValueError(f"indices={found}: the prompts' indices in the batch are distinct and >= 0")
    return found


def sample(
    model: Any,
    tokenizer: Any,
    items: Sequence[PromptItem],
    sampling: Sampling,
    *,
    seed: int,
    group: int | None = None,
    greedy: bool = False,
    indices: Sequence[int] | None = None,
) -> Rollout:
    """``group`` (default ``sampling.group_size``) completions of every prompt, seeded by ``seed``.

    Completion ``j`` of the prompt at index ``i`` of the whole batch draws from its own stream
    (``stream_seed(seed, i, j)``), so it is the same whichever prompts are sampled with it.

    Args:
        model: the causal LM (``policy_model``'s).
        greedy: the most likely tokens (validation), one completion per prompt.
        indices: each item's index in the whole batch when ``items`` are a share of it (a box's);
            default ``0 .. len(items) - 1``, the items being the whole batch.

    Raises:
        ValueError: ``indices`` not one distinct index >= 0 per item; a temperature <= 0 or a
            ``top_p`` outside (0, 1].
    """
    from transformers import LogitsProcessorList

    g = 1 if greedy else (group or sampling.group_size)
    where = _indices(indices, len(items))
    if not greedy and not sampling.temperature > 0:
        raise ValueError(f"temperature={sampling.temperature}: the softmax temperature is > 0")
    if not greedy and not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p={sampling.top_p}: nucleus sampling keeps a mass in (0, 1]")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_ids(model, tokenizer)
    ids, mask = _left_pad([it.input_ids for it in items], int(pad))
    device = next(model.parameters()).device
    options: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "pad_token_id": int(pad),
        "eos_token_id": sorted(stops) or None,
        "do_sample": False,
    }
    if not greedy:
        # row i*g + j: completion j of item i, its uniform draws from its own stream
        uniforms = torch.stack(
            [
                torch.rand(
                    sampling.max_new_tokens,
                    generator=torch.Generator().manual_seed(stream_seed(seed, i, j)),
                    dtype=torch.float64,
                )
                for i in where
                for j in range(g)
            ]
        )
        sampler = RowSampler(
            uniforms.to(device), start=ids.shape[1], temperature=sampling.temperature, top_p=sampling.top_p
        )
        options["logits_processor"] = LogitsProcessorList([sampler])
        ids, mask = ids.repeat_interleave(g, dim=0), mask.repeat_interleave(g, dim=0)
    out = model.generate(ids.to(device), attention_mask=mask.to(device), **options)
    new = out[:, ids.shape[1] :].cpu()
    completions, texts, finished = [], [], []
    for row in new.tolist():
        kept, stopped = [], False
        for token in row:
            kept.append(token)
            if token in stops:
                stopped = True
                break
        completions.append(kept)
        finished.append(stopped)
        texts.append(str(tokenizer.decode(kept[:-1] if stopped else kept, skip_special_tokens=True)))
    return Rollout(list(items), completions, texts, finished)
