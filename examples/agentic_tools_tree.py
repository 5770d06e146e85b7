"""Multi-turn GRPO with tools through TRL's ``environment_factory``, trained over prefix trees.

    python examples/agentic_tools_tree.py                 # tiny built-in model, CPU or GPU, ~2 minutes on a CPU
    python examples/agentic_tools_tree.py --mode dfs --steps 6

The environment is a small key-value store the model queries with a ``lookup`` tool; it owns the
reward (``get_reward``: did the model look up the key that holds the code the user asks for). Each rollout is a
conversation: the system prompt with the tool's schema, the user's question, the model's tool
call, the tool's response, the model's answer. The completions of a GRPO group share the prompt,
and those that call the tool with the same key share the call and its response too: the forest
branches at the tool calls, and ``tree/dedup_ratio`` (T/U, logged every step) is above what the
shared prompt alone gives.

Nothing is downloaded. The policy is a tiny Qwen2-shaped model over a word-level tokenizer built
in memory with Qwen2.5's chat template (which TRL knows how to parse tool calls from); a short
supervised warm-up over the tree teaches it the tool-call format with keys drawn at random (a
random model would never emit a parseable call); GRPO then learns which key holds the code. It prints the reward's mean over the first and the last
quarter of the logged steps.
"""

from __future__ import annotations

import argparse
import random
import re
import string
import tempfile

KEYS = ("alpha", "beta", "gamma", "delta")
#: where the store keeps the code the user asks for: what GRPO has to find out
CODE_KEY = "gamma"


class KeyValueStore:
    """The environment TRL builds once per rollout (``environment_factory=KeyValueStore``): its public
    methods are the model's tools, ``reset`` starts an episode, ``get_reward`` scores it."""

    def __init__(self) -> None:
        self.store: dict[str, str] = {}
        self.found = False

    def reset(self, seed: int = 0, **_) -> None:
        rng = random.Random(seed)
        self.store = {k: "".join(rng.choice("0123456789") for _ in range(3)) for k in KEYS}
        self.found = False

    def lookup(self, key: str) -> str:
        """Read a value from the store.

        Args:
            key: The key to look up.

        Returns:
            The value stored under the key.
        """
        if key not in self.store:
            raise KeyError(f"no key {key!r}; keys: {', '.join(KEYS)}")
        self.found = self.found or key == CODE_KEY
        return self.store[key]

    def get_reward(self) -> float:
        """1 when the model looked up the key that holds the code, 0 otherwise."""
        return float(self.found)


def tool_tokenizer():
    """A word-level tokenizer with Qwen2.5's special tokens and chat template, built in memory: the
    words of the rendered conversations (the tool schema, the call's JSON, the questions) are one
    token each, digits and other characters one token each — so the tiny model learns the call
    format in a short warm-up and its steps stay short."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                "</tool_response>"]
    split = Regex(r"[A-Za-z_]+| +|[^A-Za-z_ ]")

    def build(vocab: dict[str, int]):
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split(split, behavior="isolated")
        tok.decoder = decoders.Fuse()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                            additional_special_tokens=specials[1:])
        tokenizer.chat_template = qwen2_5_chat_template
        return add_response_schema(tokenizer)

    vocab = {token: i for i, token in enumerate(specials)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    chars = build(vocab)  # renders the conversations whose words become tokens
    env = KeyValueStore()
    env.reset()
    for key in KEYS:
        text = chars.apply_chat_template(conversation(key, env), tools=[env.lookup], tokenize=False)
        for word in re.findall(r"[A-Za-z_]+| +", text):
            vocab.setdefault(word, len(vocab))
    return build(vocab)


def conversation(queried: str, env: KeyValueStore) -> list[dict]:
    """A whole rollout: the question, the model's call for ``queried``, the tool's answer, the reply."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": queried}}}
    return question() + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": env.store[queried]},
        {"role": "assistant", "content": f"It is {env.store[queried]}."},
    ]


def question() -> list[dict]:
    return [{"role": "user", "content": "What is the code?"}]


def warm_start(model, tokenizer, steps: int, rows: int = 16, seed: int = 0) -> None:
    """Supervised steps on whole conversations (the tool call, its response, the answer), so the
    tiny model emits calls TRL can parse. Each call queries a key drawn at random: the policy learns
    the format, not where the code is — that is what GRPO's reward (the code's key looked up) teaches.

    The loss is on what follows the prompt, and it runs over the tree (``tree_backward``): the
    rows share the system prompt with the tool's schema, computed once per step."""
    import torch

    from trl_tree import tree_backward

    rng = random.Random(seed)
    env = KeyValueStore()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        seqs, starts = [], []
        for _ in range(rows):
            env.reset(seed=rng.randrange(10**6))
            text = tokenizer.apply_chat_template(conversation(rng.choice(KEYS), env), tools=[env.lookup],
                                                 tokenize=False)
            prompt = tokenizer.apply_chat_template(question(), tools=[env.lookup], tokenize=False,
                                                   add_generation_prompt=True)
            seqs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            starts.append(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
        scored = sum(len(s) - start for s, start in zip(seqs, starts))
        tree_backward(model, seqs, lambda logps, seq, pos: -logps / scored, score_from=starts)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs", "off"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warm-start-steps", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--output-dir", default=None, help="save the trained model (or adapter) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentic_tree_", ignore_cleanup_errors=True) as workdir:
        _train(args, workdir)


def _train(args, workdir: str) -> None:
    # imported after the arguments are parsed, so that --help answers at once
    import torch
    from datasets import Dataset

    from trl_tree import TreeGRPOConfig, TreeGRPOTrainer
    from trl_tree.data.tiny import tiny_model
    from trl_tree.data.toy import learning_line, save_quietly

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
    rows = [{"prompt": question(), "seed": rng.randrange(10**6)} for _ in range(64)]
    config = TreeGRPOConfig(
        output_dir=args.output_dir or f"{workdir}/out",
        tree_mode=args.mode,
        max_steps=args.steps,
        per_device_train_batch_size=2 * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=64,
        max_tool_calling_iterations=2,
        temperature=1.0,
        learning_rate=args.learning_rate,  # small steps: larger ones unlearn the warm-started call format
        beta=0.0,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = TreeGRPOTrainer(model=path, args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, environment_factory=KeyValueStore)
    trainer.train()
    if args.output_dir:  # the trained weights (an adapter under PEFT), with the tokenizer
        trainer.save_model(args.output_dir)
    # what sharing only the prompt would give: each group's prompt once, every completion whole
    env = KeyValueStore()
    text = tokenizer.apply_chat_template(question(), tools=[env.lookup], add_generation_prompt=True, tokenize=False)
    prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    rows, groups = config.per_device_train_batch_size, config.per_device_train_batch_size // args.num_generations
    rewards = []
    for log in trainer.state.log_history:
        if "tree/dedup_ratio" in log:
            rewards.append(log.get("reward", 0.0))
            total = log["tree/total_tokens"]
            prompt_only = total / (total - (rows - groups) * prompt)
            print(f"step {log['step']}: T/U {log['tree/dedup_ratio']:.2f} (sharing only the prompt: {prompt_only:.2f}), "
                  f"tool calls {log.get('tools/call_frequency', float('nan')):.2f} per rollout, "
                  f"reward {log.get('reward', 0):.2f}")
    print(learning_line(rewards))
    # every rank closes the process group before the interpreter exits (Accelerate's end of a script):
    # torch 2.15's gloo threads can abort an exit that leaves it open
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
