"""Load any local Hugging Face-layout model directory, after checking it is whole and consistent.

One path for every model: `AutoModelForCausalLM` / `AutoTokenizer` with `local_files_only=True`,
so nothing ever reaches a model hub. `check_model_dir` runs first and is cheap (it reads only
JSON files): a missing directory, a missing or broken `config.json`, no weights, no tokenizer,
or a tokenizer whose vocabulary does not fit the model's embedding all fail with a message that
names the file, before any weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prmppo.config.schema import HFModelConfig
from prmppo.errors import PrmppoError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelDirError(PrmppoError):
    """A model directory that cannot be loaded; the message names the directory or file."""


@dataclass(frozen=True)
class ModelDirInfo:
    """What `check_model_dir` read: enough to plan a run without loading weights."""

    path: Path
    model_type: str
    vocab_size: int
    eos_token_id: int | None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelDirError(f"{path} is missing: a Hugging Face-layout model directory needs it") from None
    except json.JSONDecodeError as err:
        raise ModelDirError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None


def _single_eos(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def check_model_dir(path: str | Path) -> ModelDirInfo:
    """Refuse a directory that is missing, incomplete or inconsistent; return what it holds."""
    root = Path(path)
    if not root.is_dir():
        raise ModelDirError(f"model directory {root} does not exist (model.path or a stage artifact)")
    config = _read_json(root / "config.json")
    for key in ("model_type", "vocab_size"):
        if key not in config:
            raise ModelDirError(f"{root / 'config.json'} has no '{key}' field")
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        legacy = sorted(root.glob("*.bin"))
        hint = f" (found {legacy[0].name}: convert it to safetensors)" if legacy else ""
        raise ModelDirError(f"{root} holds no *.safetensors weights{hint}")
    tokenizer_files = [root / name for name in TOKENIZER_FILES if (root / name).exists()]
    if not tokenizer_files:
        raise ModelDirError(f"{root} holds no tokenizer file (one of {', '.join(TOKENIZER_FILES)})")
    if (root / "tokenizer.json").exists():
        vocab = _tokenizer_json_vocab_size(root / "tokenizer.json")
        if vocab > config["vocab_size"]:
            raise ModelDirError(
                f"{root / 'tokenizer.json'} has {vocab} tokens but {root / 'config.json'} says "
                f"vocab_size={config['vocab_size']}: token ids past the embedding would crash the model")
    return ModelDirInfo(root, config["model_type"], int(config["vocab_size"]), _single_eos(config.get("eos_token_id")))


def _tokenizer_json_vocab_size(path: Path) -> int:
    spec = _read_json(path)
    try:
        ids = list(spec["model"]["vocab"].values()) if isinstance(spec["model"]["vocab"], dict) else []
    except (KeyError, TypeError):
        raise ModelDirError(f"{path} has no model.vocab table") from None
    ids += [tok["id"] for tok in spec.get("added_tokens", [])]
    return max(ids) + 1 if ids else 0


def load_tokenizer(path: str | Path):
    """The directory's tokenizer, with a pad token (EOS doubles as pad when none is defined)."""
    check_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ModelDirError(f"tokenizer in {path} defines no EOS token: responses could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"):
    """The directory's causal LM on `device` in `dtype`, in eval mode."""
    check_model_dir(path)
    if dtype not in DTYPES:
        raise ModelDirError(f"model.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=DTYPES[dtype],
                                                 use_safetensors=True)
    return model.to(device).eval()


class HFDirSource:
    """`model=hf`: an existing local HF-layout directory, used as it is."""

    def __init__(self, path: str, dtype: str = HFModelConfig.dtype, chat_template: str = HFModelConfig.chat_template,
                 system_prompt: str | None = HFModelConfig.system_prompt):
        self.path = path
        self.dtype = dtype
        # how task=jsonl renders prompts with this model's tokenizer (tasks/chat.py), kept for the record
        self.chat_template, self.system_prompt = chat_template, system_prompt

    def architecture(self) -> tuple[dict | None, str]:
        """The directory's config.json dict and its path; (None, "") when it is missing or not a
        transformers config (loading the model refuses that by name)."""
        config = Path(self.path) / "config.json"
        try:
            found = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError):
            return None, ""
        return (found, str(config)) if isinstance(found, dict) and "model_type" in found else (None, "")

    def materialize(self, task, out_dir: Path) -> Path:  # noqa: ARG002 - same signature as TinyModelSource
        check_model_dir(self.path)
        return Path(self.path)
