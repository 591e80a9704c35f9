"""The ``text_similarity`` grader's metrics, each a score in [0, 1] of a text against a reference.

- ``fuzzy_match``: the normalized Indel similarity of the two strings, character by character,
  ``2 * LCS / (len(a) + len(b))`` (1.0 for two empty strings).
- ``bleu``: sentence BLEU against one reference: the clipped n-gram precisions of orders 1 to 4,
  their geometric mean times the brevity penalty ``exp(1 - r/c)`` when the text (``c`` tokens) is
  shorter than the reference (``r``). Orders 2 to 4 are smoothed by adding one to their matches and
  their count (Lin and Och's smoothing), so that a short answer without a matching 4-gram does not
  score 0 and an answer equal to the reference scores 1; no unigram in common scores 0.
- ``gleu``: Google's sentence GLEU: the n-grams of orders 1 to 4 of both texts together, the
  smaller of their precision and their recall.
- ``meteor``: METEOR on exact matches only (no stems, no synonyms): the harmonic mean of unigram
  precision and recall weighted 9 to 1 towards recall, less the fragmentation penalty
  ``0.5 * (chunks / matches) ** 3``; the alignment takes the longest run of matching words first.
- ``rouge_1`` .. ``rouge_5``: the F1 of the clipped n-gram overlap of that order.
- ``rouge_l``: the F1 of the longest common subsequence of words.

BLEU and GLEU read words and punctuation marks as they are written; ROUGE and METEOR read words
(letters and digits) lowercased and leave punctuation out, as ROUGE's reference tokenizer does.
Longest common subsequences are computed bit-parallel (one integer operation per element of one
sequence over a bit mask of the other), so long answers stay fast.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

_WORDS_AND_MARKS = re.compile(r"\w+|[^\w\s]")
_WORDS = re.compile(r"[^\W_]+")
BLEU_ORDER = 4
METEOR_ALPHA, METEOR_BETA, METEOR_GAMMA = 0.9, 3.0, 0.5
_METEOR_CANDIDATES = 64  # reference positions tried per word when aligning


def words_and_marks(text: str) -> list[str]:
    """``"Hello, world!"`` -> ``["Hello", ",", "world", "!"]``: BLEU's and GLEU's tokens."""
    return _WORDS_AND_MARKS.findall(text)


def words(text: str) -> list[str]:
    """``"Hello, World_2!"`` -> ``["hello", "world", "2"]``: ROUGE's and METEOR's tokens."""
    return _WORDS.findall(text.lower())


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


def ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    """The n-grams of ``tokens`` with their counts."""
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _overlap(a: Counter[tuple[str, ...]], b: Counter[tuple[str, ...]]) -> int:
    """The clipped matches: each n-gram counted at most as often as the other side has it."""
    return sum(min(count, b[gram]) for gram, count in a.items() if gram in b)


def _f1(matches: float, predicted: int, expected: int) -> float:
    if matches == 0 or predicted == 0 or expected == 0:
        return 0.0
    precision, recall = matches / predicted, matches / expected
    return 2 * precision * recall / (precision + recall)


def fuzzy_match(text: str, reference: str) -> float:
    """``2 * LCS / (len(text) + len(reference))`` over characters; two empty strings: 1.0."""
    total = len(text) + len(reference)
    return 1.0 if total == 0 else 2 * lcs_length(text, reference) / total


def bleu(text: str, reference: str) -> float:
    """Sentence BLEU (orders 1-4, orders 2-4 add-one smoothed, with the brevity penalty)."""
    hyp, ref = words_and_marks(text), words_and_marks(reference)
    if not hyp or not ref:
        return 0.0
    log_sum = 0.0
    for n in range(1, BLEU_ORDER + 1):
        matches = _overlap(ngrams(hyp, n), ngrams(ref, n))
        total = max(len(hyp) - n + 1, 0)
        if n == 1:
            if matches == 0:
                return 0.0
            log_sum += math.log(matches / total)
        else:
            log_sum += math.log((matches + 1) / (total + 1))
    brevity = 1.0 if len(hyp) > len(ref) else math.exp(1 - len(ref) / len(hyp))
    return brevity * math.exp(log_sum / BLEU_ORDER)


def gleu(text: str, reference: str) -> float:
    """Sentence GLEU: min(precision, recall) of the n-grams of orders 1-4 taken together."""
    hyp, ref = words_and_marks(text), words_and_marks(reference)
    matches = predicted = expected = 0
    for n in range(1, BLEU_ORDER + 1):
        hyp_grams, ref_grams = ngrams(hyp, n), ngrams(ref, n)
        matches += _overlap(hyp_grams, ref_grams)
        predicted += sum(hyp_grams.values())
        expected += sum(ref_grams.values())
    if predicted == 0 or expected == 0:
        return 0.0
    return min(matches / predicted, matches / expected)


def rouge_n(text: str, reference: str, n: int) -> float:
    """ROUGE-N: the F1 of the clipped overlap of n-grams of words."""
    hyp, ref = ngrams(words(text), n), ngrams(words(reference), n)
    return _f1(_overlap(hyp, ref), sum(hyp.values()), sum(ref.values()))


def rouge_l(text: str, reference: str) -> float:
    """ROUGE-L: the F1 of the longest common subsequence of words."""
    hyp, ref = words(text), words(reference)
    return _f1(lcs_length(hyp, ref), len(hyp), len(ref))


def meteor(text: str, reference: str) -> float:
    """METEOR with exact matches only (alpha 0.9, beta 3, gamma 0.5)."""
    hyp, ref = words(text), words(reference)
    matches, chunks = _align(hyp, ref)
    if matches == 0:
        return 0.0
    precision, recall = matches / len(hyp), matches / len(ref)
    mean = precision * recall / (METEOR_ALPHA * precision + (1 - METEOR_ALPHA) * recall)
    penalty = METEOR_GAMMA * (chunks / matches) ** METEOR_BETA
    return mean * (1 - penalty)


def _align(hyp: list[str], ref: list[str]) -> tuple[int, int]:
    """Exact-match alignment of ``hyp`` to ``ref``: (matched words, chunks). From the left, each
    word not yet aligned takes, among the unused reference positions holding it, the one that
    starts the longest run of words matching in both, and the whole run is aligned at once; a
    run is a chunk."""
    where: dict[str, list[int]] = {}
    for j, word in enumerate(ref):
        where.setdefault(word, []).append(j)
    used = [False] * len(ref)
    matches = chunks = 0
    i = 0
    while i < len(hyp):
        best_start, best_length = -1, 0
        for j in [j for j in where.get(hyp[i], ()) if not used[j]][:_METEOR_CANDIDATES]:
            length = 0
            while (
                i + length < len(hyp)
                and j + length < len(ref)
                and not used[j + length]
                and hyp[i + length] == ref[j + length]
            ):
                length += 1
            if length > best_length:
                best_start, best_length = j, length
        if best_length == 0:
            i += 1
            continue
        for k in range(best_length):
            used[best_start + k] = True
        matches += best_length
        chunks += 1
        i += best_length
    return matches, chunks


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
    **{f"rouge_{n}": _rouge(n) for n in range(1, 6)},
    "rouge_l": rouge_l,
}
