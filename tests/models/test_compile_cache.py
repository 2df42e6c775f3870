"""The compile cache kept with the artifacts (models/compile_cache.py): a second process given the file loads
it and compiles nothing (inductor's FX graph cache hits), with the same numbers; an unusable file is ignored
with a warning; a save replaces the file whole or not at all; the key follows what decides the graphs.

"A fresh process on a fresh machine" is simulated in this process (conftest.py `fresh_compile_process`).
Each inductor compile on this CPU takes seconds, so the cold compile happens once, in a module fixture.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch

from conftest import fresh_compile_process, tiny_mistral
from prmppo.models.compile_cache import MAGIC, CompileCache, cache_counters, compile_cache_key
from prmppo.models.policy import LoraPolicy

KEY = "0123456789abcdef"


def small_block(x: torch.Tensor) -> torch.Tensor:  # [n, 16] -> [n, 16]
    return torch.nn.functional.gelu(x @ x.T @ x) * 0.5 + x.sin()


def run_compiled(x: torch.Tensor) -> torch.Tensor:
    return torch.compile(small_block, dynamic=True)(x)


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """A first run: nothing to load, a cold compile, the cache saved; its output, counters and directory."""
    directory = tmp_path_factory.mktemp("compile_cache")
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))
    with fresh_compile_process():
        cache = CompileCache(directory, KEY)
        loaded = cache.load()
        out = run_compiled(x)
        seen = cache_counters()
        saved = cache.save()
        torch.compile(lambda y: y.cos() * 3, dynamic=True)(x)  # a graph that joins later in the run
        # not saved: torch would write a blob whose reader keeps only this second graph, losing the first
        saved_again = cache.save()
    return {"dir": directory, "x": x, "out": out, "loaded": loaded, "counters": seen, "saves": [saved, saved_again]}


def test_a_second_run_loads_the_cache_and_compiles_nothing(cold_run):
    assert not cold_run["loaded"] and cold_run["saves"] == [True, False]
    assert cold_run["counters"]["fxgraph_cache_miss"] >= 1 and cold_run["counters"]["fxgraph_cache_hit"] == 0
    path = cold_run["dir"] / f"{KEY}.bin"
    before = path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o644  # other users' runs sharing the artifacts dir can read it
    with fresh_compile_process():
        cache = CompileCache(cold_run["dir"], KEY)
        assert cache.load()
        assert cache.loaded["inductor"] >= 1
        out = run_compiled(cold_run["x"])
        warm = cache_counters()
        assert not cache.save()  # every artifact came from the file: nothing rewritten
    # the graph came from the file, not a compile: hits, no misses (the cold run above, with no file, missed)
    assert warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0, warm
    assert torch.equal(out, cold_run["out"])  # the same compiled code: the same numbers, bit for bit
    assert path.read_bytes() == before


def _file(key: str, payload: bytes, checksum_of: bytes | None = None) -> bytes:
    header = {"key": key, "sha256": hashlib.sha256(payload if checksum_of is None else checksum_of).hexdigest()}
    return MAGIC + json.dumps(header).encode() + b"\n" + payload


@pytest.mark.parametrize("content, reason", [
    (b"\x00\x01 not a cache at all", "no header"),
    (_file("fedcba9876543210", b"payload"), "made for key 'fedcba9876543210'"),
    (_file(KEY, b"payl", checksum_of=b"payload"), "does not match its checksum"),
    (MAGIC + b"{not json\n" + b"payload", "Expecting property name"),
    (_file(KEY, b"bytes torch cannot read"), "torch could not read"),
], ids=["no header", "another key", "truncated", "bad header", "unreadable payload"])
def test_an_unusable_cache_file_is_ignored_with_a_warning(tmp_path, caplog, content, reason):
    (tmp_path / f"{KEY}.bin").write_bytes(content)
    cache = CompileCache(tmp_path, KEY)
    with caplog.at_level(logging.WARNING, logger="prmppo"):
        assert not cache.load()
    assert cache.loaded == {}
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"ignoring {tmp_path / f'{KEY}.bin'}" in warning and reason in warning and "compiling cold" in warning


def test_a_corrupt_cache_leaves_the_run_compiling_cold_with_the_same_numbers(cold_run, tmp_path):
    good = (cold_run["dir"] / f"{KEY}.bin").read_bytes()
    (tmp_path / f"{KEY}.bin").write_bytes(good[: len(good) // 2])  # a file cut short
    with fresh_compile_process():
        cache = CompileCache(tmp_path, KEY)
        assert not cache.load()
        out = run_compiled(cold_run["x"])
        assert cache_counters()["fxgraph_cache_miss"] >= 1
        assert cache.save()  # a whole file replaces the damaged one
    assert torch.equal(out, cold_run["out"])
    assert CompileCache(tmp_path, KEY)._read_payload()


def _fake_artifacts(payload: bytes):
    from torch.compiler._cache import CacheInfo

    info = CacheInfo()
    info.artifacts["inductor"].append(hashlib.sha256(payload).hexdigest())
    return lambda: (payload, info)


def test_a_failed_save_leaves_the_previous_file_whole_and_no_temp_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / f"{KEY}.bin"
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", _fake_artifacts(b"first"))
    assert CompileCache(tmp_path, KEY).save()
    first = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", _fake_artifacts(b"second, longer payload"))
    monkeypatch.setattr(os, "fsync", disk_full)  # the write fails after some bytes are out
    with caplog.at_level(logging.WARNING, logger="prmppo"):
        assert not CompileCache(tmp_path, KEY).save()  # a warning, not a failed run
    assert "could not write" in caplog.text and "No space left on device" in caplog.text
    assert path.read_bytes() == first  # a reader still finds the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_the_key_follows_what_decides_the_graphs_and_not_where_the_weights_came_from():
    cpu = torch.device("cpu")

    def key(model=None, **settings):
        return compile_cache_key(model if model is not None else tiny_mistral(64), cpu,
                                 **{"autocast": "none", **settings})

    base = key()
    assert key() == base and len(base) == 16
    moved = tiny_mistral(64, seed=3)  # other weights, another checkpoint dir: the same graphs
    moved.config._name_or_path = "/elsewhere/sft-0123"
    assert key(moved) == base
    assert key(tiny_mistral(64, max_position_embeddings=256)) != base  # the model's config
    assert key(tiny_mistral(64).to(torch.bfloat16)) != base  # the dtype
    assert key(autocast="bfloat16") != base  # a run setting
    lora = {r: key(LoraPolicy(tiny_mistral(64), detach_value_hidden=True, critic=False, r=r, alpha=8,
                              dropout=0.0, target_modules=["q_proj"]).model) for r in (4, 8)}
    assert lora[4] != base and lora[8] != lora[4]  # the adapters


def test_turning_the_cache_off_keeps_the_ppo_artifact_key():
    from conftest import compose_config
    from prmppo.artifacts import artifact_key

    key = lambda *overrides: artifact_key(compose_config(list(overrides)), "ppo")[0]  # noqa: E731
    assert key("ppo.compile_cache=false") == key() and key("ppo.compile=true") != key()
