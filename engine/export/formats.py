"""The formats a checkpoint is exported in: the one list, read by ``roundhouse export``'s flags,
the API's accepted values (``/docs`` shows them) and the web UI (served by the API).

- ``checkpoint``: the checkpoint's own export, its adapter or model folder without the resume state.
- ``merged``: a LoRA adapter merged into its base model, a full model folder (LoRA checkpoints only).
- ``gguf``: a folder for llama.cpp and Ollama (``engine.export.bundle``) in one of its variants,
  the GGUF quantizations ``engine.export.gguf_model`` writes; refused for a family it cannot write,
  and for a vision-language model (its tower and projector would need llama.cpp's separate
  ``mmproj`` file, which is not written).

Each ``ExportFormat`` says when it is refused (before anything is built) and builds itself into a
folder. A new format is one more entry of ``FORMATS``. Nothing heavy is imported here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from engine.export.gguf_families import GGUF_FAMILIES, vlm_gguf_refusal
from engine.export.gguf_quants import QUANTS
from engine.training.checkpoint_layout import CheckpointKind, export_files


@dataclass(frozen=True)
class BuildOptions:
    """What a build may need beside its source: the variant, the base model folder (a LoRA
    checkpoint merged first), the Modelfile's system prompt and comment."""

    variant: str | None = None
    base: Path | None = None
    system: str | None = None
    comment: str | None = None


@dataclass(frozen=True)
class Built:
    """A build's outcome: the folder holding the export (the source itself for the checkpoint's
    own files) and a line saying what it wrote (empty when there is nothing to add)."""

    folder: Path
    note: str = ""


# (source folder, a scratch folder to fill, options) -> what it built
Builder = Callable[[Path, Path, BuildOptions], Built]


class FormatInfo(BaseModel):
    """An export format as the API serves it (the web UI's list of downloads)."""

    name: str = Field(description="the value of the download's format")
    label: str = Field(description="a short name to show")
    summary: str
    variants: list[str] = Field(description="the values of the download's variant (GGUF: the quantization)")
    default_variant: str | None
    adapter_only: bool = Field(description="only a LoRA checkpoint can be exported so")
    refused: str | None = Field(None, description="why this job's checkpoints cannot be exported so")


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its name, variants, when it is refused and how it is built.

    Attributes:
        merges: a LoRA checkpoint is merged into its base model first (the build needs the base).
        model_copies: the full-size model copies its build writes (for the free-space check).
    """

    name: str
    label: str
    summary: str
    build: Builder
    variants: tuple[str, ...] = ()
    default_variant: str | None = None
    adapter_only: bool = False
    merges: bool = False
    model_copies: int = 0

    def variant_of(self, variant: str | None) -> str | None:
        """The variant a build uses: ``variant``, or the default when none is given.

        Raises:
            ValueError: a variant the format does not have (or any, for a format with none).
        """
        if variant is None:
            return self.default_variant
        if variant not in self.variants:
            have = f"one of {', '.join(self.variants)}" if self.variants else "none"
            raise ValueError(f"variant: {self.name} has {have} (got {variant!r})")
        return variant

    def refusal(self, *, kind: CheckpointKind | str | None, architecture: str | None = None) -> str | None:
        """Why a checkpoint of ``kind`` (whose model is ``architecture``; either None when not
        known) cannot be exported in this format; None when it can be tried."""
        if self.adapter_only and kind is not None and kind != CheckpointKind.ADAPTER:
            return "only a LoRA adapter can be merged"
        if self.name == GGUF.name and architecture is not None and architecture not in GGUF_FAMILIES:
            vlm = vlm_gguf_refusal({"architectures": [architecture]})
            if vlm is not None:
                return vlm
            return (
                f"{architecture} cannot be exported yet; the families exported are {', '.join(GGUF_FAMILIES)}"
            )
        return None

    def needs_base(self, kind: CheckpointKind | str) -> bool:
        """Whether the build of a checkpoint of ``kind`` needs its base model folder."""
        return self.merges and kind == CheckpointKind.ADAPTER

    def what(self, kind: CheckpointKind | str) -> str:
        """What the export of a checkpoint of ``kind`` is: ``adapter``/``full`` for the checkpoint's
        own files, else the format's name (a download's README and file name say it)."""
        return str(kind) if self is CHECKPOINT else self.name

    def tag(self, kind: CheckpointKind | str, variant: str | None) -> str:
        """The part of a download's name that tells the export (``adapter``, ``merged``, ``gguf-q8_0``)."""
        return "-".join(part for part in (self.what(kind), variant) if part)

    def info(self, *, refused: str | None = None) -> FormatInfo:
        return FormatInfo(
            name=self.name,
            label=self.label,
            summary=self.summary,
            variants=list(self.variants),
            default_variant=self.default_variant,
            adapter_only=self.adapter_only,
            refused=refused,
        )


def _own_files(source: Path, out: Path, options: BuildOptions) -> Built:
    """The checkpoint's own files: the source folder itself (those of it ``export_files`` lists)."""
    return Built(source)


def _merged(source: Path, out: Path, options: BuildOptions) -> Built:
    from engine.model.export import merge_adapter

    if options.base is None:
        raise ValueError(f"{source} is a LoRA adapter: give its base model folder")
    return Built(merge_adapter(source, options.base, out))


def _gguf(source: Path, out: Path, options: BuildOptions) -> Built:
    from engine.export.bundle import export_gguf_folder

    quant = GGUF.variant_of(options.variant) or QUANTS[0]
    info = export_gguf_folder(
        source, out, quant=quant, base=options.base, system=options.system, comment=options.comment
    )
    return Built(out, f"{', '.join(info['files'])} ({info['arch']}, {info['quant']})")


CHECKPOINT = ExportFormat(
    "checkpoint", "Checkpoint", "the adapter or model folder as trained (no resume state)", _own_files
)
MERGED = ExportFormat(
    "merged",
    "Merged",
    "the LoRA adapter merged into its base model: a full model folder",
    _merged,
    adapter_only=True,
    merges=True,
    model_copies=1,
)
GGUF = ExportFormat(
    "gguf",
    "GGUF",
    "a GGUF folder for llama.cpp and Ollama (model, LoRA adapter, Modelfile)",
    _gguf,
    variants=QUANTS,
    default_variant="q8_0",
    merges=True,
    model_copies=2,  # a merge's fp32 weights, then the GGUF
)
FORMATS: dict[str, ExportFormat] = {f.name: f for f in (CHECKPOINT, MERGED, GGUF)}
VARIANTS: tuple[str, ...] = tuple(dict.fromkeys(v for f in FORMATS.values() for v in f.variants))


def formats_help() -> str:
    """One line naming every format and what it is (the CLI's and the API's help)."""
    return "; ".join(f"{f.name}: {f.summary}" for f in FORMATS.values()) + f" (default {CHECKPOINT.name})"


def variants_help() -> str:
    """One line naming every format's variants and their default (the CLI's and the API's help)."""
    with_variants = [f for f in FORMATS.values() if f.variants]
    return "the format's variant: " + "; ".join(
        f"{f.name}: {', '.join(f.variants)} (default {f.default_variant})" for f in with_variants
    )


def format_named(name: str) -> ExportFormat:
    """The format called ``name``.

    Raises:
        ValueError: no such format (naming the ones there are).
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format: one of {', '.join(FORMATS)} (got {name!r})") from None


def copy_export(source: Path, out: Path) -> None:
    """Copy the files of a checkpoint's export (``export_files``: no resume state) to ``out``."""
    for path in export_files(source):
        target = out / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
