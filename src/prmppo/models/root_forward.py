"""A scoring pass run as the forward of an FSDP2 root module.

The policy's and the PRM's scoring passes call the decoder and the LM head directly, not the root
model's forward, so on a sharded model the root unit's hooks would never run: its own parameters
(the embeddings, the final norm, the LM head) would stay sharded, and in backward their gradients
would never be reduce-scattered. `as_root_forward` runs such a pass inside the root's forward.
Sharding itself is `distributed/shard.py`'s; this sits beside the models so that their scoring
can run on a sharded root without knowing who sharded it.
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from prmppo.errors import PrmppoError


def as_root_forward(root: nn.Module, run: Callable):
    """`run()` (a pass that calls `root`'s decoder and LM head itself) as the forward of the FSDP2 root
    `root`, so that the root's pre-forward all-gather and its backward hooks run around it."""
    if not isinstance(root, FSDPModule):
        raise PrmppoError(f"as_root_forward needs an FSDP2-sharded root module, got {type(root).__name__}")
    # an instance attribute: nn.Module.__call__ runs it inside the root's hooks. It takes one dummy
    # argument: on an accelerator FSDP2's root pre-forward moves the call's inputs to the device and,
    # in some torch releases, fails on a call with no inputs at all
    root.forward = lambda _unused: run()
    try:
        return root(None)
    finally:
        del root.forward
