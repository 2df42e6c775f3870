"""Shared fixtures: compose the real config (never a parallel test config) and shrink it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from prmppo.config.store import register_schemas

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = str(REPO / "conf")


def compose_config(overrides: list[str] | None = None, run_dir: Path | None = None) -> DictConfig:
    """The composed config for `overrides`, as `python -m prmppo <overrides>` would see it."""
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides or [])
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg


@pytest.fixture
def smoke_cfg(tmp_path):
    """The embedded default shrunk by the `debug=smoke` preset, writing under tmp_path."""

    def make(*overrides: str) -> DictConfig:
        cfg = compose_config(["debug=smoke", f"artifacts_dir={tmp_path / 'artifacts'}", *overrides],
                             run_dir=tmp_path / "run")
        return cfg

    return make


# The test tiers: `python -m pytest -q` (the README's command) leaves out the tests marked `slow`
# (pyproject.toml's addopts); `-m slow` runs them, `-m "slow or not slow"` everything (.ci/run). A slow
# test is marked in its file; the tests of several ranks are marked here, by folder (tests/dist, named
# tests/distributed after the package it mirrors), since each of them starts torchrun or a gloo process
# group and trains on two processes: all but the launch gates' and the sharded checkpoint's refusals,
# which run in-process in seconds (the subprocess refusal below excepted). A `vllm` test is slow too: each
# starts the vLLM engine (10-25 s on a CPU, most of it vLLM's import).
RANKS_FOLDERS = ("dist", "distributed")
FAST_RANKS_FILES = ("test_launch.py", "test_dist_checkpoint.py")
SLOW_RANKS_TESTS = ("test_a_multi_rank_launch_without_a_run_dir_is_refused",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.fspath))
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.slow)
        elif path.parent.parent == tests_dir and path.parent.name in RANKS_FOLDERS and (
                path.name not in FAST_RANKS_FILES or item.originalname in SLOW_RANKS_TESTS):
            item.add_marker(pytest.mark.slow)


# The vLLM engine environment (scripts/setup_vllm_env.sh makes it at REPO/.venv-vllm); CI sets
# PRMPPO_REQUIRE_VLLM=1 so that its absence fails the `vllm` tests instead of skipping them.
VLLM_PYTHON = os.environ.get("PRMPPO_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The engine environment's interpreter; skips (or fails, under PRMPPO_REQUIRE_VLLM=1) without it."""
    if os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK):
        return VLLM_PYTHON
    reason = (f"no vLLM engine environment at {VLLM_PYTHON} (create it with `bash scripts/setup_vllm_env.sh`, "
              "or point PRMPPO_VLLM_PYTHON at its interpreter)")
    if os.environ.get("PRMPPO_REQUIRE_VLLM") == "1":
        pytest.fail(reason + "; PRMPPO_REQUIRE_VLLM=1 requires it")
    pytest.skip(reason)


# A smoke-shaped policy that is right part of the time, so that accuracies compare as numbers above 0
# and below 1 (the 20-step smoke policy is never right, and 0 == 0 proves nothing): SFT on one-digit
# sums a+b for 150 steps at a larger LR, ~20-40 s on a 2-core CPU. The test questions are held out of
# SFT, so a right answer is learned addition, not recall; greedy test accuracy is ~0.4. Compose after
# `debug=smoke`; a run with these overrides and a seed `right_sometimes_sft` made reuses its checkpoint.
RIGHT_SOMETIMES = ["task.sft.max_operands=2", "task.sft.max_value=9", "task.sft.operators=[+]",
                   "task.rl.min_operands=2", "task.rl.max_operands=2", "task.rl.max_value=9", "task.rl.operators=[+]",
                   "task.sft_size=2000", "task.train_size=400",
                   "sft.steps=150", "sft.lr=1e-2", "sft.warmup_steps=10", "sft.batch_rows=32"]


@pytest.fixture(scope="session")
def right_sometimes_sft(tmp_path_factory):
    """`copy_to(artifacts_dir, *seeds) -> {seed: checkpoint}`: the SFT artifact of `debug=smoke` +
    `RIGHT_SOMETIMES` for each seed (trained once per session), copied into `artifacts_dir`, where a
    stage with the same overrides, seed and `artifacts_dir` reuses it instead of training."""
    import shutil

    from prmppo.app import run

    store = tmp_path_factory.mktemp("right_sometimes")
    made: dict[int, Path] = {}

    def copy_to(artifacts_dir: Path, *seeds: int) -> dict[int, Path]:
        copied = {}
        for seed in seeds:
            if seed not in made:
                cfg = compose_config(["debug=smoke", *RIGHT_SOMETIMES, "stage=sft", f"seed={seed}",
                                      f"artifacts_dir={store / 'artifacts'}"], run_dir=store / f"sft-seed{seed}")
                made[seed] = Path(run(cfg)["checkpoint"])
            copied[seed] = Path(artifacts_dir) / made[seed].name
            if not copied[seed].exists():
                shutil.copytree(made[seed], copied[seed])
        return copied

    return copy_to


def run_prmppo(args: list[str], cwd: Path, timeout: float = 300):
    """`python -m prmppo <args>` as a user would type it (a subprocess); returns the CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "prmppo", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory, right_sometimes_sft) -> Path:
    """A real multirun through Hydra's basic launcher: 2 arms x 2 seeds, 3 PPO iterations on smoke shapes
    from the `RIGHT_SOMETIMES` SFT policies (so test accuracies are neither 0 nor 1), test accuracy on 16
    problems logged every iteration. Returns the sweep dir (shared by the report and notebook tests)."""
    root = tmp_path_factory.mktemp("tiny_sweep")
    sweep_dir = root / "multirun"
    right_sometimes_sft(root / "artifacts", 0, 1)
    # job dirs by number: the overrides would make a name longer than a file name may be
    proc = run_prmppo(["-m", "stage=ppo", "debug=smoke", *RIGHT_SOMETIMES, "eval.during_ppo_problems=16",
                       "arm=prm,orm", "seed=0,1", "ppo.iterations=3", f"artifacts_dir={root / 'artifacts'}",
                       f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir=${hydra.job.num}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


def tiny_mistral(vocab_size: int, seed: int = 0, max_position_embeddings: int = 128):
    """A 2-layer, 32-wide Mistral with random weights (seeded), in eval mode: the unit tests' model."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                        tie_word_embeddings=True)
    return MistralForCausalLM(cfg).eval()


def save_perturbed_prm(model, prm_dir: Path, head, targets: list[str]):
    """A `prm` adapter on `model` with non-trivial (perturbed, seeded) weights, saved with `head` to `prm_dir`;
    returns the PeftModel."""
    import torch

    from prmppo.models.prm import new_prm, save_prm

    peft_model = new_prm(model, r=4, alpha=8, target_modules=targets, init_seed=0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    save_prm(prm_dir, peft_model, head)
    return peft_model


@contextmanager
def fresh_compile_process():
    """This process made to compile as a fresh process on a fresh machine would, for the block: dynamo's
    compiled code dropped, an empty local compile cache directory, inductor's in-memory caches and the
    compile artifacts recorded so far set aside, the compile counters zeroed."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache
    from torch.compiler._cache import CacheArtifactManager

    torch._dynamo.reset()
    counters.clear()
    with CacheArtifactManager.with_fresh_cache(), fresh_cache():
        yield
    torch._dynamo.reset()


class GraphCounter:
    """A torch.compile backend that records each graph dynamo hands it (`graphs`) and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.fixture
def decode_step_graphs(monkeypatch) -> GraphCounter:
    """The compiled decode step (`rollout.compile_decode`) traced by a `GraphCounter` instead of inductor, from
    a dynamo with no graphs of earlier tests (they are keyed by the same code object)."""
    import torch

    from prmppo.rollout import compiled_decode

    counter = GraphCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_decode, "COMPILE_BACKEND", counter)
    monkeypatch.setattr(compiled_decode, "_COMPILED_LAYER_STEP", None)
    return counter
