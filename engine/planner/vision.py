"""A vision-language model's vision tower and projector, from its ``config.json``: their weights,
the linears LoRA adapts, and what one image costs (the patches the tower runs over, the image
tokens the language model reads, the pixel values the host holds for it).

The engine runs the tower, the projector and the token embeddings as one pipeline layer, the input
layer (``engine.vision.layer``), so the planner adds them to that layer: its weights, its
trainable parameters (``method.vision_tower`` and ``method.projector``: frozen, LoRA or full), its
activations when something in it trains, and its FLOPs over a micro-batch's patches.

Per family (``VisionSpec.features``):

- ``qwen2_5_vl``: a ViT of ``depth`` blocks (RMSNorms, fused q/k/v with biases, a gated MLP with
  biases) over 3-D patches (``temporal_patch_size`` frames of ``patch_size``²), windowed attention
  but in ``fullatt_block_indexes``; its patch merger (the projector) takes each
  ``spatial_merge_size``² patches to one token. Images keep their aspect ratio, resized to
  multiples of patch x merge within the image processor's pixel bounds.
- ``gemma3``: a SigLIP tower (LayerNorms, q/k/v/out with biases, a two-matrix MLP, learned
  positions) at a fixed ``image_size``; the projector pools to ``mm_tokens_per_image`` tokens.
- ``idefics3``: a SigLIP-shaped tower over tiles of ``image_size``; the connector's pixel shuffle
  takes ``scale_factor``² patches to one token. The image processor scales an image's longest edge
  to its ``size``, rounds each edge up to whole tiles and, when that is more than one tile, adds a
  global tile of the whole image.

The image processor's settings (its ``preprocessor_config.json``: Qwen's pixel bounds, Idefics3's
sizes) refine the image costs when given; else the families' defaults.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.vision.families import vision_spec

# the image processors' default pixel bounds (Qwen2-VL's: shortest_edge / longest_edge in pixels)
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
IDEFICS3_TILES_PER_EDGE = 4  # Idefics3/SmolVLM scale an image's longest edge to 4 tiles
QWEN_FEATURES = ("qwen2_5_vl", "qwen3_vl")  # dynamic resolution, a patch merger inside the tower
VISION_LIMIT = 1 << 20  # the largest vision size (hidden, width, depth, patch) a plan accepts
TRAINING = ("frozen", "lora", "full")  # how the tower or the projector trains


@dataclass(frozen=True)
class ImageCost:
    """One image as the engine runs it: the patches its tower sees, the image tokens the language
    model reads, and the pixel values (floats) the host holds for it."""

    patches: int
    tokens: int
    pixel_values: int


@dataclass(frozen=True)
class Tower:
    """A VLM's vision tower and projector sizes (see the module docstring).

    Attributes:
        features: the family's ``VisionSpec.features``.
        hidden, intermediate, depth, heads, patch: the tower's ViT sizes.
        tower_params: every weight of the tower (the projector's not included).
        projector_params: every weight of the projector.
        block_linears: (in, out) of each linear of one tower block, by name.
        projector_linears: (in, out) of each linear of the projector.
        gated: the tower's MLP has three matrices (gate, up, down), else two.
        merge: patches per image token along an edge (Qwen's spatial merge, Idefics3's scale).
        temporal: frames per patch (Qwen's temporal patch size; 1 elsewhere).
        image_size: the tower's fixed input size (SigLIP towers), 0 for a dynamic one.
        tokens_per_image: Gemma 3's pooled tokens per image; 0 elsewhere.
        window: patches a windowed-attention block attends to (Qwen), 0 for full attention.
        full_blocks: Qwen's blocks with full attention.
        min_pixels, max_pixels: Qwen's image area bounds.
        resize_edge: Idefics3's longest edge after resizing (0: no splitting, one tile).
    """

    features: str
    hidden: int
    intermediate: int
    depth: int
    heads: int
    patch: int
    tower_params: int
    projector_params: int
    block_linears: tuple[tuple[str, int, int], ...]
    projector_linears: tuple[tuple[str, int, int], ...]
    gated: bool
    merge: int = 1
    temporal: int = 1
    image_size: int = 0
    tokens_per_image: int = 0
    window: int = 0
    full_blocks: frozenset[int] = frozenset()
    min_pixels: int = QWEN_MIN_PIXELS
    max_pixels: int = QWEN_MAX_PIXELS
    resize_edge: int = 0
    deepstack: int = 0  # Qwen3-VL's deepstack mergers (one per deepstack layer)

    @classmethod
    def from_config(cls, config: dict[str, Any], processor: dict[str, Any] | None = None) -> Tower | None:
        """The tower of a VLM ``config.json`` (None: not a VLM the engine trains), its image
        costs by the image processor's settings ``processor`` (its ``preprocessor_config.json``)
        when given.

        Raises:
            ConfigError: a vision size is missing or not a positive integer (``field`` names it,
                as ``vision_config.<key>``).
        """
        archs = config.get("architectures") or []
        spec = vision_spec(archs[0] if archs and isinstance(archs[0], str) else None)
        vision = config.get("vision_config")
        if spec is None or not isinstance(vision, dict):
            return None
        text = config.get("text_config") or config  # Qwen2.5-VL's own config.json: the text sizes on top
        out = _size("hidden_size", text.get("hidden_size") if isinstance(text, dict) else None)
        settings = processor if isinstance(processor, dict) else {}
        if spec.features == "qwen2_5_vl":
            return _qwen(vision, out, settings)
        if spec.features == "qwen3_vl":
            return _qwen3(vision, out, settings)
        if spec.features == "gemma3":
            return _gemma3(config, vision, out)
        return _idefics3(config, vision, out, settings)

    @property
    def params(self) -> int:
        """The tower's and the projector's weights."""
        return self.tower_params + self.projector_params

    @property
    def projector_inside(self) -> bool:
        """Whether the projector is a module of the tower (Qwen2.5-VL's and Qwen3-VL's patch merger)."""
        return self.features in QWEN_FEATURES

    def trainable(self, *, tower: str, projector: str, rank: int) -> int:
        """The parameters that train: all of a ``full`` part, LoRA adapters of rank ``rank`` on
        each linear layer of a ``lora`` part (r x (in + out) each; Gemma 3's projector is a bare
        matrix, no linear layer), none of a frozen one (``engine.vision.tuning``)."""
        count = 0
        adaptable = () if self.features == "gemma3" else self.projector_linears  # a bare matrix there
        for mode, total, linears, times in (
            (tower, self.tower_params, self.block_linears, self.depth),
            (projector, self.projector_params, adaptable, 1),
        ):
            if mode == "full":
                count += total
            elif mode == "lora":
                count += times * sum(rank * (a + b) for _, a, b in linears)
        return count

    def image(self, width: int, height: int) -> ImageCost:
        """What one ``width`` x ``height`` image costs (see the module docstring)."""
        channels = 3
        if self.features in QWEN_FEATURES:
            factor = self.patch * self.merge
            h, w = _qwen_resize(height, width, factor, self.min_pixels, self.max_pixels)
            patches = (h // self.patch) * (w // self.patch)
            values = channels * self.temporal * self.patch * self.patch
            return ImageCost(patches, patches // (self.merge * self.merge), patches * values)
        per_tile = (self.image_size // self.patch) ** 2
        values = channels * self.image_size * self.image_size
        if self.features == "gemma3":
            return ImageCost(per_tile, self.tokens_per_image, values)
        tiles = 1
        if self.resize_edge:
            tile, scale = self.image_size, self.resize_edge / max(width, height, 1)
            tiles = math.ceil(width * scale / tile) * math.ceil(height * scale / tile)
            tiles += 1 if tiles > 1 else 0  # the global tile beside the split ones
        tokens = per_tile // (self.merge * self.merge)
        return ImageCost(tiles * per_tile, tiles * tokens, tiles * values)

    def block_flops(self, patches: float, context: float) -> float:
        """Forward FLOPs of the tower's blocks over ``patches`` patches, each attending to
        ``context`` patches (its image's, or its window's in a windowed block)."""
        weights = sum(a * b for _, a, b in self.block_linears)
        total = 0.0
        for block in range(self.depth):
            seen = context if not self.window or block in self.full_blocks else min(context, self.window)
            total += 2.0 * weights * patches + 4.0 * self.hidden * patches * seen
        return total

    def projector_flops(self, patches: float) -> float:
        """Forward FLOPs of the projector for ``patches`` tower patches."""
        weights = sum(a * b for _, a, b in self.projector_linears)
        rows = patches / (self.merge * self.merge) if self.features != "gemma3" else patches
        return 2.0 * weights * rows

    def activation_bytes(self, patches: float, dtype_bytes: int, *, tower: bool) -> float:
        """Bytes autograd keeps for ``patches`` patches when the tower trains (``tower``) or only
        the projector, in values per patch as the families' own modules save them (measured
        with saved-tensor hooks, fp32 and bf16: ``tests/engine/test_planner_vision_memory.py``):

        - the projector's inputs: Qwen2.5-VL's merger 4h (its norm's input, the MLP's input and
          hidden), Qwen3-VL's 4h + 2 (its LayerNorm's statistics too), Idefics3's connector h
          (the pixel-shuffled features), Gemma 3's pooled tokens' norm and projection input 2h a
          pooled token;
        - a trained tower's blocks: 13h + 4i + 2 heads a block in Qwen2.5-VL's (RMSNorm inputs,
          q/k before and after the rotary embedding, v, the attention output, gate/up/activation
          and product of the gated MLP), 11h + 2i + 4 + heads in Qwen3-VL's (LayerNorms, a plain
          MLP), 8h + 2i + 4 + heads in SigLIP's (LayerNorm inputs and statistics, q/k/v, the
          attention output, fc1 and its activation); besides them the rotary tables and windowed
          reorder (Qwen2.5-VL: h + 2 head_dim), the position grid and each deepstack merger's
          inputs (Qwen3-VL: h + 12, and 3h + 0.5 a merger), the last norm's and pooling's inputs
          (SigLIP), and the patch embedding's input, the pixel values.

        In a 16-bit compute dtype some of them stay fp32 (the RMSNorms upcast their input, the
        rotary tables are fp32): 2h a block and 2h besides in Qwen2.5-VL's tower, 2 head_dim + 14
        in Qwen3-VL's, h a pooled token in Gemma 3's projector.
        """
        h, i, heads = self.hidden, self.intermediate, self.heads
        upcast = 0.0  # values a 16-bit run keeps in fp32
        if self.features == "qwen2_5_vl":
            per_patch = 4.0 * h
            block, extra = 13.0 * h + 4.0 * i + 2.0 * heads, h + 2.0 * (h // heads)
            pixels = 3 * self.temporal * self.patch * self.patch
            upcast_tower = 2.0 * h * (self.depth + 1)
        elif self.features == "qwen3_vl":
            per_patch = 4.0 * h + 2.0
            block = 11.0 * h + 2.0 * i + 4.0 + heads
            extra = h + 12.0 + self.deepstack * (3.0 * h + 0.5)  # and each deepstack merger's inputs
            pixels = 3 * self.temporal * self.patch * self.patch
            upcast_tower = 2.0 * (h // heads) + 14.0  # the rotary tables, the position grid's weights
        else:
            per_tile = (self.image_size // self.patch) ** 2
            pooled = self.tokens_per_image / per_tile if self.features == "gemma3" else 0.0
            per_patch = 2.0 * pooled * h if self.features == "gemma3" else float(h)
            block = 8.0 * h + 2.0 * i + 4.0 + heads
            extra = (2.0 + pooled) * h + 3.0 if self.features == "gemma3" else h + 4.0
            pixels = 3 * self.patch * self.patch
            upcast, upcast_tower = pooled * h, 0.0
        if tower:
            per_patch += self.depth * block + extra + pixels
            upcast += upcast_tower
        return float(patches * (per_patch * dtype_bytes + upcast * max(0, 4 - dtype_bytes)))


def image_stats(rows: Iterable[Sequence[bytes]]) -> tuple[list[int], list[tuple[int, int]]]:
    """What a dataset's rows hold, for ``Workload.from_train_config``: each row's image count and
    each image's (width, height), read from the image file's header (an image that does not open
    is left out of the sizes: a dataset's validation refuses it).

    Args:
        rows: each row's image file bytes (``engine.data``'s ``Example.images``, read).
    """
    from PIL import Image, UnidentifiedImageError  # only where a plan reads images

    counts: list[int] = []
    sizes: list[tuple[int, int]] = []
    for images in rows:
        counts.append(len(images))
        for data in images:
            try:
                with Image.open(io.BytesIO(data)) as image:
                    sizes.append((int(image.width), int(image.height)))
            except (OSError, UnidentifiedImageError, ValueError):
                continue
    return counts, sizes


def _qwen(vision: dict[str, Any], out: int, processor: dict[str, Any]) -> Tower:
    h = _size("vision_config.hidden_size", vision.get("hidden_size"))
    i = _size("vision_config.intermediate_size", vision.get("intermediate_size"))
    depth = _size("vision_config.depth", vision.get("depth"))
    heads = _size("vision_config.num_heads", vision.get("num_heads"))
    patch = _size("vision_config.patch_size", vision.get("patch_size", 14))
    temporal = _size("vision_config.temporal_patch_size", vision.get("temporal_patch_size", 2))
    merge = _size("vision_config.spatial_merge_size", vision.get("spatial_merge_size", 2))
    channels = _size("vision_config.in_channels", vision.get("in_channels", 3))
    out = _size("vision_config.out_hidden_size", vision.get("out_hidden_size", out))
    window = int(vision.get("window_size") or 0)
    full = vision.get("fullatt_block_indexes") or []
    linears = (("qkv", h, 3 * h), ("proj", h, h), ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))
    # two RMSNorms, every linear with its bias
    block = 2 * h + sum(a * b + b for _, a, b in linears)
    merged = h * merge * merge
    projector_linears = (("mlp.0", merged, merged), ("mlp.2", merged, out))
    return Tower(
        features="qwen2_5_vl",
        hidden=h,
        intermediate=i,
        depth=depth,
        heads=heads,
        patch=patch,
        tower_params=channels * temporal * patch * patch * h + depth * block,
        projector_params=h + sum(a * b + b for _, a, b in projector_linears),  # ln_q and the MLP
        block_linears=linears,
        projector_linears=projector_linears,
        gated=True,
        merge=merge,
        temporal=temporal,
        window=(window // patch) ** 2 if window >= patch else 0,
        full_blocks=frozenset(int(b) for b in full if isinstance(b, int)),
        min_pixels=_setting(processor, "shortest_edge", "min_pixels", QWEN_MIN_PIXELS),
        max_pixels=_setting(processor, "longest_edge", "max_pixels", QWEN_MAX_PIXELS),
    )


def _qwen3(vision: dict[str, Any], out: int, processor: dict[str, Any]) -> Tower:
    """Qwen3-VL's tower: Qwen2.5-VL's patching and merging, LayerNorms with biases, a learned
    position grid, a plain two-matrix MLP, full attention in every block, and one more merger per
    deepstack layer (counted with the tower: ``engine.vision.families``)."""
    h = _size("vision_config.hidden_size", vision.get("hidden_size"))
    i = _size("vision_config.intermediate_size", vision.get("intermediate_size"))
    depth = _size("vision_config.depth", vision.get("depth"))
    heads = _size("vision_config.num_heads", vision.get("num_heads"))
    patch = _size("vision_config.patch_size", vision.get("patch_size", 16))
    temporal = _size("vision_config.temporal_patch_size", vision.get("temporal_patch_size", 2))
    merge = _size("vision_config.spatial_merge_size", vision.get("spatial_merge_size", 2))
    channels = _size("vision_config.in_channels", vision.get("in_channels", 3))
    positions = _size("vision_config.num_position_embeddings", vision.get("num_position_embeddings", 2304))
    out = _size("vision_config.out_hidden_size", vision.get("out_hidden_size", out))
    deepstack = len(vision.get("deepstack_visual_indexes") or ())
    linears = (("qkv", h, 3 * h), ("proj", h, h), ("linear_fc1", h, i), ("linear_fc2", i, h))
    block = 4 * h + sum(a * b + b for _, a, b in linears)  # two LayerNorms with biases
    merged = h * merge * merge
    projector_linears = (("linear_fc1", merged, merged), ("linear_fc2", merged, out))
    merger = sum(a * b + b for _, a, b in projector_linears)
    embed = channels * temporal * patch * patch * h + h  # the patch convolution and its bias
    return Tower(
        features="qwen3_vl",
        hidden=h,
        intermediate=i,
        depth=depth,
        heads=heads,
        patch=patch,
        # the deepstack mergers normalise after the shuffle (over the merged width)
        tower_params=embed + positions * h + depth * block + deepstack * (2 * merged + merger),
        projector_params=2 * h + merger,
        block_linears=linears,
        projector_linears=projector_linears,
        gated=False,
        merge=merge,
        temporal=temporal,
        min_pixels=_setting(processor, "shortest_edge", "min_pixels", QWEN_MIN_PIXELS),
        max_pixels=_setting(processor, "longest_edge", "max_pixels", QWEN_MAX_PIXELS),
        deepstack=deepstack,
    )


def _siglip(vision: dict[str, Any], *, head_default: bool) -> tuple[int, int, int, int, int, int, int, tuple]:
    """A SigLIP-shaped tower's sizes and weights: (hidden, intermediate, depth, heads, patch,
    image size, parameters, block linears)."""
    h = _size("vision_config.hidden_size", vision.get("hidden_size"))
    i = _size("vision_config.intermediate_size", vision.get("intermediate_size"))
    depth = _size("vision_config.num_hidden_layers", vision.get("num_hidden_layers"))
    heads = _size("vision_config.num_attention_heads", vision.get("num_attention_heads"))
    patch = _size("vision_config.patch_size", vision.get("patch_size"))
    size = _size("vision_config.image_size", vision.get("image_size"))
    channels = _size("vision_config.num_channels", vision.get("num_channels", 3))
    if size < patch:
        raise ConfigError(
            "vision_config.image_size",
            f"config.json: vision_config.image_size={size} is smaller than its patch_size={patch}",
            value=size,
        )
    linears = (
        ("q_proj", h, h),
        ("k_proj", h, h),
        ("v_proj", h, h),
        ("out_proj", h, h),
        ("fc1", h, i),
        ("fc2", i, h),
    )
    block = 2 * 2 * h + sum(a * b + b for _, a, b in linears)  # two LayerNorms
    positions = (size // patch) ** 2
    params = channels * patch * patch * h + h + positions * h + depth * block + 2 * h  # + post_layernorm
    if vision.get("vision_use_head", head_default):
        # the attention-pooling head: a probe, multi-head attention, a LayerNorm and an MLP
        params += h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
    return h, i, depth, heads, patch, size, params, linears


def _gemma3(config: dict[str, Any], vision: dict[str, Any], out: int) -> Tower:
    h, i, depth, heads, patch, size, params, linears = _siglip(vision, head_default=True)
    tokens = _size("mm_tokens_per_image", config.get("mm_tokens_per_image", 256))
    return Tower(
        features="gemma3",
        hidden=h,
        intermediate=i,
        depth=depth,
        heads=heads,
        patch=patch,
        tower_params=params,
        projector_params=h * out + h,  # the input projection and its soft-embedding RMSNorm
        block_linears=linears,
        projector_linears=(("mm_input_projection", h, out),),
        gated=False,
        image_size=size,
        tokens_per_image=tokens,
    )


def _idefics3(config: dict[str, Any], vision: dict[str, Any], out: int, processor: dict[str, Any]) -> Tower:
    h, i, depth, heads, patch, size, params, linears = _siglip(vision, head_default=False)
    scale = _size("scale_factor", config.get("scale_factor", 2))
    splitting = processor.get("do_image_splitting", True) is not False
    edge = _setting(processor, "longest_edge", "longest_edge", IDEFICS3_TILES_PER_EDGE * size)
    shuffled = h * scale * scale
    return Tower(
        features="idefics3",
        hidden=h,
        intermediate=i,
        depth=depth,
        heads=heads,
        patch=patch,
        tower_params=params,
        projector_params=shuffled * out,  # the modality projection, no bias
        block_linears=linears,
        projector_linears=(("modality_projection.proj", shuffled, out),),
        gated=False,
        merge=scale,
        image_size=size,
        resize_edge=edge if splitting else 0,
    )


def _setting(processor: dict[str, Any], size_key: str, key: str, default: int) -> int:
    """An image processor's size setting: ``size[size_key]``, else ``key``, else ``default``
    (a value that is not a positive integer is ignored)."""
    size = processor.get("size")
    value = size.get(size_key) if isinstance(size, dict) else None
    if value is None:
        value = processor.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 40:
        return value
    return default


def _qwen_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image processor's size for an image: each edge a multiple of ``factor``, the
    area within its pixel bounds, the aspect ratio kept."""
    height, width = max(height, 1), max(width, 1)
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _size(key: str, value: Any) -> int:
    """A vision size of config.json: a positive integer within ``VISION_LIMIT``, else ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= VISION_LIMIT:
        raise ConfigError(
            key, f"config.json: {key}={value!r} must be an integer from 1 to {VISION_LIMIT}", value=value
        )
    return value
