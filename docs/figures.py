"""Draw the Concepts page's figures from real forests (``python docs/figures.py``; needs matplotlib).

Each figure is computed by the library on a small example, so the pictures show what the code
does: the forest of a GRPO group and of an agentic tree, the packed layout's visibility rule, the
depth-first walk's K/V stack, and where the gradients of shared tokens meet.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from trl_tree import PrefixForest  # noqa: E402
from trl_tree.engine.dfs.plan import plan_walk  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "figures")
BLUE, ORANGE, GREY = "#3b7dd8", "#e8833a", "#bbbbbb"


def finish(fig, ax, xlabel: str, ylabel: str, title: str, name: str) -> None:
    """Label the axes, title the figure and write ``figures/<name>.png``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, size=10)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, f"{name}.png"), dpi=120)
    plt.close(fig)


def small_forest() -> PrefixForest:
    """Three trajectories: a shared prompt, two of them sharing a first turn."""
    prompt = [1, 2, 3, 4, 5, 6]
    return PrefixForest.from_sequences([prompt + [7, 8, 9, 10], prompt + [7, 8, 11, 12, 13], prompt + [14, 15, 16]])


def draw_forest() -> None:
    forest = small_forest()
    fig, ax = plt.subplots(figsize=(8, 2.8))
    for n in range(forest.num_nodes):
        start, depth, length = forest.node_start[n], forest.node_depth[n], forest.node_length[n]
        ax.barh(n, length, left=depth, color=BLUE if forest.node_num_children[n] else ORANGE, height=0.7)
        for k in range(length):
            ax.text(depth + k + 0.5, n, str(forest.tokens[start + k]), ha="center", va="center", color="white", size=8)
        parent = forest.node_parent[n]
        if parent >= 0:
            ax.plot([depth, depth], [parent, n], color=GREY, lw=1, zorder=0)
    ax.invert_yaxis()
    ax.set_yticks(range(forest.num_nodes), [f"node {n}" for n in range(forest.num_nodes)])
    ax.set_xlabel("depth = position id")
    ax.set_title(f"3 sequences, T = {forest.num_tokens} tokens, U = {forest.num_unique_tokens} unique "
                 f"(T/U = {forest.dedup_ratio:.2f})\nblue: shared nodes, orange: leaves", size=10)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "forest.png"), dpi=120)
    plt.close(fig)


def draw_visibility() -> None:
    forest = small_forest()
    u = forest.num_unique_tokens
    q = np.arange(u)[:, None]
    k = np.arange(u)[None, :]
    visible = (k <= q) & (q < forest.subtree_end[None, :])
    fig, ax = plt.subplots(figsize=(5, 4.6))
    ax.imshow(visible, cmap="Blues", interpolation="nearest")
    ax.set_xticks(range(u), [str(t) for t in forest.tokens], size=7)
    ax.set_yticks(range(u), [str(t) for t in forest.tokens], size=7)
    finish(fig, ax, "key (packed order, token id)", "query",
           "packed layout: key k visible to query q\niff k <= q < subtree_end[k]", "visibility")


def draw_walk() -> None:
    prompt = list(range(100, 160))
    turns = [[200 + i] * 25 for i in range(3)]
    seqs = [prompt + turns[a] + [300 + 10 * a + b] * (10 + 5 * b) for a in range(3) for b in range(3)]
    forest = PrefixForest.from_sequences(seqs)
    plan = plan_walk(forest, forest.scoring_plan(len(prompt)), chunk_size=16)
    depth = []
    for step in plan.steps:  # slots in use after the step: a pop frees its unit's own tokens
        unit = plan.units[step.unit]
        depth.append(unit.depth if step.op == "pop" else unit.depth + unit.num_tokens)
    fig, ax = plt.subplots(figsize=(8, 2.6))
    ax.step(range(len(depth)), depth, where="post", color=BLUE)
    finish(fig, ax, "step of the depth-first walk", "K/V stack (tokens)",
           f"{forest.num_sequences} trajectories, longest path {forest.max_depth} tokens: the stack never holds "
           "more than one path", "walk")


def draw_gradients() -> None:
    prompt = list(range(100, 140))
    seqs = [prompt + [200 + b] * (8 + 4 * b) for b in range(6)] + [prompt[:20] + [300] * 30]
    forest = PrefixForest.from_sequences(seqs)
    mult = forest.multiplicity
    fig, ax = plt.subplots(figsize=(8, 2.6))
    ax.bar(range(forest.num_unique_tokens), mult, color=[BLUE if m > 1 else ORANGE for m in mult], width=1.0)
    finish(fig, ax, "unique token (packed order)", "sequences through it",
           "a shared token is computed once; its gradient sums the terms of every sequence through it", "gradients")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    draw_forest()
    draw_visibility()
    draw_walk()
    draw_gradients()
    print("figures written to", OUT)


if __name__ == "__main__":
    main()
