"""The reference gate: the logprobs the KL reads (`reference_score`) equal the base model's on a probe
batch, after a PRM loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import save_perturbed_prm, tiny_mistral
from prmppo.guards.gates import REFERENCE_REL_TOLERANCE, GateError, check_reference, reference_probe
from prmppo.models.policy import FullPolicy, LoraPolicy, _causal_lm, _score
from prmppo.models.prm import build_step_scorer, make_head
from prmppo.models.tiny import build_char_tokenizer
from prmppo.tasks import ArithTask

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASK = ArithTask(sft_size=10, train_size=10, test_size=4)
RUN = {"temperature": 1.0, "chunk_tokens": 4096}  # what the PPO loop passes reference_score


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(TASK.alphabet())


def _model(tok, seed=0):
    return tiny_mistral(len(tok), seed)


def _prompts() -> list[str]:
    return [TASK.format_prompt(p) for p in TASK.problems("train")[:2]]


def _saved_prm(tok, prm_dir):
    """A PRM with non-trivial (perturbed) adapter weights, saved to `prm_dir`."""
    save_perturbed_prm(_model(tok), prm_dir, make_head("classifier", 32, tok), TARGETS)


def _policy_with_prm(tok, tmp_path, policy_type):
    """(policy, probe): the probe taken from the fresh model, then the policy built on it and the PRM
    loaded onto its prm_host (as `stages.ppo_training._reward` does), in the order `train_ppo` runs them."""
    _saved_prm(tok, tmp_path / "prm")
    model = _model(tok)
    probe = reference_probe(model, tok, _prompts())
    if policy_type is LoraPolicy:
        policy = LoraPolicy(model, detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS,
                            modules_to_save=["model.norm"])
    else:
        policy = policy_type(model, detach_value_hidden=True, critic=True)
    build_step_scorer(scorer="learned", task=TASK, tokenizer=tok, model=policy.prm_host, prm_dir=tmp_path / "prm",
                      chunk_rows=32)
    with torch.no_grad():  # the policy has moved away from the base: the reference must not follow
        for p in policy.policy_parameters():
            p.add_(0.05)
    return policy, probe


@pytest.mark.parametrize("policy_type", [LoraPolicy, FullPolicy])
def test_gate_passes_an_intact_reference_after_the_prm_loads(tok, tmp_path, policy_type):
    policy, probe = _policy_with_prm(tok, tmp_path, policy_type)
    found = check_reference(policy, **probe, **RUN)
    real = probe["probe_attention_mask"].bool()
    rows = [len(tok(p)["input_ids"]) for p in _prompts()]
    # every token after a row's first is scored: the probe's real tokens less one a row
    assert found["probe_rows"] == 2 and found["probe_tokens"] == sum(rows) - 2 == int(real.sum()) - 2
    # float32: tolerance = 2 * 1e-5 * max(1, largest |base logit| that predicts a scored token) / temperature 1
    biggest = probe["base_logits"][:, :-1][real[:, :-1] & real[:, 1:]].abs().max().item()
    assert found["dtype"] == "float32" and found["tolerance"] == pytest.approx(2e-5 * max(1.0, biggest))
    assert found["max_abs_logprob_diff"] <= 1e-5


@pytest.mark.parametrize("policy_type", [LoraPolicy, FullPolicy])
def test_gate_refuses_a_reference_whose_weight_was_nudged(tok, tmp_path, policy_type):
    policy, probe = _policy_with_prm(tok, tmp_path, policy_type)
    # the weight the reference reads: the frozen copy's (full) or the shared base's (LoRA, adapters off)
    host = policy.reference if policy_type is FullPolicy else policy.model.get_base_model()
    with torch.no_grad():
        host.model.layers[0].mlp.down_proj.base_layer.weight.add_(0.2)
    with pytest.raises(GateError, match=r"logprobs differ from the base model's by up to [0-9.e-]+ \(tolerance "
                                        r"[0-9.e-]+ for float32 at temperature 1.0\) on 2 probe prompts.*Likely "
                                        r"cause") as refused:
        check_reference(policy, **probe, **RUN)
    assert "'prm'" in str(refused.value)  # names the adapters sitting on the reference's weights


class _PrmOnReference(FullPolicy):
    """FullPolicy as it was before the fix: the KL's reference logprobs with the PRM adapter (the copy's
    active one) on."""

    @torch.no_grad()
    def reference_score(self, input_ids, attention_mask, position_ids, response_ids, response_mask,
                        prompt_length, temperature, chunk_tokens):
        return _score(_causal_lm(self.reference), None, input_ids, attention_mask, position_ids, response_ids,
                      response_mask, prompt_length, temperature, chunk_tokens, False).logprobs


def test_gate_refuses_a_reference_that_carries_the_prm_adapter(tok, tmp_path):
    policy, probe = _policy_with_prm(tok, tmp_path, _PrmOnReference)
    with pytest.raises(GateError, match=r"adapters on the reference's weights: \['prm'\]; a PRM adapter must be "
                                        r"switched off by _PrmOnReference.reference_score"):
        check_reference(policy, **probe, **RUN)


class _ShiftedReference:
    """A stand-in policy whose reference logprobs are the base's (from `base_logits`) plus a constant
    shift where a token is scored and a huge one elsewhere (which the gate must ignore)."""

    prm_host = nn.Linear(1, 1)

    def __init__(self, base_logits, shift):
        self.base_logits, self.shift = base_logits, shift

    def reference_score(self, input_ids, attention_mask, position_ids, response_ids, response_mask, prompt_length,
                        temperature, chunk_tokens):
        assert prompt_length == 1 and torch.equal(response_ids, input_ids[:, 1:])  # each token after the first
        logprobs = torch.log_softmax(self.base_logits[:, :-1] / temperature, -1)  # [R, L - 1, V]
        logprobs = logprobs.gather(-1, response_ids[..., None]).squeeze(-1)  # [R, L - 1]
        return logprobs + torch.where(response_mask.bool(), self.shift, 1e6)


# row 0 is left-padded by one; the scored tokens are those whose own position and the one before are
# real: row 0's last, row 1's last two (3 in all), predicted by the logits at row 0 position 1 and
# row 1 positions 0 and 1. The 9s sit at the pad only, so the largest |logit| that predicts is 2.0.
ATTENTION = torch.tensor([[0, 1, 1], [1, 1, 1]])
BASE = torch.tensor([[[9.0, 9.0], [0.5, -2.0], [0.0, 0.0]],  # [R=2, L=3, V=2]
                     [[1.0, 0.0], [0.25, 1.5], [0.0, 0.0]]])


@pytest.mark.parametrize("dtype,temperature,shift,passes", [
    # tolerance = 2 * rel * 2.0 / temperature:
    (torch.float32, 1.0, 3e-5, True),      # 2 * 1e-5 * 2 = 4e-5 >= 3e-5
    (torch.float32, 1.0, 5e-3, False),     # 5e-3 > 4e-5
    (torch.float32, 0.5, 6e-5, True),      # 4e-5 / 0.5 = 8e-5 >= 6e-5: a cooler temperature scales logprobs
    (torch.bfloat16, 1.0, 2e-2, True),     # 2 * 2**-7 * 2 = 0.03125 >= 2e-2
    (torch.bfloat16, 1.0, 4e-2, False),    # 0.04 > 0.03125
    (torch.float16, 1.0, 3e-3, True),      # 2 * 2**-10 * 2 = 0.00390625 >= 3e-3
    (torch.float16, 1.0, 5e-3, False),     # 0.005 > 0.00390625
])
def test_tolerance_scales_with_dtype_temperature_and_logit_size_and_ignores_pads(dtype, temperature, shift, passes):
    policy = _ShiftedReference(BASE, shift)
    probe = {"probe_input_ids": torch.tensor([[0, 1, 0], [1, 0, 1]]), "probe_attention_mask": ATTENTION,
             "probe_position_ids": torch.zeros(2, 3, dtype=torch.long), "base_logits": BASE, "dtype": dtype}
    if passes:
        found = check_reference(policy, **probe, temperature=temperature, chunk_tokens=4096)
        assert found["tolerance"] == pytest.approx(2 * REFERENCE_REL_TOLERANCE[dtype] * 2.0 / temperature)
        assert found["max_abs_logprob_diff"] == pytest.approx(shift, rel=2e-2) and found["probe_tokens"] == 3
    else:
        with pytest.raises(GateError, match=f"by up to {shift:.4g}"):
            check_reference(policy, **probe, temperature=temperature, chunk_tokens=4096)


def test_gate_refuses_a_dtype_without_a_tolerance():
    probe = {"probe_input_ids": torch.zeros(1, 2, dtype=torch.long), "probe_attention_mask": torch.ones(1, 2),
             "probe_position_ids": torch.zeros(1, 2, dtype=torch.long), "base_logits": torch.zeros(1, 2, 3),
             "dtype": torch.float64}
    with pytest.raises(GateError, match=r"dtype torch.float64 has no tolerance; valid: torch.float32, "
                                        r"torch.bfloat16, torch.float16"):
        check_reference(_ShiftedReference(probe["base_logits"], 0.0), **probe, **RUN)
