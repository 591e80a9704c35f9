"""The chat sampler (``engine/inference/chat.py``): KV-cached greedy decoding gives exactly the tokens of
``model.generate(do_sample=False)``, sampling is reproducible with a seed, and the text pieces add
up to the decoded answer."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.inference.chat import (
    Finish,
    Piece,
    Sampling,
    TextStream,
    chat_stream,
    prompt_ids,
    sample,
    stop_ids,
)
from tests.engine.tiny import VOCAB, tiny_model, tiny_tokenizer

CHAT = [{"role": "user", "content": "what is two plus three?"}]


def tiny_chat_model(family: str = "llama", seed: int = 0) -> tuple[torch.nn.Module, object]:
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    model = tiny_model(family, vocab_size=max(VOCAB, len(tokenizer)), max_position_embeddings=256)
    return model.eval(), tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "qwen3_moe"])
def test_greedy_sampling_equals_generate(family: str) -> None:
    model, tokenizer = tiny_chat_model(family)
    for messages in (CHAT, [{"role": "system", "content": "answer"}, *CHAT]):
        ids = prompt_ids(tokenizer, messages)
        stop = stop_ids(model, tokenizer)
        mine = list(sample(model, ids, Sampling(temperature=0.0, max_tokens=40), stop=stop))
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=sorted(stop),
                pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
            )
        assert mine == out[0, len(ids) :].tolist()


def test_sampling_is_reproducible_with_a_seed() -> None:
    model, tokenizer = tiny_chat_model()
    ids = prompt_ids(tokenizer, CHAT)

    def run(**kw: object) -> list[int]:
        return list(sample(model, ids, Sampling(max_tokens=30, **kw), stop=set()))  # type: ignore[arg-type]

    a = run(temperature=1.3, top_p=0.9, seed=11)
    assert a == run(temperature=1.3, top_p=0.9, seed=11) and len(a) == 30
    assert a != run(temperature=1.3, top_p=0.9, seed=12)
    # a nucleus so small it holds only the likeliest token: greedy, whatever the seed
    assert run(temperature=1.0, top_p=1e-9, seed=3) == run(temperature=0.0)


def test_top_p_samples_only_inside_the_nucleus() -> None:
    from engine.inference.chat import pick

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    seen = {pick(logits, Sampling(temperature=1.0, top_p=0.75), generator) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reach 0.75; 2 and 3 are outside
    seen = {pick(logits, Sampling(temperature=1.0, top_p=1.0), generator) for _ in range(300)}
    assert seen == {0, 1, 2, 3}


def test_chat_stream_pieces_add_up_to_the_answer() -> None:
    model, tokenizer = tiny_chat_model()
    events = list(
        chat_stream(model, tokenizer, CHAT, sampling=Sampling(temperature=1.0, max_tokens=25, seed=1))
    )
    finish = events[-1]
    assert isinstance(finish, Finish) and all(isinstance(e, Piece) for e in events[:-1])
    assert finish.prompt_tokens == len(prompt_ids(tokenizer, CHAT))
    assert finish.reason in ("stop", "length") and 1 <= finish.completion_tokens <= 25
    ids = list(
        sample(model, prompt_ids(tokenizer, CHAT), Sampling(1.0, 1.0, 25, 1), stop=stop_ids(model, tokenizer))
    )
    text = tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert "".join(e.text for e in events[:-1]) == text


def test_text_stream_holds_back_a_partial_character() -> None:
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("é ü", add_special_tokens=False)
    stream = TextStream(tokenizer)
    pieces = [stream.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.rest() == "é ü"


def test_cancel_stops_the_answer() -> None:
    model, tokenizer = tiny_chat_model()
    cancel = threading.Event()
    cancel.set()
    events = list(chat_stream(model, tokenizer, CHAT, sampling=Sampling(max_tokens=50), cancel=cancel))
    assert events == [Finish("cancelled", len(prompt_ids(tokenizer, CHAT)), 0)]


def test_bad_input_names_the_field() -> None:
    model, tokenizer = tiny_chat_model()
    for sampling, field in [
        (Sampling(temperature=-0.1), "temperature"),
        (Sampling(top_p=0.0), "top_p"),
        (Sampling(max_tokens=0), "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            list(chat_stream(model, tokenizer, CHAT, sampling=sampling))
    with pytest.raises(ValueError, match=r"^messages\.1\.role: the last message must be the user's"):
        list(
            chat_stream(model, tokenizer, [*CHAT, {"role": "assistant", "content": "5"}], sampling=Sampling())
        )
    with pytest.raises(
        ValueError, match=r"^messages: the conversation is \d+ tokens; the model's context is 256"
    ):
        list(chat_stream(model, tokenizer, [{"role": "user", "content": "fox " * 300}], sampling=Sampling()))
