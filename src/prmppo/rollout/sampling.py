"""Token sampling shared by both decode loops of the built-in engine and in-process sampling.

Sampling draws one exponential noise value per (row, vocabulary entry) and picks
argmax(p / noise), which samples from p exactly (the exponential race, equivalent to Gumbel-max).
The noise of a step is drawn for the whole batch in row order, so a row's sample depends only on
the seed, the step and its own logits, never on which other rows share its decode batch: the
static decode path (`static_decode.py`), which reorders and drops rows, samples the same tokens
as the dynamic one for the same seed.

Logprob contract: the logprob returned for a sampled token is log_softmax(logits / temperature)
at that token, in float32, BEFORE top-p truncation (see `hf_engine`'s docstring for why).
"""

from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, ...]:
    """Left-pad token rows; returns input_ids, attention_mask, position_ids, each [B, L]."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # [B, L]
    for index, row in enumerate(rows):
        input_ids[index, length - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, length - len(row):] = 1
    # Real tokens get positions 0..len-1 whatever the padding; pads get 0 (they are masked).
    # RoPE models would not notice a per-row shift, absolute-position models would.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from logits [B, V] with exponential noise [B, V]; returns tokens
    [B] and their logprobs [B] (from the full tempered distribution, before top-p truncation)."""
    logprobs_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    probs = logprobs_all.exp()  # [B, V]
    if top_p < 1.0:
        sorted_probs, sorted_index = probs.sort(dim=-1, descending=True)  # [B, V]
        # Keep a token while the mass strictly before it is < top_p: the top token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_index, sorted_probs)
    tokens = (probs / noise).argmax(dim=-1)  # [B]: the exponential race, a draw from probs
    token_logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    return tokens, token_logprobs


def next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
    row_of_slot: torch.Tensor | None = None, batch_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row of logits [b, V]; returns tokens [b], logprobs [b].

    `temperature == 0` is greedy (logprobs then are the untempered model's). Otherwise noise is
    drawn for `batch_rows` rows (default b) and row `row_of_slot[i]`'s noise goes to logits row i.
    """
    if temperature == 0:
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)  # [b, V]
        tokens = logprobs_all.argmax(dim=-1)  # [b]
        return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
    shape = (batch_rows or logits.shape[0], logits.shape[-1])
    # Exp(1) noise as -log(U), U uniform in [0, 1): never 0 (a 0 would make its entry win whatever its
    # probability); U = 0 gives +inf, which only removes that entry from the race
    noise = torch.rand(shape, dtype=torch.float32, device=logits.device, generator=generator).log_().neg_()  # [B, V]
    if row_of_slot is not None:
        noise = noise[row_of_slot]  # [b, V]
    return sample_tokens(logits, temperature, top_p, noise)
