"""Launch gates of `topology=fsdp`: torchrun present, WORLD_SIZE == topology.train_world_size, one run dir,
and a batch that splits across the ranks (refused with the arithmetic before any work)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose_config
from prmppo.validate import validate_config
from prmppo.distributed.launch import LaunchError, check_launch
from prmppo.errors import EXIT_REFUSED, ConfigError

TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
CPU_RANKS = ["topology=fsdp", "topology.train_device=cpu", "topology.engine_device=cpu"]


def test_fsdp_outside_torchrun_is_refused_with_the_command_to_use():
    with pytest.raises(LaunchError, match=r"topology=fsdp needs torchrun .* torchrun --nproc_per_node=2 -m prmppo "
                                          r"stage=ppo topology=fsdp topology.train_world_size=2"):
        check_launch("fsdp", 2, environ={})


def test_world_size_must_equal_topology_train_world_size():
    with pytest.raises(LaunchError, match=r"topology.train_world_size=4 but torchrun started WORLD_SIZE=2"):
        check_launch("fsdp", 4, environ=TORCHRUN_ENV)
    check_launch("fsdp", 2, environ=TORCHRUN_ENV)  # equal: accepted


def test_a_one_process_topology_under_torchrun_is_refused():
    with pytest.raises(LaunchError, match=r"topology=cpu under torchrun with WORLD_SIZE=2: every process would run"):
        check_launch("cpu", 1, environ=TORCHRUN_ENV)
    check_launch("cpu", 1, environ={})
    check_launch("cpu", 1, environ={**TORCHRUN_ENV, "WORLD_SIZE": "1"})


def test_a_batch_that_does_not_split_across_ranks_is_refused_with_the_arithmetic():
    # 4 x 2 = 8 rows, minibatches of 4, micro-batches of 2 on each of 4 ranks: a rank would get 1 row
    cfg = compose_config(["debug=smoke", "stage=ppo", *CPU_RANKS, "topology.train_world_size=4"])
    with pytest.raises(ConfigError, match=r"rows per iteration 4 x 2 = 8, minibatch rows ppo.minibatch_rows=4, "
                                          r"micro-batch rows x ranks 2 x 4 = 8; ppo.minibatch_rows must be a "
                                          r"multiple of 8 \(4 % 8 = 4\)"):
        validate_config(cfg)
    validate_config(compose_config(["debug=smoke", "stage=ppo", *CPU_RANKS]))  # 2 ranks: 4 = 2 x 2


@pytest.mark.parametrize("stage,key,rows", [("sft", "sft.batch_rows", 15), ("prm", "prm_train.batch_rows", 7),
                                             ("pipeline", "sft.batch_rows", 15)])
def test_sft_and_prm_batches_that_do_not_split_across_ranks_are_refused_with_the_arithmetic(stage, key, rows):
    """SFT and PRM train data-parallel: each of the 2 ranks takes batch_rows / 2 rows of every step."""
    cfg = compose_config(["debug=smoke", f"stage={stage}", *CPU_RANKS, "topology.train_world_size=2", f"{key}={rows}"])
    with pytest.raises(ConfigError, match=rf"{key}={rows} does not split across topology.train_world_size=2 ranks: "
                                          rf"each rank trains on {key} / 2 rows of every step and {rows} % 2 = 1; "
                                          rf"use a multiple of 2 \(e.g. {key}={rows + 1}\)"):
        validate_config(cfg)
    validate_config(compose_config(["debug=smoke", f"stage={stage}", *CPU_RANKS, f"{key}={rows + 1}"]))


def test_a_prm_batch_is_checked_only_where_a_prm_is_made():
    """arm=orm's pipeline makes no PRM: its prm_train.batch_rows is never split, so it is not refused."""
    validate_config(compose_config(["debug=smoke", "arm=orm", *CPU_RANKS, "prm_train.batch_rows=7"]))
    with pytest.raises(ConfigError, match=r"prm_train.batch_rows=7 does not split"):
        validate_config(compose_config(["debug=smoke", "arm=prm", *CPU_RANKS, "prm_train.batch_rows=7"]))


@pytest.mark.parametrize("override,message", [
    ("stage=band", r"stage=band with topology=fsdp is not available yet: the stages that run on several ranks "
                   r"are sft, prm, ppo, pipeline"),
    ("stage=eval", r"stage=eval with topology=fsdp is not available yet"),
    ("ppo.drop_uniform_groups=true", r"ppo.drop_uniform_groups=true with topology=fsdp is not available yet"),
    ("topology=cpu", r"topology.train_world_size=2 with topology=cpu: one process trains"),
])
def test_what_several_ranks_cannot_run_is_refused(override, message):
    cfg = compose_config(["debug=smoke", "stage=ppo", *CPU_RANKS, override, "topology.train_world_size=2"])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_a_multi_rank_launch_without_a_run_dir_is_refused(tmp_path):
    """Hydra's default run dir is a timestamp, different in each torchrun process: the command line must give one."""
    env = {**os.environ, **TORCHRUN_ENV, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "prmppo", "stage=ppo", "debug=smoke", *CPU_RANKS], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_REFUSED, proc.stderr[-2000:]
    assert "no hydra.run.dir=<dir> was given" in proc.stderr
    assert not (Path(tmp_path) / "runs").exists() or not any((Path(tmp_path) / "runs").rglob("metrics.jsonl"))


def test_the_gpu_count_gate_counts_the_ranks_of_this_node():
    from prmppo.distributed.launch import ranks_on_this_node

    assert ranks_on_this_node(8, environ={**TORCHRUN_ENV, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 4
    assert ranks_on_this_node(8, environ={}) == 8
