"""A model folder as one GGUF file for llama.cpp (and Ollama); a LoRA adapter as a LoRA GGUF.

Names come from ``gguf``'s tensor-name maps; the layout changes and metadata per family from
``engine.export.gguf_families``; the tokenizer from ``engine.export.gguf_vocab``. Norms and
other 1-D tensors stay float32, as llama.cpp expects; the matrices take the chosen type:

- ``f16``, ``bf16``: every matrix in that float type;
- ``q8_0``: 8-bit blocks of 32 (a matrix whose rows are not a multiple of 32 stays f16);
- ``q4_k_m``: llama.cpp's mix: Q6_K for the output matrix and for the value and down
  projections of some blocks, Q4_K for the rest, with llama.cpp's fallbacks for rows that are
  not a multiple of 256 (Q4_K -> Q5_0, Q6_K -> Q8_0; see ``engine.export.gguf_types``).

The blocks (Q4_K, Q6_K, Q5_0, Q8_0) are llama.cpp's, byte for byte (``engine.export.kquants``).
llama.cpp makes a q4_k_m file from an f16 GGUF (``convert_hf_to_gguf.py --outtype f16``, then
``llama-quantize``), so a float32 or bfloat16 checkpoint's matrices are rounded to float16 before
q4_k_m's blocks are made from them. ``q8_0`` is quantized from the weights as read, as the
converter's own ``--outtype q8_0`` does.

A background thread reads the next tensor (and lays it out) while this one is encoded; the
encoders run on one thread per CPU.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.export.gguf_families import GgufFamily, family_for, head_dim, rope_parameters, sliding_layers
from engine.export.gguf_quants import QUANTS
from engine.export.gguf_types import tensor_type
from engine.export.kquants import FORMATS, quantize
from engine.export.read_ahead import Ahead

log = logging.getLogger(__name__)
F16_MAX = float(np.finfo(np.float16).max)


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise ValueError(f"quant: one of {', '.join(QUANTS)} (got {quant!r})")
    return quant


def interleave_heads(weight: np.ndarray, heads: int) -> np.ndarray:
    """Per head, rows [first half, second half] -> pairs (r0, r_half, r1, r_half+1, ...): from
    transformers' half-split rotary to llama.cpp's adjacent-pair rotary."""
    rows = weight.shape[0]
    per_head = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def read_weights(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """The folder's safetensors tensors, one at a time: float16 and float32 as stored (no
    copy beyond the read), any other type (bfloat16) as float32, which holds it exactly."""
    import torch
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"GGUF export: {folder} has no .safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensor = f.get_tensor(name)
                if tensor.dtype not in (torch.float16, torch.float32):
                    tensor = tensor.to(torch.float32)
                yield name, tensor.numpy()


def _as_f16_file_holds(name: str, array: np.ndarray) -> np.ndarray:
    """A matrix as the f16 GGUF that llama-quantize starts from holds it: float16 (a matrix
    with values beyond float16's range stays float32, with a warning: llama.cpp's converter
    would write them as infinities)."""
    if array.dtype == np.float16:
        return array
    half = array.astype(np.float16)
    if np.isinf(half).any() and not np.isinf(array).any():
        log.warning(
            "GGUF export: %s has values beyond float16's range (%g): quantized from float32",
            name,
            F16_MAX,
        )
        return array
    return half


def encode(array: np.ndarray, qtype: Any) -> np.ndarray:
    """``array`` (float16 or float32) in the GGML type ``qtype``: raw bytes for block types."""
    import gguf

    q = gguf.GGMLQuantizationType
    if qtype == q.F32:
        return array.astype(np.float32)
    if qtype == q.F16:
        return array.astype(np.float16)
    if qtype.name in FORMATS:
        return quantize(array, qtype.name)
    return gguf.quants.quantize(array.astype(np.float32, copy=False), qtype)


def _file_type(quant: str) -> int:
    import gguf

    f = gguf.LlamaFileType
    return int(
        {"f16": f.MOSTLY_F16, "bf16": f.MOSTLY_BF16, "q8_0": f.MOSTLY_Q8_0, "q4_k_m": f.MOSTLY_Q4_K_M}[quant]
    )


def _block_of(name: str) -> int | None:
    for part in name.split("."):
        if part.isdecimal():
            return int(part)
    return None


def _hyperparameters(writer: Any, config: Any, family: GgufFamily) -> int:
    """The architecture metadata; returns the context length written."""
    import gguf

    context = int(config.max_position_embeddings)
    pattern = sliding_layers(config)
    if pattern is not None and not family.swa:
        # llama.cpp runs full attention here: the file is exact up to the window
        context = min(context, int(config.sliding_window))
    dim = head_dim(config)
    rope = rope_parameters(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(int(dim * float(rope.get("partial_rotary_factor", 1.0))))
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config.vocab_size)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(float(rope[key]))
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
    if family.metadata is not None:
        family.metadata(config, writer)
    return context


def llama3_rope_factors(config: Any) -> np.ndarray:
    """Llama 3.1's rotary frequency divisors, one per rotated pair (llama.cpp's rope_freqs)."""
    rope = rope_parameters(config)
    dim = head_dim(config)
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    wavelengths = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (original / wavelengths - low) / (high - low)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelengths < original / high, 1.0, divisors)
    divisors = np.where(wavelengths > original / low, factor, divisors)
    return divisors.astype(np.float32)


def _tensors(folder: Path, config: Any, family: GgufFamily, tmap: Any) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, array in llama.cpp's layout: float16 or float32, as ``read_weights``) for every
    weight of the folder."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, array in read_weights(folder):
        if tied and name == "lm_head.weight":
            continue  # llama.cpp uses token_embd when there is no output.weight
        base, _, suffix = name.rpartition(".")
        mapped = tmap.get_name(base)
        if mapped is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"GGUF export: no GGUF name for tensor {name!r} of {config.architectures[0]}")
        if family.permute_qk and base.endswith("q_proj"):
            array = interleave_heads(array, heads)
        elif family.permute_qk and base.endswith("k_proj"):
            array = interleave_heads(array, kv_heads)
        if family.norm_offset and name.endswith("norm.weight"):
            array = array.astype(np.float32) + np.float32(family.norm_offset)
        yield f"{mapped}.{suffix}", array
    rope = rope_parameters(config)
    if family.llama3_rope and rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(config)


def export_gguf(
    folder: str | Path, out: str | Path, *, quant: str = "f16", name: str | None = None
) -> dict[str, Any]:
    """Write the model folder ``folder`` (config.json, safetensors, tokenizer) as the GGUF file
    ``out`` (atomically: a temporary file renamed).

    Args:
        folder: a Hugging Face model folder of a family in ``GGUF_FAMILIES`` (a merged export).
        out: the .gguf file to write.
        quant: f16, bf16, q8_0 or q4_k_m.
        name: ``general.name`` (default: the folder's name).

    Returns:
        What the Modelfile needs and what was written: ``arch``, ``context_length``, ``eos``,
        ``chat_template``, ``quant``, ``tensors``, and ``fallbacks``: one line per tensor whose
        rows did not fit the mix's type and took llama.cpp's fallback type (also logged as a
        warning).

    Raises:
        ValueError: a bad ``quant``, a family or config llama.cpp cannot run, a tokenizer it
            cannot run.
    """
    import gguf
    from transformers import AutoConfig

    check_quant(quant)
    folder, out = Path(folder), Path(out)
    config = AutoConfig.from_pretrained(folder)
    family = family_for(config)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    tmap = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or folder.name)
        context = _hyperparameters(writer, config, family)
        writer.add_file_type(_file_type(quant))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        count, fallbacks = 0, []
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # the reader starts on the first tensors while the tokenizer is written
        with Ahead(_tensors(folder, config, family, tmap)) as tensors:
            tokenizer = _vocab(writer, folder, config.vocab_size)
            for gguf_name, array in tensors:
                chosen = tensor_type(
                    quant,
                    gguf_name,
                    array.shape,
                    layer=_block_of(gguf_name),
                    layers=config.num_hidden_layers,
                    tied=tied,
                )
                if chosen.wanted is not None:
                    fallbacks.append(chosen.describe(gguf_name, array.shape[-1]))
                    log.warning("GGUF export: %s", fallbacks[-1])
                qtype = chosen.qtype
                if quant == "q4_k_m" and chosen.name != "F32":
                    array = _as_f16_file_holds(gguf_name, array)
                data = encode(array, qtype)
                writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
                count += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, out)
    return {
        "arch": gguf.MODEL_ARCH_NAMES[arch],
        "context_length": context,
        "quant": quant,
        "tensors": count,
        "fallbacks": fallbacks,
        **tokenizer,
    }


def _vocab(writer: Any, folder: Path, vocab_size: int) -> dict[str, Any]:
    from engine.export.gguf_vocab import add_vocab

    return add_vocab(writer, folder, vocab_size=vocab_size)


def export_adapter_gguf(adapter: str | Path, base: str | Path, out: str | Path) -> dict[str, Any]:
    """Write a PEFT LoRA adapter folder as a LoRA GGUF for llama.cpp (``--lora``) on a GGUF of its
    base model. The adapter's matrices stay float32; llama.cpp scales them by alpha / r.

    Args:
        adapter: the adapter folder (adapter_config.json, adapter_model.safetensors).
        base: the base model folder (for its config: the architecture and head counts).
        out: the .gguf file to write.

    Raises:
        ValueError: an adapter llama.cpp cannot apply as written (DoRA, per-module ranks or
            alphas, trained modules besides LoRA matrices), or a base family with no GGUF export.
    """
    import gguf
    from transformers import AutoConfig

    adapter, out = Path(adapter), Path(out)
    lora = json.loads((adapter / "adapter_config.json").read_text())
    for field in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "target_parameters"):
        if lora.get(field):
            raise ValueError(f"GGUF adapter export: {field} is not written yet (got {lora[field]!r})")
    rank = int(lora["r"])
    alpha = float(lora["lora_alpha"])
    if lora.get("use_rslora"):
        alpha = alpha * rank**0.5  # llama.cpp scales by alpha / r; rsLoRA by alpha / sqrt(r)
    config = AutoConfig.from_pretrained(base)
    family = family_for(config)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    tmap = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    count = 0
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_name(adapter.name)
        for name, array in read_weights(adapter):
            module, _, part = name.partition(".lora_")
            if part not in ("A.weight", "B.weight"):
                raise ValueError(f"GGUF adapter export: tensor {name!r} is not a LoRA matrix")
            base_name = module.removeprefix("base_model.model.")
            mapped = tmap.get_name(base_name)
            if mapped is None:
                raise ValueError(f"GGUF adapter export: no GGUF name for module {base_name!r}")
            if part == "B.weight" and family.permute_qk and base_name.endswith(("q_proj", "k_proj")):
                array = interleave_heads(array, heads if base_name.endswith("q_proj") else kv_heads)
            suffix = "lora_a" if part == "A.weight" else "lora_b"
            writer.add_tensor(f"{mapped}.weight.{suffix}", array.astype(np.float32))
            count += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, out)
    return {"arch": gguf.MODEL_ARCH_NAMES[arch], "tensors": count, "alpha": alpha, "rank": rank}
