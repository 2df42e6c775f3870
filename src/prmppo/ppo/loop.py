"""The PPO loop, identical for both arms: the reward object fills its terms, nothing else differs.

One iteration (`PPOTrainer.iteration`) reads like the algorithm:
  1. sample   prompts_per_iteration x n_samples_per_prompt responses from the rollout worker,
              with the weights it was last synced to; prompts cycle through a seeded permutation of
              the RL prompts (the task's `train` split, or a pass-rate band of it: stages/band.py);
  2. score    outcome verifier + the arm's reward object -> reward terms [B, T] (rewards/terms.py);
  3. assemble policy / reference logprobs and values with no grad, in the micro-batches the update's
              first epoch will run (`plan`: the same rows, widths and logit chunks, so the first
              minibatch's ratio is exactly 1 in any dtype); the in-reward KL. An update of one optimizer
              step (one epoch, one minibatch, no critic, one rank) takes the old logprobs of the rows it
              learns from from its own forward instead, the same bits (`AssembleSteps.old_from_update`);
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
for N ranks (`ranks`, `distributed/ranks.py`, given by the stage; one process alike): every rank
holds the whole batch, so loss denominators (explicit minibatch token counts), whitening and group
statistics are global; each rank runs its turns of each planned minibatch's micro-batches
(`ranks.deal`, in the no-grad pass as in the update, so every rank's first ratio is exactly 1), and
summing the micro-batches' gradients over the ranks gives the exact minibatch mean; only rank 0
talks to the rollout worker. A minibatch left without a response token (all its rows dropped)
takes no optimizer step but still advances the LR schedule, so the schedule ends where the planned
policy steps end; an iteration whose every group is dropped updates nothing
(`ppo/update_skipped`; one rank only). Simplifications: dropped groups are not resampled (DAPO
refills the batch), and their rows still go through the forward passes of assemble.

Modules: this one holds the shape, the horizon check, sampling (step 1) and the iteration; steps
3-4 are `ppo/assemble.py`, step 5 `ppo/update.py` (parts of `PPOTrainer`), the maths
`ppo/maths.py` and `ppo/advantages.py`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from prmppo.errors import PrmppoError
from prmppo.guards.tripwires import SkipBudget
from prmppo.ppo import maths
from prmppo.ppo.assemble import AssembleSteps
from prmppo.ppo.batch import COMPILED_WIDTH_MULTIPLE, RolloutBatch, collate, pad_floats
from prmppo.ppo.optim import MasterWeights, adamw
from prmppo.ppo.sync import WeightSync
from prmppo.ppo.update import UpdateSteps
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


class PPOTrainer(AssembleSteps, UpdateSteps):
    """Runs PPO iterations for any arm; components arrive built, settings as values. The iteration and the
    sampling are here; assembly (steps 3-4) is `AssembleSteps` (ppo/assemble.py), the update (step 5)
    `UpdateSteps` (ppo/update.py)."""

    def __init__(self, *, policy, tokenizer, task, reward, engine, sync: WeightSync, ppo, logger, seed: int, ranks,
                 show_progress: bool = False, prompts: list | None = None):
        # the training ranks (`distributed/ranks.py`: `OneProcess` or `TorchRanks`): the device, the rows this
        # process runs, global sums
        self.ranks, device = ranks, ranks.device
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
        # the policy's trained parameters, listed once: each optimizer step drops their gradients, and asking the
        # policy walks every named parameter of the model (at 0.5B under LoRA, 120 ms of the update's device-idle
        # gaps in an iteration profiled with `benchmarks/iteration_profile.py --stack`)
        self.trained_parameters = policy.policy_parameters()
        self.policy_optimizer = adamw(self.masters.groups, ppo.lr, ADAM_BETAS)
        self.value_optimizer = adamw(policy.value_parameters(), ppo.value_lr, ADAM_BETAS) if self.uses_critic else None
        if ppo.gradient_checkpointing:
            policy.enable_gradient_checkpointing()
        if ppo.compile:
            policy.compile_decoder_layers()
        # every sequence width the compiled layers see is a multiple of this (ppo/batch.py: a width of the
        # other kind would compile another graph mid-run); uncompiled, the micro-batches keep their exact cuts
        self.width_multiple = COMPILED_WIDTH_MULTIPLE if ppo.compile else 1
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
            rows_prompt, result.token_ids, tok.pad_token_id, self.width_multiple)
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
            if train.old_from_update:  # the update took the old logprobs: their metrics now
                assemble_metrics.update(self.old_policy_metrics(batch, train, self.task_advantages))
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
