"""Model state in host memory: the compute copy every stage uploads, fp32 masters, gradients.

Each distinct tensor of the model (a tied embedding is one tensor used by two layers) gets one
``HostTensor``. Trainable parameters have an fp32 master (the optimizer's copy) with an fp32
gradient buffer; frozen parameters (a LoRA base) have only their compute copy, no optimizer
state and no gradient traffic. The optimizer updates tensors in *units*: one per layer, owning
the trainable tensors that layer is the lowest user of. A unit's masters are views into one flat
fp32 block and its gradients views into another (``unit_masters``, ``unit_grads``), so the
optimizer makes one pass over a unit, not one per tensor, while each tensor keeps its name and
shape (checkpoints, exports).

For GPU workers the compute copies are pinned as one block per dtype with a view per tensor
(pinning each tensor alone rounds every allocation up to a power of two, nearly doubling the
pinned memory); ``release`` hands the blocks back and leaves the model on plain memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import COMPUTE_DTYPES
from engine.kinds import LayerKind
from engine.model import quant
from engine.model.adapter import AdaptedModel

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPES}


_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages now (file pages dropped, anonymous ones swapped)


def _page_out(t: torch.Tensor) -> None:
    """Give back the resident pages of a tensor the engine no longer reads (a base weight just
    packed from a memory-mapped checkpoint shard): the shard's mapping lives until its last tensor
    is packed, and the pages read so far would stay resident, counted in the process's memory, till
    then. ``MADV_PAGEOUT`` loses nothing (a file page is read again, an anonymous one is swapped),
    so a page shared with a neighbouring tensor stays correct; where it is unknown, nothing
    happens."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    page = 4096
    start = t.data_ptr()
    first = (start + page - 1) // page * page
    last = (start + t.numel() * t.element_size()) // page * page
    if last <= first:
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc, or no such advice: nothing
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_PAGEOUT)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _return_freed_memory() -> None:
    """Hand memory freed inside the C heap back to the system (glibc's ``malloc_trim``):
    tensors freed after many others were allocated stay in the process otherwise."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class HostTensor:
    key: int
    names: list[str]
    compute: torch.Tensor
    trainable: bool
    owner: int
    master: torch.nn.Parameter | None = None
    compute_alt: torch.Tensor | None = None  # async mode: the second compute buffer
    # a 4-bit base weight: ``compute`` is its packed uint8 buffer, this says how to decode it
    packed: quant.Layout | None = None

    def dense(self) -> torch.Tensor:
        """The values stages compute with (a packed weight decoded on the CPU)."""
        return self.compute if self.packed is None else self.packed.unpack(self.compute)

    def source(self, version: int) -> torch.Tensor:
        """The compute buffer holding weights ``version`` (odd versions in the second buffer)."""
        if self.compute_alt is not None and version % 2:
            return self.compute_alt
        return self.compute


class HostState:
    """Host copies of every tensor of an adapted model.

    Args:
        adapted: the model as layers.
        compute_dtype: dtype of the copy stages upload (floating parameters are cast to it, but
            for those the model keeps in fp32: its ``_keep_in_fp32_modules(_strict)``).
        pin: pin the compute copies (CUDA workers copy from them asynchronously).
        double_buffer: give trainable tensors a second compute buffer (async mode).
        base_bits: 4: the frozen weights of the decoder blocks are kept packed in NF4
            (``engine.model.quant``), and the model's own copies of them are released.
    """

    def __init__(
        self,
        adapted: AdaptedModel,
        *,
        compute_dtype: torch.dtype,
        pin: bool,
        double_buffer: bool,
        base_bits: int = 16,
    ) -> None:
        full = adapted.full_names()
        keep = [
            *(getattr(adapted.hf_model, "_keep_in_fp32_modules", None) or ()),
            *(getattr(adapted.hf_model, "_keep_in_fp32_modules_strict", None) or ()),
        ]

        def keep_fp32(names: list[str]) -> bool:
            # the modules a family computes in fp32 whatever the model's dtype (GPT-OSS's norms,
            # DeepSeek-V3's router), matched as whole dotted components of the name
            return any(f".{k}." in f".{n}." for n in names for k in keep)

        self.tensors: list[HostTensor] = []
        by_id: dict[int, int] = {}
        originals: list[torch.Tensor] = []
        self.layer_keys: list[dict[str, int]] = []
        for layer in adapted.layers:
            keys: dict[str, int] = {}
            for local, t in layer.tensors.items():
                if id(t) not in by_id:
                    by_id[id(t)] = len(self.tensors)
                    names = full.get(id(t), [])
                    dtype = torch.float32 if keep_fp32(names) else compute_dtype
                    loaded = quant.attached(t)
                    if loaded is not None:  # loaded packed from a quantized checkpoint: kept so
                        ht = self._adopt(len(self.tensors), t, names, layer.index, loaded, base_bits)
                    else:
                        ht = self._make(len(self.tensors), t, names, layer.index, dtype)
                    if loaded is None and (
                        base_bits == 4
                        and layer.kind == LayerKind.BLOCK
                        and self._packable(t, ht, fp32=keep_fp32(names))
                    ):
                        ht.compute, ht.packed = quant.pack(t, dtype)
                        _page_out(t.data)  # its checkpoint pages, read once to pack it
                        t.data = torch.empty(0, dtype=t.dtype)  # the dense copy goes: RAM saved
                    elif loaded is None and base_bits == 4 and not ht.trainable:
                        # its own copy: the rest of a memory-mapped checkpoint shard was packed,
                        # and the shard's mapping stays as long as one tensor still reads it
                        ht.compute = ht.compute.clone()
                        _page_out(t.data)  # the checkpoint's pages of it: the copy is what stays
                        if isinstance(t, nn.Parameter):  # the model lets go of the shard now
                            t.data = ht.compute
                    self.tensors.append(ht)
                    originals.append(t)
                keys[local] = by_id[id(t)]
            self.layer_keys.append(keys)
            if base_bits == 4:  # the packing's temporaries: handed back layer by layer, not at the end
                _return_freed_memory()
        if any(ht.packed is not None for ht in self.tensors):
            _return_freed_memory()  # the dense copies the packing replaced
        self.pinned = pin
        self.blocks: list[torch.Tensor] = []
        if pin:
            views, self.blocks = self._blocks([ht.compute for ht in self.tensors], pin=True)
            for ht, view in zip(self.tensors, views, strict=True):
                ht.compute = view
        # the model's parameters become the compute copy: host memory holds one copy, not two
        self._params = [
            (t, ht) for t, ht in zip(originals, self.tensors, strict=True) if isinstance(t, nn.Parameter)
        ]
        for t, ht in self._params:
            if ht.packed is None and ht.compute.data_ptr() != t.data_ptr():
                t.data = ht.compute
        if double_buffer:
            alts = [ht.compute for ht in self.tensors if ht.trainable]
            if pin:
                alts, more = self._blocks(alts, pin=True)
                self.blocks += more
            else:
                alts = [c.clone() for c in alts]
            for ht, alt in zip([ht for ht in self.tensors if ht.trainable], alts, strict=True):
                ht.compute_alt = alt
        self.num_layers = len(adapted.layers)
        self.owned: list[list[int]] = [[] for _ in range(self.num_layers)]
        for ht in self.tensors:
            if ht.trainable:
                self.owned[ht.owner].append(ht.key)
        # each unit's masters and gradients: views into one flat fp32 block each
        self.unit_masters: dict[int, torch.Tensor] = {}
        self.unit_grads: dict[int, torch.Tensor] = {}
        for owner, unit_keys in enumerate(self.owned):
            masters = [m for k in unit_keys if (m := self.tensors[k].master) is not None]
            if not masters:
                continue
            flat = torch.empty(sum(m.numel() for m in masters), dtype=torch.float32)
            # not zeroed: the step's first contribution writes it (or adopt_grads replaces it)
            # and settle_grads zeroes what none reached, so untouched pages cost no memory
            grads = torch.empty_like(flat)
            offset = 0
            for m in masters:
                n = m.numel()
                flat[offset : offset + n].copy_(m.detach().reshape(-1))
                m.data = flat[offset : offset + n].view(m.shape)
                m.grad = grads[offset : offset + n].view(m.shape)
                offset += n
            self.unit_masters[owner], self.unit_grads[owner] = flat, grads
        # where each unit's gradient block came from when a deposit was adopted as it:
        # (the deposit's whole buffer, whether it goes back to the board's pool once replaced)
        self.grad_buffers: dict[int, tuple[torch.Tensor, bool]] = {}
        # trainable tensors whose gradient buffer holds nothing yet this step: the first
        # contribution is written, not added, so no pass zeroes the buffers between steps
        self.unset: set[int] = {ht.key for ht in self.tensors if ht.master is not None}
        # the squared norm of each tensor's gradient buffer as the fold kernel left it
        self.grad_sq: dict[int, float] = {}
        # the optimizer units whose weights a layer reads (a tied output layer reads unit 0)
        self.layer_owners: list[set[int]] = [
            {self.tensors[k].owner for k in keys.values() if self.tensors[k].trainable}
            for keys in self.layer_keys
        ]
        # a frozen copy of the trainable tensors' first weights (``keep_initial``), by key
        self.initial: dict[int, torch.Tensor] = {}

    @staticmethod
    def _adopt(
        key: int,
        t: torch.Tensor,
        names: list[str],
        layer: int,
        loaded: tuple[torch.Tensor, quant.Layout],
        base_bits: int,
    ) -> HostTensor:
        """The host tensor of a weight loaded packed (``engine.model.prequantized``): its packed
        buffer is the compute copy; the parameter keeps a zero-size placeholder."""
        if base_bits != 4 or t.requires_grad:
            raise ValueError(f"{names}: a weight loaded packed needs a frozen base with base_bits 4")
        quant.detach_packed(t)
        t.data = torch.empty(0, dtype=t.dtype)
        return HostTensor(key, names, loaded[0], False, layer, packed=loaded[1])

    @staticmethod
    def _packable(t: torch.Tensor, ht: HostTensor, *, fp32: bool) -> bool:
        """A 4-bit base packs a frozen floating matrix of a block (linear or expert weights),
        but not what the family keeps in fp32, a mixture of experts' router, nor biases."""
        router = any(".router." in f".{n}" or ".mlp.gate." in f".{n}" for n in ht.names)
        bias = any(n.endswith("bias") for n in ht.names)  # e.g. GPT-OSS's expert biases [E, out]
        return (
            isinstance(t, nn.Parameter) and not ht.trainable and not fp32 and not router and not bias
        ) and quant.quantizable(ht.compute)

    @staticmethod
    def _blocks(
        tensors: Sequence[torch.Tensor], *, pin: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of ``tensors`` as views into one block per dtype (pinned with ``pin``).

        Returns:
            The views, in order, and the blocks.
        """
        by_dtype: dict[torch.dtype, int] = {}
        for t in tensors:
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel()
        blocks = {dt: torch.empty(n, dtype=dt, pin_memory=pin) for dt, n in by_dtype.items()}
        offsets = dict.fromkeys(by_dtype, 0)
        views = []
        for t in tensors:
            a = offsets[t.dtype]
            view = blocks[t.dtype][a : a + t.numel()].view(t.shape)
            view.copy_(t)
            offsets[t.dtype] = a + t.numel()
            views.append(view)
        return views, list(blocks.values())

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory the compute copies occupy (0 without GPU workers)."""
        return sum(b.numel() * b.element_size() for b in self.blocks)

    @property
    def compute_bytes(self) -> int:
        """Bytes of the compute copies (both buffers in async mode)."""
        total = 0
        for t in self.tensors:
            for c in (t.compute, t.compute_alt):
                if c is not None:
                    total += c.numel() * c.element_size()
        return total

    @staticmethod
    def _make(
        key: int,
        t: torch.Tensor,
        names: list[str],
        layer: int,
        dtype: torch.dtype,
    ) -> HostTensor:
        trainable = isinstance(t, torch.nn.Parameter) and t.requires_grad
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        if data.is_floating_point() and isinstance(t, torch.nn.Parameter):
            data = data.to(dtype)
        data = data.contiguous()
        ht = HostTensor(key, names, data, trainable, layer)
        if trainable:
            # its gradient buffer is a view into the unit's gradient block (set by the caller)
            ht.master = torch.nn.Parameter(t.detach().to("cpu", torch.float32, copy=True).contiguous())
        return ht

    @property
    def trainable(self) -> list[HostTensor]:
        return [t for t in self.tensors if t.trainable]

    def zero_grads(self) -> None:
        """Start a step's gradients over: the buffers count as empty (nothing is written)."""
        self.unset = {t.key for t in self.trainable if t.master is not None}
        self.grad_sq.clear()

    def unit_keys(self, owner: int) -> list[int]:
        """The keys of a unit's tensors in the order of its flat blocks."""
        return [k for k in self.owned[owner] if self.tensors[k].master is not None]

    def adopt_grads(
        self, owner: int, buffer: torch.Tensor, *, reusable: bool
    ) -> tuple[torch.Tensor, bool] | None:
        """Make the head of ``buffer`` (a deposit laid out like the unit's gradient block) the
        unit's gradient block: the deposit becomes the gradient, with no copy.

        Returns:
            The buffer the block came from before, when it was an adopted deposit: (buffer,
            whether it goes back to the board's pool).
        """
        block = buffer[: self.unit_grads[owner].numel()]
        offset = 0
        for k in self.unit_keys(owner):
            master = self.tensors[k].master
            assert master is not None
            n = master.numel()
            master.grad = block[offset : offset + n].view(master.shape)
            offset += n
        self.unit_grads[owner] = block
        previous = self.grad_buffers.get(owner)
        self.grad_buffers[owner] = (buffer, reusable)
        return previous

    def settle_grads(self) -> None:
        """Zero the buffers no contribution reached this step (before they are read)."""
        for k in self.unset:
            grad = self.tensors[k].master.grad  # type: ignore[union-attr]
            if grad is not None:
                grad.zero_()
            self.grad_sq[k] = 0.0
        self.unset = set()

    def grad_norm_sq(self) -> float | None:
        """The squared global norm of the gradients from what the fold kernel measured as it
        wrote them, or None when some buffer was written another way (then measure it)."""
        if len(self.grad_sq) != sum(len(keys) for keys in self.owned):
            return None
        return sum(self.grad_sq.values())

    def refresh_compute(self, owner: int, version: int) -> None:
        """Write the masters of one optimizer unit into the compute buffer of ``version``."""
        with torch.no_grad():
            for k in self.owned[owner]:
                t = self.tensors[k]
                if t.master is not None:
                    t.source(version).copy_(t.master)

    def compute_targets(self, owner: int, version: int) -> list[torch.Tensor]:
        """The compute buffers of ``version`` of one unit's tensors, in the unit's block order."""
        return [self.tensors[k].source(version) for k in self.unit_keys(owner)]

    def keep_initial(self, version: int) -> int:
        """Keep a frozen copy of the trainable tensors' compute buffers of ``version`` (in the
        compute dtype; pinned, one block per dtype, when the compute copies are): the weights a
        full fine-tune started from, which training no longer changes (its reference model).
        Kept once: a second call keeps the first copy.

        Returns:
            The copy's bytes.
        """
        if not self.initial:
            keys = [t.key for t in self.trainable]
            views, _ = self._blocks([self.tensors[k].source(version) for k in keys], pin=self.pinned)
            self.initial = dict(zip(keys, views, strict=True))
        return sum(t.numel() * t.element_size() for t in self.initial.values())

    def upload_source(self, key: int, version: int, *, initial: bool = False) -> torch.Tensor:
        """The host tensor a stage uploads for tensor ``key``: its compute buffer of
        ``version``, or with ``initial`` its frozen first weights (``keep_initial``; a frozen
        tensor's compute copy is its first weights)."""
        if initial and key in self.initial:
            return self.initial[key]
        return self.tensors[key].source(version)

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
        """Drop the host state; the model's parameters move off the pinned blocks first."""
        for t, ht in self._params:
            if ht.packed is not None:  # the model gets its base back, as the workers saw it
                t.data = ht.dense().to(t.dtype)
        if self.blocks:
            for t, ht in self._params:
                if ht.packed is None and t.data_ptr() == ht.compute.data_ptr():
                    t.data = torch.empty(ht.compute.shape, dtype=ht.compute.dtype).copy_(ht.compute)
        self._params.clear()
        self.blocks.clear()
        self.unit_masters.clear()
        self.unit_grads.clear()
        self.grad_buffers.clear()
        self.initial.clear()
        self.tensors.clear()
        self.layer_keys.clear()
        self.owned.clear()
