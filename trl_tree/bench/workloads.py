"""The benchmark suite's workloads (issue "GPU performance"): token sequences built in code.

Each workload is a list of sequences plus ``score_from`` (the first scored token: TRL scores the
completion, i.e. everything after the prompt). Token ids are random; only the sharing structure
and the lengths matter for speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.tiny import grpo_group


@dataclass
class Workload:
    name: str
    description: str
    sequences: list[list[int]]
    score_from: int
    #: the baseline accumulates one sequence per micro-batch: a padded batch of all of them would not
    #: fit (what a long-context user runs), and the suite times only that, packed and dfs
    per_sequence_baseline: bool = False
    #: time the per-sequence baseline on this many sequences and scale it to all of them (every
    #: sequence of the workload has the same length, so each costs the same): at 7B one 32k-token
    #: sequence takes seconds, all 64 of them minutes per timed step
    baseline_sample: int | None = None


def agentic_tree(vocab: int, system: int = 4800, turns=((60, 1), (60, 2), (150, 1), (200, 2), (60, 3)),
                 seed: int = 0, system_seed: int | None = None) -> list[list[int]]:
    """Trajectories sharing a system prompt; each turn (assistant message + tool call + tool
    result) of ``length`` tokens branches ``branch`` ways at the preceding tool call.

    The default gives 12 trajectories of 5,330 tokens, T = 63,960, U = 6,800, T/U = 9.41.
    ``system_seed``: draw the system prompt from its own seed, so that trees of different ``seed``
    (agents on different tasks) share the system prompt and nothing after it.
    """
    rng = np.random.default_rng(seed)
    system_rng = rng if system_seed is None else np.random.default_rng(system_seed)
    paths = [system_rng.integers(0, vocab, system).tolist()]
    for length, branch in turns:
        paths = [p + rng.integers(0, vocab, length).tolist() for p in paths for _ in range(branch)]
    return paths


#: W6: an 8k system prompt and five turns, each branching two ways at its tool call: 32 trajectories
#: of 13,800 tokens (T = 441,600, U = 54,800, T/U = 8.06)
LONG_AGENTIC_TURNS = ((2000, 2), (1500, 2), (1000, 2), (800, 2), (500, 2))


#: W7: 32k-token paths — an 8k system prompt and six turns, each branching two ways at its tool call:
#: 64 trajectories of 32,000 tokens (T = 2,048,000, U = 168,000, T/U = 12.2); the scale target of one
#: H200 at 7B
SCALE_SYSTEM = 8000
SCALE_TURNS = ((12000, 2), (6000, 2), (3000, 2), (1500, 2), (1000, 2), (500, 2))


def no_sharing(vocab: int, count: int = 16, length: int = 2048, seed: int = 0) -> list[list[int]]:
    """Distinct prompts, nothing shared (the first token differs too): T/U = 1."""
    rng = np.random.default_rng(seed)
    seqs = rng.integers(1, vocab, (count, length))
    seqs[:, 0] = np.arange(count) % (vocab - 1) + 1
    return seqs.tolist()


def ragged_no_sharing(vocab: int, shortest: int, longest: int = 2048, count: int = 16, seed: int = 0
                      ) -> list[list[int]]:
    """Distinct prompts, nothing shared, lengths spread evenly from ``shortest`` to ``longest``: the
    padded batch holds ``longest / mean length`` times the unique tokens — where the no-sharing
    rule (``cost_model.runs_padded``) chooses between stock's padded batch and the tree."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(shortest, longest, count).round().astype(int)
    seqs = [rng.integers(1, vocab, int(n)).tolist() for n in lengths]
    for i, s in enumerate(seqs):
        s[0] = i % (vocab - 1) + 1
    return seqs


#: the suite's workloads unless others are named (W7 is built only when asked for: 2M tokens)
DEFAULT_WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6")


def suite_workloads(vocab: int, names: tuple[str, ...] | set[str] = DEFAULT_WORKLOADS,
                    w7_scale: float = 1.0) -> list[Workload]:
    """The workloads named in ``names``, in suite order; only those are built. ``w7_scale``: W7's
    system prompt and turns that many times as long (the largest trees a mode trains,
    ``bench.dfs.largest_trees``)."""
    scaled_turns = tuple((round(n * w7_scale), b) for n, b in SCALE_TURNS)
    w7_system = round(SCALE_SYSTEM * w7_scale)
    builders = {
        "W1": lambda: Workload("W1", "GRPO G=16, prompt 2048, completion 512",
                               grpo_group(2048, 512, 16, vocab, seed=1), 2048),
        "W2": lambda: Workload("W2", "GRPO G=8, prompt 1024, completion 1024",
                               grpo_group(1024, 1024, 8, vocab, seed=2), 1024),
        "W3": lambda: Workload("W3", "GRPO G=8, prompt 256, completion 1024",
                               grpo_group(256, 1024, 8, vocab, seed=3), 256),
        "W4": lambda: Workload("W4", "agentic tree: 4.8k system prompt, 5 turns branching at tool calls, 12 leaves",
                               agentic_tree(vocab), 4800),
        "W5": lambda: Workload("W5", "no sharing: 16 sequences of 2048 tokens (prompt 1024)", no_sharing(vocab), 1024),
        # the no-sharing rule's neighbourhood: padded / unique tokens 1.02, 1.09 and 1.23
        "W8": lambda: Workload("W8", "no sharing, ragged: 16 sequences of 1984-2048 tokens (prompt 512)",
                               ragged_no_sharing(vocab, 1984), 512),
        "W9": lambda: Workload("W9", "no sharing, ragged: 16 sequences of 1700-2048 tokens (prompt 512)",
                               ragged_no_sharing(vocab, 1700), 512),
        "W10": lambda: Workload("W10", "no sharing, ragged: 16 sequences of 1280-2048 tokens (prompt 512)",
                                ragged_no_sharing(vocab, 1280), 512),
        # a small rollout batch with nothing shared: where the tree's fixed costs would show most
        "W11": lambda: Workload("W11", "no sharing: 8 rollouts of 1024 + 512 tokens",
                                no_sharing(vocab, count=8, length=1536), 1024),
        "W6": lambda: Workload("W6", "long agentic tree: 8k system prompt, 5 turns branching at tool calls, 32 leaves "
                               "of 13.8k tokens", agentic_tree(vocab, system=8000, turns=LONG_AGENTIC_TURNS, seed=6),
                               8000, per_sequence_baseline=True, baseline_sample=4),
        "W7": lambda: Workload("W7", f"{(w7_system + sum(n for n, _ in scaled_turns)) // 1000}k-token agentic paths: "
                               f"{w7_system // 1000}k system prompt, 6 turns branching at tool calls, 64 leaves",
                               agentic_tree(vocab, system=w7_system, turns=scaled_turns, seed=7), w7_system,
                               per_sequence_baseline=True, baseline_sample=2 if w7_scale <= 1 else 1),
    }
    unknown = set(names) - set(builders)
    if unknown:
        raise ValueError(f"unknown workloads {', '.join(sorted(unknown))}; choose from {', '.join(builders)}")
    return [build() for name, build in builders.items() if name in names]


# ---------------------------------------------------------------------- SFT data shapes
@dataclass
class SFTShape:
    """SFT samples as SFTTrainer's prepared rows: token ids and labels (-100 where no loss)."""

    name: str
    description: str
    input_ids: list[list[int]]
    labels: list[list[int]]
    #: samples per micro-batch, where a shape is a dataset trained over epochs (None: all, one micro-batch)
    batch_size: int | None = None

    @property
    def score_from(self) -> list[int]:
        """Each sample's first labelled token (what the FLOP limit scores from)."""
        return [next(i for i, x in enumerate(lab) if x != -100) for lab in self.labels]


def _per_turn(rng, vocab: int, conversations: int, turns: int, system: int, user: int, answer: int,
              reasoning: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """One sample per assistant turn with its whole history, the loss on that turn only (its
    reasoning and answer); ``reasoning``: each turn's reasoning is left out of later histories."""
    head = rng.integers(1, vocab, system).tolist()
    ids, labels = [], []
    for _ in range(conversations):
        history = list(head)
        for _ in range(turns):
            question = rng.integers(1, vocab, user).tolist()
            thought = rng.integers(1, vocab, reasoning).tolist()
            reply = rng.integers(1, vocab, answer).tolist()
            prompt = history + question
            ids.append(prompt + thought + reply)
            labels.append([-100] * len(prompt) + thought + reply)
            history = prompt + reply  # later turns see the answer, not the reasoning
    return ids, labels


def sft_shapes(vocab: int, names: tuple[str, ...] | None = None, seed: int = 0) -> list[SFTShape]:
    """The SFT data shapes of the issue: per-turn conversations (2 x 8 turns under a 1k system prompt,
    1 x 16 under 4k), best-of-n branches from one state, per-turn samples whose reasoning later
    turns drop, one long system prompt before independent samples, and a no-sharing control."""
    rng = np.random.default_rng(seed)

    def branches():
        state = rng.integers(1, vocab, 2048).tolist()
        outs = [rng.integers(1, vocab, 512).tolist() for _ in range(8)]
        return [state + o for o in outs], [[-100] * 2048 + o for o in outs]

    def system_prompt():
        head = rng.integers(1, vocab, 4096).tolist()
        rows = [(rng.integers(1, vocab, 256).tolist(), rng.integers(1, vocab, 512).tolist()) for _ in range(16)]
        return [head + q + a for q, a in rows], [[-100] * (4096 + 256) + a for q, a in rows]

    def none():
        ids = [rng.integers(1, vocab, int(n)).tolist() for n in np.linspace(1024, 2048, 16).round()]
        return ids, [[-100] * 256 + s[256:] for s in ids]

    def agent_epoch():  # conversations of 4-12 turns, user 32-256 and assistant 64-512 tokens, 1k system prompt
        head = rng.integers(1, vocab, 1024).tolist()
        ids, labels = [], []
        for _ in range(12):
            history = list(head)
            for _ in range(int(rng.integers(4, 13))):
                prompt = history + rng.integers(1, vocab, int(rng.integers(32, 257))).tolist()
                reply = rng.integers(1, vocab, int(rng.integers(64, 513))).tolist()
                ids.append(prompt + reply)
                labels.append([-100] * len(prompt) + reply)
                history = prompt + reply
        return ids, labels

    builders = {
        "turns_2x8": ("per-turn samples: 2 conversations x 8 turns (user 128, assistant 384), 1k system prompt",
                      lambda: _per_turn(rng, vocab, 2, 8, 1024, 128, 384)),
        "turns_1x16": ("per-turn samples: 1 conversation x 16 turns (user 128, assistant 384), 4k system prompt",
                       lambda: _per_turn(rng, vocab, 1, 16, 4096, 128, 384)),
        "branches": ("8 continuations of 512 tokens from one 2k-token state (best-of-n kept together)", branches),
        "reasoning": ("per-turn samples with reasoning later turns drop: 8 turns (user 128, reasoning 512, "
                      "answer 256), 1k system prompt", lambda: _per_turn(rng, vocab, 1, 8, 1024, 128, 256, 512)),
        "system": ("16 samples (user 256, answer 512) behind one 4k system prompt", system_prompt),
        "none": ("no sharing: 16 samples of 1024-2048 tokens (loss after 256)", none),
        "agent_epoch": ("a dataset, not one micro-batch: per-turn samples of 12 conversations of 4-12 turns (user "
                        "32-256, assistant 64-512 tokens), 1k system prompt, micro-batches of 8 with "
                        "tree_shuffle='groups', two epochs: where the first steps' time goes", agent_epoch),
    }
    chosen = [n for n in builders if n != "agent_epoch"] if names is None else list(names)  # the epoch: on request
    unknown = set(chosen) - set(builders)
    if unknown:
        raise ValueError(f"unknown SFT shapes {', '.join(sorted(unknown))}; choose from {', '.join(builders)}")
    return [SFTShape(name, builders[name][0], *builders[name][1](), batch_size=8 if name == "agent_epoch" else None)
            for name in chosen]


# ---------------------------------------------------------------------- DPO data shapes
def dpo_shapes(vocab: int, names: tuple[str, ...] | None = None, seed: int = 0) -> dict[str, tuple[str, list[dict]]]:
    """Preference micro-batches as token-id rows (``prompt_ids``/``chosen_ids``/``rejected_ids``, what
    DPOTrainer's collator takes): (a) 8 prompts of 2k tokens, one pair each, 256-token answers;
    (b) 2 prompts of 2k tokens, 4 pairs each; (c) 8 short prompts (256) with 512-token answers."""
    rng = np.random.default_rng(seed)

    def batch(prompts: int, pairs: int, prompt: int, answer: int) -> list[dict]:
        rows = []
        for _ in range(prompts):
            head = rng.integers(1, vocab, prompt).tolist()
            rows += [{"prompt_ids": head, "chosen_ids": rng.integers(1, vocab, answer).tolist(),
                      "rejected_ids": rng.integers(1, vocab, answer).tolist()} for _ in range(pairs)]
        return rows

    builders = {
        "one_pair": ("8 prompts of 2048 tokens, one pair each, answers of 256", lambda: batch(8, 1, 2048, 256)),
        "four_pairs": ("2 prompts of 2048 tokens, 4 pairs each, answers of 256", lambda: batch(2, 4, 2048, 256)),
        "short_prompt": ("8 prompts of 256 tokens, one pair each, answers of 512", lambda: batch(8, 1, 256, 512)),
        # a dataset, not one micro-batch: TRL's random order scatters a prompt's pairs over the epoch's
        # micro-batches of 8; tree_shuffle="groups" gathers them (bench/dpo.py, MICRO_BATCH)
        "four_pairs_dataset": ("8 prompts of 2048 tokens, 4 pairs each (32 pairs), answers of 256, micro-batches "
                               "of 8 pairs", lambda: batch(8, 4, 2048, 256)),
    }
    chosen = list(builders) if names is None else list(names)
    unknown = set(chosen) - set(builders)
    if unknown:
        raise ValueError(f"unknown DPO shapes {', '.join(sorted(unknown))}; choose from {', '.join(builders)}")
    return {name: (builders[name][0], builders[name][1]()) for name in chosen}


# ---------------------------------------------------------------------- async GRPO sample streams
@dataclass
class AsyncStream:
    """A recorded stream of scored rollout samples (``input_ids``, ``completion_mask``, ``group_id``,
    ``advantage``) and the ``token_budget`` the trainer runs it at; ``fit_budget``: a budget over its
    longest sample (what stock needs to drop none)."""

    name: str
    description: str
    samples: list[dict]
    token_budget: int
    fit_budget: int | None = None


def _agent_rollouts(rng, vocab: int, groups: int, system: int, turns: int, tool: int, answer: int,
                    forks: int = 1, fork_after: int = 0) -> list[dict]:
    """Per-turn samples of multi-turn agent rollouts: each group one system prompt, ``forks``
    trajectories (the later ones forking from the first after ``fork_after`` turns); every turn a
    tool output (not trained) and an answer (trained), one sample per turn holding its history, its
    own answer trained (the history's were trained by earlier samples)."""
    out = []
    for g in range(groups):
        head = rng.integers(2, vocab, system).tolist()
        first: list[list[int]] = []
        for f in range(forks):
            ids = list(head)
            for t in range(turns):
                if f and t < fork_after:
                    turn = first[t]
                else:
                    turn = rng.integers(2, vocab, tool + answer).tolist()
                if f == 0:
                    first.append(turn)
                ids = ids + turn
                if f and t < fork_after:
                    continue  # the shared turns are the first trajectory's samples
                mask = np.zeros(len(ids), np.int64)
                mask[len(ids) - answer:] = 1
                out.append({"input_ids": np.asarray(ids), "completion_mask": mask, "group_id": g,
                            "advantage": float(rng.normal())})
    return out


def async_streams(vocab: int, names: tuple[str, ...] | None = None, groups: int = 8,
                  seed: int = 0) -> list[AsyncStream]:
    """The async GRPO benchmark's streams: GRPO groups (16 rollouts of free length behind a 2k
    prompt), forking multi-turn agent rollouts (T/U about 9), and long agent rollouts whose later
    turns exceed the budget (stock drops them)."""
    rng = np.random.default_rng(seed)

    def grpo():
        out = []
        for g in range(groups):
            head = rng.integers(2, vocab, 2048).tolist()
            for _ in range(16):
                n = int(rng.integers(128, 513))
                mask = np.zeros(2048 + n, np.int64)
                mask[2048:] = 1
                out.append({"input_ids": np.asarray(head + rng.integers(2, vocab, n).tolist()), "completion_mask": mask,
                            "group_id": g, "advantage": float(rng.normal())})
        return out

    builders = {
        "grpo": ("GRPO groups: 16 rollouts of 128-512 tokens behind one 2048-token prompt", grpo, 10240, None),
        "agentic": ("agent rollouts, one sample per turn: 1k system prompt, 2 trajectories x 12 turns (tool 128 "
                    "untrained, answer 128), the second forking after turn 4",
                    lambda: _agent_rollouts(rng, vocab, groups, 1024, 12, 128, 128, forks=2, fork_after=4), 8192,
                    None),
        "agentic_long": ("long agent rollouts, one sample per turn: 2k system prompt, 28 turns (tool 256 untrained, "
                         "answer 256); turns past the 12th exceed the 8k budget",
                         lambda: _agent_rollouts(rng, vocab, groups, 2048, 28, 256, 256), 8192, 16384 + 512),
    }
    chosen = list(builders) if names is None else list(names)
    unknown = set(chosen) - set(builders)
    if unknown:
        raise ValueError(f"unknown async streams {', '.join(sorted(unknown))}; choose from {', '.join(builders)}")
    return [AsyncStream(name, builders[name][0], builders[name][1](), builders[name][2], builders[name][3])
            for name in chosen]
