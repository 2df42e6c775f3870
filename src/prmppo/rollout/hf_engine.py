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

Sampling (`generate`): `decoding.py` (`Decoding`), the loop the in-process engine runs on the
trainer's own model too: a static KV cache with CUDA graphs by default, the model's own growing
cache as the fallback; the logprob contract is stated there.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_hf_engine.py -q`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from prmppo.rollout.decoding import Decoding
from prmppo.rollout.protocol import WeightsSpec
from prmppo.rollout.sampling import left_pad  # noqa: F401 (guards/gates.py)
from prmppo.rollout.shared_weights import SharedWeightsReader

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


class HFEngine:
    """A Hugging Face causal LM that serves base / checkpoint / adapter weights and samples.

    `decode`, `done_check_every`, `prefill_tokens` and `compile_decode` are the sampling loop's
    (`decoding.Decoding`).
    """

    def __init__(self, base_model_dir: str, device: str = "cpu", dtype: str = "float32", decode: str = "static",
                 done_check_every: int = 8, prefill_tokens: int = 16384, compile_decode: bool = False) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid; valid: {sorted(DTYPES)}")
        self._sampler = Decoding(decode, done_check_every, prefill_tokens, compile_decode)  # checks its arguments
        if not (Path(base_model_dir) / "config.json").is_file():
            raise FileNotFoundError(
                f"base_model_dir={base_model_dir!r} has no config.json (need an HF-layout dir)"
            )
        self.base_model_dir = str(base_model_dir)
        self.device = device
        self.dtype = DTYPES[dtype]
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
        """What the last `generate` ran (`Decoding.info`): its loop, the CUDA-graph buckets, the decode attention."""
        return self._sampler.info

    @property
    def model(self) -> torch.nn.Module:
        """The module `generate` runs: a plain causal LM, with a synced adapter merged in."""
        return self._model

    def _load_hf_dir(self, model_dir: str) -> torch.nn.Module:
        # imported here: the vLLM engine environment imports this module (find_adapter_dir) and
        # need not have transformers or peft of the trainer's versions
        from transformers import AutoModelForCausalLM

        LOG.info("loading HF weights from %s (dtype=%s, device=%s)", model_dir, self.dtype, self.device)
        self._sampler.release()  # its graphs and buffers belong to the module being replaced
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
            elif spec.kind == "adapter":
                self._load_adapter(spec)
            else:
                raise ValueError(f"weights {spec} are the trainer's own: only rollout=inprocess serves them")
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
        return self._sampler.generate(self._model, self.device, prompt_token_ids, n_samples_per_prompt,
                                      max_new_tokens, temperature, top_p, seed, eos_token_id, pad_token_id)


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
