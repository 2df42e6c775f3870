"""With `ppo.compile`, the compiled decoder layers run one graph per pass kind (policy, reference, PRM),
all compiled by the end of the first iteration: later iterations, whose micro-batches have other rows and
widths, compile nothing (on an H200 a compilation mid-run stalled the second iteration for 12-16 s).

On a GPU inductor's alignment check specialises each compiled decoder layer on whether the sequence
width is a multiple of 8 (guard `hidden_states.size()[1] % 8 == 0`); CPU inductor adds no such guard
(and takes minutes here). The backend below records each graph dynamo hands it and asks the same
question of the width, which leaves the same guard on the graph, so the count is what a GPU would
compile for these shapes, as far as that guard goes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from conftest import GraphCounter, compose_config, save_perturbed_prm, tiny_mistral
from prmppo.distributed.ranks import OneProcess
from prmppo.models.policy import LoraPolicy
from prmppo.models.prm import build_step_scorer
from prmppo.models.prm_heads import make_head
from prmppo.models.tiny import build_char_tokenizer
from prmppo.ppo.loop import PPOTrainer
from prmppo.rewards.prm import ProcessReward
from prmppo.rollout.protocol import RolloutResult, WeightsSpec
from prmppo.tasks.arith import ArithTask

TARGETS = ["q_proj", "v_proj"]


class AlignmentCheckingCounter(GraphCounter):
    """`GraphCounter` that also asks whether each graph's sequence width (dim 1 of its [b, L, H] inputs) is a
    multiple of 8, as inductor's alignment check does on a GPU: reading the answer of a symbolic size guards
    the graph on it, so a width of the other kind compiles a graph of its own."""

    def __call__(self, gm, example_inputs):
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.dim() == 3 and isinstance(value.shape[1], torch.SymInt):
                bool(value.shape[1] % 8 == 0)  # the guard
        return super().__call__(gm, example_inputs)


class RandomLengthEngine:
    """A rollout worker stand-in: responses of random tokens (seeded by the request), 1 to a longest length
    of the request's own up to max_new_tokens, so every iteration's rows (the PRM scores them whole) and
    its micro-batches have other widths."""

    def __init__(self, tokenizer):
        self.tokens = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
        self.eos = tokenizer.eos_token_id

    def generate(self, request):
        generator = torch.Generator().manual_seed(request.seed)
        rows, reasons = [], []
        longest = int(torch.randint(request.max_new_tokens // 2, request.max_new_tokens + 1, (1,), generator=generator))
        for _ in range(len(request.prompt_token_ids) * request.n_samples_per_prompt):
            length = int(torch.randint(1, longest + 1, (1,), generator=generator))
            picks = torch.randint(len(self.tokens), (length,), generator=generator).tolist()
            stops = length < request.max_new_tokens
            rows.append([self.tokens[i] for i in picks[:length - stops]] + [self.eos] * stops)
            reasons.append("stop" if stops else "length")
        return RolloutResult(request.request_id, request.weights, rows, [[0.0] * len(r) for r in rows], reasons,
                             0.0, 0.0)


def test_compiled_layers_run_one_graph_per_pass_kind_and_none_after_the_first_iteration(monkeypatch, tmp_path):
    torch._dynamo.reset()
    task = ArithTask(seed=0, train_size=40, test_size=10)
    tokenizer = build_char_tokenizer(task.alphabet())
    save_perturbed_prm(tiny_mistral(len(tokenizer), seed=1), tmp_path / "prm", make_head("classifier", 32, tokenizer),
                       TARGETS)
    policy = LoraPolicy(tiny_mistral(len(tokenizer)), detach_value_hidden=True, critic=True, r=4, alpha=8,
                        dropout=0.0, target_modules=TARGETS)
    # the PRM on the policy's own model: its scoring runs through the policy's compiled layers too
    scorer = build_step_scorer(scorer="learned", task=task, tokenizer=tokenizer, model=policy.model,
                               prm_dir=tmp_path / "prm", chunk_rows=8)
    counting = AlignmentCheckingCounter()
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda module, **kwargs: compile_module(module, **{**kwargs, "backend": counting}))
    ppo = OmegaConf.to_object(compose_config([
        "debug=smoke", "ppo.compile=true", "ppo.advantage_estimator=gae", "ppo.iterations=4",
        "ppo.prompts_per_iteration=4", "ppo.n_samples_per_prompt=4", "ppo.minibatch_rows=8",
        "ppo.micro_batch_rows=2", "ppo.max_new_tokens=24", "ppo.warmup_steps=0"]).ppo)
    trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=ProcessReward(step_scorer=scorer),
                         engine=RandomLengthEngine(tokenizer),
                         sync=SimpleNamespace(served=WeightsSpec("base", None, 0), maybe_sync=lambda *_: False),
                         ppo=ppo, logger=None, ranks=OneProcess(torch.device("cpu")), seed=0)
    widths: list[int] = []  # of every pass through the decoder: the embeddings' output is its input
    embeddings = policy.model.get_base_model().get_input_embeddings()
    embeddings.register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    trainer.engine_gap_at_identical_weights()  # the start-up gate, as a run begins
    # one graph per pass kind, whatever the widths: the policy's (grad mode, also for the old logprobs) and the
    # reference's (no grad, adapters off) in the gate; the PRM's (no grad, its adapter on) in the first
    # iteration; then nothing. A width that is a multiple of 8 where the pass's first was not, or the reverse,
    # would add a graph to that pass
    assert len(counting.graphs) == 2
    for iteration in range(4):
        trainer.iteration(iteration)
        assert len(counting.graphs) == 3, f"{len(counting.graphs)} graphs by the end of iteration {iteration}"
    assert len(set(widths)) >= 3  # micro-batches of several widths went through the layers
    torch._dynamo.reset()
