"""A tiny PPOTrainer and hand-made rollout batches for tests of the loop's assemble and update steps:
2 prompts x 4 samples of 5-8 random tokens after 3-token prompts, no engine, no tokenizer."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from transformers import MistralConfig, MistralForCausalLM

from conftest import compose_config
from prmppo.distributed.ranks import OneProcess
from prmppo.models.policy import LoraPolicy
from prmppo.ppo.batch import RolloutBatch, collate
from prmppo.ppo.loop import PPOTrainer
from prmppo.rewards.orm import OutcomeReward


def ppo_settings(*overrides: str):
    """The real config's `ppo` node for one minibatch of 8 rows (2 prompts x 4) in micro-batches of 4."""
    return OmegaConf.to_object(compose_config([
        "debug=smoke", "ppo.iterations=2", "ppo.prompts_per_iteration=2", "ppo.n_samples_per_prompt=4",
        "ppo.minibatch_rows=8", "ppo.micro_batch_rows=4", "ppo.warmup_steps=0", *overrides]).ppo)


def tiny_trainer(ppo, lora_b_scale: float = 0.0) -> PPOTrainer:
    """A trainer over a 2-layer Mistral with a LoRA policy; `lora_b_scale` > 0 sets LoRA B to random
    values of that scale, so the policy differs from the reference (adapters off) from the start."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             tie_word_embeddings=True))
    policy = LoraPolicy(model, detach_value_hidden=True, critic=ppo.advantage_estimator == "gae", r=4, alpha=8,
                        dropout=0.0, target_modules=["q_proj", "v_proj"])
    if lora_b_scale:
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * lora_b_scale)
    task = type("Task", (), {"problems": lambda self, split: list(range(10))})()
    return PPOTrainer(policy=policy, tokenizer=None, task=task, reward=OutcomeReward(), engine=None, sync=None,
                      ppo=ppo, logger=None, ranks=OneProcess(torch.device("cpu")), seed=0)


def random_rollout(outcome: list[float]) -> RolloutBatch:
    """8 random responses of 5-8 tokens after 3-token prompts, prompt-major in groups of 4, with `outcome`."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 30, (3,), generator=g).tolist() for _ in range(2) for _ in range(4)]
    responses = [torch.randint(4, 30, (int(n),), generator=g).tolist() for n in torch.randint(5, 9, (8,), generator=g)]
    ids, att, pos, resp, mask, plen = collate(prompts, responses, pad_token_id=0)
    return RolloutBatch([None] * 8, [""] * 8, ["stop"] * 8, ids, att, pos, resp, mask, torch.zeros(mask.shape),
                        torch.tensor(outcome), plen)
