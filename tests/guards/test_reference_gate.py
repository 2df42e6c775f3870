"""The reference gate: the KL reference's logits equal the base model's on a probe batch, after a PRM loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import save_perturbed_prm, tiny_mistral
from prmppo.guards.gates import REFERENCE_REL_TOLERANCE, GateError, check_reference, reference_probe
from prmppo.models.policy import FullPolicy, LoraPolicy
from prmppo.models.prm import build_step_scorer, make_head
from prmppo.models.tiny import build_char_tokenizer
from prmppo.tasks import ArithTask

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASK = ArithTask(sft_size=10, train_size=10, test_size=4)


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
    loaded onto its prm_host (as `stages.ppo._reward` does), in the order `train_ppo` runs them."""
    _saved_prm(tok, tmp_path / "prm")
    model = _model(tok)
    probe = reference_probe(model, tok, _prompts())
    if policy_type is LoraPolicy:
        policy = LoraPolicy(model, detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS,
                            modules_to_save=["model.norm"])
    else:
        policy = policy_type(model, detach_value_hidden=True, critic=True)
    build_step_scorer(learned=True, task=TASK, tokenizer=tok, model=policy.prm_host, prm_dir=tmp_path / "prm",
                      chunk_rows=32)
    with torch.no_grad():  # the policy has moved away from the base: the reference must not follow
        for p in policy.policy_parameters():
            p.add_(0.05)
    return policy, probe


@pytest.mark.parametrize("policy_type", [LoraPolicy, FullPolicy])
def test_gate_passes_an_intact_reference_after_the_prm_loads(tok, tmp_path, policy_type):
    policy, probe = _policy_with_prm(tok, tmp_path, policy_type)
    found = check_reference(policy, **probe)
    real = probe["probe_attention_mask"].bool()
    rows = [len(tok(p)["input_ids"]) for p in _prompts()]
    assert found["probe_rows"] == 2 and found["probe_tokens"] == sum(rows) == int(real.sum())
    # float32: tolerance = 1e-5 * max(1, largest |base logit| at a real token)
    biggest = probe["base_logits"][real].abs().max().item()
    assert found["dtype"] == "float32" and found["tolerance"] == pytest.approx(1e-5 * max(1.0, biggest))
    assert found["max_abs_logit_diff"] <= 1e-6


@pytest.mark.parametrize("policy_type", [LoraPolicy, FullPolicy])
def test_gate_refuses_a_reference_whose_weight_was_nudged(tok, tmp_path, policy_type):
    policy, probe = _policy_with_prm(tok, tmp_path, policy_type)
    # the weight the reference reads: the frozen copy's (full) or the shared base's (LoRA, adapters off)
    host = policy.reference if policy_type is FullPolicy else policy.model.get_base_model()
    with torch.no_grad():
        host.model.layers[0].mlp.down_proj.base_layer.weight.add_(0.2)
    with pytest.raises(GateError, match=r"differ from the base model's by up to [0-9.e-]+ \(tolerance [0-9.e-]+ "
                                        r"for float32\) on 2 probe prompts.*Likely cause") as refused:
        check_reference(policy, **probe)
    assert "'prm'" in str(refused.value)  # names the adapters sitting on the reference's weights


class _PrmOnReference(FullPolicy):
    """FullPolicy as it was before the fix: the reference ran with the PRM adapter (its active one) on."""

    @torch.no_grad()
    def reference_logits(self, input_ids, attention_mask, position_ids):
        return self.reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).logits


def test_gate_refuses_a_reference_that_carries_the_prm_adapter(tok, tmp_path):
    policy, probe = _policy_with_prm(tok, tmp_path, _PrmOnReference)
    with pytest.raises(GateError, match=r"adapters on the reference's weights: \['prm'\]; a PRM adapter must be "
                                        r"switched off by _PrmOnReference.reference_logits"):
        check_reference(policy, **probe)


class _ShiftedReference:
    """A stand-in policy whose reference logits are the base's plus a constant shift at real tokens
    and a huge one at pad positions (which the gate must ignore)."""

    prm_host = nn.Linear(1, 1)

    def __init__(self, base_logits, attention_mask, shift):
        self.base_logits, self.attention_mask, self.shift = base_logits, attention_mask, shift

    def reference_logits(self, input_ids, attention_mask, position_ids):
        real = self.attention_mask.bool().unsqueeze(-1)  # [R, L, 1]
        return self.base_logits + torch.where(real, self.shift, 1e6)


@pytest.mark.parametrize("dtype,shift,passes", [
    # largest |base logit| = 2.0, so tolerance = rel * 2.0:
    (torch.float32, 1.5e-5, True),     # 1e-5 * 2 = 2e-5 >= 1.5e-5
    (torch.float32, 5e-3, False),      # 5e-3 > 2e-5
    (torch.bfloat16, 5e-3, True),      # 2**-7 * 2 = 0.015625 >= 5e-3
    (torch.bfloat16, 2e-2, False),     # 0.02 > 0.015625
    (torch.float16, 1.5e-3, True),     # 2**-10 * 2 = 0.001953 >= 1.5e-3
    (torch.float16, 2.5e-3, False),    # 0.0025 > 0.001953
])
def test_tolerance_scales_with_dtype_and_logit_size_and_ignores_pads(dtype, shift, passes):
    attention_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 is left-padded by one
    base = torch.tensor([[[9.0, 9.0], [0.5, -2.0], [0.0, 0.0]],  # [R=2, L=3, V=2]: the 9s sit at the pad only,
                         [[1.0, 0.0], [0.25, 1.5], [0.0, 0.0]]])  # so the largest real |logit| is 2.0
    policy = _ShiftedReference(base, attention_mask, shift)
    probe = {"probe_input_ids": torch.zeros(2, 3, dtype=torch.long), "probe_attention_mask": attention_mask,
             "probe_position_ids": torch.zeros(2, 3, dtype=torch.long), "base_logits": base, "dtype": dtype}
    if passes:
        found = check_reference(policy, **probe)
        assert found["tolerance"] == pytest.approx(REFERENCE_REL_TOLERANCE[dtype] * 2.0)
        assert found["max_abs_logit_diff"] == pytest.approx(shift, rel=2e-2) and found["probe_tokens"] == 5
    else:
        with pytest.raises(GateError, match=f"by up to {shift:.4g}"):
            check_reference(policy, **probe)


def test_gate_refuses_a_dtype_without_a_tolerance():
    base = torch.zeros(1, 2, 3)
    probe = {"probe_input_ids": torch.zeros(1, 2, dtype=torch.long), "probe_attention_mask": torch.ones(1, 2),
             "probe_position_ids": torch.zeros(1, 2, dtype=torch.long), "base_logits": base, "dtype": torch.float64}
    with pytest.raises(GateError, match=r"dtype torch.float64 has no tolerance; valid: torch.float32, "
                                        r"torch.bfloat16, torch.float16"):
        check_reference(_ShiftedReference(base, torch.ones(1, 2), 0.0), **probe)
