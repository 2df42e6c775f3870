"""The update's micro-batch loop does not stop the host to read its own device tensors.

On a GPU every read of a device tensor's value (`float(t)`, `t.item()`, `if t.any()`, a boolean
selection, whose size the host must learn) waits until the device has run everything queued before
it, and the device then idles while the host prepares the next kernels. The update cuts each
micro-batch from host copies of the masks and keeps its statistics on the device until the update
ends; the one read left per micro-batch is `token_scores` learning how many response tokens it scores.

The test marks the TrainBatch's tensors with a tensor subclass (every tensor computed from them
carries it, and `.cpu()` hands back a plain tensor) and records each value read of a marked tensor
made by prmppo's own code (reads inside transformers' mask building are theirs)."""

from __future__ import annotations

import dataclasses
import traceback

import torch

from prmppo.ppo.batch import TrainBatch
from test_update_plan import MIXED, _ppo, _rollout, _trainer

READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
         torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.nonzero, torch.nonzero}


class OnDevice(torch.Tensor):
    """Stands for a tensor on the GPU: `reads` collects (phase, where) for each value read of one."""

    reads: list[tuple[str, str]] = []
    phase = "loop"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = (func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor)
                         and args[1].dtype == torch.bool)
        if func in READS or boolean_index:
            frame = traceback.extract_stack()[-2]
            if "/prmppo/" in frame.filename:
                cls.reads.append((cls.phase, f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"))
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.cpu:  # the sanctioned copy to the host
            return out.as_subclass(torch.Tensor)
        return out


def test_the_update_reads_device_values_once_per_micro_batch_and_once_at_the_end(monkeypatch):
    trainer = _trainer(_ppo(), torch.float32)  # 16 rows: 2 minibatches of 8 rows, micro-batches of 2
    batch = _rollout(MIXED)
    plan = trainer.plan(batch, 0)
    train, _ = trainer.assemble(batch, trainer.reward(batch)[0], plan)
    marked = TrainBatch(**{f.name: (getattr(train, f.name).as_subclass(OnDevice)
                                    if isinstance(getattr(train, f.name), torch.Tensor) else getattr(train, f.name))
                           for f in dataclasses.fields(TrainBatch)})
    update_metrics = type(trainer)._update_metrics

    def metrics(self, *args, **kwargs):
        OnDevice.phase = "metrics"
        return update_metrics(self, *args, **kwargs)

    monkeypatch.setattr(type(trainer), "_update_metrics", metrics)
    OnDevice.reads, OnDevice.phase = [], "loop"
    out = trainer.update(marked, 0, plan)

    micro_batches = sum(len(minibatch.micro_batches) for minibatch in plan.epochs[0])
    loop = [where for phase, where in OnDevice.reads if phase == "loop"]
    assert loop == ["token_scores.py:token_scores"] * micro_batches, loop
    # the statistics: one read each, after the last micro-batch
    assert len([1 for phase, _ in OnDevice.reads if phase == "metrics"]) <= 2 * len(out)
    assert out["ppo/first_minibatch_ratio_dev"] == 0.0


class Copied(torch.Tensor):
    """Stands for a rollout tensor on the host: `copies` counts its `.to(device)` calls (each a blocking copy on
    a GPU: the host waits for the device's queue to drain)."""

    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and (any(isinstance(a, (torch.device, str)) for a in args[1:])
                                        or "device" in kwargs):
            cls.copies += 1
            return super().__torch_function__(func, types, args, kwargs).as_subclass(torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs)


def test_the_no_grad_pass_copies_the_rollout_to_the_device_once_not_per_micro_batch():
    trainer = _trainer(_ppo(), torch.float32)  # 16 rows in micro-batches of 2
    batch = _rollout(MIXED)
    plan = trainer.plan(batch, 0)
    micro_batches = [rows for minibatch in plan.epochs[0] for rows in minibatch.micro_batches]
    assert len(micro_batches) == 8
    marked = dataclasses.replace(batch, **{name: getattr(batch, name).as_subclass(Copied) for name in (
        "input_ids", "attention_mask", "position_ids", "response_ids", "response_mask")})
    want = trainer._forward_no_grad(batch, micro_batches, batch.response_mask)
    Copied.copies = 0
    got = trainer._forward_no_grad(marked, micro_batches, marked.response_mask)
    assert Copied.copies == 5, Copied.copies  # the four token tensors and the mask, once each
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a.as_subclass(torch.Tensor), b, rtol=0, atol=0)
