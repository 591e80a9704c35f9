"""The ``text_similarity`` grader's metrics, each a score in [0, 1] of a text against a reference.

Each is the maintained package that papers (and OpenAI's graders) report, called with these
settings, so a grader ported from elsewhere gives the same rewards (pinned in requirements.txt;
tests/engine/graders/test_metric_parity.py compares every metric with the package's own call):

- ``fuzzy_match``: rapidfuzz's ``fuzz.ratio(text, reference) / 100``, the normalized Indel
  similarity of the characters, ``2 * LCS / (len(text) + len(reference))``; two empty texts: 1.0.
- ``bleu``: sacrebleu's ``sentence_bleu(text, [reference]).score / 100``: tokenizer ``13a``,
  smoothing ``exp``, effective order, case kept.
- ``gleu``: nltk's ``sentence_gleu([reference], text)`` (orders 1 to 4) over sacrebleu's ``13a``
  tokens of each.
- ``meteor``: METEOR without WordNet synonyms (exact and Porter-stem matches only): nltk's
  ``single_meteor_score(reference, text, wordnet=...)`` over ``13a`` tokens, lowercased, with nltk's
  Porter stemmer, alpha 0.9, beta 3, gamma 0.5, and a WordNet that knows no synonyms. nltk's full
  METEOR reads WordNet from nltk_data, which no maintained package on PyPI ships and which is
  never downloaded here: its third stage (synonyms) matches nothing, its first two are nltk's.
- ``rouge_1`` .. ``rouge_5``: rouge-score's ``RougeScorer(["rougeN"], use_stemmer=False)``, the
  F-measure of ``score(reference, text)``.
- ``rouge_l``: the same for ``rougeL``: rouge-score's tokens and F-measure, with the longest common
  subsequence computed here (rouge-score's table is quadratic in memory and time; this is
  bit-parallel), equal to rouge-score's.

rouge-score's tokenizer keeps only ``a-z`` and ``0-9`` after lowercasing: a text with no ASCII
letter or digit (Chinese, punctuation only) has no words, and scores 0.0 under ROUGE. An empty
text or reference scores 0.0 under every metric, but ``fuzzy_match`` of two empty texts: 1.0.
The packages are imported on first use, not when this module is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

ROUGE_ORDERS = range(1, 6)
METEOR_ALPHA, METEOR_BETA, METEOR_GAMMA = 0.9, 3.0, 0.5
# sacrebleu's tokenizers remember the last 65,536 lines they saw (an lru_cache per class): long
# answers scored for days would hold gigabytes; past this many, their caches are emptied
TOKENIZER_CACHE_LINES = 4096
STEM_CACHE_WORDS = 1 << 16


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """The length of the longest common subsequence of ``a`` and ``b``.

    Bit-parallel: bit ``i`` of ``masks[x]`` is set where ``a[i] == x``; a row of the dynamic
    programme over ``a`` is one integer ``row`` whose zero bits mark where the LCS grew, and each
    element of ``b`` updates it with one addition, one subtraction and three bitwise operations.
    """
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[Hashable, int] = {}
    for i, x in enumerate(a):
        masks[x] = masks.get(x, 0) | (1 << i)
    full = (1 << len(a)) - 1
    row = full
    for x in b:
        matches = row & masks.get(x, 0)
        row = ((row + matches) | (row - matches)) & full
    return len(a) - row.bit_count()


def tokens_13a(text: str) -> list[str]:
    """sacrebleu's ``13a`` tokens of ``text`` (mteval-v13a's, WMT's): GLEU's and METEOR's."""
    tokens = str(_tokenizer_13a()(text)).split()
    _bound_tokenizer_caches()
    return tokens


def rouge_tokens(text: str) -> list[str]:
    """rouge-score's tokens of ``text``: lowercased runs of ``a-z`` and ``0-9``, unstemmed."""
    return list(_rouge_tokenizer().tokenize(text))


def fuzzy_match(text: str, reference: str) -> float:
    """rapidfuzz's ``fuzz.ratio / 100``: ``2 * LCS / (len(text) + len(reference))``."""
    from rapidfuzz import fuzz

    return fuzz.ratio(text, reference) / 100


def bleu(text: str, reference: str) -> float:
    """sacrebleu's sentence BLEU / 100 (``13a``, ``exp`` smoothing, effective order)."""
    score = _bleu().sentence_score(text, [reference]).score / 100
    _bound_tokenizer_caches()
    return min(float(score), 1.0)  # identical texts score 100.00000000000004


def gleu(text: str, reference: str) -> float:
    """nltk's sentence GLEU (orders 1 to 4) over ``13a`` tokens."""
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([tokens_13a(reference)], tokens_13a(text)))


def meteor(text: str, reference: str) -> float:
    """nltk's METEOR over ``13a`` tokens with exact and Porter-stem matches, no WordNet synonyms."""
    from nltk.translate.meteor_score import single_meteor_score

    score = single_meteor_score(
        tokens_13a(reference),
        tokens_13a(text),
        stemmer=_stemmer(),
        wordnet=NO_SYNONYMS,
        alpha=METEOR_ALPHA,
        beta=METEOR_BETA,
        gamma=METEOR_GAMMA,
    )
    return float(score)


def rouge_n(text: str, reference: str, n: int) -> float:
    """rouge-score's ROUGE-N F-measure (no stemming)."""
    return float(_rouge_scorer(n).score(reference, text)[f"rouge{n}"].fmeasure)


def rouge_l(text: str, reference: str) -> float:
    """rouge-score's ROUGE-L F-measure (no stemming), its LCS computed bit-parallel."""
    from rouge_score.scoring import fmeasure

    hyp, ref = rouge_tokens(text), rouge_tokens(reference)
    if not hyp or not ref:
        return 0.0
    lcs = lcs_length(ref, hyp)
    return float(fmeasure(lcs / len(hyp), lcs / len(ref)))


class NoSynonyms:
    """Stands for nltk's WordNet in its METEOR: no word has a synonym."""

    def synsets(self, word: str) -> list[Any]:
        return []


NO_SYNONYMS = NoSynonyms()


@functools.cache
def _bleu() -> Any:
    from sacrebleu.metrics import BLEU

    # sacrebleu.sentence_bleu's defaults
    return BLEU(tokenize="13a", smooth_method="exp", effective_order=True)


@functools.cache
def _tokenizer_13a() -> Any:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()


def _bound_tokenizer_caches() -> None:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    from sacrebleu.tokenizers.tokenizer_re import TokenizerRegexp

    for call in (Tokenizer13a.__call__, TokenizerRegexp.__call__):
        if call.cache_info().currsize > TOKENIZER_CACHE_LINES:
            call.cache_clear()


@functools.cache
def _rouge_tokenizer() -> Any:
    from rouge_score.tokenizers import DefaultTokenizer

    return DefaultTokenizer(use_stemmer=False)


@functools.cache
def _rouge_scorer(n: int) -> Any:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer([f"rouge{n}"], use_stemmer=False)


class CachedStemmer:
    """A stemmer that remembers its stems (``STEM_CACHE_WORDS`` words at most)."""

    def __init__(self, stem: Callable[[str], str]) -> None:
        self._stem = functools.lru_cache(maxsize=STEM_CACHE_WORDS)(stem)

    def stem(self, word: str) -> str:
        return self._stem(word)


@functools.cache
def _stemmer() -> CachedStemmer:
    """nltk's Porter stemmer (METEOR's default), each word stemmed once."""
    from nltk.stem.porter import PorterStemmer

    return CachedStemmer(PorterStemmer().stem)


def _rouge(n: int) -> Callable[[str, str], float]:
    def metric(text: str, reference: str) -> float:
        return rouge_n(text, reference, n)

    metric.__name__ = f"rouge_{n}"
    return metric


# OpenAI's ``evaluation_metric`` names; ``cosine`` needs an embedding model, which is not run here
METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    **{f"rouge_{n}": _rouge(n) for n in ROUGE_ORDERS},
    "rouge_l": rouge_l,
}
