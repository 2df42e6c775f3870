"""Steps 3 and 4 of a PPO iteration: the rollout assembled into a `TrainBatch` (`AssembleSteps`, a part of
`PPOTrainer`, ppo/loop.py).

The no-grad pass scores the policy, the reference (adapters off) and the critic in exactly the
micro-batches the update's first epoch will run (`plan`: the same rows, widths and logit chunks,
so the first minibatch's ratio is 1 to the bit in any dtype; under N ranks each rank its turns,
`ranks.deal`, with the rows summed over the ranks after); then the in-reward KL, and the
advantages from the reward terms (`ppo/advantages.py`: the task advantages normalised, the KL pull
added after at kl_coef, the same in every arm). With `drop_uniform_groups`, the rows of a prompt
whose samples were all right or all wrong are masked out of the update. An update of one optimizer step
(`old_from_update`) needs no policy pass here for its rows: it takes their old logprobs, and the KL pull of
their advantages, from its own forward, and the metrics of the old logprobs follow it (`old_policy_metrics`).
"""

from __future__ import annotations

import torch

from prmppo.models.token_scores import response_positions
from prmppo.ppo import advantages as advantages_rule
from prmppo.ppo import maths
from prmppo.ppo.batch import (IDLE_PASS_ROWS, RolloutBatch, TrainBatch, UpdatePlan, length_buckets, plan_update,
                              trim_columns)
from prmppo.rewards.kl import kl_estimate


class _OnDevice:
    """A rollout's token tensors and a response mask copied to `device` once (`host_mask` keeps the mask as
    given, for `trim_columns`)."""

    def __init__(self, batch: RolloutBatch, mask: torch.Tensor, device: torch.device) -> None:
        self.input_ids, self.attention_mask, self.position_ids, self.response_ids = (
            t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids))
        self.host_mask, self.mask = mask, mask.to(device)


class AssembleSteps:
    """The assembly of an iteration's batch, on the trainer's policy, settings (`ppo`), ranks and device."""

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
                           ppo.micro_batch_tokens, generator, self.width_multiple)

    def old_from_update(self, plan: UpdatePlan) -> bool:
        """True when the update takes one optimizer step (one epoch of one minibatch), without a critic, on one
        rank: the policy it steps from is then the sampling policy as its own forward scores it, to the bit
        (the same micro-batches as the no-grad pass, `plan`), so the no-grad pass leaves the policy out for the
        rows the update learns from, and the update takes their old logprobs, and with them the KL pull of their
        advantages, from its forward (`TrainBatch.old_from_update`). `GRPOTrainer` likewise skips the old
        logprobs when one optimizer step takes each generation batch. The first minibatch's ratio is then 1 by
        construction (`ppo/first_minibatch_ratio_dev` 0): no second pass exists to disagree with it."""
        return (len(plan.epochs) == 1 and len(plan.epochs[0]) == 1 and not self.uses_critic
                and self.ranks.world_size == 1)

    @torch.no_grad()
    def _forward_no_grad(self, batch: RolloutBatch, micro_batches: list, response_mask: torch.Tensor,
                         policy: bool = True):
        """(old logprobs, reference logprobs, values, value after each row's last token), all [B, T] / [B],
        for the rows of `micro_batches` (this rank's row index tensors, from `ranks.deal`; other rows stay 0
        here and come from the other ranks: disjoint rows, so a sum over the ranks gathers them exactly).
        Each micro-batch is cut to the columns `response_mask` [B, T] uses (`trim_columns`, widened to a
        multiple of `width_multiple` for compiled layers) and scored at its tokens, exactly as the update cuts
        and scores a micro-batch of a TrainBatch with that mask. The reference logprobs run in the same
        micro-batches (they only enter the KL terms, so any grouping would do). A None entry is a turn this
        rank has no rows for (`ranks.idle_pass`).

        The rollout's token tensors and `response_mask` go to the device once, here; each micro-batch is cut
        from those copies, its columns read off the host's masks: a copy from the host per micro-batch would
        make the host wait for the device's queue to drain every time (a blocking copy synchronises). Without
        `policy` only the reference runs: the old logprobs stay 0 (the update's, `old_from_update`)."""
        dev = self.device
        on_device, idle_inputs = _OnDevice(batch, response_mask, dev), None
        old_lp = torch.zeros(batch.response_ids.shape, device=dev)  # [B, T]
        ref_lp, values = torch.zeros_like(old_lp), torch.zeros_like(old_lp)  # [B, T]
        after = torch.zeros(len(batch), device=dev)  # [B]
        self.policy.train(False)
        for rows in micro_batches:
            if rows is None:  # N ranks: the others run a micro-batch now, and FSDP's gathers need this rank too
                if idle_inputs is None:  # its first row, cut by the rollout's own mask
                    idle_inputs = on_device if response_mask is batch.response_mask else \
                        _OnDevice(batch, batch.response_mask, dev)
                first = torch.zeros(IDLE_PASS_ROWS, dtype=torch.long)  # on the host, and made on the device: no copy
                on_dev = torch.zeros_like(first, device=dev)
                self.ranks.idle_pass(lambda: self._score_rows(batch, idle_inputs, first, on_dev, policy))
                continue
            index = rows.to(dev, non_blocking=True)
            scored, ref, micro_mask, plen = self._score_rows(batch, on_device, rows, index, policy)
            width = micro_mask.shape[1]
            ref_lp[index, :width] = ref
            if scored is not None:
                old_lp[index, :width] = scored.logprobs
            if scored is not None and scored.values is not None:
                values[index, :width] = scored.values[:, plen - 1:plen - 1 + width]  # V(s_t): before response token t
                lengths = micro_mask.sum(-1).long()  # [b]
                after[index] = scored.values.gather(1, (plen - 1 + lengths)[:, None]).squeeze(1)  # after the last token
        critic = self.policy.value_head is not None
        gathered = [self.ranks.sum_rows(t) for t in (old_lp, ref_lp, values, after)]  # every rank's rows
        return gathered[0], gathered[1], gathered[2] if critic else None, gathered[3] if critic else None

    def _score_rows(self, batch: RolloutBatch, on_device: "_OnDevice", rows: torch.Tensor, index: torch.Tensor,
                    policy: bool = True):
        """Policy scores (None without `policy`), reference logprobs [b, T'], the micro-batch's mask [b, T'] and
        its prompt length P' for `rows` [b] of `batch` (`index`: the same rows on the device), cut to the columns
        `on_device.mask` uses (read off its host copy)."""
        ppo = self.ppo
        columns, width, plen = trim_columns(batch.attention_mask[rows], on_device.host_mask[rows],
                                            batch.prompt_length, self.width_multiple)
        # contiguous rows on every device, as the update's micro-batches are (`TrainBatch.trimmed` says why)
        ids, att, pos = (t[index][:, columns].contiguous() for t in (on_device.input_ids, on_device.attention_mask,
                                                                     on_device.position_ids))
        response_ids, micro_mask = (t[index, :width] for t in (on_device.response_ids, on_device.mask))
        positions = response_positions(on_device.host_mask[rows][:, :width], self.device)  # [n] read on the host
        scored = None
        with self._precision():
            # compiled layers: the policy's scores come from the graph the update's forward runs (grad mode),
            # detached at once; a no-grad graph is another compilation, whose kernels round differently
            with torch.enable_grad() if ppo.compile else torch.no_grad():
                if policy:
                    scored = self.policy.score(ids, att, pos, response_ids, micro_mask, plen, ppo.temperature,
                                               ppo.logit_chunk_tokens, positions=positions)
            scored = scored if scored is None else type(scored)(*(None if t is None else t.detach() for t in scored))
            ref = self.policy.reference_score(ids, att, pos, response_ids, micro_mask, plen, ppo.temperature,
                                              ppo.logit_chunk_tokens, positions=positions)
        return scored, ref, micro_mask, plen

    def _length_bucketed(self, batch: RolloutBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` [r] of `batch` in length buckets (row indices into `batch`)."""
        buckets = length_buckets(batch.attention_mask[rows], batch.response_mask[rows], self.ppo.micro_batch_rows,
                                 self.ppo.micro_batch_tokens, self.width_multiple)
        return [rows[bucket] for bucket in buckets]

    def _old_and_reference(self, batch: RolloutBatch, plan: UpdatePlan, keep: torch.Tensor, policy: bool = True):
        """`_forward_no_grad` over every row. The rows the update learns from run in exactly the
        micro-batches of the update's first epoch (same rows, order, trimmed widths and logit chunks;
        under N ranks each rank the ones `ranks.deal` gives it of each minibatch, as the update does),
        so the first minibatch's ratio is 1 to the bit on every rank whatever shape-dependent rounding
        the kernels do (`ppo/first_minibatch_ratio_dev`). The rows of dropped groups (`keep` [B] 0), which
        only enter the KL metrics and the critic's return statistics, run afterwards in their own length
        buckets. Without `policy` the update's rows get no old logprobs here (`old_from_update`); the dropped rows
        always do."""
        kept = keep.cpu().bool()  # [B]
        update_mask = batch.response_mask * kept[:, None]  # [B, T] as the update will see it
        micro_batches = [rows if rows is not None and kept[rows].any() else None
                         for minibatch in plan.epochs[0] for rows in self.ranks.deal(list(minibatch.micro_batches))]
        scores = self._forward_no_grad(batch, micro_batches, update_mask, policy)
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
        one_step = self.old_from_update(plan)
        old_lp, ref_lp, values, after = self._old_and_reference(batch, plan, keep, policy=not one_step)
        mask = batch.response_mask.to(dev)
        kl = None if one_step else kl_estimate(old_lp, ref_lp, ppo.kl_estimator) * mask  # [B, T]
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
        # one_step: the task part alone (kl None), a copy the update completes in place with the KL pull of its
        # old logprobs
        advantages = out.task.clone() if one_step else out.advantages
        returns, mask, self.task_advantages = out.returns, update_mask, out.task
        metrics["adv/task_scale"] = out.task_scale
        if self.uses_critic:
            metrics.update({"value/mean": float(maths.masked_mean(values, batch.response_mask.to(dev))),
                            "value/explained_variance": maths.explained_variance(values, returns,
                                                                                 batch.response_mask.to(dev))})
            # PopArt; the old values as the head predicts them after the statistics move
            values = self.policy.value_head.update_return_stats(returns, batch.response_mask.to(dev), values)
        else:
            values = returns = torch.zeros_like(mask)
        metrics.update(advantages_rule.identical_group_share(out.task, batch.response_ids.to(dev), mask,
                                                             ppo.n_samples_per_prompt))
        train = TrainBatch(batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.position_ids.to(dev),
                           batch.response_ids.to(dev), mask, old_lp, ref_lp, values, advantages, returns,
                           batch.prompt_length, old_from_update=one_step)
        if not one_step:  # else after the update (`PPOTrainer.iteration`), once it has taken the old logprobs
            metrics.update(self.old_policy_metrics(batch, train, out.task))
        return train, metrics

    def old_policy_metrics(self, batch: RolloutBatch, train: TrainBatch, task: torch.Tensor) -> dict:
        """The metrics read off the old logprobs: the KL to the reference, the engine's gap to them, the KL's
        weight in the advantages and their means by quarter. `task` [B, T] is the task part of `train.advantages`."""
        ppo, dev = self.ppo, self.device
        mask = batch.response_mask.to(dev)
        kl = kl_estimate(train.old_logprobs, train.ref_logprobs, ppo.kl_estimator) * mask  # [B, T]
        metrics = {"ppo/kl_ref": float(maths.masked_sum(kl, mask) / mask.shape[0]),
                   "rollout/engine_logprob_abs_diff":
                       float(maths.masked_mean((batch.engine_logprobs.to(dev) - train.old_logprobs).abs(), mask)),
                   "kl/effective_coef": advantages_rule.effective_kl_coef(train.advantages, task, kl,
                                                                          train.response_mask, ppo.gamma)}
        metrics.update(advantage_by_quarter(train.advantages, train.response_mask, batch.outcome.to(dev)))
        return metrics

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


def advantage_by_quarter(advantages: torch.Tensor, mask: torch.Tensor, outcome: torch.Tensor) -> dict:
    """Mean advantage of right (and of wrong) responses in each quarter of their own length:
    `adv/right_q1` .. `adv/right_q4`, `adv/wrong_q1` .. `adv/wrong_q4` (absent when no such token).
    A right response whose late tokens get negative advantage is being credited by position.
    The eight sums (float64) and token counts are read off the device at once."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    position = torch.arange(mask.shape[1], device=mask.device)[None, :]  # [1, T]
    quarter = (position * 4 // lengths).clamp(max=3).long()  # [B, T] 0..3 within each row
    cell = (outcome <= 0.5).long()[:, None] * 4 + quarter  # [B, T] 0..3 a right row's quarters, 4..7 a wrong one's
    member = torch.nn.functional.one_hot(cell, 8).double() * mask.bool()[..., None]  # [B, T, 8]
    sums = (member * advantages.double()[..., None]).sum((0, 1))  # [8]
    sums, counts = torch.stack([sums, member.sum((0, 1))]).tolist()
    return {f"adv/{name}_q{q + 1}": sums[4 * k + q] / counts[4 * k + q]
            for k, name in enumerate(("right", "wrong")) for q in range(4) if counts[4 * k + q] > 0}
