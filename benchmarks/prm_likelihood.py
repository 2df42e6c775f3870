"""Does a trained PRM score right steps by how likely the SFT policy finds them?

    python benchmarks/prm_likelihood.py --checkpoint artifacts/sft-<key> --prm artifacts/prm-<a> artifacts/prm-<b>

A PRM arm is only a step-quality comparison with the ORM arm if the PRM's step scores say whether a
step is right, not how confident the policy was when it wrote it: a reward for likely tokens is a
second KL-to-SFT term (or a sharpening bonus) that the ORM arm does not get. This samples
`--samples` responses per test problem from the SFT checkpoint at temperature 1 (the policy PPO
starts from), labels every step with the task's checker (up to the first wrong one), and prints for
each PRM, on the right steps and on the wrong ones:

- the mean step score, and the fraction of right steps scored >= 0.5 and >= 0.9;
- the Spearman rank correlation of the step score with the SFT model's lowest token logprob in the
  step (its confidence), over right steps only: near 0 means the PRM does not rank right steps by
  likelihood; the same correlation for the SFT logprob itself is 1 by construction.

Runs on the CPU in about a minute for the default task.
"""

from __future__ import annotations

import argparse

import torch

from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.prm import LearnedStepScorer, load_prm, step_logprob_stats
from prmppo.models.prm_labels import PolicySampler, row_step_ends
from prmppo.ppo.maths import logprobs_from_logits
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
    print(f"{int(right.sum())} right and {int(wrong.sum())} wrong steps in {len(responses)} SFT samples")
    print("| PRM | head | right: mean score | right >= 0.5 | right >= 0.9 | wrong: mean score | "
          "Spearman(score, SFT lowest logprob), right steps |")
    print("|---|---|---|---|---|---|---|")
    print(f"| SFT lowest token logprob itself | - | - | - | - | - | "
          f"{spearman(confidence[right], confidence[right]):.3f} |")
    for prm_dir in args.prm:
        peft_model, head = load_prm(prm_dir, load_model(args.checkpoint, "float32", torch.device("cpu")), tokenizer)
        scorer = LearnedStepScorer(peft_model, head, boundaries.delimiter_ids, boundaries.eos_token_id, 64,
                                   boundaries.blank_ids)
        scores, _ = scorer.score(rows)
        s_right, s_wrong = scores[right], scores[wrong]
        print(f"| {prm_dir} | {head.kind} | {s_right.mean():.3f} | {(s_right >= 0.5).float().mean():.3f} | "
              f"{(s_right >= 0.9).float().mean():.3f} | {s_wrong.mean():.3f} | "
              f"{spearman(s_right, confidence[right]):.3f} |", flush=True)


if __name__ == "__main__":
    main()
