"""Tiny models of every supported family and the plain single-device training loop."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "smollm3",
    "glm4",
    "olmo2",
    "phi3",
    "granite",
    "gemma3",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
)
# the mixture-of-experts families (4 routed experts, 2 per token). With seed 0 and the test
# batches no token's 2nd and 3rd expert scores come within 7.6e-6 of each other over 3 SGD
# steps (test_families.test_the_tiny_routers_have_no_near_ties), far above the ~1e-8 the
# engine's micro-batches move them: the engine and the plain loop route every token alike.
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
VOCAB = 96
# a hand-made plan for 3 blocks (5 layers): two forward stages, a fused stage of two layers
# (top block + output layer) and two backward stages that recompute
SPLIT_PLAN = {"forward": [2, 1], "fused": 2, "backward": [1, 2]}


def tiny_model(family: str, *, blocks: int = 3, tied: bool | None = None, seed: int = 0, **extra: object):
    """A ~100k-parameter model of one family (dim 32, 4 heads, 2 KV heads).

    The mixture-of-experts families route each token to 2 of 4 experts of width 16.
    """
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Glm4Config,
        Glm4ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    common: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family in ("smollm3", "glm4", "olmo2", "phi3", "granite"):
        # their configs' default special token ids lie outside the tiny vocabulary
        common.update(pad_token_id=None, bos_token_id=1, eos_token_id=2)
    # tie the embeddings of the families whose small checkpoints do, unless told
    tied_families = ("qwen2", "qwen3", "smollm3", "granite", "gemma3")
    common["tie_word_embeddings"] = tied if tied is not None else family in tied_families
    if family == "mistral":
        common["sliding_window"] = 8  # shorter than the test sequences: exercises the sliding mask
    if family == "qwen2":
        # alternate attention types: the lowest block full, the others with a sliding window
        common.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if family == "smollm3":
        # the top block without rotary embedding (NoPE) and, as SmolLM3 pairs them, sliding
        common.update(no_rope_layers=[1, 1, 0][:blocks], use_sliding_window=True, sliding_window=8)
    if family == "glm4":
        # head_dim: the config's default is 128. No attention bias: with GLM-4's half rotary the
        # unrotated half of k_proj.bias has a gradient that is exactly zero but for rounding
        # (~1e-11), which AdamW blows up into steps of lr; q/k/v biases are covered by qwen2.
        common.update(head_dim=8, attention_bias=False)
    if family == "phi3":
        common["sliding_window"] = 8  # every block sliding
    if family == "granite":
        # away from 1.0, so a scale the engine forgot shows up in the weights
        common.update(
            embedding_multiplier=2.5, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0
        )
    if family == "gemma3":
        # head_dim: the config's default is 256. Blocks alternate sliding (window 8, shorter than
        # the test sequences) and full attention, whose rotary tables differ (local and global
        # rope_theta). The tiny logits reach ~0.45: a cap of 0.2 bends them visibly. No
        # attn_logit_softcapping: transformers' Gemma3Attention does not hand it to the attention
        # function, so it would change nothing.
        common.update(
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"][
                :blocks
            ],
            final_logit_softcapping=0.2,
        )
    if family == "qwen3_moe":
        # the lowest block dense (mlp_only_layers), the others mixtures of experts
        common.update(
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        )
    if family == "gpt_oss":
        # every block a mixture of experts; blocks alternate sliding (window 8) and full
        # attention (the config's default layer_types); YaRN rotary as the released models
        common.update(
            head_dim=8,
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
    if family == "deepseek_v3":
        # multi-head latent attention (low-rank q and kv, interleaved rotary half) with YaRN;
        # the lowest block dense, the others 4 routed experts (one group) plus a shared expert
        common.update(
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    common.update(extra)
    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
        "glm4": (Glm4Config, Glm4ForCausalLM),
        "olmo2": (Olmo2Config, Olmo2ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "granite": (GraniteConfig, GraniteForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "gpt_oss": (GptOssConfig, GptOssForCausalLM),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**common))
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


def engine_loop(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], config, **kwargs):
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
    vocab = max(VOCAB, len(tokenizer))
    model = tiny_model(family, tied=tied, vocab_size=vocab)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
