"""The PRM on the shared backbone: heads, adapter switching that leaves the policy alone, save/load."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from prmppo.models.policy import LoraPolicy
from prmppo.models.prm import (PRM_ADAPTER, LearnedStepScorer, OracleStepScorer, build_step_scorer, label_token_id,
                               load_prm, make_head, new_prm, prm_step_logits, save_prm)
from prmppo.models.tiny import build_char_tokenizer
from prmppo.rewards.steps import StepBoundaries
from prmppo.stages.prm import ScoreRows
from prmppo.tasks import ArithTask

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASK = ArithTask(sft_size=10, train_size=10, test_size=4)
TEXTS = ["17+5=22\n22-3=19\nAnswer: 19", "1+2=3\nAnswer: 3", "4-4=0"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(TASK.alphabet())


def _model(tok, seed=0):
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        tie_word_embeddings=True)
    return MistralForCausalLM(cfg).eval()


def _rows(tok):
    prompts = [tok("17+5-3\n")["input_ids"] for _ in TEXTS]
    responses = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in TEXTS]
    return ScoreRows.build([None] * len(TEXTS), prompts, responses, tok.pad_token_id)


def _perturb(params, scale=0.3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _trained_prm(tok, tmp_path, head_type="classifier"):
    """A standalone PRM with non-trivial (perturbed) adapter and head weights, saved to tmp_path."""
    peft_model = new_prm(_model(tok), r=4, alpha=8, target_modules=TARGETS, init_seed=0)
    head = make_head(head_type, 32, tok)
    _perturb([p for p in peft_model.parameters() if p.requires_grad] + list(head.parameters()))
    save_prm(tmp_path / "prm", peft_model, head)
    return peft_model, head


def _scorer(peft_model, head, tok, chunk_rows=8):
    b = StepBoundaries.from_tokenizer(tok, "\n")
    return LearnedStepScorer(peft_model, head, b.delimiter_ids, b.eos_token_id, chunk_rows, b.blank_ids)


def test_fresh_classifier_scores_one_half_exactly_at_step_ends(tok):
    peft_model = new_prm(_model(tok), r=4, alpha=8, target_modules=TARGETS)
    scores, ends = _scorer(peft_model, make_head("classifier", 32, tok), tok).score(_rows(tok))
    # zero-initialised head: sigmoid(0) = 0.5 at every step end, 0 elsewhere.
    # TEXTS[0]: ends at 7, 15 and EOS 26; TEXTS[1]: 5, EOS 15; TEXTS[2]: EOS 5
    assert [e.nonzero().squeeze(-1).tolist() for e in ends] == [[7, 15, 26], [5, 15], [5]]
    assert torch.equal(scores, 0.5 * ends.float())


def test_label_tokens_head_is_the_two_token_ratio(tok):
    model = _model(tok)
    rows = _rows(tok)
    with torch.no_grad():  # reference: the base model's own logits (the fresh prm adapter adds B = 0)
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                       position_ids=rows.position_ids).logits[:, rows.prompt_length:]
    plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
    probs = logits.softmax(-1)
    expected = probs[..., plus] / (probs[..., plus] + probs[..., minus])  # p(+) / (p(+) + p(-))
    peft_model = new_prm(model, r=4, alpha=8, target_modules=TARGETS)
    scores, ends = _scorer(peft_model, make_head("label_tokens", 32, tok, "+", "-"), tok).score(rows)
    assert torch.allclose(scores[ends], expected[ends], atol=1e-5)
    assert expected[ends].std() > 1e-3  # the ratio varies by position: a constant would pass anything


def test_step_logprobs_head_reads_each_steps_own_token_logprobs(tok):
    model = _model(tok)
    rows = _rows(tok)
    with torch.no_grad():  # reference: the base model's logprob of each response token, step by step
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                       position_ids=rows.position_ids).logits
    p = rows.prompt_length
    token_lp = torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, rows.input_ids[:, p:, None])[..., 0]
    peft_model = new_prm(model, r=4, alpha=8, target_modules=TARGETS)
    head = make_head("step_logprobs", 32, tok)
    assert head.scale == 10.0
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[0.05, -0.2, 0.025]]))
        head.linear.bias.fill_(0.01)
    scores, ends = _scorer(peft_model, head, tok, chunk_rows=2).score(rows)
    for row, positions in enumerate([[7, 15, 26], [5, 15], [5]]):
        start = 0
        for end in positions:  # a step: the tokens after the previous end, up to and including its own
            step = token_lp[row, start:end + 1]
            logit = head.scale * (0.05 * step.min() - 0.2 * step.mean() + 0.025 * step[-1] + 0.01)
            assert torch.allclose(scores[row, end], torch.sigmoid(logit), atol=1e-5), (row, end)
            start = end + 1
    assert scores[ends].std() > 1e-3  # the steps differ: a constant would pass anything


def test_step_logprobs_head_starts_as_lowest_logprob_rule_and_trains_the_adapter(tok):
    peft_model = new_prm(_model(tok), r=4, alpha=8, target_modules=TARGETS)
    head = make_head("step_logprobs", 32, tok)
    # SCALE * (lowest + 1): the map starts on the step's least likely token alone
    assert head.linear.weight.tolist() == [[1.0, 0.0, 0.0]] and head.linear.bias.tolist() == [1.0]
    rows = _rows(tok)
    ends = StepBoundaries.from_tokenizer(tok, "\n").mask(rows.response_ids, rows.response_mask)
    logits = prm_step_logits(peft_model, head, rows.input_ids, rows.attention_mask, rows.position_ids,
                             rows.prompt_length, ends)[ends]
    logits.sum().backward()
    lora_b = [q for n, q in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(q.grad is not None for q in lora_b)
    assert max(q.grad.abs().max() for q in lora_b) > 0  # the step's logprobs carry gradient into the adapter
    with pytest.raises(ValueError, match="needs step_ends"):
        prm_step_logits(peft_model, head, rows.input_ids, rows.attention_mask, rows.position_ids, rows.prompt_length)


@pytest.mark.parametrize("modules_to_save", [[], ["model.norm"]])
def test_scoring_on_the_policy_model_leaves_policy_flags_and_logits_alone(tok, tmp_path, modules_to_save):
    standalone, head = _trained_prm(tok, tmp_path)
    rows = _rows(tok)
    expected, _ = _scorer(standalone, head, tok).score(rows)

    # with modules_to_save the policy also trains its own copy of the final norm: the PRM must
    # still read the base's norm
    policy = LoraPolicy(_model(tok), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS,
                        modules_to_save=modules_to_save)
    _perturb(policy.policy_parameters(), seed=2)  # the policy has moved away from the base
    frozen_one = policy.policy_parameters()[0]
    frozen_one.requires_grad_(False)  # an unusual flag: it must survive exactly
    before = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    logits_before, _ = policy.forward(rows.input_ids, rows.attention_mask, rows.position_ids)

    shared, shared_head = load_prm(tmp_path / "prm", policy.model, tok)
    assert shared is policy.model and policy.model.active_adapter == "policy"
    scores, ends = _scorer(shared, shared_head, tok, chunk_rows=2).score(rows)

    # the PRM on the shared backbone scores exactly as the standalone PRM (the policy delta is off)
    assert torch.allclose(scores, expected, atol=1e-5)
    assert (scores[ends] - 0.5).abs().max() > 1e-2  # the PRM is non-trivial, so the match means something
    after = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    assert {n: after[n] for n in before} == before
    prm_flags = [flag for n, flag in after.items() if f".{PRM_ADAPTER}." in n]
    assert prm_flags and not any(prm_flags)
    assert policy.model.active_adapter == "policy" and not frozen_one.requires_grad
    logits_after, _ = policy.forward(rows.input_ids, rows.attention_mask, rows.position_ids)
    assert torch.allclose(logits_before, logits_after, atol=1e-6)


def test_chunking_does_not_change_scores(tok, tmp_path):
    standalone, head = _trained_prm(tok, tmp_path, head_type="label_tokens")
    rows = _rows(tok)
    one, _ = _scorer(standalone, head, tok, chunk_rows=1).score(rows)
    many, _ = _scorer(standalone, head, tok, chunk_rows=64).score(rows)
    assert torch.allclose(one, many, atol=1e-5)


def test_build_step_scorer_loads_the_saved_prm_onto_a_plain_model(tok, tmp_path):
    standalone, head = _trained_prm(tok, tmp_path)
    rows = _rows(tok)
    expected, _ = _scorer(standalone, head, tok).score(rows)
    scorer = build_step_scorer(learned=True, task=TASK, tokenizer=tok, model=_model(tok), prm_dir=tmp_path / "prm",
                               chunk_rows=32)
    got, _ = scorer.score(rows)
    assert torch.allclose(got, expected, atol=1e-5)
    assert sorted(p.name for p in (tmp_path / "prm").rglob("*.safetensors")) == [
        "adapter_model.safetensors", "prm_head.safetensors"]


class _NoCheckerTask:
    name, step_delimiter = "nochecker", "\n"

    def problems(self, split):
        return TASK.problems(split)

    def check_steps(self, problem, response):
        return None


def test_oracle_refuses_a_task_without_checker(tok):
    b = StepBoundaries.from_tokenizer(tok, "\n")
    with pytest.raises(ValueError, match="reward=prm_oracle.*'nochecker'"):
        OracleStepScorer(_NoCheckerTask(), tok, b.delimiter_ids, b.eos_token_id)


def test_label_token_must_be_one_known_token(tok):
    assert label_token_id(tok, "+", "prm_train.good_token") == tok.convert_tokens_to_ids("+")
    with pytest.raises(ValueError, match="prm_train.good_token='ok'"):
        label_token_id(tok, "ok", "prm_train.good_token")  # two characters: two tokens
    with pytest.raises(ValueError, match="prm_train.head=.linear. is not one of classifier, label_tokens, step_lo"):
        make_head("linear", 32, tok)


def test_a_prm_loads_beside_a_bf16_policys_bf16_adapter(tok, tmp_path):
    # the policy keeps its LoRA factors in the model's dtype; the PRM adapter peft loads beside them
    # (upcast to fp32, as the standalone PRM has it) still scores as the standalone PRM does
    standalone = new_prm(_model(tok).to(torch.bfloat16), r=4, alpha=8, target_modules=TARGETS, init_seed=0)
    head = make_head("classifier", 32, tok)
    _perturb([p for p in standalone.parameters() if p.requires_grad] + list(head.parameters()))
    save_prm(tmp_path / "prm", standalone, head)
    rows = _rows(tok)
    expected, _ = _scorer(standalone, head, tok).score(rows)

    policy = LoraPolicy(_model(tok).to(torch.bfloat16), detach_value_hidden=True, critic=False, r=4, alpha=8,
                        target_modules=TARGETS)
    _perturb(policy.policy_parameters(), seed=2)
    logits_before, _ = policy.forward(rows.input_ids, rows.attention_mask, rows.position_ids)
    shared, shared_head = load_prm(tmp_path / "prm", policy.model, tok)
    scores, ends = _scorer(shared, shared_head, tok).score(rows)
    assert torch.allclose(scores, expected, atol=1e-2)
    assert (scores[ends] - 0.5).abs().max() > 5e-2  # a non-trivial PRM
    assert {p.dtype for p in policy.policy_parameters()} == {torch.bfloat16}
    assert policy.model.active_adapter == "policy"
    logits_after, _ = policy.forward(rows.input_ids, rows.attention_mask, rows.position_ids)
    assert torch.equal(logits_before, logits_after)


@pytest.mark.parametrize("kind", ["classifier", "label_tokens", "step_logprobs"])
def test_prm_scoring_leaves_no_forward_hooks_on_the_shared_model(tok, kind):
    """Under LoRA the PRM is an adapter on the policy's own model. Asking that model for its hidden states
    makes transformers install output-capturing forward hooks on its modules, which stay; dynamo then breaks
    each of the policy's compiled decoder layers at them (`ppo.compile`). The logits must not change: they
    equal those of the model's own forward with its hidden states, bit for bit."""
    from prmppo.models.prm import StepInputs
    from prmppo.ppo.maths import logprobs_from_logits

    peft_model = new_prm(_model(tok), r=4, alpha=8, target_modules=TARGETS)
    head = make_head(kind, 32, tok)
    rows = _rows(tok)
    plen = rows.prompt_length
    ends = StepBoundaries.from_tokenizer(tok, "\n").mask(rows.response_ids, rows.response_mask)
    hooks = lambda: sum(len(m._forward_hooks) for m in peft_model.modules())  # noqa: E731
    before = hooks()
    logits = prm_step_logits(peft_model, head, rows.input_ids, rows.attention_mask, rows.position_ids, plen, ends)
    assert hooks() == before
    t = rows.input_ids.shape[1] - plen
    keep = {"hidden": 1, "next_logits": t, "token_logprobs": t + 1}[head.reads]
    out = peft_model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids,
                     output_hidden_states=True, use_cache=False, logits_to_keep=keep)
    assert hooks() > before  # what the model's own forward leaves behind
    token_lp = (logprobs_from_logits(out.logits[:, :-1], rows.input_ids[:, plen:])
                if head.reads == "token_logprobs" else None)
    expected = head(StepInputs(out.hidden_states[-1][:, plen:], out.logits if head.reads == "next_logits" else None,
                               token_lp, rows.attention_mask[:, plen:].bool(), ends))
    assert torch.equal(logits, expected)
