"""Load any local Hugging Face-layout model directory, after checking it is whole and consistent.

One path for every model: `AutoModelForCausalLM` / `AutoTokenizer` with `local_files_only=True`,
so nothing ever reaches a model hub. `check_model_dir` runs first and is cheap (it reads only
JSON files): a missing directory, a missing or broken `config.json`, no weights, no tokenizer,
or a tokenizer whose vocabulary does not fit the model's embedding all fail with a message that
names the file, before any weights are read.

A directory may stand for a model directory elsewhere (`MODEL_REFERENCE`): the SFT artifact of
`sft.steps=0` on `model=hf` keeps no copy of the weights it accepts as they are, only the source's
path and the size and modification time of each of its files. `resolve_model_dir` follows it, after
checking that the source is still the directory it was (else a `ModelDirError` naming what changed:
what was built on the old weights, such as a PRM, would no longer match them). Every loader here
resolves first, so a reference loads wherever a model directory does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prmppo.config.schema import HFModelConfig
from prmppo.errors import PrmppoError
from prmppo.logger import write_json_atomic

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
MODEL_REFERENCE = "model_reference.json"  # {"path": the model directory, "files": {name: [bytes, mtime ns]}}
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


def source_fingerprint(root: Path) -> dict[str, list[int]]:
    """Size in bytes and modification time in ns of every file directly inside `root`, by name: what a
    reference records and checks (an overwritten or re-saved file changes its mtime)."""
    return {path.name: [stat.st_size, stat.st_mtime_ns]
            for path in sorted(root.iterdir()) if path.is_file() for stat in [path.stat()]}


def write_model_reference(source: str | Path, out_dir: Path) -> Path:
    """Make `out_dir` stand for the model directory `source` (followed through any reference it is itself)
    without copying its files: `MODEL_REFERENCE` with its absolute path and fingerprint."""
    root = check_model_dir(source).path.resolve()
    write_json_atomic(Path(out_dir) / MODEL_REFERENCE, {"path": str(root), "files": source_fingerprint(root)})
    return root


def _fingerprint_changes(recorded: dict, found: dict) -> list[str]:
    changes = [f"{name} is gone" for name in recorded if name not in found]
    changes += [f"{name} is new" for name in found if name not in recorded]
    changes += [f"{name} was {recorded[name][0]} bytes, now {found[name][0]}" if recorded[name][0] != found[name][0]
                else f"{name} was rewritten (modification time changed)"
                for name in recorded if name in found and list(recorded[name]) != found[name]]
    return changes


def resolve_model_dir(path: str | Path) -> Path:
    """The model directory `path` stands for: `path` itself, or the source its `MODEL_REFERENCE` names once
    that source is checked to be unchanged since the reference was written."""
    root = Path(path)
    reference_file = root / MODEL_REFERENCE
    if not reference_file.is_file():
        return root
    reference = _read_json(reference_file)
    source = Path(reference["path"])
    redo = ("restore it, or run `stage=sft` again to accept it as it is now (and delete the prm-/band- "
            "artifacts made from the old weights: they are keyed by config and would be reused)")
    if not source.is_dir():
        raise ModelDirError(f"{root} keeps no copy of the model weights (sft.steps=0) and refers to {source}, "
                            f"which no longer exists: {redo}")
    changes = _fingerprint_changes(reference["files"], source_fingerprint(source))
    if changes:
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        raise ModelDirError(f"{root} keeps no copy of the model weights (sft.steps=0) and refers to {source}, "
                            f"which changed after {root} was made ({shown}): {redo}")
    return source


def check_model_dir(path: str | Path) -> ModelDirInfo:
    """Refuse a directory that is missing, incomplete or inconsistent; return what it holds (`path`: the
    directory the weights are in, followed through a `MODEL_REFERENCE`)."""
    root = Path(path)
    if not root.is_dir():
        raise ModelDirError(f"model directory {root} does not exist (model.path or a stage artifact)")
    root = resolve_model_dir(root)
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
    path = check_model_dir(path).path
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ModelDirError(f"tokenizer in {path} defines no EOS token: responses could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"):
    """The directory's causal LM on `device` in `dtype`, in eval mode."""
    path = check_model_dir(path).path
    if dtype not in DTYPES:
        raise ModelDirError(f"model.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=DTYPES[dtype],
                                                 use_safetensors=True)
    return model.to(device).eval()


class HFDirSource:
    """`model=hf`: an existing local HF-layout directory, used as it is."""

    # the weights live in the user's directory, which outlives the run: an SFT artifact that accepts them as
    # they are (`sft.steps=0`) refers to that directory instead of copying it (`write_model_reference`)
    lasting_weights = True

    def __init__(self, path: str, dtype: str = HFModelConfig.dtype, chat_template: str = HFModelConfig.chat_template,
                 system_prompt: str | None = HFModelConfig.system_prompt):
        self.path = path
        self.dtype = dtype
        # how task=jsonl renders prompts with this model's tokenizer (tasks/chat.py), kept for the record
        self.chat_template, self.system_prompt = chat_template, system_prompt

    def architecture(self) -> tuple[dict | None, str]:
        """The directory's config.json dict and its path; (None, "") when it is missing or not a
        transformers config (loading the model refuses that by name)."""
        try:
            config = resolve_model_dir(self.path) / "config.json"
            found = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError, ModelDirError):
            return None, ""
        return (found, str(config)) if isinstance(found, dict) and "model_type" in found else (None, "")

    def materialize(self, task, out_dir: Path) -> Path:  # noqa: ARG002 - same signature as TinyModelSource
        """The directory the weights are in (`model.path`, or the source a reference there stands for)."""
        return check_model_dir(self.path).path
