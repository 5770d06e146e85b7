"""A toy GRPO task with a tiny policy built in code: what the demo and the examples train offline.

The policy is a randomly initialised Qwen2-shaped model over :func:`trl_tree.tiny.tiny_tokenizer`'s
characters, saved to a local directory so TRL can load it (and build a reference model from it)
like any checkpoint. The task: long shared prompts (so a GRPO group has a real prefix to share)
and a reward for writing the letter ``a`` — learnable by a random model within tens of steps, so
the reward visibly rises on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tiny import tiny_model, tiny_tokenizer

INSTRUCTION = (
    "you are a careful assistant. read the whole story below, then answer with one word only. "
    "the answer is the first letter of the alphabet, written as often as you can. "
)


def build_tiny_policy(path: str | Path, hidden_size: int = 128, num_layers: int = 4, seed: int = 0) -> str:
    """Save a tiny Qwen2-shaped causal LM and its tokenizer to ``path``; return the path."""
    tok = tiny_tokenizer()
    model = tiny_model(
        "qwen2", seed=seed, vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=2048, initializer_range=0.05,
    )
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def toy_prompts(n: int = 256, story_len: int = 320, seed: int = 0) -> list[str]:
    """``n`` prompts: a shared instruction plus a random 'story' of ``story_len`` characters each."""
    g = torch.Generator().manual_seed(seed)
    letters = "bcdefghijklmnopqrstuvwxyz    "
    prompts = []
    for _ in range(n):
        idx = torch.randint(len(letters), (story_len,), generator=g).tolist()
        prompts.append(INSTRUCTION + "".join(letters[i] for i in idx) + " answer:")
    return prompts


def reward_letter_a(completions, **kwargs) -> list[float]:
    """Share of the letter 'a' in each completion (0 for an empty one)."""
    return [c.count("a") / max(len(c), 1) for c in completions]
