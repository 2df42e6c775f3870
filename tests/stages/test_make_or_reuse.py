"""`make_or_reuse`, the one way a stage makes its artifact: lock, reuse (when asked and present), build,
publish from rank 0 while the others wait. Checked on one process with a build that writes a file, and
with a ranks object that records the order of its calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from prmppo import artifacts
from prmppo.distributed.ranks import OneProcess
from prmppo.stages.common import Made, make_or_reuse


def _build(calls: list, text: str):
    def build(final: Path) -> Made:
        calls.append(final)
        return Made({"made": text}, lambda full, tmp: (tmp / "out.txt").write_text(f"{text} {full}"),
                    lambda: "full")

    return build


def test_builds_once_then_reuses_and_rebuilds_when_told(smoke_cfg, caplog):
    cfg, calls = smoke_cfg("stage=sft"), []
    one = OneProcess(torch.device("cpu"))
    final, summary = make_or_reuse(cfg, "sft", one, _build(calls, "first"))
    assert final == artifacts.artifact_dir(cfg, "sft") and calls == [final]
    assert summary == {"made": "first"} and artifacts.artifact_ready(final)
    assert (final / "out.txt").read_text() == "first full"  # save got full()'s model in the staging dir
    caplog.set_level("INFO", logger="prmppo")
    again, reused = make_or_reuse(cfg, "sft", one, _build(calls, "second"))
    assert (again, reused, calls) == (final, {"reused": True, "checkpoint": str(final)}, [final])
    assert "reusing SFT checkpoint" in caplog.text and "(same task/model/sft config)" in caplog.text
    _, rebuilt = make_or_reuse(cfg, "sft", one, _build(calls, "third"), reuse=False)
    assert rebuilt == {"made": "third"} and (final / "out.txt").read_text() == "third full" and len(calls) == 2


def test_a_reused_band_names_its_file(smoke_cfg):
    cfg, calls = smoke_cfg("stage=band"), []
    one = OneProcess(torch.device("cpu"))
    make_or_reuse(cfg, "band", one, _build(calls, "x"))
    final, reused = make_or_reuse(cfg, "band", one, _build(calls, "y"))
    assert reused == {"reused": True, "band_file": str(final / "band.jsonl")} and len(calls) == 1


@dataclass(frozen=True)
class _Recorded(OneProcess):
    """Rank `rank` of a job whose collectives are recorded, not run: rank 0's answers are `main_says`."""

    log: list = field(default_factory=list)
    main_says: dict = field(default_factory=dict)

    def from_main(self, make):
        self.log.append("from_main")
        return self.main_says["from_main"] if not self.is_main else make()

    def barrier(self) -> None:
        self.log.append("barrier")


@pytest.mark.parametrize("is_main", [True, False])
def test_every_rank_builds_and_joins_the_gather_and_rank_0_alone_writes(smoke_cfg, is_main):
    cfg, calls = smoke_cfg("stage=prm"), []
    ranks = _Recorded(torch.device("cpu"), rank=0 if is_main else 1, world_size=2, is_main=is_main,
                      main_says={"from_main": False})

    def build(final: Path) -> Made:
        calls.append("build")
        return Made({"made": 1}, lambda full, tmp: calls.append(f"save {full}"),
                    lambda: calls.append("full") or "gathered")

    make_or_reuse(cfg, "prm", ranks, build)
    assert calls == (["build", "full", "save gathered"] if is_main else ["build", "full"])
    assert ranks.log == ["from_main", "barrier"]  # rank 0's word on reuse, then the wait for its write
    assert artifacts.artifact_ready(artifacts.artifact_dir(cfg, "prm")) is is_main
