"""Launch gates: cheap checks that refuse a broken setup before any model weights are loaded.

Run in cost order after config validation (`validate.py`): 1-3 by `stages/inputs.py::early_gates`, 4 and
the reference check by `stages/ppo_training.py::train_ppo`:
  1. `verifier_receipt`  gold solutions must verify (~100%), corrupted ones must not (~0%): a
                         verifier that passes everything or nothing would make every reward noise;
  2. `check_topology`    devices exist, world size >= 1, roles on distinct GPUs unless colocated;
  3. `check_rollout_engine`  the interpreter of `rollout.python` can run the engine (for vLLM: it
                         imports vllm and serves the model's attention head size);
  4. `derive_eos`        config.json, generation_config.json and the tokenizer agree on EOS.
Once the policy is built (and its PRM loaded), `check_reference` compares the logprobs the KL reads
(`policy.reference_score`) with the base model's on a probe batch (`reference_probe`, taken before the
policy wraps the model).
(Horizon consistency, the last gate, is `ppo.loop.check_horizon`, run when the trainer is built.)
Each gate returns what it derived, recorded under `"gates"` in `banner.json`, or raises
`GateError` with a sentence that names the values and what would be valid.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoConfig, AutoModelForCausalLM

from prmppo.errors import PrmppoError
from prmppo.models.external_prm import check_external_reward
from prmppo.rollout.client import probe_engine_python, resolve_python
from prmppo.rollout.hf_engine import left_pad
from prmppo.rollout.inprocess import ENGINE as IN_PROCESS_ENGINE
from prmppo.rollout.worker import ENGINE_PACKAGES


class GateError(PrmppoError):
    """A launch gate refused the setup; the message says which gate, what it saw and why it matters."""


def _examples(rows: list[tuple[str, str]], limit: int = 3) -> str:
    return " | ".join(f"problem {q!r} -> response {r!r}" for q, r in rows[:limit])


def verifier_receipt(task, n: int = 200, seed: int = 0, min_gold: float = 0.99, max_corrupt: float = 0.01) -> dict:
    """Verify `n` gold and `n` corrupted `test` solutions; refuse a verifier that cannot tell them apart.

    A corrupted solution has one reasoning step made wrong (`task.corrupt` at a random step),
    which also makes its final answer wrong, so a working verifier rejects it.
    """
    problems = task.problems("test")[:n]
    if not problems:
        raise GateError(f"verifier receipt: task {task.name!r} has no `test` problems to check its verifier on")
    rng = random.Random(seed)
    gold_failed, corrupt_passed = [], []
    for problem in problems:
        if not task.verify(problem, problem.solution):
            gold_failed.append((problem.question, problem.solution))
        positions = len(task.split_steps(problem.solution)) - 1  # the last step is the answer line
        corrupted = task.corrupt(problem, rng.randrange(max(positions, 1)), rng)
        if task.verify(problem, corrupted):
            corrupt_passed.append((problem.question, corrupted))
    gold_rate = 1 - len(gold_failed) / len(problems)
    corrupt_rate = len(corrupt_passed) / len(problems)
    receipt = {"n_problems": len(problems), "gold_pass_rate": gold_rate, "corrupted_pass_rate": corrupt_rate,
               "min_gold": min_gold, "max_corrupt": max_corrupt}
    problems_found = []
    if gold_rate < min_gold:
        problems_found.append(f"gold solutions verify at {gold_rate:.3f} < {min_gold} (the verifier rejects right "
                              f"answers), e.g. {_examples(gold_failed)}")
    if corrupt_rate > max_corrupt:
        problems_found.append(f"corrupted solutions verify at {corrupt_rate:.3f} > {max_corrupt} (the verifier "
                              f"accepts wrong answers), e.g. {_examples(corrupt_passed)}")
    if problems_found:
        raise GateError(f"verifier receipt of task {task.name!r} on {len(problems)} test problems failed: "
                        + "; ".join(problems_found) + ". Rewards from this verifier would be noise; fix the "
                        "task's verify/extract_answer before training")
    return receipt


def _cuda_index(device: str, default: int) -> int | None:
    """GPU index of a device string (`cuda` -> `default`), or None for a non-CUDA device."""
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return None
    return default if parsed.index is None else parsed.index


def check_topology(train_device: str, engine_device: str, world_size: int, colocated: bool,
                   visible_gpus: int | None = None) -> dict:
    """Refuse devices that do not exist and roles that share a GPU without `colocated`; return the layout.

    `visible_gpus` defaults to `torch.cuda.device_count()`; training ranks use GPUs
    0..world_size-1 when `train_device` is plain `cuda`.
    """
    visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    if world_size < 1:
        raise GateError(f"topology.train_world_size={world_size} must be >= 1")
    train_base = _cuda_index(train_device, 0)
    engine_gpu = _cuda_index(engine_device, 0)
    for key, value, index in (("train_device", train_device, train_base), ("engine_device", engine_device, engine_gpu)):
        if index is not None and visible == 0:
            raise GateError(f"topology.{key}={value!r} but no CUDA device is visible; use topology=cpu")
    train_gpus = [] if train_base is None else list(range(train_base, train_base + world_size))  # CPU ranks: gloo
    used = train_gpus + ([engine_gpu] if engine_gpu is not None else [])
    if used and max(used) >= visible:
        raise GateError(f"topology needs GPU index {max(used)} (train ranks on {train_gpus}, engine on "
                        f"{engine_device!r}) but only {visible} GPU(s) are visible (indices 0..{visible - 1})")
    if engine_gpu is not None and engine_gpu in train_gpus and not colocated:
        raise GateError(f"topology.engine_device={engine_device!r} is also training GPU {engine_gpu} (train ranks on "
                        f"{train_gpus}) and topology.colocated=false: the two roles would contend for one GPU's "
                        "memory; choose a distinct engine_device or set topology.colocated=true")
    return {"train_device": train_device, "train_gpus": train_gpus, "engine_device": engine_device,
            "engine_gpu": engine_gpu, "world_size": world_size, "colocated": colocated, "visible_gpus": visible}


VLLM_SETUP = ("create it with `bash scripts/setup_vllm_env.sh` (it prints the interpreter path) and set "
              "rollout.python to that path")


def check_rollout_engine(engine: str, python: str, head_dim: int | None, head_dim_source: str = "") -> dict:
    """The interpreter named by `rollout.python` can run the rollout worker's engine; returns what it found.

    The trainer's own interpreter runs `hf` (and `inprocess`, which has no worker) without a check.
    Any other interpreter is run once (a few seconds: it imports the engine's packages and the worker
    as the worker would), so a missing or broken engine environment is refused before SFT or any
    weights. For vLLM on CPU, the model's
    attention head size (`head_dim`, when known; `head_dim_source` says where it came from) must be
    one its CPU attention kernels support.
    """
    if engine == IN_PROCESS_ENGINE or (engine == "hf" and not python):  # the in-process engine: this interpreter
        return {"engine": engine, "python": sys.executable}
    interpreter = resolve_python(python)
    try:
        found = probe_engine_python(interpreter, ENGINE_PACKAGES[engine])
    except ValueError as err:
        setup = VLLM_SETUP if engine == "vllm" else "point rollout.python at an interpreter that has them"
        raise GateError(f"rollout.engine={engine!r} runs in rollout.python={python!r}, but {err}; {setup}") from None
    sizes = found["attention_head_sizes"]
    if sizes is not None and head_dim is not None and head_dim not in sizes:
        raise GateError(
            f"rollout.engine={engine!r} on {found['platform']}: the model's attention head size {head_dim} "
            f"({head_dim_source}) is not one vLLM's CPU attention supports {sizes}; choose a hidden size and head "
            "count that give one (model=tiny: e.g. model.num_attention_heads=3 model.num_key_value_heads=1 with "
            "model.hidden_size=96), or use rollout=hf")
    return {"engine": engine, **found, "head_dim": head_dim}


def _eos_ids(value) -> list[int] | None:
    if value is None:
        return None
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def derive_eos(model_dir: str | Path, tokenizer) -> dict:
    """The EOS id the run uses: the tokenizer's, which config.json and generation_config.json must contain.

    Files that do not state an EOS are not consulted; every file that does must agree.
    """
    root = Path(model_dir)
    token_id = tokenizer.eos_token_id
    derived: dict = {"eos_token_id": token_id, "eos_token": tokenizer.eos_token}
    for name in ("config.json", "generation_config.json"):
        path = root / name
        if not path.exists():
            derived[name] = None
            continue
        try:
            stated = _eos_ids(json.loads(path.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError) as err:
            raise GateError(f"{path}: cannot read its eos_token_id ({err})") from None
        derived[name] = stated
        if stated is not None and token_id not in stated:
            raise GateError(
                f"EOS disagrees: {path} says eos_token_id={stated} but the tokenizer in {root} says "
                f"{token_id} ({tokenizer.eos_token!r}). The engine stops sampling on one id and the reward lands "
                "on the last token by the other, so responses would never stop or rewards would land on the "
                f"wrong token; make {name} and the tokenizer name the same EOS")
    return derived


def check_step_scorer(task, reward) -> dict:
    """A step-level reward needs a source of step scores: the exact checker (`reward.scorer=oracle`)
    must exist for this task; a learned PRM is trained or reused by the runner. Refused before any
    model loads, so `reward=prm_oracle` on a task without a checker fails in seconds."""
    if not reward.needs_step_scorer:
        return {"step_scores": "none (outcome reward only)"}
    if reward.needs_learned_prm:
        return {"step_scores": "learned PRM"}
    if reward.scorer == "external":  # reward=prm_external: the checkpoint's files and format markers
        return {"step_scores": "external PRM", **check_external_reward(reward)}
    if not reward.needs_step_checker:  # reward=prm_likelihood_control
        return {"step_scores": "the SFT model's likelihood (untrained step_logprobs rule, no PRM)"}
    probe = task.problems("test")[0]
    if task.check_steps(probe, probe.solution) is None:
        raise GateError(f"reward.scorer=oracle (reward=prm_oracle) needs an exact step checker, but task "
                        f"{task.name!r} has none; use reward=prm (a learned PRM) or a task with a checker")
    return {"step_scores": "exact step checker"}


def check_label_source(task, label_source: str, needed: bool = True) -> dict:
    """PRM training labels need a source: `prm_train.label_source=checker` labels steps with the task's
    exact step checker, so a task without one (GSM8K) is refused here, before SFT or any weights,
    instead of after SFT when the labels are made. `monte_carlo` labels come from policy completions
    and need only the outcome verifier. `needed=False` (no learned PRM in this run) checks nothing."""
    if not needed:
        return {"prm_labels": "none (no learned PRM)"}
    if label_source != "checker":
        return {"prm_labels": label_source}
    probe = task.problems("test")[0]
    if task.check_steps(probe, probe.solution) is None:
        raise GateError(f"prm_train.label_source=checker needs an exact step checker, but task {task.name!r} has "
                        f"none; use prm_train.label_source=monte_carlo (labels from policy completions) or arm=orm "
                        f"(no PRM)")
    return {"prm_labels": "checker (exact step checker)"}


def check_trainable_modules(modules_to_save: list[str], architecture: dict | None, source: str = "") -> dict:
    """Every `lora.modules_to_save` name must be a module of the model: checked on a skeleton built
    on the meta device from the model's config (`architecture`, a transformers config dict), so
    no weights load and a typo fails before SFT. None: the config is not readable yet (model=hf
    with a missing dir), and the model loader refuses that by name."""
    if not modules_to_save:
        return {"modules_to_save": []}
    if architecture is None:
        return {"modules_to_save": list(modules_to_save), "checked": False}
    config_dict = dict(architecture)
    model_type = config_dict.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **config_dict)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # an architecture this transformers cannot build: the loader will say so
        return {"modules_to_save": list(modules_to_save), "checked": False, "why": f"{type(exc).__name__}: {exc}"}
    names = [name for name, _ in skeleton.named_modules()]
    tied = [m for m in modules_to_save
            if getattr(config, "tie_word_embeddings", False) and m.split(".")[-1] in ("lm_head", "embed_tokens")]
    if tied:
        raise GateError(f"lora.modules_to_save names {tied}, which shares its weight with the tied input/output "
                        f"embedding of the model ({source}); training one copy would break the tie in the synced "
                        f"weights")
    missing = [m for m in modules_to_save if not any(n == m or n.endswith(f".{m}") for n in names)]
    if missing:
        norms = [n for n in names if n.endswith("norm") and "layers." not in n and ".h." not in n]
        raise GateError(f"lora.modules_to_save names {missing}, which no module of the model ({source}) is "
                        f"called; its top-level norms: {norms or 'none'}; use lora.modules_to_save=[] to train "
                        f"the LoRA factors only")
    return {"modules_to_save": list(modules_to_save), "checked": True}


# Largest |reference - base| logit difference accepted, relative to the largest |base logit| (at
# least 1). The same weights through the same kernels agree to rounding, usually exactly; the room
# is for kernel nondeterminism: float32 1e-5 (~100 units in the last place), 16-bit 2 units in the
# last place (2**-7 bfloat16, 2**-10 float16). A PRM adapter left on in the reference shifts logits
# by ~0.1-1 (0.73 on the test's tiny model), far above all three. `check_reference` compares logprobs
# at a temperature T, which a logit difference e moves by at most 2 e / T: its tolerance is that.
REFERENCE_REL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def reference_probe(model, tokenizer, prompts: list[str]) -> dict:
    """The probe batch for `check_reference` and the base model's logits on it: call with the freshly
    loaded model, before the policy wraps it. Returns `check_reference`'s keyword arguments, all but
    the run's `temperature` and `chunk_tokens`."""
    if not prompts:
        raise GateError("reference check: no probe prompts; pass one or more formatted task prompts")
    parameter = next(model.parameters())
    rows = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    input_ids, attention_mask, position_ids = left_pad(rows, tokenizer.pad_token_id, parameter.device)  # [R, L]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits  # [R, L, V]
    return {"probe_input_ids": input_ids, "probe_attention_mask": attention_mask, "probe_position_ids": position_ids,
            "base_logits": logits.float().cpu(), "dtype": parameter.dtype}


def _adapter_names(model) -> list[str]:
    """Names of the peft adapters injected into `model`'s layers (on or off)."""
    return sorted({name for module in model.modules() if isinstance(module, BaseTunerLayer)
                   for attribute in module.adapter_layer_names for name in getattr(module, attribute).keys()})


def check_reference(policy, probe_input_ids, probe_attention_mask, probe_position_ids, base_logits,
                    dtype: torch.dtype, temperature: float, chunk_tokens: int) -> dict:
    """The policy's KL reference must be the base model it was built on. Checked on the path the KL
    reads: `policy.reference_score` (as the PPO loop calls it, at the run's `temperature` and
    `chunk_tokens`) scores every probe token after the first as a response to the tokens before it,
    and those logprobs must equal the base's (`base_logits` from `reference_probe`, tempered and
    log-softmaxed) wherever the token and the one before it are real, within
    2 * `REFERENCE_REL_TOLERANCE[dtype]` * max(1, largest |base logit| there) / `temperature`. Run after
    the step scorer is built, so a PRM adapter loaded onto the reference's weights is covered.
    Returns the largest difference, the tolerance and the probe's shape, for `banner.json`."""
    if dtype not in REFERENCE_REL_TOLERANCE:
        raise GateError(f"reference check: model dtype {dtype} has no tolerance; valid: "
                        f"{', '.join(str(d) for d in REFERENCE_REL_TOLERANCE)}")
    ids, attention = probe_input_ids, probe_attention_mask
    tokens = ids[:, 1:]  # [R, L - 1] each token after the first, a response to the prefix before it
    scored = attention[:, :-1].bool() & attention[:, 1:].bool()  # [R, L - 1] the token and its prefix's end are real
    if not scored.any():
        raise GateError("reference check: no probe prompt has two tokens to score; pass longer prompts")
    reference = policy.reference_score(ids, attention, probe_position_ids, tokens, scored.to(base_logits.dtype),
                                       1, temperature, chunk_tokens)  # [R, L - 1]
    predicting = base_logits.float().cpu()[:, :-1]  # [R, L - 1, V] the logits that predict each token
    base = torch.log_softmax(predicting / temperature, -1).gather(-1, tokens.cpu()[..., None]).squeeze(-1)
    real = scored.cpu()
    diff = (reference.float().cpu()[real] - base[real]).abs().max().item()
    tolerance = 2 * REFERENCE_REL_TOLERANCE[dtype] * max(1.0, predicting[real].abs().max().item()) / temperature
    found = {"max_abs_logprob_diff": diff, "tolerance": tolerance, "dtype": str(dtype).removeprefix("torch."),
             "temperature": temperature, "probe_rows": int(real.shape[0]), "probe_tokens": int(real.sum())}
    if not diff <= tolerance:  # NaN fails too
        adapters = _adapter_names(policy.prm_host)
        raise GateError(
            f"reference check: the KL reference's logprobs differ from the base model's by up to {diff:.4g} "
            f"(tolerance {tolerance:.3g} for {found['dtype']} at temperature {temperature}) on "
            f"{found['probe_rows']} probe prompts, so the KL penalty would pull the policy toward another model "
            f"than the SFT checkpoint. Likely cause: a peft adapter left on in the reference (adapters on the "
            f"reference's weights: {adapters or 'none'}; a PRM adapter must be switched off by "
            f"{type(policy).__name__}.reference_score), or a reference weight changed in place since the base was "
            f"loaded (a peft merge, or an optimizer that holds the reference's parameters)")
    return found
