"""The built-in engine's generation loop, run on whatever causal LM it is handed.

`Decoding` holds the decode settings (`decode`, `done_check_every`, `prefill_tokens`) and the
static decoder it last built, and samples a request with `generate(model, device, ...)`. The
worker's engine (`hf_engine.HFEngine`) hands it the model it keeps resident; the in-process
engine (`inprocess.InProcessEngine`) hands it the trainer's own policy model, so that both sample
with the same code, the same random numbers and the same logprob contract.

Every prompt is repeated n times, rows prompt-major. Two loops:

- "static" (the default; "static_eager" without CUDA graphs): `static_decode.py`, a KV cache
  allocated for the request's rows and its longest prompt + `max_new_tokens` (rounded up to
  `SLOT_ROUNDING` slots), kept for the next request while it fits (same row count, long enough,
  the same parameter storage), length-sorted prefill chunks, finished rows dropped from the decode
  batch in bucket sizes, each bucket's decode step a CUDA graph on CUDA;
- "dynamic": rows LEFT-padded to a common length with explicit position ids (cumsum(mask) - 1,
  so padding never shifts positions), one prefill forward, then one token per row per step
  through the model's own growing KV cache; rows that finished keep being fed (their outputs
  are discarded) until the whole batch is done. In-process sampling (`sample_responses`, used by
  evaluation and the PRM's Monte-Carlo labels) uses it.

Both draw the same random numbers (`sampling.py`), so for a seed they sample the same tokens up to
float rounding of the logits. A row stops after EOS (positions after it are not returned).

Logprob contract: the logprob returned for a sampled token is log_softmax(logits / temperature)
at that token, computed in float32 BEFORE top-p truncation. It therefore equals what the trainer
gets from one full forward pass over prompt + response at the same temperature, which is what
the PPO ratio tripwire compares (with top_p < 1 the sampling distribution differs from that
logprob; that is the usual, documented PPO approximation).

Simplifications: no continuous batching and no paged cache.
"""

from __future__ import annotations

import logging

import torch

from prmppo.rollout.protocol import validate_sampling_args
from prmppo.rollout.sampling import left_pad, next_tokens
from prmppo.rollout.static_decode import StaticDecoder, sample_static, unsupported_reason

LOG = logging.getLogger(__name__)
DECODE_MODES = ("static", "static_eager", "dynamic")
SLOT_ROUNDING = 128  # the static cache's length is rounded up to this, so that it serves later requests


class Decoding:
    """The sampling loop of the built-in engine and the static decoder it keeps between requests.

    `decode` picks the loop: "static" (`static_decode.py`: pre-allocated KV cache, finished rows
    dropped in buckets, each bucket's decode step a CUDA graph on CUDA), "static_eager" (the same
    without graphs) or "dynamic" (`sample_loop`: the model's own growing cache, every row fed
    until all are done). `done_check_every` (decode steps between reads of how many rows are
    unfinished) and `prefill_tokens` (padded tokens per prefill forward) tune the static loop.
    """

    def __init__(self, decode: str = "static", done_check_every: int = 8, prefill_tokens: int = 16384,
                 compile_decode: bool = False) -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r} is invalid; valid: {list(DECODE_MODES)}")
        for name, value in (("done_check_every", done_check_every), ("prefill_tokens", prefill_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= 1")
        if not isinstance(compile_decode, bool):
            raise ValueError(f"compile_decode={compile_decode!r} is invalid; it must be true or false")
        if compile_decode and decode == "dynamic":
            raise ValueError("compile_decode=true compiles the static loop's decode step: decode=dynamic has none")
        self.decode, self.done_check_every, self.prefill_tokens = decode, done_check_every, prefill_tokens
        self.compile_decode = compile_decode
        self.decoder: StaticDecoder | None = None  # its KV cache and CUDA graphs, kept while it fits
        self.last_loop: str | None = None  # the loop the last generate ran

    @property
    def info(self) -> dict:
        """What the last `generate` ran: its loop ("static" or "dynamic", which a model the static
        loop cannot run falls back to), the bucket sizes that have a captured CUDA graph, and the
        static loop's decode attention (`grouped_attention.NAME`, or None: the model's own)."""
        decoder = self.decoder if self.last_loop == "static" else None
        graphs = sorted(decoder.graphs) if decoder is not None and decoder.use_graphs else []
        attention = decoder.decode_attention if decoder is not None else None
        return {"loop": self.last_loop, "cuda_graph_buckets": graphs, "decode_attention": attention}

    def release(self) -> None:
        """Drop the static decoder (its KV cache, its CUDA graphs): before the model it was built for is
        replaced, or to give its memory back between requests."""
        self.decoder = None

    def generate(self, model, device, prompt_token_ids: list[list[int]], n_samples_per_prompt: int,
                 max_new_tokens: int, temperature: float, top_p: float, seed: int, eos_token_id: int,
                 pad_token_id: int) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Sample responses from `model` (on `device`); returns (token_ids, logprobs, finish_reasons),
        rows prompt-major. The caller picks the grad mode (the worker's engine: inference mode)."""
        validate_sampling_args(
            prompt_token_ids, n_samples_per_prompt, max_new_tokens, temperature, top_p, seed,
            eos_token_id, pad_token_id,
        )
        vocab_size = model.get_input_embeddings().num_embeddings
        for index, prompt in enumerate(prompt_token_ids):
            if max(prompt) >= vocab_size:
                raise ValueError(
                    f"prompt_token_ids[{index}] holds id {max(prompt)} >= vocab size {vocab_size}"
                )
        generator = torch.Generator(device=device).manual_seed(seed)
        rows = [prompt for prompt in prompt_token_ids for _ in range(n_samples_per_prompt)]
        decoder = self._static_decoder(model, device, len(rows), max(map(len, rows)) + max_new_tokens)
        self.last_loop = "dynamic" if decoder is None else "static"
        if decoder is None:
            tokens, logprobs, done = sample_loop(model, rows, max_new_tokens, temperature, top_p, generator,
                                                 eos_token_id, pad_token_id, device)
        else:
            tokens, logprobs, done = sample_static(decoder, rows, max_new_tokens, temperature, top_p, generator,
                                                   eos_token_id, pad_token_id, self.done_check_every)
        return trim_rows(tokens, logprobs, done, eos_token_id)

    def _static_decoder(self, model, device, rows: int, slots_needed: int) -> StaticDecoder | None:
        """The static decoder for this request (kept while it fits), or None for the dynamic loop."""
        if self.decode == "dynamic":
            return None
        if self.decoder is not None and self.decoder.fits(model, rows, slots_needed):
            return self.decoder
        self.decoder = None  # free its buffers before allocating new ones
        slots = -(-slots_needed // SLOT_ROUNDING) * SLOT_ROUNDING
        reason = unsupported_reason(model, slots)
        if reason is not None:
            LOG.warning("decode=%s cannot run this model (%s); sampling with the dynamic cache", self.decode, reason)
            return None
        use_graphs = self.decode == "static" and torch.device(device).type == "cuda"
        self.decoder = StaticDecoder(model, rows, slots, use_graphs, self.prefill_tokens, self.compile_decode)
        return self.decoder


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
        tokens, logprobs, done = sample_loop(
            model, rows, max_new_tokens, temperature, top_p, generator, eos_token_id, pad_token_id, device
        )
    return trim_rows(tokens, logprobs, done, eos_token_id)


def sample_loop(model, rows, max_new_tokens, temperature, top_p, generator, eos_token_id, pad_token_id, device):
    """Prefill + cached decode; returns tokens [B, T], logprobs [B, T], done [B] (T <= max)."""
    input_ids, attention_mask, position_ids = left_pad(rows, pad_token_id, device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    next_logits = out.logits[:, -1, :]  # [B, V]
    next_position = position_ids[:, -1:] + 1  # [B, 1]
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)  # [B]
    sampled, sampled_logprobs = [], []
    for step in range(max_new_tokens):
        tokens, token_logprobs = next_tokens(next_logits, temperature, top_p, generator)  # [B], [B]
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


def trim_rows(
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
