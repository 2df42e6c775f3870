"""`validate_config(cfg)`: the first and cheapest launch gate, the composed config against the code.

It runs before any model, tokenizer or dataset is built, cheapest first:

1. every `_target_` against the allowed packages (`config/build.py`), before anything is built;
2. the config's own ranges and arithmetic between keys (`config/validate.py`: needs only the config);
3. what only the code can say: each choice key against the list of the module that implements it
   (`CHOICE_HOMES`, and `OPTION_CHOICE_HOMES` for the keys of one option such as task=jsonl's), the
   policy class the `lora` group names (does it ship an adapter), the reward
   (built without a model or task: it checks its own keys), the arith task's operators.

Every problem found is listed in one `ConfigError` whose message names the keys, the values, and
what would be valid. It lives beside `app.py`, above the components whose lists it reads, so that
`config/` stays a leaf that the components import their defaults from.
"""

from __future__ import annotations

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from prmppo.config.build import build_quietly, check_targets
from prmppo.config.schema import (ArithTaskConfig, ExternalProcessRewardConfig, HFModelConfig, JsonlTaskConfig,
                                  LoraAdapterConfig)
from prmppo.config.validate import config_problems
from prmppo.errors import ConfigError
from prmppo.models.external_prm import PRM_FORMATS
from prmppo.models.loading import DTYPES
from prmppo.models.prm_heads import HEAD_TYPES
from prmppo.models.prm_labels import ESTIMATIONS, LABEL_SOURCES
from prmppo.optim import AUTOCAST_MODES
from prmppo.ppo.estimators import ADVANTAGE_ESTIMATORS
from prmppo.ppo.maths import AGG_MODES
from prmppo.ppo.sync import SYNC_MODES
from prmppo.rewards.kl import KL_ESTIMATORS
from prmppo.rollout.decoding import DECODE_MODES
from prmppo.rollout.inprocess import ENGINE as IN_PROCESS_ENGINE
from prmppo.rollout.worker import ENGINE_CLASSES
from prmppo.stages import STAGES
from prmppo.tasks.answers import CHECKERS
from prmppo.tasks.chains import SUPPORTED_OPERATORS
from prmppo.tasks.chat import chat_template_mode
from prmppo.tasks.jsonl import BAD_ROWS

# logger.mode: auto picks online when a W&B key is configured (stages/common.py), else offline
WANDB_MODES = ("auto", "offline", "online")

# choice key -> the valid values, each the list (or table) of the module that implements the choice
CHOICE_HOMES = {
    "stage.name": tuple(STAGES),
    "model.dtype": tuple(DTYPES),
    "rollout.engine": (*ENGINE_CLASSES, IN_PROCESS_ENGINE),
    "rollout.sync": SYNC_MODES,
    "rollout.decode": DECODE_MODES,
    "logger.mode": WANDB_MODES,
    "ppo.autocast": AUTOCAST_MODES,
    "ppo.kl_estimator": KL_ESTIMATORS,
    "ppo.kl_loss_estimator": KL_ESTIMATORS,
    "ppo.loss_agg": AGG_MODES,
    "ppo.advantage_estimator": ADVANTAGE_ESTIMATORS,
    "prm_train.label_source": LABEL_SOURCES,
    "prm_train.estimation": ESTIMATIONS,
    "prm_train.head": HEAD_TYPES,
}

# (group, the option's schema) -> its choice keys and their homes: keys only that option has, checked when
# the group's schema is that option's
OPTION_CHOICE_HOMES = {
    ("task", JsonlTaskConfig): {"checker": CHECKERS, "bad_rows": BAD_ROWS},
    ("reward", ExternalProcessRewardConfig): {"format": tuple(PRM_FORMATS), "dtype": tuple(DTYPES)},
}


def _check_choices(problems: list[str], cfg: DictConfig) -> None:
    homes = dict(CHOICE_HOMES)
    for (group, schema), keys in OPTION_CHOICE_HOMES.items():
        if issubclass(OmegaConf.get_type(cfg[group]), schema):
            homes.update({f"{group}.{key}": valid for key, valid in keys.items()})
    for key, valid in homes.items():
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
        if value not in valid:
            problems.append(f"{key}={value!r} is not one of {', '.join(map(str, valid))}")
    if issubclass(OmegaConf.get_type(cfg.model), HFModelConfig):
        try:  # true / false may arrive as YAML booleans: tasks/chat.py reads them
            chat_template_mode(cfg.model.chat_template)
        except ConfigError as err:
            problems.append(str(err))


def _check_policy(problems: list[str], cfg: DictConfig) -> None:
    """The policy class `lora._target_` names, asked whether it ships an adapter; the adapter's own keys
    where the group is the adapter's schema (`lora=none` has none of them)."""
    try:
        ships_adapter = get_class(cfg.lora._target_).ships_adapter
    except (ImportError, ValueError, AttributeError) as err:
        problems.append(f"lora._target_={cfg.lora._target_!r} is not a policy class prmppo can build ({err})")
        ships_adapter = True
    if cfg.rollout.sync == "adapter" and not ships_adapter:
        problems.append("rollout.sync=adapter needs LoRA adapters, but lora=none trains the full model: "
                        "use rollout.sync=checkpoint or lora=adapter")
    if not issubclass(OmegaConf.get_type(cfg.lora), LoraAdapterConfig):
        return
    lora = cfg.lora
    if lora.modules_to_save_lr is not None and not lora.modules_to_save_lr > 0:
        problems.append(f"lora.modules_to_save_lr={lora.modules_to_save_lr} must be > 0 (or null for ppo.lr)")
    if cfg.rollout.engine == "vllm" and cfg.rollout.sync == "adapter" and list(lora.modules_to_save):
        problems.append(f"lora.modules_to_save={list(lora.modules_to_save)} with rollout=vllm "
                        f"rollout.sync=adapter: vLLM's LoRA serves only the low-rank factors; use "
                        f"rollout.sync=checkpoint or lora.modules_to_save=[]")


def _check_task(problems: list[str], task: DictConfig) -> None:
    """The step delimiter every task but task=jsonl reads (that one splits at any delimiter), and the arith
    task's difficulty ranges (`task.sft`, `task.rl`)."""
    if task.step_delimiter != "\n" and not issubclass(OmegaConf.get_type(task), JsonlTaskConfig):
        problems.append(f"task.step_delimiter={task.step_delimiter!r}: only '\\n' (one step a line) is supported")
    if not issubclass(OmegaConf.get_type(task), ArithTaskConfig):
        return
    for name in ("sft", "rl"):
        dist = task[name]
        if dist.min_operands < 2 or dist.min_operands > dist.max_operands:
            problems.append(f"task.{name}.min_operands={dist.min_operands} must be >= 2 and <= "
                            f"task.{name}.max_operands={dist.max_operands}")
        if dist.min_value > dist.max_value:
            problems.append(f"task.{name}.min_value={dist.min_value} must be <= task.{name}.max_value={dist.max_value}")
        bad = [op for op in dist.operators if op not in SUPPORTED_OPERATORS]
        if bad or not dist.operators:
            problems.append(f"task.{name}.operators={list(dist.operators)} must be a non-empty subset of "
                            f"{list(SUPPORTED_OPERATORS)}")
    for key in ("sft_size", "train_size", "test_size"):
        if task[key] <= 0:
            problems.append(f"task.{key}={task[key]} must be > 0")


def validate_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` listing every problem in `cfg`; return None when it can run."""
    check_targets(cfg)  # first: the checks below build the reward and look up the policy class
    problems = config_problems(cfg)
    _check_choices(problems, cfg)
    _check_policy(problems, cfg)
    try:  # the reward checks its own keys (cheap: no model, no task)
        build_quietly(cfg.reward, seed=cfg.seed)
    except ConfigError as err:
        problems.append(str(err))
    except MissingMandatoryValue:
        pass  # a reward key left `???` (reward=prm_external's path): config_problems names it
    _check_task(problems, cfg.task)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
