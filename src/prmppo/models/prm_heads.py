"""The PRM's heads: what turns the backbone's outputs on a step into a step logit (`prm_train.head`).

- `mode_gap` (the default): an affine map of the lowest, mean, last and summed gap
                  log pi_prm(token) - max_v log pi_ref(v) over the step's own tokens, where pi_prm
                  is the LM with the `prm` adapter and pi_ref the same backbone with adapters off
                  (the SFT model): the implicit process reward's log-ratio log pi_prm / pi_ref (Yuan
                  et al. 2024, "Free Process Rewards without Process Labels"; PRIME, Cui et al.
                  2025) plus the SFT model's margin to its own greedy token. A token the SFT model
                  would write greedily contributes 0 however confident it was, so the SFT model's
                  likelihood of a step is not what the head starts from: it starts as "the step's
                  tokens fall less than a factor e short of the SFT model's top choices", and the
                  gradient reaches the adapter through the PRM's logprobs from the first step on;
- `log_ratio`:    the same map over the log-ratio alone (the implicit PRM): every step starts at 0.5
                  and it learns too slowly for the default budget;
- `classifier`:   sigmoid(linear(h_t)) on the last hidden state h_t of each step-end token;
- `label_tokens`: the LM's own next-token distribution at the step end, restricted to a "good"
                  and a "bad" token: p(good) / (p(good) + p(bad)) = sigmoid(logit_good -
                  logit_bad), as in Math-Shepherd (Wang et al. 2024, "Math-Shepherd: Verify and
                  Reinforce LLMs Step-by-step without Human Annotations");
- `step_logprobs`: a likelihood score: an affine map of how likely the PRM-adapted LM finds the
                  step's own tokens (the lowest, the mean and the last token logprob of the step).
                  It starts as a `min logprob > -1` rule of the SFT model and training barely moves
                  it from there, so its scores largely restate the SFT model's confidence
                  (benchmarks/RESULTS.md, "A PRM that is not the SFT model's likelihood").

Every head returns a step *logit* (pre-sigmoid) at each response position (the caller reads the
step ends), so training uses BCE-with-logits.

`make_head` builds one by name; `HEAD_TYPES` lists the names (what `prm_train.head` may be).

Tests: `pytest tests/models/test_prm.py -q`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

HEAD_TYPES = ("mode_gap", "log_ratio", "classifier", "label_tokens", "step_logprobs")


class StepInputs(NamedTuple):
    """What a head reads, response positions only: position t has read response token t."""

    hidden: Tensor  # [b, T, H] last hidden state
    logits: Tensor | None  # [b, T, V] next-token logits (heads with reads="next_logits")
    token_logprobs: Tensor | None  # [b, T] log p(token t | before it) (reads="token_logprobs"|"token_log_ratios")
    valid: Tensor  # [b, T] bool: a response token, not padding
    step_ends: Tensor | None  # [b, T] bool (reads="token_logprobs"|"token_log_ratios")
    reference_logprobs: Tensor | None = None  # [b, T] the same under the reference, adapters off ("token_log_ratios")


class ClassifierHead(nn.Module):
    """Step logit = linear(h) on the last hidden state; zero-initialised (every score starts at 0.5)."""

    kind, reads = "classifier", "hidden"

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, inputs: StepInputs) -> Tensor:  # [b, T, H] -> [b, T]
        return self.linear(inputs.hidden.float()).squeeze(-1)


class LabelTokenHead(nn.Module):
    """Step logit = logit(good) - logit(bad) of the LM at the step end (no weights of its own)."""

    kind, reads = "label_tokens", "next_logits"

    def __init__(self, good_token_id: int, bad_token_id: int, good_token: str, bad_token: str):
        super().__init__()
        self.good_token_id, self.bad_token_id = good_token_id, bad_token_id
        self.good_token, self.bad_token = good_token, bad_token

    def forward(self, inputs: StepInputs) -> Tensor:  # [b, T, V] -> [b, T]
        logits = inputs.logits
        return logits[..., self.good_token_id].float() - logits[..., self.bad_token_id].float()


def step_token_stats(values: Tensor, valid: Tensor, step_ends: Tensor) -> Tensor:
    """[b, T, 4]: at each position, (lowest, mean, last, sum) of a per-token value [b, T] over the step it
    belongs to, counted up to and including that step's end token. A step is the tokens after the previous
    step end up to its own end; padding is left out. Only the values at step ends are complete."""
    b, t = values.shape
    ends = step_ends & valid
    step = ends.long().cumsum(-1) - ends.long()  # [b, T] the index of each token's step
    slots = t + 1  # per row: steps 0..T-1, and slot T for padding
    flat = torch.where(valid, step, torch.full_like(step, t)) + slots * torch.arange(b, device=step.device)[:, None]
    v = values.float().masked_fill(~valid, 0.0)
    lowest = torch.zeros(b * slots, device=v.device).scatter_reduce(0, flat.flatten(), v.flatten(), "amin",
                                                                     include_self=False)
    total = torch.zeros(b * slots, device=v.device).index_add(0, flat.flatten(), v.flatten())
    count = torch.zeros(b * slots, device=v.device).index_add(0, flat.flatten(), valid.float().flatten())
    mean = total / count.clamp(min=1.0)
    return torch.stack([lowest[flat], mean[flat], v, total[flat]], -1)  # [b, T, 4]


def step_logprob_stats(token_logprobs: Tensor, valid: Tensor, step_ends: Tensor) -> Tensor:
    """[b, T, 3]: (lowest, mean, last) token logprob of each position's step (`step_token_stats`)."""
    return step_token_stats(token_logprobs, valid, step_ends)[..., :3]


class StepLogprobHead(nn.Module):
    """Step logit = SCALE * (w . (lowest, mean, last token logprob of the step) + b) under the PRM's
    own LM.

    Initialised to `SCALE * (lowest + 1)`: a step is scored right while its least likely token has
    p > 1/e under the model the adapter starts from (the SFT policy); training moves both the map
    and, through the logprobs, the adapter. SCALE makes the map move SCALE times faster at the
    stage's learning rate and the scores saturate: with 1 the default PRM scored no right step of
    the SFT policy's samples >= 0.9 after 300 steps, with 10 it scores 98-99% of them >= 0.9
    (experiments/prm_likelihood/)."""

    kind, reads = "step_logprobs", "token_logprobs"
    SCALE = 10.0

    def __init__(self, scale: float = SCALE):
        super().__init__()
        self.scale = scale
        self.linear = nn.Linear(3, 1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[1.0, 0.0, 0.0]]))
            self.linear.bias.fill_(1.0)

    def forward(self, inputs: StepInputs) -> Tensor:  # -> [b, T]
        stats = step_logprob_stats(inputs.token_logprobs, inputs.valid, inputs.step_ends)
        return self.scale * self.linear(stats).squeeze(-1)


class _ReferenceGapHead(nn.Module):
    """Step logit = SCALE * (w . (lowest, mean, last, sum of the step's token gaps) + b), a token's gap being
    log pi_prm(token) - (a logprob of the reference at that position): the PRM-adapted LM against the same
    backbone with adapters off (the SFT model). `reference` names which logprob of the reference: "token",
    the written token's; "mode", the reference's most likely token's. SCALE plays the part of beta in the
    implicit process reward beta * log(pi / pi_ref) (Yuan et al. 2024, "Free Process Rewards without Process
    Labels"; Cui et al. 2025, "Process Reinforcement through Implicit Rewards"): a wrong step needs only a
    small move of the adapter to score low. The gradient reaches the adapter through the PRM's logprobs; the
    reference's are read under no_grad."""

    reads = "token_log_ratios"
    SCALE = 10.0
    INIT = ((1.0, 0.0, 0.0, 0.0), 0.0)  # (w on (lowest, mean, last, sum), b)

    def __init__(self, scale: float = SCALE):
        super().__init__()
        self.scale = scale
        self.linear = nn.Linear(4, 1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([self.INIT[0]]))
            self.linear.bias.fill_(self.INIT[1])

    def forward(self, inputs: StepInputs) -> Tensor:  # -> [b, T]
        gaps = inputs.token_logprobs.float() - inputs.reference_logprobs.float()  # [b, T]
        return self.scale * self.linear(step_token_stats(gaps, inputs.valid, inputs.step_ends)).squeeze(-1)


class ModeGapHead(_ReferenceGapHead):
    """Gap = log pi_prm(token) - max_v log pi_ref(v): the PRM's logprob of the written token against the SFT
    model's logprob of its own most likely token there. It splits into the implicit process reward's
    log-ratio log pi_prm(token) - log pi_ref(token) plus the SFT model's margin to its greedy choice,
    log pi_ref(token) - max_v log pi_ref(v), which is 0 for a token the SFT model would write greedily,
    however confident it was, and negative for any other.

    Initialised to SCALE * (summed gap + 1): a step is right while its tokens together fall less than a
    factor e short of the SFT model's top choices. The sum of a step's log-ratios is the implicit PRM's step
    reward (Yuan et al. 2024); with the lowest gap instead the trained PRM ranked right steps by the SFT
    model's confidence again (benchmarks/RESULTS.md). Every step the SFT model writes greedily starts at the
    same score, sigmoid(SCALE); training moves the PRM's logprobs, e.g. down on the steps the SFT model
    writes greedily but wrongly."""

    kind, reference = "mode_gap", "mode"
    INIT = ((0.0, 0.0, 0.0, 1.0), 1.0)


class LogRatioHead(_ReferenceGapHead):
    """Gap = log pi_prm(token) - log pi_ref(token), the implicit process reward's log-ratio alone. It is 0 for
    every token until the adapter moves: every step starts at 0.5, and the SFT model's likelihood of a step
    never enters. On the default task it learns too slowly for the stage's budget (benchmarks/RESULTS.md)."""

    kind, reference = "log_ratio", "token"


def label_token_id(tokenizer, text: str, key: str) -> int:
    """The single vocabulary id of `text`, or a ValueError naming the config key."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"{key}={text!r} must be exactly one token of the model's vocabulary "
                         f"(it encodes to {ids}); pick a character the tokenizer knows, e.g. '+' or '-'")
    return ids[0]


def make_head(head_type: str, hidden_size: int, tokenizer, good_token: str = "+", bad_token: str = "-",
              scale: float | None = None) -> nn.Module:
    if head_type in ("mode_gap", "log_ratio"):
        head = ModeGapHead if head_type == "mode_gap" else LogRatioHead
        return head(head.SCALE if scale is None else scale)
    if head_type == "classifier":
        return ClassifierHead(hidden_size)
    if head_type == "label_tokens":
        good = label_token_id(tokenizer, good_token, "prm_train.good_token")
        bad = label_token_id(tokenizer, bad_token, "prm_train.bad_token")
        if good == bad:
            raise ValueError(f"prm_train.good_token={good_token!r} and prm_train.bad_token={bad_token!r} must differ")
        return LabelTokenHead(good, bad, good_token, bad_token)
    if head_type == "step_logprobs":
        return StepLogprobHead(StepLogprobHead.SCALE if scale is None else scale)
    raise ValueError(f"prm_train.head={head_type!r} is not one of {', '.join(HEAD_TYPES)}")
