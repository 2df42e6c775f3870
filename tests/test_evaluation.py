"""prmppo.evaluation: pass@k against hand-counted and brute-force numbers, and `score` on a scripted model
whose every answer the test chooses, so greedy accuracy, sampled accuracy and pass@k are known by hand.

The scripted model goes through the real batched sampler (`rollout/decoding.py::sample_responses`):
left padding, the KV-cache loop, EOS trimming and the `max_new_tokens` cut are all the real ones.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict, deque
from itertools import combinations
from math import comb

import pytest
import torch

from conftest import GraphCounter
from prmppo.evaluation import pass_at_k, score
from prmppo.models.tiny import build_char_tokenizer
from prmppo.tasks import ArithTask


def test_pass_at_k_matches_hand_counts():
    # 1 right of 5, k=2: 1 - C(4,2)/C(5,2) = 1 - 6/10 = 0.4
    assert pass_at_k(5, 1, 2) == pytest.approx(0.4)
    # 2 right of 4, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 4) == 0.0  # nothing right: no draw can pass
    assert pass_at_k(4, 3, 2) == 1.0  # only 1 wrong sample: every pair holds a right one
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: any right sample passes


@pytest.mark.parametrize("n,c,k", [(6, 2, 3), (7, 3, 2), (5, 0, 1), (8, 1, 8), (6, 5, 4)])
def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_right_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    brute = sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)
    assert len(subsets) == comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


class _Output(dict):
    """What the sampler reads from a forward: `.logits` and the cache under `past_key_values`."""

    @property
    def logits(self) -> torch.Tensor:
        return self["logits"]


class ScriptedLM(torch.nn.Module):
    """A causal LM that writes chosen responses: at each prefill row it takes the next response scripted
    for that row's prompt (rows are read in order) and then emits its tokens and EOS, one per step,
    as logits 0 on the chosen token and -1e4 elsewhere (so greedy and temperature-1 sampling agree)."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the sampler asks the parameters for a device
        self.tokenizer = tokenizer
        self.queues = defaultdict(deque, {prompt: deque(responses) for prompt, responses in script.items()})
        self.vocab = len(tokenizer)

    def _logits(self, targets: list[list[int]], step: int, width: int) -> torch.Tensor:
        logits = torch.full((len(targets), width, self.vocab), -1e4)  # [B, L, V]
        for row, target in enumerate(targets):
            logits[row, -1, target[min(step, len(target) - 1)]] = 0.0
        return logits

    def forward(self, input_ids, attention_mask, position_ids=None, use_cache=True, past_key_values=None,
                cache=None):
        state = past_key_values if past_key_values is not None else cache
        if state is None:  # prefill: pick each row's response from its prompt
            targets = []
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
                prompt = self.tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
                response = self.queues[prompt].popleft()
                targets.append(self.tokenizer(response, add_special_tokens=False)["input_ids"]
                               + [self.tokenizer.eos_token_id])
            state = {"targets": targets, "step": 0}
        else:
            state["step"] += 1
        return _Output(logits=self._logits(state["targets"], state["step"], input_ids.shape[1]),
                       past_key_values=state)


@pytest.fixture(scope="module")
def task():
    one_digit = {"min_operands": 2, "max_operands": 2, "min_value": 0, "max_value": 9, "operators": ["+"]}
    return ArithTask(sft=one_digit, rl=one_digit, sft_size=10, train_size=10, test_size=3)


def _wrong(problem) -> str:
    return problem.solution.replace(f"Answer: {problem.answer}", f"Answer: {int(problem.answer) + 1}")


MAX_NEW_TOKENS = 24  # the solutions ("a+b=c\nAnswer: c") have <= 16 characters + EOS


def _cut(problem) -> str:
    """A right answer that the `MAX_NEW_TOKENS` cut loses: 30 characters come before it."""
    return "0+0=0\n" * 5 + problem.solution


def test_score_counts_scripted_outcomes_by_hand(task):
    p0, p1, p2 = task.problems("test")
    tokenizer = build_char_tokenizer(task.alphabet())
    prompt = task.format_prompt
    # samples, prompt by prompt (R right, W wrong, C right but cut at max_new_tokens):
    #   p0: R W R W -> c=2    p1: W W W C -> c=0    p2: R R R R -> c=4
    sampled_script = {prompt(p0): [p0.solution, _wrong(p0), p0.solution, _wrong(p0)],
                      prompt(p1): [_wrong(p1), _wrong(p1), _wrong(p1), _cut(p1)],
                      prompt(p2): [p2.solution] * 4}
    # greedy: p0 right, p1 wrong, p2 cut -> 1/3
    greedy_script = {prompt(p0): [p0.solution], prompt(p1): [_wrong(p1)], prompt(p2): [_cut(p2)]}
    for batch_rows in (4, 256):  # one prompt per sampler call (4 rows // k=4), and all at once
        model = ScriptedLM(tokenizer, greedy_script).train()
        greedy = score(model, tokenizer, task, [p0, p1, p2], k=0, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS,
                       batch_rows=batch_rows, seed=0)
        assert greedy == {"n_problems": 3.0, "greedy_accuracy": pytest.approx(1 / 3)}
        assert model.training  # score restores the mode it found
        model = ScriptedLM(tokenizer, sampled_script)
        sampled = score(model, tokenizer, task, [p0, p1, p2], k=4, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS,
                        batch_rows=batch_rows, seed=0, greedy=False)
        assert not any(model.queues.values())  # every scripted sample was drawn, once
        assert sampled["sampled_accuracy"] == pytest.approx(6 / 12)  # (2 + 0 + 4) right of 12
        assert sampled["pass@4"] == pytest.approx(2 / 3)  # p0 and p2 have a right sample
        # pass@2: p0 1 - C(2,2)/C(4,2) = 5/6, p1 0, p2 1 -> (5/6 + 0 + 1) / 3 = 11/18
        assert sampled["pass@2"] == pytest.approx(11 / 18)
        assert "greedy_accuracy" not in sampled


def test_score_keeps_each_problems_outcomes_by_hand(task):
    p0, p1, p2 = task.problems("test")
    tokenizer = build_char_tokenizer(task.alphabet())
    prompt = task.format_prompt
    # each prompt's greedy response first, then its 3 samples: greedy R W C; samples p0 R W W, p1 W W W, p2 R R C
    script = {prompt(p0): [p0.solution, p0.solution, _wrong(p0), _wrong(p0)],
              prompt(p1): [_wrong(p1), _wrong(p1), _wrong(p1), _wrong(p1)],
              prompt(p2): [_cut(p2), p2.solution, p2.solution, _cut(p2)]}
    model = ScriptedLM(tokenizer, script)
    result = score(model, tokenizer, task, [p0, p1, p2], k=3, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS,
                   batch_rows=256, seed=0, per_problem=True)
    ids = [hashlib.sha1(p.question.encode()).hexdigest()[:12] for p in (p0, p1, p2)]
    hard = [task.difficulty(p) for p in (p0, p1, p2)]
    assert [h["operands"] for h in hard] == [2, 2, 2]  # a+b
    assert result["problems"] == [
        {"index": 0, "id": ids[0], "difficulty": hard[0], "greedy_correct": True, "correct_of_k": 1, "k": 3},
        {"index": 1, "id": ids[1], "difficulty": hard[1], "greedy_correct": False, "correct_of_k": 0, "k": 3},
        {"index": 2, "id": ids[2], "difficulty": hard[2], "greedy_correct": False, "correct_of_k": 2, "k": 3}]
    # the aggregates are the rows' means: greedy 1/3, sampled (1 + 0 + 2) / 9
    assert result["greedy_accuracy"] == pytest.approx(1 / 3) and result["sampled_accuracy"] == pytest.approx(3 / 9)
    assert len(set(ids)) == 3
    model = ScriptedLM(tokenizer, {prompt(p0): [p0.solution]})
    assert "problems" not in score(model, tokenizer, task, [p0], k=0, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS,
                                   batch_rows=4, seed=0)  # only when asked: the canary's rows stay small


def test_generation_runs_compiled_decoder_layers_eagerly(task):
    """The test evaluation and the canary during PPO generate with the trainer's policy, whose decoder layers
    `ppo.compile` compiled: generating through them would compile a graph per layer and KV-cache state, and past
    dynamo's recompile limit (8) the update's own graphs would never be compiled. A counting backend records
    each graph dynamo hands it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch._dynamo.reset()
    tokenizer = build_char_tokenizer(task.alphabet())
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    counting = GraphCounter()
    graphs = counting.graphs
    for layer in model.model.layers:
        layer.compile(backend=counting, dynamic=True)
    result = score(model, tokenizer, task, task.problems("test")[:3], k=2, temperature=1.0, max_new_tokens=6,
                   batch_rows=8, seed=0)
    assert result["n_problems"] == 3.0
    assert graphs == []  # nothing compiled while generating
    ids = torch.tensor([tokenizer("1+2\n")["input_ids"]])
    model(input_ids=ids, attention_mask=torch.ones_like(ids))  # a plain forward, as the update runs
    assert graphs, "the layers are compiled outside generation: the counting backend saw their graphs"
    torch._dynamo.reset()
