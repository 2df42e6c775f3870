"""Stage `prm` with `reward=prm_external`: no PRM is trained; the off-the-shelf checkpoint
(models/external_prm.py) is evaluated the way `stages/prm.py` evaluates a trained one, so the two compare
on the same problems.

`prm_launch_gate` runs before SFT or any weight: with an external PRM it checks that checkpoint's files and
format (and refuses several training ranks: the evaluation runs on one process), otherwise the task's
label source for the PRM that `stages/prm.py` trains. `evaluate_external_prm` takes that module's
`evaluate_prm` as an argument, since `stages/prm.py` imports this module.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.errors import PrmppoError
from prmppo.guards.gates import check_label_source
from prmppo.models.external_prm import check_external_reward, external_step_scorer
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.prm_labels import PolicySampler
from prmppo.stages.common import open_metrics, train_device


def prm_launch_gate(cfg: DictConfig, task):
    """The reward when it scores steps with an external PRM (its checkpoint checked, one process), else None
    after the label source of the PRM to train is checked."""
    reward = build(cfg.reward, "reward", seed=cfg.seed)
    if not (reward.needs_step_scorer and reward.scorer == "external"):
        check_label_source(task, cfg.prm_train.label_source)
        return None
    check_external_reward(reward)  # the checkpoint's files and format markers, no weights
    if cfg.topology.train_world_size > 1:
        raise PrmppoError("stage=prm with reward=prm_external evaluates on one process; use topology=cpu or gpu")
    return reward


def _sft_candidates(cfg: DictConfig, task, tokenizer, sft_checkpoint: Path, test) -> list | None:
    """`prm_train.best_of_n` samples of the SFT policy per test problem (token ids), or None when 0."""
    p = cfg.prm_train
    if p.best_of_n <= 0:
        return None
    model = load_model(sft_checkpoint, cfg.model.dtype, train_device(cfg))
    sampler = PolicySampler(model, temperature=1.0, max_new_tokens=p.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            batch_rows=cfg.eval.batch_rows, seed=cfg.seed, show_progress=cfg.logger.console)
    flat = sampler([tokenizer(task.format_prompt(q))["input_ids"] for q in test], p.best_of_n)
    return [flat[i * p.best_of_n:(i + 1) * p.best_of_n] for i in range(len(test))]


def evaluate_external_prm(cfg: DictConfig, task, run_dir: Path, reward, sft_checkpoint: Path, evaluate_prm) -> dict:
    """The external PRM gets a trained one's evaluation (`evaluate_prm` of stages/prm.py: step level on held-out
    solutions, half corrupted, and best-of-N of the SFT policy's samples against majority vote)."""
    tokenizer = load_tokenizer(sft_checkpoint)
    test = task.problems("test")[: cfg.prm_train.eval_problems]
    rng = random.Random(f"{cfg.seed}-prm")
    candidates = _sft_candidates(cfg, task, tokenizer, sft_checkpoint, test)  # the SFT model is freed on return
    scorer = external_step_scorer(reward, task, tokenizer, cfg.topology.train_device)
    with open_metrics(cfg, run_dir, "prm") as logger:
        start = time.time()
        result = evaluate_prm(scorer, task, tokenizer, test, candidates, rng)
        result["seconds"] = time.time() - start
        logger.log(0, {f"prm_eval/{k}": v for k, v in result.items()}, echo=True)
    return {"external_prm": check_external_reward(reward), "sft_checkpoint": str(sft_checkpoint), "eval": result}
