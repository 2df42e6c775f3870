"""Does a trained PRM score right steps by how likely the SFT policy finds them?

    python experiments/prm_likelihood/prm_likelihood.py --checkpoint artifacts/sft-<key> --prm artifacts/prm-<a> artifacts/prm-<b>

Give every PRM to compare in one run (e.g. the `mode_gap` default, the `step_logprobs` head and the
classifier, trained on the same SFT checkpoint): they score the same samples.

A PRM arm is only a step-quality comparison with the ORM arm if the PRM's step scores say whether a
step is right, not how confident the policy was when it wrote it: a reward for likely tokens is a
second KL-to-SFT term (or a sharpening bonus) that the ORM arm does not get. This samples
`--samples` responses per test problem from the SFT checkpoint at temperature 1 (the policy PPO
starts from), labels every step with the task's checker (up to the first wrong one), and prints for
each PRM, on the right steps and on the wrong ones:

- the mean step score, and the fraction of right steps scored >= 0.5 and >= 0.9;
- the Spearman rank correlation of the step score with the SFT model's lowest token logprob in the
  step (its confidence), over right steps only: near 0 means the PRM does not rank right steps by
  likelihood; the same correlation for the SFT logprob itself is 1 by construction;
- the AUC of right against wrong steps (the probability that a random right step outscores a random
  wrong one, ties counted half), beside the AUC of the SFT rule itself;
- the accuracy (threshold 0.5) on the steps the untrained likelihood rule gets wrong: right steps
  with an SFT token below p = 1/e and wrong steps without one (`min logprob > -1` decides). A PRM that
  only restates the rule scores about 0 there;
- the Pearson correlation of the PRM's step scores with the untrained rule's, over all labelled steps:
  near 1 means the PRM's rewards are, to first order, the rule's (a likelihood bonus).

The first row is that rule, `StepLogprobHead` at its init on the SFT model (the scores of
`reward=prm_likelihood_control`); the second is the default `mode_gap` head at its init, before any
training (the SFT model's greedy-agreement rule).

Runs on the CPU in about a minute for the default task. The figures: README.md here.
"""

from __future__ import annotations

import argparse

import torch

from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.token_scores import logprobs_from_logits
from prmppo.config.stage_schema import PRMTrainConfig
from prmppo.models.prm import LearnedStepScorer, LikelihoodControlScorer, load_prm, make_head, new_prm
from prmppo.models.prm_heads import step_logprob_stats
from prmppo.models.prm_labels import PolicySampler, row_step_ends
from prmppo.rewards.steps import StepBoundaries, align_step_labels
from prmppo.stages.prm import ScoreRows
from prmppo.tasks.arith import ArithTask


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the SFT checkpoint the PRMs were trained on")
    parser.add_argument("--prm", nargs="+", required=True, help="PRM artifact dirs (stage=prm)")
    parser.add_argument("--problems", type=int, default=200, help="test problems")
    parser.add_argument("--samples", type=int, default=8, help="SFT samples per problem")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def rank(values: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank)."""
    order = values.argsort()
    ranks = torch.empty_like(values)
    ranks[order] = torch.arange(len(values), dtype=values.dtype)
    for value in values.unique():
        tied = values == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def auc(right: torch.Tensor, wrong: torch.Tensor) -> float:
    """P(a right step's score > a wrong step's), ties counted half: the Mann-Whitney U over both counts."""
    ranks = rank(torch.cat([right, wrong]).double())
    n_right, n_wrong = len(right), len(wrong)
    if not n_right or not n_wrong:
        return float("nan")
    return float((ranks[:n_right].sum() + n_right - n_right * (n_right + 1) / 2) / (n_right * n_wrong))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = rank(a.double()), rank(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = (ra.norm() * rb.norm()).item()
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


@torch.no_grad()
def sft_step_confidence(model, rows: ScoreRows, ends: torch.Tensor) -> torch.Tensor:
    """[B, T]: the SFT model's lowest token logprob in each step, at the step's end."""
    p = rows.prompt_length
    logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                   position_ids=rows.position_ids).logits[:, p - 1:-1]
    token_lp = logprobs_from_logits(logits, rows.input_ids[:, p:])
    return step_logprob_stats(token_lp, rows.attention_mask[:, p:].bool(), ends)[..., 0]


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.checkpoint)
    task = ArithTask()
    problems = task.problems("test")[: args.problems]
    prompts = [tokenizer(task.format_prompt(q))["input_ids"] for q in problems]
    model = load_model(args.checkpoint, "float32", torch.device("cpu"))
    sampler = PolicySampler(model, temperature=1.0, max_new_tokens=96, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, batch_rows=256, seed=args.seed)
    responses = sampler(prompts, args.samples)
    flat_problems = [q for q in problems for _ in range(args.samples)]
    flat_prompts = [p for p in prompts for _ in range(args.samples)]
    boundaries = StepBoundaries.from_tokenizer(tokenizer, task.step_delimiter)
    rows = ScoreRows.build(flat_problems, flat_prompts, responses, tokenizer.pad_token_id)
    ends = boundaries.mask(rows.response_ids, rows.response_mask)  # [B, T]
    labels = torch.full(ends.shape, -1, dtype=torch.long)  # 1 right, 0 wrong, -1 unlabelled (after an error)
    for b, (problem, response) in enumerate(zip(flat_problems, responses)):
        positions = row_step_ends(boundaries, response)
        right = align_step_labels(task, problem, tokenizer, response, positions, boundaries.delimiter_ids)
        for position, ok in zip(positions, right):
            labels[b, position] = int(ok)
            if not ok:
                break
    confidence = sft_step_confidence(model, rows, ends)
    right, wrong = labels == 1, labels == 0
    rule_errs = (right & (confidence <= -1.0)) | (wrong & (confidence > -1.0))  # [B, T] the untrained rule's misses
    print(f"{int(right.sum())} right and {int(wrong.sum())} wrong steps in {len(responses)} SFT samples; the SFT "
          f"lowest token logprob separates them with AUC {auc(confidence[right], confidence[wrong]):.4f}; the "
          f"untrained rule (SFT min logprob > -1) misses {int(rule_errs.sum())} of them")
    print("| PRM | head | right: mean score | right >= 0.5 | right >= 0.9 | wrong: mean score | AUC right vs wrong | "
          "accuracy where the rule errs | Spearman(score, SFT lowest logprob), right steps | "
          "Pearson(score, rule's score), labelled steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    control = LikelihoodControlScorer(model, boundaries.delimiter_ids, boundaries.eos_token_id, 64,
                                      boundaries.blank_ids)
    rule = control.score(rows)[0]  # [B, T]
    print(_row("untrained rule on the SFT model (reward=prm_likelihood_control)", "step_logprobs at init",
               rule, labels, confidence, rule_errs, rule), flush=True)
    untrained = new_prm(load_model(args.checkpoint, "float32", torch.device("cpu")), r=PRMTrainConfig.r,
                        alpha=PRMTrainConfig.alpha, target_modules=list(PRMTrainConfig().target_modules))
    greedy = LearnedStepScorer(untrained, make_head("mode_gap", 0, tokenizer), boundaries.delimiter_ids,
                               boundaries.eos_token_id, 64, boundaries.blank_ids)
    print(_row("untrained mode_gap head on the SFT model", "mode_gap at init", greedy.score(rows)[0], labels,
               confidence, rule_errs, rule), flush=True)
    for prm_dir in args.prm:
        peft_model, head = load_prm(prm_dir, load_model(args.checkpoint, "float32", torch.device("cpu")), tokenizer)
        scorer = LearnedStepScorer(peft_model, head, boundaries.delimiter_ids, boundaries.eos_token_id, 64,
                                   boundaries.blank_ids)
        print(_row(prm_dir, head.kind, scorer.score(rows)[0], labels, confidence, rule_errs, rule), flush=True)


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denominator = (a.norm() * b.norm()).item()
    return float((a * b).sum() / denominator) if denominator > 0 else float("nan")


def _row(name: str, kind: str, scores: torch.Tensor, labels: torch.Tensor, confidence: torch.Tensor,
         rule_errs: torch.Tensor, rule: torch.Tensor) -> str:
    """One table row: scores [B, T] against labels [B, T] (1 right, 0 wrong, -1 unlabelled) and the rule's [B, T]."""
    right, wrong = labels == 1, labels == 0
    s_right, s_wrong = scores[right], scores[wrong]
    hits = ((scores >= 0.5) == right)[rule_errs]
    return (f"| {name} | {kind} | {s_right.mean():.3f} | {(s_right >= 0.5).float().mean():.3f} | "
            f"{(s_right >= 0.9).float().mean():.3f} | {s_wrong.mean():.3f} | {auc(s_right, s_wrong):.4f} | "
            f"{hits.float().mean():.3f} | {spearman(s_right, confidence[right]):.3f} | "
            f"{pearson(scores[right | wrong], rule[right | wrong]):.3f} |")


if __name__ == "__main__":
    main()
