"""Relative paths in the shipped config resolve against documented bases (config/paths.py), not
against whatever directory the process is in; an environment variable overrides each default."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from conftest import CONF_DIR, compose_config
from prmppo.config.paths import absolute_against, conf_dir
from prmppo.config.store import register_schemas


@pytest.fixture
def no_path_env(monkeypatch):
    monkeypatch.delenv("PRMPPO_DATA_DIR", raising=False)
    monkeypatch.delenv("PRMPPO_VLLM_PYTHON", raising=False)


def test_absolute_against_keeps_absolute_expands_home_and_normalises(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    assert absolute_against(Path("/base/dir"), "/abs/x") == "/abs/x"
    assert absolute_against(Path("/base/dir"), "~/x") == "/home/u/x"
    assert absolute_against(Path("/base/dir"), "../shared/data") == "/base/shared/data"
    assert absolute_against(Path("/base/dir"), "") == ""


def test_data_dir_default_is_absolute_from_the_launch_directory(tmp_path, monkeypatch, no_path_env):
    launch = tmp_path / "launch"
    launch.mkdir()
    monkeypatch.chdir(launch)
    cfg = compose_config(["task=gsm8k"])
    # ../shared/data/gsm8k from <tmp>/launch
    assert cfg.task.data_dir == str(tmp_path / "shared" / "data" / "gsm8k")


def test_data_dir_env_override_absolute_and_relative(tmp_path, monkeypatch, no_path_env):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRMPPO_DATA_DIR", "/data/sets")
    cfg = compose_config(["task=gsm8k"])
    assert cfg.task.data_dir == "/data/sets/gsm8k"
    monkeypatch.setenv("PRMPPO_DATA_DIR", "sets")  # relative: from the launch directory too
    assert cfg.task.data_dir == str(tmp_path / "sets" / "gsm8k")


def test_data_dir_follows_hydra_launch_directory_not_a_changed_cwd(tmp_path, monkeypatch, no_path_env):
    """Under Hydra's runtime (also with hydra.job.chdir=true) the base is hydra.runtime.cwd."""
    launch, elsewhere = tmp_path / "launch", tmp_path / "run_dir"
    launch.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(launch)
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["task=gsm8k"], return_hydra_config=True)
    assert cfg.hydra.runtime.cwd == str(launch)
    monkeypatch.chdir(elsewhere)  # what hydra.job.chdir=true does before the job runs
    HydraConfig.instance().set_config(cfg)
    try:
        assert cfg.task.data_dir == str(tmp_path / "shared" / "data" / "gsm8k")
    finally:
        HydraConfig.instance().cfg = None


def test_missing_data_dir_is_refused_with_key_and_resolved_path(tmp_path, monkeypatch, no_path_env):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRMPPO_DATA_DIR", "nowhere")
    task = instantiate(compose_config(["task=gsm8k"]).task)
    with pytest.raises(FileNotFoundError) as error:
        task.problems("test")
    assert "task.data_dir" in str(error.value)
    assert str(tmp_path / "nowhere" / "gsm8k" / "test.jsonl") in str(error.value)


def test_vllm_python_default_is_beside_the_trainers_environment(tmp_path, monkeypatch, no_path_env):
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    cfg = compose_config(["rollout=vllm"])
    assert cfg.rollout.python == str(Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python")
    monkeypatch.setenv("PRMPPO_VLLM_PYTHON", "/envs/vllm/bin/python")
    assert cfg.rollout.python == "/envs/vllm/bin/python"


def test_the_config_dir_is_the_repos_conf():
    """The packaged config (prmppo.conf) is the repo's conf/ under an editable install or a checkout."""
    assert conf_dir() == Path(CONF_DIR).resolve()
    assert (conf_dir() / "config.yaml").is_file()
