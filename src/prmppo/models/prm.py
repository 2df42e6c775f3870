"""The process reward model (PRM) on the shared backbone, and the step scorers the reward uses.

The PRM is a LoRA adapter named `prm` plus a head. In the `prm` stage it is trained alone on
the SFT checkpoint (`new_prm`: `get_peft_model(base, ..., adapter_name="prm")`); during PPO it
is loaded next to the `policy` adapter on the *same* PeftModel (`load_prm`), frozen, so no
second copy of the backbone exists. The heads (`prm_train.head`) are in `models/prm_heads.py`; every
head returns a step *logit* (pre-sigmoid) at each response position, so training uses BCE-with-logits.

Step scorers (`StepScorer.score(batch) -> (scores [B, T], step_end_mask [B, T])`, scores in
[0, 1] at step ends and 0 elsewhere):

- `LearnedStepScorer`: the PRM, in chunks of `chunk_rows` rows under no_grad, with the `prm`
  adapter switched on and the previously active adapter switched back afterwards. peft's
  `set_adapter` also rewrites `requires_grad` of adapter weights, so every flag is snapshotted
  and restored: the policy stays exactly as trainable as it was and the PRM stays frozen.
- `OracleStepScorer`: the task's exact step checker (`reward=prm_oracle`): 1.0 right, 0.0 wrong.
- `LikelihoodControlScorer`: the untrained `step_logprobs` rule on the reference model (the policy's
  backbone with adapters off, i.e. the SFT model), `reward=prm_likelihood_control`: a likelihood
  bonus dressed as a PRM, to tell process supervision from a reward for likely steps.

Saved layout (`save_prm`, safetensors only): `<dir>/prm/adapter_model.safetensors` (+ peft's
adapter_config.json), `<dir>/prm_head.safetensors`, `<dir>/prm_meta.json`.

Tests: `pytest tests/models/test_prm.py -q`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from prmppo.models.policy import _causal_lm, adapters_off, decoder_mask
from prmppo.models.prm_heads import StepInputs, StepLogprobHead, make_head
from prmppo.models.root_forward import as_root_forward
from prmppo.models.token_scores import logprobs_from_logits
from prmppo.rewards.prm import SCORER_KINDS
from prmppo.rewards.steps import StepBoundaries, align_step_labels
from prmppo.rollout.hf_engine import find_adapter_dir

PRM_ADAPTER = "prm"
HEAD_FILE, META_FILE = "prm_head.safetensors", "prm_meta.json"


def _lora_config(r: int, alpha: int, target_modules: list[str]):
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules),
                      bias="none", task_type="CAUSAL_LM")


def new_prm(base_model: nn.Module, *, r: int, alpha: int, target_modules: list[str], init_seed: int = 0):
    """A PeftModel whose only adapter is a fresh, trainable `prm` adapter on `base_model`."""
    with torch.random.fork_rng(devices=[]):  # peft draws LoRA A from the global generator
        torch.manual_seed(init_seed)
        return get_peft_model(base_model, _lora_config(r, alpha, target_modules), adapter_name=PRM_ADAPTER)


@contextmanager
def adapter_active(peft_model, name: str):
    """Run with adapter `name` active and the model in eval mode; restore the active adapter,
    the train/eval mode and every parameter's requires_grad flag afterwards."""
    flags = {id(p): p.requires_grad for p in peft_model.parameters()}
    previous, was_training = peft_model.active_adapter, peft_model.training
    peft_model.set_adapter(name)
    peft_model.eval()
    try:
        yield peft_model
    finally:
        peft_model.set_adapter(previous)
        for p in peft_model.parameters():
            p.requires_grad_(flags.get(id(p), False))
        peft_model.train(was_training)


def _lm_pass(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
             keep: int | None) -> tuple[Tensor, Tensor | None]:
    """(final hidden states [b, P + T, H], LM logits of the last `keep` positions [b, keep, V] or None)."""
    lm = _causal_lm(model)  # refused where the model's own forward would change its logits (softcapping, scaling)

    def run() -> tuple[Tensor, Tensor | None]:
        # the decoder and the LM head called directly, as the policy's scoring calls them: asking the model for
        # its hidden states would install transformers' output-capturing hooks on the modules, for good, and
        # under LoRA they are the policy's own (its compiled layers would break their graphs at the hooks)
        final = lm.get_decoder()(input_ids=input_ids, attention_mask=decoder_mask(lm, attention_mask),
                                 position_ids=position_ids, use_cache=False).last_hidden_state  # [b, P + T, H] normed
        return final, None if keep is None else lm.get_output_embeddings()(final[:, -keep:])  # [b, keep, V]

    return as_root_forward(model, run) if isinstance(model, FSDPModule) else run()


@torch.no_grad()
def reference_token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                             prompt_length: int, of: str = "token") -> Tensor:
    """[b, T] under `model` with every adapter off (the SFT model): log p(response token t | before it) (`of`
    "token"), or the logprob of the most likely token at that position (`of` "mode")."""
    t = input_ids.shape[1] - prompt_length
    with adapters_off(model):
        _, lm_logits = _lm_pass(model, input_ids, attention_mask, position_ids, t + 1)
    logits = lm_logits[:, :-1].float()  # [b, T, V]: position P - 1 + t predicts response token t
    if of == "mode":
        return logits.log_softmax(-1).max(-1).values
    return logprobs_from_logits(logits, input_ids[:, prompt_length:])


def prm_step_logits(model, head: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                    prompt_length: int, step_ends: Tensor | None = None,
                    reference_logprobs: Tensor | None = None) -> Tensor:
    """Step logits [b, T] at every response position (the caller picks the step ends).
    `step_ends` [b, T] bool is needed by heads that read a whole step (`step_logprobs`, `log_ratio`).
    `log_ratio` also reads the response's logprobs under the reference, `reference_logprobs` [b, T] when the
    caller has them (the stage's training caches them), else computed here by `reference_token_logprobs`
    (a second forward, no grad: the gradient reaches the adapter through the PRM's own pass)."""
    t = input_ids.shape[1] - prompt_length
    if head.reads in ("token_logprobs", "token_log_ratios") and step_ends is None:
        raise ValueError(f"prm head {head.kind!r} reads whole steps: prm_step_logits needs step_ends")
    keep = {"next_logits": t, "token_logprobs": t + 1, "token_log_ratios": t + 1}.get(head.reads)  # LM positions
    final, lm_logits = _lm_pass(model, input_ids, attention_mask, position_ids, keep)
    hidden = final[:, prompt_length:]  # [b, T, H]: position P + t has read token t
    valid = attention_mask[:, prompt_length:].bool()  # [b, T]
    logits = lm_logits if head.reads == "next_logits" else None  # [b, T, V]
    token_logprobs = None
    if head.reads in ("token_logprobs", "token_log_ratios"):
        # position P - 1 + t predicts response token t
        token_logprobs = logprobs_from_logits(lm_logits[:, :-1], input_ids[:, prompt_length:])  # [b, T]
    if head.reads == "token_log_ratios" and reference_logprobs is None:
        reference_logprobs = reference_token_logprobs(model, input_ids, attention_mask, position_ids, prompt_length,
                                                      head.reference)
    return head(StepInputs(hidden, logits, token_logprobs, valid, step_ends,
                           reference_logprobs if head.reads == "token_log_ratios" else None))


class StepScorer(Protocol):
    """Step scores for a batch of responses (a `RolloutBatch` or anything with its fields)."""

    boundaries: StepBoundaries

    def score(self, batch) -> tuple[Tensor, Tensor]:
        """(scores [B, T] in [0, 1], zero off step ends; step_end_mask [B, T] bool)."""


def _chunked_scores(model, head: nn.Module, batch, ends: Tensor, chunk_rows: int) -> Tensor:
    """sigmoid(step logits) [B, T] of `head` on `model` as it is set up now, `chunk_rows` rows per forward,
    zero off step ends."""
    device = next(model.parameters()).device
    chunks = []
    for rows in torch.arange(len(ends)).split(chunk_rows):
        ids, att, pos = (t[rows].to(device) for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
        logits = prm_step_logits(model, head, ids, att, pos, batch.prompt_length, ends[rows].to(device))
        chunks.append(torch.sigmoid(logits).float().cpu())  # [b, T]
    return torch.cat(chunks).to(ends.device) * ends  # [B, T]


class LearnedStepScorer:
    """The trained PRM on the shared backbone; never changes what the policy trains."""

    def __init__(self, peft_model, head: nn.Module, delimiter_ids: frozenset[int], eos_id: int, chunk_rows: int,
                 blank_ids: frozenset[int] | None = None):
        if chunk_rows <= 0:
            raise ValueError(f"prm_train.chunk_rows={chunk_rows} must be > 0")
        self.peft_model, self.head, self.chunk_rows = peft_model, head, chunk_rows
        self.boundaries = StepBoundaries(frozenset(delimiter_ids), frozenset(blank_ids or delimiter_ids), eos_id)

    @torch.no_grad()
    def score(self, batch) -> tuple[Tensor, Tensor]:
        ends = self.boundaries.mask(batch.response_ids, batch.response_mask)  # [B, T]
        with adapter_active(self.peft_model, PRM_ADAPTER):
            return _chunked_scores(self.peft_model, self.head, batch, ends, self.chunk_rows), ends


class LikelihoodControlScorer:
    """The untrained `step_logprobs` rule of the reference model as a PRM (`reward=prm_likelihood_control`):
    sigmoid(SCALE * (lowest token logprob of the step + 1)), `StepLogprobHead` at its init, on `model` with
    every adapter off (the policy's base under LoRA, the frozen copy under `lora=none`: the SFT model).

    Nothing is trained and no PRM artifact exists: a step scores high when the SFT model found each of its
    tokens likely. A PRM arm with this scorer receives a likelihood bonus shaped like process rewards, the
    control that tells process supervision apart from a reward for steps the SFT model finds likely."""

    def __init__(self, model: nn.Module, delimiter_ids: frozenset[int], eos_id: int, chunk_rows: int,
                 blank_ids: frozenset[int] | None = None):
        if chunk_rows <= 0:
            raise ValueError(f"prm_train.chunk_rows={chunk_rows} must be > 0")
        device = next(model.parameters()).device
        self.model, self.chunk_rows = model, chunk_rows
        self.head = StepLogprobHead().to(device).eval().requires_grad_(False)
        self.boundaries = StepBoundaries(frozenset(delimiter_ids), frozenset(blank_ids or delimiter_ids), eos_id)

    @torch.no_grad()
    def score(self, batch) -> tuple[Tensor, Tensor]:
        ends = self.boundaries.mask(batch.response_ids, batch.response_mask)  # [B, T]
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_off(self.model):
                return _chunked_scores(self.model, self.head, batch, ends, self.chunk_rows), ends
        finally:
            self.model.train(was_training)


class OracleStepScorer:
    """The task's exact step checker as a PRM (`reward=prm_oracle`): 1.0 right, 0.0 wrong."""

    def __init__(self, task, tokenizer, delimiter_ids: frozenset[int], eos_id: int,
                 blank_ids: frozenset[int] | None = None):
        probe = task.problems("test")[0]
        if task.check_steps(probe, probe.solution) is None:
            raise ValueError(f"reward=prm_oracle (reward.scorer=oracle) needs a task with an exact step checker, "
                             f"but task {task.name!r} has none (check_steps returns None); use reward=prm with a "
                             "learned PRM, or task=arith")
        self.task, self.tokenizer = task, tokenizer
        self.boundaries = StepBoundaries(frozenset(delimiter_ids), frozenset(blank_ids or delimiter_ids), eos_id)

    @torch.no_grad()
    def score(self, batch) -> tuple[Tensor, Tensor]:
        ends = self.boundaries.mask(batch.response_ids, batch.response_mask)  # [B, T]
        scores = torch.zeros(ends.shape, dtype=torch.float32)  # [B, T]
        for row, problem in enumerate(batch.problems):
            length = int(batch.response_mask[row].sum())
            positions = ends[row].nonzero().squeeze(-1).tolist()
            labels = align_step_labels(self.task, problem, self.tokenizer, batch.response_ids[row, :length].tolist(),
                                       positions, self.boundaries.delimiter_ids)
            scores[row, positions] = torch.tensor(labels, dtype=torch.float32)
        return scores.to(ends.device), ends


def save_prm(out_dir: str | Path, peft_model, head: nn.Module) -> Path:
    """Write the `prm` adapter, the head and `prm_meta.json` into `out_dir` (safetensors only)."""
    out_dir = Path(out_dir)
    peft_model.save_pretrained(out_dir, selected_adapters=[PRM_ADAPTER], safe_serialization=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(out_dir / HEAD_FILE))
    lora = peft_model.peft_config[PRM_ADAPTER]
    meta = {"head": head.kind, "good_token": getattr(head, "good_token", None),
            "bad_token": getattr(head, "bad_token", None), "scale": getattr(head, "scale", None), "r": lora.r,
            "alpha": lora.lora_alpha, "target_modules": sorted(lora.target_modules)}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out_dir


def load_prm(prm_dir: str | Path, model: nn.Module, tokenizer) -> tuple[nn.Module, nn.Module]:
    """(peft_model, head): the frozen `prm` adapter added to `model` (a PeftModel, e.g. the
    policy's, whose active adapter and trainable flags are left as they were) or wrapped around
    it (a plain model), and the frozen head on the model's device."""
    prm_dir = Path(prm_dir)
    if not (prm_dir / META_FILE).is_file():
        raise FileNotFoundError(f"{prm_dir / META_FILE} is missing: {prm_dir} is not a PRM made by the prm stage")
    meta = json.loads((prm_dir / META_FILE).read_text())
    adapter_dir = find_adapter_dir(prm_dir)
    if isinstance(model, PeftModel):
        flags = {id(p): p.requires_grad for p in model.parameters()}
        previous = model.active_adapter
        model.load_adapter(str(adapter_dir), adapter_name=PRM_ADAPTER, is_trainable=False)
        model.set_adapter(previous)
        for p in model.parameters():
            p.requires_grad_(flags.get(id(p), False))  # the new prm weights are not in `flags`: frozen
        peft_model = model
    else:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=PRM_ADAPTER, is_trainable=False)
    base_config = peft_model.get_base_model().config
    head = make_head(meta["head"], base_config.hidden_size, tokenizer, meta["good_token"] or "+",
                     meta["bad_token"] or "-", meta.get("scale"))
    state = load_file(str(prm_dir / HEAD_FILE))
    head.load_state_dict(state)
    device = next(peft_model.parameters()).device
    return peft_model, head.to(device).eval().requires_grad_(False)


def build_step_scorer(*, scorer: str, task, tokenizer, model: nn.Module | None = None,
                      prm_dir: str | Path | None = None, chunk_rows: int) -> StepScorer:
    """The step scorer `reward.scorer` names: `learned`, the PRM artifact at `prm_dir` loaded onto `model`
    (e.g. the policy's PeftModel); `oracle`, the task's exact step checker; `likelihood_control`, the
    untrained `step_logprobs` rule of `model` with its adapters off (the SFT model)."""
    boundaries = StepBoundaries.from_tokenizer(tokenizer, task.step_delimiter)
    if scorer == "oracle":
        return OracleStepScorer(task, tokenizer, boundaries.delimiter_ids, boundaries.eos_token_id,
                                boundaries.blank_ids)
    if scorer == "likelihood_control":
        if model is None:
            raise ValueError("reward.scorer=likelihood_control needs the model whose base (adapters off) it reads")
        return LikelihoodControlScorer(model, boundaries.delimiter_ids, boundaries.eos_token_id, chunk_rows,
                                       boundaries.blank_ids)
    if scorer != "learned":
        raise ValueError(f"reward.scorer={scorer!r} is not one of {', '.join(SCORER_KINDS)}")
    if model is None or prm_dir is None:
        raise ValueError("a learned PRM scorer needs the PRM artifact dir (ensure_prm) and the model to load it on")
    peft_model, head = load_prm(prm_dir, model, tokenizer)
    return LearnedStepScorer(peft_model, head, boundaries.delimiter_ids, boundaries.eos_token_id, chunk_rows,
                             boundaries.blank_ids)
