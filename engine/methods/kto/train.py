"""KTO's torch side: its loss as a per-token objective, and its run (``engine.methods.kto``).

Rows. Each unpaired row (a prompt, a completion, a desirable label) is trained as one sequence,
the loss on the completion's tokens. Its mismatched row, for the KL estimate, is its prompt with
the completion of the row before it in its chunk of ``hyper.batch_size`` rows of the file (the
first row of a chunk takes the chunk's last completion; a chunk of one row is its own), as TRL
pairs them when it prepares its KL dataset; the pairing is fixed before training, so the
reference's log-probabilities of both rows are computed once.

A batch travels as preference pairs do (``Batcher``: row ``2i`` the row, ``2i + 1`` its
mismatched row, and ``rows`` their indices, by which each finds its label and its reference
values; the same prompt and completion may be on several lines, labelled alike or not). A step
first measures the policy's log-probability of each mismatched row (forward only,
``RoundPipe.sequence_logps``): ``z = max(0, mean(policy - reference))`` over the batch, a
constant of the step. Then the rows train under ``KtoObjective``: each micro-batch's summed loss
from its rows' summed log-probabilities, divided by the batch's row count (the mean, as TRL's).
Sequence log-probabilities are sums over the completion's tokens (TRL's KTO).

The reference is a LoRA run's base (adapters off) or a full fine-tune's initial weights; its
log-probabilities of every row and mismatched row, training and validation, are computed before
the first step and stored in the run folder (``kto_reference.pt``, with a fingerprint of the
rows, the base model and the dtype), as DPO's (``engine.methods.reference_file``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.data.batches import collate_pairs
from engine.data.sequences import Encoded, EncodedPair, EncodedUnpaired
from engine.methods.base import MethodRun, load_split
from engine.methods.reference_file import by_rows, fingerprint, stored_or_computed
from engine.metrics import Sink
from engine.parallel.objective import Upload
from engine.parallel.tokens import TokenScores, reported
from engine.roundpipe import RoundPipe

if TYPE_CHECKING:
    from engine.parallel.board import Iteration

REFERENCE_FILE = "kto_reference.pt"


def kl_estimate(policy: torch.Tensor, reference: torch.Tensor) -> float:
    """``max(0, mean(policy - reference))`` of the mismatched rows' log-probabilities."""
    return max(0.0, float((policy.float() - reference.float()).mean()))


def kto_losses(
    logratio: torch.Tensor,
    desirable: torch.Tensor,
    kl: float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Each row's KTO loss (``[rows]`` fp32, differentiable in ``logratio``).

    Args:
        logratio: ``[rows]`` the policy's minus the reference's log-probability of each completion.
        desirable: ``[rows]`` bool, the completion is desirable.
        kl: the batch's KL estimate ``z`` (a constant).
    """
    r = logratio.float()
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - r)))
    return torch.where(desirable.to(r.device), good, bad)


@dataclass(frozen=True)
class KtoStats:
    """KTO's numbers of a batch.

    Attributes:
        loss: the mean loss over its rows.
        kl: the KL estimate ``z``.
        chosen_reward: the mean implicit reward ``beta * logratio`` of its desirable rows (None: none).
        rejected_reward: that of its undesirable rows (None: none).
        desirable: how many rows are desirable.
        undesirable: how many are not.
    """

    loss: float
    kl: float
    chosen_reward: float | None
    rejected_reward: float | None
    desirable: int
    undesirable: int

    @classmethod
    def of(
        cls, logratio: torch.Tensor, desirable: torch.Tensor, kl: float, beta: float, loss: float
    ) -> KtoStats:
        rewards = beta * logratio.detach().float()
        good = desirable.bool()
        chosen = float(rewards[good].mean()) if bool(good.any()) else None
        rejected = float(rewards[~good].mean()) if bool((~good).any()) else None
        return cls(loss, kl, chosen, rejected, int(good.sum()), int((~good).sum()))

    def metrics(self) -> dict[str, float]:
        out = {
            "kto/kl": self.kl,
            "kto/desirable": float(self.desirable),
            "kto/undesirable": float(self.undesirable),
        }
        if self.chosen_reward is not None:
            out["kto/chosen_reward"] = self.chosen_reward
        if self.rejected_reward is not None:
            out["kto/rejected_reward"] = self.rejected_reward
        if self.chosen_reward is not None and self.rejected_reward is not None:
            out["kto/reward_margin"] = self.chosen_reward - self.rejected_reward
        return out


class KtoObjective(TokenScores):
    """The fused stage's KTO loss: a micro-batch's summed row losses, from its rows' token
    log-probabilities; each micro-batch reports its rows' summed log-probabilities.

    Args:
        beta: KTO's beta (> 0).
        kl: the batch's KL estimate.
        reference_logps: ``[rows]`` the reference's log-probability of each row's completion.
        desirable: ``[rows]`` bool.
        desirable_weight: the weight of a desirable row's loss.
        undesirable_weight: the weight of an undesirable row's loss.
    """

    name = "kto"

    def __init__(
        self,
        *,
        beta: float,
        kl: float,
        reference_logps: torch.Tensor,
        desirable: torch.Tensor,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self.beta, self.kl = beta, kl
        self.weights = (desirable_weight, undesirable_weight)
        self.reference_logps = reference_logps.detach().float().cpu()
        self.desirable = desirable.detach().bool().cpu()
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bind(self, microbatches: list[Any], *, pin: bool) -> None:
        super().bind(microbatches, pin=pin)
        self.parts = []
        for start, mb in zip(self.rows, microbatches, strict=True):
            n = int(mb.input_ids.shape[0])
            ref = self.reference_logps[start : start + n].contiguous()
            good = self.desirable[start : start + n].contiguous()
            self.parts.append((ref.pin_memory(), good.pin_memory()) if pin else (ref, good))

    def report_size(self, batch: Any) -> int:
        return int(batch.input_ids.shape[0])

    def statistics(self, it: Iteration) -> KtoStats:
        """The statistics of a finished iteration under this objective; ``loss`` the mean over the
        batch's rows (on several boxes the rewards are this box's share's)."""
        logps = torch.cat([reported(it, mb) for mb in range(len(it.microbatches))])
        start = self.rows[it.first] if it.first else 0
        mine = slice(start, start + int(logps.shape[0]))
        loss = it.loss_sum() / it.total_tokens  # the divisor: the batch's rows
        return KtoStats.of(logps - self.reference_logps[mine], self.desirable[mine], self.kl, self.beta, loss)

    def step_metrics(self, iterations: Sequence[Iteration]) -> dict[str, float]:
        """The KL estimate, the rewards and the row counts of a step's iterations."""
        merged: dict[str, float] = {}
        for it in iterations:
            objective = it.objective
            if isinstance(objective, KtoObjective):
                merged.update(objective.statistics(it).metrics())
        return merged

    def token_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> tuple[torch.Tensor, torch.Tensor]:
        ref, good = self.parts[mb]
        logp = logps.float().sum(dim=1)
        losses = kto_losses(
            logp - upload(ref),
            upload(good),
            self.kl,
            beta=self.beta,
            desirable_weight=self.weights[0],
            undesirable_weight=self.weights[1],
        )
        return losses.sum(), logp.detach()


def forward_backward(
    engine: RoundPipe,
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    kl_input_ids: torch.Tensor,
    kl_labels: torch.Tensor,
    kl_attention_mask: torch.Tensor,
    reference_logps: torch.Tensor,
    kl_reference_logps: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KtoStats:
    """One KTO batch: the policy's log-probabilities of its mismatched rows (forward only) give the
    KL estimate, then forward and backward of its rows; gradients accumulate until ``step()``.

    Args:
        input_ids, labels, attention_mask: ``[rows, seq]`` each row, labels on its completion.
        kl_input_ids, kl_labels, kl_attention_mask: ``[rows, seq']`` each row's mismatched row.
        reference_logps, kl_reference_logps: ``[rows]`` the reference's log-probabilities of them.
        desirable: ``[rows]`` bool.

    Returns:
        The batch's statistics; ``loss`` is the mean KTO loss over its rows.
    """
    policy_kl = engine.sequence_logps(
        input_ids=kl_input_ids, labels=kl_labels, attention_mask=kl_attention_mask
    )
    kl = kl_estimate(policy_kl, kl_reference_logps)
    objective = KtoObjective(
        beta=beta,
        kl=kl,
        reference_logps=reference_logps,
        desirable=desirable,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )
    it = engine.forward_backward_tokens(
        objective,
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        divisor=int(input_ids.shape[0]),
    )
    return objective.statistics(it)


def mismatched(rows: list[EncodedUnpaired], chunk: int, max_length: int) -> list[Encoded]:
    """Each row's mismatched row: its prompt with the completion of the row before it in its
    chunk of ``chunk`` rows (the first takes the chunk's last), cut to ``max_length`` tokens."""
    out = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        for i, row in enumerate(part):
            other = part[i - 1]  # i = 0: the chunk's last row (itself in a chunk of one)
            prompt, completion = row.prompt_ids, other.completion_ids
            ids = (prompt + completion)[:max_length]
            labels = ([-100] * len(prompt) + completion)[:max_length]
            n = len(prompt) + len(completion)
            out.append(Encoded(row.line, ids, labels, length=n, truncated=n > max_length))
    return out


def as_pairs(rows: list[EncodedUnpaired], chunk: int, max_length: int) -> list[EncodedPair]:
    """The rows as the batcher serves them: each row with its mismatched row."""
    return [
        EncodedPair(row.line, row.sequence, kl)
        for row, kl in zip(rows, mismatched(rows, chunk, max_length), strict=True)
    ]


class KtoRun(MethodRun):
    """A KTO run: its rows with their mismatched rows, the reference's log-probabilities of both,
    its steps and its validation. A batch's rows find their labels and reference values by their
    indices (the ``rows`` the batcher serves), so the same prompt and completion may appear on
    several lines, labelled alike or not."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        data, m = config.data, config.method
        rows, held = load_split(config, tokenizer, EncodedUnpaired)
        chunk = config.hyper.batch_size
        self.train: list[EncodedPair] = as_pairs(rows, chunk, data.max_length)
        self.validation: list[EncodedPair] = as_pairs(held, chunk, data.max_length)
        self.desirable = torch.tensor([r.label for r in rows], dtype=torch.bool)
        self.validation_desirable = torch.tensor([r.label for r in held], dtype=torch.bool)
        self.beta, self.lora = float(m.beta), bool(m.lora)
        self.weights = (float(m.desirable_weight), float(m.undesirable_weight))
        self.train_logps = torch.empty(0)
        self.validation_logps = torch.empty(0)

    def fingerprint(self, *, base: str, compute_dtype: str) -> str:
        """What the reference values depend on: every row's tokens and label, the base, the dtype."""
        labels = torch.cat([self.desirable, self.validation_desirable]).tolist()
        return fingerprint(
            self.train,
            self.validation,
            base=base,
            compute_dtype=compute_dtype,
            tag="kto|",
            marks=[b"+" if good else b"-" for good in labels],
        )

    def prepare(
        self,
        engine: RoundPipe,
        folder: Path,
        *,
        base: str,
        compute_dtype: str,
        batch_size: int,
        pad_id: int,
        sink: Sink,
    ) -> None:
        """Read the stored reference log-probabilities, or compute and store them (before the
        engine resumes or steps: on the initial weights)."""
        self.train_logps, self.validation_logps = stored_or_computed(
            engine,
            folder / REFERENCE_FILE,
            self.fingerprint(base=base, compute_dtype=compute_dtype),
            self.train,
            self.validation,
            batch_size=batch_size,
            pad_id=pad_id,
            lora=self.lora,
            sink=sink,
            unit="rows",
            described="rows and their mismatched rows",
        )

    def _inputs(self, batch: dict[str, torch.Tensor], *, validation: bool = False) -> dict[str, Any]:
        """A served batch (rows and mismatched rows interleaved, ``rows`` their indices among the
        training or the validation rows) as ``forward_backward``'s arguments."""
        if "rows" not in batch:
            raise RuntimeError("a KTO batch without its rows' indices (collate_pairs' rows)")
        logps = self.validation_logps if validation else self.train_logps
        desirable = self.validation_desirable if validation else self.desirable
        if logps.shape[0] != 2 * desirable.shape[0]:
            raise RuntimeError("a KTO batch without reference log-probabilities (prepare() first)")
        ids, labels, mask, rows = batch["input_ids"], batch["labels"], batch["attention_mask"], batch["rows"]
        reference = by_rows(logps, rows)
        return {
            **_trimmed(ids[0::2], labels[0::2], mask[0::2], ""),
            **_trimmed(ids[1::2], labels[1::2], mask[1::2], "kl_"),
            "reference_logps": reference[0::2],
            "kl_reference_logps": reference[1::2],
            "desirable": desirable[rows.long()],
        }

    def forward_backward(
        self, engine: RoundPipe, batch: dict[str, torch.Tensor]
    ) -> tuple[float, dict[str, float]]:
        stats = forward_backward(
            engine,
            **self._inputs(batch),
            beta=self.beta,
            desirable_weight=self.weights[0],
            undesirable_weight=self.weights[1],
        )
        return stats.loss, stats.metrics()

    def validate(self, engine: RoundPipe, batch_size: int, pad_id: int) -> dict[str, float] | None:
        """``loss/val`` and the validation rows' KL estimate and rewards, batch by batch (forward
        only, the losses on the host)."""
        if not self.validation:
            return None
        losses, rewards, good = [], [], []
        kls = []
        for i in range(0, len(self.validation), batch_size):
            chunk = self.validation[i : i + batch_size]
            x = self._inputs(collate_pairs(chunk, pad_id, range(i, i + len(chunk))), validation=True)
            policy_kl = engine.sequence_logps(
                input_ids=x["kl_input_ids"], labels=x["kl_labels"], attention_mask=x["kl_attention_mask"]
            )
            kl = kl_estimate(policy_kl, x["kl_reference_logps"])
            logratio = (
                engine.sequence_logps(
                    input_ids=x["input_ids"], labels=x["labels"], attention_mask=x["attention_mask"]
                )
                - x["reference_logps"]
            )
            losses.append(
                kto_losses(
                    logratio,
                    x["desirable"],
                    kl,
                    beta=self.beta,
                    desirable_weight=self.weights[0],
                    undesirable_weight=self.weights[1],
                )
            )
            rewards.append(self.beta * logratio)
            good.append(x["desirable"])
            kls.append(kl)
        desirable, reward = torch.cat(good), torch.cat(rewards)
        out = {"loss/val": float(torch.cat(losses).mean()), "kto/val_kl": sum(kls) / len(kls)}
        if bool(desirable.any()) and bool((~desirable).any()):
            out["kto/val_reward_margin"] = float(reward[desirable].mean() - reward[~desirable].mean())
        return out


def _trimmed(
    ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, prefix: str
) -> dict[str, torch.Tensor]:
    """Rows cut to their longest (the interleaved batch padded them to the longest of both kinds)."""
    width = max(1, int(mask.sum(dim=1).max()))
    return {
        f"{prefix}input_ids": ids[:, :width].contiguous(),
        f"{prefix}labels": labels[:, :width].contiguous(),
        f"{prefix}attention_mask": mask[:, :width].contiguous(),
    }


RUN = KtoRun
OBJECTIVE = KtoObjective
