"""Where the PRM stage's CPU time goes: label sampling vs training steps, per torch thread count.

    python benchmarks/prm_profile.py --checkpoint artifacts/sft-<key> --threads 1,2

On the default task's SFT checkpoint: the seconds to sample `--problems` x 4 responses with the
stage's sampler (what checker labelling does for 10,000 problems), and the median seconds of a
PRM optimizer step on 256 labelled responses (the stage's batch), each with every thread count
given, one after the other in this process. Prints the projection to the default stage's size
(10,000 problems x 4 samples; 3000 steps). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from prmppo.config.schema import PRMTrainConfig
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.prm import make_head, new_prm, prm_step_logits
from prmppo.models.prm_labels import PolicySampler, make_step_labels
from prmppo.rewards.steps import StepBoundaries
from prmppo.stages.prm import train_batch, step_bce
from prmppo.tasks.arith import ArithTask


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="an SFT checkpoint of the default task")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--problems", type=int, default=256, help="train problems sampled x 4")
    parser.add_argument("--steps", type=int, default=6, help="PRM optimizer steps timed (the first is not counted)")
    return parser.parse_args()




def time_sampling(model, tokenizer, prompts, seed: int) -> tuple[float, int, list]:
    sampler = PolicySampler(model, temperature=1.0, max_new_tokens=PRMTrainConfig.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            batch_rows=256, seed=seed)
    start = time.perf_counter()
    out = sampler(prompts, 4)
    return time.perf_counter() - start, sum(len(row) for row in out), sampler


def time_training(model, tokenizer, examples, steps: int) -> tuple[float, int]:
    p = PRMTrainConfig()
    peft_model = new_prm(model, r=p.r, alpha=p.alpha, target_modules=list(p.target_modules))
    head = make_head(p.head, model.config.hidden_size, tokenizer, p.good_token, p.bad_token)
    params = [q for q in peft_model.parameters() if q.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=p.lr)
    generator, times, width = torch.Generator().manual_seed(0), [], 0
    for _ in range(steps):
        picked = [examples[i] for i in torch.randint(len(examples), (p.batch_rows,), generator=generator).tolist()]
        start = time.perf_counter()
        ids, att, pos, plen, targets, mask = train_batch(picked, tokenizer.pad_token_id, torch.device("cpu"))
        logits = prm_step_logits(peft_model, head, ids, att, pos, plen, mask)
        loss = step_bce(logits[mask], targets[mask], p.negative_weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        width = ids.shape[1]
    peft_model.unload()  # the next thread count starts from the plain SFT model again
    return statistics.median(times[1:]), width


def main() -> None:
    args = parse_args()
    tokenizer = load_tokenizer(args.checkpoint)
    task = ArithTask()
    problems = task.problems("train")[: args.problems]
    prompts = [tokenizer(task.format_prompt(q))["input_ids"] for q in problems]
    boundaries = StepBoundaries.from_tokenizer(tokenizer, task.step_delimiter)
    p = PRMTrainConfig()
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        model = load_model(args.checkpoint, "float32", torch.device("cpu"))
        seconds, tokens, sampler = time_sampling(model, tokenizer, prompts, seed=0)
        examples = make_step_labels("checker", task=task, tokenizer=tokenizer, problems=problems, sampler=sampler,
                                    samples_per_problem=1, mc_completions=1, estimation="hard", boundaries=boundaries,
                                    rng=random.Random(0))
        step, width = time_training(model, tokenizer, examples, args.steps)
        labels_min = seconds * p.train_problems / len(problems) / 60
        print(f"threads {threads}: sampling {len(problems)} x 4 in {seconds:.1f} s ({tokens / seconds:.0f} tok/s; "
              f"{p.train_problems} problems: {labels_min:.1f} min); PRM step ({p.batch_rows} rows x {width} tokens) "
              f"{step:.3f} s ({p.steps} steps: {step * p.steps / 60:.1f} min)", flush=True)


if __name__ == "__main__":
    main()
