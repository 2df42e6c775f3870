"""Log-probabilities (and entropies) of the taken tokens without a [B, T, V] float32 logit tensor.

The update and the no-grad forwards need, per response token, log softmax(logits / temperature)
at the token that was sampled (and the entropy of that distribution, which the loop logs). With a
16k-150k vocabulary the full float32 logits of a micro-batch are the largest tensor of the step
(and autograd keeps them, plus the softmax, for backward). Here the LM head runs on chunks of
`chunk_tokens` hidden states at a time, only at real response tokens (padding never reaches the
head), each chunk reduced to two numbers per token at once; under autograd each chunk is
recomputed in backward (`torch.utils.checkpoint`), so what stays alive is the hidden states, not
the logits. The values are those of `logprobs_from_logits` / `entropy_from_logits` (below) on the
full logits: same upcast-then-temper order, same formulas, only evaluated a slice at a time. Those
two are the token-score helpers every scorer shares (the PPO loop, the PRM's heads, the benchmarks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint



def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] of softmax(logits [B, T, V]) as logsumexp(l) - sum_v p_v * l_v.

    Logits of -inf (masked vocabulary) contribute 0 instead of 0 * -inf = nan, and the
    replacement happens before the product, so the gradient stays finite too.
    """
    log_norm = torch.logsumexp(logits, dim=-1)  # [B, T]
    probs = torch.softmax(logits, dim=-1)  # [B, T, V]
    finite_logits = logits.masked_fill(probs == 0, 0.0)  # [B, T, V]
    return log_norm - (probs * finite_logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits [B, T, V]) gathered at `tokens` [B, T] -> [B, T].

    Computed in float32 (half-precision logits are upcast): PPO ratios are exponentials of
    logprob differences, and bf16 rounding alone would move them by percent.
    """
    if tuple(logits.shape[:-1]) != tuple(tokens.shape):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} must equal logits shape "
                         f"{tuple(logits.shape)} without its last (vocabulary) dimension")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    picked = torch.gather(logits, -1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_scores(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
                  with_entropy: bool, entropy_grad: bool) -> torch.Tensor:
    """[n, H] hidden states -> [n, 2] (logprob of `tokens` [n], entropy or 0) under softmax(head(h) / T)."""
    # upcast before the temperature, as the engines do: bf16 logits / T round differently
    logits = head(hidden).float() / temperature  # [n, V]
    logprobs = logprobs_from_logits(logits, tokens)  # [n]
    if not with_entropy:
        return torch.stack([logprobs, torch.zeros_like(logprobs)], dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # a logged-only entropy: no graph
        entropy = entropy_from_logits(logits)  # [n]
    return torch.stack([logprobs, entropy], dim=-1)


def token_scores(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                 temperature: float, chunk_tokens: int, with_entropy: bool = False, entropy_grad: bool = True,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [b, T] of `tokens` [b, T] predicted from `hidden` [b, T, H] through the LM `head`, and
    their entropies [b, T] (None unless `with_entropy`; without a gradient unless `entropy_grad`, for
    an entropy that is only logged); 0 where `mask` [b, T] is 0.

    `head` is the model's output-embedding module (tied or not, LoRA-wrapped or not), called as the
    model calls it. Gradients reach `hidden` and the head's trainable parameters exactly as through
    the full-logit path.

    `positions` [n] (long, on `hidden`'s device) are the flat indices of `mask`'s nonzero entries in
    row-major order (`response_positions`), for a caller that holds the mask on the host: read here off
    a device mask instead, their count makes the host wait for everything queued on the device.
    """
    if hidden.shape[:2] != tokens.shape or tokens.shape != mask.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, tokens {tuple(tokens.shape)} and mask {tuple(mask.shape)} "
                         f"must agree on [rows, response tokens]")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (ppo.logit_chunk_tokens)")
    # the masked positions by index: the host learns their count once here, and the backward (an index_add
    # and a gather) needs no count again, where a boolean selection asks for it in both directions
    flat = response_positions(mask, mask.device) if positions is None else positions  # [n] in the flat [b * T]
    picked_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)  # [n, H]
    picked_tokens = tokens.reshape(-1).index_select(0, flat)  # [n]
    recompute = torch.is_grad_enabled()
    parts = []
    for h, t in zip(picked_hidden.split(chunk_tokens), picked_tokens.split(chunk_tokens)):
        if recompute:  # keep only the chunk's hidden states for backward; the logits are rebuilt there
            parts.append(checkpoint(_chunk_scores, head, h, t, temperature, with_entropy, entropy_grad,
                                    use_reentrant=False))
        else:
            parts.append(_chunk_scores(head, h, t, temperature, with_entropy, entropy_grad))
    scores = torch.cat(parts) if parts else hidden.new_zeros((0, 2), dtype=torch.float32)  # [n, 2]
    out = hidden.new_zeros((tokens.numel(), 2), dtype=torch.float32).index_copy(0, flat, scores).view(*tokens.shape, 2)
    entropy = (out[..., 1] if entropy_grad else out[..., 1].detach()) if with_entropy else None
    return out[..., 0], entropy  # [b, T] each


def response_positions(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The `positions` argument of `token_scores` for `mask` [b, T]: its nonzero entries' flat indices [n] on
    `device`. Given a host copy of the mask, they are found on the host and copied without waiting for the
    device's queue."""
    return mask.reshape(-1).nonzero().squeeze(1).to(device, non_blocking=True)
