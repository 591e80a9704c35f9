"""The base models a job can start from: the demo, the models folder, the local HF cache."""

from __future__ import annotations

import json
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model import DEMO_NAME, FAMILIES, ModelKind, demo_source, model_kind
from engine.vision import vision_spec


@dataclass
class BaseModelInfo:
    name: str
    source: str  # "demo" | "models" | "hub" | "hf-cache"
    path: Path | None
    architecture: str | None
    parameters: int | None
    size_bytes: int
    ready: bool
    family: str | None = None  # readable: "Llama", "Qwen3-MoE"
    moe: bool = False
    experts: int | None = None  # routed experts per MoE block
    active_experts: int | None = None  # experts each token is routed to
    supported: bool = True  # the engine can train it; else unsupported_reason says why
    unsupported_reason: str | None = None
    hub: dict[str, Any] | None = None  # a pulled model: {"repo_id", "revision", "sha", "pulled_at"}
    quantization: str | None = None  # how its checkpoint is quantized: "bitsandbytes 4-bit (nf4)", "mxfp4"


# readable names of a few common model classes the engine does not train whose stem reads badly
# (the families it trains name themselves: ``FamilySpec.display_name``, a vision-language
# model's ``VisionSpec.display_name``); any other class name is
# shortened to its stem ("BertForMaskedLM": "Bert", "Qwen2MoeForCausalLM": "Qwen2-MoE")
OTHER_FAMILY_NAMES = {
    "Gemma2ForCausalLM": "Gemma 2",
    "GPT2LMHeadModel": "GPT-2",
}
_CLASS_SUFFIX = re.compile(r"(For[A-Z][A-Za-z0-9]*|LMHeadModel|Model)$")

MAX_CONFIG_BYTES = 4 << 20  # a real config.json is a few KiB
MAX_LAYERS = 100_000  # a larger block count in a config.json is not a model
MAX_EXPERTS = 1 << 20
MAX_REASON_CHARS = 1000  # the engine's reason lists every supported class


def family_name(architecture: str | None) -> str | None:
    """The readable family of a model class name: "Qwen3-MoE" for ``Qwen3MoeForCausalLM``."""
    if not architecture:
        return None
    spec = FAMILIES.get(architecture)
    if spec is not None and spec.display_name:
        return spec.display_name
    vision = vision_spec(architecture)
    if vision is not None:
        return vision.display_name
    if architecture in OTHER_FAMILY_NAMES:
        return OTHER_FAMILY_NAMES[architecture]
    stem = _CLASS_SUFFIX.sub("", architecture).replace("Moe", "-MoE")
    return stem or architecture


def _short(value: Any, chars: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[: chars - 1] + "…"


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _read_config(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The folder's ``config.json`` as a dict, or None and what is wrong with it."""
    try:
        with (folder / "config.json").open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        return None, f"config.json cannot be read: {exc.strerror or exc}"
    if len(raw) > MAX_CONFIG_BYTES:
        return None, f"config.json is larger than {MAX_CONFIG_BYTES >> 20} MiB"
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # a UnicodeDecodeError is a ValueError too
        return None, f"config.json is not valid JSON: {exc}"
    if not isinstance(config, dict):
        kind = "null" if config is None else _JSON_TYPES.get(type(config), type(config).__name__)
        return None, f"config.json is not a JSON object: it is {kind}"
    return config, None


def _kind(config: dict[str, Any]) -> ModelKind:
    """``model_kind`` of a parsed ``config.json`` of any content: a value of the wrong type makes
    the model unsupported, with the reason, instead of raising."""
    archs = config.get("architectures")
    named = isinstance(archs, list) and archs and isinstance(archs[0], str)
    if archs not in (None, []) and not (named and len(archs[0]) <= 200 and archs[0].isidentifier()):
        return ModelKind(
            None, False, f"config.json: architectures is not a list of class names: {_short(archs)}"
        )
    architecture = archs[0] if archs else None
    # the engine counts blocks one by one: a hostile count must not hang the listing
    for key in ("num_hidden_layers", "first_k_dense_replace"):
        value = config.get(key)
        if value is not None and not (type(value) is int and 0 <= value <= MAX_LAYERS):
            return ModelKind(
                architecture,
                False,
                f"config.json: {key} must be a whole number from 0 to {MAX_LAYERS}, not {_short(value)}",
            )
    try:
        kind = model_kind(config)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError) as exc:
        return ModelKind(architecture, False, f"config.json has a value of the wrong type: {exc}")
    if kind.moe:
        for label, count in (("expert count", kind.experts), ("active expert count", kind.active_experts)):
            if count is not None and not 1 <= count <= MAX_EXPERTS:
                reason = f"config.json: the {label} must be from 1 to {MAX_EXPERTS}, not {count}"
                return ModelKind(architecture, False, reason)
        active, experts = kind.active_experts, kind.experts
        if active is not None and experts is not None and active > experts:
            return ModelKind(
                architecture, False, f"config.json routes each token to {active} experts of only {experts}"
            )
    return kind


def _info(
    name: str,
    source: str,
    path: Path | None,
    kind: ModelKind,
    parameters: int | None,
    size: int,
    ready: bool,
) -> BaseModelInfo:
    reason = kind.reason
    if reason is not None and len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    return BaseModelInfo(
        name,
        source,
        path,
        kind.architecture,
        parameters,
        size,
        ready,
        family=family_name(kind.architecture),
        moe=kind.moe,
        experts=kind.experts,
        active_experts=kind.active_experts,
        supported=kind.supported,
        unsupported_reason=None if kind.supported else reason or "not supported",
    )


def _safetensors_parameters(folder: Path) -> int | None:
    """Parameter count from the safetensors headers (no tensor is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        # bitsandbytes 4-bit weights: those with a quantization state beside them
        bnb = {key.split(_BNB_STATE, 1)[0] for key in header if _BNB_STATE in key}
        total += sum(_tensor_parameters(key, meta, bnb) for key, meta in header.items())
    return total


_BNB_STATE = ".quant_state.bitsandbytes__"
_ITEM_BYTES = {"U8": 1, "I8": 1, "BF16": 2, "F16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_BNB_PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


def _tensor_parameters(name: str, meta: dict[str, Any], bnb: set[str]) -> int:
    """The parameters one safetensors entry holds. MXFP4 checkpoints (GPT-OSS) pack two 4-bit
    values in each byte of a uint8 ``*_blocks`` tensor, and their uint8 ``*_scales`` (one shared
    exponent per 32 values) are not parameters. A bitsandbytes 4-bit weight (a name in ``bnb``)
    packs two values a byte too; its scales, code books and quantization state are not
    parameters."""
    count = 1
    for d in meta["shape"]:
        count *= d
    if name in bnb:  # two values a byte, whatever dtype holds the bytes (bnb_4bit_quant_storage)
        return 2 * count * _ITEM_BYTES.get(str(meta.get("dtype")), 1)
    if _BNB_STATE in name or (name.endswith(_BNB_PARTS) and name.rsplit(".", 1)[0] in bnb):
        return 0
    if meta.get("dtype") == "U8" and name.endswith("_blocks"):
        return 2 * count
    if meta.get("dtype") == "U8" and name.endswith("_scales"):
        return 0
    return count


def _size(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:  # a file went away, or a folder cannot be read: the size is unknown
        return 0


# what reading a truncated or hostile safetensors header raises (a header length of 2**62 bytes
# fails to allocate at once: MemoryError)
_BROKEN_HEADER = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    IndexError,
    struct.error,
    RecursionError,
    OverflowError,
    MemoryError,
)


def _quantization(config: dict[str, Any]) -> tuple[str | None, str | None]:
    """How a ``config.json`` says its checkpoint is quantized, and why the engine cannot read it
    (None: it can; ``engine.model.loading``)."""
    q = config.get("quantization_config")
    if not q:
        return None, None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if not isinstance(method, str) or not method:
        return "unknown", "config.json: quantization_config names no quant_method"
    method = method[:40]
    if method == "mxfp4":
        return "mxfp4", None
    if method == "bitsandbytes":
        if not (q.get("load_in_4bit") or q.get("_load_in_4bit")):
            return "bitsandbytes 8-bit", "a bitsandbytes 8-bit checkpoint: the engine reads 4-bit ones"
        kind = q.get("bnb_4bit_quant_type")
        return f"bitsandbytes 4-bit ({kind})" if isinstance(
            kind, str
        ) and kind.isalnum() else "bitsandbytes 4-bit", None
    return method, (
        f"quantized with {method!r}: the engine reads bitsandbytes 4-bit and MXFP4 checkpoints "
        "(or give the unquantized model)"
    )


def _describe(name: str, source: str, folder: Path) -> BaseModelInfo:
    """A model folder, whatever is in it: what its ``config.json`` says, or why it is unsupported."""
    config, problem = _read_config(folder)
    kind = ModelKind(None, False, problem) if config is None else _kind(config)
    quantization, unreadable = _quantization(config) if config is not None else (None, None)
    if unreadable is not None and kind.supported:
        kind = ModelKind(kind.architecture, False, unreadable)
    parameters: int | None = None
    try:
        parameters = _safetensors_parameters(folder)
    except _BROKEN_HEADER as exc:
        if kind.supported:
            detail = str(exc)[:200] or type(exc).__name__
            kind = ModelKind(kind.architecture, False, f"a .safetensors file has a broken header: {detail}")
    if not isinstance(parameters, int) or parameters < 0:
        parameters = None
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # not expressible in JSON as it is: shown, never startable
        name = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        kind = ModelKind(kind.architecture, False, "the folder name is not valid UTF-8: rename the folder")
    info = _info(name, source, folder, kind, parameters, _size(folder), True)
    info.quantization = quantization
    return info


def discover(models_dir: Path, hf_cache: Path | None) -> list[BaseModelInfo]:
    """Every base model, the demo first; a folder the engine cannot train too, marked unsupported
    with the reason (whatever its ``config.json`` holds, listing it never raises)."""
    found: list[BaseModelInfo] = []
    demo_folder = models_dir / DEMO_NAME
    if (demo_folder / "config.json").is_file():
        info = _describe("demo", "demo", demo_folder)
        found.append(info)
    else:
        try:
            gguf = next(demo_source().glob("*.gguf"))
            demo = ModelKind("LlamaForCausalLM", True)  # SmolLM2, prepared from its GGUF on first use
            found.append(_info("demo", "demo", None, demo, 134_515_008, gguf.stat().st_size, False))
        except (ValueError, StopIteration):
            pass
    try:
        children = sorted(models_dir.iterdir()) if models_dir.is_dir() else []
    except OSError:  # an unreadable models folder lists nothing from it
        children = []
    for child in children:
        if child.name == DEMO_NAME or child.name.startswith("."):  # .pulls: pulls under way
            continue
        if (child / "config.json").is_file():
            found.append(_local(child.name, child))
        elif child.is_dir():  # an organisation's folder: models/<org>/<name>, named "org/name"
            try:
                inner = sorted(child.iterdir())
            except OSError:
                continue
            for folder in inner:
                if not folder.name.startswith(".") and (folder / "config.json").is_file():
                    found.append(_local(f"{child.name}/{folder.name}", folder))
    if hf_cache is not None and hf_cache.is_dir():
        for repo in sorted(hf_cache.glob("models--*")):
            try:
                snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
            except OSError:  # a snapshot went away while it was looked at
                continue
            if snapshots and (snapshots[-1] / "config.json").is_file():
                name = repo.name.removeprefix("models--").replace("--", "/")
                found.append(_describe(name, "hf-cache", snapshots[-1]))
    return found


HUB_SOURCE = ".hub-source.json"  # written into a model folder pulled from the Hub


def _local(name: str, folder: Path) -> BaseModelInfo:
    """A folder of the models folder: "hub" when a pull put it there (with where from), else "models"."""
    try:
        origin = json.loads((folder / HUB_SOURCE).read_text())
    except (OSError, ValueError):
        origin = None
    if not isinstance(origin, dict):
        return _describe(name, "models", folder)
    info = _describe(name, "hub", folder)
    info.hub = {k: origin.get(k) for k in ("repo_id", "revision", "sha", "pulled_at")}
    return info


def forget() -> None:
    """Drop the remembered lookups (a model was added or deleted)."""
    _found.clear()


_found: dict[tuple[str, str, str], tuple[float, BaseModelInfo | None]] = {}
FIND_TTL_S = 10.0


def find(name: str, models_dir: Path, hf_cache: Path | None) -> BaseModelInfo | None:
    """One base model by name; a lookup is remembered for a few seconds (creating jobs in a burst
    should not rescan every model folder each time)."""
    key = (name, str(models_dir), str(hf_cache))
    hit = _found.get(key)
    if hit is not None and time.monotonic() - hit[0] < FIND_TTL_S:
        return hit[1]
    found = next((m for m in discover(models_dir, hf_cache) if m.name == name), None)
    _found[key] = (time.monotonic(), found)
    return found


def usable_folder(name: str, models_dir: Path, hf_cache: Path | None) -> Path | None:
    """The folder of a base model that is ready to load (the demo once prepared), or None."""
    found = find(name, models_dir, hf_cache)
    return found.path if found is not None and found.ready else None
