"""Run TRL's trainer and the tree trainer from one seed on one tiny checkpoint, offline.

Both trainers load the same saved checkpoint (so ``beta > 0`` can build its reference model from
the path), generate with the same seed (so the rollouts are identical — checked), and train with
plain SGD, whose update is linear in the gradient (Adam's first step is ~lr·sign(g) and would hide
or magnify rounding). TRL's configs default to bf16 autocast, turned off here.

``dtype=torch.float64`` runs the whole comparison in double precision (TRL's fused LM head still
rounds through fp32 inside): two fp32 runs that order their sums differently disagree by ~1e-5 on a
parameter whose gradient is mostly cancellation (the final norm's weight), so per-parameter checks
at 1e-5 are made in float64, where such noise is ~1e-7 and any real difference is still O(1).
"""

from __future__ import annotations

import torch
from datasets import Dataset

from trl_tree.data.tiny import tiny_model, tiny_tokenizer

PROMPTS = [("count the a letters in " + "banana " * (1 + i % 3) + str(i)) for i in range(32)]


def save_tiny_checkpoint(path, family: str = "qwen2", tokenizer=None, **overrides) -> str:
    """A tiny model of ``family`` and its tokenizer (``tiny_tokenizer`` unless given) saved at ``path``."""
    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    fields = dict(vocab_size=len(tok), max_position_embeddings=512, initializer_range=0.05)
    model = tiny_model(family, **{**fields, **overrides})
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def reward_a(completions, **kwargs):
    """Share of 'a' characters: a reward a random tiny model can learn within a few steps."""
    return [c.count("a") / max(len(c), 1) for c in completions]


BASE_ARGS = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=8,
    learning_rate=0.05,
    optim="sgd",
    max_steps=2,
    gradient_accumulation_steps=2,
    num_iterations=2,
    beta=0.04,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    bf16=False,
    save_strategy="no",
    seed=0,
    disable_tqdm=True,
)


def run(trainer_cls, config_cls, checkpoint: str, *, dataset=None, trainer_kwargs=None, dtype=torch.float32,
        **overrides):
    """Train; return (parameter updates, completions, the trainer)."""
    from transformers import PreTrainedTokenizerFast

    overrides.setdefault("model_init_kwargs", {"dtype": dtype})
    args = config_cls(output_dir=f"{checkpoint}/out", **{**BASE_ARGS, **overrides})
    tok = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=checkpoint,
        args=args,
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
        **{"reward_funcs": reward_a, **(trainer_kwargs or {})},
    )
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    updates = {n: p.detach() - start[n] for n, p in trainer.model.named_parameters() if p.requires_grad}
    return updates, list(trainer._logs["completion"]), trainer


def multi_turn_rollout(prompts, trainer):
    """Two turns with a tool result between them: pairs of a group share turn 1 and the tool output."""
    tok = trainer.processing_class
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for i, prompt in enumerate(prompts):
        pair, member = (i % 4) // 2, i % 2
        turn1 = tok(f"call tool {pair}")["input_ids"]
        tool = tok(f" result {pair * 7}")["input_ids"]
        turn2 = tok(f" answer {'a' * (1 + member + pair)}")["input_ids"] + [tok.eos_token_id]
        out["prompt_ids"].append(tok(prompt)["input_ids"])
        out["completion_ids"].append(turn1 + tool + turn2)
        out["logprobs"].append([0.0] * len(turn1 + tool + turn2))
        out["env_mask"].append([1] * len(turn1) + [0] * len(tool) + [1] * len(turn2))
    return out
