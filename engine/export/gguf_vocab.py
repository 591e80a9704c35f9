"""A model folder's tokenizer as GGUF metadata, with the ``gguf`` library's vocab helpers.

Byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen) are written as llama.cpp's
``gpt2`` model: every token by id, its type (control for special added tokens), the merges and
the pre-tokenizer. The pre-tokenizer is named as llama.cpp's converter names it: by the
tokenizer's check hash (``check_hash``) in llama.cpp's table
(``engine.export.gguf_pre_tokenizers``). A hash in no table is refused, as the converter refuses
it, unless the model folder's ``tokenizer_config.json`` names the pre-tokenizer itself
(``"gguf_pre_tokenizer": "<name>"``, a name llama.cpp implements); the export's result says which
named it. SentencePiece-style BPE tokenizers (byte fallback: Llama 2, Mistral, Gemma) are written
as llama.cpp's ``llama`` model with their scores and the ``default`` pre-tokenizer, with no
hash, as the converter writes them. Special token ids, whether BOS is added, and the chat
template come from ``gguf.SpecialVocab``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.export.gguf_pre_tokenizers import CHECK_HASHES, CHECK_TEXT, LLAMA_CPP_COMMIT, LOADER_NAMES

# the tokenizer_config.json key that names the pre-tokenizer of a tokenizer in no llama.cpp table
DECLARED = "gguf_pre_tokenizer"
TABLE = f"llama.cpp {LLAMA_CPP_COMMIT[:10]}"


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's pre-tokenizer of a byte-level BPE tokenizer, and who named it."""

    name: str
    check_hash: str
    named_by: str  # TABLE, or f"tokenizer_config.json {DECLARED}"


def check_hash(folder: Path) -> str:
    """llama.cpp's ``chkhsh`` of the folder's tokenizer: the sha256 of the ``str()`` of the ids
    its ``AutoTokenizer`` gives for ``CHECK_TEXT`` (special tokens included)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(CHECK_TEXT)
    return hashlib.sha256(str(list(ids)).encode()).hexdigest()


def _declared(folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get(DECLARED)
    if value is None:
        return None
    if not isinstance(value, str) or value not in LOADER_NAMES:
        raise ValueError(
            f"GGUF export: tokenizer_config.json {DECLARED}: {value!r} is not a pre-tokenizer "
            "llama.cpp implements (e.g. llama-bpe, qwen2, smollm, gpt-2, tekken)"
        )
    return value


def pre_tokenizer(folder: Path) -> PreTokenizer:
    """llama.cpp's name for the pre-tokenizer of the byte-level BPE tokenizer in ``folder``.

    Raises:
        ValueError: the tokenizer's check hash is in no llama.cpp table and the folder does not
            name its pre-tokenizer (the message gives the hash and what to do), or the folder
            names one llama.cpp does not implement or one the table contradicts.
    """
    digest = check_hash(folder)
    declared = _declared(folder)
    known = CHECK_HASHES.get(digest)
    if known is not None:
        if declared is not None and declared != known:
            raise ValueError(
                f"GGUF export: tokenizer_config.json {DECLARED} says {declared!r}, but llama.cpp's "
                f"table ({TABLE}) names this tokenizer (chkhsh {digest}) {known!r}: remove or correct it"
            )
        return PreTokenizer(known, digest, TABLE)
    if declared is not None:
        return PreTokenizer(declared, digest, f"tokenizer_config.json {DECLARED}")
    raise ValueError(
        f"GGUF export: the tokenizer's check hash (chkhsh) {digest} is in no llama.cpp pre-tokenizer "
        f"table ({TABLE}); llama.cpp's convert_hf_to_gguf.py refuses it too. If you know which "
        "pre-tokenizer llama.cpp implements for it (that of the model it comes from: llama-bpe for "
        f'Llama 3, qwen2 for Qwen2 and Qwen3, ...), add "{DECLARED}": "<name>" to the model '
        "folder's tokenizer_config.json (a LoRA checkpoint's own: its merge copies it); else the "
        "tokenizer needs a newer llama.cpp table"
    )


def _is_byte_level(tokenizer_json: dict[str, Any]) -> bool:
    model = tokenizer_json.get("model", {})
    decoder = tokenizer_json.get("decoder") or {}
    return (
        model.get("type") == "BPE" and not model.get("byte_fallback") and decoder.get("type") == "ByteLevel"
    )


def add_vocab(writer: Any, folder: Path, *, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer of ``folder`` into ``writer``, padded to the model's ``vocab_size``
    rows.

    Returns:
        What the Ollama Modelfile needs (``eos`` text, ``chat_template``) and the pre-tokenizer
        written: ``pre_tokenizer``, ``pre_tokenizer_hash`` (the check hash; None for a
        SentencePiece vocabulary) and ``pre_tokenizer_named_by`` (llama.cpp's table, the folder's
        tokenizer_config.json, or a SentencePiece vocabulary).

    Raises:
        ValueError: no tokenizer.json, a tokenizer kind llama.cpp cannot run, a byte-level
            tokenizer whose pre-tokenizer llama.cpp does not name (``pre_tokenizer``), or more
            tokens than the model has embedding rows.
    """
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"GGUF export: {folder} has no tokenizer.json")
    tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    pre: PreTokenizer | None = None
    if _is_byte_level(tokenizer_json):
        tokens, types = _byte_level_tokens(tokenizer_json, vocab_size)
        pre = pre_tokenizer(folder)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre.name)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
    else:
        try:
            vocab = gguf.LlamaHfVocab(folder)
        except (FileNotFoundError, TypeError) as exc:
            model = tokenizer_json.get("model", {}).get("type")
            raise ValueError(
                f"GGUF export: a {model} tokenizer of this kind is not written yet ({exc})"
            ) from exc
        pieces: list[bytes] = []
        scores: list[float] = []
        kinds: list[int] = []
        for text, score, kind in vocab.all_tokens():
            pieces.append(text)
            scores.append(score)
            kinds.append(kind)
        if len(pieces) > vocab_size:
            raise ValueError(
                f"GGUF export: the tokenizer has {len(pieces)} tokens, the model {vocab_size} rows"
            )
        for i in range(len(pieces), vocab_size):
            pieces.append(f"[PAD{i}]".encode())
            scores.append(-1000.0)
            kinds.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(pieces)
        writer.add_token_scores(scores)
        writer.add_token_types(kinds)
    special = gguf.SpecialVocab(folder, load_merges=_is_byte_level(tokenizer_json), n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    by_id = {t["id"]: t["content"] for t in tokenizer_json.get("added_tokens", [])}
    eos = special.special_token_ids.get("eos")
    template = special.chat_template if isinstance(special.chat_template, str) else None
    return {
        "eos": by_id.get(eos) if eos is not None else None,
        "chat_template": template,
        "pre_tokenizer": pre.name if pre else "default",
        "pre_tokenizer_hash": pre.check_hash if pre else None,
        "pre_tokenizer_named_by": pre.named_by if pre else "a SentencePiece vocabulary (no check hash)",
    }


def _byte_level_tokens(tokenizer_json: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    import gguf

    texts: dict[int, str] = {i: t for t, i in tokenizer_json["model"]["vocab"].items()}
    kinds: dict[int, int] = {}
    for added in tokenizer_json.get("added_tokens", []):
        texts[added["id"]] = added["content"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if texts and max(texts) >= vocab_size:
        raise ValueError(f"GGUF export: the tokenizer has token id {max(texts)}, the model {vocab_size} rows")
    tokens, types = [], []
    for i in range(vocab_size):
        if i in texts:
            tokens.append(texts[i])
            types.append(kinds.get(i, gguf.TokenType.NORMAL))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types
