"""Can a head on the frozen SFT model's hidden states replace the trained PRM at a fraction of its CPU time?

    python experiments/prm_probe/prm_probe.py --checkpoint artifacts/sft-<key> [overrides of python -m prmppo]

The PRM stage trains a LoRA adapter and a head for 3000 steps x 256 responses (most of the embedded
default's CPU time). This measures a cheaper route on the same labels: the stage's own step labels
(`stage_samples`: the labelling step's calls, with the same config and seed), one no-grad forward
of the frozen SFT model over every labelled response, its hidden states at the step ends kept as
features (the last layer, or every layer concatenated) beside the model's own logprobs of the step's
tokens (min, mean, last, count), and a small head trained on those features alone. Each head is then
scored by the stage's own evaluation (`evaluate_prm`: held-out step accuracy on gold and corrupted solutions,
best-of-N with each aggregation against majority vote). Prints the seconds of each part and the
figures per head, one line each; `--json` also writes them. The figures: README.md here.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch import nn

from prmppo.__main__ import CONF_DIR
from prmppo.config.build import build
from prmppo.config.store import register_schemas
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.prm_labels import PolicySampler, make_step_labels
from prmppo.rewards.steps import StepBoundaries
from prmppo.stages.prm import train_batch, evaluate_prm, step_bce

def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the SFT checkpoint the PRM stage would train on")
    parser.add_argument("--heads", default="mlp-last,mlp-all,linear-lp,mlp-lp,mlp-all+lp",
                        help="comma-separated <linear|mlp>-<last|all|lp|all+lp> (ProbeHead)")
    parser.add_argument("--epochs", type=int, default=20, help="passes of head training over the features")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default="", help="also write the figures here")
    return parser.parse_known_args()


def stage_samples(cfg, task, tokenizer, model, boundaries, rng: random.Random):
    """(step-labelled examples, best-of-N candidates or None, `rng`'s state after them): the PRM stage's
    labelling step (stages/prm.py) made with the same calls in the same order, so the same config and
    seed give the stage's own labels and held-out candidates."""
    p = cfg.prm_train
    sampler = PolicySampler(model, temperature=1.0, max_new_tokens=p.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            batch_rows=cfg.eval.batch_rows, seed=cfg.seed)
    examples = make_step_labels(
        p.label_source, task=task, tokenizer=tokenizer, problems=task.problems("train")[: p.train_problems],
        sampler=sampler, samples_per_problem=p.samples_per_problem, mc_completions=p.mc_completions,
        estimation=p.estimation, boundaries=boundaries, rng=rng)
    candidates = None
    if p.best_of_n > 0:
        test = task.problems("test")[: p.eval_problems]
        flat = sampler([tokenizer(task.format_prompt(q))["input_ids"] for q in test], p.best_of_n)
        candidates = [flat[i * p.best_of_n:(i + 1) * p.best_of_n] for i in range(len(test))]
    return examples, candidates, rng.getstate()




def compose_cfg(overrides: list[str]):
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


@torch.no_grad()
def features(model, ids, att, pos, plen: int, ends: torch.Tensor) -> torch.Tensor:
    """[b, T, L + 2, H] at every response position: the embedding output and every layer's hidden state, then
    one row of logprob statistics of the step that ends there under the model itself (min, mean and last token
    logprob and the step's token count, zero-padded to H): the step-end positions are the ones used."""
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, output_hidden_states=True, use_cache=False)
    hidden = torch.stack(out.hidden_states)[:, :, plen:].permute(1, 2, 0, 3).float()  # [b, T, L+1, H]
    tokens, valid = ids[:, plen:], att[:, plen:].bool()  # [b, T]
    logprobs = torch.log_softmax(out.logits[:, plen - 1:-1].float(), -1).gather(-1, tokens.unsqueeze(-1))[..., 0]
    logprobs = logprobs.masked_fill(~valid, 0.0)  # [b, T]: log p(token t | everything before it)
    segment = torch.cumsum(ends.long(), 1) - ends.long()  # [b, T]: index of the step each token belongs to
    b, t = tokens.shape
    flat = (torch.arange(b).unsqueeze(1) * (t + 1) + segment).flatten()  # [b*T]: (row, step) slot
    slots = b * (t + 1)
    lowest = torch.full((slots,), 0.0).scatter_reduce(0, flat, logprobs.flatten(), "amin")
    total = torch.zeros(slots).index_add(0, flat, logprobs.flatten())
    count = torch.zeros(slots).index_add(0, flat, valid.float().flatten()).clamp(min=1)
    stats = torch.stack([lowest[flat], (total / count)[flat], logprobs.flatten(), count[flat]], -1).view(b, t, 4)
    padded = torch.zeros(b, t, 1, hidden.shape[-1])
    padded[..., 0, :4] = stats
    return torch.cat([hidden, padded], 2)


@torch.no_grad()
def step_features(model, examples, pad_token_id: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, L + 2, H] at every labelled step end, labels [n])."""
    feats, labels = [], []
    for start in range(0, len(examples), rows):
        ids, att, pos, plen, targets, mask = train_batch(examples[start:start + rows], pad_token_id, torch.device("cpu"))
        feats.append(features(model, ids, att, pos, plen, mask)[mask])  # [n_b, L+2, H]
        labels.append(targets[mask])
    return torch.cat(feats), torch.cat(labels)


class ProbeHead(nn.Module):
    """`<linear|mlp>-<inputs>`; inputs: `last` (the last layer's hidden state), `all` (every layer's), `lp` (the
    step's logprob statistics alone), `all+lp`."""

    def __init__(self, kind: str, inputs: str, n_rows: int, hidden: int):
        super().__init__()
        self.inputs = inputs
        width = {"last": hidden, "all": hidden * (n_rows - 1), "lp": 4, "all+lp": hidden * (n_rows - 1) + 4}[inputs]
        self.norm = nn.LayerNorm(width)
        self.net = (nn.Linear(width, 1) if kind == "linear"
                    else nn.Sequential(nn.Linear(width, 256), nn.GELU(), nn.Linear(256, 1)))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # [..., L+2, H] -> [...]
        parts = {"last": [feats[..., -2, :]], "all": [feats[..., :-1, :].flatten(-2)], "lp": [feats[..., -1, :4]],
                 "all+lp": [feats[..., :-1, :].flatten(-2), feats[..., -1, :4]]}[self.inputs]
        return self.net(self.norm(torch.cat(parts, -1))).squeeze(-1)


def train_head(head: ProbeHead, feats, labels, *, epochs: int, negative_weight: float, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.01)
    batches = max(1, len(labels) // 1024)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * batches)
    start = time.perf_counter()
    for _ in range(epochs):
        for rows in torch.randperm(len(labels), generator=generator).chunk(batches):
            loss = step_bce(head(feats[rows]), labels[rows], negative_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    return time.perf_counter() - start


class ProbeScorer:
    """`StepScorer` for the evaluation: the frozen model's `features` through a trained probe head."""

    def __init__(self, model, head: ProbeHead, boundaries: StepBoundaries, rows: int):
        self.model, self.head, self.boundaries, self.rows = model, head, boundaries, rows

    @torch.no_grad()
    def score(self, batch):
        ends = self.boundaries.mask(batch.response_ids, batch.response_mask)  # [B, T]
        chunks = []
        for rows in torch.arange(len(ends)).split(self.rows):
            feats = features(self.model, batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows],
                             batch.prompt_length, ends[rows])  # [b, T, L+2, H]
            chunks.append(torch.sigmoid(self.head(feats)))  # [b, T]
        return torch.cat(chunks) * ends, ends


def main() -> None:
    args, overrides = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose_cfg(overrides)
    p = cfg.prm_train
    task = build(cfg.task, "task")
    tokenizer = load_tokenizer(args.checkpoint)
    model = load_model(args.checkpoint, "float32", torch.device("cpu")).eval()
    boundaries = StepBoundaries.from_tokenizer(tokenizer, task.step_delimiter)
    rng = random.Random(f"{cfg.seed}-prm")  # the stage's stream: the same labels and held-out draws

    start = time.perf_counter()
    examples, candidates, rng_state = stage_samples(cfg, task, tokenizer, model, boundaries, rng)
    label_s = time.perf_counter() - start
    start = time.perf_counter()
    feats, labels = step_features(model, examples, tokenizer.pad_token_id, p.chunk_rows)
    feature_s = time.perf_counter() - start
    print(f"labels: {len(examples)} responses, {len(labels)} steps ({labels.mean():.3f} right) in {label_s:.0f} s; "
          f"features [{', '.join(map(str, feats.shape))}] in {feature_s:.0f} s", flush=True)

    results = {"labels_s": label_s, "features_s": feature_s, "steps": len(labels), "heads": {}}
    for name in args.heads.split(","):
        kind, inputs = name.split("-", 1)
        torch.manual_seed(cfg.seed)
        head = ProbeHead(kind, inputs, feats.shape[1], feats.shape[2])
        train_s = train_head(head, feats, labels, epochs=args.epochs, negative_weight=p.negative_weight,
                             seed=cfg.seed)
        head.eval()
        rng.setstate(rng_state)
        start = time.perf_counter()
        figures = evaluate_prm(ProbeScorer(model, head, boundaries, p.chunk_rows), task, tokenizer,
                               task.problems("test")[: p.eval_problems], candidates, rng)
        eval_s = time.perf_counter() - start
        results["heads"][name] = {**figures, "train_s": train_s, "eval_s": eval_s}
        print(f"{name}: step accuracy {figures['step_accuracy']:.3f} (right {figures['step_accuracy_right_steps']:.3f}, "
              f"wrong {figures['step_accuracy_wrong_steps']:.3f}), first-error F1 {figures['first_error_f1']:.3f}; "
              f"best-of-{p.best_of_n} min {figures.get('bon/min_accuracy', float('nan')):.3f} vs majority "
              f"{figures.get('bon/majority_accuracy', float('nan')):.3f}; head {train_s:.0f} s, eval {eval_s:.0f} s",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
