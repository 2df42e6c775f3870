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

Sampling: `decoding.Decoding`, the loop of the worker's engine (static KV cache, CUDA graphs on
CUDA, grouped decode attention), under `torch.no_grad` with every module in eval mode, each
module's own training flag put back afterwards (the policy keeps its gradient-checkpointed layers
marked as training, and transformers drops the KV cache of a checkpointed layer in training mode).
Decoder layers compiled for the update (`ppo.compile`) run their eager forward here: decode steps
of one token would compile graphs of their own in the middle of the run.

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
import time

import torch
from torch import nn

from prmppo.rollout.decoding import Decoding
from prmppo.rollout.protocol import RolloutRequest, RolloutResult, RolloutWorkerError, WeightsSpec

ENGINE = "inprocess"  # its `rollout.engine` name
SERVED_KINDS = ("base", "live")  # the model as handed over, or the trainer's weights as they are now


class InProcessEngine:
    """Samples rollout requests with a model the caller holds (the trainer's policy model)."""

    # the run builds this engine after the policy and hands it the policy's model (stages/ppo_training.py)
    in_process = True

    def __init__(self, engine: str, python: str, sync: str, sync_every_iterations: int, startup_timeout_s: float,
                 request_timeout_s: float, heartbeat_timeout_s: float, gpu_memory_utilization: float,
                 decode: str, standby: bool, *, model: nn.Module, spool_dir=None, base_model_dir=None, log_path=None,
                 device=None, dtype=None, lora_rank=None, seed=None) -> None:
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
        self._sampler = Decoding(decode)
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
            with torch.no_grad(), _eval_mode(self.model), _eager_layers(self.model):
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
