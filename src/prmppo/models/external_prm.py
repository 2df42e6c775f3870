"""An off-the-shelf PRM checkpoint as the step scorer (`reward=prm_external`): its own model and tokenizer,
the policy's steps rebuilt in its format, its step scores put back on the policy's step-end tokens.

    python -m prmppo task=jsonl ... reward=prm_external reward.path=/ckpt/math-shepherd-mistral-7b-prm

Per batch of policy responses:
  1. step ends   from the policy's tokenizer, as for every step reward (`rewards/steps.py`): the k-th step
                 is the policy's tokens after step end k-1 up to step end k, decoded, delimiter removed;
  2. rebuild     each response in the PRM's format (`reward.format`):
                   math_shepherd  `<question> <step 1> ки\\n<step 2> ки\\n...`: a tag after every step;
                   qwen_prm       system, user question and assistant `<step 1><extra_0><step 2><extra_0>...`
                                  through the PRM's own chat template;
  3. score       the PRM reads the text (micro-batches of `reward.micro_batch_rows`, `no_grad`, on
                 `reward.device` or the trainer's); at the k-th marker the step score is P(good):
                   math_shepherd  softmax over the LM logits of `+` and `-`, the `+` side;
                   qwen_prm       softmax of the two-class `score` head, class 1;
  4. map back    score k lands on the policy's k-th step-end token; scores [B, T] zero elsewhere.

The PRM and the policy need not share a tokenizer: steps travel as text. `check_external_prm` checks the
directory, the format's marker tokens in the PRM's tokenizer (each a single token inside the model's
vocabulary) and, for qwen_prm, the chat template and the score head's shapes, without reading weights (a
launch gate); `load_external_scorer` then loads it. A qwen_prm checkpoint is loaded without its remote
code: the base model through transformers' own classes, the `score.*` head (Linear, ReLU, Linear to 2
classes) from its safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from prmppo.errors import PrmppoError
from prmppo.rewards.steps import StepBoundaries


class ExternalPRMError(PrmppoError):
    """An external PRM checkpoint that cannot be used in the format asked for; the message names it."""


def single_token_id(tokenizer, text: str, what: str, where: str) -> int:
    """The id of `text` when the tokenizer writes it as one token (alone, no special tokens), else refused."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ExternalPRMError(f"{where}: the {what} {text!r} is {len(ids)} tokens of this PRM's tokenizer "
                               f"({ids}), not one: not a checkpoint of this reward.format")
    return ids[0]


@dataclass(frozen=True)
class MathShepherdFormat:
    """Math-Shepherd's step format: a tag token after every step, read as `+` (good) vs `-` (bad) by the LM head."""

    marker: str = "ки"
    good_token: str = "+"
    bad_token: str = "-"

    def check(self, tokenizer, where: str) -> list[int]:
        """The ids of the marker and the two label tokens, each refused unless a single token."""
        return [single_token_id(tokenizer, self.marker, "step tag", where),
                single_token_id(tokenizer, self.good_token, "good-step token", where),
                single_token_id(tokenizer, self.bad_token, "bad-step token", where)]

    def text(self, tokenizer, question: str, steps: list[str]) -> str:  # noqa: ARG002 - same signature as Qwen's
        """The PRM's input: the question, then each step followed by the tag and a newline."""
        return f"{question} " + "".join(f"{step} {self.marker}\n" for step in steps)

    def step_probs(self, logits: Tensor, ids: list[int]) -> Tensor:
        """P(good) [b, L] from the LM logits [b, L, V]: softmax over the (good, bad) pair."""
        return logits[..., ids[1:]].float().softmax(-1)[..., 0]


@dataclass(frozen=True)
class QwenPRMFormat:
    """Qwen2.5-Math-PRM's format: the conversation through the PRM's chat template, the assistant turn the steps
    each followed by `<extra_0>`, read by a two-class head at each separator (class 1: a good step)."""

    marker: str = "<extra_0>"
    system_prompt: str = "Please reason step by step, and put your final answer within \\boxed{}."

    def check(self, tokenizer, where: str) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise ExternalPRMError(f"{where}: reward.format=qwen_prm needs the PRM tokenizer's chat template, and it "
                                   "has none")
        return [single_token_id(tokenizer, self.marker, "step separator", where)]

    def text(self, tokenizer, question: str, steps: list[str]) -> str:
        conversation = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question},
                        {"role": "assistant", "content": "".join(f"{step}{self.marker}" for step in steps)}]
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)

    def step_probs(self, logits: Tensor, ids: list[int]) -> Tensor:  # noqa: ARG002 - same signature as Shepherd's
        """P(good) [b, L] from the head's two-class logits [b, L, 2]."""
        return logits.float().softmax(-1)[..., 1]


PRM_FORMATS = {"math_shepherd": MathShepherdFormat(), "qwen_prm": QwenPRMFormat()}


class ExternalStepScorer:
    """Step scores [B, T] from an external PRM (module docstring); the same contract as the trained PRM's."""

    def __init__(self, model, prm_tokenizer, prm_format, policy_tokenizer, step_delimiter: str,
                 micro_batch_rows: int, where: str = "reward.path"):
        if micro_batch_rows < 1:
            raise ValueError(f"reward.micro_batch_rows={micro_batch_rows} must be >= 1")
        self.model, self.tokenizer, self.format = model, prm_tokenizer, prm_format
        self.policy_tokenizer, self.delimiter, self.micro_batch_rows = policy_tokenizer, step_delimiter, micro_batch_rows
        self.format_ids = prm_format.check(prm_tokenizer, where)
        self.tag_id = self.format_ids[0]
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
        ids = self.tokenizer(self.format.text(self.tokenizer, question, steps))["input_ids"]
        tags = sum(i == self.tag_id for i in ids)
        if tags != len(steps):
            raise ExternalPRMError(f"the PRM's input holds {tags} step tags for {len(steps)} steps (a step's text "
                                   f"contains the tag {self.format.marker!r}, or the tokenizer merged it)")
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
            pair = self.format.step_probs(logits, self.format_ids).cpu()  # [b, L] P(good)
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


SCORE_HEAD_PREFIX = "score."  # qwen_prm: Linear(hidden, hidden), ReLU, Linear(hidden, 2) as score.0 / score.2


def score_head_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Shapes of the `score.*` tensors in the directory's safetensors files (headers only, no weights read)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.startswith(SCORE_HEAD_PREFIX):
                    shapes[key[len(SCORE_HEAD_PREFIX):]] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _check_score_head(path: Path, hidden_size: int, where: str) -> None:
    want = {"0.weight": (hidden_size, hidden_size), "0.bias": (hidden_size,), "2.weight": (2, hidden_size),
            "2.bias": (2,)}
    found = score_head_shapes(path)
    if found != want:
        raise ExternalPRMError(f"{where}: reward.format=qwen_prm needs a two-class score head "
                               f"{ {SCORE_HEAD_PREFIX + k: v for k, v in want.items()} } (hidden size {hidden_size}); "
                               f"the checkpoint holds {found or 'no score.* tensors'}")


class TwoClassPRM(torch.nn.Module):
    """A base transformer and the two-class `score` head on its last hidden states (qwen_prm)."""

    def __init__(self, base, score: torch.nn.Module):
        super().__init__()
        self.base, self.score = base, score

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [b, L, H]
        return SimpleNamespace(logits=self.score(hidden))  # [b, L, 2]


def load_two_class_prm(path: Path, dtype: str, device: str) -> TwoClassPRM:
    """The base model through transformers' own classes (no remote code) and the `score.*` head read from the
    safetensors files."""
    from safetensors import safe_open
    from transformers import AutoModel

    from prmppo.models.loading import DTYPES

    base = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=DTYPES[dtype], use_safetensors=True)
    hidden = base.config.hidden_size
    score = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            state.update({k[len(SCORE_HEAD_PREFIX):]: handle.get_tensor(k) for k in handle.keys()
                          if k.startswith(SCORE_HEAD_PREFIX)})
    score.load_state_dict(state)
    return TwoClassPRM(base, score.to(DTYPES[dtype])).to(device).eval()


def check_external_prm(path: str, prm_format: str):
    """(tokenizer, format) of the PRM checkpoint at `path`, checked without reading weights: the directory is
    whole, the format is known, its marker tokens are single tokens inside the model's vocabulary, and (qwen_prm)
    the tokenizer has a chat template and the checkpoint a two-class score head of the model's width."""
    from prmppo.models.loading import check_model_dir, load_tokenizer

    if prm_format not in PRM_FORMATS:
        raise ExternalPRMError(f"reward.format={prm_format!r} is not one of {', '.join(PRM_FORMATS)}")
    fmt = PRM_FORMATS[prm_format]
    info = check_model_dir(path)
    tokenizer = load_tokenizer(Path(path))
    where = f"reward.path={path}"
    for token in fmt.check(tokenizer, where):
        if token >= info.vocab_size:
            raise ExternalPRMError(f"{where}: the format's token id {token} is past the model's vocab_size "
                                   f"{info.vocab_size}")
    if isinstance(fmt, QwenPRMFormat):
        config = json.loads((Path(path) / "config.json").read_text())
        _check_score_head(Path(path), int(config["hidden_size"]), where)
    return tokenizer, fmt


def load_external_scorer(path: str, prm_format: str, device: str, dtype: str, policy_tokenizer, step_delimiter: str,
                         micro_batch_rows: int) -> ExternalStepScorer:
    """The checked PRM checkpoint at `path` loaded on `device` in `dtype`, as a step scorer for the policy."""
    from prmppo.models.loading import load_model

    tokenizer, fmt = check_external_prm(path, prm_format)
    if isinstance(fmt, QwenPRMFormat):
        model = load_two_class_prm(Path(path), dtype, device)
    else:
        model = load_model(Path(path), dtype, device)
    return ExternalStepScorer(model, tokenizer, fmt, policy_tokenizer, step_delimiter, micro_batch_rows,
                              where=f"reward.path={path}")


def check_external_reward(reward) -> dict:
    """The launch gate of `reward=prm_external` (`rewards/prm_external.py`): its checkpoint is whole and
    speaks `reward.format` (no weights read)."""
    check_external_prm(reward.path, reward.format)
    return {"path": reward.path, "format": reward.format}


def external_step_scorer(reward, task, tokenizer, train_device: str):
    """`reward=prm_external`'s checkpoint loaded as a step scorer of the policy's responses (`tokenizer`: the
    policy's), on `reward.device` or else the trainer's device."""
    return load_external_scorer(reward.path, reward.format, reward.device or train_device, reward.dtype, tokenizer,
                                task.step_delimiter, reward.micro_batch_rows)
