"""PPOTrainer on hand-built batches: the LR schedule's horizon checked when the trainer is built; in
assemble, GAE against a hand computation (decoupled lambdas, truncated rows bootstrapped from the value
at the cut) and a group baseline's scale-only normalisation; in the update, separate gradient clipping,
true logged losses, the LR that ran, dropout-free ratios, the critic only where it is used,
upcast-then-temper logprobs, fp32 master weights for half-precision parameters, and the engine-gap
limit above the noise floor."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf
from peft.tuners.tuners_utils import cast_adapter_dtype
from transformers import MistralConfig, MistralForCausalLM

from conftest import compose_config
from prmppo.distributed.ranks import OneProcess
from prmppo.models.policy import POLICY_ADAPTER, LoraPolicy
from prmppo.ppo import maths
from prmppo.ppo.batch import TrainBatch, collate
from prmppo.ppo.loop import HorizonError, PPOTrainer
from prmppo.ppo.optim import MasterWeights
from prmppo.rewards.orm import OutcomeReward
from prmppo.guards.monitors import engine_gap_tripwire
from trainer_builders import ppo_settings, random_rollout, tiny_trainer

TARGETS = ["q_proj", "v_proj"]


class _Task:
    def problems(self, split):
        return list(range(10))


def _ppo(*overrides: str):
    # 2 prompts x 4 samples, one minibatch of 8 rows in two micro-batches of 4
    return OmegaConf.to_object(compose_config([
        "debug=smoke", "ppo.iterations=4", "ppo.prompts_per_iteration=2", "ppo.n_samples_per_prompt=4",
        "ppo.minibatch_rows=8", "ppo.micro_batch_rows=4", "ppo.warmup_steps=2", *overrides]).ppo)


def _policy(critic: bool, dropout: float = 0.0, modules_to_save=None, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=True)
    model = MistralForCausalLM(cfg).to(dtype)
    return LoraPolicy(model, detach_value_hidden=True, critic=critic, r=4, alpha=8, dropout=dropout,
                      target_modules=TARGETS, modules_to_save=modules_to_save, modules_to_save_lr=3e-2)


def _trainer(policy, ppo):
    return PPOTrainer(policy=policy, tokenizer=None, task=_Task(), reward=OutcomeReward(), engine=None, sync=None,
                      ppo=ppo, logger=None, ranks=OneProcess(torch.device("cpu")), seed=0)


def _batch(trainer, policy, seed: int = 0) -> TrainBatch:
    """8 random responses of 5-8 tokens after 3-token prompts, with the trainer's own old logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 30, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(4, 30, (int(n),), generator=g).tolist() for n in torch.randint(5, 9, (8,), generator=g)]
    ids, att, pos, resp, mask, plen = collate(prompts, responses, pad_token_id=0)
    policy.train(False)
    with torch.no_grad():
        scored = policy.score(ids, att, pos, resp, mask, plen, trainer.ppo.temperature, 4096)
        old = scored.logprobs
        ref = policy.reference_score(ids, att, pos, resp, mask, plen, trainer.ppo.temperature, 4096)
    values = scored.values
    values = torch.zeros_like(mask) if values is None else values[:, plen - 1:plen - 1 + resp.shape[1]] * mask
    advantages = torch.randn(mask.shape, generator=g) * mask
    returns = (torch.rand(mask.shape, generator=g) * 4) * mask  # returns of ~0-4, as on the default task
    return TrainBatch(ids, att, pos, resp, mask, old, ref, values, advantages, returns, plen)


def _policy_grads_seen(trainer) -> list[list[torch.Tensor]]:
    """Spy on the policy optimizer: the gradients it is asked to step with, per step."""
    seen, step = [], trainer.policy_optimizer.step

    def spy(*args, **kwargs):
        seen.append([p.grad.clone() for g in trainer.policy_optimizer.param_groups for p in g["params"]
                     if p.grad is not None])
        return step(*args, **kwargs)

    trainer.policy_optimizer.step = spy
    return seen


def test_the_trainer_refuses_a_schedule_that_ends_before_the_loop():
    # 8 rows in minibatches of 3: the schedule's horizon counts 8 // 3 = 2 minibatches an epoch, the loop
    # steps on 3 slices (3, 3, 2); over 4 iterations the schedule would end after 8 of the 12 steps
    with pytest.raises(HorizonError, match=r"spans 8 steps but the update loop takes 12 policy optimizer steps"):
        _trainer(_policy(critic=False), _ppo("ppo.minibatch_rows=3", "ppo.micro_batch_rows=1"))


# ----------------------------------------------------------------------------- assemble: task advantages

def _critic_trainer(*overrides: str):
    """A GAE trainer with no KL anywhere and no normalisation, whose critic predicts values away from 0
    (its head starts at 0, which would make every value, and so the bootstrap, 0)."""
    trainer = tiny_trainer(ppo_settings("ppo.advantage_estimator=gae", "ppo.kl_coef=0", "ppo.kl_loss_coef=0",
                                        "ppo.whiten_advantages=false", *overrides))
    with torch.no_grad():
        head = trainer.policy.value_head.linear
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)))
        head.bias.fill_(0.5)
    return trainer


def _values_before_assemble(trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's V(s_t) [B, T] (at the position before response token t) and its value after each
    row's last token [B], from one forward of the whole batch (assemble's first batch then moves the
    head's return statistics)."""
    plen, width = batch.prompt_length, batch.response_ids.shape[1]
    trainer.policy.train(False)
    with torch.no_grad():
        values = trainer.policy.score(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids,
                                      batch.response_mask, plen, 1.0, 4096).values  # [B, P + T]
    lengths = batch.response_mask.sum(-1).long()  # [B]
    return values[:, plen - 1:plen - 1 + width] * batch.response_mask, values[torch.arange(len(batch)),
                                                                               plen - 1 + lengths]


def _hand_gae(rewards, values, mask, bootstrap, gamma: float, lam: float):
    """GAE from its definition, a token at a time from each row's end: delta_t = r_t + gamma V_{t+1} - V_t
    with V after the last token = `bootstrap` [B]; A_t = delta_t + gamma lam A_{t+1}; returns A + V."""
    advantages = torch.zeros_like(values)
    for row in range(values.shape[0]):
        next_value, running = float(bootstrap[row]), 0.0
        for t in reversed(range(int(mask[row].sum()))):
            delta = float(rewards[row, t]) + gamma * next_value - float(values[row, t])
            running = delta + gamma * lam * running
            advantages[row, t], next_value = running, float(values[row, t])
    return advantages, (advantages + values) * mask


def test_assemble_bootstraps_rows_cut_at_the_length_limit_from_the_value_at_the_cut():
    trainer = _critic_trainer()
    batch = dataclasses.replace(random_rollout([1., 0., 0., 1., 1., 1., 0., 1.]),
                                finish_reasons=["length", "stop"] * 4)
    values, after = _values_before_assemble(trainer, batch)
    cut = torch.tensor([reason == "length" for reason in batch.finish_reasons])
    assert after[cut].abs().min() > 0.05  # a bootstrap of 0 would show
    rewards = OutcomeReward()(batch)[0]
    train, _ = trainer.assemble(batch, rewards, trainer.plan(batch, 0))
    # gamma 1, lambda 1: the return is the rest of the row's reward plus, for a cut row, the value after
    # its last token (the response would have gone on); a row that ended (EOS) is worth nothing after it
    mask = batch.response_mask
    rest = rewards.terms["outcome"].values.flip(-1).cumsum(-1).flip(-1) * mask  # [B, T]
    expected_returns = (rest + torch.where(cut, after, 0.0)[:, None]) * mask
    torch.testing.assert_close(train.returns, expected_returns, rtol=0, atol=1e-5)
    torch.testing.assert_close(train.advantages, expected_returns - values, rtol=0, atol=1e-5)
    hand_advantages, _ = _hand_gae(rewards.terms["outcome"].values, values, mask, torch.where(cut, after, 0.0), 1.0,
                                   1.0)
    torch.testing.assert_close(train.advantages, hand_advantages, rtol=0, atol=1e-5)


def test_assemble_takes_the_advantages_at_lam_actor_and_the_critic_targets_at_lam_critic():
    trainer = _critic_trainer("ppo.gamma=0.9", "ppo.lam_actor=0.5", "ppo.lam_critic=0.9")
    batch = random_rollout([1., 0., 0., 1., 1., 1., 0., 1.])  # every row ended: no bootstrap
    values, _ = _values_before_assemble(trainer, batch)
    rewards = OutcomeReward()(batch)[0]
    train, _ = trainer.assemble(batch, rewards, trainer.plan(batch, 0))
    outcome, mask, ended = rewards.terms["outcome"].values, batch.response_mask, torch.zeros(8)
    advantages, _ = _hand_gae(outcome, values, mask, ended, 0.9, 0.5)
    _, returns = _hand_gae(outcome, values, mask, ended, 0.9, 0.9)
    assert (_hand_gae(outcome, values, mask, ended, 0.9, 0.9)[0] - advantages).abs().max() > 0.05  # lambdas differ
    torch.testing.assert_close(train.advantages, advantages, rtol=0, atol=1e-5)
    torch.testing.assert_close(train.returns, returns, rtol=0, atol=1e-5)


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_assemble_rescales_a_group_baseline_without_shifting_it(estimator):
    # group 0 all right: no contrast, advantage 0; group 1 right, wrong, wrong, right. The baseline has
    # centred each prompt already; a shift by the batch's token mean (responses differ in length) would
    # push all of group 0's samples, and some of group 1's, one way
    trainer = tiny_trainer(ppo_settings(f"ppo.advantage_estimator={estimator}", "ppo.kl_coef=0", "ppo.kl_loss_coef=0",
                                        "ppo.whiten_advantages=true"))
    batch = random_rollout([1., 1., 1., 1., 1., 0., 0., 1.])
    train, metrics = trainer.assemble(batch, OutcomeReward()(batch)[0], trainer.plan(batch, 0))
    mask = batch.response_mask
    # rloo: right 1 - (1 + 0 + 0) / 3 = 2/3, wrong 0 - 2/3; grpo: (1 - 1/2) / std(1, 0, 0, 1) = 0.5 / 0.577,
    # the wrong ones its negative (unbiased std sqrt(1/3)); at every token (gamma 1, one reward at the end)
    contrast = 2 / 3 if estimator == "rloo" else 0.5 / (1 / 3) ** 0.5
    raw = torch.tensor([0., 0., 0., 0., contrast, -contrast, -contrast, contrast])[:, None] * mask  # [8, T]
    std = float(maths.masked_var(raw, mask).sqrt())
    assert abs(float(maths.masked_mean(raw, mask))) > 0.05 * std  # a shift would show
    torch.testing.assert_close(train.advantages, raw / std, rtol=0, atol=1e-5)
    assert metrics["adv/task_scale"] == pytest.approx(1 / std, rel=1e-5)
    assert torch.equal(train.advantages[:4], torch.zeros_like(train.advantages[:4]))  # the uniform group: 0
    signs = torch.tensor([1., -1., -1., 1.])[:, None] * mask[4:]  # right samples up, wrong ones down
    assert torch.equal(torch.sign(train.advantages[4:]), signs)


# ----------------------------------------------------------------------------- update

def test_a_hundredfold_value_loss_leaves_the_policy_step_unchanged():
    # One clip over critic + policy let the critic's (much larger) gradient scale the policy's step.
    runs = []
    for vf_coef in (0.5, 50.0):
        policy = _policy(critic=True)
        trainer = _trainer(policy, _ppo("ppo.advantage_estimator=gae", f"ppo.vf_coef={vf_coef}"))
        seen = _policy_grads_seen(trainer)
        metrics = trainer.update(_batch(trainer, policy), iteration=0)
        runs.append((seen, metrics))
    (small, m_small), (big, m_big) = runs
    assert m_big["value/grad_norm"] > 10 * m_small["value/grad_norm"]  # the critic's gradient did grow
    assert m_small["ppo/policy_grad_norm"] == m_big["ppo/policy_grad_norm"]
    for a, b in zip(small[0], big[0]):
        assert torch.equal(a, b)


def test_a_non_finite_critic_gradient_does_not_skip_the_policy_step():
    policy = _policy(critic=True)
    trainer = _trainer(policy, _ppo("ppo.advantage_estimator=gae", "ppo.max_skipped_fraction=1"))
    batch = _batch(trainer, policy)
    batch.returns[0, 0] = float("inf")  # the value loss, and only it, becomes non-finite
    seen = _policy_grads_seen(trainer)
    trainer.update(batch, iteration=0)
    assert len(seen) == 1 and all(torch.isfinite(g).all() for g in seen[0])
    assert torch.isfinite(policy.value_head.linear.weight).all()  # the critic's step was skipped
    assert trainer.skipped_steps == 1


def test_logged_losses_are_the_minibatch_losses_not_a_share_of_them():
    # one minibatch of 8 rows in 2 micro-batches; at the first step the ratio is 1, so the
    # token-mean policy loss is -mean(advantages over the minibatch's tokens)
    policy = _policy(critic=False)
    trainer = _trainer(policy, _ppo("ppo.whiten_advantages=false"))
    batch = _batch(trainer, policy)
    metrics = trainer.update(batch, iteration=0)
    expected = -float(maths.masked_mean(batch.advantages, batch.response_mask))
    assert metrics["ppo/policy_loss"] == pytest.approx(expected, rel=1e-5)


def test_logged_lr_is_the_one_each_group_stepped_with():
    # warmup over 2 steps: the first step runs at lr / 2; the final norm's group at its own lr / 2
    policy = _policy(critic=False, modules_to_save=["model.norm"])
    ppo = _ppo("ppo.lr=1e-3")
    metrics = _trainer(policy, ppo).update(_batch(_trainer(policy, ppo), policy), iteration=0)
    assert metrics["ppo/lr"] == pytest.approx(0.5e-3)
    assert metrics["ppo/lr_group1"] == pytest.approx(0.5 * 3e-2)


def test_first_minibatch_ratio_is_one_under_lora_dropout():
    # LoRA dropout acts on the adapter's input, so it changes nothing while B is 0: move B first
    policy = _policy(critic=False, dropout=0.5)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.5)
    trainer = _trainer(policy, _ppo())
    batch = random_rollout([1., 0., 0., 1., 1., 1., 0., 1.])
    rows = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids, batch.response_mask,
            batch.prompt_length, 1.0, 4096)
    policy.train(True)  # as a caller may leave it: dropout on
    with torch.no_grad():
        first, second = policy.score(*rows).logprobs, policy.score(*rows).logprobs
    assert (first - second).abs().max() > 1e-3  # dropout is live and moves the logprobs
    # the no-grad pass (old logprobs) and the update must each turn dropout off themselves
    plan = trainer.plan(batch, 0)
    train, _ = trainer.assemble(batch, OutcomeReward()(batch)[0], plan)
    policy.train(True)
    metrics = trainer.update(train, iteration=0, plan=plan)
    assert metrics["ppo/first_minibatch_ratio_dev"] < 1e-6


def test_group_estimators_build_and_train_no_critic():
    policy = _policy(critic=False)
    trainer = _trainer(policy, _ppo("ppo.advantage_estimator=rloo"))
    assert policy.value_head is None and trainer.value_optimizer is None
    metrics = trainer.update(_batch(trainer, policy), iteration=0)
    assert not [key for key in metrics if key.startswith("value/")]
    with pytest.raises(ValueError, match="must not have a value head"):
        _trainer(_policy(critic=True), _ppo("ppo.advantage_estimator=grpo"))


def test_group_estimators_report_the_critic_keys_as_inert():
    from prmppo.config.validate import inert_keys

    rloo = inert_keys(compose_config(["ppo.advantage_estimator=rloo"]))
    assert {"ppo.value_lr", "ppo.vf_coef", "ppo.lam_actor", "ppo.lam_critic"} <= set(rloo)
    assert not {"ppo.value_lr", "ppo.lam_actor"} & set(inert_keys(compose_config(["ppo.advantage_estimator=gae"])))


def test_logprobs_are_upcast_before_the_temperature():
    from prmppo.models.token_scores import token_scores

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 32, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(32, 16, generator=g))
    hidden = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, 32, (2, 5), generator=g)
    logits = head(hidden)  # [2, 5, 32] bf16, as a bf16 model's head gives them
    expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    tempered_in_bf16 = torch.log_softmax((logits / 0.7).float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert (tempered_in_bf16 - expected).abs().max() > 1e-3  # the order matters at this size
    with torch.no_grad():
        got, _ = token_scores(head, hidden, tokens, torch.ones(2, 5), temperature=0.7, chunk_tokens=3)
    assert torch.allclose(got, expected, atol=1e-6)


def test_master_weights_keep_updates_that_bf16_rounds_away():
    # AdamW moves a weight by ~lr per step; at 1.0, bf16's spacing is 2^-7 = 0.0078, so 1e-5 steps vanish
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mixed = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    masters = MasterWeights([{"params": [mixed]}])
    opt_plain = torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0)
    opt_mixed = torch.optim.AdamW(masters.groups, lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        plain.grad = torch.ones_like(plain)
        opt_plain.step()
        mixed.grad = torch.ones_like(mixed)
        masters.grads_to_masters()
        opt_mixed.step()
        masters.masters_to_model()
    assert torch.equal(plain.detach(), torch.ones_like(plain))  # 100 steps of 1e-4 lost to rounding
    master = masters.groups[0]["params"][0]
    assert master.dtype == torch.float32 and float(master[0].detach()) == pytest.approx(1 - 100 * 1e-4, rel=1e-3)
    assert torch.equal(mixed.detach(), master.detach().to(torch.bfloat16))  # 0.99 in bf16: 0.9883


def test_a_bf16_policy_trains_through_fp32_masters():
    policy = _policy(critic=False, modules_to_save=["model.norm"], dtype=torch.bfloat16)
    trainer = _trainer(policy, _ppo())
    trained = [p for p in policy.policy_parameters() if p.dtype == torch.bfloat16]
    assert trained and len(trainer.masters.pairs) == len(trained)
    assert all(p.dtype == torch.float32 for g in trainer.policy_optimizer.param_groups for p in g["params"])


class _GapTrainer:
    def __init__(self, gap: float):
        self.gap = gap

    def engine_gap_at_identical_weights(self) -> float:
        return self.gap


@pytest.mark.parametrize("measured, limit", [(4e-7, 1e-2), (0.0077, 3 * 0.0077)])
def test_engine_gap_limit_sits_above_the_measured_noise_floor(measured, limit):
    # fp32 (~4e-7): the configured 1e-2 stands; bf16 on a 0.5B model (0.0077): 3x the floor
    ppo = _ppo()
    tripwire, banner = engine_gap_tripwire(_GapTrainer(measured), ppo.max_first_ratio_dev, ppo.max_engine_logprob_gap)
    assert tripwire.max_logprob_gap == pytest.approx(limit)
    assert banner["measured_at_identical_weights"] == measured and banner["limit"] == pytest.approx(limit)
    assert not tripwire.check({"rollout/engine_logprob_abs_diff": measured})
    assert tripwire.check({"rollout/engine_logprob_abs_diff": 2 * limit})


def test_value_head_starts_at_the_mean_return_and_keeps_predictions_when_statistics_move():
    from prmppo.models.policy import ValueHead

    head = ValueHead(hidden_size=3, detach_hidden=True, stats_decay=0.5)
    hidden = torch.tensor([[[1.0, 0.0, 2.0], [0.5, -1.0, 0.0]]])  # [1, 2, 3]
    mask = torch.ones(2, 2)
    head.update_return_stats(torch.tensor([[1.0, 3.0], [1.0, 3.0]]), mask)  # mean 2, std 1
    assert torch.allclose(head(hidden), torch.full((1, 2), 2.0))  # zero head: the mean return at once
    assert torch.allclose(head.normalise(torch.tensor([3.0])), torch.tensor([1.0]))
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[0.3, -0.2, 0.1]]))  # as if it had learned something
    before = head(hidden)
    head.update_return_stats(torch.tensor([[10.0, 14.0], [10.0, 14.0]]), mask)
    # decay .5: mean .5 * 2 + .5 * 12 = 7; second moment .5 * 5 + .5 * 148 = 76.5; std sqrt(27.5)
    assert float(head.return_mean) == pytest.approx(7.0)
    assert float(head.return_std) == pytest.approx(27.5 ** 0.5)
    assert torch.allclose(head(hidden), before, atol=1e-5)  # PopArt: the same predictions in new units


def _first_step_grads(micro_batch_rows: int, spy_widths: list | None = None, *overrides: str):
    policy = _policy(critic=True)
    trainer = _trainer(policy, _ppo("ppo.advantage_estimator=gae", f"ppo.micro_batch_rows={micro_batch_rows}",
                                    *overrides))
    batch = _batch(trainer, policy)
    if spy_widths is not None:
        score = policy.score

        def spy(input_ids, *args, **kwargs):
            spy_widths.append(tuple(input_ids.shape))
            return score(input_ids, *args, **kwargs)

        policy.score = spy
    seen = _policy_grads_seen(trainer)
    metrics = trainer.update(batch, iteration=0)
    return seen[0], metrics, batch


def test_length_buckets_and_trimming_change_no_gradient_and_no_loss():
    # one micro-batch of all 8 rows vs four length-sorted micro-batches of 2, each cut to its longest
    # row: the losses divide by the minibatch's counts, so the gradient is the same sum
    shapes: list = []
    whole, m_whole, batch = _first_step_grads(8)
    parts, m_parts, _ = _first_step_grads(2, shapes)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for key in ("ppo/policy_loss", "value/loss", "ppo/entropy"):
        assert m_parts[key] == pytest.approx(m_whole[key], rel=1e-5)
    # and the micro-batches did less work than the padded batch: fewer columns x rows
    assert sum(rows * cols for rows, cols in shapes) < batch.input_ids.numel()
    assert shapes[0][1] < batch.input_ids.shape[1]  # the shortest rows ran narrower


def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_the_losses_fp32():
    policy = _policy(critic=True)
    trainer = _trainer(policy, _ppo("ppo.advantage_estimator=gae", "ppo.autocast=bfloat16"))
    batch = _batch(trainer, policy)
    dtypes = []
    q_proj = policy.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    q_proj.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    metrics = trainer.update(batch, iteration=0)
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in policy.policy_parameters())  # fp32 weights: the masters
    assert not trainer.masters.pairs and math.isfinite(metrics["ppo/policy_loss"])
    with trainer._precision():
        scored = policy.score(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids,
                              batch.response_mask, batch.prompt_length, 1.0, 4096, with_entropy=True)
    assert scored.logprobs.dtype == scored.entropy.dtype == scored.values.dtype == torch.float32


def test_gradient_checkpointing_switch_keeps_the_update():
    policy = _policy(critic=True)
    _trainer(policy, _ppo("ppo.advantage_estimator=gae", "ppo.gradient_checkpointing=true"))
    policy.train(False)  # as the update runs: dropout off, the decoder layers still checkpointing
    assert policy._checkpointed_layers and all(layer.training for layer in policy._checkpointed_layers)
    assert not policy.model.training
    plain, _, _ = _first_step_grads(4)
    checkpointed, _, _ = _first_step_grads(4, None, "ppo.gradient_checkpointing=true")
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_micro_batches_sized_by_tokens_change_no_gradient():
    whole, m_whole, _ = _first_step_grads(8)
    shapes: list = []
    budget, m_budget, _ = _first_step_grads(8, shapes, "ppo.micro_batch_tokens=20")
    assert len(shapes) > 2  # the no-grad pass and the update split the 8 rows by the budget
    for a, b in zip(whole, budget):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert m_budget["ppo/policy_loss"] == pytest.approx(m_whole["ppo/policy_loss"], rel=1e-5)


def test_an_entropy_bonus_reaches_the_gradient():
    # entropy_coef 0: the entropy is only logged (computed without a graph); > 0 it must move the step
    plain, m_plain, _ = _first_step_grads(8)
    bonus, m_bonus, _ = _first_step_grads(8, None, "ppo.entropy_coef=0.5")
    assert m_bonus["ppo/entropy"] == pytest.approx(m_plain["ppo/entropy"], rel=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, bonus)) > 1e-6


def _lora_factors(policy) -> list[torch.nn.Parameter]:
    return [p for name, p in policy.model.named_parameters() if "lora_" in name]


def test_bf16_lora_runs_bf16_factors_and_steps_fp32_masters():
    # peft upcasts a bf16 base's LoRA factors to fp32 by default; each LoRA layer then casts its bf16 input
    # to fp32 and runs fp32 GEMMs (no tensor cores), forward and backward. The policy keeps them in bf16.
    policy = _policy(critic=False, dtype=torch.bfloat16)
    factors = _lora_factors(policy)
    assert factors and all(p.dtype == torch.bfloat16 for p in factors)
    trainer = _trainer(policy, _ppo("ppo.lr=1e-2"))
    assert len(trainer.masters.pairs) == len(factors)  # every factor steps through an fp32 master
    assert all(p.dtype == torch.float32 for g in trainer.policy_optimizer.param_groups for p in g["params"])
    seen = []
    lora_a = policy.model.get_base_model().model.layers[0].self_attn.q_proj.lora_A[POLICY_ADAPTER]
    lora_a.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
    grads = _policy_grads_seen(trainer)
    trainer.update(_batch(trainer, policy), iteration=0)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    for param, master in trainer.masters.pairs:
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))  # the model holds the rounded master

    # the same step with the factors as peft made them before (fp32, their own masters): the gradient it
    # steps with is the same within bf16 rounding (Adam's first step, ~lr * sign(g), would magnify the
    # rounding of gradients near 0, so the gradients are what compares)
    before = _policy(critic=False, dtype=torch.bfloat16)
    cast_adapter_dtype(before.model, POLICY_ADAPTER)
    assert all(p.dtype == torch.float32 for p in _lora_factors(before))
    before_trainer = _trainer(before, _ppo("ppo.lr=1e-2"))
    assert not before_trainer.masters.pairs
    before_grads = _policy_grads_seen(before_trainer)
    before_trainer.update(_batch(before_trainer, before), iteration=0)
    assert len(grads[0]) == len(before_grads[0]) == len(factors)
    assert sum(float(g.norm()) > 0 for g in before_grads[0]) == len(factors) // 2  # B's (A's are 0 while B is 0)
    for grad, reference in zip(grads[0], before_grads[0]):
        assert grad.dtype == torch.float32
        assert float((grad - reference).norm()) <= 3e-2 * float(reference.norm())


def test_an_fp32_models_lora_factors_are_fp32_without_masters():
    policy = _policy(critic=False)
    assert all(p.dtype == torch.float32 for p in _lora_factors(policy))
    assert not _trainer(policy, _ppo()).masters.pairs


def test_ppo_compile_compiles_each_decoder_layer_in_place(monkeypatch):
    policy = _policy(critic=False)
    names = [name for name, _ in policy.model.named_parameters()]
    compile_kwargs = []
    compile_module = torch.nn.Module.compile

    def spy(module, *args, **kwargs):
        compile_kwargs.append(kwargs)
        return compile_module(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    _trainer(policy, _ppo("ppo.compile=true"))
    layers = policy.model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    # dynamic shapes from the first call: one graph for every micro-batch shape, no recompiles as widths vary
    assert compile_kwargs == [{"dynamic": True}] * len(layers)
    assert [name for name, _ in policy.model.named_parameters()] == names  # checkpoints keep their keys
    assert policy.model.get_base_model().model.embed_tokens._compiled_call_impl is None  # layers only


def test_ppo_compile_refuses_a_decoder_without_layers():
    policy = _policy(critic=False)
    policy.model.get_base_model().model.layers = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"ppo.compile: MistralForCausalLM's decoder has no `layers` list"):
        policy.compile_decoder_layers()


@pytest.mark.slow  # inductor compiles the layers' C++ kernels: ~1.5 min on 2 cores
def test_compiled_layers_give_the_eager_logprobs_and_gradients():
    policy = _policy(critic=True)
    trainer = _trainer(policy, _ppo("ppo.advantage_estimator=gae"))
    batch = _batch(trainer, policy)

    def scores_and_grads():
        scored = policy.score(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids,
                              batch.response_mask, batch.prompt_length, 1.0, 4, with_entropy=True)
        (scored.logprobs.sum() + scored.entropy.sum() + scored.values.sum()).backward()
        grads = [p.grad.clone() for p in policy.policy_parameters()]
        for p in policy.policy_parameters():
            p.grad = None
        return scored, grads

    policy.train(False)
    eager, eager_grads = scores_and_grads()
    policy.compile_decoder_layers()
    compiled, compiled_grads = scores_and_grads()
    assert policy.model.get_base_model().model.layers[0]._compiled_call_impl is not None
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert any(float(g.abs().max()) > 0 for g in eager_grads)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
