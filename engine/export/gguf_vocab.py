"""A model folder's tokenizer as GGUF metadata, with the ``gguf`` library's vocab helpers.

Byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen) are written as llama.cpp's
``gpt2`` model: every token by id, its type (control for special added tokens), the merges and
the pre-tokenizer, recognised from the structure of ``tokenizer.json``'s pre-tokenizer (llama.cpp
names each regex set it implements). SentencePiece-style BPE tokenizers (byte fallback: Llama 2,
Mistral, Gemma) are written as llama.cpp's ``llama`` model with their scores. Special token ids,
whether BOS is added, and the chat template come from ``gguf.SpecialVocab``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# the pre-tokenizer regexes of the tokenizers llama.cpp implements, as tokenizer.json spells them
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501


def _steps(pre: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        return [s for step in pre.get("pretokenizers", []) for s in _steps(step)]
    return [pre]


def _describe(step: dict[str, Any]) -> str:
    if step.get("type") == "Split":
        return f"Split({step.get('pattern', {}).get('Regex') or step.get('pattern', {}).get('String')!r})"
    return str(step.get("type"))


def pre_tokenizer(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name for a byte-level BPE tokenizer's pre-tokenizer.

    Raises:
        ValueError: a pre-tokenizer llama.cpp has no implementation of (named by its steps).
    """
    steps = _steps(tokenizer_json.get("pre_tokenizer"))
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex == LLAMA3_SPLIT:
            return "llama-bpe"
        if regex == QWEN2_SPLIT:
            return "qwen2"
    raise ValueError(
        "GGUF export: the tokenizer's pre-tokenizer "
        f"[{', '.join(_describe(s) for s in steps)}] is not one llama.cpp implements "
        "(known: GPT-2, SmolLM, Llama 3, Qwen2)"
    )


def _is_byte_level(tokenizer_json: dict[str, Any]) -> bool:
    model = tokenizer_json.get("model", {})
    decoder = tokenizer_json.get("decoder") or {}
    return (
        model.get("type") == "BPE" and not model.get("byte_fallback") and decoder.get("type") == "ByteLevel"
    )


def add_vocab(writer: Any, folder: Path, *, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer of ``folder`` into ``writer``, padded to the model's ``vocab_size``
    rows. Returns what the Ollama Modelfile needs: ``eos`` text, the chat template.

    Raises:
        ValueError: no tokenizer.json, a tokenizer kind llama.cpp cannot run, or more tokens
            than the model has embedding rows.
    """
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"GGUF export: {folder} has no tokenizer.json")
    tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    if _is_byte_level(tokenizer_json):
        tokens, types = _byte_level_tokens(tokenizer_json, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer(tokenizer_json))
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
    return {"eos": by_id.get(eos) if eos is not None else None, "chat_template": template}


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
