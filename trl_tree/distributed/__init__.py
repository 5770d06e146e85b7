"""How trees are placed on ranks and how gradients meet.

A tree must live on one rank and in one call: ``grouping.py`` keeps prompt groups on one rank,
``window.py`` runs an accumulation window's micro-steps as one forest and places whole trees on
ranks by their cost (``balance.py``), moving token ids and per-token tensors between ranks
(``exchange.py``); gradients are averaged in buckets that overlap the backward (``grad_sync.py``),
or, under FSDP2, gathered once and reduced once per optimizer step (``fsdp.py``), and under
DeepSpeed ZeRO kept local and reduced once per step, the ZeRO-3 model held whole (``deepspeed.py``).
"""
