"""The weight sync for the in-process engine (`rollout.sync=none`): nothing is shipped, only the version moves."""

from __future__ import annotations

import pytest

from prmppo.ppo.sync import WeightSync
from prmppo.rollout.protocol import WeightsSpec


class NothingToShip:
    """A policy whose every way of being saved fails: a sync that touches it is not a no-op."""

    def __getattr__(self, name):
        raise AssertionError(f"the sync called policy.{name}")


def test_sync_none_ships_nothing_and_advances_the_live_version(tmp_path):
    sync = WeightSync("none", 1, tmp_path / "sync", tokenizer=None)
    assert sync.served == WeightsSpec(kind="live", path=None, version=0)
    assert sync.maybe_sync(NothingToShip(), iteration=0)
    assert sync.push(NothingToShip()) == sync.served == WeightsSpec(kind="live", path=None, version=2)
    assert not any((tmp_path / "sync").iterdir())


def test_live_weights_carry_no_path():
    with pytest.raises(ValueError, match="weights.path must be null for kind='live'"):
        WeightsSpec(kind="live", path="/somewhere", version=1)
