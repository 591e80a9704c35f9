"""Turn a Hugging Face causal LM into the engine's list of layers.

One generic adapter serves every supported family: a family's ``FamilySpec``
(``engine.model.families``) says where its embeddings, decoder blocks, final norm, rotary
embedding and LM head are, which attention mask each block gets and what a block is called
with. A ``peft`` wrapper (LoRA) is unwrapped to the ``*ForCausalLM``; the LoRA modules stay
inside the decoder blocks and are ordinary parameters of those layers.

Layer 0 is the input layer (token embeddings), layers 1..B are the decoder blocks and layer
B+1 is the output layer (final norm + LM head; the loss is computed next to it). The per
micro-batch context every block needs — rotary tables, causal/padding masks, position ids — is
rebuilt by each stage from the micro-batch's attention mask, so only hidden states travel
between stages. Masks and rotary tables are kept per attention type (full or sliding window):
a block gets those of its type, as the model's own forward hands them out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from engine.errors import ConfigError
from engine.kinds import LayerKind
from engine.model.block_context import LLAMA_CONTEXT
from engine.model.families import FAMILIES, FamilySpec, family_for
from engine.model.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    check_chunk_tokens,
    chunked_causal_lm_loss_and_correct,
    chunked_causal_lm_loss_sum,
    chunked_sequence_logps,
    chunked_token_logps,
    finish_logits,
)
from engine.vision.families import VISION_FAMILIES, vision_spec
from engine.vision.layer import DeepstackBlock, VisionInputLayer, vision_layer_parts


class InputLayer(nn.Module):
    """Token embeddings: ``input_ids [b, s] -> hidden [b, s, d]``.

    With a ``multiplier`` (Granite) the embeddings are multiplied by it, as the model does.
    """

    def __init__(self, embed_tokens: nn.Module, *, multiplier: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        return hidden if self.multiplier is None else hidden * self.multiplier


class OutputLayer(nn.Module):
    """Final norm, LM head and the loss: ``hidden [b, s, d], labels [b, s] -> loss sum``.

    With labels the layer returns the fp32 sum of the next-token cross entropy, computed
    ``chunk_tokens`` positions at a time (``engine.model.loss``), so no ``[tokens, vocab]``
    logits are ever held; without labels it returns the logits ``[b, s, vocab]``. With a
    ``logits_divisor`` (Granite's ``logits_scaling``) the logits are divided by it and with a
    ``logit_softcap`` (Gemma 3's ``final_logit_softcapping``) they are soft-capped, as the model
    does; in the loss this happens chunk by chunk, inside the head.
    """

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        logits_divisor: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_tokens = check_chunk_tokens(chunk_tokens)
        self.logits_divisor = logits_divisor
        self.logit_softcap = logit_softcap

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        per_sequence: bool = False,
        per_token: bool = False,
        grad_scale: float = 1.0,
        count_correct: bool = False,
    ) -> torch.Tensor:
        """The logits; given ``labels``, the loss sum, or with ``per_sequence`` the ``[b]`` sums of
        each row's label-token log-probabilities, with ``per_token`` the ``[b, s - 1]``
        log-probabilities themselves (``engine.model.loss``). ``grad_scale``: the
        gradient the caller will back-propagate into the loss sum (``chunked_causal_lm_loss_sum``).
        ``count_correct``: ``[2]`` fp32, the loss sum and the number of label tokens whose logits'
        argmax is the label (exact up to 2**24 label tokens per call)."""
        normed = self.norm(hidden)
        divisor, cap = self.logits_divisor, self.logit_softcap
        if labels is None:
            return finish_logits(self.lm_head(normed), divisor=divisor, softcap=cap)
        # The head runs again in backward (per chunk), after a caller's functional_call has put
        # the module's own tensors back: bind the ones this forward sees.
        tensors: dict[str, torch.Tensor] = dict(self.lm_head.named_parameters(remove_duplicate=False))
        tensors.update(self.lm_head.named_buffers(remove_duplicate=False))
        lm_head = self.lm_head

        def head(h: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = functional_call(lm_head, tensors, (h,), tie_weights=False, strict=False)
            return finish_logits(logits, divisor=divisor, softcap=cap)

        if per_sequence or per_token:
            scored = chunked_sequence_logps if per_sequence else chunked_token_logps
            return scored(
                normed,
                labels,
                head,
                chunk_tokens=self.chunk_tokens,
                preserve_rng_state=uses_dropout(lm_head, None),
            )
        # the head's gradients are taken in this pass: autograd reaches its tensors through the loss
        trained = list({id(t): t for t in tensors.values() if t.requires_grad}.values())
        chunk = self.chunk_tokens
        if count_correct:
            loss, correct = chunked_causal_lm_loss_and_correct(
                normed, labels, head, chunk_tokens=chunk, weights=trained, grad_scale=grad_scale
            )
            return torch.stack([loss, correct.to(loss.dtype)])
        return chunked_causal_lm_loss_sum(
            normed, labels, head, chunk_tokens=chunk, weights=trained, grad_scale=grad_scale
        )


@dataclass
class Layer:
    """One layer of the adapted model.

    ``tensors`` maps the layer-local name of every parameter and buffer to the tensor of the
    original model (the same object when a parameter is tied between two layers).
    ``arguments(context, attention_type)`` gives a decoder block's keyword arguments (its
    family's ``BlockContext.block_arguments``).
    """

    index: int
    kind: LayerKind
    module: nn.Module
    attention_type: str = "full_attention"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    arguments: Callable[[Context, str], dict[str, Any]] = LLAMA_CONTEXT.block_arguments

    @property
    def parametrized(self) -> bool:
        """The layer's forward enters ``torch.nn.utils.parametrize.cached()`` (peft's LoRA on
        parameters, e.g. a mixture's expert stacks): a cache that is global to the process, so
        two threads must not run such a forward at once (``PARAMETRIZE_LOCK``)."""
        return any(type(m).__name__ == "ParamWrapper" for m in self.module.modules())


# held around the forward of a parametrized layer (``Layer.parametrized``): with the cache global,
# one worker's forward would otherwise reuse another's cached weights, or its own from a graph
# that backward has already freed
PARAMETRIZE_LOCK = threading.Lock()


@dataclass
class Context:
    """What every decoder block of one micro-batch needs besides its hidden input.

    ``masks`` and ``position_embeddings`` (the rotary ``(cos, sin)``) are keyed by attention
    type; a family with one rotary table has the same tables under every type.
    """

    masks: dict[str, Any]
    position_ids: torch.Tensor
    position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _unwrap(hf_model: nn.Module) -> tuple[Any, FamilySpec]:
    """Return the ``*ForCausalLM`` (or VLM ``*ForConditionalGeneration``) inside a peft wrapper
    (or the model itself) and its family (a VLM's: its language model's)."""
    model: Any = hf_model
    for _ in range(3):
        name = type(model).__name__
        if name in FAMILIES or name in VISION_FAMILIES:
            break
        inner = getattr(model, "base_model", None)
        if name.startswith("Peft") and inner is not None:
            model = inner
            continue
        inner = getattr(model, "model", None)
        if name.endswith("Model") and "Lora" in name and inner is not None:
            model = inner
            continue
        break
    return model, family_for(type(model).__name__)


class AdaptedModel:
    """A causal LM seen as a list of layers plus the context builder blocks need.

    Args:
        hf_model: a supported ``*ForCausalLM``, possibly wrapped by ``peft.get_peft_model``.

    Raises:
        ConfigError: the architecture is not supported, or its config sets a flag the engine
            cannot train with (Gemma 3's ``use_bidirectional_attention``); field ``model.path``.
    """

    def __init__(self, hf_model: nn.Module, *, loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> None:
        causal_lm, family = _unwrap(hf_model)
        self.hf_model = hf_model
        self.family = family
        self.architecture = family.architecture
        # a VLM's family facts (None: a text model); its blocks read its language model's config
        self.vision = vision_spec(self.architecture)
        self.config: Any = causal_lm.config if self.vision is None else causal_lm.config.get_text_config()
        refusal = family.refusal(self.config)
        if refusal is not None:
            raise ConfigError("model.path", refusal, value=self.architecture)
        self.rotary: nn.Module = attrgetter(family.rotary)(causal_lm)
        blocks = list(attrgetter(family.blocks)(causal_lm)[: self.config.num_hidden_layers])
        embeddings, norm = attrgetter(family.embeddings, family.norm)(causal_lm)
        multiplier = self._config_float(family.embedding_multiplier)
        first: nn.Module = InputLayer(embeddings, multiplier=multiplier)
        self.image_token_id: int | None = None
        self.hf_config: Any = causal_lm.config  # a VLM's whole config (its vision_config too)
        if self.vision is not None:
            top = causal_lm.config
            self.image_token_id = int(getattr(top, self.vision.image_token))
            tower, projector = vision_layer_parts(causal_lm, self.vision)
            first = VisionInputLayer(
                embeddings,
                tower,
                projector,
                spec=self.vision,
                image_token_id=self.image_token_id,
                patch_size=int(top.vision_config.patch_size),
            )
            if self.vision.positions == "mrope":
                # the model's own 3-D position ids (no weights: read off the config and the grids)
                self.rope_index = causal_lm.model.get_rope_index
        self.layers: list[Layer] = [Layer(0, LayerKind.INPUT, first)]
        # Qwen3-VL: its first blocks each add a deepstack feature handed on by the input layer
        deepstack = 0
        if self.vision is not None and self.vision.deepstack:
            deepstack = len(causal_lm.config.vision_config.deepstack_visual_indexes)
        for i, block in enumerate(blocks):
            attention = family.attention_type(self.config, i)
            module = DeepstackBlock(block, int(self.config.hidden_size)) if i < deepstack else block
            self.layers.append(
                Layer(i + 1, LayerKind.BLOCK, module, attention, arguments=family.context.block_arguments)
            )
        lm_head = attrgetter(family.lm_head)(causal_lm)
        divisor = self._config_float(family.logits_divisor)
        cap = self._config_float(family.logit_softcap, optional=True)
        output = OutputLayer(
            norm, lm_head, chunk_tokens=loss_chunk_tokens, logits_divisor=divisor, logit_softcap=cap
        )
        self.layers.append(Layer(len(blocks) + 1, LayerKind.OUTPUT, output))
        for layer in self.layers:
            for name, p in layer.module.named_parameters(remove_duplicate=False):
                layer.tensors[name] = p
            for name, b in layer.module.named_buffers(remove_duplicate=False):
                layer.tensors[name] = b
        self.attention_types = sorted({layer.attention_type for layer in self.layers[1:-1]})

    def _config_float(self, attribute: str | None, *, optional: bool = False) -> float | None:
        """The value of a config attribute a family's spec names (None when it names none, or
        when the attribute is ``optional`` and the config sets it to None)."""
        if attribute is None:
            return None
        value = getattr(self.config, attribute, None)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RuntimeError(f"{self.architecture}: config.{attribute}={value!r} is not a number")
        return value

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def full_names(self) -> dict[int, list[str]]:
        """Map ``id(tensor)`` to every name it has in ``hf_model.state_dict()`` order."""
        names: dict[int, list[str]] = {}
        for name, p in self.hf_model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for name, b in self.hf_model.named_buffers(remove_duplicate=False):
            names.setdefault(id(b), []).append(name)
        return names

    def build_context(
        self,
        rotary: nn.Module,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        upload: Callable[[torch.Tensor], torch.Tensor] | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> Context:
        """Masks, position ids and rotary tables for one micro-batch, on ``hidden``'s device.

        The family's ``BlockContext`` builds the masks and the rotary tables, with the mask
        functions and rotary calls of the model's own forward, so the engine attends exactly like
        the unsplit model: one mask per attention type of the blocks, and the rotary tables as
        the family's blocks take them.

        With ``upload`` (a GPU worker's host-to-device copy) ``attention_mask`` is the host copy:
        the masks and position ids are built on the host and copied up, because the mask
        functions inspect the mask's values (is there padding?), which on the device would make
        the host wait for the GPU at every micro-batch of every stage.

        ``images``: what a VLM's micro-batch adds (``engine.vision.batch.context_inputs``, host
        tensors): Qwen2.5-VL's 3-D rotary ``position_ids``, Gemma 3's ``token_type_ids``.
        """
        batch, seq = hidden.shape[0], hidden.shape[1]
        on_host = upload is not None and hidden.device.type != "cpu"
        where = torch.device("cpu") if on_host else hidden.device
        position_ids = torch.arange(seq, device=where).unsqueeze(0)
        kwargs = {
            "config": self.config,
            # the mask functions read only the shape, dtype and device of the embeddings
            "inputs_embeds": torch.empty((batch, seq, 1), dtype=hidden.dtype, device=where)
            if on_host
            else hidden,
            "attention_mask": attention_mask,
            "cache": None,
            "position_ids": position_ids,
        }
        extra = images or {}
        if "token_type_ids" in extra:
            kwargs["token_type_ids"] = extra["token_type_ids"].to(where)
        context = self.family.context
        masks = context.masks(self.attention_types, kwargs)
        rotary_positions = extra.get("position_ids")
        if on_host:
            assert upload is not None
            if not all(m is None or isinstance(m, torch.Tensor) for m in masks.values()):
                # a mask object that cannot be copied (flex attention's): build it on the device
                return self.build_context(
                    rotary,
                    hidden,
                    None if attention_mask is None else upload(attention_mask),
                    images=None if images is None else {k: upload(v) for k, v in images.items()},
                )
            masks = {k: None if m is None else upload(m) for k, m in masks.items()}
            position_ids = upload(position_ids)
            rotary_positions = None if rotary_positions is None else upload(rotary_positions)
        elif rotary_positions is not None:
            rotary_positions = rotary_positions.to(where)
        tables = context.rotary_tables(
            rotary,
            hidden,
            position_ids if rotary_positions is None else rotary_positions,
            self.attention_types,
        )
        return Context(masks, position_ids, tables)


def run_layer(
    layer: Layer,
    call: Callable[..., Any],
    x: torch.Tensor,
    ctx: Context | None,
    labels: torch.Tensor | None = None,
    *,
    per_sequence: bool = False,
    per_token: bool = False,
    grad_scale: float = 1.0,
    count_correct: bool = False,
    images: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run one layer on ``x``; ``call(*args, **kwargs)`` invokes (a copy of) ``layer.module``.

    A VLM's input layer takes the micro-batch's ``images`` (its tensors on the layer's device).

    The output layer given ``labels`` returns the loss sum, not the logits (``grad_scale``: the
    gradient its caller will back-propagate into it); with ``count_correct`` ``[2]``: the loss
    sum and the label tokens predicted right (``OutputLayer``); with ``per_sequence`` the ``[b]``
    per-row sums of the label tokens' log-probabilities; with ``per_token`` the ``[b, s - 1]``
    log-probabilities of the label tokens.
    """
    if layer.kind == LayerKind.OUTPUT:
        if labels is None:
            return call(x)  # type: ignore[no-any-return]
        if per_sequence or per_token:
            return call(x, labels, per_sequence=per_sequence, per_token=per_token)  # type: ignore[no-any-return]
        if count_correct:
            return call(x, labels, grad_scale=grad_scale, count_correct=True)  # type: ignore[no-any-return]
        return call(x, labels, grad_scale=grad_scale)  # type: ignore[no-any-return]
    if layer.kind == LayerKind.INPUT and images:
        return call(x, **images)  # type: ignore[no-any-return]
    if layer.kind != LayerKind.BLOCK:
        return call(x)  # type: ignore[no-any-return]
    if ctx is None:
        raise RuntimeError(f"layer {layer.index}: a decoder block needs its context")
    out = call(x, **layer.arguments(ctx, layer.attention_type))
    return out[0] if isinstance(out, tuple) else out


def count_label_tokens(labels: torch.Tensor) -> int:
    """Number of tokens the loss is taken over (shifted labels != -100)."""
    return int((labels[:, 1:] != -100).sum().item())


def uses_dropout(model: nn.Module, config: Any) -> bool:
    """Whether a forward of ``model`` in its current mode consumes random numbers."""
    if not model.training:
        return False
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return bool(getattr(config, "attention_dropout", 0.0))
