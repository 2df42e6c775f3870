"""The PPO loop, identical for both arms: the reward object fills its terms, nothing else differs.

One iteration (`PPOTrainer.iteration`) reads like the algorithm:
  1. sample   prompts_per_iteration x n_samples_per_prompt responses from the rollout worker,
              with the weights it was last synced to; prompts cycle through a seeded permutation of
              the RL prompts (the task's `train` split, or a pass-rate band of it: stages/band.py);
  2. score    outcome verifier + the arm's reward object -> reward terms [B, T] (rewards/terms.py);
  3. assemble policy / reference logprobs and values with no grad, in the micro-batches the update's
              first epoch will run (`plan`: the same rows, widths and logit chunks, so the first
              minibatch's ratio is exactly 1 in any dtype); the in-reward KL;
  4. advantages: the task advantages from the reward terms alone, GAE with decoupled lambdas (lam_actor
              for advantages, lam_critic for targets; rows cut at max_new_tokens bootstrap from the value
              at the cut), or a group baseline (rloo / grpo) that compares each reward term step with step
              against the prompt's other samples; normalised; then the KL pull added at kl_coef, unscaled,
              so both arms are held to the reference alike (ppo/advantages.py); with
              `drop_uniform_groups`, the rows of a prompt whose samples the verifier scored all
              right or all wrong are masked out of the update (every loss and its denominators);
  5. update   ppo_epochs over minibatches of micro-batches (rows of similar length, each cut to its
              longest row; logprobs from the hidden states in chunks, models/token_scores.py),
              clipped losses, one policy and one
              value optimizer step per minibatch (only the critic during value warmup); the two
              gradients are clipped and checked for finiteness separately;
  6. sync     ship the new weights to the engine every `sync_every_iterations`; log.

The critic exists only for `advantage_estimator=gae`. Old logprobs and the update both run with
dropout off, so the first minibatch's ratio is exactly 1 whatever `lora.dropout` says. Written
for N ranks (`ranks`, distributed/ranks.py; one process by default): every rank holds the whole batch, so
loss denominators (explicit minibatch token counts), whitening and group statistics are global;
each rank runs its turns of each planned minibatch's micro-batches (`ranks.deal`, in the no-grad
pass as in the update, so every rank's first ratio is exactly 1), and summing the micro-batches'
gradients over the ranks gives the exact minibatch mean; only rank 0 talks to the rollout worker. A minibatch left without a
response token (all its rows dropped) takes no optimizer step but still advances the LR schedule,
so the schedule ends where the planned policy steps end; an iteration whose every group is dropped
updates nothing (`ppo/update_skipped`; one rank only). Simplifications: dropped groups are not
resampled (DAPO refills the batch), and their rows still go through the forward passes of assemble.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from prmppo.distributed.ranks import OneProcess
from prmppo.errors import PrmppoError
from prmppo.guards.tripwires import SkipBudget
from prmppo.logger.console import progress
from prmppo.ppo import advantages as advantages_rule
from prmppo.ppo import maths
from prmppo.ppo.batch import (Minibatch, RolloutBatch, TrainBatch, UpdatePlan, collate, length_buckets, pad_floats,
                              plan_update, trim_columns)
from prmppo.ppo.optim import MasterWeights, adamw
from prmppo.ppo.sync import WeightSync
from prmppo.rewards.kl import kl_estimate
from prmppo.rollout.protocol import RolloutRequest

ADAM_BETAS = (0.9, 0.95)
log = logging.getLogger("prmppo")


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


def count_policy_steps(ppo) -> int:
    """The policy optimizer steps the update loop will take, counted the way it iterates: every
    iteration past the value warmup, every epoch, one step per `minibatch_rows` slice of the rows."""
    rows = ppo.prompts_per_iteration * ppo.n_samples_per_prompt
    slices = len(range(0, rows, ppo.minibatch_rows))  # what `perm.split(minibatch_rows)` yields
    return sum(slices for it in range(ppo.iterations) if it >= ppo.value_warmup_iterations
               for _ in range(ppo.ppo_epochs))


def check_horizon(scheduler_steps: int, loop_steps: int, ppo) -> None:
    """The scheduler's horizon (from `Shape`) must equal the loop's own count of policy steps."""
    if scheduler_steps != loop_steps:
        raise HorizonError(
            f"the LR schedule spans {scheduler_steps} steps but the update loop takes {loop_steps} policy "
            f"optimizer steps (ppo.iterations {ppo.iterations}, ppo.value_warmup_iterations "
            f"{ppo.value_warmup_iterations}, ppo.ppo_epochs {ppo.ppo_epochs}, ppo.minibatch_rows "
            f"{ppo.minibatch_rows} of {ppo.prompts_per_iteration * ppo.n_samples_per_prompt} rows)")


@contextmanager
def _timer(times: dict, key: str):
    start = time.time()
    yield
    times[key] = time.time() - start


# losses summed over the micro-batches of a minibatch (each is a share of the minibatch's loss);
# every other statistic is a per-micro-batch mean
_ADDITIVE = ("ppo/policy_loss", "ppo/entropy", "ppo/kl_loss", "value/loss")


class PPOTrainer:
    """Runs PPO iterations for any arm; components arrive built, settings as values."""

    def __init__(self, *, policy, tokenizer, task, reward, engine, sync: WeightSync, ppo, logger,
                 device: torch.device, seed: int, show_progress: bool = False, prompts: list | None = None,
                 ranks=None):
        # the training ranks (distributed/ranks.py): the rows this process runs, global sums; one process by default
        self.ranks = ranks if ranks is not None else OneProcess(device)
        self.show_progress = show_progress  # a bar over the update's optimizer steps (interactive only)
        self.policy, self.tokenizer, self.task, self.reward = policy, tokenizer, task, reward
        self.engine, self.sync, self.ppo, self.logger = engine, sync, ppo, logger
        self.device, self.seed = device, seed
        self.uses_critic = ppo.advantage_estimator == "gae"
        if self.uses_critic != (policy.value_head is not None):
            raise ValueError(f"ppo.advantage_estimator={ppo.advantage_estimator} "
                             f"{'needs' if self.uses_critic else 'must not have'} a value head on the policy")
        self.shape = Shape.derive(ppo)
        self.masters = MasterWeights(policy.policy_param_groups(ppo.lr))
        self.policy_optimizer = adamw(self.masters.groups, ppo.lr, ADAM_BETAS)
        self.value_optimizer = adamw(policy.value_parameters(), ppo.value_lr, ADAM_BETAS) if self.uses_critic else None
        if ppo.gradient_checkpointing:
            policy.enable_gradient_checkpointing()
        if ppo.compile:
            policy.compile_decoder_layers()
        self.scheduler = maths.make_scheduler(self.policy_optimizer, self.shape.policy_steps,
                                              min(ppo.warmup_steps, max(self.shape.policy_steps - 1, 0)),
                                              ppo.min_lr_ratio)
        check_horizon(self.shape.policy_steps, count_policy_steps(ppo), ppo)
        self.policy_steps_taken = 0
        self.skipped_steps = 0
        self.skip_budget = SkipBudget(ppo.max_consecutive_skipped_steps, ppo.max_skipped_fraction,
                                      ppo.iterations * ppo.ppo_epochs * self.shape.minibatches_per_epoch)
        self.prompts = list(prompts) if prompts is not None else task.problems("train")  # the RL prompts
        self.order = torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(seed))

    # ------------------------------------------------------------------ 1. sample
    def sample(self, iteration: int, prompts: list | None = None, n_samples: int | None = None,
               request_id: str | None = None) -> RolloutBatch:
        """This iteration's prompts (or `prompts`) sampled by the engine with the served weights."""
        ppo, tok = self.ppo, self.tokenizer
        start = iteration * ppo.prompts_per_iteration
        picked = prompts if prompts is not None else [self.prompts[int(self.order[(start + i) % len(self.prompts)])]
                                                      for i in range(ppo.prompts_per_iteration)]
        n = n_samples or ppo.n_samples_per_prompt
        prompt_ids = [tok(self.task.format_prompt(p))["input_ids"] for p in picked]
        result = self.engine.generate(RolloutRequest(
            request_id=request_id or f"it{iteration:06d}", weights=self.sync.served, prompt_token_ids=prompt_ids,
            n_samples_per_prompt=n, max_new_tokens=ppo.max_new_tokens,
            temperature=ppo.temperature, top_p=ppo.top_p, seed=self.seed * 1_000_003 + iteration,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        problems = [p for p in picked for _ in range(n)]
        rows_prompt = [ids for ids in prompt_ids for _ in range(n)]
        input_ids, attention, positions, response_ids, response_mask, plen = collate(
            rows_prompt, result.token_ids, tok.pad_token_id)
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in result.token_ids]
        outcome = torch.tensor([float(self.task.verify(p, t)) for p, t in zip(problems, texts)])
        return RolloutBatch(problems, texts, list(result.finish_reasons), input_ids, attention, positions,
                            response_ids, response_mask, pad_floats(result.logprobs, response_ids.shape[1]),
                            outcome, plen)

    def engine_gap_at_identical_weights(self, n_prompts: int = 8) -> float:
        """Mean |engine - trainer| logprob per response token while both hold the same weights: the
        noise floor of this run's dtype and kernels, measured on a few train prompts."""
        batch = self.ranks.from_main(lambda: self.sample(0, prompts=self.prompts[:n_prompts], n_samples=1,
                                                         request_id="engine-gap-probe"))
        micro_batches = self.ranks.deal(self._length_bucketed(batch, torch.arange(len(batch))))
        old_lp, _, _, _ = self._forward_no_grad(batch, micro_batches, batch.response_mask)
        return float(maths.masked_mean((batch.engine_logprobs.to(self.device) - old_lp).abs(),
                                       batch.response_mask.to(self.device)))

    # ------------------------------------------------------------------ 3. assemble (+ 4. advantages)
    def _precision(self):
        """The forwards' precision context: bf16 autocast with `ppo.autocast=bfloat16` (weights stay in
        model.dtype, so fp32 weights are their own master copy), else the weights' own dtype."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.ppo.autocast == "bfloat16")

    def plan(self, batch: RolloutBatch, iteration: int) -> UpdatePlan:
        """This iteration's minibatches and micro-batches (seeded by the run's seed and the iteration),
        made once and used by both the no-grad pass of step 3 and the update of step 5."""
        keep, _ = self._kept_rows(batch)
        return self._plan_from_masks(batch.attention_mask, batch.response_mask * keep.cpu()[:, None], iteration)

    def _plan_from_masks(self, attention_mask, update_mask, iteration: int) -> UpdatePlan:
        ppo = self.ppo
        generator = torch.Generator().manual_seed(self.seed * 7919 + iteration)
        return plan_update(attention_mask, update_mask, ppo.ppo_epochs, ppo.minibatch_rows, ppo.micro_batch_rows,
                           ppo.micro_batch_tokens, generator)

    @torch.no_grad()
    def _forward_no_grad(self, batch: RolloutBatch, micro_batches: list, response_mask: torch.Tensor):
        """(old logprobs, reference logprobs, values, value after each row's last token), all [B, T] / [B],
        for the rows of `micro_batches` (this rank's row index tensors, from `ranks.deal`; other rows stay 0
        here and come from the other ranks: disjoint rows, so a sum over the ranks gathers them exactly).
        Each micro-batch is cut to the columns `response_mask` [B, T] uses (`trim_columns`) and scored at
        its tokens, exactly as the update cuts and scores a micro-batch of a TrainBatch with that mask. The
        reference logprobs run in the same micro-batches (they only enter the KL terms, so any grouping
        would do). A None entry is a turn this rank has no rows for (`ranks.idle_pass`)."""
        dev = self.device
        old_lp = torch.zeros(batch.response_ids.shape, device=dev)  # [B, T]
        ref_lp, values = torch.zeros_like(old_lp), torch.zeros_like(old_lp)  # [B, T]
        after = torch.zeros(len(batch), device=dev)  # [B]
        self.policy.train(False)
        for rows in micro_batches:
            if rows is None:  # N ranks: the others run a micro-batch now, and FSDP's gathers need this rank too
                self.ranks.idle_pass(lambda: self._score_rows(batch, torch.zeros(1, dtype=torch.long),
                                                              batch.response_mask))
                continue
            scored, ref, micro_mask, plen = self._score_rows(batch, rows, response_mask)
            width = micro_mask.shape[1]
            rows = rows.to(dev)
            old_lp[rows, :width], ref_lp[rows, :width] = scored.logprobs, ref
            if scored.values is not None:
                values[rows, :width] = scored.values[:, plen - 1:plen - 1 + width]  # V(s_t): before response token t
                lengths = micro_mask.sum(-1).long()  # [b]
                after[rows] = scored.values.gather(1, (plen - 1 + lengths)[:, None]).squeeze(1)  # after the last token
        critic = self.policy.value_head is not None
        gathered = [self.ranks.sum_rows(t) for t in (old_lp, ref_lp, values, after)]  # every rank's rows
        return gathered[0], gathered[1], gathered[2] if critic else None, gathered[3] if critic else None

    def _score_rows(self, batch: RolloutBatch, rows: torch.Tensor, response_mask: torch.Tensor):
        """Policy scores, reference logprobs [b, T'], the micro-batch's mask [b, T'] and its prompt length P'
        for `rows` [b] of `batch`, cut to the columns `response_mask` uses."""
        dev, ppo = self.device, self.ppo
        columns, width, plen = trim_columns(batch.attention_mask[rows], response_mask[rows], batch.prompt_length)
        ids, att, pos = (t[rows][:, columns].to(dev) for t in (batch.input_ids, batch.attention_mask,
                                                              batch.position_ids))
        response_ids, micro_mask = (t[rows, :width].to(dev) for t in (batch.response_ids, response_mask))
        with self._precision():
            # compiled layers: the policy's scores come from the graph the update's forward runs (grad mode),
            # detached at once; a no-grad graph is another compilation, whose kernels round differently
            with torch.enable_grad() if ppo.compile else torch.no_grad():
                scored = self.policy.score(ids, att, pos, response_ids, micro_mask, plen, ppo.temperature,
                                           ppo.logit_chunk_tokens)
            scored = type(scored)(*(None if t is None else t.detach() for t in scored))
            ref = self.policy.reference_score(ids, att, pos, response_ids, micro_mask, plen, ppo.temperature,
                                              ppo.logit_chunk_tokens)
        return scored, ref, micro_mask, plen

    def _length_bucketed(self, batch: RolloutBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` [r] of `batch` in length buckets (row indices into `batch`)."""
        buckets = length_buckets(batch.attention_mask[rows], batch.response_mask[rows], self.ppo.micro_batch_rows,
                                 self.ppo.micro_batch_tokens)
        return [rows[bucket] for bucket in buckets]

    def _old_and_reference(self, batch: RolloutBatch, plan: UpdatePlan, keep: torch.Tensor):
        """`_forward_no_grad` over every row. The rows the update learns from run in exactly the
        micro-batches of the update's first epoch (same rows, order, trimmed widths and logit chunks;
        under N ranks each rank the ones `ranks.deal` gives it of each minibatch, as the update does),
        so the first minibatch's ratio is 1 to the bit on every rank whatever shape-dependent rounding
        the kernels do (`ppo/first_minibatch_ratio_dev`). The rows of dropped groups (`keep` [B] 0), which
        only enter the KL metrics and the critic's return statistics, run afterwards in their own length
        buckets."""
        kept = keep.cpu().bool()  # [B]
        update_mask = batch.response_mask * kept[:, None]  # [B, T] as the update will see it
        micro_batches = [rows if rows is not None and kept[rows].any() else None
                         for minibatch in plan.epochs[0] for rows in self.ranks.deal(list(minibatch.micro_batches))]
        scores = self._forward_no_grad(batch, micro_batches, update_mask)
        dropped = (~kept).nonzero().squeeze(1)  # [d]
        if not len(dropped):
            return scores
        rest = self._forward_no_grad(batch, self.ranks.deal(self._length_bucketed(batch, dropped)), batch.response_mask)
        is_dropped = (~kept).to(self.device)
        return tuple(None if a is None else torch.where(is_dropped.view(-1, *[1] * (a.dim() - 1)), b, a)
                     for a, b in zip(scores, rest))

    @torch.no_grad()
    def assemble(self, batch: RolloutBatch, rewards, plan: UpdatePlan) -> tuple[TrainBatch, dict]:
        """The TrainBatch of this iteration: old and reference logprobs and values from a no-grad pass over
        `plan`'s first-epoch micro-batches (the plan the update will run), rewards, advantages."""
        ppo, dev = self.ppo, self.device
        keep, metrics = self._kept_rows(batch)  # [B]
        old_lp, ref_lp, values, after = self._old_and_reference(batch, plan, keep)
        mask = batch.response_mask.to(dev)
        kl = kl_estimate(old_lp, ref_lp, ppo.kl_estimator) * mask  # [B, T]
        metrics.update({"ppo/kl_ref": float(maths.masked_sum(kl, mask) / mask.shape[0]),
                        "rollout/engine_logprob_abs_diff":
                            float(maths.masked_mean((batch.engine_logprobs.to(dev) - old_lp).abs(), mask))})
        update_mask = mask * keep[:, None]  # [B, T] the update's mask: dropped rows carry nothing
        settings = dict(estimator=ppo.advantage_estimator, group_size=ppo.n_samples_per_prompt, gamma=ppo.gamma,
                        whiten=ppo.whiten_advantages, group_std_floor=ppo.group_std_floor,
                        group_same_tol=ppo.group_same_tol,
                        lam_actor=ppo.lam_actor, lam_critic=ppo.lam_critic)
        if self.uses_critic:
            values = values * mask  # [B, T]
            truncated = torch.tensor([r == "length" for r in batch.finish_reasons], device=dev)  # [B]
            settings.update(values=values, bootstrap=torch.where(truncated, after, torch.zeros_like(after)))
        terms = [(term.values.to(dev), term.events.to(dev)) for term in rewards.terms.values()]
        # 4. task advantages normalised, then the KL pull at kl_coef (ppo/advantages.py: the same in every arm)
        out = advantages_rule.compute(terms, kl, mask, update_mask, kl_coef=ppo.kl_coef, **settings)
        without_kl = advantages_rule.compute(terms, kl, mask, update_mask, kl_coef=0.0, **settings)
        advantages, returns, mask = out.advantages, out.returns, update_mask
        metrics.update({"kl/effective_coef": advantages_rule.effective_kl_coef(advantages, without_kl.advantages, kl,
                                                                               mask, ppo.gamma),
                        "adv/task_scale": out.task_scale})
        if self.uses_critic:
            metrics.update({"value/mean": float(maths.masked_mean(values, batch.response_mask.to(dev))),
                            "value/explained_variance": maths.explained_variance(values, returns,
                                                                                 batch.response_mask.to(dev))})
            # PopArt; the old values as the head predicts them after the statistics move
            values = self.policy.value_head.update_return_stats(returns, batch.response_mask.to(dev), values)
        else:
            values = returns = torch.zeros_like(mask)
        metrics.update(advantage_by_quarter(advantages, mask, batch.outcome.to(dev)))
        metrics.update(advantages_rule.identical_group_share(advantages - out.kl_pull, batch.response_ids.to(dev), mask,
                                                             ppo.n_samples_per_prompt))
        train = TrainBatch(batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.position_ids.to(dev),
                           batch.response_ids.to(dev), mask, old_lp, ref_lp, values, advantages, returns,
                           batch.prompt_length)
        return train, metrics

    def _kept_rows(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """[B] 1 for the rows the update learns from, 0 for those of a dropped uniform group, and the
        share of uniform groups (`rollout/uniform_group_fraction`, with n_samples_per_prompt >= 2)."""
        n = self.ppo.n_samples_per_prompt
        keep = torch.ones(len(batch), device=self.device)  # [B]
        if n < 2:
            return keep, {}
        uniform = maths.uniform_groups(batch.outcome, n)  # [G]
        metrics = {"rollout/uniform_group_fraction": float(uniform.float().mean())}
        if self.ppo.drop_uniform_groups:
            keep = (~uniform).repeat_interleave(n).float().to(self.device)
            metrics.update({"ppo/dropped_groups": float(uniform.sum()),
                            "ppo/dropped_group_fraction": float(uniform.float().mean())})
        return keep, metrics

    # ------------------------------------------------------------------ 5. update
    def _micro_loss(self, mb: TrainBatch, tokens: float, seqs: float, train_policy: bool):
        ppo = self.ppo
        with self._precision():
            scored = self.policy.score(mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids,
                                       mb.response_mask, mb.prompt_length, ppo.temperature, ppo.logit_chunk_tokens,
                                       with_entropy=train_policy, entropy_grad=ppo.entropy_coef != 0)
        plen, width = mb.prompt_length, mb.response_ids.shape[1]
        counts = dict(global_token_count=tokens, global_seq_count=seqs, norm_length=float(ppo.max_new_tokens))
        loss, stats = 0.0, {}
        if self.uses_critic:
            head = self.policy.value_head  # the loss in normalised return units (ValueHead)
            v_loss, v_clip = maths.value_loss(head.normalise(scored.values[:, plen - 1:plen - 1 + width]),
                                              head.normalise(mb.old_values), head.normalise(mb.returns),
                                              mb.response_mask, ppo.value_clip, ppo.loss_agg, **counts)
            loss, stats = ppo.vf_coef * v_loss, {"value/loss": v_loss.detach(), "value/clip_fraction": v_clip}
        if train_policy:
            logprobs = scored.logprobs
            p_loss, pstats = maths.policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                               ppo.clip_low, ppo.clip_high, ppo.clip_c, ppo.loss_agg, **counts)
            ent = maths.aggregate(scored.entropy, mb.response_mask, ppo.loss_agg, **counts)
            loss = loss + p_loss - ppo.entropy_coef * ent
            if ppo.kl_loss_coef > 0:
                kl = maths.aggregate(kl_estimate(logprobs, mb.ref_logprobs, ppo.kl_loss_estimator), mb.response_mask,
                                     ppo.loss_agg, **counts)
                loss = loss + ppo.kl_loss_coef * kl
                stats["ppo/kl_loss"] = kl.detach()
            stats.update({"ppo/policy_loss": p_loss.detach(), "ppo/entropy": ent.detach(),
                          **{f"ppo/{k}": v for k, v in pstats._asdict().items()}})
        return loss, stats

    def update(self, train: TrainBatch, iteration: int, plan: UpdatePlan | None = None) -> dict:
        """ppo_epochs over `plan`'s minibatches (None: the plan `self.plan` gives for this iteration,
        made here from `train`'s masks)."""
        ppo, shape = self.ppo, self.shape
        train_policy = iteration >= ppo.value_warmup_iterations
        if plan is None:
            plan = self._plan_from_masks(train.attention_mask, train.response_mask, iteration)
        # host copies of the masks: each micro-batch's rows, columns and token counts are read from these,
        # so the loop below never waits for the device to answer a question about its own tensors
        host = (train.attention_mask.cpu(), train.response_mask.cpu())
        self.policy.train(False)  # dropout off, as when the old logprobs were taken: ratio 1 before any step
        sums: dict[str, float] = {}
        micro_count, steps, empty = 0, [], 0
        first_ratio = None
        bar = progress(total=ppo.ppo_epochs * shape.minibatches_per_epoch, desc="update", unit="step",
                       enabled=self.show_progress, leave=False)
        for epoch in plan.epochs:
            for minibatch in epoch:
                if host[1][minibatch.rows].any():
                    ran, ratio = self._accumulate(train, host, minibatch, train_policy, sums)
                    micro_count += ran
                    first_ratio = first_ratio or ratio
                    steps.append(self._step(train_policy))
                else:  # every row of it belongs to a dropped group: nothing to learn from
                    self._empty_step(train_policy)
                    empty += 1
                bar.update()
        bar.close()
        if not steps:
            log.info("ppo iteration %d: every group was dropped (all right or all wrong): no update", iteration)
        return self._update_metrics(sums, steps, micro_count, first_ratio, empty)

    def _accumulate(self, train: TrainBatch, host: tuple[torch.Tensor, torch.Tensor], minibatch: Minibatch,
                    train_policy: bool, sums: dict) -> tuple[int, tuple | None]:
        """Backward every micro-batch of `minibatch` that holds a response token, adding their statistics
        to `sums`; returns (micro-batches run, (ratio min, ratio max) of the first one when training the
        policy). `host` holds CPU copies of `train`'s attention and response masks, from which the
        micro-batches are cut; the statistics stay device tensors (`_update_metrics` reads them once)."""
        device = train.input_ids.device
        attention, update_mask = host
        response_mask = update_mask[minibatch.rows]  # [m, T]
        tokens = float(response_mask.sum())
        seqs = float((response_mask.sum(-1) > 0).sum())
        ran, ratio = 0, None
        for micro in self.ranks.deal(list(minibatch.micro_batches)):  # this rank's turns of the minibatch
            if micro is None or not update_mask[micro].any():  # no rows here, or only rows of dropped groups
                self.ranks.idle_pass(lambda: self._idle_micro(train, minibatch, tokens, seqs, train_policy, sums))
                continue
            # rows of similar length, no all-padding column
            cut = trim_columns(attention[micro], update_mask[micro], train.prompt_length)
            part = train.rows(micro.to(device, non_blocking=True)).trimmed(cut)
            loss, stats = self._micro_loss(part, tokens, seqs, train_policy)
            loss.backward()
            if ratio is None and train_policy:
                ratio = (stats["ppo/ratio_min"], stats["ppo/ratio_max"])
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + (value.detach() if isinstance(value, torch.Tensor) else value)
            ran += 1
        return ran, ratio

    def _idle_micro(self, train: TrainBatch, minibatch: Minibatch, tokens: float, seqs: float, train_policy: bool,
                    sums: dict) -> None:
        """A turn in which another rank runs a micro-batch and this one has none: forward and backward one
        row of the minibatch with the loss times 0, so that FSDP's gathers and gradient reductions meet
        on every rank while this rank adds nothing to the gradients; its statistics' keys join `sums` at 0
        (the sum over the ranks needs the same keys on each)."""
        part = train.rows(minibatch.rows[:1].to(train.input_ids.device)).trimmed()
        loss, stats = self._micro_loss(part, tokens, seqs, train_policy)
        (loss * 0.0).backward()
        for key in stats:
            sums.setdefault(key, 0.0)

    def _update_metrics(self, sums: dict, steps: list[dict], micro_count: int, first_ratio: tuple | None,
                        empty: int) -> dict:
        sums = {key: float(value) for key, value in sums.items()}  # the device's sums, read once per update
        first_ratio = None if first_ratio is None else (float(first_ratio[0]), float(first_ratio[1]))
        sums = self.ranks.sum_floats({**sums, "micro_count": micro_count})  # over every rank's micro-batches
        micro_count = sums.pop("micro_count")
        metrics = {key: value / (len(steps) if key in _ADDITIVE else max(micro_count, 1))
                   for key, value in sums.items()}
        for key in ("ppo/policy_grad_norm", "value/grad_norm", "ppo/lr"):
            ran = [step[key] for step in steps if key in step]
            if ran:
                metrics[key] = sum(ran) / len(ran)
        if steps:
            metrics.update({key: value for key, value in steps[-1].items() if key.startswith("ppo/lr_group")})
        if first_ratio is not None:
            metrics["ppo/first_minibatch_ratio_dev"] = max(abs(first_ratio[0] - 1), abs(first_ratio[1] - 1))
        if self.ppo.drop_uniform_groups:
            metrics.update({"ppo/empty_minibatches": float(empty), "ppo/update_skipped": float(not steps)})
        return metrics

    def _empty_step(self, train_policy: bool) -> None:
        """A minibatch without a response token: no gradient and no optimizer step, but the LR schedule
        advances (counted as a policy step), so it still ends where the run's planned policy steps end."""
        if train_policy:
            with warnings.catch_warnings():  # deliberate: this schedule step has no optimizer step
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before",
                                        category=UserWarning)
                self.scheduler.step()
            self.policy_steps_taken += 1

    def _step(self, train_policy: bool) -> dict:
        """Clip and check each gradient on its own, step what is finite; returns the pre-clip norms and
        the learning rate each policy group stepped with."""
        out: dict[str, float] = {}
        skipped = False
        if self.uses_critic:
            self.ranks.sum_grads(self.policy.value_parameters())  # replicated on every rank
            value_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.value_parameters(), self.ppo.grad_clip))
            out["value/grad_norm"] = value_norm
            if math.isfinite(value_norm):
                self.value_optimizer.step()
            else:
                skipped = True  # a non-finite gradient must never reach the weights
        if train_policy:
            self.masters.grads_to_masters()
            # the global norm: FSDP2's gradients are DTensors, whose norm is reduced over the ranks
            policy_norm = self.ranks.scalar(torch.nn.utils.clip_grad_norm_(self.masters.parameters(),
                                                                           self.ppo.grad_clip))
            out["ppo/policy_grad_norm"] = policy_norm
            for i, group in enumerate(self.policy_optimizer.param_groups):
                out["ppo/lr" if i == 0 else f"ppo/lr_group{i}"] = group["lr"]
            if math.isfinite(policy_norm):
                self.policy_optimizer.step()
                self.masters.masters_to_model()
            else:
                skipped = True
            self.scheduler.step()
            self.policy_steps_taken += 1
        self.skipped_steps += skipped
        self.policy_optimizer.zero_grad(set_to_none=True)
        for p in self.policy.policy_parameters():
            p.grad = None
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)
        self.skip_budget.record(skipped=skipped)  # raises TrainingAborted past a limit
        return out

    # ------------------------------------------------------------------ one iteration
    def iteration(self, iteration: int) -> dict:
        times: dict[str, float] = {}
        with _timer(times, "perf/generate_s"):
            batch = self.ranks.from_main(lambda: self.sample(iteration))  # 1 (rank 0 asks the engine)
        with _timer(times, "perf/score_s"):
            rewards, reward_metrics = self.reward(batch)  # 2
        with _timer(times, "perf/assemble_s"):
            plan = self.plan(batch, iteration)  # the update's micro-batches, which the no-grad pass runs too
            train, assemble_metrics = self.assemble(batch, rewards, plan)  # 3, 4
        with _timer(times, "perf/update_s"):
            update_metrics = self.update(train, iteration, plan)  # 5
        with _timer(times, "perf/sync_s"):
            synced = self.sync.maybe_sync(self.policy, iteration)  # 6
        lengths = batch.response_mask.sum(-1)
        return {"rollout/accuracy": float(batch.outcome.mean()),
                "reward/total_mean": float(rewards.total.sum(-1).mean()),
                "rollout/response_length": float(lengths.mean()),
                "rollout/truncated_fraction": sum(r == "length" for r in batch.finish_reasons) / len(batch),
                **reward_metrics, **assemble_metrics, **update_metrics, **times, "perf/synced": float(synced),
                "perf/rollout_tokens_per_s": float(lengths.sum()) / max(times["perf/generate_s"], 1e-9),
                "perf/iteration_s": sum(times.values())}


def advantage_by_quarter(advantages: torch.Tensor, mask: torch.Tensor, outcome: torch.Tensor) -> dict:
    """Mean advantage of right (and of wrong) responses in each quarter of their own length:
    `adv/right_q1` .. `adv/right_q4`, `adv/wrong_q1` .. `adv/wrong_q4` (absent when no such row).
    A right response whose late tokens get negative advantage is being credited by position."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    position = torch.arange(mask.shape[1], device=mask.device)[None, :]  # [1, T]
    quarter = (position * 4 // lengths).clamp(max=3)  # [B, T] 0..3 within each row
    out = {}
    for name, rows in (("right", outcome > 0.5), ("wrong", outcome <= 0.5)):
        if not rows.any():
            continue
        for q in range(4):
            where = mask.bool() & rows[:, None] & (quarter == q)
            if where.any():
                out[f"adv/{name}_q{q + 1}"] = float(advantages[where].mean())
    return out


def save_value_head(policy, path: Path) -> None:
    if policy.value_head is None:
        return  # no critic under a group baseline
    save_file({k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()}, str(path))
