"""KTO's torch side: its loss as a per-token objective, and its run (``engine.methods.kto``).

Rows. Each unpaired row (a prompt, a completion, a desirable label) is trained as one sequence,
the loss on the completion's tokens. Its mismatched row, for the KL estimate, is its prompt with
the completion of the row before it in its chunk of ``hyper.batch_size`` rows of the file (the
first row of a chunk takes the chunk's last completion; a chunk of one row is its own), as TRL
pairs them when it prepares its KL dataset; the pairing is fixed before training, so the
reference's log-probabilities of both rows are computed once.

A batch travels as preference pairs do (``Batcher``: row ``2i`` the row, ``2i + 1`` its
mismatched row). A step first measures the policy's log-probability of each mismatched row
(forward only, ``RoundPipe.sequence_logps``): ``z = max(0, mean(policy - reference))`` over the
batch, a constant of the step. Then the rows train under ``KtoObjective``: each micro-batch's
summed loss from its rows' summed log-probabilities, divided by the batch's row count (the mean,
as TRL's). Sequence log-probabilities are sums over the completion's tokens (TRL's KTO).

The reference is a LoRA run's base (adapters off) or a full fine-tune's initial weights; its
log-probabilities of every row and mismatched row, training and validation, are computed before
the first step and stored in the run folder (``kto_reference.pt``, with a fingerprint of the
rows, the base model and the dtype), as DPO's (``engine.methods.reference_file``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.data.batches import collate_pairs, split_validation
from engine.data.encode import load_unpaired
from engine.data.sequences import Encoded, EncodedPair, EncodedUnpaired
from engine.errors import ConfigError
from engine.kinds import EngineEvent
from engine.methods.base import MethodRun
from engine.methods.reference_file import read_reference, row_key, write_reference
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
        """The statistics of a finished iteration under this objective; ``loss`` the mean over its rows."""
        logps = torch.cat([reported(it, mb) for mb in range(len(it.microbatches))])
        rows = int(logps.shape[0])
        loss = it.loss_sum() / rows
        return KtoStats.of(logps - self.reference_logps, self.desirable, self.kl, self.beta, loss)

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
    its steps and its validation."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        data, m = config.data, config.method
        rows = load_unpaired(data.train, tokenizer, fmt=data.format, max_length=data.max_length)
        if data.validation:
            held = load_unpaired(
                data.validation,
                tokenizer,
                fmt=data.format,
                max_length=data.max_length,
                field="data.validation",
            )
        else:
            rows, held = split_validation(rows, data.validation_fraction, config.hyper.seed)
        chunk = config.hyper.batch_size
        self.train: list[EncodedPair] = as_pairs(rows, chunk, data.max_length)
        self.validation: list[EncodedPair] = as_pairs(held, chunk, data.max_length)
        # a batch's rows find their labels by their tokens: rows of the same tokens (and the same
        # mismatched row) must agree
        self.labels: dict[bytes, bool] = {}
        lines: dict[bytes, int] = {}
        for pair, r in zip(self.train + self.validation, rows + held, strict=True):
            key = _key(pair)
            if key in self.labels and self.labels[key] != r.label:
                raise ConfigError(
                    "data.train",
                    f"lines {lines[key]} and {r.line}: the same prompt and completion labelled both "
                    "desirable and undesirable",
                    value=r.line,
                )
            self.labels[key], lines[key] = r.label, r.line
        self.beta, self.lora = float(m.beta), bool(m.lora)
        self.weights = (float(m.desirable_weight), float(m.undesirable_weight))
        self.table: dict[bytes, float] = {}

    def fingerprint(self, *, base: str, compute_dtype: str) -> str:
        """What the reference values depend on: every row's tokens and label, the base, the dtype."""
        h = hashlib.sha256(f"kto|{base}|{compute_dtype}|{len(self.train)}|{len(self.validation)}".encode())
        for pair in self.train + self.validation:
            h.update(_key(pair) + (b"+" if self.labels[_key(pair)] else b"-"))
        return h.hexdigest()

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
        path = folder / REFERENCE_FILE
        fingerprint = self.fingerprint(base=base, compute_dtype=compute_dtype)
        stored = read_reference(path)
        pairs = self.train + self.validation
        if stored is not None and stored.get("fingerprint") == fingerprint:
            values = stored["rows"]
            sink.event(EngineEvent.REFERENCE, f"reference log-probabilities read from {REFERENCE_FILE}", {})
        else:
            started = time.perf_counter()
            parts = [torch.empty(0)]
            for i in range(0, len(pairs), batch_size):
                batch = collate_pairs(pairs[i : i + batch_size], pad_id)
                parts.append(engine.sequence_logps(**batch, adapters=not self.lora))
            values = torch.cat(parts)
            write_reference(path, {"fingerprint": fingerprint, "rows": values})
            seconds = time.perf_counter() - started
            what = "the base model (adapters off)" if self.lora else "the initial weights"
            sink.event(
                EngineEvent.REFERENCE,
                f"reference log-probabilities of {len(pairs)} rows and their mismatched rows from {what} "
                f"in {seconds:.1f} s",
                {"rows": len(pairs), "seconds": seconds},
            )
        flat = values.tolist()
        self.table = {}
        for i, pair in enumerate(pairs):
            self.table[row_key(pair.chosen.input_ids, pair.chosen.labels)] = flat[2 * i]
            self.table[row_key(pair.rejected.input_ids, pair.rejected.labels)] = flat[2 * i + 1]

    def _inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """A served batch (rows and mismatched rows interleaved) as ``forward_backward``'s arguments."""
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        refs, desirable = [], []
        for r in range(ids.shape[0]):
            n = int(mask[r].sum())  # collate pads on the right
            key = row_key(ids[r, :n], labels[r, :n])
            if key not in self.table:
                raise RuntimeError("a training row has no reference log-probability (prepare() first)")
            refs.append(self.table[key])
        for r in range(0, ids.shape[0], 2):
            n, k = int(mask[r].sum()), int(mask[r + 1].sum())
            desirable.append(
                self.labels[_pair_key(ids[r, :n], labels[r, :n], ids[r + 1, :k], labels[r + 1, :k])]
            )
        reference = torch.tensor(refs, dtype=torch.float32)
        return {
            **_trimmed(ids[0::2], labels[0::2], mask[0::2], ""),
            **_trimmed(ids[1::2], labels[1::2], mask[1::2], "kl_"),
            "reference_logps": reference[0::2],
            "kl_reference_logps": reference[1::2],
            "desirable": torch.tensor(desirable, dtype=torch.bool),
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
            x = self._inputs(collate_pairs(self.validation[i : i + batch_size], pad_id))
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


def _key(pair: EncodedPair) -> bytes:
    return _pair_key(pair.chosen.input_ids, pair.chosen.labels, pair.rejected.input_ids, pair.rejected.labels)


def _pair_key(ids: Any, labels: Any, kl_ids: Any, kl_labels: Any) -> bytes:
    return row_key(ids, labels) + row_key(kl_ids, kl_labels)


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
