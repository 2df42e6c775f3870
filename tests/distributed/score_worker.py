"""Run by test_shard_score.py under `torchrun --nproc_per_node=2`: the chunked scoring pass (`policy.score`)
of a tiny full fine-tuning policy with a tied LM head, before and after `shard_policy`, written to
`<out>/rank<N>.json`. Usage: score_worker.py <out_dir> <run_dir>."""

import copy
import json
import os
import sys
from pathlib import Path

import torch
from transformers import MistralConfig, MistralForCausalLM

from prmppo.distributed.launch import close_ranks, init_ranks
from prmppo.distributed.shard import shard_policy
from prmppo.models.policy import FullPolicy, call_directly

out, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
rank = int(os.environ["RANK"])
run_dir.mkdir(parents=True, exist_ok=True)
ranks = init_ranks("fsdp", "cpu", run_dir)
torch.manual_seed(0)  # the same weights on both ranks
model = MistralForCausalLM(MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True))
policy = FullPolicy(model, detach_value_hidden=False, critic=False)
plain = copy.deepcopy(policy)
ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))  # [b, P + T] P = 5, T = 4
att, pos = torch.ones_like(ids), torch.arange(9).expand(2, 9)
response, mask = ids[:, 5:], torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])  # [b, T]


def scored(p):
    """Logprobs [b, T] and the tied embedding's gradient of -sum(logprobs), whole."""
    logprobs = p.score(ids, att, pos, response, mask, 5, 0.7, chunk_tokens=3).logprobs
    (-logprobs.sum()).backward()
    grad = p.model.get_input_embeddings().weight.grad
    return logprobs.detach(), (grad.full_tensor() if hasattr(grad, "full_tensor") else grad)


want_lp, want_grad = scored(plain)
shard_policy(policy, torch.float32)
got_lp, got_grad = scored(policy)
seen = {"logprobs_equal": bool(torch.allclose(got_lp, want_lp, atol=1e-6)),
        # each rank's loss is the whole batch's: the ranks' sum is world_size times one process's gradient
        "tied_grad_equal": bool(torch.allclose(got_grad, ranks.world_size * want_grad, atol=1e-5)),
        "tied_grad_norm": float(want_grad.norm())}
policy.scoring_call = call_directly  # the decoder and head called outside the root's forward
try:
    lp = policy.score(ids, att, pos, response, mask, 5, 0.7, chunk_tokens=3).logprobs
    seen["direct"] = "equal" if torch.allclose(lp, want_lp, atol=1e-6) else "different"
except Exception as err:  # noqa: BLE001 (what goes wrong is what is recorded)
    seen["direct"] = f"raised {type(err).__name__}"
(out / f"rank{rank}.json").write_text(json.dumps(seen))
close_ranks(ranks)
