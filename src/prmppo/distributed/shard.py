"""FSDP2 sharding of the policy, and the full weights gathered to rank 0 for everything written as files.

`shard_policy`: `fully_shard` on every decoder block and then at the root of the policy's model
(the peft model for `lora=adapter`: the LoRA factors, a PRM adapter and `modules_to_save` are
sharded with the blocks they sit in) and of the frozen reference (`lora=none`). The sharded
weights are fp32 (they are the master weights: the stage loads them in fp32 under several ranks);
forward and backward compute in `model.dtype` (bf16 on a GPU) and gradients are reduced in fp32
(`MixedPrecisionPolicy`); with `model.dtype=float32` (CPU) nothing is cast. The value head (hidden_size + 1 numbers)
is replicated: every rank holds it whole, its gradients are summed by `TorchRanks.sum_grads`.
Gradients are summed, not averaged, over the ranks (divide factor 1): each rank's loss is already
its share of the global minibatch mean.

Scoring (`policy.score`, `models/token_scores.py`) calls the decoder and the LM head directly, not
the root model's forward, so the root unit's hooks would never run: its own parameters (the
embeddings, the final norm, the LM head, tied or not) would stay sharded, and in backward their
gradients would never be reduce-scattered. `as_root_forward` (`models/root_forward.py`) runs the
scoring pass as the root's forward (the policy's `scoring_call`, set by `shard_policy`): the root
gathers its parameters once before the pass (the LM head's chunks then need no collective, however
many a rank runs), keeps them for backward (FSDP2 does not reshard the root after forward), and
reduces their gradients at the end of backward.

`GatheredModel` / `GatheredWriter`: weight sync, checkpoints' HF files, the final policy and the
SFT and PRM artifacts need the full weights as ordinary tensors.
`get_model_state_dict(full_state_dict=True, cpu_offload=True)` gathers them (a collective: every
rank calls it) onto rank 0's CPU, where they are loaded into a plain copy of the model made before
sharding, whose existing writers (`save_merged`, `save_pretrained`, `save_prm`) write them.
Simplification: that copy costs rank 0 one model of host memory (the PPO policy's `GatheredWriter`
copies the policy only, never a `lora=none` reference).

`shard_model` shards a plain model (SFT) or a PRM's PeftModel the same way as the policy;
`check_same_weights` refuses ranks that start from different weights; `clip_global_norm` clips on
the norm of all gradients, sharded (DTensor) and replicated alike.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from prmppo.errors import PrmppoError
from prmppo.models.root_forward import as_root_forward


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM (the `layers` ModuleList of Mistral, Llama, Qwen2 ...)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return list(module)
    raise PrmppoError(f"topology=fsdp: found no decoder block list (a ModuleList named layers, h or blocks) in "
                      f"{type(model).__name__}; FSDP2 shards block by block")


def _shard(model: nn.Module, compute_dtype: torch.dtype) -> None:
    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum over ranks: each loss is a share of the global mean
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def shard_model(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Shard an fp32 causal LM (or a PeftModel around one) in place, per decoder block and at the root,
    computing in `compute_dtype`."""
    low = [name for name, p in model.named_parameters() if p.dtype != torch.float32][:3]
    if low:
        raise PrmppoError(f"topology=fsdp shards fp32 weights (the master weights), but {low} are not fp32")
    _shard(model, compute_dtype)


def shard_policy(policy, compute_dtype: torch.dtype) -> None:
    """Shard the policy's fp32 model (and a separate reference) in place, computing in `compute_dtype`; the
    value head stays replicated."""
    shard_model(policy.model, compute_dtype)
    reference = getattr(policy, "reference", None)
    if reference is not None:
        _shard(reference, compute_dtype)
    policy.scoring_call = as_root_forward


def weights_digest(modules: list[nn.Module]) -> str:
    """A hash of every parameter and buffer of `modules` (unsharded), to compare ranks' starting weights."""
    digest = hashlib.sha256()
    for module in modules:
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def check_identical_init(policy, ranks) -> None:
    """`check_same_weights` of the policy's model, its separate reference and its value head."""
    check_same_weights([m for m in (policy.model, getattr(policy, "reference", None), policy.value_head)
                        if m is not None], ranks)


def check_same_weights(modules: list[nn.Module], ranks) -> None:
    """Refuse to train when the ranks start from different weights (before sharding: a rank-dependent
    seed, a different checkpoint on a node's disk): FSDP would silently mix their shards."""
    digests = [None] * ranks.world_size
    dist.all_gather_object(digests, weights_digest(modules))
    if len(set(digests)) > 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PrmppoError(f"topology=fsdp: ranks {differing} start from different weights than rank 0 (a different "
                          "model file on their node, or an initialisation that is not seeded the same on every rank)")


class GatheredModel:
    """Rank 0's plain CPU copy of a model, made before sharding (construct it then), refilled with the
    sharded model's current weights by `full`."""

    def __init__(self, model: nn.Module, ranks):
        self.model = model
        self.copy = copy.deepcopy(model).to("cpu") if ranks.is_main else None

    def full(self) -> nn.Module | None:
        """Every rank calls this (a collective); rank 0 gets the plain copy holding the current weights,
        the others None."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.copy is None:
            return None
        result = self.copy.load_state_dict(state, strict=False)
        if result.unexpected_keys or any(k not in _tied(self.copy) for k in result.missing_keys):
            raise PrmppoError(f"gathered weights do not fit the model: missing {result.missing_keys[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}")
        return self.copy


class GatheredWriter:
    """Writes the full policy from rank 0: weight sync, the final policy, checkpoints' adapter/model files."""

    def __init__(self, policy, ranks):
        self.policy, self.ranks = policy, ranks
        self.gathered = GatheredModel(policy.model, ranks)
        # on rank 0: a shallow copy of the policy around the plain copy of its model (no reference: only the
        # policy is ever written; the value head is replicated, so shared)
        self.copy = None
        if ranks.is_main:
            self.copy = copy.copy(policy)
            self.copy.model = self.gathered.copy
            if hasattr(self.copy, "reference"):
                self.copy.reference = None

    def full_policy(self):
        """Every rank calls this (a collective); rank 0 gets the plain copy holding the current weights,
        the others None."""
        self.gathered.full()
        return self.copy


def clip_global_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` on the norm of all of `params`' gradients, where some are FSDP2-sharded (DTensor)
    and some plain (a replicated head whose gradients `TorchRanks.sum_grads` already summed); returns the
    total norm before clipping. One kind alone is torch's own `clip_grad_norm_` (it reduces DTensor norms
    over the ranks itself)."""
    with_grad = [p for p in params if p.grad is not None]
    sharded = [p.grad for p in with_grad if isinstance(p.grad, DTensor)]
    plain = [p.grad for p in with_grad if not isinstance(p.grad, DTensor)]
    if not sharded or not plain:
        return torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
    sharded_norm = torch.nn.utils.get_total_norm(sharded).full_tensor()  # over every rank's shards
    plain_norm = torch.nn.utils.get_total_norm(plain).to(sharded_norm.device)
    total = torch.linalg.vector_norm(torch.stack([sharded_norm, plain_norm]))
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))  # clip_grad_norm_'s coefficient
    for grad in sharded + plain:
        grad.mul_(coef)
    return total


def _tied(model: nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier one (a full state dict may leave them out)."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


class GatheredSync:
    """`WeightSync` for N ranks: every rank joins the gather on the sync cadence, rank 0 writes and serves."""

    def __init__(self, sync, full_policy: Callable, every_iterations: int):
        self.sync, self.full_policy = sync, full_policy  # `sync` (a WeightSync) is None on ranks other than 0
        self.every_iterations = every_iterations

    @property
    def served(self):
        return self.sync.served

    def push(self, policy):
        full = self.full_policy()  # `GatheredWriter.full_policy`: a collective
        return None if self.sync is None else self.sync.push(full)

    def maybe_sync(self, policy, iteration: int) -> bool:
        if (iteration + 1) % self.every_iterations:
            return False
        self.push(policy)
        return True
