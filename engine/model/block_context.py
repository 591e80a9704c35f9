"""How a family's decoder blocks get what they need besides their hidden states.

``BlockContext`` is the Llama way: one mask per attention type of the blocks (causal, or
causal within a sliding window), one rotary table shared by every type, and a block called with
the mask and table of its type, its position ids and no KV cache. A family that differs
subclasses it and overrides the step that differs (Gemma 3: ``RotaryPerAttentionType``); its
``FamilySpec.context`` names the instance. ``engine.model.adapter.AdaptedModel.build_context``
does the family-independent part (position ids, the host-to-device copy) and asks the family's
context for the rest.

No torch import at module import: the masks come from transformers' own mask functions,
imported when a context is first built, so the planner can read the family table without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SLIDING = "sliding_attention"


class BlockContext:
    """The Llama context: masks per attention type, one shared rotary table."""

    def masks(self, attention_types: Sequence[str], mask_arguments: dict[str, Any]) -> dict[str, Any]:
        """The attention mask of each attention type (None where the kernel needs none).

        Args:
            attention_types: the attention types of the model's blocks.
            mask_arguments: the keyword arguments of transformers' mask functions (config,
                inputs_embeds, attention_mask, cache, position_ids).
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        return {
            kind: (create_sliding_window_causal_mask if kind == SLIDING else create_causal_mask)(
                **mask_arguments
            )
            for kind in attention_types
        }

    def rotary_tables(
        self, rotary: Any, hidden: Any, position_ids: Any, attention_types: Sequence[str]
    ) -> dict[str, Any]:
        """The rotary ``(cos, sin)`` of each attention type: here one table, called once."""
        return dict.fromkeys(attention_types, rotary(hidden, position_ids))

    def block_arguments(self, context: Any, attention_type: str) -> dict[str, Any]:
        """The keyword arguments of a decoder block besides its hidden states.

        Args:
            context: the micro-batch's ``engine.model.adapter.Context`` (masks and rotary tables
                by attention type, position ids).
            attention_type: the block's attention kind, which picks its mask and rotary tables.

        Returns:
            The mask and rotary ``(cos, sin)`` of the block's attention type, the position ids,
            and no KV cache.
        """
        return {
            "attention_mask": context.masks[attention_type],
            "position_embeddings": context.position_embeddings[attention_type],
            "position_ids": context.position_ids,
            "cache": None,
            "use_cache": False,
        }


class RotaryPerAttentionType(BlockContext):
    """A rotary embedding that takes the attention type (Gemma 3: a local and a global
    ``rope_theta``), called once per type."""

    def rotary_tables(
        self, rotary: Any, hidden: Any, position_ids: Any, attention_types: Sequence[str]
    ) -> dict[str, Any]:
        return {kind: rotary(hidden, position_ids, kind) for kind in attention_types}


class BidirectionalImages(RotaryPerAttentionType):
    """Gemma 3 with images: the tokens of one image attend to each other both ways (on top of
    the causal mask, within the sliding window for sliding blocks), as the model's own forward
    builds its masks when it is given ``token_type_ids`` (1 on image tokens).

    ``mask_arguments`` may carry ``token_type_ids`` (``[b, s]``); without it the masks are the
    text ones."""

    def masks(self, attention_types: Sequence[str], mask_arguments: dict[str, Any]) -> dict[str, Any]:
        arguments = dict(mask_arguments)
        token_types = arguments.pop("token_type_ids", None)
        if token_types is None:
            return super().masks(attention_types, arguments)
        from transformers.models.gemma3.modeling_gemma3 import (
            create_masks_for_vision_model,
            get_block_sequence_ids_for_mask,
        )

        blocks = get_block_sequence_ids_for_mask(token_types, device=arguments["inputs_embeds"].device)
        masks = create_masks_for_vision_model(block_sequence_ids=blocks, **arguments)
        return {kind: masks[kind] for kind in attention_types}


LLAMA_CONTEXT = BlockContext()
