"""Step 5 of a PPO iteration: `ppo_epochs` over the plan's minibatches of micro-batches (`UpdateSteps`, a
part of `PPOTrainer`, ppo/loop.py).

Each micro-batch (rows of similar length, cut to its longest row, or to the next multiple of 8
columns for compiled layers: ppo/batch.py; logprobs from the hidden states in chunks,
models/token_scores.py) adds its clipped policy loss, clipped value loss, entropy bonus
and KL loss to the minibatch's gradients; then one policy and one value optimizer step per
minibatch (only the critic during value warmup), each gradient clipped and checked for finiteness
on its own (one joint clip would let the critic's gradient set the policy's step size). Under N
ranks each rank runs its turns of the minibatch (`ranks.deal`) and a turn without rows runs an
idle pass, so FSDP's collectives meet. A minibatch without a response token takes no optimizer
step but still advances the LR schedule.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

from prmppo.logger.console import progress
from prmppo.models.token_scores import response_positions
from prmppo.ppo import advantages as advantages_rule
from prmppo.ppo import maths
from prmppo.ppo.batch import IDLE_PASS_ROWS, Minibatch, TrainBatch, UpdatePlan, trim_columns
from prmppo.rewards.kl import kl_estimate

log = logging.getLogger("prmppo")

# losses summed over the micro-batches of a minibatch (each is a share of the minibatch's loss);
# every other statistic is a per-micro-batch mean
_ADDITIVE = ("ppo/policy_loss", "ppo/entropy", "ppo/kl_loss", "value/loss")


class UpdateSteps:
    """The update of an iteration, on the trainer's policy, optimizers, scheduler, settings (`ppo`) and ranks."""

    def _micro_loss(self, mb: TrainBatch, tokens: float, seqs: float, train_policy: bool,
                    positions: torch.Tensor | None = None):
        """The loss of micro-batch `mb` and its statistics; `positions`: its response tokens' flat indices, from a
        host copy of its mask (`token_scores`; None reads them off the device)."""
        ppo = self.ppo
        with self._precision():
            scored = self.policy.score(mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids,
                                       mb.response_mask, mb.prompt_length, ppo.temperature, ppo.logit_chunk_tokens,
                                       with_entropy=train_policy, entropy_grad=ppo.entropy_coef != 0,
                                       positions=positions)
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
            logprobs, old, advantages = scored.logprobs, mb.old_logprobs, mb.advantages
            if mb.old_from_update:  # one optimizer step: this forward is the old policy's (TrainBatch)
                old = logprobs.detach()
                advantages = advantages + self._kl_pull(old, mb.ref_logprobs, mb.response_mask)
                self._taken = (old, advantages)
            p_loss, pstats = maths.policy_loss(logprobs, old, advantages, mb.response_mask,
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

    def _kl_pull(self, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The KL pull [b, T'] of rows whose old logprobs `old` [b, T'] the update's forward took: the rule of
        `advantages.kl_pull` on these rows (`mask` [b, T'] the update's tokens, which are all of a kept row's
        response), so the same bits as on the whole batch. On an accelerator its return-to-go reads the KL off
        the device (`estimators.gae`): one wait per micro-batch."""
        ppo = self.ppo
        kl = kl_estimate(old, ref, ppo.kl_estimator) * mask  # [b, T']
        return advantages_rule.kl_pull(kl, mask, mask, ppo.kl_coef, ppo.gamma)

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
            # rows of similar length, no all-padding column (compiled layers: a width of `width_multiple`s)
            micro_mask = update_mask[micro]  # [b, T] on the host
            cut = trim_columns(attention[micro], micro_mask, train.prompt_length, self.width_multiple)
            index = micro.to(device, non_blocking=True)
            part = train.rows(index).trimmed(cut)
            positions = response_positions(micro_mask[:, :cut[1]], device)  # [n] read on the host
            loss, stats = self._micro_loss(part, tokens, seqs, train_policy, positions)
            if part.old_from_update and train_policy:  # the TrainBatch completed: what the loss read
                # only the rows it learns from: a dropped group's row in this micro-batch has no update token, so
                # its logprobs here are 0, and its old logprobs (for the KL metrics) came from the no-grad pass
                learns = micro_mask.any(-1).nonzero().squeeze(1)  # [b'] positions in the micro-batch (host)
                width, into = part.response_ids.shape[1], micro[learns].to(device, non_blocking=True)
                old, advantages = (t[learns.to(device, non_blocking=True)] for t in self._taken)
                train.old_logprobs[into, :width], train.advantages[into, :width] = old, advantages
            loss.backward()
            if ratio is None and train_policy:
                ratio = (stats["ppo/ratio_min"], stats["ppo/ratio_max"])
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + (value.detach() if isinstance(value, torch.Tensor) else value)
            ran += 1
        return ran, ratio

    def _idle_micro(self, train: TrainBatch, minibatch: Minibatch, tokens: float, seqs: float, train_policy: bool,
                    sums: dict) -> None:
        """A turn in which another rank runs a micro-batch and this one has none: forward and backward the
        minibatch's first row (`IDLE_PASS_ROWS` times over) with the loss times 0, so that FSDP's gathers and
        gradient reductions meet on every rank while this rank adds nothing to the gradients; its statistics'
        keys join `sums` at 0 (the sum over the ranks needs the same keys on each)."""
        rows = minibatch.rows[:1].repeat(IDLE_PASS_ROWS).to(train.input_ids.device)  # [IDLE_PASS_ROWS]
        part = train.rows(rows).trimmed(multiple=self.width_multiple)
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
        for p in self.trained_parameters:
            p.grad = None
        if self.value_optimizer is not None:
            self.value_optimizer.zero_grad(set_to_none=True)
        self.skip_budget.record(skipped=skipped)  # raises TrainingAborted past a limit
        return out
