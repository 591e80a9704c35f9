"""Tiny models of every supported family and the plain single-device training loop."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from engine.model.families import FAMILIES as FAMILY_TABLE
from engine.model.family_spec import FamilySpec

# the supported families by short name ("gemma3"), in the family table's order
SPECS: dict[str, FamilySpec] = {spec.short_name: spec for spec in FAMILY_TABLE.values()}
FAMILIES = tuple(SPECS)
# the mixture-of-experts families (4 routed experts, 2 per token). With seed 0 and the test
# batches no token's 2nd and 3rd expert scores come within 7.6e-6 of each other over 3 SGD
# steps (test_families.test_the_tiny_routers_have_no_near_ties), far above the ~1e-8 the
# engine's micro-batches move them: the engine and the plain loop route every token alike.
MOE_FAMILIES = tuple(name for name, spec in SPECS.items() if spec.moe is not None)
VOCAB = 96
# a hand-made plan for 3 blocks (5 layers): two forward stages, a fused stage of two layers
# (top block + output layer) and two backward stages that recompute
SPLIT_PLAN = {"forward": [2, 1], "fused": 2, "backward": [1, 2]}


def tiny_model(family: str, *, blocks: int = 3, tied: bool | None = None, seed: int = 0, **extra: object):
    """A ~100k-parameter model of one family (dim 32, 4 heads, 2 KV heads).

    The family's ``FamilySpec.tiny_config`` goes on top of these sizes, then ``tied`` and
    ``extra``. The mixture-of-experts families route each token to 2 of 4 experts of width 16.
    """
    import transformers

    spec = SPECS[family]
    common: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    common.update(copy.deepcopy(dict(spec.tiny_config)))
    if tied is not None:
        common["tie_word_embeddings"] = tied
    common.update(extra)
    model_class = getattr(transformers, spec.architecture)
    torch.manual_seed(seed)
    model = model_class(model_class.config_class(**common))
    model.train()
    return model


def tiny_batch(batch: int = 7, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random tokens with right padding on two rows and -100 on the prompt and the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -4:] = 0
    mask[-1, -2:] = 0
    labels = ids.clone()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def plain_loop(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    max_grad_norm: float | None = None,
    microbatches: int | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train a copy of ``model`` the ordinary way: whole batch, one device, one optimizer.

    With ``microbatches`` the batch is instead split like the engine splits it and the
    gradients are accumulated, each micro-batch weighted by its share of the label tokens.
    """
    ref = copy.deepcopy(model)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = make_opt(params)
    losses = []
    for batch in batches:
        if microbatches is None:
            loss = ref(**batch).loss
            loss.backward()
        else:
            total = int((batch["labels"][:, 1:] != -100).sum())
            loss = torch.zeros(())
            for rows in torch.arange(len(batch["input_ids"])).tensor_split(microbatches):
                mb = {k: v[rows] for k, v in batch.items()}
                share = int((mb["labels"][:, 1:] != -100).sum()) / total
                part = ref(**mb).loss * share
                part.backward()
                loss = loss + part.detach()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in ref.state_dict().items()}


def engine_loop(model: torch.nn.Module, batches: list[dict[str, Any]], config, **kwargs):
    """Train a copy of ``model`` with RoundPipe; returns losses, master weights and the engine's plan."""
    from engine import RoundPipe

    rp = RoundPipe(copy.deepcopy(model), config, **kwargs)
    try:
        losses = []
        for batch in batches:
            losses.append(rp.forward_backward(**batch))
            rp.step()
        return losses, rp.master_state_dict(), rp.plan
    finally:
        rp.close()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is two plus three? five. what is one plus one? two.",
    "system user assistant hello world answer question reply",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 + - = ?",
]


def tiny_tokenizer(with_template: bool = True):
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if with_template:
        fast.chat_template = CHATML
    return fast


def tiny_model_folder(path, family: str = "llama", *, tied: bool | None = None):
    """Save a tiny model and tokenizer as a Hugging Face folder; returns the path."""
    tokenizer = tiny_tokenizer()
    # in no llama.cpp pre-tokenizer table: the folder names it for GGUF exports (GPT-2's split)
    tokenizer.init_kwargs["gguf_pre_tokenizer"] = "gpt-2"
    vocab = max(VOCAB, len(tokenizer))
    model = tiny_model(family, tied=tied, vocab_size=vocab)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
