"""The PRM on the shared backbone: heads, adapter switching that leaves the policy alone, save/load."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from prmppo.models.policy import FullPolicy, LoraPolicy
from prmppo.models.prm import (PRM_ADAPTER, LearnedStepScorer, LikelihoodControlScorer, OracleStepScorer,
                               build_step_scorer, load_prm, make_head, new_prm, prm_step_logits, save_prm)
from prmppo.models.prm_heads import StepInputs, label_token_id
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


def _token_logprobs(model, rows) -> torch.Tensor:
    """[B, T] log p(response token t | before it) under `model`'s own forward (with grad where it has one)."""
    logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids).logits
    p = rows.prompt_length
    return torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, rows.input_ids[:, p:, None])[..., 0]


def _steps(values: torch.Tensor, row: int):
    """(end position, the step's values) per step of TEXTS[row]: the tokens after the previous end up to its own."""
    start = 0
    for end in [[7, 15, 26], [5, 15], [5]][row]:
        yield end, values[row, start:end + 1]
        start = end + 1


def _reference(model, rows, of: str) -> torch.Tensor:
    """[B, T] under `model` (no grad): each response token's logprob (`of` "token") or, at each response
    position, the logprob of the most likely token there (`of` "mode")."""
    with torch.no_grad():
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                       position_ids=rows.position_ids).logits
    logprobs = torch.log_softmax(logits[:, rows.prompt_length - 1:-1], -1)  # [B, T, V]
    if of == "mode":
        return logprobs.max(-1).values
    return logprobs.gather(-1, rows.input_ids[:, rows.prompt_length:, None])[..., 0]


# the heads that compare the PRM's logprob of each token with the reference's: log pi_ref(token) | its top logprob
RATIO_HEADS = [("log_ratio", "token"), ("mode_gap", "mode")]


@pytest.mark.parametrize("kind,of", RATIO_HEADS)
def test_ratio_heads_read_each_steps_gaps_to_the_reference(tok, kind, of):
    model = _model(tok)
    rows = _rows(tok)
    reference = _reference(model, rows, of)  # the SFT model: the base before the adapter exists
    peft_model = new_prm(model, r=4, alpha=8, target_modules=TARGETS)
    with torch.no_grad():
        _perturb([p for p in peft_model.parameters() if p.requires_grad], scale=0.1)
        gaps = _token_logprobs(peft_model, rows) - reference  # [B, T]
    head = make_head(kind, 32, tok)
    assert head.scale == 10.0 and head.reference == of
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[0.5, -0.2, 0.1, 0.05]]))
        head.linear.bias.fill_(0.2)
    scores, ends = _scorer(peft_model, head, tok, chunk_rows=2).score(rows)
    for row in range(len(TEXTS)):
        for end, step in _steps(gaps, row):  # (lowest, mean, last, sum) of the step's gaps
            logit = head.scale * (0.5 * step.min() - 0.2 * step.mean() + 0.1 * step[-1] + 0.05 * step.sum() + 0.2)
            assert torch.allclose(scores[row, end], torch.sigmoid(logit), atol=1e-5), (row, end)
    assert gaps[ends].abs().max() > 1e-2  # not all 0
    assert scores[ends].std() > 1e-3  # the steps differ: a constant would pass anything


def test_mode_gap_head_starts_alike_on_every_greedy_step_whatever_the_confidence(tok):
    head = make_head("mode_gap", 32, tok)
    # SCALE * (summed gap + 1): a step is right while its tokens fall less than a factor e short of the top choices
    assert head.linear.weight.tolist() == [[0.0, 0.0, 0.0, 1.0]] and head.linear.bias.tolist() == [1.0]
    valid = torch.ones(1, 4, dtype=torch.bool)
    ends = torch.tensor([[False, True, False, True]])
    top = torch.log(torch.tensor([[0.99, 0.4, 0.9, 0.3]]))  # the reference's top-token probability per position
    # the PRM as it starts (its LM is the reference) on two greedy steps, one confident and one not: both score
    # SCALE * (0 + 1); the likelihood rule would give 10 * (ln 0.4 + 1) = 0.84 to the second
    greedy = head(StepInputs(None, None, top, valid, ends, top))[ends]
    assert torch.allclose(greedy, torch.full((2,), 10.0))
    # a token other than the top one, half as likely as it: gap ln 0.5, logit 10 * (ln 0.5 + 1)
    other = head(StepInputs(None, None, top + torch.log(torch.tensor([[1.0, 1.0, 0.5, 1.0]])), valid, ends, top))
    assert torch.allclose(other[ends], torch.tensor([10.0, 10 * (math.log(0.5) + 1)]))


def test_log_ratio_head_leaves_the_references_likelihood_out(tok):
    head = make_head("log_ratio", 32, tok)
    # w = (1, 0, 0, 0) on (lowest, mean, last, sum), b = 0: every step 0.5 until the adapter or the map moves
    assert head.linear.weight.tolist() == [[1.0, 0.0, 0.0, 0.0]] and head.linear.bias.tolist() == [0.0]
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[0.5, -0.2, 0.1, 0.05]]))
        head.linear.bias.fill_(0.2)
    gen = torch.Generator().manual_seed(0)
    prm_lp, ref_lp = -3 * torch.rand(2, 2, 6, generator=gen)  # [b, T] each
    shift = -5 * torch.rand(2, 6, generator=gen)  # any per-token change of both models' likelihood
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    ends = torch.tensor([[False, True, False, False, False, True], [False, False, True, True, False, False]])
    logits = lambda prm, ref: head(StepInputs(None, None, prm, valid, ends, ref))  # noqa: E731
    # the same logprobs under the PRM and the reference: ratio 0 everywhere, logit SCALE * b at every step end
    assert torch.allclose(logits(ref_lp, ref_lp)[ends], torch.full((4,), 10 * 0.2))
    assert torch.allclose(logits(prm_lp + shift, ref_lp + shift)[ends], logits(prm_lp, ref_lp)[ends], atol=1e-5)
    # the likelihood head on the same numbers does move with the shift: the check above can fail
    likelihood = make_head("step_logprobs", 32, tok)
    moved = likelihood(StepInputs(None, None, prm_lp + shift, valid, ends))[ends]
    assert (moved - likelihood(StepInputs(None, None, prm_lp, valid, ends))[ends]).abs().max() > 1.0


@pytest.mark.parametrize("kind,of", RATIO_HEADS)
def test_ratio_heads_train_the_adapter_through_the_prms_own_logprobs_only(tok, kind, of):
    model = _model(tok)
    rows = _rows(tok)
    reference = _reference(model, rows, of)
    peft_model = new_prm(model, r=4, alpha=8, target_modules=TARGETS)
    ends = StepBoundaries.from_tokenizer(tok, "\n").mask(rows.response_ids, rows.response_mask)
    head = make_head(kind, 32, tok)
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 1.0]]))  # the sum: every response token counts once
        head.linear.bias.fill_(0.3)
    # LoRA B = 0: the PRM's LM is the reference token for token; log_ratio: every step scores sigmoid(SCALE * b)
    scores, _ = _scorer(peft_model, head, tok).score(rows)
    gap_sums = torch.stack([step.sum() for row in range(len(TEXTS))
                            for _, step in _steps(_reference(model, rows, "token") - reference, row)])
    assert torch.allclose(scores[ends], torch.sigmoid(10.0 * (gap_sums + 0.3)), atol=1e-6)
    assert (kind == "log_ratio") == bool((gap_sums == 0).all())
    logits = prm_step_logits(peft_model, head, rows.input_ids, rows.attention_mask, rows.position_ids,
                             rows.prompt_length, ends)[ends]
    logits.sum().backward()
    lora = [q for q in peft_model.parameters() if q.requires_grad]
    assert lora and all(q.requires_grad for q in lora)  # the reference pass (adapters off) left the flags as they were
    got = [q.grad.clone() for q in lora]
    assert max(g.abs().max() for g in got) > 0  # the gradient reaches the adapter
    # sum over step ends of SCALE * (sum of log pi_prm - sum of the reference's + b): every response token once, and
    # the reference's pass carries no gradient, so the gradient is SCALE * d(sum of the PRM's own token logprobs)
    for q in lora:
        q.grad = None
    (10.0 * (_token_logprobs(peft_model, rows) * rows.response_mask).sum()).backward()
    assert all(torch.allclose(g, q.grad, atol=1e-5, rtol=1e-4) for g, q in zip(got, lora))


@pytest.mark.parametrize("kind", ["log_ratio", "mode_gap"])
@pytest.mark.parametrize("policy_type", [LoraPolicy, FullPolicy])
def test_ratio_prm_round_trips_and_scores_alike_beside_a_moved_policy(tok, tmp_path, policy_type, kind):
    standalone, head = _trained_prm(tok, tmp_path, head_type=kind)
    with torch.no_grad():  # a map whose scores stay off 0 and 1, saved again
        head.linear.weight.copy_(torch.tensor([[0.1, 0.05, -0.05, 0.02]]))
        head.linear.bias.fill_(0.1)
    save_prm(tmp_path / "prm", standalone, head)
    rows = _rows(tok)
    expected, ends = _scorer(standalone, head, tok).score(rows)
    assert (expected[ends] - expected[ends].mean()).abs().max() > 1e-2  # a PRM whose steps differ
    if policy_type is LoraPolicy:
        policy = LoraPolicy(_model(tok), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS)
    else:
        policy = FullPolicy(_model(tok), detach_value_hidden=True, critic=True)
    _perturb(policy.policy_parameters(), seed=2)  # the policy has moved: neither pass may read it
    scorer = build_step_scorer(scorer="learned", task=TASK, tokenizer=tok, model=policy.prm_host,
                               prm_dir=tmp_path / "prm", chunk_rows=2)
    assert scorer.head.kind == kind
    assert all(torch.equal(a, b) for a, b in zip(scorer.head.state_dict().values(), head.state_dict().values()))
    got, _ = scorer.score(rows)
    assert torch.allclose(got, expected, atol=1e-5)


def test_likelihood_control_is_the_untrained_rule_of_the_sft_model_by_hand(tok):
    # every logit 0 (the final norm's weight 0): every token has logprob -ln V, so each step's lowest token
    # logprob is -ln V and the untrained rule gives sigmoid(10 * (1 - ln V)) at every step end
    model = _model(tok)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    b = StepBoundaries.from_tokenizer(tok, "\n")
    scores, ends = LikelihoodControlScorer(model, b.delimiter_ids, b.eos_token_id, 2, b.blank_ids).score(_rows(tok))
    expected = torch.sigmoid(torch.tensor(10 * (1 - math.log(model.config.vocab_size))))
    assert ends.sum() == 6 and torch.allclose(scores[ends], expected.expand(6), rtol=1e-4, atol=0)
    assert torch.equal(scores[~ends], torch.zeros_like(scores[~ends]))


def test_likelihood_control_reads_the_base_under_a_moved_policy_and_its_prm(tok, tmp_path):
    model = _model(tok)
    rows = _rows(tok)
    with torch.no_grad():
        sft = _token_logprobs(model, rows)  # the SFT model's token logprobs, before any adapter
    _trained_prm(tok, tmp_path)
    policy = LoraPolicy(model, detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS)
    load_prm(tmp_path / "prm", policy.model, tok)  # a PRM beside the policy must not change the control either
    _perturb(policy.policy_parameters(), seed=2)
    policy.model.train()
    flags = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    scorer = build_step_scorer(scorer="likelihood_control", task=TASK, tokenizer=tok, model=policy.prm_host,
                               chunk_rows=2)
    scores, ends = scorer.score(rows)
    rule = lambda lp: torch.stack([torch.sigmoid(10.0 * (step.min() + 1.0))  # noqa: E731  StepLogprobHead's init
                                   for row in range(len(TEXTS)) for _, step in _steps(lp, row)])
    assert torch.allclose(scores[ends], rule(sft), rtol=1e-4, atol=0)
    with torch.no_grad():
        moved = _token_logprobs(policy.model, rows)  # the policy's own logprobs: the control must not read them
    assert not torch.allclose(scores[ends], rule(moved), rtol=1e-2, atol=0)
    assert {n: p.requires_grad for n, p in policy.model.named_parameters()} == flags
    assert policy.model.training and policy.model.active_adapter == "policy"


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
    scorer = build_step_scorer(scorer="learned", task=TASK, tokenizer=tok, model=_model(tok), prm_dir=tmp_path / "prm",
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
    with pytest.raises(ValueError, match="prm_train.head=.linear. is not one of mode_gap, log_ratio, classifier, lab"):
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


@pytest.mark.parametrize("kind", ["log_ratio", "mode_gap", "classifier", "label_tokens", "step_logprobs"])
def test_prm_scoring_leaves_no_forward_hooks_on_the_shared_model(tok, kind):
    """Under LoRA the PRM is an adapter on the policy's own model. Asking that model for its hidden states
    makes transformers install output-capturing forward hooks on its modules, which stay; dynamo then breaks
    each of the policy's compiled decoder layers at them (`ppo.compile`). The logits must not change: they
    equal those of the model's own forward with its hidden states, bit for bit."""
    from prmppo.models.token_scores import logprobs_from_logits

    peft_model = new_prm(_model(tok), r=4, alpha=8, target_modules=TARGETS)
    _perturb([p for p in peft_model.parameters() if p.requires_grad])  # log_ratio: a ratio that is not 0
    head = make_head(kind, 32, tok)
    rows = _rows(tok)
    plen = rows.prompt_length
    ends = StepBoundaries.from_tokenizer(tok, "\n").mask(rows.response_ids, rows.response_mask)
    hooks = lambda: sum(len(m._forward_hooks) for m in peft_model.modules())  # noqa: E731
    before = hooks()
    logits = prm_step_logits(peft_model, head, rows.input_ids, rows.attention_mask, rows.position_ids, plen, ends)
    assert hooks() == before
    t = rows.input_ids.shape[1] - plen
    keep = {"hidden": 1, "next_logits": t, "token_logprobs": t + 1, "token_log_ratios": t + 1}[head.reads]
    reads_logprobs = head.reads in ("token_logprobs", "token_log_ratios")
    ref_lp = None
    if head.reads == "token_log_ratios":
        with torch.no_grad(), peft_model.disable_adapter():
            ref = peft_model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                             position_ids=rows.position_ids, use_cache=False, logits_to_keep=keep)
        ref_lp = (ref.logits[:, :-1].log_softmax(-1).max(-1).values if head.reference == "mode"
                  else logprobs_from_logits(ref.logits[:, :-1], rows.input_ids[:, plen:]))
    out = peft_model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids,
                     output_hidden_states=True, use_cache=False, logits_to_keep=keep)
    assert hooks() > before  # what the model's own forward leaves behind
    token_lp = logprobs_from_logits(out.logits[:, :-1], rows.input_ids[:, plen:]) if reads_logprobs else None
    expected = head(StepInputs(out.hidden_states[-1][:, plen:], out.logits if head.reads == "next_logits" else None,
                               token_lp, rows.attention_mask[:, plen:].bool(), ends, ref_lp))
    assert torch.equal(logits, expected)
