"""Gradient checkpointing around a compiled decoder layer's forward, from outside its graph.

`models/policy.py` installs `CheckpointOutsideGraph` as the checkpointing function of every decoder layer
that is both compiled (`ppo.compile`) and checkpointed (`ppo.gradient_checkpointing`).

Run the tests: `PYTHONPATH=src pytest tests/models/test_policy.py -q -k checkpoint_outside`.
"""

from __future__ import annotations

import functools

import torch


class CheckpointOutsideGraph:
    """A compiled decoder layer's checkpointing function (transformers calls it with the layer's own forward
    and the layer's inputs) that checkpoints a compiled copy of that forward, from outside any graph.

    Compiled as transformers wraps it, a checkpointed layer puts the checkpoint inside the graph, and the
    partitioner then wraps the attention kernel (a seeded op, dropout 0 or not) in
    `graphsafe_run_with_rng_state` so that its recompute replays the forward's RNG state: torch 2.11 will
    not put a graph holding that operator in its FX graph cache (pytorch/pytorch#185562 marks it cacheable;
    torch 2.13 has that), so the update's graph was compiled cold by every run (85 s of a warm start at 0.5B
    on an H100). Here the call is a graph break (`torch._dynamo.disable`): dynamo compiles the layer's
    forward as a graph of its own with no recompute in it, the checkpoint runs eagerly around it (the same
    recompute in backward, the same memory), and the graph is cacheable on every torch. The forward is
    compiled with the options the layer was (`dynamic=True`), once for all layers of its class (`shared`).
    """

    def __init__(self, checkpoint, shared: dict) -> None:
        self.checkpoint, self.shared = checkpoint, shared

    @torch._dynamo.disable
    def __call__(self, function, *args):
        forward = function.func  # partial(forward, layer, **kwargs): the layer class's own forward
        compiled = self.shared.get(forward)
        if compiled is None:
            compiled = self.shared[forward] = torch.compile(forward, dynamic=True)
        return self.checkpoint(functools.partial(compiled, *function.args, **function.keywords), *args)
