"""Accumulation windows (``trl_tree.distributed.window``): the plan every rank computes alike, the cost of
a group from its lengths, the window-by-window micro-batch plan, and the construction checks on
batch sizes. The exchange between real processes and the update it gives are in
tests/test_distributed.py."""

from __future__ import annotations

import os
import random

import numpy as np

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trainer_harness import run, save_tiny_checkpoint

from trl_tree import PrefixForest, TreeGRPOConfig, TreeGRPOTrainer
from trl_tree.engine.cost_model import StepCost
from trl_tree.data.tiny import tiny_config
from trl_tree.distributed.exchange import RankExchange
from trl_tree.distributed.grouping import plan_windows
from trl_tree.engine.rows import PaddedRows
from trl_tree.distributed.window import TreeWindow, decode_payload, encode_payload, group_step_cost

CONFIG = tiny_config("qwen2")


class ViewOf(RankExchange):
    """Rank ``rank`` of ``world`` whose gather returns every rank's payload (the plan needs no other
    collective)."""

    def __init__(self, rank: int, payloads: list) -> None:  # no process group: a view, not a rank
        self.rank, self.world, self.payloads = rank, len(payloads), payloads

    def all_gather_ints(self, values):
        return self.payloads

    def all_gather_object(self, obj):  # the passes' dtype agreement: every view agrees with itself
        return [obj] * self.world


def rows_of(groups: list[tuple[list[int], list[list[int]]]]) -> PaddedRows:
    """A micro-batch of (prompt, completions) groups as the rows a trainer would hold."""
    seqs, score_from = [], []
    for prompt, completions in groups:
        for c in completions:
            seqs.append(torch.tensor(prompt + c))
            score_from.append(len(prompt))
    return PaddedRows.from_sequences(seqs, score_from)


def windows(layout: list[list[PaddedRows]]) -> list[TreeWindow]:
    """Every rank's view of one window; ``layout[rank][micro]`` its rows."""
    payloads = [encode_payload(micros, [64] * len(micros)) for micros in layout]
    return [TreeWindow(micros, [64] * len(micros), ViewOf(r, payloads), CONFIG, True, None, False, False)
            for r, micros in enumerate(layout)]


def test_group_cost_is_the_forest_cost_when_completions_share_only_the_prompt():
    prompt = list(range(100, 137))
    completions = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    forest = PrefixForest.from_sequences([prompt + c for c in completions])
    plan = forest.scoring_plan([len(prompt)] * 3)
    assert group_step_cost(len(prompt), [3, 5, 1]) == StepCost(forest.num_unique_tokens, plan.num_predictions,
                                                               forest.sum_visible_keys())


def test_every_rank_computes_one_plan_of_whole_trees():
    rng = random.Random(0)
    groups = [(list(range(10 * k, 10 * k + rng.randint(20, 200))), [[k] * rng.randint(5, 60) for _ in range(4)])
              for k in range(16)]
    # TRL's layout: 2 ranks x 2 micro-steps of 8 rows, groups in order, so none straddles...
    layout = [[rows_of(groups[8 * r + 4 * m : 8 * r + 4 * m + 4][:2]) for m in range(2)] for r in range(2)]
    # ...and one where every group straddles both ranks (2 completions each side)
    straddle = [[rows_of([(p, c[2 * r : 2 * r + 2]) for p, c in groups[8 * m : 8 * m + 8]]) for m in range(2)]
                for r in range(2)]
    for lay in (layout, straddle):
        views = windows(lay)
        assert views[0].owner == views[1].owner and views[0].units == views[1].units
        assert sorted(views[0].owned + views[1].owned) == list(range(len(views[0].rows)))
        prompts = {}
        for g, row in enumerate(views[0].rows):  # a prompt's rows all on one rank: no tree was cut
            prompts.setdefault(tuple(row.tokens[: row.score_from]), set()).add(views[0].owner[g])
        assert all(len(owners) == 1 for owners in prompts.values())
        assert views[0].imbalance <= 1.05
    straddled = windows(straddle)[0]
    assert straddled.pays and max(straddled.rank_costs) < max(straddled.stock_rank_costs)


def test_few_large_trees_are_cut_to_balance_the_ranks():
    prompt = list(range(300))
    groups = [([k] + prompt, [[k, j] * 10 for j in range(8)]) for k in range(3)]
    layout = [[rows_of(groups[:2])], [rows_of(groups[2:])]]
    window = windows(layout)[0]
    whole = max(sum(x) for x in ([2, 1],)) / 1.5  # three equal whole trees on two ranks: 1.33
    assert window.imbalance < whole and len(window.units) > 3  # a tree was cut in two


def test_fsdp2_placement_cuts_trees_until_every_rank_owns_one():
    """Four agentic tasks sharing one system prompt (one tree), each rank holding one task's rows:
    whole, or cut where that lowers the busiest rank's cost, the tree lands on two ranks (the halves
    tie, so a third cut lowers nothing). ``fill_ranks`` (FSDP2, which runs no window with an idle
    rank) cuts on until every rank owns a task."""
    system = list(range(100, 400))
    tasks = [(system, [[1000 + 10 * k] * 30 + [k, j] * 5 for j in range(4)]) for k in range(4)]
    layout = [[rows_of([task])] for task in tasks]
    payloads = [encode_payload(micros, [64] * len(micros)) for micros in layout]

    def view(fill: bool, rank: int = 0) -> TreeWindow:
        return TreeWindow(layout[rank], [64], ViewOf(rank, payloads), CONFIG, True, None, False, False,
                          fill_ranks=fill)

    assert view(False).idle_ranks == [2, 3] and view(False).imbalance == 2.0
    filled = [view(True, r) for r in range(4)]
    assert filled[0].idle_ranks == [] and filled[0].imbalance == pytest.approx(1.0)
    assert all(v.owner == filled[0].owner for v in filled)
    assert sorted(v.owned for v in filled) == sorted([g for g, row in enumerate(filled[0].rows) if row.rank == r]
                                                     for r in range(4))  # each rank owns one whole task


def test_one_process_window_owns_everything():
    rows = rows_of([([1, 2, 3], [[4, 5], [4, 6]]), ([7, 8], [[9]])])
    window = windows([[rows, rows]])[0]
    assert window.owned == list(range(6)) and window.home == window.owned and window.imbalance == 1.0
    _, groups = window.layout(torch.device("cpu"))
    assert len(groups) == 1 and sum(f.num_tokens for f in groups[0][1]) == 2 * sum(len(s) for s in rows.sequences)
    assert sum(f.num_unique_tokens for f in groups[0][1]) == 3 + 2 + 1 + 2 + 1  # both micro-steps in one forest


def test_window_plan_keeps_groups_whole_per_optimizer_step():
    groups = [list(range(4 * k, 4 * k + 4)) for k in range(6)]  # 24 rows, groups of 4
    plan = plan_windows(groups, steps_per_generation=6, accumulation=2, generator=torch.Generator().manual_seed(0))
    assert len(plan) == 6 and all(len(b) == 4 for b in plan)
    for w in range(3):  # each optimizer step (2 micro-steps of 4 rows) holds whole groups
        step = set(plan[2 * w]) | set(plan[2 * w + 1])
        assert all(set(g) <= step or not set(g) & step for g in groups)
    costs = plan_windows(groups, 6, 2, costs_of=lambda pieces: [len(p) * 10 for p in pieces],
                         generator=torch.Generator().manual_seed(0))
    assert sorted(i for b in costs for i in b) == list(range(24))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_batch_sizes_that_split_groups_between_optimizer_steps(checkpoint):
    """Refused under tree_window='accumulation'; under the default 'auto' the trainer takes trees per
    micro-step there, as stock trains it, and says so (TRL's own tests use such batch sizes)."""
    with pytest.raises(ValueError, match=r"2 x 1 rows .* num_generations=4.*gradient_accumulation_steps=2"):
        run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, per_device_train_batch_size=2, gradient_accumulation_steps=1,
            steps_per_generation=4, tree_window="accumulation")
    with pytest.raises(ValueError, match="steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"):
        run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            steps_per_generation=3, tree_window="accumulation")
    with pytest.warns(UserWarning, match="not a multiple of gradient_accumulation_steps=3.*trees per micro-step here"):
        _, _, trainer = run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, per_device_train_batch_size=4,
                            gradient_accumulation_steps=3, steps_per_generation=4, max_steps=1)
    assert not trainer._windows_on()
    # the warning keeps the fix the error names (the working batch sizes), not only the diagnosis
    with pytest.warns(UserWarning, match=r"Use gradient_accumulation_steps=2 .*or steps_per_generation=1 .*trees per "
                                         r"micro-step here"):
        run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, per_device_train_batch_size=2, gradient_accumulation_steps=1,
            steps_per_generation=4, max_steps=1)
    with pytest.warns(UserWarning, match="split between micro-steps"):
        run(TreeGRPOTrainer, TreeGRPOConfig, checkpoint, per_device_train_batch_size=2, tree_window="micro_step",
            max_steps=1)
    with pytest.raises(ValueError, match="tree_window must be one of"):
        TreeGRPOConfig(output_dir="/tmp/unused", tree_window="rank")


def test_accelerate_configs_are_valid_and_documented():
    """Every launcher config parses, names its strategy and process count, and the multi-GPU page
    says what the tree runs under it."""
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = os.path.join(root, "examples", "accelerate")
    with open(os.path.join(root, "docs", "multi_gpu.md")) as f:
        page = f.read()
    kinds = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            config = yaml.safe_load(f)
        assert config["num_processes"] >= 1 and config["distributed_type"], name
        assert f"examples/accelerate/{name}" in page, f"{name} is not on docs/multi_gpu.md"
        kinds[name] = (config["distributed_type"], config.get("fsdp_config", {}).get("fsdp_version"),
                       config.get("deepspeed_config", {}).get("zero_stage"))
    assert kinds["fsdp2.yaml"] == ("FSDP", 2, None)
    assert kinds["deepspeed_zero2.yaml"][2] == 2 and kinds["deepspeed_zero3.yaml"][2] == 3
    assert kinds["single_gpu.yaml"][0] == "NO" and kinds["multi_gpu.yaml"][0] == "MULTI_GPU"
    with open(os.path.join(folder, "multi_node.yaml")) as f:
        nodes = yaml.safe_load(f)
    assert kinds["multi_node.yaml"][0] == "MULTI_GPU" and nodes["num_machines"] > 1
    assert nodes["num_processes"] % nodes["num_machines"] == 0 and nodes["main_process_ip"]


def test_the_window_payload_reads_back_what_was_sent():
    """A rank's rows go to the others as one int64 array (two tensor collectives, no pickling): widths,
    per micro-step the rows' tokens and score offsets — an empty micro-batch included — read back
    as sent; a damaged array is an error, not a wrong plan."""
    micros = [rows_of([(list(range(5, 12)), [[1, 2], [3]])]), PaddedRows.from_sequences([], []),
              rows_of([([9] * 4, [[7, 7, 7]])])]
    values = encode_payload(micros, [40, 0, 12])
    got, widths = decode_payload(values)
    assert widths == [40, 0, 12]
    want = [[(s.numpy(), f) for s, f in zip(m.sequences, m.score_from)] for m in micros]
    assert [[(t.tolist(), f) for t, f in m] for m in got] == [[(t.tolist(), f) for t, f in m] for m in want]
    with pytest.raises(ValueError, match="not encode_payload's"):
        decode_payload(np.concatenate([values, [3]]))
