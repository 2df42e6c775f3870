"""An off-the-shelf PRM checkpoint as the step scorer (`reward=prm_external`): its own model and tokenizer,
the policy's steps rebuilt in its format, its step scores put back on the policy's step-end tokens.

    python -m prmppo task=jsonl ... reward=prm_external reward.path=/ckpt/math-shepherd-mistral-7b-prm

Per batch of policy responses:
  1. step ends   from the policy's tokenizer, as for every step reward (`rewards/steps.py`): the k-th step
                 is the policy's tokens after step end k-1 up to step end k, decoded, delimiter removed;
  2. rebuild     each response in the PRM's format (`reward.format`):
                   math_shepherd  `<question> <step 1> ки\\n<step 2> ки\\n...`: a step tag after every step;
  3. score       the PRM reads the text (micro-batches of `reward.micro_batch_rows`, `no_grad`, on
                 `reward.device` or the trainer's); at the k-th tag the step score is
                 softmax(logits[good], logits[bad])[good] (Math-Shepherd: the tokens `+` and `-`);
  4. map back    score k lands on the policy's k-th step-end token; scores [B, T] zero elsewhere.

The PRM and the policy need not share a tokenizer: steps travel as text. `check_external_prm` checks the
directory, the format's marker tokens in the PRM's tokenizer (each a single token) and that the model's
vocabulary covers them, without reading weights (a launch gate); `load_external_scorer` then loads it. Simplification: only the math_shepherd format (a causal LM read at
its tag tokens); PRMs with a classification head (Qwen2.5-Math-PRM) need their remote code and are not
loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from prmppo.errors import PrmppoError
from prmppo.rewards.steps import StepBoundaries


class ExternalPRMError(PrmppoError):
    """An external PRM checkpoint that cannot be used in the format asked for; the message names it."""


@dataclass(frozen=True)
class MathShepherdFormat:
    """Math-Shepherd's step format: a tag token after every step, read as `+` (good) vs `-` (bad)."""

    step_tag: str = "ки"
    good_token: str = "+"
    bad_token: str = "-"

    def text(self, question: str, steps: list[str]) -> str:
        """The PRM's input: the question, then each step followed by the tag and a newline."""
        return f"{question} " + "".join(f"{step} {self.step_tag}\n" for step in steps)


PRM_FORMATS = {"math_shepherd": MathShepherdFormat()}


def single_token_id(tokenizer, text: str, what: str, where: str) -> int:
    """The id of `text` when the tokenizer writes it as one token (alone, no special tokens), else refused."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ExternalPRMError(f"{where}: the {what} {text!r} is {len(ids)} tokens of this PRM's tokenizer "
                               f"({ids}), not one: not a checkpoint of this reward.format")
    return ids[0]


class ExternalStepScorer:
    """Step scores [B, T] from an external PRM (module docstring); the same contract as the trained PRM's."""

    def __init__(self, model, prm_tokenizer, prm_format: MathShepherdFormat, policy_tokenizer, step_delimiter: str,
                 micro_batch_rows: int, where: str = "reward.path"):
        if micro_batch_rows < 1:
            raise ValueError(f"reward.micro_batch_rows={micro_batch_rows} must be >= 1")
        self.model, self.tokenizer, self.format = model, prm_tokenizer, prm_format
        self.policy_tokenizer, self.delimiter, self.micro_batch_rows = policy_tokenizer, step_delimiter, micro_batch_rows
        self.tag_id = single_token_id(prm_tokenizer, prm_format.step_tag, "step tag", where)
        self.label_ids = [single_token_id(prm_tokenizer, prm_format.good_token, "good-step token", where),
                          single_token_id(prm_tokenizer, prm_format.bad_token, "bad-step token", where)]
        self.boundaries = StepBoundaries.from_tokenizer(policy_tokenizer, step_delimiter)

    def step_texts(self, response_ids: list[int], end_positions: list[int]) -> list[str]:
        """The policy's steps of one response as text: tokens after the previous end up to this one."""
        steps, start = [], 0
        for end in end_positions:
            text = self.policy_tokenizer.decode(response_ids[start:end + 1], skip_special_tokens=True)
            steps.append(text.replace(self.delimiter, " ").strip())
            start = end + 1
        return steps

    def _encode(self, question: str, steps: list[str]) -> list[int]:
        ids = self.tokenizer(self.format.text(question, steps))["input_ids"]
        tags = sum(i == self.tag_id for i in ids)
        if tags != len(steps):
            raise ExternalPRMError(f"the PRM's input holds {tags} step tags for {len(steps)} steps (a step's text "
                                   f"contains the tag {self.format.step_tag!r}, or the tokenizer merged it)")
        return ids

    @torch.no_grad()
    def prm_scores(self, rows: list[list[int]]) -> list[Tensor]:
        """P(good) at every tag of each PRM input row, in order; `micro_batch_rows` rows per forward."""
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[Tensor] = []
        for start in range(0, len(rows), self.micro_batch_rows):
            chunk = rows[start:start + self.micro_batch_rows]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [b, L] right-padded
            mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [b, L]
            for i, row in enumerate(chunk):
                ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # [b, L, V]
            pair = logits[..., self.label_ids].float().softmax(-1)[..., 0].cpu()  # [b, L] P(good)
            tags = (ids == self.tag_id) & mask.bool()  # [b, L]
            out.extend(pair[i][tags[i]] for i in range(len(chunk)))
        return out

    def score(self, batch) -> tuple[Tensor, Tensor]:
        """(scores [B, T] in [0, 1] at the policy's step ends, zero elsewhere; step_end_mask [B, T] bool)."""
        ends = self.boundaries.mask(batch.response_ids, batch.response_mask)  # [B, T]
        positions = [ends[row].nonzero().squeeze(-1).tolist() for row in range(len(ends))]
        rows = []
        for row, problem in enumerate(batch.problems):
            length = int(batch.response_mask[row].sum())
            steps = self.step_texts(batch.response_ids[row, :length].tolist(), positions[row])
            rows.append(self._encode(problem.question, steps))
        scores = torch.zeros(ends.shape, dtype=torch.float32)  # [B, T]
        for row, step_scores in enumerate(self.prm_scores(rows)):
            scores[row, positions[row]] = step_scores
        return scores.to(ends.device), ends


def check_external_prm(path: str, prm_format: str):
    """(tokenizer, format) of the PRM checkpoint at `path`, checked without reading weights: the directory is
    whole, the format is known, its marker tokens are single tokens of the tokenizer and inside the model's
    vocabulary."""
    from prmppo.models.loading import check_model_dir, load_tokenizer

    if prm_format not in PRM_FORMATS:
        raise ExternalPRMError(f"reward.format={prm_format!r} is not one of {', '.join(PRM_FORMATS)}")
    fmt = PRM_FORMATS[prm_format]
    info = check_model_dir(path)
    tokenizer = load_tokenizer(Path(path))
    where = f"reward.path={path}"
    for text, what in ((fmt.step_tag, "step tag"), (fmt.good_token, "good-step token"), (fmt.bad_token, "bad-step token")):
        token = single_token_id(tokenizer, text, what, where)
        if token >= info.vocab_size:
            raise ExternalPRMError(f"{where}: the {what} {text!r} has id {token}, past the model's vocab_size "
                                   f"{info.vocab_size}")
    return tokenizer, fmt


def load_external_scorer(path: str, prm_format: str, device: str, dtype: str, policy_tokenizer, step_delimiter: str,
                         micro_batch_rows: int) -> ExternalStepScorer:
    """The checked PRM checkpoint at `path` loaded on `device` in `dtype`, as a step scorer for the policy."""
    from prmppo.models.loading import load_model

    tokenizer, fmt = check_external_prm(path, prm_format)
    model = load_model(Path(path), dtype, device)
    return ExternalStepScorer(model, tokenizer, fmt, policy_tokenizer, step_delimiter, micro_batch_rows,
                              where=f"reward.path={path}")
