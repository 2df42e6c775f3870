"""`rollout.sync=shared`: the trainer's buffer and the built-in engine's copy out of it.

On the CPU the buffer is a `/dev/shm` file; `test_cuda_ipc_*` (CUDA only) opens a CUDA buffer through
its IPC handle in a second process, as the rollout worker does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

from prmppo.rollout.hf_engine import HFEngine  # noqa: E402
from prmppo.rollout.protocol import WeightsSpec  # noqa: E402
from prmppo.rollout.shared_weights import (MANIFEST, SharedWeightsReader, SharedWeightsWriter,  # noqa: E402
                                           remove_orphaned_files)

from tests.rollout.test_hf_engine import generate, save_tiny_model  # noqa: E402


def state_of(model_dir) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict())


def test_shared_sync_serves_what_a_checkpoint_of_the_same_weights_serves(tmp_path):
    base_dir = save_tiny_model(tmp_path / "base", seed=0)
    writer = SharedWeightsWriter(tmp_path / "sync" / "shared")
    engine = HFEngine(base_dir)
    base_tokens = generate(engine, seed=4)[0]
    resident, decoder = engine.model, engine._sampler.decoder
    assert decoder is not None
    storage = [parameter.data_ptr() for parameter in engine.model.parameters()]
    for version, seed in enumerate((1, 2), start=1):  # the second write reuses the buffer
        checkpoint_dir = save_tiny_model(tmp_path / f"ckpt{seed}", seed=seed)
        path = writer.write(state_of(checkpoint_dir), version)
        engine.load_weights(WeightsSpec("shared", str(path), version))
        assert engine.model is resident and engine._sampler.decoder is decoder
        assert [parameter.data_ptr() for parameter in engine.model.parameters()] == storage  # in place
        expected = state_of(checkpoint_dir)
        assert all(torch.equal(value, expected[name]) for name, value in engine.model.state_dict().items())
        assert generate(engine, seed=4) == generate(HFEngine(checkpoint_dir), seed=4)
    manifest = json.loads((tmp_path / "sync" / "shared" / MANIFEST).read_text())
    assert manifest["transport"] == "shm" and Path(manifest["file"]).is_file()
    engine.load_weights(WeightsSpec("base", None, 3))  # back to the base: reloaded from its dir
    assert generate(engine, seed=4)[0] == base_tokens
    writer.close()
    assert not Path(manifest["file"]).exists()  # the trainer's close removes the shared file


def test_tied_weights_travel_once_and_reach_every_name(tmp_path):
    base_dir = save_tiny_model(tmp_path / "base", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, as Qwen2-0.5B does
    writer = SharedWeightsWriter(tmp_path / "shared")
    writer.write(dict(model.state_dict()), 1)
    names = [entry["names"] for entry in writer.manifest["tensors"]]
    assert ["model.embed_tokens.weight", "lm_head.weight"] in names
    engine = HFEngine(base_dir)  # untied: both of its tensors get the one shared value
    engine.load_weights(WeightsSpec("shared", str(writer.path), 1))
    assert torch.equal(engine.model.lm_head.weight, model.model.embed_tokens.weight)
    writer.close()


def test_stale_or_mismatched_buffers_are_refused_and_nothing_is_served(tmp_path):
    base_dir = save_tiny_model(tmp_path / "base", seed=0)
    writer = SharedWeightsWriter(tmp_path / "shared")
    state = state_of(save_tiny_model(tmp_path / "ckpt", seed=1))
    writer.write(state, 1)
    engine = HFEngine(base_dir)
    with pytest.raises(RuntimeError, match="holds version 1, the request asks for 2"):
        engine.load_weights(WeightsSpec("shared", str(writer.path), 2))
    assert engine.served_weights is None
    with pytest.raises(RuntimeError, match="no weights are served"):
        generate(engine)
    engine.load_weights(WeightsSpec("shared", str(writer.path), 1))  # the right version recovers
    assert generate(engine, seed=4) == generate(HFEngine(str(tmp_path / "ckpt")), seed=4)
    with pytest.raises(ValueError, match="changed names, shapes or dtypes"):
        writer.write({name: value.double() if name.endswith("norm.weight") else value
                      for name, value in state.items()}, 2)
    renamed = SharedWeightsWriter(tmp_path / "renamed")
    renamed.write({("x." + name if "norm" in name else name): value for name, value in state.items()}, 1)
    unknown = "'x.model.layers.0.input_layernorm.weight', which the engine's model does not have"
    with pytest.raises(ValueError, match=unknown):
        engine.load_weights(WeightsSpec("shared", str(renamed.path), 1))
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        SharedWeightsReader().copy_into(engine.model, tmp_path / "nowhere", 1)
    writer.close(), renamed.close()


def test_a_shm_without_room_puts_the_buffer_in_the_sync_dir(tmp_path, monkeypatch):
    import prmppo.rollout.shared_weights as shared

    room_for = shared._room_for
    assert room_for(tmp_path, 1) and not room_for(tmp_path, 1 << 60)
    monkeypatch.setattr(shared, "_room_for", lambda where, size: False)
    writer = SharedWeightsWriter(tmp_path / "shared")
    writer.write({"w": torch.ones(4)}, 1)
    assert Path(writer.manifest["file"]).parent == tmp_path / "shared"
    writer.close()


def test_files_of_killed_owners_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid no longer runs
    orphan = tmp_path / f"prmppo-weights-{dead.pid}-0123456789ab.bin"
    live = tmp_path / f"prmppo-weights-{__import__('os').getpid()}-0123456789ab.bin"
    other = tmp_path / "prmppo-weights-notapid-x.bin"
    for path in (orphan, live, other):
        path.write_bytes(b"0")
    assert remove_orphaned_files(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and other.exists()


WORKER = r"""
import json, sys, torch
from prmppo.rollout.shared_weights import SharedWeightsReader
model = torch.nn.Linear(64, 32, device="cuda", dtype=torch.bfloat16)
SharedWeightsReader().copy_into(model, sys.argv[1], int(sys.argv[2]))
print(json.dumps({k: v.float().sum().item() for k, v in model.state_dict().items()}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_buffer_is_read_by_another_process(tmp_path):
    source = torch.nn.Linear(64, 32, device="cuda", dtype=torch.bfloat16)
    writer = SharedWeightsWriter(tmp_path / "shared")
    writer.write(dict(source.state_dict()), 7)
    assert writer.manifest["transport"] == "cuda_ipc"
    out = subprocess.run([sys.executable, "-c", WORKER, str(writer.path), "7"], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, "PYTHONPATH": "src"})
    sums = json.loads(out.stdout.strip().splitlines()[-1])
    assert sums == {k: v.float().sum().item() for k, v in source.state_dict().items()}
