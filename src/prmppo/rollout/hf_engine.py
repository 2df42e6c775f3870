"""The built-in rollout engine: batched sampling with a KV cache in plain PyTorch.

`HFEngine` holds one Hugging Face causal LM loaded from a local HF-layout directory and serves
three kinds of weights (`WeightsSpec.kind`):

- "base": the directory the engine was built from;
- "checkpoint": full merged HF-layout weights from another directory (reloaded);
- "adapter": a peft LoRA adapter applied on the resident base, without reloading the base
  (each sync loads under a fresh adapter name, activates it, and deletes the previous one).

Sampling (`generate`): every prompt is repeated n times, rows are LEFT-padded to a common
length with explicit position ids (cumsum(mask) - 1, so padding never shifts positions), one
prefill forward, then one token per row per step through the model's own KV cache. A row stops
after EOS (positions after it are not returned); the loop ends when every row is done.

Logprob contract: the logprob returned for a sampled token is log_softmax(logits / temperature)
at that token, computed in float32 BEFORE top-p truncation. It therefore equals what the trainer
gets from one full forward pass over prompt + response at the same temperature, which is what
the PPO ratio tripwire compares (with top_p < 1 the sampling distribution differs from that
logprob; that is the usual, documented PPO approximation).

Simplifications: no continuous batching, no paged cache, and rows that finished keep being fed
(their outputs are discarded) until the whole batch is done.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_hf_engine.py -q`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from prmppo.rollout.protocol import WeightsSpec, validate_sampling_args

LOG = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def find_adapter_dir(path: str | Path) -> Path:
    """Return the directory holding adapter_config.json: `path` itself or its one subdirectory.

    peft saves the "default" adapter at the top level and a named adapter in a subdirectory
    named after it; both layouts are accepted.
    """
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return path
    candidates = sorted(p.parent for p in path.glob("*/adapter_config.json"))
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise FileNotFoundError(
            f"adapter dir {path} holds no adapter_config.json "
            "(neither at the top level nor in a subdirectory)"
        )
    raise ValueError(
        f"adapter dir {path} holds several adapters {[p.name for p in candidates]}; point weights.path at one"
    )


def left_pad(rows: list[list[int]], pad_token_id: int, device: str) -> tuple[torch.Tensor, ...]:
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
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from logits [B, V]; returns tokens [B] and their logprobs [B].

    The logprob is taken from the full tempered distribution, before top-p truncation (see the
    module docstring for why).
    """
    logprobs_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    probs = logprobs_all.exp()  # [B, V]
    if top_p < 1.0:
        sorted_probs, sorted_index = probs.sort(dim=-1, descending=True)  # [B, V]
        # Keep a token while the mass strictly before it is < top_p: the top token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_index, sorted_probs)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # [B]
    token_logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    return tokens, token_logprobs


class HFEngine:
    """A Hugging Face causal LM that serves base / checkpoint / adapter weights and samples."""

    def __init__(self, base_model_dir: str, device: str = "cpu", dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid; valid: {sorted(DTYPES)}")
        if not (Path(base_model_dir) / "config.json").is_file():
            raise FileNotFoundError(
                f"base_model_dir={base_model_dir!r} has no config.json (need an HF-layout dir)"
            )
        self.base_model_dir = str(base_model_dir)
        self.device = device
        self.dtype = DTYPES[dtype]
        self._model = self._load_hf_dir(self.base_model_dir)
        self._resident = "base"  # resident backbone: "base" | "checkpoint" | "unknown"
        self._adapter_name: str | None = None
        self._adapter_loads = 0
        self._served: WeightsSpec | None = WeightsSpec(kind="base", path=None, version=0)

    @property
    def served_weights(self) -> WeightsSpec | None:
        """The weights `generate` samples with; None after a failed `load_weights`."""
        return self._served

    @property
    def model(self) -> torch.nn.Module:
        """The module `generate` runs (a PeftModel while an adapter is served)."""
        return self._model

    def _load_hf_dir(self, model_dir: str) -> torch.nn.Module:
        # imported here: the vLLM engine environment imports this module (find_adapter_dir) and
        # need not have transformers or peft of the trainer's versions
        from transformers import AutoModelForCausalLM

        LOG.info("loading HF weights from %s (dtype=%s, device=%s)", model_dir, self.dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=self.dtype,
                                                     use_safetensors=True)
        return model.to(self.device).eval()

    def _use_base(self) -> None:
        """Make the resident module the pristine base (LoRA layers removed, unmerged)."""
        if self._resident != "base":
            self._adapter_name = None
            self._model = None  # free the old weights before loading the base
            self._model = self._load_hf_dir(self.base_model_dir)
            self._resident = "base"
        elif self._adapter_name is not None:
            self._model = self._model.unload().eval()
            self._adapter_name = None

    def load_weights(self, spec: WeightsSpec) -> None:
        """Serve `spec`. On failure the previous weights may be half gone: nothing is served
        until a later `load_weights` succeeds (a "base" request always recovers)."""
        self._served = None
        try:
            if spec.kind == "base":
                self._use_base()
            elif spec.kind == "checkpoint":
                self._load_checkpoint(spec)
            else:
                self._load_adapter(spec)
        except BaseException:
            self._resident = "unknown"  # forces a reload from disk on the next load_weights
            raise
        self._served = spec
        LOG.info("serving weights %s", spec)

    def _load_checkpoint(self, spec: WeightsSpec) -> None:
        if not (Path(spec.path) / "config.json").is_file():
            raise FileNotFoundError(
                f"checkpoint weights.path={spec.path!r} has no config.json (need an HF-layout dir)"
            )
        self._adapter_name = None
        self._model = None  # free the old weights before loading the new ones
        self._model = self._load_hf_dir(spec.path)
        self._resident = "checkpoint"

    def _load_adapter(self, spec: WeightsSpec) -> None:
        from peft import PeftModel  # here, not at the top: see _load_hf_dir

        adapter_dir = find_adapter_dir(spec.path)
        if self._resident != "base":  # an adapter is trained against the base, not a checkpoint
            self._use_base()
        self._adapter_loads += 1
        name = f"sync{self._adapter_loads}"  # fresh per load: the same version may be re-sent
        if self._adapter_name is None:
            # the factors in the served dtype, as the trainer's policy holds them (peft would upcast a
            # bf16 model's to fp32 and run every LoRA layer's GEMMs in fp32)
            self._model = PeftModel.from_pretrained(
                self._model, str(adapter_dir), adapter_name=name, is_trainable=False,
                autocast_adapter_dtype=False,
            )
        else:
            previous = self._adapter_name
            self._model.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=False,
                                     autocast_adapter_dtype=False)
            self._model.set_adapter(name)
            self._model.delete_adapter(previous)
        self._adapter_name = name
        self._model.to(self.device).eval()

    @torch.inference_mode()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n_samples_per_prompt: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        eos_token_id: int,
        pad_token_id: int,
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Sample responses; returns (token_ids, logprobs, finish_reasons), rows prompt-major."""
        if self._served is None:
            raise RuntimeError(
                "no weights are served: the last load_weights failed; load weights again first"
            )
        validate_sampling_args(
            prompt_token_ids, n_samples_per_prompt, max_new_tokens, temperature, top_p, seed,
            eos_token_id, pad_token_id,
        )
        vocab_size = self._model.get_input_embeddings().num_embeddings
        for index, prompt in enumerate(prompt_token_ids):
            if max(prompt) >= vocab_size:
                raise ValueError(
                    f"prompt_token_ids[{index}] holds id {max(prompt)} >= vocab size {vocab_size}"
                )
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return sample_responses(
            self._model, prompt_token_ids, n_samples_per_prompt, max_new_tokens, temperature, top_p,
            generator, eos_token_id, pad_token_id,
        )


def sample_responses(
    model, prompt_token_ids: list[list[int]], n_samples_per_prompt: int, max_new_tokens: int,
    temperature: float, top_p: float, generator: torch.Generator, eos_token_id: int, pad_token_id: int,
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Sample from any in-process causal LM; rows prompt-major, cut after EOS.

    The engine and in-process evaluation share this loop, so their numbers mean the same.
    `temperature == 0` means greedy decoding (logprobs then are those of the untempered model).
    """
    rows = [prompt for prompt in prompt_token_ids for _ in range(n_samples_per_prompt)]
    device = next(model.parameters()).device
    with torch.inference_mode():
        tokens, logprobs, done = _sample_loop(
            model, rows, max_new_tokens, temperature, top_p, generator, eos_token_id, pad_token_id, device
        )
    return _trim_rows(tokens, logprobs, done, eos_token_id)


def _sample_loop(model, rows, max_new_tokens, temperature, top_p, generator, eos_token_id, pad_token_id, device):
    """Prefill + cached decode; returns tokens [B, T], logprobs [B, T], done [B] (T <= max)."""
    input_ids, attention_mask, position_ids = left_pad(rows, pad_token_id, device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    next_logits = out.logits[:, -1, :]  # [B, V]
    next_position = position_ids[:, -1:] + 1  # [B, 1]
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)  # [B]
    sampled, sampled_logprobs = [], []
    for step in range(max_new_tokens):
        if temperature == 0:
            logprobs_all = torch.log_softmax(next_logits.float(), dim=-1)  # [B, V]
            tokens = logprobs_all.argmax(dim=-1)  # [B]
            token_logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
        else:
            tokens, token_logprobs = sample_tokens(next_logits, temperature, top_p, generator)  # [B], [B]
        tokens = tokens.masked_fill(done, pad_token_id)  # finished rows emit nothing real
        sampled.append(tokens)
        sampled_logprobs.append(token_logprobs)
        done = done | (tokens == eos_token_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=-1)
        out = model(
            input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_position,
            use_cache=True, **_cache_kwargs(out),
        )
        next_logits = out.logits[:, -1, :]  # [B, V]
        next_position = next_position + 1
    return torch.stack(sampled, dim=1), torch.stack(sampled_logprobs, dim=1), done  # [B, T], [B, T], [B]


def _cache_kwargs(out) -> dict:
    """Feed back the KV cache a forward returned, under the name this transformers uses.

    Recent transformers 5.x releases call it `cache` (and warn on `past_key_values`, to be
    removed in 5.40); earlier ones call it `past_key_values`. The output's keys tell which
    name this version speaks.
    """
    if "cache" in out.keys():
        return {"cache": out["cache"]}
    return {"past_key_values": out["past_key_values"]}


def _trim_rows(
    tokens: torch.Tensor, logprobs: torch.Tensor, done: torch.Tensor, eos_token_id: int
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Cut each row after its first EOS; rows without EOS ran out of `max_new_tokens`."""
    token_rows, logprob_rows, finish_reasons = [], [], []
    rows = zip(tokens.tolist(), logprobs.float().tolist(), done.tolist())
    for row_tokens, row_logprobs, row_done in rows:
        length = row_tokens.index(eos_token_id) + 1 if row_done else len(row_tokens)
        token_rows.append(row_tokens[:length])
        logprob_rows.append(row_logprobs[:length])
        finish_reasons.append("stop" if row_done else "length")
    return token_rows, logprob_rows, finish_reasons
