"""`model=hf` on models other than the tiny Mistral with a character tokenizer: a random Llama and a
random Qwen2, each with a byte-level BPE tokenizer, built here and saved in the Hugging Face layout
(config.json, model.safetensors, tokenizer files), through every stage of the pipeline (sft -> prm ->
ppo -> eval) on `debug=smoke` shapes.

`debug=smoke` sets the tiny model's shape keys, which `model=hf` does not have, so the config is the
real `debug=smoke` composition with its `model` node replaced by the real `model=hf` composition.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from conftest import compose_config
from prmppo.app import run
from prmppo.config.build import build
from prmppo.models.tiny import build_bpe_tokenizer, sft_texts

# every stage on a random model of each Hugging Face architecture: about a minute each
pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)


def _random_hf_dir(architecture: str, tokenizer, out: Path) -> Path:
    """A randomly initialised `architecture` model and `tokenizer`, saved as an HF-layout directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):  # seeded weights, the global generator left as it was
        torch.manual_seed(0)
        if architecture == "llama":  # separate input and output embeddings
            model = LlamaForCausalLM(LlamaConfig(**SHAPE, **ids, tie_word_embeddings=False))
        else:  # qwen2: biases on q/k/v, tied embeddings
            model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, **ids, tie_word_embeddings=True, use_sliding_window=False))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _rows(run_dir: Path, stage: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["stage"] == stage]


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_random_hf_model_runs_every_stage(smoke_cfg, tmp_path, architecture):
    cfg = smoke_cfg()  # stage=pipeline, arm=prm: sft, a learned PRM, ppo, eval of both policies
    tokenizer = build_bpe_tokenizer(sft_texts(build(cfg.task, "task")), vocab_size=320)
    model_dir = _random_hf_dir(architecture, tokenizer, tmp_path / architecture)
    with open_dict(cfg):
        cfg.model = compose_config(["model=hf", f"model.path={model_dir}", "model.dtype=float32"]).model
    summary = run(cfg)
    run_dir, artifacts_dir = Path(cfg.run_dir), Path(cfg.artifacts_dir)

    assert summary["sft"]["init"] == str(model_dir)  # model=hf starts from the directory itself
    sft = _rows(run_dir, "sft")
    assert sft[-2]["sft/loss"] < sft[0]["sft/loss"]
    for stage in ("sft", "ppo"):  # the architecture and the tokenizer survive training and merging
        (artifact,) = artifacts_dir.glob(f"{stage}-*")
        config = json.loads((artifact / "config.json").read_text())
        assert config["model_type"] == architecture and config["vocab_size"] == len(tokenizer)
        saved = json.loads((artifact / "tokenizer.json").read_text())
        assert saved["model"]["type"] == "BPE" and len(saved["model"]["merges"]) == 320 - 4 - 256
    (prm_dir,) = artifacts_dir.glob("prm-*")
    assert json.loads((prm_dir / "artifact.json").read_text())["summary"]["labels"]["examples"] > 0

    ppo = _rows(run_dir, "ppo")
    assert [r["step"] for r in ppo] == [0, 1]
    for row in ppo:  # the worker served exactly the policy the trainer holds, step rewards from the PRM
        assert row["rollout/engine_logprob_abs_diff"] < 1e-4 and "reward/prm_mean" in row
    banner = json.loads((run_dir / "banner.json").read_text())
    assert banner["derived_ids"]["eos_token_id"] == tokenizer.eos_token_id == banner["gates"]["eos"]["eos_token_id"]
    assert summary["ppo"]["policy_steps"] == summary["ppo"]["planned_policy_steps"] == 4

    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert {"sft", "ppo", "delta"} <= set(evaluation)
    for name in ("sft", "ppo"):
        assert evaluation[name]["n_problems"] == cfg.eval.n_problems
        assert {"greedy_accuracy", "sampled_accuracy", "pass@2"} <= set(evaluation[name])
