"""Model state in host memory: the compute copy every stage uploads, fp32 masters, gradients.

Each distinct tensor of the model (a tied embedding is one tensor used by two layers) gets one
``HostTensor``. Trainable parameters have an fp32 master (the optimizer's copy) with an fp32
gradient buffer; frozen parameters (a LoRA base) have only their compute copy, no optimizer
state and no gradient traffic. The optimizer updates tensors in *units*: one per layer, owning
the trainable tensors that layer is the lowest user of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import COMPUTE_DTYPES
from engine.model.adapter import AdaptedModel

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPES}


@dataclass
class HostTensor:
    key: int
    names: list[str]
    compute: torch.Tensor
    trainable: bool
    owner: int
    master: torch.nn.Parameter | None = None
    compute_alt: torch.Tensor | None = None  # async mode: the second compute buffer

    def source(self, version: int) -> torch.Tensor:
        """The compute buffer holding weights ``version`` (odd versions in the second buffer)."""
        if self.compute_alt is not None and version % 2:
            return self.compute_alt
        return self.compute


class HostState:
    """Host copies of every tensor of an adapted model.

    Args:
        adapted: the model as layers.
        compute_dtype: dtype of the copy stages upload (floating parameters are cast to it).
        pin: pin the compute copies (CUDA workers copy from them asynchronously).
        double_buffer: give trainable tensors a second compute buffer (async mode).
    """

    def __init__(
        self, adapted: AdaptedModel, *, compute_dtype: torch.dtype, pin: bool, double_buffer: bool
    ) -> None:
        full = adapted.full_names()
        self.tensors: list[HostTensor] = []
        by_id: dict[int, int] = {}
        self.layer_keys: list[dict[str, int]] = []
        for layer in adapted.layers:
            keys: dict[str, int] = {}
            for local, t in layer.tensors.items():
                if id(t) not in by_id:
                    by_id[id(t)] = len(self.tensors)
                    self.tensors.append(
                        self._make(len(self.tensors), t, full, layer.index, compute_dtype, pin)
                    )
                keys[local] = by_id[id(t)]
            self.layer_keys.append(keys)
        if double_buffer:
            for ht in self.tensors:
                if ht.trainable:
                    ht.compute_alt = ht.compute.clone().pin_memory() if pin else ht.compute.clone()
        self.num_layers = len(adapted.layers)
        self.owned: list[list[int]] = [[] for _ in range(self.num_layers)]
        for ht in self.tensors:
            if ht.trainable:
                self.owned[ht.owner].append(ht.key)
        # the optimizer units whose weights a layer reads (a tied output layer reads unit 0)
        self.layer_owners: list[set[int]] = [
            {self.tensors[k].owner for k in keys.values() if self.tensors[k].trainable}
            for keys in self.layer_keys
        ]

    @staticmethod
    def _make(
        key: int,
        t: torch.Tensor,
        full: dict[int, list[str]],
        layer: int,
        dtype: torch.dtype,
        pin: bool,
    ) -> HostTensor:
        trainable = isinstance(t, torch.nn.Parameter) and t.requires_grad
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        if data.is_floating_point() and isinstance(t, torch.nn.Parameter):
            data = data.to(dtype)
        data = data.contiguous()
        if pin and not data.is_pinned():
            data = data.pin_memory()
        ht = HostTensor(key, full.get(id(t), []), data, trainable, layer)
        if trainable:
            master = torch.nn.Parameter(t.detach().to("cpu", torch.float32, copy=True).contiguous())
            master.grad = torch.zeros_like(master)
            ht.master = master
        if isinstance(t, torch.nn.Parameter) and data.data_ptr() != t.data_ptr():
            # the model's parameter becomes the compute copy: host memory holds one copy, not two
            t.data = data
        return ht

    @property
    def trainable(self) -> list[HostTensor]:
        return [t for t in self.tensors if t.trainable]

    def zero_grads(self) -> None:
        for t in self.trainable:
            if t.master is not None and t.master.grad is not None:
                t.master.grad.zero_()

    def refresh_compute(self, owner: int, version: int) -> None:
        """Write the masters of one optimizer unit into the compute buffer of ``version``."""
        with torch.no_grad():
            for k in self.owned[owner]:
                t = self.tensors[k]
                if t.master is not None:
                    t.source(version).copy_(t.master)

    def param_bytes(self, layer: int) -> int:
        """Bytes of the compute copy a layer uploads."""
        return sum(
            self.tensors[k].compute.numel() * self.tensors[k].compute.element_size()
            for k in self.layer_keys[layer].values()
        )

    def trainable_numel(self, layer: int) -> int:
        return sum(
            self.tensors[k].compute.numel()
            for k in self.layer_keys[layer].values()
            if self.tensors[k].trainable
        )

    def release(self) -> None:
        self.tensors.clear()
        self.layer_keys.clear()
        self.owned.clear()
