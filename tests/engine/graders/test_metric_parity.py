"""Every ``text_similarity`` metric equals the package that reports it, called directly with the
settings engine/graders/metrics.py states, within 1e-6, on 600 generated pairs of texts: prose
with inflected words, near copies, unicode, empty and blank texts, punctuation only, sacrebleu's
special strings, and very long texts. Our side is the grader's reward (``grade_batch``)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.graders import validate_grader

PAIRS = 600
LONG_WORDS = 1000  # rouge-score's ROUGE-L table is quadratic: the package's side is the slow one
VERY_LONG_WORDS = 10_000  # the package's ROUGE-L would take minutes: every other metric
TOLERANCE = 1e-6
ROUGE_TYPES = ["rouge1", "rouge2", "rouge3", "rouge4", "rouge5", "rougeL"]

WORDS = [
    *("the", "a", "cat", "cats", "dog", "dogs", "sat", "sit", "sitting", "on", "mat", "mats", "run"),
    *("runs", "running", "ran", "quick", "quickly", "brown", "fox", "jumps", "jumped", "over"),
    *("lazy", "is", "was", "are", "be", "being", "been", "of", "to", "and", "in", "it", "that"),
]
UNICODE = [
    *("café", "naïve", "résumé", "Straße", "ÆØÅ", "İstanbul", "ΑΒΓ", "αβγ", "Ωμέγα", "Привет"),
    *("мир", "中文", "字", "日本語", "한국어", "שלום", "مرحبا", "हिन्दी", "🙂", "👍🏽", "e\u0301"),
    *("\u200b", "ﬁ", "x²"),
]
MARKS = list(".,;:!?-—–'\"()[]{}<>/\\|@#$%^&*_+=~`…«»¿¡")
# fixed edge cases first; generated pairs make up the rest
EDGES = [
    *(("", ""), ("", "the cat"), ("the cat", ""), (" ", " "), ("\n", "the cat"), ("...", "...")),
    *(("!?", "the cat!"), ("中文", "中文"), ("🙂", "🙂"), ("café", "cafe"), ("Straße", "strasse")),
]
SPECIAL = ["&amp;", "&quot;", "&lt;", "&gt;", "<skipped>", "-\n", "\n", "\t", "3.14", "1,000", "9-5"]


def _words(draw: random.Random, n: int, pool: list[str]) -> str:
    out = []
    for _ in range(n):
        word = draw.choice(pool)
        if draw.random() < 0.3:
            word = word.capitalize()
        if draw.random() < 0.2:
            word += draw.choice(MARKS)
        out.append(word)
    return draw.choice([" ", "  ", " \n"]).join(out)


def _edit(draw: random.Random, text: str) -> str:
    """A near copy: some words dropped, swapped or replaced."""
    tokens = text.split()
    for _ in range(draw.randint(0, 4)):
        if not tokens:
            break
        i = draw.randrange(len(tokens))
        kind = draw.choice(("drop", "swap", "replace"))
        if kind == "drop":
            del tokens[i]
        elif kind == "swap":
            j = draw.randrange(len(tokens))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            tokens[i] = draw.choice(WORDS)
    return " ".join(tokens)


def _pair(draw: random.Random, k: int) -> tuple[str, str]:
    kind = k % 10
    if kind == 0:  # empty or blank on one side or both
        blank = ["", " ", "\n", "\t \n"]
        if draw.random() < 0.2:
            return draw.choice(blank), draw.choice(blank)
        sides = [draw.choice(blank), _words(draw, draw.randint(1, 8), WORDS)]
        draw.shuffle(sides)
        return sides[0], sides[1]
    if kind == 1:  # punctuation only, against punctuation or words
        marks = "".join(draw.choice([*MARKS, " "]) for _ in range(draw.randint(1, 20)))
        if k % 20 == 11:
            return marks, _words(draw, 5, WORDS)
        other = "".join(draw.choice([*MARKS, " "]) for _ in range(draw.randint(0, 20)))
        return marks, other if draw.random() < 0.5 else marks
    if kind == 2:  # unicode only
        return _words(draw, draw.randint(1, 12), UNICODE), _words(draw, draw.randint(1, 12), UNICODE)
    if kind == 3:  # unicode mixed with English, near copies
        reference = _words(draw, draw.randint(3, 30), WORDS + UNICODE)
        return _edit(draw, reference), reference
    if kind == 4:  # sacrebleu's special strings and numbers
        pool = WORDS + SPECIAL
        reference = "".join(draw.choice(pool) + draw.choice(["", " "]) for _ in range(draw.randint(1, 25)))
        return _edit(draw, reference) if draw.random() < 0.5 else reference[::-1], reference
    if kind == 5:  # identical
        text = _words(draw, draw.randint(1, 40), WORDS)
        return text, text
    if kind == 6:  # long and very long: a near copy of a long text, or two long texts
        length = LONG_WORDS if k % 200 == 6 else draw.randint(100, 300)
        reference = _words(draw, length, WORDS)
        return (_edit(draw, reference) if draw.random() < 0.5 else _words(draw, length, WORDS)), reference
    # prose: near copies and unrelated sentences
    reference = _words(draw, draw.randint(1, 40), WORDS)
    if draw.random() < 0.6:
        return _edit(draw, reference), reference
    return _words(draw, draw.randint(1, 40), WORDS), reference


def _pairs() -> list[tuple[str, str]]:
    draw = random.Random(20240607)
    return EDGES + [_pair(draw, k) for k in range(PAIRS - len(EDGES))]


class _NoSynonyms:
    def synsets(self, word: str) -> list[Any]:
        return []


def _expected(text: str, reference: str, *, rouge_l: bool = True) -> dict[str, float]:
    """Each metric as its package computes it, called directly with the stated settings."""
    import sacrebleu
    from nltk.translate.gleu_score import sentence_gleu
    from nltk.translate.meteor_score import single_meteor_score
    from rapidfuzz import fuzz
    from rouge_score.rouge_scorer import RougeScorer
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    def tokens(s: str) -> list[str]:
        return str(Tokenizer13a()(s)).split()

    rouge_types = ROUGE_TYPES if rouge_l else ROUGE_TYPES[:-1]
    rouge = RougeScorer(rouge_types, use_stemmer=False).score(reference, text)
    return {
        "fuzzy_match": fuzz.ratio(text, reference) / 100,
        "bleu": sacrebleu.sentence_bleu(text, [reference]).score / 100,
        "gleu": sentence_gleu([tokens(reference)], tokens(text)),
        "meteor": single_meteor_score(tokens(reference), tokens(text), wordnet=_NoSynonyms()),
        **{f"rouge_{t[5:].lower()}": rouge[t].fmeasure for t in rouge_types},
    }


def _assert_rewards_equal(pairs: list[tuple[str, str]], *, rouge_l: bool = True) -> dict[str, list[float]]:
    """Each grader's rewards on ``pairs``, checked against the packages'; returns them."""
    expected = [_expected(text, reference, rouge_l=rouge_l) for text, reference in pairs]
    texts, items = [text for text, _ in pairs], [{"reference": reference} for _, reference in pairs]
    spec = {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.reference}}"}
    rewards = {}
    for name in expected[0]:
        grader = validate_grader({**spec, "name": name, "evaluation_metric": name})
        result = grader.grade_batch(texts, items)
        assert result.errors == [None] * len(pairs), name
        for (text, reference), want, got in zip(pairs, expected, result.rewards, strict=True):
            assert 0.0 <= got <= 1.0, (name, text, reference, got)
            assert got == pytest.approx(want[name], abs=TOLERANCE, rel=0), (name, text, reference)
        rewards[name] = result.rewards
    return rewards


def test_the_generated_pairs_cover_the_edge_cases() -> None:
    pairs = _pairs()
    assert len(pairs) >= 500
    assert any(a == "" for a, _ in pairs) and any(b == "" for _, b in pairs) and ("", "") in pairs
    assert any(a and not any(c.isalnum() for c in a) for a, _ in pairs)  # punctuation only
    assert any(any(ord(c) > 0x2E80 for c in b) for _, b in pairs)  # CJK and beyond
    assert any(len(b.split()) >= LONG_WORDS for _, b in pairs)
    assert sum(a == b for a, b in pairs) >= 50


def test_every_metric_equals_its_package_on_generated_pairs() -> None:
    rewards = _assert_rewards_equal(_pairs())
    assert len(rewards) == 10
    for name, values in rewards.items():  # not a run of zeros: full matches, misses, and between
        seen = {round(value, 3) for value in values}
        assert {0.0, 1.0} <= seen and len(seen) > 20, (name, sorted(seen))


def test_very_long_texts_equal_their_packages() -> None:
    # ROUGE-L is left out: rouge-score's table would take minutes here (ours is bit-parallel and
    # equals it on the pairs above)
    draw = random.Random(5)
    reference = _words(draw, VERY_LONG_WORDS, WORDS + UNICODE)
    pairs = [(_edit(draw, reference), reference), (_words(draw, VERY_LONG_WORDS, WORDS), reference)]
    rewards = _assert_rewards_equal(pairs, rouge_l=False)
    assert len(rewards) == 9 and rewards["bleu"][0] > 0.9
