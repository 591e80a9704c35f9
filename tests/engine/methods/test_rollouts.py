"""Rollout sampling: each completion draws from its own stream keyed by (step seed, prompt index in
the batch, completion index), so a split of the batch (across boxes) samples what the whole batch
does; the sampling distribution is temperature then nucleus, as Hugging Face's warpers give it."""

from __future__ import annotations

import pytest
import torch

from engine.data.sequences import PromptItem
from engine.methods.rollouts import Rollout, Sampling, distribution, draw, sample
from tests.engine.tiny import VOCAB, tiny_model, tiny_tokenizer

# prompts of different lengths: each split left-pads them to another width
LENGTHS = [3, 9, 5, 12, 7, 4]
SAMPLING = Sampling(group_size=4, max_new_tokens=20)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def prompts(tokenizer) -> list[PromptItem]:
    g = torch.Generator().manual_seed(3)
    return [
        PromptItem(i, torch.randint(5, len(tokenizer), (n,), generator=g).tolist(), "", {})
        for i, n in enumerate(LENGTHS)
    ]


def model_of(family: str, tokenizer):
    return tiny_model(family, vocab_size=max(VOCAB, len(tokenizer))).eval()


def rows(rollout: Rollout, prompt: int) -> list[list[int]]:
    g = rollout.group_size
    return rollout.completions[prompt * g : prompt * g + g]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_prompt_samples_the_same_completions_in_any_split_of_the_batch(family: str, tokenizer) -> None:
    model, items = model_of(family, tokenizer), prompts(tokenizer)
    with torch.no_grad():
        whole = sample(model, tokenizer, items, SAMPLING, seed=11)
        first = sample(model, tokenizer, items[:2], SAMPLING, seed=11)
        rest = sample(model, tokenizer, items[2:], SAMPLING, seed=11, indices=range(2, 6))
        odd = sample(model, tokenizer, items[1::2], SAMPLING, seed=11, indices=[1, 3, 5])
        alone = {i: sample(model, tokenizer, [items[i]], SAMPLING, seed=11, indices=[i]) for i in (0, 3)}
    # the batch's rows stop at different lengths, so some rows run on as padding while others sample
    assert 0 < sum(whole.finished) < len(whole.finished)
    assert len({len(c) for c in whole.completions}) > 1
    assert all(len({tuple(c) for c in rows(whole, i)}) > 1 for i in range(len(items)))  # own streams
    assert whole.completions == first.completions + rest.completions
    assert [rows(whole, i) for i in (1, 3, 5)] == [rows(odd, k) for k in range(3)]
    for i, one in alone.items():
        assert one.completions == rows(whole, i)
        assert one.texts == whole.texts[i * 4 : i * 4 + 4]
        assert one.finished == whole.finished[i * 4 : i * 4 + 4]


def test_the_streams_are_keyed_by_seed_and_index_and_leave_the_process_stream_alone(tokenizer) -> None:
    model, items = model_of("llama", tokenizer), prompts(tokenizer)[:1]
    state = torch.random.get_rng_state()
    with torch.no_grad():
        at0 = sample(model, tokenizer, items, SAMPLING, seed=11)
        again = sample(model, tokenizer, items, SAMPLING, seed=11, indices=[0])
        at1 = sample(model, tokenizer, items, SAMPLING, seed=11, indices=[1])
        other_step = sample(model, tokenizer, items, SAMPLING, seed=12)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert at0.completions == again.completions
    assert at0.completions != at1.completions and at0.completions != other_step.completions


def test_a_tiny_top_p_samples_the_greedy_completions(tokenizer) -> None:
    model, items = model_of("llama", tokenizer), prompts(tokenizer)
    narrow = Sampling(group_size=3, max_new_tokens=12, top_p=1e-9)
    with torch.no_grad():
        greedy = sample(model, tokenizer, items, narrow, seed=5, greedy=True)
        sampled = sample(model, tokenizer, items, narrow, seed=5)
    assert sampled.completions == [c for c in greedy.completions for _ in range(3)]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (1.0, 0.05)])
def test_the_distribution_is_temperature_then_nucleus_as_transformers_warpers_give_it(
    temperature: float, top_p: float
) -> None:
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    scores = torch.randn(8, 261, generator=torch.Generator().manual_seed(0)) * 3
    scores[:, 7] = float("-inf")  # a token another processor banned
    warped = TemperatureLogitsWarper(temperature)(torch.zeros(8, 1, dtype=torch.long), scores.clone())
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(torch.zeros(8, 1, dtype=torch.long), warped)
    expected = torch.softmax(warped, dim=-1).double()
    probs, tokens = distribution(scores, temperature=temperature, top_p=top_p)
    assert (tokens is None) == (top_p == 1)
    if tokens is not None:  # ranked most likely first: back to vocabulary order
        probs = torch.zeros_like(probs).scatter_(-1, tokens, probs)
    probs = probs.double() / probs.double().sum(-1, keepdim=True)
    assert torch.equal(probs > 0, expected > 0)
    assert (probs - expected).abs().max() < 1e-6


def test_the_draws_follow_a_known_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64)
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def frequencies(temperature: float, top_p: float) -> torch.Tensor:
        probs, tokens = distribution(p.log().expand(n, -1), temperature=temperature, top_p=top_p)
        return torch.bincount(draw(probs, u, tokens), minlength=5).double() / n

    # 4 standard deviations of a share of 40,000 draws is at most 0.01
    assert (frequencies(1.0, 1.0) - p).abs().max() < 0.01
    hot = p.sqrt() / p.sqrt().sum()  # temperature 2
    assert (frequencies(2.0, 1.0) - hot).abs().max() < 0.01
    nucleus = frequencies(1.0, 0.7)  # 0.5 < 0.7 <= 0.8: the two most likely, renormalised
    assert nucleus[2:].sum() == 0 and abs(float(nucleus[0]) - 0.625) < 0.01
    assert frequencies(1.0, 1.0)[4] == 0  # probability 0: never drawn
    # the ends, 0 and 1: the first and the last token with any probability, in vocabulary order
    # and ranked (not the zero-probability tokens past them)
    ends = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert draw(p.expand(2, -1), ends).tolist() == [0, 3]
    ranked = torch.tensor([[0.05, 0.0, 0.3, 0.15, 0.5]] * 2, dtype=torch.float64).log()
    probs, tokens = distribution(ranked, temperature=1.0, top_p=0.9)
    assert draw(probs, ends, tokens).tolist() == [4, 3]


def test_bad_input_names_the_field(tokenizer) -> None:
    model, items = model_of("llama", tokenizer), prompts(tokenizer)[:2]
    with pytest.raises(ValueError, match=r"indices: 1 given for 2 prompts"):
        sample(model, tokenizer, items, SAMPLING, seed=0, indices=[0])
    with pytest.raises(ValueError, match=r"indices=\[1, 1\]: .* distinct"):
        sample(model, tokenizer, items, SAMPLING, seed=0, indices=[1, 1])
    with pytest.raises(ValueError, match=r"temperature=0\.0"):
        sample(model, tokenizer, items, Sampling(2, 4, temperature=0.0), seed=0)
    with pytest.raises(ValueError, match=r"top_p=0\.0"):
        sample(model, tokenizer, items, Sampling(2, 4, top_p=0.0), seed=0)
