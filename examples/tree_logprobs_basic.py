"""Log-probs and a GRPO-style backward over a prefix tree, checked against the untreed path.

    python examples/tree_logprobs_basic.py [--mode packed|dfs] [--chunk-size N]

Runs on CPU with a tiny Qwen2-shaped model built in code (nothing downloaded).
"""

import argparse

import torch

from trl_tree import PrefixForest, tree_backward, tree_logprobs
from trl_tree.engine.reference import untreed_backward, untreed_logprobs
from trl_tree.data.tiny import grpo_group, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="packed", choices=("packed", "dfs"))
    parser.add_argument("--chunk-size", type=int, default=None)
    args = parser.parse_args()

    model = tiny_model("qwen2", vocab_size=256, max_position_embeddings=512)
    prompt_len = 48
    seqs = grpo_group(prompt_len, 16, group_size=8, vocab_size=256)  # 8 completions of one prompt
    forest = PrefixForest.from_sequences(seqs)
    print(forest)

    advantages = torch.linspace(-1, 1, len(seqs))

    def grpo_token_loss(logps, seq_idx, pos):  # elementwise: what the walk needs
        return -logps * advantages[seq_idx] / (len(seqs) * 16)

    kw = {"mode": args.mode, "chunk_size": args.chunk_size}
    with torch.no_grad():
        tree = tree_logprobs(model, seqs, score_from=prompt_len, **kw)
        ref = untreed_logprobs(model, seqs, score_from=prompt_len)
    print("max |Δ log-prob| vs untreed:", max(float((a - b).abs().max()) for a, b in zip(tree, ref)))

    tree_backward(model, seqs, grpo_token_loss, score_from=prompt_len, **kw)
    tree_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    untreed_backward(model, seqs, grpo_token_loss, score_from=prompt_len)
    worst = max(float((g - p.grad).norm() / p.grad.norm()) for g, p in zip(tree_grads, model.parameters()))
    print("worst relative gradient error vs untreed:", worst)


if __name__ == "__main__":
    main()
