"""The optimizer's units as flat blocks: one optimizer per unit over one flat fp32 parameter.

``HostState`` keeps each unit's masters as views into one flat fp32 block and their gradients
as views into another. The optimizer works on the blocks: one update per unit instead of one
per tensor (a torch optimizer's per-tensor bookkeeping and, with many cores, one parallel region
per tensor), one norm per unit, one scaling per unit for the clipping. Element by element the
arithmetic is the optimizer's own, so results are those of per-tensor optimizers up to the order
of the norm's sum.

Checkpoints keep the per-tensor layout: ``unit_state_dict`` splits a unit's flat state into one
entry per tensor (the layout ``torch.optim`` writes for the unit's tensors) and
``load_unit_state_dict`` joins such entries back, so checkpoints written before and after the
blocks existed load either way.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import EngineConfig
from engine.optimizers import OptimizerSpec
from engine.parallel import kernels
from engine.parallel.host import HostState

COMPUTE = (torch.float32, torch.bfloat16, torch.float16)

# what the kernel writes for a compute copy of each dtype
OUT_KINDS = {dtype: kernels.OUT_KINDS[str(dtype).removeprefix("torch.")] for dtype in COMPUTE}


class Unit:
    """One optimizer unit: its flat parameter (the master block), the shapes of its tensors."""

    def __init__(self, host: HostState, owner: int, spec: OptimizerSpec, cfg: EngineConfig) -> None:
        self.owner = owner
        self.host = host
        self.shapes = [m.shape for k in host.owned[owner] if (m := host.tensors[k].master) is not None]
        # shares the block's memory; its .grad is set only while a torch step runs (the block
        # may be replaced between steps: HostState.adopt_grads)
        self.param = torch.nn.Parameter(host.unit_masters[owner])
        self.optimizer = spec.build([self.param], cfg)
        self.kernel = kernels.adamw() if self._plain_adamw() else None

    def _plain_adamw(self) -> bool:
        """torch's AdamW with the options the one-pass kernel implements (no amsgrad, ...)."""
        opt = self.optimizer
        if not isinstance(opt, torch.optim.AdamW) or len(opt.param_groups) != 1:
            return False
        group = opt.param_groups[0]
        return not (group.get("amsgrad") or group.get("maximize") or group.get("capturable"))

    @property
    def writes_copies(self) -> bool:
        """Whether ``step_writing`` updates and writes the compute copies in one pass."""
        return self.kernel is not None

    def step_writing(
        self, lr: float, copies: list[torch.Tensor], *, grad_divisor: float = 1.0, threads: int = 1
    ) -> None:
        """One AdamW update of the unit that also writes ``copies`` (the compute buffers of the
        unit's tensors, in block order) from the new masters, in one pass (``kernels/adamw.c``).

        The optimizer state is the torch optimizer's own (its ``step``, ``exp_avg`` and
        ``exp_avg_sq``), so checkpoints and the torch path read and continue it unchanged.
        """
        assert self.kernel is not None
        group = self.optimizer.param_groups[0]
        group["lr"] = lr
        state = self.optimizer.state[self.param]
        if not state:  # as torch's fused AdamW creates it
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(self.param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(self.param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        step_size = lr / (1 - beta1**step)
        p, g = self.param.detach(), self.grad
        m, v = state["exp_avg"], state["exp_avg_sq"]
        offset = 0
        for out in copies:
            n = out.numel()
            kind = OUT_KINDS[out.dtype]
            at = offset * 4  # bytes into the fp32 blocks
            self.kernel(
                p.data_ptr() + at,
                g.data_ptr() + at,
                m.data_ptr() + at,
                v.data_ptr() + at,
                out.data_ptr(),
                kind,
                n,
                grad_divisor,
                lr,
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                step_size,
                bias_correction2_sqrt,
                threads,
            )
            offset += n
        if offset != p.numel():
            raise RuntimeError(f"optimizer unit {self.owner}: copies cover {offset} of {p.numel()} values")

    @property
    def grad(self) -> torch.Tensor:
        """The unit's gradient block (``HostState.adopt_grads`` may have replaced it)."""
        return self.host.unit_grads[self.owner]

    def squared_norm(self) -> torch.Tensor:
        """The squared L2 norm of the unit's gradients (fp32, a 0-d tensor)."""
        return torch.linalg.vector_norm(self.grad).square()

    def step(self, lr: float, *, grad_divisor: float = 1.0) -> None:
        """One update of the unit with its gradients divided by ``grad_divisor`` (the clipping:
        the fused AdamW kernel applies it as it reads them; other optimizers after a scaling)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if grad_divisor != 1.0 and _fused(self.optimizer):
            # read by torch's fused kernels (what torch.amp.GradScaler sets): no extra pass
            self.optimizer.grad_scale = torch.tensor(grad_divisor, dtype=torch.float32)  # type: ignore[attr-defined]
        elif grad_divisor != 1.0:
            self.grad.div_(grad_divisor)
        self.param.grad = self.grad
        try:
            self.optimizer.step()
        finally:
            self.param.grad = None
            if getattr(self.optimizer, "grad_scale", None) is not None:
                self.optimizer.grad_scale = None  # type: ignore[attr-defined]

    # -- checkpoints: the per-tensor layout --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        flat_state = next(iter(sd["state"].values()), None)
        state: dict[int, dict[str, Any]] = {}
        if flat_state is not None:
            offset = 0
            for i, shape in enumerate(self.shapes):
                n = shape.numel()
                state[i] = {
                    key: _piece(value, offset, n, shape, total=self.param.numel())
                    for key, value in flat_state.items()
                }
                offset += n
        groups = [dict(g, params=list(range(len(self.shapes)))) for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        groups = sd["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.shapes):
            raise ValueError(
                f"optimizer unit {self.owner}: the saved state covers "
                f"{sum(len(g['params']) for g in groups)} tensors, the unit has {len(self.shapes)}"
            )
        per_tensor = [sd["state"].get(i, sd["state"].get(str(i))) for i in groups[0]["params"]]
        state: dict[int, dict[str, Any]] = {}
        if any(entry is not None for entry in per_tensor):
            if any(entry is None for entry in per_tensor):
                raise ValueError(f"optimizer unit {self.owner}: the saved state misses some tensors")
            joined: dict[str, Any] = {}
            for key, first in per_tensor[0].items():
                values = [entry[key] for entry in per_tensor]
                if isinstance(first, torch.Tensor) and first.dim() > 0:
                    for v, shape in zip(values, self.shapes, strict=True):
                        if v.numel() != shape.numel():
                            raise ValueError(
                                f"optimizer unit {self.owner}: saved {key} of {v.numel()} values "
                                f"for a tensor of {shape.numel()}"
                            )
                    joined[key] = torch.cat([v.reshape(-1) for v in values])
                else:
                    joined[key] = first.clone() if isinstance(first, torch.Tensor) else first
            state[0] = joined
        self.optimizer.load_state_dict({"state": state, "param_groups": [dict(groups[0], params=[0])]})


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(bool(g.get("fused")) for g in optimizer.param_groups)


def _piece(value: Any, offset: int, n: int, shape: torch.Size, *, total: int) -> Any:
    """A tensor's share of one flat state entry (a whole-block tensor), or a scalar's copy."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == total:
        return value[offset : offset + n].view(shape)
    return value.clone() if isinstance(value, torch.Tensor) else value


def build_units(host: HostState, spec: OptimizerSpec, cfg: EngineConfig) -> dict[int, Unit]:
    """One ``Unit`` per optimizer unit that has trainable tensors."""
    return {owner: Unit(host, owner, spec, cfg) for owner in host.unit_masters}


def global_norm(units: dict[int, Unit]) -> torch.Tensor:
    """The L2 norm of every unit's gradients together (0 with no units)."""
    if not units:
        return torch.zeros(())
    return torch.stack([u.squared_norm() for u in units.values()]).sum().sqrt()
