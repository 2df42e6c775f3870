"""The rollout engine inside the trainer's process: it samples with the trainer's own policy model.

    python -m prmppo stage=ppo rollout=inprocess            # LoRA (the default lora=adapter)
    python -m prmppo stage=ppo rollout=inprocess lora=none  # full fine-tuning: the same object

`rollout=inprocess` builds `InProcessEngine` in place of the worker client (`client.py`), behind
the same interface (`launch`, `wait_ready`, `close`, a context manager, `generate(RolloutRequest)
-> RolloutResult`), so the trainer, the engine-gap gate, resume and the band stage drive it as
they drive the worker.

What it saves: the worker's engine holds a copy of the weights of its own, and `rollout.sync=shared`
adds a third (the merged buffer both map). This engine holds none: it runs the module object the
trainer trains. Under LoRA that is the peft model with the `policy` adapter active, so every
adapted layer computes base(x) + scale * B(A(x)) through peft's LoRA layers on the fly: no merged
copy, no second base. Under full fine-tuning (`lora=none`) it is the trained model itself.

Weight sync: none (`rollout.sync=none`, `ppo/sync.py`): the engine reads the weights the optimizer
has just written; a push only advances the version the next request names ("live" weights), so
`rollout.sync_every_iterations` must be 1 (sampling with older weights would need a copy of them).

Merged adapter (`rollout.merge_adapter=true`; default false; LoRA only): for each request every LoRA
linear's base weight is swapped, for the request alone, for W + scale * B A (computed in fp32, stored in
the weights' dtype), and its LoRA branch is switched off, so a decode step runs one matmul per linear
instead of three (the factors' two small ones are kernel launches that a small model's launch-bound
step pays for on every token). The merged tensors are a transient copy of the adapted weights (at the
7B shape about 12 GiB, held while the request runs, freed before the update); the trainer's tensors are
untouched and back in place when the request returns, or fails. The samples are those of the merged
weights that `rollout.sync=shared` serves a worker: equal to the unmerged forward up to rounding (the
trainer recomputes every logprob PPO uses). Adapters that are not plain LoRA on `nn.Linear` (DoRA,
LoRA biases, `fan_in_fan_out`) are never merged: the request then runs the LoRA branches, with a
warning. `rollout.merge_adapter=false` (the default) keeps the branches: no transient copy, the run's
peak memory as without the merge. The merge pays where the decode step is launch-bound (small models);
where the weights' memory is what limits the run, the copy can raise its peak (benchmarks/RESULTS.md).

Sampling: `decoding.Decoding`, the loop of the worker's engine (static KV cache, CUDA graphs on
CUDA, grouped decode attention), under `torch.no_grad` with every module in eval mode, each
module's own training flag put back afterwards (the policy keeps its gradient-checkpointed layers
marked as training, and transformers drops the KV cache of a checkpointed layer in training mode).
Decoder layers compiled for the update (`ppo.compile`) run their eager forward here: decode steps
of one token would compile graphs of their own in the middle of the run. `rollout.compile_decode=true`
compiles the decode step itself instead: one graph, its batch and slot count dynamic, made in the first
request (`compiled_decode.py`: one graph of a decoder layer, shared by every layer).

KV cache: allocated for each request from its rows and its longest prompt + `max_new_tokens`
(rounded up to `decoding.SLOT_ROUNDING` slots) and released when the request returns, so the
update reuses that memory; on CUDA the decode steps' graphs are therefore captured anew for each
request (the worker's engine keeps its cache and graphs while the next request fits).

Refused at config validation: FSDP (`topology=fsdp`: rank 0 alone samples, and a sharded model's
forward needs every rank), a weight sync other than none, `sync_every_iterations` > 1.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_inprocess.py -q`.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from prmppo.rollout.decoding import Decoding
from prmppo.rollout.protocol import RolloutRequest, RolloutResult, RolloutWorkerError, WeightsSpec

LOG = logging.getLogger(__name__)

ENGINE = "inprocess"  # its `rollout.engine` name
SERVED_KINDS = ("base", "live")  # the model as handed over, or the trainer's weights as they are now


class InProcessEngine:
    """Samples rollout requests with a model the caller holds (the trainer's policy model)."""

    # the run builds this engine after the policy and hands it the policy's model (stages/ppo_training.py)
    in_process = True

    def __init__(self, engine: str, python: str, sync: str, sync_every_iterations: int, startup_timeout_s: float,
                 request_timeout_s: float, heartbeat_timeout_s: float, gpu_memory_utilization: float,
                 decode: str, compile_decode: bool, standby: bool, *, model: nn.Module, spool_dir=None,
                 base_model_dir=None, log_path=None, device=None, dtype=None, lora_rank=None, seed=None,
                 merge_adapter: bool = False) -> None:
        # the worker's keys (its interpreter, timeouts, memory share, standby) and the arguments a run gives a
        # worker (spool, base checkpoint, log, engine device, dtype, LoRA rank, seed) mean nothing here: the
        # engine runs in this process, on the device and in the dtype `model` has
        del python, startup_timeout_s, request_timeout_s, heartbeat_timeout_s, gpu_memory_utilization, standby
        del spool_dir, base_model_dir, log_path, device, dtype, lora_rank, seed
        if engine != ENGINE:
            raise ValueError(f"rollout.engine={engine!r} with InProcessEngine: use rollout=inprocess")
        if sync != "none" or sync_every_iterations != 1:
            raise ValueError(f"rollout=inprocess reads the trainer's weights as they are: rollout.sync={sync!r} and "
                             f"rollout.sync_every_iterations={sync_every_iterations} must be none and 1")
        self.model = model
        # a peft model runs through the causal LM under it, with the LoRA layers injected: that module's
        # forward takes the KV cache (peft's own forward would hide it from the static decoder)
        self._causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._adapter = getattr(model, "active_adapter", None)  # the policy's, when the engine is built
        if not isinstance(merge_adapter, bool):
            raise ValueError(f"rollout.merge_adapter={merge_adapter!r} must be true or false")
        self.merge_adapter = merge_adapter
        self.last_merged = 0  # LoRA linears the last request ran merged
        self._sampler = Decoding(decode, compile_decode=compile_decode)  # checks both
        self._served: WeightsSpec | None = None

    # ------------------------------------------------------------------ the worker client's lifecycle

    def launch(self) -> None:
        return None  # nothing to start: the model is loaded

    def wait_ready(self) -> None:
        return None

    def close(self) -> None:
        self._sampler.release()

    def __enter__(self) -> "InProcessEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def served_weights(self) -> WeightsSpec | None:
        """The weights the last result was sampled with (None before the first)."""
        return self._served

    @property
    def decode_info(self) -> dict:
        """What the last request ran (`Decoding.info`)."""
        return self._sampler.info

    # ------------------------------------------------------------------ requests

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Sample `request` with the model as it is now; the KV cache lives only while it runs."""
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"generate() takes a RolloutRequest, got {type(request).__name__}")
        if request.weights.kind not in SERVED_KINDS:
            raise RolloutWorkerError(
                f"request {request.request_id} asks for {request.weights}, which the in-process engine cannot "
                f"load: it samples with the trainer's own weights (kinds {SERVED_KINDS}); use rollout.sync=none")
        adapter = getattr(self.model, "active_adapter", None)
        if adapter != self._adapter:
            raise RolloutWorkerError(f"the policy model's active adapter is {adapter!r}, not {self._adapter!r} (the "
                                     "one active when the engine was built): a scorer left another adapter on")
        device = next(self.model.parameters()).device
        start = time.perf_counter()
        try:
            with torch.no_grad(), _eval_mode(self.model), _eager_layers(self.model), \
                    _merged_adapter(self.model, self._adapter, self.merge_adapter) as merged:
                self.last_merged = merged
                token_ids, logprobs, finish_reasons = self._sampler.generate(
                    self._causal_lm, device, request.prompt_token_ids, request.n_samples_per_prompt,
                    request.max_new_tokens, request.temperature, request.top_p, request.seed,
                    request.eos_token_id, request.pad_token_id)
        finally:
            self._sampler.release()  # the update gets the KV cache's memory back
        self._served = request.weights
        return RolloutResult(request.request_id, request.weights, token_ids, logprobs, finish_reasons,
                             time.perf_counter() - start, 0.0)


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Every module of `model` in eval mode for the block; each module's own flag restored after."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def _eager_layers(model: nn.Module):
    """Modules compiled in place (`nn.Module.compile`) run their eager forward for the block."""
    compiled = [(module, module._compiled_call_impl) for module in model.modules()
                if getattr(module, "_compiled_call_impl", None) is not None]
    for module, _ in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call


def _merge_refusal(layer, adapter: str) -> str | None:
    """Why `layer` cannot run `adapter` merged into a transient base weight; None when it can."""
    if not isinstance(layer, LoraLinear) or not isinstance(layer.get_base_layer(), nn.Linear):
        return f"{type(layer).__name__} is not a LoRA nn.Linear"
    if adapter in layer.lora_variant or layer.use_dora.get(adapter, False):
        return "a LoRA variant (DoRA and the like)"
    if layer.lora_bias.get(adapter, False) or layer.fan_in_fan_out or layer.merged:
        return "a LoRA bias, fan_in_fan_out or an adapter merged already"
    if list(layer.active_adapters) != [adapter]:
        return f"active adapters {list(layer.active_adapters)}"
    return None


@contextlib.contextmanager
def _merged_adapter(model: nn.Module, adapter: str | None, enabled: bool):
    """For the block, every LoRA linear of `model` computes base(x) with W + scale * B A as its base weight
    and its LoRA branch off; yields how many linears were merged (0: the branches run as they are). Each
    base weight's own tensor and each layer's switch are put back on the way out, whatever happens inside."""
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)] \
        if enabled and adapter is not None else []
    refusals = {reason for reason in (_merge_refusal(layer, adapter) for layer in layers) if reason}
    if refusals:
        LOG.warning("rollout.merge_adapter: sampling with the LoRA branches unmerged (%s)", "; ".join(sorted(refusals)))
        layers = []
    swapped = []  # (base weight, its own tensor, the layer, its switch)
    try:
        for layer in layers:
            weight = layer.get_base_layer().weight
            lora_a, lora_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            merged = torch.addmm(weight.float(), lora_b.float(), lora_a.float(), alpha=layer.scaling[adapter])
            swapped.append((weight, weight.data, layer, layer._disable_adapters))
            weight.data = merged.to(weight.dtype)
            layer._disable_adapters = True
        yield len(swapped)
    finally:
        for weight, own, layer, switch in reversed(swapped):
            weight.data = own
            layer._disable_adapters = switch
