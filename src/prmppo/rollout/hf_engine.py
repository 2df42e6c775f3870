"""The built-in rollout engine: batched sampling with a static KV cache and CUDA graphs in PyTorch.

`HFEngine` holds one Hugging Face causal LM loaded from a local HF-layout directory and serves
three kinds of weights (`WeightsSpec.kind`):

- "base": the directory the engine was built from;
- "checkpoint": full merged HF-layout weights from another directory, copied into the resident
  tensors in place when names and shapes match (else the module is reloaded);
- "adapter": a peft LoRA adapter merged into the resident base in place, so sampling runs at the
  base model's speed with no LoRA layers in the loop. The exact base values of every parameter
  an adapter changes are kept (copied before the first merge touches them) and copied back
  before the next merge or a "base" request: never an unmerge by subtraction;
- "shared": full merged weights the trainer keeps in a buffer shared with this process (a CUDA
  IPC handle or a `/dev/shm` file, `shared_weights.py`), copied into the resident tensors in place.

Sampling (`generate`): every prompt is repeated n times. Two loops (`decode`):

- "static" (the default; "static_eager" without CUDA graphs): `static_decode.py`, a
  pre-allocated KV cache, length-sorted prefill chunks, finished rows dropped from the decode
  batch in bucket sizes, each bucket's decode step a CUDA graph on CUDA;
- "dynamic": rows LEFT-padded to a common length with explicit position ids (cumsum(mask) - 1,
  so padding never shifts positions), one prefill forward, then one token per row per step
  through the model's own growing KV cache; rows that finished keep being fed (their outputs
  are discarded) until the whole batch is done. In-process sampling (`sample_responses`) uses it.

Both draw the same random numbers (`sampling.py`), so for a seed they sample the same tokens up to
float rounding of the logits. A row stops after EOS (positions after it are not returned).

Logprob contract: the logprob returned for a sampled token is log_softmax(logits / temperature)
at that token, computed in float32 BEFORE top-p truncation. It therefore equals what the trainer
gets from one full forward pass over prompt + response at the same temperature, which is what
the PPO ratio tripwire compares (with top_p < 1 the sampling distribution differs from that
logprob; that is the usual, documented PPO approximation).

Simplifications: no continuous batching and no paged cache.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_hf_engine.py -q`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from prmppo.rollout.protocol import WeightsSpec, validate_sampling_args
from prmppo.rollout.sampling import left_pad, next_tokens  # noqa: F401 (left_pad: guards/gates.py)
from prmppo.rollout.shared_weights import SharedWeightsReader
from prmppo.rollout.static_decode import StaticDecoder, sample_static, unsupported_reason

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


DECODE_MODES = ("static", "static_eager", "dynamic")
SLOT_ROUNDING = 128  # the static cache's length is rounded up to this, so that it serves later requests


class HFEngine:
    """A Hugging Face causal LM that serves base / checkpoint / adapter weights and samples.

    `decode` picks the sampling loop: "static" (`static_decode.py`: pre-allocated KV cache,
    finished rows dropped in buckets, each bucket's decode step a CUDA graph on CUDA),
    "static_eager" (the same without graphs) or "dynamic" (`_sample_loop`: the model's own
    growing cache, every row fed until all are done). `done_check_every` (decode steps between
    reads of how many rows are unfinished) and `prefill_tokens` (padded tokens per prefill
    forward) tune the static loop.
    """

    def __init__(self, base_model_dir: str, device: str = "cpu", dtype: str = "float32", decode: str = "static",
                 done_check_every: int = 8, prefill_tokens: int = 16384) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid; valid: {sorted(DTYPES)}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r} is invalid; valid: {list(DECODE_MODES)}")
        for name, value in (("done_check_every", done_check_every), ("prefill_tokens", prefill_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= 1")
        if not (Path(base_model_dir) / "config.json").is_file():
            raise FileNotFoundError(
                f"base_model_dir={base_model_dir!r} has no config.json (need an HF-layout dir)"
            )
        self.base_model_dir = str(base_model_dir)
        self.device = device
        self.dtype = DTYPES[dtype]
        self.decode, self.done_check_every, self.prefill_tokens = decode, done_check_every, prefill_tokens
        self._decoder: StaticDecoder | None = None
        self._last_loop: str | None = None  # the loop the last generate ran
        self._model = self._load_hf_dir(self.base_model_dir)
        self._resident = "base"  # resident backbone: "base" | "checkpoint" | "unknown"
        self._base_copy: dict[str, torch.Tensor] = {}  # exact base values of what adapters change
        self._merged = False  # an adapter is merged into the resident base
        self._served: WeightsSpec | None = WeightsSpec(kind="base", path=None, version=0)
        self._shared = SharedWeightsReader()

    @property
    def served_weights(self) -> WeightsSpec | None:
        """The weights `generate` samples with; None after a failed `load_weights`."""
        return self._served

    @property
    def decode_info(self) -> dict:
        """What the last `generate` ran: its loop ("static" or "dynamic", which a model the static
        loop cannot run falls back to), the bucket sizes that have a captured CUDA graph, and the
        static loop's decode attention (`grouped_attention.NAME`, or None: the model's own)."""
        decoder = self._decoder if self._last_loop == "static" else None
        graphs = sorted(decoder.graphs) if decoder is not None and decoder.use_graphs else []
        attention = decoder.decode_attention if decoder is not None else None
        return {"loop": self._last_loop, "cuda_graph_buckets": graphs, "decode_attention": attention}

    @property
    def model(self) -> torch.nn.Module:
        """The module `generate` runs: a plain causal LM, with a synced adapter merged in."""
        return self._model

    def _load_hf_dir(self, model_dir: str) -> torch.nn.Module:
        # imported here: the vLLM engine environment imports this module (find_adapter_dir) and
        # need not have transformers or peft of the trainer's versions
        from transformers import AutoModelForCausalLM

        LOG.info("loading HF weights from %s (dtype=%s, device=%s)", model_dir, self.dtype, self.device)
        self._decoder = None  # its graphs and buffers belong to the module being replaced
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=self.dtype,
                                                     use_safetensors=True)
        return model.to(self.device).eval()

    def _use_base(self) -> None:
        """Make the resident module the pristine base: reloaded after a checkpoint, restored in
        place from the exact copy after a merged adapter (no unmerge by subtraction)."""
        if self._resident != "base":
            self._model = None  # free the old weights before loading the base
            self._model = self._load_hf_dir(self.base_model_dir)
            self._resident, self._merged = "base", False
        elif self._merged:
            parameters = dict(self._model.named_parameters())
            with torch.no_grad():
                for name, value in self._base_copy.items():
                    parameters[name].copy_(value)
            self._merged = False

    def load_weights(self, spec: WeightsSpec) -> None:
        """Serve `spec`. On failure the previous weights may be half gone: nothing is served
        until a later `load_weights` succeeds (a "base" request always recovers)."""
        self._served = None
        try:
            if spec.kind == "base":
                self._use_base()
            elif spec.kind == "checkpoint":
                self._load_checkpoint(spec)
            elif spec.kind == "shared":
                self._load_shared(spec)
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
        if self._resident == "unknown" or not copy_checkpoint_in_place(self._model, spec.path):
            self._model = None  # free the old weights before loading the new ones
            self._model = self._load_hf_dir(spec.path)
        self._resident, self._merged = "checkpoint", False

    def _load_shared(self, spec: WeightsSpec) -> None:
        if self._resident == "unknown":  # a failed load may have left the module half written or replaced
            self._use_base()
        self._shared.copy_into(self._model, Path(spec.path), spec.version)
        self._resident, self._merged = "checkpoint", False

    def _load_adapter(self, spec: WeightsSpec) -> None:
        """Merge the adapter into the pristine base in place, so sampling runs no LoRA layers."""
        from peft import PeftModel  # here, not at the top: see _load_hf_dir

        adapter_dir = find_adapter_dir(spec.path)
        self._use_base()  # an adapter is trained against the base, not a checkpoint or another adapter
        originals = dict(self._model.named_parameters())
        names = {id(parameter): name for name, parameter in originals.items()}
        self._merged = True  # from here on the base may change; _use_base restores it
        # the factors in the served dtype, as the trainer's policy holds them (peft would upcast a bf16
        # model's to fp32), so the merged weights are the trainer's merged checkpoint's
        peft_model = PeftModel.from_pretrained(self._model, str(adapter_dir), adapter_name="sync",
                                               is_trainable=False, autocast_adapter_dtype=False)
        with torch.no_grad():
            for parameter in adapter_base_parameters(peft_model):
                name = names[id(parameter)]
                if name not in self._base_copy:  # still pristine: every earlier change was restored
                    self._base_copy[name] = parameter.detach().clone()
        self._model = peft_model.merge_and_unload().to(self.device).eval()
        keep_original_tensors(self._model, originals)

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
        rows = [prompt for prompt in prompt_token_ids for _ in range(n_samples_per_prompt)]
        decoder = self._static_decoder(len(rows), max(map(len, rows)) + max_new_tokens)
        self._last_loop = "dynamic" if decoder is None else "static"
        if decoder is None:
            tokens, logprobs, done = _sample_loop(self._model, rows, max_new_tokens, temperature, top_p, generator,
                                                  eos_token_id, pad_token_id, self.device)
        else:
            tokens, logprobs, done = sample_static(decoder, rows, max_new_tokens, temperature, top_p, generator,
                                                   eos_token_id, pad_token_id, self.done_check_every)
        return _trim_rows(tokens, logprobs, done, eos_token_id)

    def _static_decoder(self, rows: int, slots_needed: int) -> StaticDecoder | None:
        """The static decoder for this request (kept while it fits), or None for the dynamic loop."""
        if self.decode == "dynamic":
            return None
        if self._decoder is not None and self._decoder.fits(self._model, rows, slots_needed):
            return self._decoder
        self._decoder = None  # free its buffers before allocating new ones
        slots = -(-slots_needed // SLOT_ROUNDING) * SLOT_ROUNDING
        reason = unsupported_reason(self._model, slots)
        if reason is not None:
            LOG.warning("decode=%s cannot run this model (%s); sampling with the dynamic cache", self.decode, reason)
            return None
        use_graphs = self.decode == "static" and torch.device(self.device).type == "cuda"
        self._decoder = StaticDecoder(self._model, rows, slots, use_graphs, self.prefill_tokens)
        return self._decoder


def copy_checkpoint_in_place(model: torch.nn.Module, checkpoint_dir: str) -> bool:
    """Copy the safetensors weights of `checkpoint_dir` into `model`'s tensors; False (nothing
    copied) unless every file tensor names a tensor of the model with the same shape and every
    parameter gets a value. Keeping the tensors keeps the static decoder's buffers and CUDA graphs."""
    from safetensors import safe_open

    targets = model.state_dict(keep_vars=True)  # tied weights appear under each of their names
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    covered = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name not in targets or tuple(handle.get_slice(name).get_shape()) != tuple(targets[name].shape):
                    return False
                covered.add(id(targets[name]))
    if not files or any(id(parameter) not in covered for parameter in model.parameters()):
        return False
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    targets[name].copy_(handle.get_tensor(name))
    LOG.info("copied %s into the resident weights in place", checkpoint_dir)
    return True


def keep_original_tensors(model: torch.nn.Module, originals: dict[str, torch.nn.Parameter]) -> None:
    """Where merging replaced a parameter (a module the adapter saves whole), copy the new values into
    the tensor it replaced and put that tensor back: every parameter keeps its storage, which the
    static decoder's CUDA graphs read."""
    with torch.no_grad():
        for name, parameter in list(model.named_parameters()):
            original = originals.get(name)
            if original is not None and parameter is not original:
                original.copy_(parameter)
                owner, _, attribute = name.rpartition(".")
                model.get_submodule(owner)._parameters[attribute] = original


def adapter_base_parameters(peft_model) -> list[torch.nn.Parameter]:
    """The base model's parameters that merging `peft_model`'s adapter changes or replaces: those
    of every LoRA-wrapped layer and of every module the adapter saves whole (modules_to_save)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    touched = []
    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            touched += module.get_base_layer().parameters()
        elif hasattr(module, "original_module"):
            touched += module.original_module.parameters()
    return touched


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
