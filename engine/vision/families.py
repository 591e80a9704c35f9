"""The vision-language model (VLM) families the engine trains, one ``VisionSpec`` each, and the
VLMs it refuses with the reason.

A VLM is a vision tower and a projector in front of a causal language model: the projector's
outputs replace the image placeholder tokens' embeddings, then the language model runs as any
text model. Its spec says where the tower and the projector are, how image features are computed
and merged (``features``), how the language blocks' context differs from a text model's
(``positions``: Qwen2.5-VL's 3-D rotary positions over each image's grid; ``image_blocks``: Gemma 3's
bidirectional attention inside each image), and its language model as a ``FamilySpec`` with the
paths from the top model (``text``), which the engine's adapter reads like a text family's.

The engine's input layer runs the tower, the projector and the token embeddings
(``engine.vision.layer``): one pipeline layer, held on the host and dispatched round-robin like any
other, with the tower's weights frozen or trained as ``method.vision_tower`` and
``method.projector`` say. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.model.block_context import LLAMA_CONTEXT, BidirectionalImages, BlockContext
from engine.model.family_spec import FamilySpec, config_value

Features = Literal["qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3"]
Positions = Literal["text", "mrope"]

# llama.cpp keeps a VLM's vision tower and projector in a second file (its ``mmproj``), which the
# GGUF export does not write
NO_VLM_GGUF = (
    "a vision-language model's GGUF needs llama.cpp's separate mmproj file for its vision tower and "
    "projector, which the GGUF export does not write; download the merged folder instead"
)
_GEMMA3_REFUSED = (
    (
        "use_bidirectional_attention",
        "bidirectional attention lets every position see the token the next-token loss asks it "
        "to predict; the engine trains causal LMs",
    ),
)


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know about one VLM family.

    Attributes:
        architecture: the ``*ForConditionalGeneration`` class name.
        display_name: the readable family name listings show.
        short_name: the lower-case name the tests and benchmarks use.
        text: the language model's ``FamilySpec``: its blocks, norms, rotary and LM head, with
            paths from the top model; its ``architecture`` is the VLM's.
        tower: the dotted path of the vision tower (its projector may sit inside it).
        projector: the dotted path of the projector (Qwen2.5-VL's patch merger, Gemma 3's
            multi-modal projector, Idefics3's connector).
        features: how the tower's outputs become one embedding per image token.
        positions: ``"mrope"``: the language blocks' rotary positions are 3-D over each image's
            grid (computed on the host per micro-batch); ``"text"``: positions 0..n-1.
        image_token: the config attribute with the id of the image placeholder token.
        no_gguf: why the family has no GGUF export.
        deepstack: the tower's features from some of its intermediate layers are added to the
            image tokens' hidden states after the first language blocks (Qwen3-VL's "deepstack",
            one feature per block, ``vision_config.deepstack_visual_indexes``): the input layer
            hands them on beside the hidden states, and each of those blocks takes its own
            (``engine.vision.layer.DeepstackBlock``).
    """

    architecture: str
    display_name: str
    short_name: str
    text: FamilySpec
    tower: str
    projector: str
    features: Features
    positions: Positions = "text"
    image_token: str = "image_token_id"
    no_gguf: str = NO_VLM_GGUF
    deepstack: bool = False

    def refusal(self, config: Any) -> str | None:
        """Why the engine cannot train a model with ``config`` (None when it can)."""
        return self.text.refusal(config_value(config, "text_config", None) or {})


def _text(architecture: str, root: str, *, context: BlockContext = LLAMA_CONTEXT, **facts: Any) -> FamilySpec:
    """A VLM's language model as a ``FamilySpec`` whose paths start at the top model."""
    return FamilySpec(
        architecture,
        embeddings=f"{root}.embed_tokens",
        blocks=f"{root}.layers",
        norm=f"{root}.norm",
        rotary=f"{root}.rotary_emb",
        context=context,
        **facts,
    )


VISION_FAMILIES: dict[str, VisionSpec] = {
    spec.architecture: spec
    for spec in (
        VisionSpec(
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen2.5-VL",
            "qwen2_5_vl",
            _text(
                "Qwen2_5_VLForConditionalGeneration",
                "model.language_model",
                display_name="Qwen2.5-VL",
                short_name="qwen2_5_vl",
                model_type="qwen2_5_vl_text",
                qkv_bias=True,
                no_gguf=NO_VLM_GGUF,
                unmeasured="a vision-language model's activations are estimated",
            ),
            tower="model.visual",
            projector="model.visual.merger",
            features="qwen2_5_vl",
            positions="mrope",
        ),
        VisionSpec(
            "Qwen3VLForConditionalGeneration",
            "Qwen3-VL",
            "qwen3_vl",
            _text(
                "Qwen3VLForConditionalGeneration",
                "model.language_model",
                display_name="Qwen3-VL",
                short_name="qwen3_vl",
                model_type="qwen3_vl_text",
                block_extra=lambda s: 2 * s.head_dim,  # q and k norms per head
                no_gguf=NO_VLM_GGUF,
                unmeasured="a vision-language model's activations are estimated",
            ),
            tower="model.visual",
            projector="model.visual.merger",
            features="qwen3_vl",
            positions="mrope",
            deepstack=True,
        ),
        VisionSpec(
            "Gemma3ForConditionalGeneration",
            "Gemma 3 (vision)",
            "gemma3_vl",
            _text(
                "Gemma3ForConditionalGeneration",
                "model.language_model",
                context=BidirectionalImages(),
                display_name="Gemma 3 (vision)",
                short_name="gemma3_vl",
                model_type="gemma3_text",
                logit_softcap="final_logit_softcapping",
                refused=_GEMMA3_REFUSED,
                block_extra=lambda s: 2 * s.hidden + 2 * s.head_dim,
                no_gguf=NO_VLM_GGUF,
                unmeasured="a vision-language model's activations are estimated",
            ),
            tower="model.vision_tower",
            projector="model.multi_modal_projector",
            features="gemma3",
        ),
        *(
            VisionSpec(
                architecture,
                name,
                short,
                _text(
                    architecture,
                    "model.text_model",
                    display_name=name,
                    short_name=short,
                    model_type="llama",
                    no_gguf=NO_VLM_GGUF,
                    unmeasured="a vision-language model's activations are estimated",
                ),
                tower="model.vision_model",
                projector="model.connector",
                features="idefics3",
            )
            for architecture, name, short in (
                ("Idefics3ForConditionalGeneration", "Idefics3", "idefics3"),
                ("SmolVLMForConditionalGeneration", "SmolVLM", "smolvlm"),
            )
        ),
    )
}
SUPPORTED_VLMS = tuple(VISION_FAMILIES)

# VLMs the engine refuses, with the reason
REFUSED_VLMS: dict[str, str] = {
    "Qwen3VLMoeForConditionalGeneration": (
        "the engine's vision-language path does not take mixture-of-experts language blocks yet "
        "(the dense Qwen3-VL is supported)"
    ),
    "Gemma3nForConditionalGeneration": (
        "Gemma 3n's per-layer embeddings and audio tower are not layers the engine can split"
    ),
}


def vision_spec(architecture: str | None) -> VisionSpec | None:
    """The spec of a VLM class name (None: not a supported VLM)."""
    return VISION_FAMILIES.get(architecture or "")


def is_vision_config(config: Any) -> bool:
    """Whether a config (object or ``config.json`` dict) describes a vision-language model."""
    archs = config_value(config, "architectures", None) or []
    if archs and (archs[0] in VISION_FAMILIES or archs[0] in REFUSED_VLMS):
        return True
    return config_value(config, "vision_config", None) is not None


def vision_refusal(config: Any) -> str | None:
    """Why the engine refuses a VLM config (None: a supported VLM, or not a VLM)."""
    if not is_vision_config(config):
        return None
    archs = config_value(config, "architectures", None) or []
    architecture = archs[0] if archs else None
    spec = vision_spec(architecture)
    if spec is not None:
        return spec.refusal(config)
    supported = ", ".join(s.display_name for s in VISION_FAMILIES.values())
    why = REFUSED_VLMS.get(architecture or "")
    if why is None:
        why = f"the engine trains the vision-language models {supported}"
    return f"unsupported vision-language model {architecture}: {why}"
