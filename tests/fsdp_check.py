"""Run under ``torchrun --nproc_per_node 2`` (tests/test_fsdp.py does): the engine's own backward on
an FSDP2 (``fully_shard``) model over gloo, through ``trl_tree.distributed.fsdp``, under the mixed-precision
policies Accelerate sets.

Each rank runs its own forest (packed in one call, packed cut into calls by a token budget, and
the depth-first walk in chunks — many forward/backward calls), accumulates two micro-steps, then
reduces once; the test compares the sharded gradients with the average of the two ranks'
gradients on an unsharded copy, and counts FSDP2's collectives: one all-gather per parameter group
per micro-step and one reduce-scatter per group per optimizer step, however many calls ran.

Policies (``POLICIES``): none (float64 throughout); float32 parameters over float64 storage with a
float64 reduction and forward-input casting (every mechanism of a mixed-precision policy, checked
at fp32 tolerances); Accelerate's ``mixed_precision: bf16`` (bf16 parameters, fp32 reduction,
inputs cast) and the same with input casting off, checked by the bf16 rule against the untreed
per-sequence forward under the same policy. Forward-input casting rebuilds every dataclass it
meets in a call's arguments — the tree's metadata among them — which is what broke the trainers
under Accelerate's FSDP2.
"""

import os
import sys

import torch
import torch.distributed as dist

#: decoder layers of the tiny model: enough that one block's bytes are a small part of the whole
LAYERS = 4
#: name -> (storage dtype, MixedPrecisionPolicy kwargs or None)
POLICIES = {
    "none": (torch.float64, None),
    "fp32-params": (torch.float64, {"param_dtype": torch.float32, "reduce_dtype": torch.float64}),
    "bf16": (torch.float32, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}),
    "bf16-no-cast": (torch.float32, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                                     "cast_forward_inputs": False}),
}


def _token_loss(lp, seq_idx, pos, **_):
    return lp * (1.0 + 0.1 * seq_idx)


def _untreed_backward(model, seqs, score_from: int) -> None:
    """The per-sequence reference: each sequence through the model's own forward, the same loss."""
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0][score_from - 1:]
        _token_loss(lp, torch.full_like(lp, i), None).sum().backward()


def _errors(model, expected: dict) -> dict:
    return {name: ((p.grad.full_tensor().double() - expected[name]).norm()
                   / expected[name].norm().clamp(min=1e-30)).item() for name, p in model.named_parameters()}


def _sharded(policy, mesh, state):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trl_tree.data.tiny import tiny_model

    dtype, mp = POLICIES[policy]
    model = tiny_model(num_hidden_layers=LAYERS).to(dtype)
    model.load_state_dict(state)
    kwargs = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(**mp)}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, **kwargs)  # as Accelerate's fsdp_reshard_after_forward
    return model


#: the policies the block-by-block runs take (float64 and Accelerate's bf16)
BLOCK_POLICIES = ("none", "bf16")


def _block_runs(policy, model, data, rank, expected, counts) -> dict:
    """Gathered block by block (``fsdp.block_held``, the ranks' calls lined up by ``CallLockstep``) on
    calls that differ between the ranks: packed in one call, packed cut into ``rank + 1`` calls, and
    the walk in chunks (each rank's forests make their own number of units). Per run: the gradient
    errors, the all-gathers, the stand-in calls, and the peak of unsharded decoder-layer parameter
    bytes, read at every all-gather FSDP2 issues (the block being gathered counted in), against one
    block's bytes."""
    from trl_tree import PrefixForest, tree_backward
    from trl_tree.distributed import fsdp
    from trl_tree.distributed.lockstep import CallLockstep

    blocks = [m for m in fsdp.fsdp_modules(model) if id(m) in fsdp.layer_units(model)]

    def block_bytes(m) -> int:
        return fsdp.whole_bytes(m) if fsdp._unsharded(m) else 0

    one_block = max(fsdp.whole_bytes(m) for m in blocks)  # in the dtype the blocks compute in
    peak = [0]
    # FSDP2's all-gather (``all_gather_single`` in newer torch, ``all_gather_into_tensor`` before), output first
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor")
                 if hasattr(dist, name)}

    def watching(gather):
        def watched(*args, **kwargs):
            held = sum(block_bytes(m) for m in blocks)
            peak[0] = max(peak[0], held + args[0].numel() * args[0].element_size())  # the block being gathered
            return gather(*args, **kwargs)
        return watched

    for name, gather in originals.items():
        setattr(dist, name, watching(gather))
    out = {}
    try:
        for run, mode, calls in (("block-packed", "packed", 1), ("block-budget", "packed", rank + 1),
                                 ("block-dfs", "dfs", 1)):
            model.zero_grad(set_to_none=True)
            counts["all_gather"] = 0
            peak[0] = 0
            lockstep = CallLockstep(torch.device("cpu"))
            for micro in range(2):
                seqs = data[rank][micro]
                step = -(-len(seqs) // calls)
                with fsdp.block_held(model, lockstep):
                    for start in range(0, len(seqs), step):
                        def token_loss(lp, seq_idx, pos, _start=start, **_):
                            return _token_loss(lp, seq_idx + _start, pos)

                        tree_backward(model, PrefixForest.from_sequences(seqs[start:start + step]), token_loss,
                                      score_from=2, mode=mode, chunk_size=3 if mode == "dfs" else None)
            fsdp.reduce_gradients(model, torch.device("cpu"))
            out[(policy, run)] = {"errors": _errors(model, expected), "gathers": counts["all_gather"],
                                  "standins": lockstep.standins, "slots": lockstep.slots, "peak_bytes": peak[0],
                                  "block_bytes": one_block, "blocks": len(blocks), "groups": len(blocks) + 1,
                                  "sharded": type(model.lm_head.weight).__name__}
    finally:
        for name, gather in originals.items():
            setattr(dist, name, gather)
    return out


def main(out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from trl_tree import PrefixForest, tree_backward, tree_logprobs
    from trl_tree.distributed import fsdp
    from trl_tree.distributed.fsdp import fsdp_modules, gathered, reduce_gradients, root_unsharded
    from trl_tree.data.tiny import tiny_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = tiny_model(num_hidden_layers=LAYERS).double()
    counts = {"all_gather": 0, "reduce_scatter": 0}
    # FSDP2's collectives (torch.distributed.fsdp._fully_shard._fsdp_collectives call them through
    # ``torch.distributed``; the names differ between torch releases: the *_single ones are newer); gloo has no
    # reduce-scatter, where FSDP2 reduces with all_reduce
    for name, key in (("all_gather_single", "all_gather"), ("all_gather_into_tensor", "all_gather"),
                      ("reduce_scatter_single", "reduce_scatter"), ("reduce_scatter_tensor", "reduce_scatter"),
                      ("all_reduce", "reduce_scatter")):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    generator = torch.Generator().manual_seed(0)
    data = [[[torch.randint(2, 90, (int(n),), generator=generator).tolist() for n in torch.randint(8, 16, (4,),
              generator=generator)] for _ in range(2)] for _ in range(world)]  # [rank][micro-step] sequences
    for seqs in (s for r in data for s in r):
        for s in seqs[1:]:
            s[:5] = seqs[0][:5]  # a shared prefix: a tree, not a list
    # the fp64 reference gradients: the average over ranks of both micro-steps, and of micro-step 0 alone
    expected = {}
    for key, micros in (("two", (0, 1)), ("one", (0,))):
        reference.zero_grad(set_to_none=True)
        for r in range(world):
            for micro in micros:
                tree_backward(reference, PrefixForest.from_sequences(data[r][micro]), _token_loss, score_from=2)
        expected[key] = {n: q.grad / world for n, q in reference.named_parameters()}
    results = {}
    for policy in POLICIES:
        model = _sharded(policy, mesh, reference.state_dict())
        groups = len(fsdp_modules(model))
        # (run, mode, calls per micro-step, reduce while gathered): a token budget cuts a micro-batch's rows
        # into calls, as the trainers do; the trainers reduce inside the step's last gathered block
        runs = (("packed", "packed", 1, False), ("budget", "packed", 2, False), ("dfs", "dfs", 1, False),
                ("packed-reduced-gathered", "packed", 1, True), ("dfs-reduced-gathered", "dfs", 1, True),
                ("packed-reduced-by-backward", "packed", 1, False))
        for run, mode, calls, inside in runs:
            # the reduction's fallback where torch's FSDP2 lacks the steps it runs directly: a one-token backward
            fsdp._REDUCE_WITHOUT_BACKWARD = not run.endswith("by-backward")
            model.zero_grad(set_to_none=True)
            for key in counts:
                counts[key] = 0
            gathers = None
            for micro in range(2):
                seqs = data[rank][micro]
                step = -(-len(seqs) // calls)
                with gathered(model):
                    for start in range(0, len(seqs), step):
                        def token_loss(lp, seq_idx, pos, _start=start, **_):
                            return _token_loss(lp, seq_idx + _start, pos)

                        tree_backward(model, PrefixForest.from_sequences(seqs[start:start + step]), token_loss,
                                      score_from=2, mode=mode, chunk_size=3 if mode == "dfs" else None)
                    if inside and micro == 1:
                        gathers = counts["all_gather"]
                        reduce_gradients(model, torch.device("cpu"))
            if not inside:
                gathers = counts["all_gather"]
                reduce_gradients(model, torch.device("cpu"))
            results[(policy, run)] = {"errors": _errors(model, expected["two"]), "gathers": gathers,
                                      "reduce_gathers": counts["all_gather"] - gathers,
                                      "reduce_scatters": counts["reduce_scatter"], "groups": groups,
                                      "sharded": type(model.lm_head.weight).__name__}
        fsdp._REDUCE_WITHOUT_BACKWARD = True  # the library's way again for what follows
        if policy in BLOCK_POLICIES:
            results.update(_block_runs(policy, model, data, rank, expected["two"], counts))
        # FSDP2's own backward through a packed tree call (the trainers' one-pass path): the root kept
        # unsharded from the forward to the LM head's scoring, FSDP2 reducing in its backward
        model.zero_grad(set_to_none=True)
        with root_unsharded(model, reshard_after=False):
            logps = tree_logprobs(model, PrefixForest.from_sequences(data[rank][0]), score_from=2)
        sum(_token_loss(lp, torch.full_like(lp, i), None).sum() for i, lp in enumerate(logps)).backward()
        results[(policy, "one-pass")] = {"errors": _errors(model, expected["one"]),
                                         "sharded_after": type(model.lm_head.weight).__name__}
        # the untreed per-sequence forward under the same policy, FSDP2's own backward: what the bf16 rule
        # measures against, over both micro-steps and over the first alone
        for key, micros in (("two", (0, 1)), ("one", (0,))):
            model.zero_grad(set_to_none=True)
            for micro in micros:
                _untreed_backward(model, data[rank][micro], score_from=2)
            results[(policy, f"untreed-{key}")] = {"errors": _errors(model, expected[key])}
        del model
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit ("terminate called ..."); all is saved
