"""The config checks that need only the config: value ranges and arithmetic between keys.

Types and unknown keys are caught by the schemas when Hydra composes; the checks here catch what
a schema cannot: ranges, divisibility, keys that contradict each other, keys left `???`. Each
appends one sentence per problem to a list, naming the keys, the values, and what would be valid.
`prmppo.validate.validate_config` runs them, with the checks that ask the code (the choices each
component implements, what the configured classes can do), and raises one `ConfigError` listing
every problem, before any model, tokenizer or dataset is built.

Also here, because a run asks them of its config later: `inert_keys` (the keys this run never
reads) and `wandb_key_configured`. This package imports nothing from the rest of prmppo but its
error family: the components import their defaults from `config/schema.py`, never the reverse.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from prmppo.config.build import build_quietly
from prmppo.config.schema import HFModelConfig, InProcessRolloutConfig, JsonlTaskConfig
from prmppo.errors import ConfigError


def _positive(problems: list[str], cfg: DictConfig, section: str, *keys: str) -> None:
    for key in keys:
        value = getattr(cfg, key)
        if value <= 0:
            problems.append(f"{section}.{key}={value} must be > 0")


def _check_ppo_batch(problems: list[str], ppo: DictConfig) -> None:
    """The rollout shape and the update's batches: positive, and each dividing the one above it."""
    _positive(problems, ppo, "ppo", "iterations", "prompts_per_iteration", "n_samples_per_prompt",
              "minibatch_rows", "micro_batch_rows", "ppo_epochs", "max_new_tokens", "temperature",
              "lr", "grad_clip", "logit_chunk_tokens")
    if ppo.micro_batch_tokens is not None and ppo.micro_batch_tokens <= 0:
        problems.append(f"ppo.micro_batch_tokens={ppo.micro_batch_tokens} must be > 0 (or null: micro-batches "
                        f"of ppo.micro_batch_rows rows)")
    rows = ppo.prompts_per_iteration * ppo.n_samples_per_prompt
    if ppo.minibatch_rows > 0 and rows % ppo.minibatch_rows:
        problems.append(
            f"ppo.minibatch_rows={ppo.minibatch_rows} must divide the responses per iteration, "
            f"ppo.prompts_per_iteration * ppo.n_samples_per_prompt = {ppo.prompts_per_iteration} * "
            f"{ppo.n_samples_per_prompt} = {rows} ({rows} % {ppo.minibatch_rows} = {rows % ppo.minibatch_rows})")
    if ppo.micro_batch_rows > 0 and ppo.minibatch_rows % ppo.micro_batch_rows:
        problems.append(
            f"ppo.micro_batch_rows={ppo.micro_batch_rows} must divide ppo.minibatch_rows={ppo.minibatch_rows} "
            f"({ppo.minibatch_rows} % {ppo.micro_batch_rows} = {ppo.minibatch_rows % ppo.micro_batch_rows})")


def _check_ppo_ranges(problems: list[str], ppo: DictConfig) -> None:
    """Sampling, discounting, clipping and the guards' limits, each in its range."""
    if not 0 < ppo.top_p <= 1:
        problems.append(f"ppo.top_p={ppo.top_p} must be in (0, 1]")
    for key in ("gamma", "lam_actor", "lam_critic", "min_lr_ratio"):
        if not 0 <= getattr(ppo, key) <= 1:
            problems.append(f"ppo.{key}={getattr(ppo, key)} must be in [0, 1]")
    for key in ("clip_low", "clip_high"):
        if not 0 < getattr(ppo, key) < 1:
            problems.append(f"ppo.{key}={getattr(ppo, key)} must be in (0, 1)")
    if ppo.clip_c is not None and ppo.clip_c <= 1:
        problems.append(f"ppo.clip_c={ppo.clip_c} must be > 1 (dual-clip bound) or null")
    if ppo.keep_checkpoints < 1:
        problems.append(f"ppo.keep_checkpoints={ppo.keep_checkpoints} must be >= 1")
    _positive(problems, ppo, "ppo", "max_first_ratio_dev", "max_engine_logprob_gap", "max_consecutive_skipped_steps")
    if not 0 <= ppo.max_skipped_fraction <= 1:
        problems.append(f"ppo.max_skipped_fraction={ppo.max_skipped_fraction} must be in [0, 1] (a fraction of the "
                        "run's planned optimizer steps)")


def _check_ppo_estimators(problems: list[str], ppo: DictConfig) -> None:
    """The KL terms and the advantage estimator against the keys they need."""
    if ppo.value_warmup_iterations >= ppo.iterations > 0:
        problems.append(f"ppo.value_warmup_iterations={ppo.value_warmup_iterations} leaves no policy iteration "
                        f"out of ppo.iterations={ppo.iterations}")
    if ppo.kl_coef < 0:
        problems.append(f"ppo.kl_coef={ppo.kl_coef} must be >= 0")
    if ppo.kl_loss_coef < 0:
        problems.append(f"ppo.kl_loss_coef={ppo.kl_loss_coef} must be >= 0")
    if ppo.kl_loss_coef > 0 and ppo.kl_loss_estimator == "k1":
        problems.append("ppo.kl_loss_estimator=k1 with ppo.kl_loss_coef > 0: the gradient of k1 = log(pi/pi_ref) "
                        "on samples from pi is zero in expectation, so the KL loss would do nothing; use k2 or k3 "
                        "(or ppo.kl_coef for a k1 KL in the reward)")
    if not ppo.group_same_tol >= 0:
        problems.append(f"ppo.group_same_tol={ppo.group_same_tol} must be >= 0 (reward units; 0 turns it off)")
    if not ppo.group_std_floor >= 0:
        problems.append(f"ppo.group_std_floor={ppo.group_std_floor} must be >= 0 (reward units; 0 turns it off)")
    if ppo.advantage_estimator != "gae" and ppo.n_samples_per_prompt < 2:
        problems.append(f"ppo.advantage_estimator={ppo.advantage_estimator} needs ppo.n_samples_per_prompt >= 2 "
                        f"(the baseline comes from the prompt's other samples), got {ppo.n_samples_per_prompt}")
    if ppo.advantage_estimator != "gae" and ppo.value_warmup_iterations > 0:
        problems.append(f"ppo.value_warmup_iterations={ppo.value_warmup_iterations} warms up a critic, but "
                        f"ppo.advantage_estimator={ppo.advantage_estimator} uses none; set it to 0 or use gae")


def _check_rollout(problems: list[str], cfg: DictConfig) -> None:
    """The rollout worker's timeouts and memory share, and the engine / sync / sampling combinations."""
    _positive(problems, cfg.rollout, "rollout", "sync_every_iterations", "startup_timeout_s",
              "request_timeout_s", "heartbeat_timeout_s")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        problems.append(f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} must be in (0, 1]")
    if cfg.rollout.engine == "vllm" and cfg.ppo.top_p < 1:
        problems.append(f"rollout=vllm with ppo.top_p={cfg.ppo.top_p}: vLLM's sampling logprobs are those of the "
                        "top-p truncated distribution, not the full tempered one the trainer scores, so the engine "
                        "and trainer logprobs would never match; use ppo.top_p=1.0 or rollout=hf")
    if cfg.rollout.engine == "vllm" and cfg.rollout.sync == "shared":
        problems.append("rollout=vllm with rollout.sync=shared: only the built-in engine (rollout=hf) maps the "
                        "trainer's shared weights; use rollout.sync=checkpoint or adapter")
    if cfg.rollout.compile_decode and cfg.rollout.decode == "dynamic" and cfg.rollout.engine != "vllm":
        problems.append("rollout.compile_decode=true with rollout.decode=dynamic: use static or static_eager")
    _check_in_process(problems, cfg)


def _check_in_process(problems: list[str], cfg: DictConfig) -> None:
    """rollout=inprocess samples with the trainer's own model on one process: no sync, no lag, no FSDP."""
    rollout = cfg.rollout
    in_process = issubclass(OmegaConf.get_type(rollout), InProcessRolloutConfig)
    if in_process and rollout.engine != "inprocess":
        problems.append(f"rollout=inprocess with rollout.engine={rollout.engine}: a worker engine is chosen with "
                        f"rollout={rollout.engine}, not by renaming the in-process one")
        return
    if not in_process and rollout.engine == "inprocess":
        problems.append("rollout.engine=inprocess under a worker's rollout config: choose the in-process engine "
                        "with rollout=inprocess")
        return
    if not in_process:
        if rollout.sync == "none":
            problems.append(f"rollout.sync=none with rollout={rollout.engine}: a worker engine holds its own copy of "
                            "the weights and must be sent them; use rollout.sync=checkpoint, adapter or shared, or "
                            "rollout=inprocess")
        return
    if rollout.sync != "none":
        problems.append(f"rollout=inprocess with rollout.sync={rollout.sync}: the engine samples with the trainer's "
                        "own weights, there is nothing to sync; use rollout.sync=none")
    if rollout.sync_every_iterations != 1:
        problems.append(f"rollout=inprocess with rollout.sync_every_iterations={rollout.sync_every_iterations}: the "
                        "engine always sees the latest weights, so it cannot sample with older ones; use 1, or "
                        "rollout=hf for a lagged engine")
    if cfg.topology.name == "fsdp":
        problems.append("rollout=inprocess with topology=fsdp: rank 0 alone samples, and a sharded model's forward "
                        "needs every rank; use rollout=hf (the engine on its own GPU) or one process (topology=gpu)")


def _check_sft_eval_canary(problems: list[str], cfg: DictConfig) -> None:
    """SFT's steps and warmup, the test evaluation's sizes, the canary's cadence and threshold."""
    sft = cfg.sft
    if sft.steps < 0:
        problems.append(f"sft.steps={sft.steps} must be >= 0")
    _positive(problems, sft, "sft", "batch_rows", "lr", "max_new_tokens")
    if sft.steps and sft.warmup_steps >= sft.steps:
        problems.append(f"sft.warmup_steps={sft.warmup_steps} must be < sft.steps={sft.steps}")
    _positive(problems, cfg.eval, "eval", "n_problems", "k", "temperature", "max_new_tokens", "batch_rows",
              "during_ppo_problems")
    if cfg.eval.every < 0 or cfg.eval.during_ppo_k < 0:
        problems.append(f"eval.every={cfg.eval.every} and eval.during_ppo_k={cfg.eval.during_ppo_k} must be >= 0 "
                        "(0 turns the test evaluation during PPO off / makes it greedy only)")
    if cfg.canary.every < 0:
        problems.append(f"canary.every={cfg.canary.every} must be >= 0 (0 turns the canary off)")
    _positive(problems, cfg.canary, "canary", "n_problems")
    if not 0 <= cfg.canary.max_drop <= 1:
        problems.append(f"canary.max_drop={cfg.canary.max_drop} must be in [0, 1] (a drop in accuracy)")


def _check_prm_train(problems: list[str], prm: DictConfig) -> None:
    _positive(problems, prm, "prm_train", "r", "alpha", "steps", "batch_rows", "lr", "train_problems",
              "mc_completions", "eval_problems", "chunk_rows", "max_new_tokens")
    if prm.samples_per_problem < (1 if prm.label_source == "monte_carlo" else 0):
        problems.append(f"prm_train.samples_per_problem={prm.samples_per_problem} must be >= 0, and >= 1 with "
                        "prm_train.label_source=monte_carlo (its labels come from policy samples)")
    if prm.negative_weight <= 0:
        problems.append(f"prm_train.negative_weight={prm.negative_weight} must be > 0")
    if prm.best_of_n < 0:
        problems.append(f"prm_train.best_of_n={prm.best_of_n} must be >= 0 (0 skips best-of-N reranking)")
    if not 0 <= prm.warmup_steps < max(prm.steps, 1):
        problems.append(f"prm_train.warmup_steps={prm.warmup_steps} must be >= 0 and < prm_train.steps={prm.steps}")
    if prm.head == "label_tokens" and prm.good_token == prm.bad_token:
        problems.append(f"prm_train.good_token={prm.good_token!r} and prm_train.bad_token={prm.bad_token!r} "
                        "must differ for head=label_tokens")
    if not prm.target_modules:
        problems.append("prm_train.target_modules is empty: the prm adapter needs at least one module name")


def _check_band(problems: list[str], cfg: DictConfig) -> None:
    band = cfg.band
    _positive(problems, band, "band", "k", "problems", "temperature", "max_new_tokens", "request_rows")
    if not 0 <= band.low <= band.high <= 1:
        problems.append(f"band.low={band.low} and band.high={band.high} must satisfy 0 <= low <= high <= 1 "
                        "(pass rates, e.g. 0.2 and 0.8)")
    if not 0 < band.top_p <= 1:
        problems.append(f"band.top_p={band.top_p} must be in (0, 1]")
    if band.file and band.enabled:
        problems.append(f"band.file={band.file!r} with band.enabled=true: PPO would have two bands; give the "
                        "file (band.enabled=false) or use this config's band artifact (band.file='')")
    if band.enabled and band.problems < cfg.ppo.prompts_per_iteration:
        problems.append(f"band.problems={band.problems} with band.enabled=true: the band could never hold "
                        f"ppo.prompts_per_iteration={cfg.ppo.prompts_per_iteration} prompts (one iteration's); "
                        "measure more prompts")
    if cfg.ppo.drop_uniform_groups and cfg.ppo.n_samples_per_prompt < 2:
        problems.append(f"ppo.drop_uniform_groups=true with ppo.n_samples_per_prompt={cfg.ppo.n_samples_per_prompt}: "
                        "a group of one sample is always uniform, so every group would be dropped; use >= 2")


# the stages that run on several ranks (`topology=fsdp`); sft and prm train data-parallel wherever they run
FSDP_STAGES = ("sft", "prm", "ppo", "pipeline")


def _check_split(problems: list[str], key: str, batch_rows: int, world: int) -> None:
    if world >= 1 and batch_rows % world:
        problems.append(f"{key}={batch_rows} does not split across topology.train_world_size={world} ranks: each rank "
                        f"trains on {key} / {world} rows of every step and {batch_rows} % {world} = "
                        f"{batch_rows % world}; use a multiple of {world} "
                        f"(e.g. {key}={-(-batch_rows // world) * world})")


def _check_stage_splits(problems: list[str], cfg: DictConfig, world: int) -> None:
    """The SFT and PRM batches of a stage that may train them on several ranks (the PRM only where one is made)."""
    if cfg.stage.name in FSDP_STAGES:  # ppo and pipeline make a missing SFT checkpoint
        _check_split(problems, "sft.batch_rows", cfg.sft.batch_rows, world)
    try:
        learned_prm = build_quietly(cfg.reward, seed=cfg.seed).needs_learned_prm
    except (ConfigError, MissingMandatoryValue):  # reported by prmppo.validate / _check_missing
        learned_prm = False
    if cfg.stage.name == "prm" or (cfg.stage.name in ("ppo", "pipeline") and learned_prm):
        _check_split(problems, "prm_train.batch_rows", cfg.prm_train.batch_rows, world)


def _check_topology(problems: list[str], cfg: DictConfig) -> None:
    """Several training ranks (`topology=fsdp`): the stages of FSDP_STAGES, SFT and PRM batches that split
    into equal shares, and a PPO batch that splits into whole micro-batches on every rank (each rank runs
    `minibatch_rows / train_world_size` rows of every minibatch)."""
    topology, ppo, world = cfg.topology, cfg.ppo, cfg.topology.train_world_size
    if world < 1:
        problems.append(f"topology.train_world_size={world} must be >= 1")
    if topology.name != "fsdp":
        if world != 1:
            problems.append(f"topology.train_world_size={world} with topology={topology.name}: one process trains; "
                            "use topology=fsdp for several ranks")
        return
    if cfg.stage.name not in FSDP_STAGES:
        problems.append(f"stage={cfg.stage.name} with topology=fsdp is not available yet: the stages that run on "
                        f"several ranks are {', '.join(FSDP_STAGES)}; run stage={cfg.stage.name} on one process "
                        "(topology=cpu or gpu)")
    _check_stage_splits(problems, cfg, world)
    rows, share = ppo.prompts_per_iteration * ppo.n_samples_per_prompt, ppo.micro_batch_rows * world
    if world >= 1 and share > 0 and ppo.minibatch_rows % share:
        problems.append(
            f"the batch does not split across topology.train_world_size={world} ranks: rows per iteration "
            f"{ppo.prompts_per_iteration} x {ppo.n_samples_per_prompt} = {rows}, minibatch rows "
            f"ppo.minibatch_rows={ppo.minibatch_rows}, micro-batch rows x ranks {ppo.micro_batch_rows} x {world} = "
            f"{share}; ppo.minibatch_rows must be a multiple of {share} ({ppo.minibatch_rows} % {share} = "
            f"{ppo.minibatch_rows % share}) so that every rank runs whole micro-batches")
    if ppo.drop_uniform_groups:
        problems.append("ppo.drop_uniform_groups=true with topology=fsdp is not available yet: a rank whose "
                        "micro-batch held only dropped rows would skip FSDP's collectives while the others wait")


# what to give for a key that has no default (`???` in YAML), keyed by its dotted name
MISSING_HINTS = {
    "model.path": "a local Hugging Face-layout checkpoint directory (config.json, tokenizer files, *.safetensors), "
                  "e.g. model.path=/ckpt/mistral-7b",
    "task.data_dir": "the directory holding the task's JSONL files, e.g. task.data_dir=/data/gsm8k",
    "task.train_path": "your JSONL or Parquet file of RL prompts, e.g. task.train_path=data/train.parquet",
    "task.test_path": "your JSONL or Parquet file of held-out problems, e.g. task.test_path=data/test.parquet",
}


def _missing_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted names of keys left `???`, without resolving interpolations (run_dir needs Hydra's runtime)."""
    found = []
    for key in node.keys():
        name = f"{prefix}{key}"
        if name == "hydra":  # Hydra's own node, present only when composed with return_hydra_config
            continue
        if OmegaConf.is_missing(node, key):
            found.append(name)
        elif OmegaConf.is_dict(node._get_node(key)) and not OmegaConf.is_interpolation(node, key) \
                and node[key] is not None:
            found += _missing_keys(node[key], f"{name}.")
    return found


def _check_missing(problems: list[str], cfg: DictConfig) -> None:
    """Keys left `???` (no default: the user must give them) are refused by name before any work."""
    for key in sorted(_missing_keys(cfg)):
        hint = MISSING_HINTS.get(key, "give it on the command line or in an experiment file")
        problems.append(f"{key} is not set: {hint}")


def wandb_key_configured(environ=os.environ) -> bool:
    """True when W&B has an API key without asking: WANDB_API_KEY, or a netrc entry for the W&B host
    (what `wandb login` writes; the host comes from WANDB_BASE_URL, default api.wandb.ai)."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = Path(environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return bool(path.is_file() and netrc.netrc(path).authenticators(host))
    except (netrc.NetrcParseError, OSError):
        return False


def _check_wandb(problems: list[str], logger: DictConfig) -> None:
    if not logger.wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        problems.append("logger.wandb=true needs the wandb package, which is not installed: "
                        "pip install 'prmppo[wandb]' (or use logger=console; metrics.jsonl has every metric)")
    elif logger.mode == "online" and not wandb_key_configured():
        problems.append("logger.mode=online but no W&B API key is configured (set WANDB_API_KEY or run "
                        "`wandb login`); logger.mode=offline writes the run under <run_dir>/wandb for a later "
                        "`wandb sync`")


CRITIC_KEYS = ("value_lr", "vf_coef", "value_clip", "lam_actor", "lam_critic", "detach_value_hidden")
BAND_MEASURE_KEYS = ("k", "low", "high", "problems", "temperature", "top_p", "max_new_tokens", "request_rows")
CANARY_CHECK_KEYS = ("n_problems", "max_drop")  # read by the canary's checks, which canary.every=0 turns off
# the worker process's own keys, which rollout=inprocess (no worker) never reads
WORKER_KEYS = ("python", "startup_timeout_s", "request_timeout_s", "heartbeat_timeout_s", "standby")
TEST_EVAL_DURING_PPO_KEYS = ("during_ppo_problems", "during_ppo_k")  # eval.every=0 turns that evaluation off
PRM_STAGES = ("ppo", "pipeline")  # the stages that train (or reuse) a PRM when the reward needs a learned one


def _inert_prm_train(cfg: DictConfig, reward) -> list[str]:
    """The `prm_train` keys of a run that trains no PRM: every one unless `stage=prm`, or `stage=ppo` /
    `pipeline` with a reward that needs a learned PRM (`ensure_prm` trains or reuses it). Such a run
    still reads `prm_train.chunk_rows` when its reward scores steps at all (the step scorer's rows per
    forward), so it is left out for those."""
    stage = cfg.stage.name
    if stage == "prm" or (stage in PRM_STAGES and reward.needs_learned_prm):
        return []
    scores_steps = stage in PRM_STAGES and reward.needs_step_scorer
    return [f"prm_train.{key}" for key in cfg.prm_train if not (scores_steps and key == "chunk_rows")]


def inert_keys(cfg: DictConfig) -> list[str]:
    """Keys this run's code never reads under its own config, so a sweep over them repeats the same run.

    The reward says which of its keys it ignores (`inert_keys`: `reward.eta` is only the `clip` transform's
    threshold, `reward.min_form_temperature` only `min_form`'s); the critic's keys only for
    `ppo.advantage_estimator=gae` (rloo / grpo build no critic); `ppo.group_std_floor` and
    `ppo.group_same_tol` only for grpo; a KL estimator only when its coefficient is above 0; `lora.dropout`
    never (the no-grad pass and the update both run with dropout off, ppo/loop.py, and the engines serve
    merged or dropout-free adapters); the canary's check keys only when `canary.every` > 0, the test
    evaluation's during-PPO keys only when `eval.every` > 0; `prm_train` only where a PRM is trained
    (`_inert_prm_train`); vLLM's memory share only under `rollout=vllm`, the decode loop and its compile never
    under it; the band's measurement keys only when a band is measured (`stage=band` or `band.enabled`); the
    model's chat template settings only under task=jsonl. Recorded in `stage_result.json`, warned about when
    swept, and used by `prmppo.report` so that such a key does not split a group.
    """
    ppo = cfg.ppo
    reward = build_quietly(cfg.reward, seed=cfg.seed)
    inert = [f"reward.{key}" for key in reward.inert_keys]
    if ppo.advantage_estimator != "gae":
        inert += [f"ppo.{key}" for key in CRITIC_KEYS]
    if ppo.advantage_estimator != "grpo":
        inert += ["ppo.group_std_floor", "ppo.group_same_tol"]
    if ppo.kl_coef == 0:
        inert.append("ppo.kl_estimator")
    if ppo.kl_loss_coef == 0:
        inert.append("ppo.kl_loss_estimator")
    if "dropout" in cfg.lora:  # lora=adapter; lora=none has no such key
        inert.append("lora.dropout")
    if cfg.canary.every == 0:
        inert += [f"canary.{key}" for key in CANARY_CHECK_KEYS]
    if cfg.eval.every == 0:
        inert += [f"eval.{key}" for key in TEST_EVAL_DURING_PPO_KEYS]
    inert += _inert_prm_train(cfg, reward)
    vllm = cfg.rollout.engine == "vllm"
    inert += ["rollout.decode", "rollout.compile_decode"] if vllm else ["rollout.gpu_memory_utilization"]
    if cfg.rollout.engine == "inprocess":  # no worker: its interpreter, timeouts and standby are never read
        inert += [f"rollout.{key}" for key in WORKER_KEYS] + ["topology.engine_device"]
    if not (cfg.band.enabled or cfg.stage.name == "band"):
        inert += [f"band.{key}" for key in BAND_MEASURE_KEYS]
    if issubclass(OmegaConf.get_type(cfg.model), HFModelConfig) and \
            not issubclass(OmegaConf.get_type(cfg.task), JsonlTaskConfig):  # only task=jsonl renders chat prompts
        inert += ["model.chat_template", "model.system_prompt"]
    return inert


def config_problems(cfg: DictConfig) -> list[str]:
    """Every problem the checks of this module find in `cfg`: missing keys first, then the topology, W&B,
    and each section's ranges and arithmetic."""
    problems: list[str] = []
    _check_missing(problems, cfg)
    _check_topology(problems, cfg)
    _check_wandb(problems, cfg.logger)
    _check_rollout(problems, cfg)
    _check_sft_eval_canary(problems, cfg)
    for check in (_check_ppo_batch, _check_ppo_ranges, _check_ppo_estimators):
        check(problems, cfg.ppo)
    _check_prm_train(problems, cfg.prm_train)
    _check_band(problems, cfg)
    return problems
