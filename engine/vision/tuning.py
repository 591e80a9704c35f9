"""What trains in a vision-language model: the language model as the run's ``tuning`` says, and
the vision tower and the projector each ``"frozen"``, ``"lora"`` or ``"full"``
(``method.vision_tower``, ``method.projector``).

A full fine-tune leaves ``requires_grad`` on only what trains. A LoRA run adapts the language
model's ``target_modules`` (never the same-named layers of the tower), every linear layer of a
part set to ``"lora"``, and trains a part set to ``"full"`` whole as one of peft's
``modules_to_save`` (the adapter folder then carries its weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from engine.errors import ConfigError
from engine.vision.families import VisionSpec

PARTS = ("vision_tower", "projector")


def check_options(spec: VisionSpec | None, architecture: str, options: Any) -> None:
    """Refuse tower and projector settings the model or the tuning cannot take.

    Raises:
        ConfigError: (field ``method.vision_tower``/``method.projector``) a setting other than
            ``"frozen"`` for a text model; ``"lora"`` with ``tuning: "full"``; ``"lora"`` on a
            projector with no linear layer (Gemma 3's is a plain weight matrix).
    """
    for part in PARTS:
        value = getattr(options, part)
        field = f"method.{part}"
        if value == "frozen":
            continue
        if spec is None:
            raise ConfigError(
                field, f"{field}={value!r}: {architecture} is not a vision-language model", value=value
            )
        if (
            value == "lora"
            and part == "projector"
            and _inside(spec.projector, spec.tower)
            and options.vision_tower == "full"
        ):
            raise ConfigError(
                field,
                f"{field}='lora': {spec.display_name}'s projector is inside its vision tower, which "
                "method.vision_tower='full' trains whole (pick 'full' or 'frozen' for the projector)",
                value=value,
            )
        if value == "lora" and not options.lora:
            raise ConfigError(
                field,
                f"{field}='lora' needs tuning 'lora' (with tuning 'full' pick 'frozen' or 'full')",
                value=value,
            )


def _parts(model: nn.Module, spec: VisionSpec) -> tuple[str, str]:
    """The full module names of the tower and the projector in ``model`` (a peft wrapper or not)."""
    names = [n for n, _ in model.named_modules()]

    def find(path: str) -> str:
        found = [n for n in names if n == path or n.endswith("." + path)]
        if not found:
            raise RuntimeError(f"{spec.architecture}: no module {path}")
        return min(found, key=len)

    return find(spec.tower), find(spec.projector)


def _inside(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def freeze(model: nn.Module, spec: VisionSpec, options: Any) -> None:
    """A full fine-tune: stop the gradients of the frozen tower and projector."""
    tower, projector = _parts(model, spec)
    for name, p in model.named_parameters():
        in_projector = _inside(name, projector)
        part = "projector" if in_projector else "vision_tower" if _inside(name, tower) else None
        if part is not None and getattr(options, part) == "frozen":
            p.requires_grad_(False)


def lora_modules(
    model: nn.Module, spec: VisionSpec, suffixes: Sequence[str], options: Any
) -> tuple[list[str], list[str]]:
    """A LoRA run's ``target_modules`` (full names) and ``modules_to_save``.

    Raises:
        ConfigError: a part set to ``"lora"`` has no linear layer (field ``method.<part>``);
            the language model has no module named by ``suffixes`` (``method.target_modules``).
    """
    tower, projector = _parts(model, spec)
    targets: list[str] = []
    chosen = {part: [] for part in PARTS}  # type: dict[str, list[str]]
    for name, module in model.named_modules():
        in_projector = _inside(name, projector)
        part = "projector" if in_projector else "vision_tower" if _inside(name, tower) else None
        if part is None:
            if any(name == s or name.endswith("." + s) for s in suffixes):
                targets.append(name)
        elif getattr(options, part) == "lora" and isinstance(module, nn.Linear):
            chosen[part].append(name)
    if not targets:
        raise ConfigError(
            "method.target_modules",
            f"method.target_modules={list(suffixes)}: no layer of {spec.architecture}'s "
            "language model has these names",
            value=list(suffixes),
        )
    for part in PARTS:
        if getattr(options, part) == "lora" and not chosen[part]:
            raise ConfigError(
                f"method.{part}",
                f"method.{part}='lora': {spec.display_name}'s {part.replace('_', ' ')} has no linear layer "
                "to adapt (train it 'full' or keep it 'frozen')",
                value="lora",
            )
        targets += chosen[part]
    save = [
        root for part, root in zip(PARTS, (tower, projector), strict=True) if getattr(options, part) == "full"
    ]
    if tower in save and projector in save and _inside(projector, tower):
        save.remove(projector)  # saved with the tower that holds it (peft does not nest the wrappers)
    return targets, save


def settle_saved(model: nn.Module, spec: VisionSpec, options: Any) -> None:
    """After peft wrapped ``modules_to_save``: a projector inside a fully trained tower
    (Qwen2.5-VL's merger) stays frozen when its own setting is ``"frozen"``."""
    if (
        not _inside(spec.projector, spec.tower)
        or options.vision_tower != "full"
        or options.projector == "full"
    ):
        return
    for name, p in model.named_parameters():
        if ".modules_to_save." not in name:
            continue
        plain = name.replace(".modules_to_save.default", "").removeprefix("base_model.model.")
        if _inside(plain.rsplit(".", 1)[0], spec.projector):
            p.requires_grad_(False)


def with_saved_modules(model: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """A LoRA checkpoint's ``weights`` (its trained tensors) with the frozen weights inside a
    part peft saves whole (``modules_to_save``: Qwen2.5-VL's frozen merger inside its fully
    trained tower), which peft's adapter writer asks for with the rest of that part."""
    missing = {
        name: p.detach()
        for name, p in model.named_parameters()
        if ".modules_to_save." in name and name not in weights
    }
    return {**weights, **missing} if missing else weights
