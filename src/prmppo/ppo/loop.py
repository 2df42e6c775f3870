"""The PPO loop, identical for both arms: the reward object fills `rewards [B, T]`, nothing else differs.

One iteration (`PPOTrainer.iteration`) reads like the algorithm:
  1. sample   prompts_per_iteration x n_samples_per_prompt responses from the rollout worker,
              with the weights it was last synced to;
  2. score    outcome verifier + the arm's reward object -> rewards [B, T];
  3. assemble policy / reference logprobs and values with no grad; KL into the reward;
  4. advantages: GAE with decoupled lambdas (lam_actor for advantages, lam_critic for targets),
              or a group baseline (rloo / grpo) from the prompt's other samples;
  5. update   ppo_epochs over minibatches of micro-batches, clipped losses, one policy and one
              value optimizer step per minibatch (only the critic during value warmup);
  6. sync     ship the new weights to the engine every `sync_every_iterations`; log.

Written for N ranks: loss denominators are explicit minibatch token counts, so gradient
accumulation over micro-batches (and, later, ranks) gives the exact minibatch mean; only this
process talks to the rollout worker. Simplifications: one rank, one device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prmppo.errors import PrmppoError
from prmppo.guards.tripwires import SkipBudget
from prmppo.logger.console import progress
from prmppo.ppo import maths
from prmppo.ppo.batch import RolloutBatch, TrainBatch, collate, pad_floats
from prmppo.ppo.sync import WeightSync
from prmppo.rewards.kl import kl_estimate
from prmppo.rollout.protocol import RolloutRequest


@dataclass(frozen=True)
class Shape:
    """The rollout and optimisation shape, derived once from the config."""

    rows_per_iteration: int
    minibatches_per_epoch: int
    micro_batches_per_minibatch: int
    policy_steps: int  # total policy optimizer steps of the run: the scheduler horizon

    @classmethod
    def derive(cls, ppo) -> "Shape":
        rows = ppo.prompts_per_iteration * ppo.n_samples_per_prompt
        minibatches = rows // ppo.minibatch_rows
        policy_iterations = ppo.iterations - ppo.value_warmup_iterations
        return cls(rows, minibatches, ppo.minibatch_rows // ppo.micro_batch_rows,
                   policy_iterations * ppo.ppo_epochs * minibatches)


class HorizonError(PrmppoError, ValueError):
    """The LR schedule would not end where the policy's optimizer steps end."""


def check_horizon(scheduler_steps: int, shape: Shape, ppo) -> None:
    if scheduler_steps != shape.policy_steps:
        raise HorizonError(
            f"the LR schedule spans {scheduler_steps} steps but the run takes {shape.policy_steps} policy "
            f"optimizer steps = (ppo.iterations {ppo.iterations} - ppo.value_warmup_iterations "
            f"{ppo.value_warmup_iterations}) * ppo.ppo_epochs {ppo.ppo_epochs} * minibatches per epoch "
            f"{shape.minibatches_per_epoch}")


class PPOTrainer:
    """Runs PPO iterations for any arm; components arrive built, settings as values."""

    def __init__(self, *, policy, tokenizer, task, reward, engine, sync: WeightSync, ppo, logger,
                 device: torch.device, seed: int, show_progress: bool = False):
        self.show_progress = show_progress  # a bar over the update's optimizer steps (interactive only)
        self.policy, self.tokenizer, self.task, self.reward = policy, tokenizer, task, reward
        self.engine, self.sync, self.ppo, self.logger = engine, sync, ppo, logger
        self.device, self.seed = device, seed
        self.shape = Shape.derive(ppo)
        self.policy_optimizer = torch.optim.AdamW(policy.policy_param_groups(ppo.lr), lr=ppo.lr, betas=(0.9, 0.95),
                                                  weight_decay=0.0)
        self.value_optimizer = torch.optim.AdamW(policy.value_parameters(), lr=ppo.value_lr, weight_decay=0.0)
        self.scheduler = maths.make_scheduler(self.policy_optimizer, self.shape.policy_steps,
                                              min(ppo.warmup_steps, max(self.shape.policy_steps - 1, 0)),
                                              ppo.min_lr_ratio)
        check_horizon(self.shape.policy_steps, self.shape, ppo)
        self.policy_steps_taken = 0
        self.skipped_steps = 0
        self.skip_budget = SkipBudget(ppo.max_consecutive_skipped_steps, ppo.max_skipped_fraction,
                                      ppo.iterations * ppo.ppo_epochs * self.shape.minibatches_per_epoch)
        self.prompts = task.problems("train")
        self.order = torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(seed))

    # ------------------------------------------------------------------ 1. sample
    def sample(self, iteration: int) -> RolloutBatch:
        ppo, tok = self.ppo, self.tokenizer
        start = iteration * ppo.prompts_per_iteration
        picked = [self.prompts[int(self.order[(start + i) % len(self.prompts)])]
                  for i in range(ppo.prompts_per_iteration)]
        prompt_ids = [tok(self.task.format_prompt(p))["input_ids"] for p in picked]
        result = self.engine.generate(RolloutRequest(
            request_id=f"it{iteration:06d}", weights=self.sync.served, prompt_token_ids=prompt_ids,
            n_samples_per_prompt=ppo.n_samples_per_prompt, max_new_tokens=ppo.max_new_tokens,
            temperature=ppo.temperature, top_p=ppo.top_p, seed=self.seed * 1_000_003 + iteration,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        n = ppo.n_samples_per_prompt
        problems = [p for p in picked for _ in range(n)]
        rows_prompt = [ids for ids in prompt_ids for _ in range(n)]
        input_ids, attention, positions, response_ids, response_mask, plen = collate(
            rows_prompt, result.token_ids, tok.pad_token_id)
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in result.token_ids]
        outcome = torch.tensor([float(self.task.verify(p, t)) for p, t in zip(problems, texts)])
        return RolloutBatch(problems, texts, list(result.finish_reasons), input_ids, attention, positions,
                            response_ids, response_mask, pad_floats(result.logprobs, response_ids.shape[1]),
                            outcome, plen)

    # ------------------------------------------------------------------ 3. assemble (+ 4. advantages)
    def _response_logprobs(self, logits: torch.Tensor, response_ids: torch.Tensor, prompt_length: int
                           ) -> torch.Tensor:
        width = response_ids.shape[1]
        scaled = logits[:, prompt_length - 1:prompt_length - 1 + width] / self.ppo.temperature  # [b, T, V]
        return maths.logprobs_from_logits(scaled, response_ids)  # [b, T]

    @torch.no_grad()
    def assemble(self, batch: RolloutBatch, rewards: torch.Tensor) -> tuple[TrainBatch, dict]:
        ppo, dev = self.ppo, self.device
        old_lp, ref_lp, values = [], [], []
        self.policy.train(False)
        for rows in torch.arange(len(batch)).split(ppo.micro_batch_rows):
            ids, att, pos = (t[rows].to(dev) for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
            response_ids = batch.response_ids[rows].to(dev)
            logits, vals = self.policy.forward(ids, att, pos)
            old_lp.append(self._response_logprobs(logits, response_ids, batch.prompt_length))
            ref_lp.append(self._response_logprobs(self.policy.reference_logits(ids, att, pos), response_ids,
                                                  batch.prompt_length))
            plen, width = batch.prompt_length, batch.response_ids.shape[1]
            values.append(vals[:, plen - 1:plen - 1 + width])
        mask = batch.response_mask.to(dev)
        old_lp, ref_lp = torch.cat(old_lp), torch.cat(ref_lp)  # [B, T]
        values = torch.cat(values) * mask  # [B, T]
        kl = kl_estimate(old_lp, ref_lp, ppo.kl_estimator) * mask  # [B, T]
        rewards = rewards.to(dev)
        if ppo.kl_placement == "reward":
            rewards = rewards - ppo.kl_coef * kl
        advantages, returns = maths.decoupled_gae(rewards, values, mask, ppo.gamma, ppo.lam_actor, ppo.lam_critic)
        if ppo.advantage_estimator != "gae":
            advantages = maths.group_baseline_advantages(rewards, mask, ppo.n_samples_per_prompt, ppo.gamma,
                                                         ppo.advantage_estimator)
        if ppo.whiten_advantages:
            advantages = maths.masked_whiten(advantages, mask)
        gap = maths.masked_mean((batch.engine_logprobs.to(dev) - old_lp).abs(), mask)
        metrics = {"ppo/kl_ref": float(maths.masked_sum(kl, mask) / mask.shape[0]),
                   "rollout/engine_logprob_abs_diff": float(gap),
                   "value/mean": float(maths.masked_mean(values, mask)),
                   "value/explained_variance": maths.explained_variance(values, returns, mask)}
        train = TrainBatch(batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.position_ids.to(dev),
                           batch.response_ids.to(dev), mask, old_lp, ref_lp, values, advantages, returns,
                           batch.prompt_length)
        return train, metrics

    # ------------------------------------------------------------------ 5. update
    def _micro_loss(self, mb: TrainBatch, tokens: float, seqs: float, train_policy: bool):
        ppo = self.ppo
        logits, values = self.policy.forward(mb.input_ids, mb.attention_mask, mb.position_ids)
        plen, width = mb.prompt_length, mb.response_ids.shape[1]
        values = values[:, plen - 1:plen - 1 + width]
        counts = dict(global_token_count=tokens, global_seq_count=seqs,
                      norm_length=float(ppo.max_new_tokens))
        v_loss, v_clip = maths.value_loss(values, mb.old_values, mb.returns, mb.response_mask, ppo.value_clip,
                                          ppo.loss_agg, **counts)
        loss, stats = ppo.vf_coef * v_loss, {"value/loss": v_loss.detach(), "value/clip_fraction": v_clip}
        if train_policy:
            logprobs = self._response_logprobs(logits, mb.response_ids, mb.prompt_length)
            p_loss, pstats = maths.policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                               ppo.clip_low, ppo.clip_high, ppo.clip_c, ppo.loss_agg, **counts)
            entropy = maths.entropy_from_logits(logits[:, plen - 1:plen - 1 + width].float() / ppo.temperature)
            ent = maths.aggregate(entropy, mb.response_mask, ppo.loss_agg, **counts)
            loss = loss + p_loss - ppo.entropy_coef * ent
            if ppo.kl_placement == "loss":
                kl = kl_estimate(logprobs, mb.ref_logprobs, ppo.kl_estimator)
                loss = loss + ppo.kl_coef * maths.aggregate(kl, mb.response_mask, ppo.loss_agg, **counts)
            stats.update({"ppo/policy_loss": p_loss.detach(), "ppo/entropy": ent.detach(),
                          **{f"ppo/{k}": v for k, v in pstats._asdict().items()}})
        return loss, stats

    def update(self, train: TrainBatch, iteration: int) -> dict:
        ppo, shape = self.ppo, self.shape
        train_policy = iteration >= ppo.value_warmup_iterations
        generator = torch.Generator().manual_seed(self.seed * 7919 + iteration)
        self.policy.train(True)
        sums: dict[str, float] = {}
        count = 0
        self._grad_norms: list[float] = []
        first_ratio = None
        bar = progress(total=ppo.ppo_epochs * shape.minibatches_per_epoch, desc="update", unit="step",
                       enabled=self.show_progress, leave=False)
        for epoch in range(ppo.ppo_epochs):
            perm = torch.randperm(shape.rows_per_iteration, generator=generator)
            for mb_rows in perm.split(ppo.minibatch_rows):
                mb_all = train.rows(mb_rows.to(train.input_ids.device))
                tokens = float(mb_all.response_mask.sum())
                seqs = float((mb_all.response_mask.sum(-1) > 0).sum())
                for micro in torch.arange(len(mb_rows)).split(ppo.micro_batch_rows):
                    loss, stats = self._micro_loss(mb_all.rows(micro.to(train.input_ids.device)), tokens, seqs,
                                                   train_policy)
                    loss.backward()
                    if first_ratio is None and train_policy:
                        first_ratio = (float(stats["ppo/ratio_min"]), float(stats["ppo/ratio_max"]))
                    for key, value in stats.items():
                        sums[key] = sums.get(key, 0.0) + float(value)
                    count += 1
                self._grad_norms.append(self._step(train_policy))
                bar.update()
        bar.close()
        self.policy.train(False)
        metrics = {key: value / max(count, 1) for key, value in sums.items()}
        metrics["ppo/grad_norm"] = sum(self._grad_norms) / max(len(self._grad_norms), 1)
        if first_ratio is not None:
            metrics["ppo/first_minibatch_ratio_dev"] = max(abs(first_ratio[0] - 1), abs(first_ratio[1] - 1))
        metrics["ppo/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _step(self, train_policy: bool) -> float:
        """Clip, then step the optimizers unless the gradient is non-finite; returns the norm."""
        params = self.policy.value_parameters() + (self.policy.policy_parameters() if train_policy else [])
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.ppo.grad_clip)
        finite = math.isfinite(float(grad_norm))
        if not finite:
            self.skipped_steps += 1  # a non-finite gradient must never reach the weights
        else:
            self.value_optimizer.step()
            if train_policy:
                self.policy_optimizer.step()
        if train_policy:
            self.scheduler.step()
            self.policy_steps_taken += 1
        self.policy_optimizer.zero_grad(set_to_none=True)
        self.value_optimizer.zero_grad(set_to_none=True)
        self.skip_budget.record(skipped=not finite)  # raises TrainingAborted past a limit
        return float(grad_norm)

    # ------------------------------------------------------------------ one iteration
    def iteration(self, iteration: int) -> dict:
        t0 = time.time()
        batch = self.sample(iteration)  # 1
        t1 = time.time()
        rewards, reward_metrics = self.reward(batch)  # 2
        t2 = time.time()
        train, assemble_metrics = self.assemble(batch, rewards)  # 3, 4
        t3 = time.time()
        update_metrics = self.update(train, iteration)  # 5
        t4 = time.time()
        synced = self.sync.maybe_sync(self.policy, iteration)  # 6
        t5 = time.time()
        lengths = batch.response_mask.sum(-1)
        tokens = float(lengths.sum())
        return {"rollout/accuracy": float(batch.outcome.mean()), "reward/total_mean": float(rewards.sum(-1).mean()),
                "rollout/response_length": float(lengths.mean()),
                "rollout/truncated_fraction": sum(r == "length" for r in batch.finish_reasons) / len(batch),
                **reward_metrics, **assemble_metrics, **update_metrics,
                "perf/generate_s": t1 - t0, "perf/score_s": t2 - t1, "perf/assemble_s": t3 - t2,
                "perf/update_s": t4 - t3, "perf/sync_s": t5 - t4, "perf/synced": float(synced),
                "perf/rollout_tokens_per_s": tokens / max(t1 - t0, 1e-9),
                "perf/iteration_s": t5 - t0}


def save_value_head(policy, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()}, str(path))
