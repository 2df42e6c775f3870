"""`reward=prm` / `prm_oracle` / `prm_likelihood_control`: step rewards from a PRM on step-end tokens, plus
the outcome.

Same contract as `OutcomeReward` (`rewards/terms.py`): `reward(batch) -> (RewardTerms, metrics)`,
with a `process` term (paid at step ends) and an `outcome` term (the last token), so the PPO loop
does not know which arm it runs. For a batch of B responses:

  1. score      the step scorer gives s [B, T] at step-end tokens (`reward.scorer`: the learned PRM, the
                task's checker, or the likelihood control: the untrained `step_logprobs` rule of the SFT
                model, models/prm.py `LikelihoodControlScorer`);
  2. noise      with `label_noise = p`, each step score flips s -> 1 - s with probability p
                (to study reward hacking under a wrong PRM); the flips come from a generator of
                their own, seeded from the run's `seed`, whose state PPO checkpoints carry;
  3. transform  compact to steps [B, K], apply `transform` (rewards/transforms.py), put back;
  4. combine    terms: process = w_prm * transformed at step ends, outcome = w_outcome * outcome
                reward on the last token (their sum is the per-token reward GAE sees).

Metrics, logged every iteration: `prm/score_mean` (mean step score as used, i.e. after noise),
`reward/prm_mean` and `reward/outcome_mean` (per-response sums of each term), and hacking
monitors: `hack/steps_per_response`, `hack/tokens_per_step`, `hack/no_delimiter_fraction`
(responses without a delimiter token), `hack/repeated_line_rate` (steps whose content tokens
repeat an earlier step of the same response), `hack/prm_score_minus_accuracy` (mean step score
minus outcome accuracy) and, when the task has an exact step checker, `hack/true_step_accuracy`
and `hack/prm_vs_true_step_gap` (mean step score minus true step accuracy).

The step scorer (and the task, for the true-step monitors) are runtime dependencies: the PPO
stage passes them at construction (`build(cfg.reward, "reward", step_scorer=..., task=...)`).
`needs_learned_prm` tells the runner whether a PRM artifact must exist. The runner also passes
the run's `seed` (`build(cfg.reward, "reward", seed=cfg.seed)`), from which the noise generator's seed is derived (`label_noise_seed`), so two run seeds flip different steps.
`state_dict()` / `load_state_dict()` hold that generator's state: `ppo/checkpoint.py` saves it, so a
resumed run flips the steps the uninterrupted run would have flipped.

Tests: `pytest tests/rewards/test_prm_reward.py -q`.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from prmppo.config.schema import ProcessRewardConfig
from prmppo.rewards.orm import outcome_term
from prmppo.rewards.steps import to_steps, to_tokens
from prmppo.rewards.terms import RewardTerm, RewardTerms
from prmppo.rewards.transforms import TRANSFORM_NAMES, apply_transform

# `reward.scorer`: where step scores come from (`models/prm.py build_step_scorer` builds each)
SCORER_KINDS = ("learned", "oracle", "likelihood_control")


class ProcessReward:
    """w_prm * transform(PRM step scores) on step ends + w_outcome * outcome on the last token."""

    def __init__(
        self,
        transform: str = ProcessRewardConfig.transform,
        w_prm: float = ProcessRewardConfig.w_prm,
        w_outcome: float = ProcessRewardConfig.w_outcome,
        eta: float = ProcessRewardConfig.eta,
        min_form_temperature: float = ProcessRewardConfig.min_form_temperature,
        label_noise: float = ProcessRewardConfig.label_noise,
        scorer: str = ProcessRewardConfig.scorer,
        correct_reward: float = ProcessRewardConfig.correct_reward,
        wrong_reward: float = ProcessRewardConfig.wrong_reward,
        step_scorer=None,
        task=None,
        seed: int = 0,
    ):
        if transform not in TRANSFORM_NAMES:
            raise ValueError(f"reward.transform={transform!r} is not one of {', '.join(TRANSFORM_NAMES)}")
        if scorer not in SCORER_KINDS:
            raise ValueError(f"reward.scorer={scorer!r} is not one of {', '.join(SCORER_KINDS)}")
        if not 0.0 <= label_noise <= 1.0:
            raise ValueError(f"reward.label_noise={label_noise} must be in [0, 1]")
        if min_form_temperature <= 0:
            raise ValueError(f"reward.min_form_temperature={min_form_temperature} must be > 0")
        self.transform, self.w_prm, self.w_outcome, self.eta = transform, w_prm, w_outcome, eta
        self.min_form_temperature, self.label_noise, self.scorer = min_form_temperature, label_noise, scorer
        self.correct_reward, self.wrong_reward = correct_reward, wrong_reward
        self.step_scorer, self.task = step_scorer, task
        self.noise_generator = torch.Generator().manual_seed(label_noise_seed(seed))

    needs_step_scorer = True

    @property
    def needs_learned_prm(self) -> bool:
        """True when step scores come from a trained PRM (the runner must provide its artifact); the oracle and
        the likelihood control need no PRM stage."""
        return self.scorer == "learned"

    @property
    def needs_step_checker(self) -> bool:
        """True when step scores come from the task's exact step checker (`scorer=oracle`)."""
        return self.scorer == "oracle"

    @property
    def inert_keys(self) -> tuple[str, ...]:
        """Reward keys this transform never reads (`config.validate.inert_keys`)."""
        return (*(() if self.transform == "clip" else ("eta",)),
                *(() if self.transform == "min_form" else ("min_form_temperature",)))

    def state_dict(self) -> dict[str, Tensor]:
        """The noise generator's state, which a resume needs to draw the flips the uninterrupted run would;
        empty when `label_noise` = 0 (nothing is drawn, so there is no state that matters)."""
        return {"noise_generator": self.noise_generator.get_state()} if self.label_noise > 0 else {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what `state_dict` returned; refuse a state that does not fit this `label_noise`."""
        expected = sorted(self.state_dict())
        if sorted(state) != expected:
            raise ValueError(f"the reward state holds {sorted(state)} but reward.label_noise={self.label_noise} "
                             f"needs {expected}")
        if state:
            self.noise_generator.set_state(state["noise_generator"])

    def __call__(self, batch) -> tuple[RewardTerms, dict[str, float]]:
        if self.step_scorer is None:
            raise RuntimeError(
                f"ProcessReward (reward.scorer={self.scorer}) was called without a step scorer: the runner must pass "
                "step_scorer= (prmppo.models.prm.build_step_scorer) when it builds the reward")
        scores, ends = self.step_scorer.score(batch)  # [B, T], [B, T] bool  (1)
        steps, step_mask = to_steps(scores.float(), ends)  # [B, K]
        steps, flipped = self._noise(steps, step_mask)  # (2)
        shaped = apply_transform(self.transform, steps, step_mask, self.eta, self.min_form_temperature)  # (3)
        process = self.w_prm * to_tokens(shaped, step_mask, ends)  # [B, T]
        outcome = outcome_term(batch, self.correct_reward, self.wrong_reward, self.w_outcome)
        metrics = {"prm/score_mean": _mean(steps[step_mask]), "prm/flipped_fraction": flipped,
                   "reward/prm_mean": float(process.sum(-1).mean()),
                   "reward/outcome_mean": float(outcome.values.sum(-1).mean())}
        metrics.update(self._monitors(batch, ends, steps[step_mask]))
        process_events = ends.bool() & batch.response_mask.bool()  # [B, T]
        return RewardTerms({"process": RewardTerm(process, process_events), "outcome": outcome}), metrics  # (4)

    def _noise(self, steps: Tensor, step_mask: Tensor) -> tuple[Tensor, float]:
        if self.label_noise == 0.0:
            return steps, 0.0
        flip = (torch.rand(steps.shape, generator=self.noise_generator) < self.label_noise) & step_mask  # [B, K]
        return torch.where(flip, 1.0 - steps, steps), _mean(flip[step_mask].float())

    def _monitors(self, batch, ends: Tensor, step_scores: Tensor) -> dict[str, float]:
        boundaries = self.step_scorer.boundaries
        real = batch.response_mask.bool()  # [B, T]
        steps_per_row = ends.sum(-1).float()  # [B]
        delim = real & torch.isin(batch.response_ids, torch.tensor(sorted(boundaries.delimiter_ids)))
        score_mean = _mean(step_scores)
        out = {"hack/steps_per_response": float(steps_per_row.mean()),
               "hack/tokens_per_step": float(real.sum()) / max(float(steps_per_row.sum()), 1.0),
               "hack/no_delimiter_fraction": float((~delim.any(-1)).float().mean()),
               "hack/repeated_line_rate": repeated_step_rate(batch.response_ids, real, ends,
                                                             boundaries.blank_ids | {boundaries.eos_token_id}),
               "hack/prm_score_minus_accuracy": score_mean - float(batch.outcome.float().mean())}
        true_accuracy = self._true_step_accuracy(batch)
        if true_accuracy is not None:
            out["hack/true_step_accuracy"] = true_accuracy
            out["hack/prm_vs_true_step_gap"] = score_mean - true_accuracy
        return out

    def _true_step_accuracy(self, batch) -> float | None:
        if self.task is None:
            return None
        labels: list[bool] = []
        for problem, text in zip(batch.problems, batch.response_texts):
            row = self.task.check_steps(problem, text)
            if row is None:
                return None  # the task has no exact step checker
            labels.extend(row)
        return sum(labels) / len(labels) if labels else 0.0


def label_noise_seed(seed: int) -> int:
    """The noise generator's seed, drawn from the run's `seed` under a name of its own (as the PRM
    stage's `f"{seed}-prm"`), so it is unrelated to the trainer's generators, whose seeds are `seed`
    or linear in it (`seed * 7919 + iteration`, `ppo/loop.py`)."""
    return random.Random(f"{seed}-label-noise").getrandbits(63)


def _mean(values: Tensor) -> float:
    return float(values.float().mean()) if values.numel() else 0.0


def repeated_step_rate(response_ids: Tensor, real: Tensor, ends: Tensor, blank_ids: frozenset[int]) -> float:
    """Fraction of steps whose content tokens (blank tokens dropped) equal an earlier step's in the
    same response: a policy that pads its answer with copies of a high-scoring line shows here."""
    repeats, total = 0, 0
    blank = set(blank_ids)
    for ids, keep, end in zip(response_ids.tolist(), real.tolist(), ends.tolist()):
        seen: set[tuple[int, ...]] = set()
        current: list[int] = []
        for token, is_real, is_end in zip(ids, keep, end):
            if not is_real:
                break
            if token not in blank:
                current.append(token)
            if is_end:
                key = tuple(current)
                repeats += key in seen
                total += 1
                seen.add(key)
                current = []
    return repeats / total if total else 0.0
