"""Run under ``torchrun --nproc_per_node 2`` (tests/test_fsdp.py does): the engine's own backward on
an FSDP2 (``fully_shard``) model over gloo, through ``trl_tree.fsdp``.

Each rank runs its own forest (packed in one call, packed cut into calls by a token budget, and
the depth-first walk in chunks — many forward/backward calls), accumulates two micro-steps, then
reduces once; the test compares the sharded gradients with the average of the two ranks'
gradients on an unsharded copy, and counts FSDP2's collectives: one all-gather per parameter group
per micro-step and one reduce-scatter per group per optimizer step, however many calls ran.
"""

import os
import sys

import torch
import torch.distributed as dist


def main(out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trl_tree import PrefixForest, tree_backward, tree_logprobs
    from trl_tree.fsdp import fsdp_modules, gathered, reduce_gradients, root_unsharded
    from trl_tree.tiny import tiny_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    reference = tiny_model().double()
    model = tiny_model().double()
    model.load_state_dict(reference.state_dict())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # as Accelerate's fsdp_reshard_after_forward
    groups = len(fsdp_modules(model))
    counts = {"all_gather": 0, "reduce_scatter": 0}
    # FSDP2's collectives (torch.distributed.fsdp._fully_shard._fsdp_collectives call them through
    # ``torch.distributed``); gloo has no reduce-scatter, where FSDP2 reduces with all_reduce
    for name, key in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter"),
                      ("all_reduce", "reduce_scatter")):
        original = getattr(dist, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    generator = torch.Generator().manual_seed(0)
    data = [[[torch.randint(2, 90, (int(n),), generator=generator).tolist() for n in torch.randint(4, 12, (4,),
              generator=generator)] for _ in range(2)] for _ in range(world)]  # [rank][micro-step] sequences
    for seqs in (s for r in data for s in r):
        for s in seqs[1:]:
            s[:3] = seqs[0][:3]  # a shared prefix: a tree, not a list
    results = {}
    for run, kwargs in (("packed", {"mode": "packed"}), ("dfs", {"mode": "dfs", "chunk_size": 3})):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        for key in counts:
            counts[key] = 0

        def token_loss(lp, seq_idx, pos, **_):
            return lp * (1.0 + 0.1 * seq_idx)

        for micro in range(2):
            with gathered(model):
                tree_backward(model, PrefixForest.from_sequences(data[rank][micro]), token_loss, score_from=2,
                              **kwargs)
        gathers = counts["all_gather"]
        reduce_gradients(model, torch.device("cpu"))
        for r in range(world):
            for micro in range(2):
                tree_backward(reference, PrefixForest.from_sequences(data[r][micro]), token_loss, score_from=2,
                              **kwargs)
        errors = {}
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            full = p.grad.full_tensor()
            expected = q.grad / world
            errors[name] = ((full - expected).norm() / expected.norm().clamp(min=1e-30)).item()
        results[run] = {"errors": errors, "gathers": gathers, "reduce_scatters": counts["reduce_scatter"],
                        "groups": groups, "sharded": type(model.lm_head.weight).__name__}
    # FSDP2's own backward through a packed tree call (the trainers' one-pass path): the root kept
    # unsharded from the forward to the LM head's scoring, FSDP2 reducing in its backward
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    with root_unsharded(model, reshard_after=False):
        logps = tree_logprobs(model, PrefixForest.from_sequences(data[rank][0]), score_from=2)
    torch.cat(logps).sum().backward()
    for r in range(world):
        torch.cat(tree_logprobs(reference, PrefixForest.from_sequences(data[r][0]), score_from=2)).sum().backward()
    errors = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        expected = q.grad / world
        errors[name] = ((p.grad.full_tensor() - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    results["one-pass"] = {"errors": errors, "sharded_after": type(model.lm_head.weight).__name__}
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit ("terminate called ..."); all is saved
