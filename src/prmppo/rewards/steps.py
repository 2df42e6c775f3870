"""Step boundaries of responses, derived from the tokenizer (never hard-coded token ids).

A step ends at every token whose decoded text contains the task's step delimiter ("\n" for
arith and GSM8K), and the last real token of a row (EOS, or the final token of a row cut at
`max_new_tokens`) closes the last step. Works for a character tokenizer (one "\n" token) and
for BPE vocabularies where the delimiter merges with other characters (".\n", "\n\n", " \n"):
every such token is a delimiter token.

"No empty steps": a delimiter token ends a step only if some *content* token (one whose text
is not blank once delimiters are removed; EOS is never content) came since the previous step
end, so "a\n\n\nb" has two steps, not four, and a leading "\n" opens nothing. An empty response
(only EOS) still gets one step end at its last token, so every row has a score.

Also here: moving per-step values between the token layout [B, T] and the compact step layout
[B, K] (K = most steps in any row), and aligning a task's per-step labels (its `split_steps`
/ `check_steps`) with token step ends by decoding prefixes.

Simplification: a token whose text has content *after* the delimiter ("\n2") ends the step
before it; its trailing content is counted in the next step.

Tests: `pytest tests/rewards/test_steps.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _vocab_texts(tokenizer) -> list[str]:
    """Decoded text of every vocabulary id (special tokens map to "")."""
    specials = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return ["" if i in specials else text for i, text in enumerate(texts)]


def delimiter_token_ids(tokenizer, delimiter: str) -> frozenset[int]:
    """Every vocabulary id whose decoded text contains `delimiter` (special tokens excluded)."""
    if not delimiter:
        raise ValueError("task.step_delimiter is empty: a step delimiter must be a non-empty string")
    ids = frozenset(i for i, text in enumerate(_vocab_texts(tokenizer)) if delimiter in text)
    if not ids:
        raise ValueError(f"no token of the tokenizer contains the step delimiter {delimiter!r}: "
                         "steps could never end; check task.step_delimiter against the model's tokenizer")
    return ids


def blank_token_ids(tokenizer, delimiter: str) -> frozenset[int]:
    """Ids whose text is only whitespace once `delimiter` is removed, plus every special token."""
    texts = _vocab_texts(tokenizer)
    return frozenset(i for i, text in enumerate(texts) if not text.replace(delimiter, "").strip())


@dataclass(frozen=True)
class StepBoundaries:
    """What `step_end_mask` needs, derived once from a tokenizer and a delimiter."""

    delimiter_ids: frozenset[int]
    blank_ids: frozenset[int]
    eos_token_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer, delimiter: str) -> "StepBoundaries":
        return cls(delimiter_token_ids(tokenizer, delimiter), blank_token_ids(tokenizer, delimiter),
                   tokenizer.eos_token_id)

    def mask(self, response_ids: Tensor, response_mask: Tensor) -> Tensor:
        return step_end_mask(response_ids, response_mask, self.delimiter_ids, self.eos_token_id, self.blank_ids)


def _isin(ids: Tensor, members: frozenset[int]) -> Tensor:
    return torch.isin(ids, torch.tensor(sorted(members), dtype=ids.dtype, device=ids.device))


def step_end_mask(response_ids: Tensor, response_mask: Tensor, delimiter_ids: frozenset[int], eos_token_id: int,
                  blank_ids: frozenset[int] | None = None) -> Tensor:
    """bool [B, T]: True where a step ends (see the module docstring for the rule).

    `blank_ids` (whitespace-only tokens) defaults to the delimiter tokens themselves.
    """
    real = response_mask.bool()  # [B, T]
    blank = _isin(response_ids, frozenset(blank_ids if blank_ids is not None else delimiter_ids) | {eos_token_id})
    content = real & ~blank  # [B, T]
    delim = real & _isin(response_ids, delimiter_ids)  # [B, T]
    seen = content.long().cumsum(-1)  # [B, T] content tokens up to and including t
    # content count at the previous delimiter token (0 before the first): seen is non-decreasing,
    # so a running max of it sampled at delimiter positions carries the last one forward
    at_delim = torch.where(delim, seen, torch.zeros_like(seen)).cummax(-1).values  # [B, T]
    before = torch.cat([torch.zeros_like(at_delim[:, :1]), at_delim[:, :-1]], dim=-1)  # [B, T]
    # a delimiter ends a step iff content came since the previous delimiter token; by induction
    # that is exactly "since the previous step end"
    ends = delim & (seen > before)  # [B, T]
    last = (real.long().sum(-1) - 1).clamp(min=0)  # [B] index of the last real token
    rows = torch.arange(len(last), device=last.device)
    open_tail = seen[rows, last] > at_delim[rows, last]  # [B] content after the last delimiter
    no_step = ~ends.any(-1)  # [B] an empty response still gets its one step end
    close = (open_tail | no_step) & real.any(-1)  # [B]
    ends[rows[close], last[close]] = True
    return ends


def to_steps(values: Tensor, ends: Tensor) -> tuple[Tensor, Tensor]:
    """Compact layout: values at step ends [B, T] -> (steps [B, K], step_mask [B, K] bool)."""
    counts = ends.long().sum(-1)  # [B]
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    step_mask = torch.arange(width, device=ends.device)[None, :] < counts[:, None]  # [B, K]
    steps = torch.zeros(ends.shape[0], width, dtype=values.dtype, device=values.device)  # [B, K]
    steps[step_mask] = values[ends]  # row-major order keeps each row's steps in sequence order
    return steps, step_mask


def to_tokens(steps: Tensor, step_mask: Tensor, ends: Tensor) -> Tensor:
    """Inverse of `to_steps`: steps [B, K] -> [B, T] zeros except at step ends."""
    out = torch.zeros(ends.shape, dtype=steps.dtype, device=steps.device)  # [B, T]
    out[ends] = steps[step_mask]
    return out


def align_step_labels(task, problem, tokenizer, response_ids: list[int], end_positions: list[int],
                      delimiter_ids: frozenset[int]) -> list[bool]:
    """The task's per-step label at each token step end of one response.

    Step end j is labelled with the task step it completes: the prefix text up to token j (cut
    at its last delimiter when token j is a delimiter token) holds n task steps, so the label is
    `check_steps(...)[n - 1]` (False when n == 0: an empty step is never right).
    """
    labels = task.check_steps(problem, tokenizer.decode(response_ids, skip_special_tokens=True))
    if labels is None:
        raise ValueError(f"task {task.name!r} has no exact step checker (check_steps returned None)")
    out = []
    for pos in end_positions:
        text = tokenizer.decode(response_ids[: pos + 1], skip_special_tokens=True)
        if response_ids[pos] in delimiter_ids and task.step_delimiter in text:
            text = text[: text.rfind(task.step_delimiter)]
        n = len(task.split_steps(text))
        out.append(bool(labels[n - 1]) if 0 < n <= len(labels) else False)
    return out
