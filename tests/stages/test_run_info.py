"""run_info.json: the code commit of the source checkout (null outside one, never an error), the versions of
Python and the packages that decide a run's numbers, and the machine's CPU and training device."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import torch

from prmppo.stages.common import RECORDED_PACKAGES, code_commit, cpu_model, package_versions, record_start

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="no git program to make a checkout with")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A git checkout with one commit of a package (`pkg/__init__.py`) and an ignored folder (`venv/`)."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("venv/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return repo


@needs_git
def test_code_commit_is_the_checkouts_head_and_dirty_when_a_tracked_file_changed(checkout):
    head = _git(checkout, "rev-parse", "HEAD")
    assert code_commit(checkout / "pkg") == {"commit": head, "dirty": False}
    (checkout / "pkg" / "new.py").write_text("")  # untracked: not what the commit means by dirty
    assert code_commit(checkout / "pkg") == {"commit": head, "dirty": False}
    (checkout / "pkg" / "__init__.py").write_text("x = 2\n")
    assert code_commit(checkout / "pkg") == {"commit": head, "dirty": True}


@needs_git
def test_code_commit_is_none_outside_a_checkout_or_for_an_ignored_install(checkout, tmp_path, monkeypatch):
    plain = tmp_path / "plain" / "pkg"  # a copy without git, e.g. an unpacked sdist
    plain.mkdir(parents=True)
    (plain / "__init__.py").write_text("")
    assert code_commit(plain) is None
    # a wheel installed into a virtualenv that lies inside a checkout: its files are not the checkout's
    installed = checkout / "venv" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    assert code_commit(installed) is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no git program at all
    assert code_commit(checkout / "pkg") is None


def test_run_info_records_code_versions_and_hardware(tmp_path):
    record_start(tmp_path, "cpu")
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["device"] == "cpu" and info["cpu_model"] == cpu_model()
    assert info["versions"]["python"] == platform.python_version()
    assert info["versions"]["torch"] == metadata.version("torch") and torch.__version__.startswith(
        info["versions"]["torch"].split("+")[0])
    assert set(info["versions"]) == {"python", *RECORDED_PACKAGES}
    assert info["versions"]["hydra-core"] and info["versions"]["omegaconf"] and info["versions"]["peft"]
    repo = Path(__file__).resolve().parents[2]
    source = repo / "src" / "prmppo" / "__init__.py"
    tracked = shutil.which("git") and subprocess.run(["git", "-C", str(repo), "ls-files", "--error-unmatch",
                                                      str(source)], capture_output=True).returncode == 0
    if tracked:  # the tests run from a checkout: the commit is its HEAD
        assert info["code"]["commit"] == _git(repo, "rev-parse", "HEAD") and isinstance(info["code"]["dirty"], bool)
    else:  # from an installed copy: no commit, and the run still starts
        assert info["code"] is None


def test_package_versions_names_a_missing_package_none(monkeypatch):
    monkeypatch.setattr("prmppo.stages.common.RECORDED_PACKAGES", ("torch", "no-such-package-prmppo"))
    assert package_versions() == {"python": platform.python_version(), "torch": metadata.version("torch"),
                                  "no-such-package-prmppo": None}
