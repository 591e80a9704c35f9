"""GRPO: group relative policy optimization (Shao et al., 2024), with graders as the reward.

Each step samples ``G`` completions of every prompt of the batch with the current policy
(``engine.methods.rollouts``), grades them (``engine.graders``), and turns each group's rewards
into advantages: ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)`` (``scale_rewards`` off: the mean
only, as Dr. GRPO does). The completions are then trained on through the engine's pipeline under
a per-token objective (``engine.parallel.tokens``). With ``pi`` the policy's log-probability of a
completion token, ``old`` the sampling policy's and ``ref`` the reference's::

    ratio   = exp(pi - old)
    policy  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
    kl      = exp(ref - pi) - (ref - pi) - 1          (the k3 estimator; beta = 0: none)
    token   = policy + beta * kl

With ``num_iterations`` 1 the policy samples the completions it trains on at the start of the
step, so ``old`` is the policy's own log-probability, detached (the ratio is 1 and its gradient
the policy gradient). With ``num_iterations`` mu > 1 (the paper's mu, TRL's ``num_iterations``) a
batch's completions, rewards and advantages train mu steps in a row (the batcher serves its
prompts mu times), and ``old`` is the sampling policy's log-probability, measured once before the
first of them: the later steps' ratios move, and the clip bounds them. The reference is what the
run started from: a LoRA run's model with its adapters off, a full fine-tune's frozen copy of its
initial weights, kept in host memory in the compute dtype (``RoundPipe.keep_initial_weights``,
when ``beta`` > 0) and uploaded to the stages for the reference pass as the weights are. Both
are measured through the pipeline, once a batch.

How token losses become the batch's loss (``loss_type``):

- ``grpo``: each completion's mean over its tokens, then the mean over completions (the paper);
- ``dapo``: the mean over every completion token of the batch (DAPO's token-level average);
- ``dr_grpo``: the sum over tokens divided by ``completions x max_completion_tokens`` (Dr. GRPO:
  no length bias).

A grader that fails on a sample scores it 0 and the error is counted (``grpo/grader_errors``)
and shown with the step's samples (an event ``samples``); it never fails the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch

from engine.data.batches import split_validation
from engine.data.prompts import PromptItem, load_prompts
from engine.graders import validate_grader
from engine.kinds import EngineEvent
from engine.methods.base import MethodRun
from engine.methods.grpo import GrpoOptions
from engine.methods.rollouts import (
    Rollout,
    RolloutBatch,
    Sampling,
    policy_model,
    rollout_device,
    sample,
)
from engine.metrics import Sink
from engine.parallel.objective import Upload
from engine.parallel.tokens import TokenScores, reported
from engine.roundpipe import RoundPipe

if TYPE_CHECKING:
    from engine.distributed.group import Group
    from engine.parallel.board import Iteration, MicroBatch

LOSS_TYPES: tuple[str, ...] = get_args(GrpoOptions.model_fields["loss_type"].annotation)
SAMPLES_EVENT = "samples"  # a step's sample completions with their rewards: data {"step", "samples"}
ROLLOUTS_EVENT = "rollouts"  # where the rollouts sample: data {"device"}
SAMPLES_SHOWN = 4  # completions per step in the samples event
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True) -> torch.Tensor:
    """Each completion's reward against its group's: ``r - mean``, divided by ``std + 1e-4``
    with ``scale`` (the unbiased std, as the paper's implementations).

    Args:
        rewards: ``[groups * group_size]`` fp32, group by group.

    Raises:
        ValueError: the rewards do not fill whole groups.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"{tuple(rewards.shape)} rewards do not fill groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return centred.reshape(-1)


def token_terms(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    epsilon: float,
    epsilon_high: float,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's GRPO loss, its KL term and whether its ratio was clipped.

    Args:
        logps: ``[rows, T]`` the policy's token log-probabilities (differentiable).
        advantages: ``[rows]``.
        old: ``[rows, T]`` the sampling policy's (None: ``logps`` detached).
        ref: ``[rows, T]`` the reference's (None: no KL term; needs ``beta`` 0).

    Returns:
        ``(loss [rows, T], kl [rows, T], clipped [rows, T])`` fp32; the caller masks them.
    """
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    a = advantages.unsqueeze(1)
    unclipped = ratio * a
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    loss = -torch.min(unclipped, clipped_ratio * a)
    clipped = (clipped_ratio * a < unclipped).float().detach()
    if ref is None or beta == 0.0:
        kl = torch.zeros_like(loss)
    else:
        delta = ref - logps
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + beta * kl
    return loss, kl.detach(), clipped


def combine(loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The summed loss of some rows (``loss``, ``mask``: ``[rows, T]``) for ``loss_type``: per
    completion its token mean (``grpo``), or every token's loss (``dapo``, ``dr_grpo``); the
    batch's divisor (``divisor``) turns the sums into the loss."""
    masked = loss * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum()
    return masked.sum()


def divisor(loss_type: str, labels: torch.Tensor, max_completion_tokens: int) -> int:
    """What the batch's summed loss is divided by: completions (``grpo``), completion tokens
    (``dapo``), or completions times the longest completion allowed (``dr_grpo``)."""
    rows = int(labels.shape[0])
    if loss_type == "grpo":
        return rows
    if loss_type == "dapo":
        return max(1, int((labels[:, 1:] != -100).sum()))
    return rows * max_completion_tokens


class GRPOObjective(TokenScores):
    """GRPO's per-token loss over a micro-batch, with its rows' advantages (and reference).

    Reports per micro-batch: the KL terms' sum, the clipped tokens and the completion tokens.
    """

    name = "grpo"
    stats_size = 3

    def __init__(
        self,
        advantages: torch.Tensor,
        *,
        reference: torch.Tensor | None = None,
        old: torch.Tensor | None = None,
        loss_type: str = "grpo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
    ) -> None:
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
        if beta and reference is None:
            raise ValueError(f"beta={beta}: the KL term needs the reference's log-probabilities")
        self.advantages = advantages.detach().float().cpu()
        self.reference_all = None if reference is None else reference.detach().float().cpu()
        self.old_all = None if old is None else old.detach().float().cpu()
        self.loss_type = loss_type
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.beta = float(beta)
        self.parts: list[dict[str, torch.Tensor]] = []

    def bind(self, microbatches: list[MicroBatch], *, pin: bool) -> None:
        super().bind(microbatches, pin=pin)
        self.parts = []
        for start, mb in zip(self.rows, microbatches, strict=True):
            n = int(mb.input_ids.shape[0])
            part = {
                "advantages": self.advantages[start : start + n].contiguous(),
                "mask": (mb.labels[:, 1:] != -100).float().contiguous(),
            }
            if self.reference_all is not None:
                part["reference"] = self.reference_all[start : start + n].contiguous()
            if self.old_all is not None:
                part["old"] = self.old_all[start : start + n].contiguous()
            self.parts.append({k: v.pin_memory() if pin else v for k, v in part.items()})

    def token_loss(self, mb: int, logps: torch.Tensor, upload: Upload) -> tuple[torch.Tensor, torch.Tensor]:
        part = {k: upload(v) for k, v in self.parts[mb].items()}
        mask = part["mask"]
        loss, kl, clipped = token_terms(
            logps,
            part["advantages"],
            old=part.get("old"),
            ref=part.get("reference"),
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
        )
        stats = torch.stack([(kl * mask).sum(), (clipped * mask).sum(), mask.sum()])
        return combine(loss, mask, self.loss_type), stats

    def step_metrics(self, iterations: Sequence[Iteration]) -> dict[str, float]:
        """The KL to the reference and the share of clipped tokens, over the step's tokens."""
        kl = clipped = tokens = 0.0
        for it in iterations:
            for mb in range(len(it.microbatches)):
                values = reported(it, mb)
                kl, clipped, tokens = (
                    kl + float(values[0]),
                    clipped + float(values[1]),
                    tokens + float(values[2]),
                )
        tokens = max(tokens, 1.0)
        return {"grpo/kl": kl / tokens, "grpo/clip_fraction": clipped / tokens}


class GRPORun(MethodRun):
    """A GRPO run: its prompts, its grader, the rollouts and updates of each step."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        # the config refused what GRPO cannot train with (packing, the router loss, a 4-bit base,
        # no room for a prompt): ``GrpoOptions``
        m, data = config.method, config.data
        self.steps_per_batch = m.steps_per_batch()
        budget = data.max_length - m.max_completion_tokens
        self.sampling = Sampling(m.group_size, m.max_completion_tokens, m.temperature, m.top_p)
        self.train: list[PromptItem] = load_prompts(
            data.train, tokenizer, fmt=data.format, max_prompt_tokens=budget
        )
        if data.validation:
            self.validation: list[PromptItem] = load_prompts(
                data.validation, tokenizer, fmt=data.format, max_prompt_tokens=budget, field="data.validation"
            )
        else:
            self.train, self.validation = split_validation(
                self.train, data.validation_fraction, config.hyper.seed
            )
        self.grader = validate_grader(m.grader, field="method.grader")
        self.sink: Sink | None = None
        self.pad_id = 0
        self.current: RolloutBatch | None = None  # the batch the next steps train on
        self.device: torch.device | None = None  # where the rollouts run, chosen at the first

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
        """Keep a full fine-tune's reference, its initial weights, when the KL term needs it."""
        self.sink, self.pad_id = sink, pad_id
        m = self.config.method
        if m.beta and not m.lora:
            size = engine.keep_initial_weights()
            sink.event(
                EngineEvent.REFERENCE,
                f"the KL term's reference: a frozen copy of the initial weights, {size / 2**30:.2f} GiB "
                f"of host memory in {compute_dtype}",
                {"bytes": size},
            )

    def state_dict(self) -> dict[str, Any]:
        """The batch the next steps train on, when a step before its last is checkpointed (on
        several boxes none: each box holds only its share of it, so a resumed run samples the
        batch again)."""
        current = self.current
        if current is None or current.used >= self.steps_per_batch or self.group is not None:
            return {}
        return {"rollout_batch": current.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("rollout_batch")
        self.current = None if saved is None else RolloutBatch.from_state(saved, self.train)

    def close(self) -> None:
        self.grader.close()

    def rollout(
        self, engine: RoundPipe, items: list[PromptItem], *, greedy: bool = False, first: int = 0
    ) -> Rollout:
        """Completions of ``items`` sampled with the policy (seeded by the run's seed and step;
        ``first``: the index of ``items[0]`` in the whole batch, whose own stream each prompt's
        completions draw from)."""
        seed = self.config.hyper.seed * 1_000_003 + engine.steps * 2 + int(greedy)
        if self.device is None:
            engine.synchronize()
            self.device, why = rollout_device(engine)
            if self.sink is not None:
                self.sink.event(ROLLOUTS_EVENT, why, {"device": str(self.device)})
        with policy_model(engine, self.device) as model:
            indices = range(first, first + len(items))
            return sample(
                model, self.tokenizer, items, self.sampling, seed=seed, greedy=greedy, indices=indices
            )

    def grade(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, list[float]], list[str | None]]:
        """Each completion's reward, each named grader's scores, and each completion's grader error."""
        result = self.grader.grade_batch(rollout.texts, rollout.row_items())
        rewards = torch.tensor([float(r) for r in result.rewards], dtype=torch.float32)
        return rewards, dict(result.sub_rewards), list(result.errors)

    def collect(self, engine: RoundPipe, prompts: list[int]) -> RolloutBatch:
        """A new batch to train on: the prompts' completions sampled and graded, their
        advantages, and the log-probabilities the steps on it compare with (the reference's when
        ``beta`` > 0, the sampling policy's when ``num_iterations`` > 1), all measured before the
        first step on it."""
        m = self.config.method
        mine, first = box_share(prompts, self.group)  # on several boxes: this box's prompts
        rollout = self.rollout(engine, [self.train[i] for i in mine], first=first)
        rewards, graded, errors = self.grade(rollout)
        advantages = group_advantages(rewards, m.group_size, scale=m.scale_rewards)
        rows = rollout.batch(self.pad_id)
        ids, labels, mask = rows["input_ids"], rows["labels"], rows["attention_mask"]
        reference = old = None
        if m.beta and m.lora:  # the base model: the adapters off
            reference = engine.token_logps(input_ids=ids, labels=labels, attention_mask=mask, adapters=False)
        elif m.beta:  # a full fine-tune's frozen copy of its initial weights
            reference = engine.token_logps(input_ids=ids, labels=labels, attention_mask=mask, initial=True)
        if m.num_iterations > 1:  # the sampling policy's, fixed before the first step on the batch
            old = engine.token_logps(input_ids=ids, labels=labels, attention_mask=mask)
        metrics = step_metrics(rollout, rewards, graded, errors, self.group)
        return RolloutBatch(prompts, rollout, rows, rewards, errors, advantages, reference, old, metrics)

    def forward_backward(
        self, engine: RoundPipe, batch: dict[str, torch.Tensor]
    ) -> tuple[float, dict[str, float]]:
        m = self.config.method
        prompts = [int(i) for i in batch["rows"].tolist()]
        current = self.current
        if current is None or current.used >= m.num_iterations:
            current = self.current = self.collect(engine, prompts)
        elif current.prompts != prompts:  # the batcher serves each batch num_iterations times
            raise RuntimeError(
                f"GRPO: step {engine.steps + 1} got prompts {prompts[:4]}... while the completions "
                f"trained on {current.used} of {m.num_iterations} times are of {current.prompts[:4]}..."
            )
        objective = GRPOObjective(
            current.advantages,
            reference=current.reference,
            old=current.old,
            loss_type=m.loss_type,
            epsilon=m.epsilon,
            epsilon_high=m.epsilon_high,
            beta=m.beta,
        )
        rows = current.rows
        ids, labels, mask = rows["input_ids"], rows["labels"], rows["attention_mask"]
        # on several boxes: this box's completions, divided by what the whole batch's are
        whole = self.group is None
        scale = (
            divisor(m.loss_type, labels, m.max_completion_tokens) if whole else self._whole_divisor(current)
        )
        it = engine.forward_backward_tokens(
            objective, input_ids=ids, labels=labels, attention_mask=mask, divisor=scale, whole=whole
        )
        loss = it.loss_sum() / it.total_tokens
        if current.used == 0:  # a batch's first step: its host-side numbers (the engine logs its own)
            if self.sink is not None:
                self.sink.log(current.metrics, engine.steps + 1)
            if self.group is None or self.group.writer:  # rank 0's share shown, once
                self._show(engine.steps + 1, current.rollout, current.rewards, current.errors)
        current.used += 1
        return loss, dict(current.metrics)

    def _whole_divisor(self, current: RolloutBatch) -> int:
        """``divisor`` of the whole batch on several boxes: its completions are known from the
        prompts; its completion tokens (``dapo``) are summed over the boxes."""
        m = self.config.method
        rows = len(current.prompts) * m.group_size
        if m.loss_type == "grpo":
            return rows
        if m.loss_type == "dr_grpo":
            return rows * m.max_completion_tokens
        assert self.group is not None
        mine = int((current.rows["labels"][:, 1:] != -100).sum())
        (tokens,) = self.group.sum_values([float(mine)], name="control")
        return max(1, int(tokens))

    def _show(self, step: int, rollout: Rollout, rewards: torch.Tensor, errors: list[str | None]) -> None:
        """A few of the step's completions with their rewards, as an event for the job page."""
        if self.sink is None:
            return
        g = rollout.group_size
        shown = []
        for r in range(min(SAMPLES_SHOWN, len(rollout.texts))):
            row = r * g if r * g < len(rollout.texts) else r  # one per prompt first
            shown.append(
                {
                    "prompt": rollout.items[row // g].text[-500:],
                    "completion": rollout.texts[row][:1000],
                    "reward": float(rewards[row]),
                    "error": errors[row],
                }
            )
        self.sink.event(
            SAMPLES_EVENT,
            f"step {step}: {len(rollout.texts)} completions graded",
            {"step": step, "samples": shown},
        )

    def validate(self, engine: RoundPipe, batch_size: int, pad_id: int) -> dict[str, float] | None:
        """``reward/val``: the mean reward of greedy completions of the validation prompts
        (``loss/val`` is its negative: lower is better, as every method's)."""
        if not self.validation:
            return None
        total, n = 0.0, 0
        for i in range(0, len(self.validation), batch_size):
            rollout = self.rollout(engine, self.validation[i : i + batch_size], greedy=True)
            rewards, _, _ = self.grade(rollout)
            total, n = total + float(rewards.sum()), n + len(rollout.texts)
        mean = total / max(n, 1)
        return {"loss/val": -mean, "reward/val": mean}


def box_share(prompts: list[int], group: Group | None) -> tuple[list[int], int]:
    """This box's prompts of a batch shared out over the boxes (near-equal consecutive parts, as
    ``torch.tensor_split`` cuts), and the index of its first; all of them on one box."""
    if group is None:
        return prompts, 0
    k, n = group.world_size, len(prompts)
    start = group.rank * (n // k) + min(group.rank, n % k)
    size = n // k + (1 if group.rank < n % k else 0)
    return prompts[start : start + size], start


def step_metrics(
    rollout: Rollout,
    rewards: torch.Tensor,
    graded: dict[str, list[float]],
    errors: list[str | None],
    group: Group | None = None,
) -> dict[str, float]:
    """A step's reward statistics, each grader's mean, the completions' lengths, and the
    graders' failures (on several boxes, over every box's completions: ``group``)."""
    outcome: dict[str, Any] = {
        "rewards": [float(r) for r in rewards.tolist()],
        "lengths": [len(c) for c in rollout.completions],
        "finished": [bool(f) for f in rollout.finished],
        "errors": sum(e is not None for e in errors),
        "graded": {name: list(scores) for name, scores in graded.items()},
    }
    if group is not None:  # every box's share, in rank order (the whole batch's order)
        every = group.gather(outcome)
        outcome = {
            "rewards": [r for o in every for r in o["rewards"]],
            "lengths": [n for o in every for n in o["lengths"]],
            "finished": [f for o in every for f in o["finished"]],
            "errors": sum(o["errors"] for o in every),
            "graded": {name: [s for o in every for s in o["graded"].get(name, [])] for name in graded},
        }
    all_rewards = torch.tensor(outcome["rewards"], dtype=torch.float32)
    lengths = torch.tensor(outcome["lengths"], dtype=torch.float32)
    groups = all_rewards.view(-1, rollout.group_size)
    finished = outcome["finished"]
    metrics = {
        "reward/mean": float(all_rewards.mean()),
        "reward/min": float(all_rewards.min()),
        "reward/max": float(all_rewards.max()),
        "reward/std": float(groups.std(dim=1).mean()) if rollout.group_size > 1 else 0.0,
        "completion/length": float(lengths.mean()),
        "completion/length_max": float(lengths.max()),
        "completion/finished": sum(finished) / max(len(finished), 1),
        "grpo/grader_errors": float(outcome["errors"]),
    }
    graded = outcome["graded"]
    for name, scores in graded.items():
        values = [float(s) for s in scores if isinstance(s, int | float) and math.isfinite(s)]
        if values:
            metrics[f"reward/{name}"] = sum(values) / len(values)
    return metrics


RUN = GRPORun
OBJECTIVE = GRPOObjective
