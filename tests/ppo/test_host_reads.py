"""The update's micro-batch loop and the no-grad pass do not stop the host to read their own device tensors.

On a GPU every read of a device tensor's value (`float(t)`, `t.item()`, `if t.any()`, a boolean
selection, whose size the host must learn) waits until the device has run everything queued before
it, and the device then idles while the host prepares the next kernels. The update and the no-grad pass cut
each micro-batch from host copies of the masks, and find the response tokens `token_scores` scores there too
(`response_positions`); the update keeps its statistics on the device until it ends.

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


def test_the_update_reads_no_device_value_until_its_last_micro_batch(monkeypatch):
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
    assert micro_batches == 8 and loop == [], loop
    # the statistics: one read each, after the last micro-batch
    assert len([1 for phase, _ in OnDevice.reads if phase == "metrics"]) <= 2 * len(out)
    assert out["ppo/first_minibatch_ratio_dev"] == 0.0


class Copied(torch.Tensor):
    """Stands for a rollout tensor on the host: `copies` counts its blocking `.to(device)` calls (on a GPU the host
    waits for the device's queue to drain; a `non_blocking` copy of an index is queued behind it instead)."""

    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and not kwargs.get("non_blocking") and (
                any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs):
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


def test_the_no_grad_pass_reads_no_value_of_its_device_tensors(monkeypatch):
    """The rollout's copies on the device marked: scoring the policy and the reference of every micro-batch reads
    none of their values (the response tokens' positions come from the host's mask)."""
    from prmppo.ppo import assemble

    trainer = _trainer(_ppo(), torch.float32)
    batch = _rollout(MIXED)
    plan = trainer.plan(batch, 0)
    micro_batches = [rows for minibatch in plan.epochs[0] for rows in minibatch.micro_batches]
    want = trainer._forward_no_grad(batch, micro_batches, batch.response_mask)
    copy_once = assemble._OnDevice.__init__

    def marked(self, *args):
        copy_once(self, *args)
        for name in ("input_ids", "attention_mask", "position_ids", "response_ids", "mask"):
            setattr(self, name, getattr(self, name).as_subclass(OnDevice))

    monkeypatch.setattr(assemble._OnDevice, "__init__", marked)
    OnDevice.reads, OnDevice.phase = [], "loop"
    got = trainer._forward_no_grad(batch, micro_batches, batch.response_mask)
    assert len(micro_batches) == 8 and OnDevice.reads == [], OnDevice.reads
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a.as_subclass(torch.Tensor), b, rtol=0, atol=0)


def test_the_advantage_by_quarter_metrics_are_read_off_the_device_at_once():
    from prmppo.ppo.assemble import advantage_by_quarter

    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 1, 4, 0, 2, 1])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).float()  # [6, 9]
    advantages = torch.randn(6, 9, generator=generator) * mask
    outcome = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    want = {}  # each quarter's mean by hand: token t of a row of n tokens is in quarter min(4t // n, 3)
    for name, rows in (("right", outcome > 0.5), ("wrong", outcome <= 0.5)):
        for q in range(4):
            picked = [float(advantages[b, t]) for b in range(6) if rows[b] for t in range(int(lengths[b]))
                      if min(4 * t // int(lengths[b]), 3) == q]
            if picked:
                want[f"adv/{name}_q{q + 1}"] = sum(picked) / len(picked)
    OnDevice.reads, OnDevice.phase = [], "metrics"
    got = advantage_by_quarter(*(t.as_subclass(OnDevice) for t in (advantages, mask, outcome)))
    assert got.keys() == want.keys() and "adv/wrong_q2" not in got  # wrong rows of 1 and 2 tokens: q1 and q3
    assert all(abs(got[k] - want[k]) < 1e-6 for k in want)
    assert len(OnDevice.reads) == 1, OnDevice.reads  # one read for all eight cells, not two per cell


def test_the_update_never_walks_the_models_parameters_and_leaves_no_gradient(monkeypatch):
    """Each optimizer step drops the trained parameters' gradients from the list the trainer took once: asking
    the policy walks every named parameter of the model, host time in every step. Checked in a value warmup
    iteration too, whose steps leave the policy's parameters to this loop alone (no master copy takes them)."""
    for overrides, iteration in (((), 0), (("ppo.advantage_estimator=gae", "ppo.value_warmup_iterations=1"), 0)):
        trainer = _trainer(_ppo(*overrides), torch.bfloat16)
        batch = _rollout(MIXED)
        plan = trainer.plan(batch, iteration)
        train, _ = trainer.assemble(batch, trainer.reward(batch)[0], plan)
        asked = []
        monkeypatch.setattr(trainer.policy, "policy_parameters", lambda: asked.append(1) or [])
        trainer.update(train, iteration, plan)
        assert asked == []
        assert trainer.trained_parameters and all(p.grad is None for p in trainer.trained_parameters)
        assert all(p.grad is None for p in trainer.policy.model.parameters() if p.requires_grad)
