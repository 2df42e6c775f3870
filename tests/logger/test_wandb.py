"""logger=wandb: a real offline W&B run per stage, read back from its own files; key and mode checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prmppo.app import run
from prmppo.config import validate
from prmppo.config.validate import wandb_key_configured
from prmppo.validate import ConfigError, validate_config
from prmppo.logger import MetricsLogger
from prmppo.logger.wandb_sink import WandbSink
from wandb_records import read_offline_run


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's own config/cache dirs under tmp_path, and no key from the environment."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    empty_netrc = tmp_path / "netrc"
    empty_netrc.write_text("")
    monkeypatch.setenv("NETRC", str(empty_netrc))
    return tmp_path


@pytest.mark.slow  # SFT and PPO with an offline W&B run
def test_offline_run_holds_the_resolved_config_grouping_and_the_jsonl_metrics(smoke_cfg, wandb_home):
    cfg = smoke_cfg("stage=sft", "logger=wandb", "experiment_name=wandb_check", "seed=3")
    assert cfg.logger.mode == "auto"  # no key configured: auto means offline
    run(cfg)
    run_dir = Path(cfg.run_dir)
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    got = read_offline_run(offline)
    assert got["run"]["group"] == "wandb_check" and got["run"]["job_type"] == "sft"
    assert cfg.arm.name == "prm"  # the default arm
    assert set(got["run"]["tags"]) == {"prm", "sft", "seed=3"}
    # the run config is the job's resolved config
    assert got["config"]["sft"]["steps"] == cfg.sft.steps and got["config"]["arm"]["name"] == "prm"
    assert got["config"]["run_dir"] == str(run_dir) and got["config"]["seed"] == 3
    # every metric row in metrics.jsonl (the source of truth) reached W&B with the same values
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [{k: v for k, v in row.items() if k not in ("stage", "step", "time")} for row in rows]
    history = [{k: v for k, v in h.items() if not k.startswith("_")} for h in got["history"]]
    assert len(logged) >= 2 and history == logged


def test_online_mode_without_a_key_is_refused_before_any_work(smoke_cfg, wandb_home):
    with pytest.raises(ConfigError, match="logger.mode=online but no W&B API key"):
        validate_config(smoke_cfg("logger=wandb", "logger.mode=online"))


def test_a_key_from_the_environment_or_netrc_counts_as_configured(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert wandb_key_configured({"WANDB_API_KEY": "abc"})
    assert wandb_key_configured({"NETRC": str(netrc)})
    assert not wandb_key_configured({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"})
    assert not wandb_key_configured({"NETRC": str(tmp_path / "absent")})


def test_logger_wandb_without_the_package_is_refused_with_the_install_command(smoke_cfg, monkeypatch):
    real = validate.importlib.util.find_spec
    monkeypatch.setattr(validate.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"pip install 'prmppo\[wandb\]'"):
        validate_config(smoke_cfg("logger=wandb"))


class _BrokenRun:
    def __init__(self):
        self.calls = 0

    def log(self, metrics, step):
        self.calls += 1
        raise ConnectionError("dashboard unreachable")


def test_a_wandb_failure_mid_run_turns_the_sink_off_and_jsonl_goes_on(tmp_path, caplog):
    sink = WandbSink.__new__(WandbSink)  # a sink whose run fails on every call, without starting W&B
    broken = sink.run = _BrokenRun()
    with MetricsLogger(tmp_path, "ppo", console=False, sinks=[sink]) as logger:
        logger.log(0, {"ppo/kl_ref": 0.1})
        logger.log(1, {"ppo/kl_ref": 0.2})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["ppo/kl_ref"] for row in rows] == [0.1, 0.2]
    assert broken.calls == 1 and sink.run is None  # tried once, then off
    assert "W&B logging failed" in caplog.text
