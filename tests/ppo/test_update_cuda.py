"""The update's CUDA-only paths (fused AdamW, bf16 autocast with checkpointing on a GPU): run on a
GPU machine with `pytest -m gpu tests/ppo/test_update_cuda.py`; CI has no CUDA device."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from test_loop import _batch, _policy, _ppo, _trainer
from prmppo.distributed.ranks import OneProcess
from prmppo.ppo.loop import PPOTrainer
from prmppo.rewards.orm import OutcomeReward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = torch.device("cuda")


def _on_device(*overrides: str):
    """(policy, trainer, batch) on the GPU; the batch's old logprobs taken on the CPU, same weights."""
    policy = _policy(critic=True)
    ppo = _ppo("ppo.advantage_estimator=gae", *overrides)
    batch = _batch(_trainer(policy, _ppo("ppo.advantage_estimator=gae")), policy)
    policy.model.to(DEVICE)
    policy.value_head.to(DEVICE)
    trainer = PPOTrainer(policy=policy, tokenizer=None, task=type("T", (), {"problems": lambda self, s: [0]})(),
                         reward=OutcomeReward(), engine=None, sync=None, ppo=ppo, logger=None, ranks=OneProcess(DEVICE), seed=0)
    moved = {f.name: getattr(batch, f.name) for f in fields(batch)}
    batch = type(batch)(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})
    return policy, trainer, batch


def test_optimizers_are_fused_on_cuda():
    _, trainer, _ = _on_device()
    for optimizer in (trainer.policy_optimizer, trainer.value_optimizer):
        assert all(group["fused"] for group in optimizer.param_groups)


def test_bf16_autocast_with_checkpointing_trains_on_cuda():
    _, trainer, batch = _on_device("ppo.autocast=bfloat16", "ppo.gradient_checkpointing=true")
    metrics = trainer.update(batch, iteration=0)
    assert math.isfinite(metrics["ppo/policy_loss"]) and metrics["ppo/policy_grad_norm"] > 0
    assert metrics["ppo/first_minibatch_ratio_dev"] < 0.05  # fp32 old logprobs vs a bf16 forward: close


def test_gae_on_a_gpu_runs_its_loop_on_the_host_to_the_same_bits():
    from prmppo.ppo.estimators import _gae_rows, gae

    generator = torch.Generator().manual_seed(0)
    rows, horizon = 64, 256
    lengths = torch.randint(0, horizon + 1, (rows,), generator=generator)
    mask = (torch.arange(horizon)[None, :] < lengths[:, None]).float()
    rewards, values = torch.randn(rows, horizon, generator=generator), torch.randn(rows, horizon, generator=generator)
    bootstrap = torch.randn(rows, generator=generator)
    args = [t.to(DEVICE) for t in (rewards, values, mask)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        advantages, returns = gae(*args, 0.99, 0.95, bootstrap.to(DEVICE))
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
    assert launches < 10, launches  # on the device, the loop alone is about 7 launches a step: 1800 here
    assert advantages.device.type == "cuda" and returns.device.type == "cuda"
    on_device = _gae_rows(*args, 0.99, 0.95, bootstrap.to(DEVICE))
    assert torch.equal(advantages, on_device[0]) and torch.equal(returns, on_device[1])


def test_the_policy_loss_makes_the_host_wait_for_nothing():
    from prmppo.ppo.maths import policy_loss

    generator = torch.Generator().manual_seed(0)
    logprobs, old, advantages = (torch.randn(4, 6, generator=generator).to(DEVICE) for _ in range(3))
    mask = torch.ones(4, 6, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
    try:
        loss, stats = policy_loss(logprobs, old, advantages, mask, 0.2, 0.2, 3.0, "token_mean")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(stats.ratio_min) <= float(stats.ratio_max) and torch.isfinite(loss)


def test_token_scores_given_the_positions_make_the_host_wait_for_nothing():
    from prmppo.models.token_scores import response_positions, token_scores

    generator = torch.Generator().manual_seed(0)
    mask = (torch.arange(12)[None, :] < torch.tensor([12, 3, 0, 7])[:, None]).float()  # [4, 12] on the host
    head = torch.nn.Linear(16, 50, bias=False).to(DEVICE)
    hidden = torch.randn(4, 12, 16, generator=generator).to(DEVICE).requires_grad_(True)
    tokens = torch.randint(0, 50, (4, 12), generator=generator).to(DEVICE)
    want, _ = token_scores(head, hidden, tokens, mask.to(DEVICE), 0.7, 5)  # positions read off the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
    try:
        got, _ = token_scores(head, hidden, tokens, mask.to(DEVICE, non_blocking=True), 0.7, 5,
                              positions=response_positions(mask, DEVICE))
        got.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want) and hidden.grad is not None
