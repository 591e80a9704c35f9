"""Checkpoints that arrive quantized: bitsandbytes 4-bit (NF4 or FP4) and MXFP4 (GPT-OSS).

Such a folder is read here, shard by shard from memory-mapped safetensors (each tensor copied out
and its pages of the mapping given back at once), never through a ``transformers`` quantizer: the
model is built from its config without initializing weights (untouched memory costs nothing),
each plain tensor of the checkpoint becomes its parameter, and each quantized weight is either

- decoded to a dense tensor as it is read (``keep_packed=False``: a full fine-tune, a LoRA run
  with a 16-bit base, an export or a served model), one weight at a time, or
- kept *packed* as it is stored (``keep_packed=True``, a LoRA run with ``base_bits: 4``): its
  bytes go into one ``uint8`` buffer with a layout that decodes it (``BnbLayout``,
  ``Mxfp4Layout``), attached to the parameter (``engine.model.quant.attach``), whose own data is a
  zero-size placeholder of the right shape. The host state keeps the buffer as the weight's
  compute copy, stages upload it packed and the worker decodes it on its device, like the NF4
  weights the engine packs itself. Host memory never holds a dense copy of them.

A mixture of experts' checkpoint (Qwen3-MoE, DeepSeek-V3) stores one weight per expert and
projection where the model has one fused parameter per block (``gate_up_proj``: each expert's
gate rows then its up rows; ``down_proj``); the pieces are placed into it as they come, and kept
packed piece by piece (``StackedLayout``) when they arrive quantized.

The decoding is our own, pure torch (CPU workers and CUDA alike), and gives the values of the
formats' reference decoders bit for bit (tests compare them with bitsandbytes' own
``dequantize_4bit`` and with ``transformers``' MXFP4 de-quantization):

- bitsandbytes 4-bit: two codes a byte (the first in the high nibble) indexing the checkpoint's
  16-entry ``quant_map``, times one fp32 absmax per block of ``blocksize`` values; with double
  quantization the absmax are themselves uint8 codes into ``nested_quant_map`` times one fp32
  ``nested_absmax`` per ``nested_blocksize`` of them, plus ``nested_offset``; the product is
  formed in fp32 and then cast.
- MXFP4: ``X_blocks`` ``[..., out, groups, 16]`` holds two e2m1 codes a byte (the first in the
  low nibble) and ``X_scales`` ``[..., out, groups]`` one E8M0 exponent (bias 127) per 32 values;
  GPT-OSS's expert parameter ``X`` is ``[experts, in, out]``, the transpose of what is stored.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError
from engine.model import quant

# the methods read here, and the modules of a bitsandbytes checkpoint's quantization state
METHODS = ("bitsandbytes", "mxfp4")
_BNB_STATE = "quant_state.bitsandbytes__"
_BNB_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# e2m1 values of the codes 0..15 (bit 3 the sign)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _byte_table(book: torch.Tensor, *, high_first: bool) -> torch.Tensor:
    """``[256, 2]``: the two values each byte holds (``book`` indexed by its nibbles)."""
    byte = torch.arange(256, device=book.device)
    first, second = (byte >> 4, byte & 0x0F) if high_first else (byte & 0x0F, byte >> 4)
    return torch.stack([book[first], book[second]], dim=-1)


@dataclass(frozen=True)
class BnbLayout:
    """A bitsandbytes 4-bit weight in a packed buffer: codes, absmax (uint8 codes with double
    quantization, else fp32), the 16-entry code book, and with double quantization the nested
    absmax and code book."""

    shape: torch.Size
    dtype: torch.dtype  # what it decodes to
    blocksize: int
    nested_blocksize: int  # 0: no double quantization
    nested_offset: float
    parts: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def absmax(self, buffer: torch.Tensor) -> torch.Tensor:
        """Each block's fp32 scale."""
        if not self.nested_blocksize:
            return quant.view_part(buffer, self.parts[1], torch.float32)
        codes = quant.view_part(buffer, self.parts[1], torch.uint8)
        nested = quant.view_part(buffer, self.parts[3], torch.float32)
        book = quant.view_part(buffer, self.parts[4], torch.float32)
        values = torch.nn.functional.embedding(codes.to(torch.int32), book.unsqueeze(-1)).squeeze(-1)
        n = values.numel()
        full = n - n % self.nested_blocksize
        out = torch.empty_like(values)
        out[:full] = (
            values[:full].view(-1, self.nested_blocksize) * nested[: full // self.nested_blocksize, None]
        ).flatten()
        if full < n:
            out[full:] = values[full:] * nested[-1]
        return out + self.nested_offset

    def unpack(self, buffer: torch.Tensor) -> torch.Tensor:
        """The dense weight (``dtype``, on ``buffer``'s device)."""
        codes = quant.view_part(buffer, self.parts[0], torch.uint8)
        book = quant.view_part(buffer, self.parts[2], torch.float32)
        scales = self.absmax(buffer)
        values = torch.nn.functional.embedding(codes.to(torch.int32), _byte_table(book, high_first=True))
        values = values.reshape(-1)[: self.numel]
        n, size = self.numel, self.blocksize
        full = n - n % size
        out = torch.empty(n, dtype=self.dtype, device=buffer.device)
        out[:full] = (values[:full].view(-1, size) * scales[: full // size, None]).flatten()
        if full < n:
            out[full:] = values[full:] * scales[full // size]
        return out.view(self.shape)


@dataclass(frozen=True)
class Mxfp4Layout:
    """A GPT-OSS MXFP4 expert weight in a packed buffer: the blocks, then the scales."""

    shape: torch.Size  # the parameter's: [experts, in, out]
    dtype: torch.dtype
    stored: tuple[int, ...]  # the blocks' shape: [experts, out, groups, 16]
    parts: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def unpack(self, buffer: torch.Tensor) -> torch.Tensor:
        """The dense weight, one expert at a time (the decode's temporaries stay one expert's
        size); values and scales are powers of two apart, so computing in ``dtype`` is exact but
        for float16, which decodes through float32."""
        experts, rows, groups, width = self.stored
        blocks = quant.view_part(buffer, self.parts[0], torch.uint8).view(experts, rows * groups, width)
        scales = quant.view_part(buffer, self.parts[1], torch.uint8).view(experts, rows * groups, 1)
        work = torch.float32 if self.dtype == torch.float16 else self.dtype
        book = torch.tensor(_E2M1, dtype=work, device=buffer.device)
        table = _byte_table(book, high_first=False).reshape(256, 2)
        out = torch.empty(self.shape, dtype=self.dtype, device=buffer.device)
        for e in range(experts):
            values = torch.nn.functional.embedding(blocks[e].to(torch.int32), table).view(rows * groups, -1)
            values = torch.ldexp(values, scales[e].to(torch.int32) - 127)
            out[e].copy_(values.view(rows, groups * 2 * width).t())
        return out


# safetensors' dtype names
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _Shard:
    """One safetensors file, memory-mapped: ``get_tensor`` copies an entry out of the mapping
    and gives the mapping's pages of it back at once (``MADV_DONTNEED``: a read-only file
    mapping reads them again if touched), so reading a shard never keeps its pages resident and
    the process holds each tensor once."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header
        self.base = 8 + n
        self.path = path

    def __enter__(self) -> _Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.map.close()

    def keys(self) -> list[str]:
        return list(self.header)

    def get_tensor(self, key: str) -> torch.Tensor:
        meta = self.header[key]
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path.name}: {key} has dtype {meta['dtype']}, which is not read")
        start, end = (self.base + int(x) for x in meta["data_offsets"])
        if end == start:  # an empty tensor: nothing to read (a zero-length view is refused)
            return torch.empty(meta["shape"], dtype=_DTYPES[meta["dtype"]])
        with warnings.catch_warnings():  # the mapping is read-only; the view is only copied
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(self.map, dtype=torch.uint8, count=end - start, offset=start)
        out = view.clone()
        del view
        page = mmap.PAGESIZE
        first, last = (start + page - 1) // page * page, end // page * page
        if last > first:
            with contextlib.suppress(OSError, ValueError):
                self.map.madvise(mmap.MADV_DONTNEED, first, last - first)
        return out.view(_DTYPES[meta["dtype"]]).reshape(meta["shape"])


@dataclass(frozen=True)
class StackedLayout:
    """A fused expert parameter (``[experts, rows, cols]``) whose checkpoint stores one weight per
    expert and projection, each packed in its own layout: ``pieces`` are (byte start, byte end,
    layout, expert, first row) within one buffer."""

    shape: torch.Size
    dtype: torch.dtype
    pieces: tuple[tuple[int, int, BnbLayout, int, int], ...]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def unpack(self, buffer: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=buffer.device)
        for start, end, layout, expert, row in self.pieces:
            out[expert, row : row + layout.shape[0]] = layout.unpack(buffer[start:end])
        return out


# per-expert checkpoint entries of a fused experts parameter (transformers' layout for Qwen3-MoE
# and DeepSeek-V3: ``gate_up_proj`` [experts, 2 x width, hidden] holds each expert's gate rows then
# its up rows, ``down_proj`` [experts, hidden, width] each expert's down weight)
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def _fused_name(match: re.Match[str]) -> str:
    """The fused parameter a per-expert entry belongs to."""
    return f"{match['experts']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"


class _Fused:
    """The pieces of one fused experts parameter as the shards give them."""

    def __init__(self, param: torch.Tensor, slots: int) -> None:
        self.param = param
        self.slots = slots
        self.seen: set[tuple[int, int]] = set()
        self.dense: torch.Tensor | None = None
        self.packed: dict[tuple[int, int], tuple[torch.Tensor, BnbLayout]] = {}

    def _dense(self) -> torch.Tensor:
        if self.dense is None:
            self.dense = torch.empty(self.param.shape, dtype=self.param.dtype)
        return self.dense

    def add(
        self, expert: int, row: int, value: torch.Tensor | tuple[torch.Tensor, BnbLayout], keep: bool
    ) -> None:
        if isinstance(value, tuple) and keep:
            self.packed[expert, row] = value
        else:
            dense = value[1].unpack(value[0]) if isinstance(value, tuple) else value
            self._dense()[expert, row : row + dense.shape[0]] = dense
        self.seen.add((expert, row))

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.slots

    def finish(self) -> None:
        """Give the parameter its values: packed as stored when every piece came packed."""
        if self.packed and self.dense is None:
            pieces, chunks, offset = [], [], 0
            for (expert, row), (buffer, layout) in sorted(self.packed.items()):
                pieces.append((offset, offset + buffer.numel(), layout, expert, row))
                chunks.append(buffer)
                offset += buffer.numel()
            stacked = StackedLayout(self.param.shape, self.param.dtype, tuple(pieces))
            self.param.data = torch.zeros((), dtype=self.param.dtype).expand(self.param.shape)
            quant.attach(self.param, torch.cat(chunks), stacked)  # each piece stays 16-byte aligned
            return
        dense = self._dense()
        for (expert, row), (buffer, layout) in self.packed.items():
            dense[expert, row : row + layout.shape[0]] = layout.unpack(buffer)
        self.param.data = dense


def _bnb_state(raw: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(raw.tolist()).decode())


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(
        "model.path", f"model.path: {str(folder)!r} holds no safetensors weights", value=str(folder)
    )


def check_bitsandbytes(config: dict[str, Any], folder: Path) -> None:
    """A bitsandbytes checkpoint is read only in 4 bits.

    Raises:
        ConfigError: (``model.path``) an 8-bit one.
    """
    if not (config.get("load_in_4bit") or config.get("_load_in_4bit")):
        raise ConfigError(
            "model.path",
            f"model.path: {str(folder)!r} is a bitsandbytes checkpoint that is not 4-bit (8-bit weights "
            "cannot be read for training); give the unquantized model or a 4-bit one",
            value="bitsandbytes",
        )


class _Reader:
    """Groups a shard's entries into plain tensors and quantized weights."""

    def __init__(self, method: str, handle: Any, dtype_of: Any) -> None:
        self.method = method
        self.f = handle
        self.keys = set(handle.keys())
        self.dtype_of = dtype_of
        # each quantized weight's name and the entries it is stored in
        self.groups: dict[str, set[str]] = {}
        self.states: dict[str, str] = {}  # a bitsandbytes weight's quantization state entry
        for key in self.keys:
            if method == "bitsandbytes" and (state := self._bnb_state_key(key)) is not None:
                self.states[key] = state
                self.groups[key] = {key, state, *(f"{key}.{p}" for p in _BNB_PARTS)}
            elif method == "mxfp4" and key.endswith("_blocks"):
                name = key.removesuffix("_blocks")
                if f"{name}_scales" in self.keys:
                    self.groups[name] = {key, f"{name}_scales"}

    def quantized(self) -> Iterator[tuple[str, torch.Tensor, Any]]:
        """(parameter name, packed buffer, layout) of each quantized weight of the shard."""
        for name in sorted(self.groups):
            yield name, *(self._bnb(name) if self.method == "bitsandbytes" else self._mxfp4(name))

    def plain(self) -> list[str]:
        """The entries that are not part of a quantized weight."""
        used = set().union(*self.groups.values())
        return sorted(self.keys - used)

    def _bnb_state_key(self, key: str) -> str | None:
        for kind in ("nf4", "fp4"):
            if f"{key}.{_BNB_STATE}{kind}" in self.keys:
                return f"{key}.{_BNB_STATE}{kind}"
        return None

    def _bnb(self, key: str) -> tuple[torch.Tensor, BnbLayout]:
        f = self.f
        state = _bnb_state(f.get_tensor(self.states[key]))
        nested = f"{key}.nested_absmax" in self.keys
        # the codes' bytes, whatever dtype they are stored as (``bnb_4bit_quant_storage``)
        codes = f.get_tensor(key).contiguous().reshape(-1).view(torch.uint8)
        pieces = [codes, f.get_tensor(f"{key}.absmax"), f.get_tensor(f"{key}.quant_map").float()]
        if nested:
            pieces += [
                f.get_tensor(f"{key}.nested_absmax").float(),
                f.get_tensor(f"{key}.nested_quant_map").float(),
            ]
        buffer, parts = quant.lay_out(pieces)
        layout = BnbLayout(
            shape=torch.Size(state["shape"]),
            dtype=self.dtype_of(key),
            blocksize=int(state["blocksize"]),
            nested_blocksize=int(state["nested_blocksize"]) if nested else 0,
            nested_offset=float(state["nested_offset"]) if nested else 0.0,
            parts=parts,
        )
        return buffer, layout

    def _mxfp4(self, name: str) -> tuple[torch.Tensor, Mxfp4Layout]:
        blocks = self.f.get_tensor(f"{name}_blocks")
        scales = self.f.get_tensor(f"{name}_scales")
        experts, rows, groups, width = blocks.shape
        buffer, parts = quant.lay_out([blocks, scales])
        shape = torch.Size((experts, groups * 2 * width, rows))
        return buffer, Mxfp4Layout(shape, self.dtype_of(name), tuple(blocks.shape), parts)


def load(folder: str | Path, method: str, dtype: torch.dtype, *, keep_packed: bool) -> Any:
    """The causal LM of a quantized folder (``METHODS``), its plain weights in ``dtype`` (but for
    the modules the family keeps in fp32), its quantized ones decoded or kept packed.

    Raises:
        ConfigError: (``model.path``) the checkpoint's entries do not match the model its config
            describes (a layout this reader does not know), or a bitsandbytes one is not 4-bit.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    if method == "bitsandbytes":
        check_bitsandbytes(quantization, folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    filled: set[str] = set()
    unknown: list[str] = []

    fused: dict[str, _Fused] = {}

    def dtype_of(name: str) -> torch.dtype:
        match = _PER_EXPERT.match(name)
        if match is not None:  # a piece of a fused experts parameter: decoded to its dtype
            name = _fused_name(match)
        p = params.get(name)
        return p.dtype if p is not None and p.is_floating_point() else dtype

    def expert_piece(key: str, value: Any, shape: torch.Size) -> bool:
        """Place one expert's projection into its fused parameter; False: no such place."""
        match = _PER_EXPERT.match(key)
        assert match is not None
        expert, proj, name = int(match["e"]), match["proj"], _fused_name(match)
        param = params.get(name)
        if param is None or param.dim() != 3 or not expert < param.shape[0]:
            return False
        rows = shape[0]
        row = rows if proj == "up_proj" else 0
        if tuple(param.shape[1:]) != ((2 * rows if proj != "down_proj" else rows), shape[1]):
            return False
        if name not in fused:
            fused[name] = _Fused(param, param.shape[0] * (1 if proj == "down_proj" else 2))
        fused[name].add(expert, row, value, keep_packed)
        if fused[name].complete:
            fused[name].finish()
            filled.add(name)
        return True

    for shard in _shards(folder):
        with _Shard(shard) as handle:
            reader = _Reader(method, handle, dtype_of)
            for name, buffer, layout in reader.quantized():
                if _PER_EXPERT.match(name) and isinstance(layout, BnbLayout):
                    if not expert_piece(name, (buffer, layout), layout.shape):
                        unknown.append(name)
                    continue
                param = params.get(name)
                if param is None or param.shape != layout.shape:
                    unknown.append(name)
                    continue
                if keep_packed:
                    param.data = torch.zeros((), dtype=param.dtype).expand(layout.shape)
                    quant.attach(param, buffer, layout)
                else:
                    param.data = layout.unpack(buffer)
                filled.add(name)
            for key in reader.plain():
                if _PER_EXPERT.match(key):
                    value = handle.get_tensor(key)
                    if not expert_piece(key, value, value.shape):
                        unknown.append(key)
                    continue
                target = params.get(key, buffers.get(key))
                if target is None:
                    unknown.append(key)
                    continue
                value = handle.get_tensor(key)
                if tuple(value.shape) != tuple(target.shape):
                    unknown.append(key)
                    continue
                target.data = value.to(target.dtype) if target.is_floating_point() else value
                filled.add(key)
    model.tie_weights()  # a tied output layer is its embedding (a no-op for untied families)
    loaded = {id(params[n]) for n in filled if n in params}
    missing = sorted(
        n for n, p in dict(model.named_parameters(remove_duplicate=False)).items() if id(p) not in loaded
    )
    if unknown or missing:
        raise ConfigError(
            "model.path",
            f"model.path: {str(folder)!r}: its {method} checkpoint does not match the model its config "
            f"describes (entries not in the model: {unknown[:4]}; parameters not in the checkpoint: "
            f"{missing[:4]}); give the unquantized model",
            value=method,
        )
    return model
