"""CI's share of ``tests/family_enumeration.py``: one family of each kind the engine meets — dense,
latent attention, chunked attention, each hybrid kernel (Kimi's delta attention, slow on a CPU, in
test_recurrent_mixers.py instead), a refused encoder and a refused attention-free model — exact in packed and dfs or refused at validation, never a crash or a wrong number. The whole
enumeration of transformers' causal-LM families is ``python tests/family_enumeration.py``."""

from __future__ import annotations

import json
import os

import pytest
from family_enumeration import BEGIN, END, check, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: family -> the verdict it must get
SHARE = {
    "llama": "exact", "qwen3_5_text": "exact", "qwen3_5_moe_text": "exact", "olmo_hybrid": "exact",
    "lfm3": "exact", "llama4_text": "exact", "glm4_moe": "exact", "gpt2": "exact",
    "bert": "refused", "mamba": "refused", "gemma4_unified_text": "refused", "openai-gpt": "refused",
    "doge": "refused",
}


@pytest.mark.parametrize("family", sorted(SHARE))
def test_a_family_is_exact_or_refused(family):
    row = check(family)
    assert row["verdict"] == SHARE[family], row


def test_the_models_page_lists_the_enumerations_verdicts():
    """docs/models.md's list of every family is the committed enumeration's, as generated."""
    with open(os.path.join(ROOT, "docs/benchmarks/families_cpu.json")) as f:
        expected = markdown(json.load(f))
    with open(os.path.join(ROOT, "docs/models.md")) as f:
        page = f.read()
    assert page[page.index(BEGIN): page.index(END) + len(END)] == expected, (
        "regenerate: python tests/family_enumeration.py --markdown docs/benchmarks/families_cpu.json")
