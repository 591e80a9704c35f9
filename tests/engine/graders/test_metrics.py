"""The text-similarity metrics on small sentences whose values are worked out by hand below, with
the packages' definitions (sacrebleu, nltk, rouge-score, rapidfuzz); test_metric_parity.py
compares them with the packages' own calls on generated text."""

from __future__ import annotations

import math
import random
import time

import pytest

from engine.graders import metrics
from engine.graders.metrics import (
    METRICS,
    bleu,
    fuzzy_match,
    gleu,
    lcs_length,
    meteor,
    rouge_l,
    rouge_n,
    rouge_tokens,
    tokens_13a,
)

CAT = "the cat sat on the mat"


def _lcs_table(a: str, b: str) -> int:
    """The textbook dynamic programme, to check the bit-parallel one against."""
    rows = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            rows[i + 1][j + 1] = rows[i][j] + 1 if x == y else max(rows[i][j + 1], rows[i + 1][j])
    return rows[-1][-1]


def test_the_bit_parallel_lcs_equals_the_dynamic_programme() -> None:
    draw = random.Random(7)
    for _ in range(2000):
        a = "".join(draw.choice("abc") for _ in range(draw.randint(0, 24)))
        b = "".join(draw.choice("abcd") for _ in range(draw.randint(0, 24)))
        assert lcs_length(a, b) == _lcs_table(a, b), (a, b)
    assert lcs_length(["the", "cat"], ["a", "cat", "the"]) == 1


def test_tokenizers() -> None:
    # 13a: punctuation apart, but an apostrophe, a hyphen between letters and a decimal point stay
    assert tokens_13a("Hello, world! don't 3.14 a-b") == ["Hello", ",", "world", "!", "don't", "3.14", "a-b"]
    # rouge-score: lowercased runs of a-z and 0-9; any other character splits (or is dropped)
    assert rouge_tokens("Hello, World_2! Café 中文") == ["hello", "world", "2", "caf"]


def test_fuzzy_match() -> None:
    # kitten / sitting: LCS "ittn" = 4 characters; 2 * 4 / (6 + 7) = 8/13
    assert fuzzy_match("kitten", "sitting") == pytest.approx(8 / 13)
    assert fuzzy_match("same", "same") == 1.0
    assert fuzzy_match("", "") == 1.0
    assert fuzzy_match("abc", "") == 0.0
    assert fuzzy_match("abc", "xyz") == 0.0


def test_bleu() -> None:
    # hypothesis "the cat sat on the mat" (6 tokens), reference "the cat is on the mat" (6):
    #   1-grams: the x2, cat, on, mat match -> 5 of 6          p1 = 5/6
    #   2-grams: the-cat, on-the, the-mat match -> 3 of 5     p2 = 3/5
    #   3-grams: on-the-mat matches -> 1 of 4                 p3 = 1/4
    #   4-grams: none of 3; exp smoothing: 1 / (2 * 3)        p4 = 1/6
    #   same length: no brevity penalty; BLEU = (5/6 * 3/5 * 1/4 * 1/6) ** (1/4) = (1/48) ** (1/4)
    assert bleu(CAT, "the cat is on the mat") == pytest.approx((1 / 48) ** 0.25)
    # "the cat" against the 6-token sentence: orders 1 and 2 perfect, orders 3 and 4 have no
    # n-gram (effective order 2), brevity penalty exp(1 - 6/2) = exp(-2)
    assert bleu("the cat", CAT) == pytest.approx(math.exp(-2))
    assert bleu(CAT, CAT) == 1.0  # sacrebleu's 100.00000000000004, capped
    assert bleu("dog", CAT) == 0.0
    assert bleu("", CAT) == bleu(CAT, "") == bleu("", "") == 0.0
    # case counts and marks are tokens: "The cat." is [The, cat, .] against [the, cat]: p1 = 1/3;
    # p2: 0 of 2 -> 1 / (2 * 2); p3: 0 of 1 -> 1 / (4 * 1); effective order 3: (1/48) ** (1/3)
    assert bleu("The cat.", "the cat") == pytest.approx((1 / 48) ** (1 / 3))
    assert bleu("the cat .", "the cat.") == pytest.approx(1.0)


def test_gleu() -> None:
    # the same pair: 6+5+4+3 = 18 n-grams on each side, 5+3+1+0 = 9 matching: min(9/18, 9/18)
    assert gleu(CAT, "the cat is on the mat") == pytest.approx(0.5)
    # "the cat" has 3 n-grams (the, cat, the-cat), all in CAT's 18: precision 1, recall 3/18
    assert gleu("the cat", CAT) == pytest.approx(3 / 18)
    assert gleu("", CAT) == gleu("", "") == 0.0


def test_rouge() -> None:
    # ROUGE-1: 5 of 6 words match either way -> F1 5/6; ROUGE-2: 3 of 5 bigrams -> 0.6;
    # ROUGE-L: LCS "the cat on the mat" = 5 -> 5/6
    assert rouge_n(CAT, "the cat is on the mat", 1) == pytest.approx(5 / 6)
    assert rouge_n(CAT, "the cat is on the mat", 2) == pytest.approx(0.6)
    assert rouge_l(CAT, "the cat is on the mat") == pytest.approx(5 / 6)
    # "the mat sat on the cat": all 6 words match (ROUGE-1 1.0); bigrams the-mat, sat-on, on-the,
    # the-cat match 4 of 5 (0.8); the LCS is "the sat on the", 4 of 6 -> 2/3
    swapped = "the mat sat on the cat"
    assert rouge_n(swapped, CAT, 1) == pytest.approx(1.0)
    assert rouge_n(swapped, CAT, 2) == pytest.approx(0.8)
    assert rouge_l(swapped, CAT) == pytest.approx(2 / 3)
    # "the cat" against "the cat sat": precision 1, recall 2/3 -> F1 = 2 * (2/3) / (5/3) = 0.8
    assert rouge_n("the cat", "the cat sat", 1) == pytest.approx(0.8)
    # lowercased, punctuation left out, no stemming
    assert rouge_n("The CAT!", "the cat", 1) == pytest.approx(1.0)
    assert rouge_n("the cats", "the cat", 1) == pytest.approx(0.5)
    # only ASCII letters and digits are words: no word on either side scores 0
    assert rouge_n("中文", "中文", 1) == rouge_l("中文", "中文") == 0.0
    assert rouge_n("", "the cat", 1) == rouge_l("", "the cat") == 0.0
    # orders 3 to 5: "a b c d e" against "a b c d x": 3-grams abc, bcd match 2 of 3; 4-grams 1 of 2;
    # 5-grams 0 of 1
    assert METRICS["rouge_3"]("a b c d e", "a b c d x") == pytest.approx(2 / 3)
    assert METRICS["rouge_4"]("a b c d e", "a b c d x") == pytest.approx(0.5)
    assert METRICS["rouge_5"]("a b c d e", "a b c d x") == 0.0


def test_meteor() -> None:
    # "the cat sat on the mat" against "the cat is on the mat": 5 words match (P = R = 5/6, the
    # weighted mean 5/6); nltk aligns from the last word, each to the last free equal word:
    # (0,0) (1,1) (3,3) (4,4) (5,5): 2 chunks of 5 matches, penalty 0.5 * (2/5)**3 = 0.032
    assert meteor(CAT, "the cat is on the mat") == pytest.approx(5 / 6 * (1 - 0.032))
    # identical: one chunk: 1 - 0.5 * (1/6)**3
    assert meteor(CAT, CAT) == pytest.approx(1 - 0.5 / 216)
    # "the cat" against "the cat sat": P = 1, R = 2/3; mean = P*R / (0.9 P + 0.1 R) = (2/3) / (0.9 + 1/15)
    # = 20/29; one chunk of 2: penalty 0.5 * (1/2)**3 = 1/16
    assert meteor("the cat", "the cat sat") == pytest.approx(20 / 29 * (1 - 1 / 16))
    # the same words reordered: nltk's greedy alignment (0,1) (1,5) (2,3) (3,0) (4,4) (5,2) is 6
    # chunks of 6 matches: penalty 0.5
    assert meteor(CAT, "on the mat sat the cat") == pytest.approx(0.5)
    # Porter stems match ("cats" -> "cat"), lowercased: 3 of 3 in one chunk: 1 - 0.5 * (1/3)**3
    assert meteor("The cats sat", "the cat sat") == pytest.approx(1 - 0.5 / 27)
    # no WordNet: a synonym is not a match
    assert meteor("the dog sat", "the hound sat") == pytest.approx(2 / 3 * (1 - 0.5 * (2 / 2) ** 3))
    assert meteor("dog", CAT) == meteor("", CAT) == meteor(CAT, "") == 0.0


def test_every_openai_metric_but_cosine_is_there() -> None:
    assert set(METRICS) == {"fuzzy_match", "bleu", "gleu", "meteor", "rouge_l"} | {
        f"rouge_{n}" for n in range(1, 6)
    }
    for metric in METRICS.values():
        assert 0.0 <= metric(CAT, "the cat is on the mat") <= 1.0


def test_sacrebleus_tokenizer_caches_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    from sacrebleu.tokenizers.tokenizer_re import TokenizerRegexp

    monkeypatch.setattr(metrics, "TOKENIZER_CACHE_LINES", 8)
    for i in range(40):
        bleu(f"answer number {i}", "a reference")
        gleu(f"answer number {i}", "a reference")
    for call in (Tokenizer13a.__call__, TokenizerRegexp.__call__):
        assert call.cache_info().currsize <= 8


def _prose(draw: random.Random, words: int) -> str:
    stems = [draw.choice("bcdfglmnprst") + draw.choice("aeiou") + draw.choice("klmnrst") for _ in range(400)]
    vocab = [stem + end for stem in stems for end in ("", "s", "ing", "ed")]
    return " ".join(draw.choice(vocab) + draw.choice(["", "", "", ",", "."]) for _ in range(words))


def test_a_long_answer_scores_within_a_second_each() -> None:
    # 10,000 words against a reference of 10,000 more: CPU time, the machine may be shared
    draw = random.Random(11)
    for name, metric in METRICS.items():
        text, reference = _prose(draw, 10_000), _prose(draw, 10_000)
        start = time.process_time()
        metric(text, reference)
        assert time.process_time() - start < 1.0, name


def test_long_answers_stay_fast() -> None:
    draw = random.Random(3)
    text = " ".join(draw.choice(["alpha", "beta", "gamma", "delta", "x"]) for _ in range(4000))
    start = time.perf_counter()
    for name in ("fuzzy_match", "rouge_l", "bleu", "meteor"):
        METRICS[name](text, text[::-1])
    assert time.perf_counter() - start < 10
