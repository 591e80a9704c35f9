"""Continuous batching (``engine/inference/batching.py``): answers decoded together give the
tokens each gives alone, prompts of different lengths and requests that join mid-way included;
LoRA adapters of one base share it in one batch, unmerged; a cancelled answer leaves the batch at
the next step; an unloaded model ends its answers ``preempted``; stop strings cut the text."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from engine.inference.batching import Ask, Batcher, End, Event, Model, Token
from engine.inference.chat import Sampling, prompt_ids, sample, stop_ids
from engine.inference.text import StopText
from tests.engine.tiny import VOCAB, tiny_model, tiny_tokenizer

PROMPTS = [
    [{"role": "user", "content": "what is two plus three?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "answer me"}, {"role": "user", "content": "what is two plus three? now"}],
]


def base(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return tiny_model(
        "llama", vocab_size=max(VOCAB, len(tiny_tokenizer())), max_position_embeddings=256
    ).eval()


class Answers:
    """Collects the events of one ``Ask``; ``wait`` until all its choices ended."""

    def __init__(self, n: int = 1) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.ends: dict[int, End] = {}
        self.n, self.done = n, threading.Event()

    def emit(self, event: Event) -> None:
        if isinstance(event, Token):
            self.tokens[event.index].append(event.token)
        else:
            self.ends[event.index] = event
            if len(self.ends) == self.n:
                self.done.set()

    def wait(self) -> Answers:
        assert self.done.wait(60), "the answer did not end"
        return self


def alone(model: Any, tokenizer: Any, messages: list[dict[str, str]], tokens: int) -> list[int]:
    ids = prompt_ids(tokenizer, messages)
    out = list(sample(model, ids, Sampling(0.0, 1.0, tokens), stop=stop_ids(model, tokenizer)))
    return out[:-1] if out and out[-1] in stop_ids(model, tokenizer) else out


def test_a_batch_answers_what_each_prompt_answers_alone() -> None:
    tokenizer, module = tiny_tokenizer(), base()
    batcher, model = Batcher(), Model(module, name="tiny")
    stops = frozenset(stop_ids(module, tokenizer))
    answers = [Answers(n=2) for _ in PROMPTS]
    for messages, a in zip(PROMPTS, answers, strict=True):  # queued before the thread starts: one batch
        batcher.submit(
            model,
            Ask(
                prompt_ids(tokenizer, messages),
                Sampling(0.0, 1.0, 24),
                tokenizer,
                a.emit,
                n=2,
                stop_ids=stops,
            ),
        )
    batcher.start()
    for messages, a in zip(PROMPTS, answers, strict=True):
        a.wait()
        assert a.tokens[0] == a.tokens[1] == alone(module, tokenizer, messages, 24)
    # 3 prefills, then one forward per step for all six rows, not one per row
    assert batcher.steps <= 3 + 24
    # one that joins a running batch
    late = Answers()
    first = Answers()
    batcher.submit(
        model,
        Ask(prompt_ids(tokenizer, PROMPTS[0]), Sampling(0.0, 1.0, 40), tokenizer, first.emit, stop_ids=stops),
    )
    while not first.tokens[0]:
        time.sleep(0.001)
    batcher.submit(
        model,
        Ask(prompt_ids(tokenizer, PROMPTS[2]), Sampling(0.0, 1.0, 20), tokenizer, late.emit, stop_ids=stops),
    )
    assert first.wait().tokens[0] == alone(module, tokenizer, PROMPTS[0], 40)
    assert late.wait().tokens[0] == alone(module, tokenizer, PROMPTS[2], 20)
    batcher.close()


def test_adapters_of_one_base_share_it_in_one_batch(tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    tokenizer = tiny_tokenizer()
    folders = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(base(), lora).save_pretrained(tmp_path / f"a{seed}")
        folders.append(str(tmp_path / f"a{seed}"))
    batcher, model = Batcher(), Model(base(), name="tiny")
    names = [None, model.adapter(folders[0]), model.adapter(folders[1]), model.adapter(folders[0])]
    assert names[1] == names[3] and len(model.adapters) == 2  # loaded once
    assert sum(p.numel() for n, p in model.module.named_parameters() if "lora" not in n) == sum(
        p.numel() for p in base().parameters()
    )  # one base, not merged
    ids = prompt_ids(tokenizer, PROMPTS[0])
    answers = [Answers() for _ in names]
    for name, a in zip(names, answers, strict=True):
        batcher.submit(model, Ask(ids, Sampling(0.0, 1.0, 16), tokenizer, a.emit, adapter=name))
    batcher.start()
    references = [base(), *(PeftModel.from_pretrained(base(), f).eval() for f in (*folders, folders[0]))]
    for reference, a in zip(references, answers, strict=True):
        assert a.wait().tokens[0] == list(sample(reference, ids, Sampling(0.0, 1.0, 16), stop=set()))
    assert answers[0].tokens != answers[1].tokens  # the adapter is applied
    assert batcher.steps == 4 + 15  # four prefills, then one forward per step for all four
    batcher.close()


def test_a_cancelled_answer_leaves_at_the_next_step_and_an_unloaded_model_preempts() -> None:
    tokenizer, module = tiny_tokenizer(), base()
    batcher, model = Batcher().start(), Model(module, name="tiny")
    ids = prompt_ids(tokenizer, PROMPTS[0])
    a, b = Answers(), Answers()
    ask = Ask(ids, Sampling(1.0, 1.0, 200, seed=0), tokenizer, a.emit)
    batcher.submit(model, ask)
    batcher.submit(model, Ask(ids, Sampling(1.0, 1.0, 200, seed=1), tokenizer, b.emit))
    while len(a.tokens[0]) < 3:
        time.sleep(0.001)
    ask.cancel.set()
    a.wait()
    assert a.ends[0].reason == "cancelled" and len(a.tokens[0]) <= a.ends[0].tokens + 1 < 200
    batcher.drop(model, grace_s=0.0)
    assert b.wait().ends[0].reason == "preempted" and model.closed
    batcher.close()


def test_stop_strings_cut_the_text_and_hold_back_a_possible_start() -> None:
    class Chars:  # one character per token id
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    text = StopText(Chars(), ("END", "xy"))
    assert "".join(text.add(ord(c)) for c in "abcEN") == "abc" and not text.stopped  # "EN" may start "END"
    assert text.add(ord("D")) == "" and text.stopped  # the stop string and what follows are never sent
    other = StopText(Chars(), ("END", "xy"))
    assert "".join(other.add(ord(c)) for c in "ENx") == "EN"  # "ENx" cannot start a stop; "x" can
    assert other.add(ord("z")) == "xz" and not other.stopped
    open_end = StopText(Chars(), ("END",))
    assert "".join(open_end.add(ord(c)) for c in "abE") == "ab"
    assert open_end.rest() == "E"  # the answer ended: what was held back goes out
