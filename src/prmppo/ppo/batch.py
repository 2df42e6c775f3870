"""Typed containers of one PPO iteration: the sampled batch and the assembled training batch.

Layout: every row is `[left-padded prompt (P) | right-padded response (T)]`. Position ids count
real tokens only (cumsum of the attention mask - 1), exactly as the rollout engine assigns
them, so the trainer's recomputed logprobs match the engine's. The logits that predict response
token t sit at sequence position P - 1 + t.

Forward passes run on micro-batches of rows of similar length (`length_buckets`), each cut to the
columns some row of it uses (`trim_columns`, `TrainBatch.trimmed`), so no compute is spent on
columns that are padding in every row. The losses divide by explicit minibatch counts, so which
rows share a micro-batch changes no loss and no gradient. With compiled decoder layers
(`ppo.compile`) every width is a multiple of `COMPILED_WIDTH_MULTIPLE` instead: the batch is
collated to such a width and each cut is widened to the next multiple with padding columns.

`plan_update` fixes, once per iteration, which rows form each minibatch and micro-batch of every
epoch. The no-grad pass that makes the old logprobs runs the first epoch's micro-batches of that
plan: a GPU kernel's rounding depends on the shapes it runs (rows, width, logit chunk), so the old
logprobs equal the first minibatch's logprobs to the bit only when both passes run the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from prmppo.tasks.base import Problem

# The sequence widths that reach compiled decoder layers are multiples of this. Inductor's alignment
# check specialises a compiled layer on whether the width is a multiple of 8 (the graph carries the
# guard `hidden_states.size()[1] % 8 == 0`), so a micro-batch of another width would compile a second
# graph mid-run (12-16 s inside the second iteration on an H200 at 0.5B).
COMPILED_WIDTH_MULTIPLE = 8
# Rows of the forward a rank runs in a turn without rows of its own (its outputs discarded, its loss times 0),
# so that FSDP's collectives meet: dynamo specialises a size of 1, and a one-row pass would compile graphs of
# its own for compiled layers, mid-run, the first time a rank sits a turn out.
IDLE_PASS_ROWS = 2


def round_up(width: int, multiple: int) -> int:
    """The least multiple of `multiple` that is >= `width`."""
    return -(-width // multiple) * multiple


@dataclass
class RolloutBatch:
    """Responses sampled by the engine for one iteration, with the verifier's outcome."""

    problems: list[Problem]  # [B] the problem of each row (prompt-major, n per prompt)
    response_texts: list[str]  # [B] decoded responses, special tokens dropped
    finish_reasons: list[str]  # [B] "stop" (EOS) | "length"
    input_ids: Tensor  # [B, P + T]
    attention_mask: Tensor  # [B, P + T]
    position_ids: Tensor  # [B, P + T]
    response_ids: Tensor  # [B, T] (pad after the end)
    response_mask: Tensor  # [B, T] float, 1 on real response tokens (EOS included)
    engine_logprobs: Tensor  # [B, T] the engine's sampling logprobs
    outcome: Tensor  # [B] float, 1 when the verifier accepts the response
    prompt_length: int  # P

    def __len__(self) -> int:
        return len(self.problems)


@dataclass
class TrainBatch:
    """Everything the update needs, computed once per iteration before any weight moves.

    With `old_from_update` (an update of one optimizer step: `AssembleSteps.old_from_update`) the old logprobs of
    the rows the update learns from are the update's own, taken as its forward makes them: `old_logprobs` holds
    placeholders there and `advantages` the task part alone, and the update writes both in place (the KL pull
    added) before the loss reads them."""

    input_ids: Tensor  # [B, P + T]
    attention_mask: Tensor  # [B, P + T]
    position_ids: Tensor  # [B, P + T]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T]
    old_logprobs: Tensor  # [B, T] the trainer's logprobs of the sampling policy
    ref_logprobs: Tensor  # [B, T]
    old_values: Tensor  # [B, T]
    advantages: Tensor  # [B, T]
    returns: Tensor  # [B, T] value targets
    prompt_length: int
    old_from_update: bool = False

    def rows(self, index: Tensor) -> "TrainBatch":
        """The sub-batch of rows `index` (a minibatch or micro-batch)."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: (v[index] if isinstance(v, Tensor) else v) for k, v in picked.items()})

    def trimmed(self, cut: tuple[slice, int, int] | None = None, multiple: int = 1) -> "TrainBatch":
        """The same rows without the columns that are padding in every one of them (widened to a multiple of
        `multiple`, `trim_columns`). `cut` is `trim_columns`' answer for these rows where the caller has it
        from host copies of the masks (reading it off device tensors makes the host wait for the device)."""
        columns, width, prompt_length = cut or trim_columns(self.attention_mask, self.response_mask,
                                                            self.prompt_length, multiple)
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        # the layers' inputs as contiguous rows: a column cut is a view whose row stride is the full width, and a
        # compiled layer's graph guards on `position_ids.stride(0) == width` (the no-grad passes, copied to the
        # device, are contiguous), so a view would compile another graph in the first update
        out = {k: v[:, columns].contiguous() if k in ("input_ids", "attention_mask", "position_ids") else v[:, :width]
               for k, v in picked.items() if isinstance(v, Tensor)}
        return TrainBatch(**out, prompt_length=prompt_length, old_from_update=self.old_from_update)


def trim_columns(attention_mask: Tensor, response_mask: Tensor, prompt_length: int,
                 multiple: int = 1) -> tuple[slice, int, int]:
    """(input columns to keep, response width T', prompt length P') for rows `[P | T]`: from the first
    column any row attends to, to the end of the longest response (by `response_mask`, at least one
    token). Column P - 1 holds every row's last prompt token, so the cut never passes it.

    With `multiple` > 1 (compiled layers: `COMPILED_WIDTH_MULTIPLE`) the cut is widened to a width
    P' + T' that is a multiple of it, never past the rows' own P + T: first by prompt columns to the
    left, padding in every row (the layers run them, the LM head does not), then by response columns
    to the right, which `response_mask` leaves out of every loss and logprob."""
    used = attention_mask[:, :prompt_length].any(0).nonzero()  # [k, 1] prompt columns some row uses
    start = min(int(used[0, 0]) if len(used) else prompt_length - 1, prompt_length - 1)
    width = max(int(response_mask.sum(-1).max()) if len(response_mask) else 0, 1)
    missing = round_up(prompt_length - start + width, multiple) - (prompt_length - start + width)
    left = min(missing, start)
    start, width = start - left, min(width + missing - left, max(response_mask.shape[1], width))
    return slice(start, prompt_length + width), width, prompt_length - start


def length_buckets(attention_mask: Tensor, response_mask: Tensor, rows_per_bucket: int,
                   max_tokens: int | None = None, multiple: int = 1) -> list[Tensor]:
    """Row indices [b] in groups of at most `rows_per_bucket`, rows sorted by response then prompt
    length so that each group's trimmed width (`trim_columns`) is close to each of its rows' lengths.
    With `max_tokens`, a group also closes before its rows x trimmed width (rounded up to `multiple`,
    as `trim_columns` widens it) would pass it (a row alone may: it runs by itself), so short rows
    share a micro-batch that long ones could not."""
    response_lengths = response_mask.sum(-1).long()  # [B]
    prompt_lengths = attention_mask.sum(-1).long() - response_lengths  # [B]
    key = response_lengths * (attention_mask.shape[1] + 1) + prompt_lengths  # [B]
    order = torch.argsort(key, stable=True)
    if max_tokens is None:
        return list(order.split(rows_per_bucket))
    buckets, current, widest_prompt, widest_response = [], [], 0, 0
    for row in order.tolist():
        prompt, response = int(prompt_lengths[row]), max(int(response_lengths[row]), 1)
        grown = (len(current) + 1) * round_up(max(widest_prompt, prompt) + max(widest_response, response), multiple)
        if current and (len(current) == rows_per_bucket or grown > max_tokens):
            buckets.append(current)
            current, widest_prompt, widest_response = [], 0, 0
        current.append(row)
        widest_prompt, widest_response = max(widest_prompt, prompt), max(widest_response, response)
    buckets.append(current)
    return [torch.tensor(rows, dtype=torch.long, device=order.device) for rows in buckets if rows]


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step's rows and how they are grouped into micro-batches."""

    rows: Tensor  # [m] row indices into the iteration's batch, in the update's (shuffled) order
    micro_batches: tuple[Tensor, ...]  # [b] row indices into the iteration's batch: `rows` regrouped


@dataclass(frozen=True)
class UpdatePlan:
    """Every epoch's minibatches, in the order the update runs them."""

    epochs: tuple[tuple[Minibatch, ...], ...]

    def first_epoch_micro_batches(self) -> list[Tensor]:
        """The micro-batches of epoch 0, in order: each row of the batch exactly once."""
        return [micro for minibatch in self.epochs[0] for micro in minibatch.micro_batches]


def plan_update(attention_mask: Tensor, response_mask: Tensor, epochs: int, minibatch_rows: int,
                micro_batch_rows: int, micro_batch_tokens: int | None, generator: torch.Generator,
                width_multiple: int = 1) -> UpdatePlan:
    """A fresh permutation of the rows per epoch, cut into minibatches of `minibatch_rows`, each split
    into `length_buckets` by `response_mask` [B, T] (the update's: dropped rows carry no token), whose
    widths `trim_columns` rounds up to `width_multiple`. Indices live on the CPU whatever device the
    masks are on."""
    attention_mask, response_mask = attention_mask.cpu(), response_mask.cpu()
    planned = []
    for _ in range(epochs):
        perm = torch.randperm(attention_mask.shape[0], generator=generator)  # [B]
        planned.append(tuple(
            Minibatch(rows, tuple(rows[micro] for micro in length_buckets(
                attention_mask[rows], response_mask[rows], micro_batch_rows, micro_batch_tokens, width_multiple)))
            for rows in perm.split(minibatch_rows)))
    return UpdatePlan(tuple(planned))


def collate(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int, width_multiple: int = 1
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """(input_ids, attention_mask, position_ids, response_ids, response_mask, P) for rows of ids. With
    `width_multiple` > 1 (compiled layers) P + T is a multiple of it: the prompts get more left padding,
    so a micro-batch cut wide enough to reach the whole batch still has such a width (`trim_columns`),
    and so does the PRM's pass over whole rows."""
    resp_len = max(map(len, response_ids))
    prompt_len = round_up(max(map(len, prompt_ids)) + resp_len, width_multiple) - resp_len
    rows = len(prompt_ids)
    input_ids = torch.full((rows, prompt_len + resp_len), pad_token_id, dtype=torch.long)  # [B, P+T]
    attention_mask = torch.zeros((rows, prompt_len + resp_len), dtype=torch.long)  # [B, P+T]
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, prompt_len - len(prompt):prompt_len] = torch.tensor(prompt)
        input_ids[i, prompt_len:prompt_len + len(response)] = torch.tensor(response, dtype=torch.long)
        attention_mask[i, prompt_len - len(prompt):prompt_len + len(response)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    response_mask = attention_mask[:, prompt_len:].float()  # [B, T]
    return input_ids, attention_mask, position_ids, input_ids[:, prompt_len:].clone(), response_mask, prompt_len


def pad_floats(rows: list[list[float]], width: int) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)  # [B, T]
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out
