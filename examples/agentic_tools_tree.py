"""Multi-turn GRPO with tools through TRL's ``environment_factory``, trained over prefix trees.

    python examples/agentic_tools_tree.py                 # tiny built-in model, CPU or GPU, ~2 minutes on a CPU
    python examples/agentic_tools_tree.py --mode dfs --steps 6

The environment is a small key-value store the model queries with a ``lookup`` tool; it owns the
reward (``get_reward``: did the final answer name the stored value). Each rollout is a
conversation: the system prompt with the tool's schema, the user's question, the model's tool
call, the tool's response, the model's answer. The completions of a GRPO group share the prompt,
and those that call the tool with the same key share the call and its response too: the forest
branches at the tool calls, and ``tree/dedup_ratio`` (T/U, logged every step) is above what the
shared prompt alone gives.

Nothing is downloaded. The policy is a tiny Qwen2-shaped model over a character tokenizer built
in memory with Qwen2.5's chat template (which TRL knows how to parse tool calls from); a short
supervised warm-up teaches it the tool-call format, so that sampling explores which key to query
— a random model would never emit a parseable call.
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile

KEYS = ("alpha", "beta", "gamma", "delta")


class KeyValueStore:
    """The environment TRL builds once per rollout (``environment_factory=KeyValueStore``): its public
    methods are the model's tools, ``reset`` starts an episode, ``get_reward`` scores it."""

    def __init__(self) -> None:
        self.store: dict[str, str] = {}
        self.asked = ""
        self.answer = ""

    def reset(self, seed: int = 0, key: str = "alpha", **_) -> None:
        rng = random.Random(seed)
        self.store = {k: "".join(rng.choice("0123456789") for _ in range(3)) for k in KEYS}
        self.asked, self.answer = key, ""

    def lookup(self, key: str) -> str:
        """Read a value from the store.

        Args:
            key: The key to look up.

        Returns:
            The value stored under the key.
        """
        if key not in self.store:
            raise KeyError(f"no key {key!r}; keys: {', '.join(KEYS)}")
        self.answer = self.store[key] if key == self.asked else self.answer
        return self.store[key]

    def get_reward(self) -> float:
        """1 when the model looked the asked key up, 0 otherwise."""
        return float(bool(self.answer))


def tool_tokenizer():
    """A character-level tokenizer with Qwen2.5's special tokens and chat template, built in memory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                "</tool_response>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=specials[1:])
    tokenizer.chat_template = qwen2_5_chat_template
    return add_response_schema(tokenizer)


def question(key: str) -> list[dict]:
    return [{"role": "user", "content": f"What is stored under {key}?"}]


def warm_start(model, tokenizer, steps: int, seed: int = 0) -> None:
    """Supervised steps on whole conversations (the tool call, its response, the answer), so the
    tiny model emits calls TRL can parse; which key it queries stays a sampled choice."""
    import torch

    rng = random.Random(seed)
    env = KeyValueStore()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = []
        for _ in range(6):
            asked, queried = rng.choice(KEYS), rng.choice(KEYS)
            env.reset(seed=rng.randrange(10**6), key=asked)
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": queried}}}
            messages = question(asked) + [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "lookup", "content": env.store[queried]},
                {"role": "assistant", "content": f"It is {env.store[queried]}."},
            ]
            text = tokenizer.apply_chat_template(messages, tools=[env.lookup], tokenize=False)
            batch.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        width = max(map(len, batch))
        ids = torch.tensor([b + [tokenizer.pad_token_id] * (width - len(b)) for b in batch])
        labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warm-start-steps", type=int, default=120)
    parser.add_argument("--num-generations", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentic_tree_", ignore_cleanup_errors=True) as workdir:
        _train(args, workdir)


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset

    from trl_tree import TreeGRPOConfig, TreeGRPOTrainer
    from trl_tree.tiny import tiny_model
    from trl_tree.toy import save_quietly

    torch.manual_seed(0)
    tokenizer = tool_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=4096, initializer_range=0.05)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    warm_start(model, tokenizer, args.warm_start_steps)
    path = f"{workdir}/policy"
    save_quietly(model, tokenizer, path)

    rng = random.Random(1)
    rows = [{"prompt": question(k), "key": k, "seed": rng.randrange(10**6)} for k in KEYS * 16]
    config = TreeGRPOConfig(
        output_dir=f"{workdir}/out",
        tree_mode=args.mode,
        max_steps=args.steps,
        per_device_train_batch_size=2 * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=96,
        max_tool_calling_iterations=2,
        temperature=1.0,
        learning_rate=1e-4,  # small steps: larger ones unlearn the warm-started call format
        beta=0.0,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = TreeGRPOTrainer(model=path, args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, environment_factory=KeyValueStore)
    trainer.train()
    # what sharing only the prompt would give: each group's prompt once, every completion whole
    env = KeyValueStore()
    texts = [tokenizer.apply_chat_template(question(k), tools=[env.lookup], add_generation_prompt=True, tokenize=False)
             for k in KEYS]
    prompt = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts) / len(KEYS)
    rows, groups = config.per_device_train_batch_size, config.per_device_train_batch_size // args.num_generations
    for log in trainer.state.log_history:
        if "tree/dedup_ratio" in log:
            total = log["tree/total_tokens"]
            prompt_only = total / (total - (rows - groups) * prompt)
            print(f"step {log['step']}: T/U {log['tree/dedup_ratio']:.2f} (sharing only the prompt: {prompt_only:.2f}), "
                  f"tool calls {log.get('tools/call_frequency', float('nan')):.2f} per rollout, "
                  f"reward {log.get('reward', 0):.2f}")


if __name__ == "__main__":
    main()
