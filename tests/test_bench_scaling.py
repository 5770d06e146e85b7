"""``bench.scaling``: the model of the step past one machine reproduces the measurements it was
built from, and behaves as a network model must (more nodes or less bandwidth never faster, the
overlap never slower, trees cut where they are fewer than ranks)."""

from __future__ import annotations

import json

from trl_tree.bench.scaling import MEASURED_64_ROWS, Network, ScalingModel, all_reduce_ms, check, main


def test_the_model_reproduces_the_one_host_measurements():
    model = ScalingModel()
    for row in check(model):
        assert abs(row["tree_error"]) <= 0.05, row  # 1, 2, 4 GPUs within 5%
        # stock's step is modelled linear in its rows from one GPU; on the measuring host its two- and
        # four-GPU steps read 8-9% above that (efficiency 0.89-0.91), which the model leaves out
        assert abs(row["stock_error"]) <= 0.10, row
    assert model.fixed_ms > 0  # a step pays a part that does not shrink with its rows


def test_network_terms():
    g = 3 * 2**30
    assert all_reduce_ms(g, 1, Network()) == 0.0
    inside = all_reduce_ms(g, 8, Network())
    two, four = all_reduce_ms(g, 16, Network()), all_reduce_ms(g, 32, Network())
    assert inside < two < four  # crossing nodes adds the slower level
    assert all_reduce_ms(g, 16, Network(node_gbps=100)) > two
    model = ScalingModel()
    for gpus in (2, 16, 32):
        row = model.step(gpus, 16 * gpus)
        assert row["tree_ms"] <= row["tree_not_overlapped_ms"]
        assert row["efficiency_tree"] >= row["efficiency_tree_not_overlapped"]
    slow = ScalingModel(net=Network(node_gbps=25.0)).step(32, 512)
    assert slow["tree_not_overlapped_ms"] > model.step(32, 512)["tree_not_overlapped_ms"]


def test_fewer_trees_than_ranks_are_cut(tmp_path):
    model = ScalingModel()
    row = model.step(32, 128)  # 8 groups of 16 over 32 ranks: each cut in 4
    assert row["units"] == 32 and row["speedup_over_stock"] < model.step(8, 128)["speedup_over_stock"]
    out = tmp_path / "s.json"
    assert main(["--gpus", "1,16,32", "--check", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["gpus"] for r in results["predicted"]] == [1, 16, 32]
    assert [r["gpus"] for r in results["check"]] == sorted(MEASURED_64_ROWS)
