"""CI's share of the sharded-engine matrix (``tests/sharded_matrix.py``): under DDP, FSDP2 (gathered whole
and block by block), ZeRO-2 and
ZeRO-3 on two CPU processes, each trainer family in each tree mode, the window kinds spread over the
engines, on rollouts that give the ranks different numbers of trees, calls and walk units. A hang is a
failure in bounded time (the watchdog dumps every rank's stack). The whole matrix, 2 and 4 processes,
is ``python tests/sharded_matrix.py`` (docs/benchmarks/sharded_matrix_cpu.json)."""

from __future__ import annotations

import pytest
import sharded_matrix

pytestmark = pytest.mark.slow  # launches of several processes


@pytest.mark.parametrize("engine", sharded_matrix.ENGINES)
def test_every_trainer_family_and_mode_ends_under_each_engine(engine, tmp_path):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    results = sharded_matrix.run_engine(engine, 2, sharded_matrix.ci_combos(engine), str(tmp_path))
    bad = {combo: r for combo, r in results.items() if r["status"] not in ("ok", "refused")}
    assert not bad, "\n\n".join(f"{combo}: {r['status']}\n{r.get('message') or r.get('output', '')}"
                                for combo, r in bad.items())
    # a refusal is the engine's documented one, not a stray error; the families all train somewhere
    refused = {combo: r["message"] for combo, r in results.items() if r["status"] == "refused"}
    assert len(refused) < len(results), refused
