"""How much of grpo's advantage mass sits on groups of identical samples, with and without the std floor.

    python scripts/grpo_identical_groups.py RUN_DIR [--prompts 64] [--samples 4] [--floors 0 0.1 0.1 --tols 0 0 0.01]

RUN_DIR is a finished `python -m prmppo` run (its `.hydra/overrides.yaml`, its final policy in
`checkpoints/final`, and this config's SFT and PRM artifacts under `artifacts_dir`). The final policy
samples `--prompts` train prompts x `--samples` responses once; the run's reward scores them (the
learned PRM on the SFT backbone, as during PPO); then the same batch is assembled under
`ppo.advantage_estimator=grpo` with each pair of `ppo.group_std_floor` (`--floors`) and
`ppo.group_same_tol` (`--tols`); the default pairs are plain grpo, the floor alone, and both (KL off: the
KL pull is the same whatever they are). For each floor it prints the share of groups whose samples are token for
token identical and the share of the task-advantage mass (sum |A|) those groups carry: identical
samples differ in nothing a reward could judge, so their mass is PRM noise turned into advantage.
Runs on the CPU in about a minute for the default task.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from prmppo import artifacts
from prmppo.config.build import build
from prmppo.config.store import register_schemas
from prmppo.distributed.ranks import OneProcess
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.models.prm import build_step_scorer
from prmppo.ppo.loop import PPOTrainer
from prmppo.rollout.hf_engine import HFEngine
from prmppo.rollout.protocol import WeightsSpec

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


class InProcessEngine:
    """The built-in engine called directly with a `RolloutRequest` (no worker process)."""

    def __init__(self, model_dir: Path):
        self.engine = HFEngine(str(model_dir), decode="dynamic")

    def generate(self, request):
        tokens, logprobs, finish = self.engine.generate(
            request.prompt_token_ids, request.n_samples_per_prompt, request.max_new_tokens, request.temperature,
            request.top_p, request.seed, request.eos_token_id, request.pad_token_id)
        return SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reasons=finish)


def run_config(run_dir: Path, extra: list[str]):
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=[*overrides, *extra])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--floors", type=float, nargs="+", default=[0.0, 0.1, 0.1], help="ppo.group_std_floor")
    parser.add_argument("--tols", type=float, nargs="+", default=[0.0, 0.0, 0.01], help="ppo.group_same_tol, one a floor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = args.prompts * args.samples
    cfg = run_config(args.run_dir, ["ppo.advantage_estimator=grpo", "ppo.kl_coef=0", f"ppo.prompts_per_iteration="
                                    f"{args.prompts}", f"ppo.n_samples_per_prompt={args.samples}",
                                    f"ppo.minibatch_rows={rows}", f"ppo.micro_batch_rows={rows}",
                                    "ppo.value_warmup_iterations=0"])
    final = args.run_dir / "checkpoints" / "final"
    sft_dir, prm_dir = artifacts.artifact_dir(cfg, "sft"), artifacts.artifact_dir(cfg, "prm")
    task = build(cfg.task, "task")
    tokenizer = load_tokenizer(sft_dir)
    policy = build(cfg.lora, "policy", base_model=load_model(sft_dir), detach_value_hidden=True, critic=False)
    spec = build(cfg.reward, "reward", seed=cfg.seed)
    scorer = build_step_scorer(scorer=spec.scorer, task=task, tokenizer=tokenizer, model=policy.prm_host,
                               prm_dir=prm_dir, chunk_rows=cfg.prm_train.chunk_rows) if spec.needs_step_scorer else None
    reward = build(cfg.reward, "reward", seed=cfg.seed, step_scorer=scorer, task=task) if scorer else spec
    print(f"run {args.run_dir}: final policy {final}, PRM {prm_dir if spec.needs_learned_prm else '(none)'}")
    batch, rewards = None, None
    if len(args.floors) != len(args.tols):
        parser.error(f"--floors ({len(args.floors)} values) and --tols ({len(args.tols)}) must pair up")
    for floor, tol in zip(args.floors, args.tols):
        ppo = OmegaConf.to_object(cfg.ppo)
        ppo.group_std_floor, ppo.group_same_tol = floor, tol
        trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=reward,
                             engine=InProcessEngine(final) if batch is None else None,
                             sync=SimpleNamespace(served=WeightsSpec(kind="base", path=None, version=0)), ppo=ppo, logger=None, ranks=OneProcess(torch.device("cpu")),
                             seed=args.seed)
        if batch is None:
            batch = trainer.sample(0)
            rewards, _ = reward(batch)
        _, metrics = trainer.assemble(batch, rewards, trainer.plan(batch, 0))
        print(f"group_std_floor {floor:g}, group_same_tol {tol:g}: {metrics['adv/identical_group_fraction']:.3f} of groups identical, "
              f"carrying {metrics['adv/identical_group_mass']:.4f} of the task-advantage mass; "
              f"rollout accuracy {float(batch.outcome.mean()):.3f}")


if __name__ == "__main__":
    main()
