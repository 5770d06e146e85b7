"""Every causal-LM family of the installed transformers through the tree: exact or refused, never a crash
and never a wrong number.

    python tests/family_enumeration.py [--families a,b,...] [--out docs/benchmarks/families_cpu.json]

Walks ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, builds a tiny fp32 model from each family's own config
(the common size fields shrunk to what the config knows; a family whose config cannot be made tiny
that way, or that is not a text decoder, is skipped with the reason) and runs the engine on a small
forest, packed and dfs, against the model's own per-sequence forward and backward. Verdicts:

- ``exact``: log-probs within 1e-5 and gradients within 1e-5 relative (fp32, the suite's rule), both modes;
- ``refused``: the engine raised a ``ValueError``/``TypeError`` naming why, before any number;
- ``differs``: a number outside the rule (a bug: the test fails);
- ``crash``: any other exception from the engine (a bug: the test fails);
- ``skipped``: the tiny model could not be built or run untreed (the family's own limits, recorded).

CI runs a subset (``tests/test_family_enumeration.py``); the whole enumeration is this command, and
its result is committed as ``docs/benchmarks/families_cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: the size fields shrunk wherever a config has them
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
    initializer_range=0.02, n_embd=32, n_layer=2, n_head=4, n_positions=256, d_model=32, n_layers=2, n_heads=4,
    num_layers=2, ffn_dim=64, d_ff=64, n_inner=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, top_k=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_head_dim=8, linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    decoder_start_token_id=0, sliding_window=None, use_cache=False,
)
FOREST = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10], [3, 4, 11, 12, 13, 14, 15], [20, 21, 22], [20, 21, 23, 24]]
RULE = 1e-5
MAX_PARAMETERS = 5_000_000


def _fields(config_class) -> set[str]:
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    return set(inspect.signature(config_class.__init__).parameters)


def tiny_model(model_type: str):
    """A tiny fp32 model of ``model_type`` (or raise with why it cannot be built)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = {k: v for k, v in TINY.items() if k in _fields(config_class)}
    for _ in range(len(fields) + 1):  # a field the config's own validation refuses goes back to its default
        try:
            config = config_class(**fields)
            break
        except Exception as e:  # noqa: BLE001
            named = [k for k in fields if k in str(e)]
            if not named:
                raise
            fields.pop(named[0])
    for name in ("layer_types", "mlp_layer_types"):  # per-layer lists sized for the default depth
        value = getattr(config, name, None)
        if isinstance(value, list) and len(value) > config.get_text_config().num_hidden_layers:
            setattr(config, name, value[: config.get_text_config().num_hidden_layers])
    for name in ("vision_config", "audio_config", "speech_config", "encoder_config"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"not a text decoder ({name}): its text family is enumerated on its own")
    with torch.device("meta"):  # the size first: a config whose size fields this table misses stays large
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"not tiny from the common size fields ({size / 1e6:.0f}M parameters)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def check(model_type: str) -> dict:
    """One family's verdict (see the module docstring)."""
    from trl_tree import tree_backward, tree_logprobs
    from trl_tree.engine.reference import untreed_backward, untreed_logprobs

    def loss(lp, seq, pos):
        return -(lp * ((seq * 7 + pos * 13) % 5 - 2).to(lp.dtype) / 2)

    def grads(model):
        return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}

    from trl_tree.engine.model_parts import model_parts

    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(model_type)
    except Exception as e:  # noqa: BLE001 - the family's own limits: recorded, not the tree's verdict
        return {"verdict": "skipped", "why": f"{type(e).__name__}: {e}"[:300]}
    try:
        model_parts(model)  # what the engine refuses at validation (a trainer's construction)
    except (ValueError, TypeError) as e:
        return {"class": type(model).__name__, "verdict": "refused", "why": str(e)[:300]}
    except Exception as e:  # noqa: BLE001
        return {"class": type(model).__name__, "verdict": "crash", "why": f"{type(e).__name__}: {e}"[:300],
                "where": traceback.format_exc().splitlines()[-3][:200]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = untreed_logprobs(model, FOREST)
            model.zero_grad(set_to_none=True)
            untreed_backward(model, FOREST, loss)
            ref_grads = grads(model)
    except Exception as e:  # noqa: BLE001 - the family's own limits: recorded, not the tree's verdict
        return {"verdict": "skipped", "why": f"{type(e).__name__}: {e}"[:300]}
    row = {"class": type(model).__name__, "modes": {}}
    for mode in ("packed", "dfs"):
        kwargs = {"mode": mode} | ({"chunk_size": 3} if mode == "dfs" else {})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = tree_logprobs(model, FOREST, **kwargs)
                model.zero_grad(set_to_none=True)
                tree_backward(model, FOREST, loss, **kwargs)
        except (ValueError, TypeError) as e:
            row["modes"][mode] = {"verdict": "refused", "why": str(e)[:300]}
            continue
        except Exception as e:  # noqa: BLE001
            row["modes"][mode] = {"verdict": "crash", "why": f"{type(e).__name__}: {e}"[:300],
                                  "where": traceback.format_exc().splitlines()[-3][:200]}
            continue
        logp = max(float((a.detach().double() - b.double()).abs().max()) for a, b in zip(got, ref))
        g = grads(model)
        num = sum(float((g[n] - r).pow(2).sum()) for n, r in ref_grads.items() if n in g)
        den = sum(float(r.pow(2).sum()) for r in ref_grads.values()) or 1.0
        grad = (num / den) ** 0.5
        ok = logp <= RULE and grad <= RULE and set(g) == set(ref_grads)
        row["modes"][mode] = {"verdict": "exact" if ok else "differs", "logp_max_abs": logp, "grad_rel": grad}
    verdicts = {m["verdict"] for m in row["modes"].values()}
    row["verdict"] = ("crash" if "crash" in verdicts else "differs" if "differs" in verdicts
                      else "exact" if verdicts == {"exact"} else "refused")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


#: the section of docs/models.md that lists every family's verdict (generated: ``--markdown``)
BEGIN, END = "<!-- families: generated by tests/family_enumeration.py --markdown -->", "<!-- /families -->"


def _why(row: dict) -> str:
    return row.get("why") or "; ".join(m["why"] for m in row.get("modes", {}).values() if m.get("why"))


def markdown(result: dict) -> str:
    """docs/models.md's list of every family's verdict, from an enumeration's JSON."""
    rows = result["families"]
    lines = [BEGIN, f"Enumerated with transformers {result['transformers']} ({len(rows)} causal-LM families; "
             f"{', '.join(f'{n} {v}' for v, n in sorted(result['counts'].items()))}):", ""]
    exact = sorted(k for k, r in rows.items() if r["verdict"] == "exact")
    lines += [f"- **exact** in packed and dfs ({len(exact)}): {', '.join(f'`{k}`' for k in exact)}", ""]
    lines += ["| refused family | why (the engine's own words, cut) |", "| --- | --- |"]
    lines += [f"| `{k}` | {_why(r)[:160].replace('|', '/')} |" for k, r in sorted(rows.items())
              if r["verdict"] == "refused"]
    skipped = sorted(k for k, r in rows.items() if r["verdict"] == "skipped")
    lines += ["", f"Skipped ({len(skipped)}: a config the common size fields do not make tiny, or not a text "
              f"decoder; their JSON rows say which): {', '.join(f'`{k}`' for k in skipped)}", END]
    return "\n".join(lines)


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=None, help="comma-separated model types (default: every one)")
    parser.add_argument("--out", default=None, help="write the verdicts as JSON here")
    parser.add_argument("--markdown", default=None, metavar="JSON",
                        help="print docs/models.md's section from this enumeration's JSON (runs nothing)")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    import transformers

    chosen = args.families.split(",") if args.families else families()
    rows = {}
    for name in chosen:
        rows[name] = check(name)
        why = rows[name].get("why") or "; ".join(m.get("why", "") for m in rows[name].get("modes", {}).values())
        print(f"{name:32} {rows[name]['verdict']:8} {why[:110]}", flush=True)
    counts = {}
    for row in rows.values():
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    print(counts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"what": __doc__.split("\n")[0], "command": "python tests/family_enumeration.py --out " + args.out,
                       "transformers": transformers.__version__, "torch": torch.__version__, "counts": counts,
                       "families": rows}, f, indent=1)
    return 0 if not counts.get("crash") and not counts.get("differs") else 1


if __name__ == "__main__":
    raise SystemExit(main())
