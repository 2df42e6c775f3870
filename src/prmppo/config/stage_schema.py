"""Typed schemas of the stages' settings: `ppo`, `sft`, `eval`, `prm_train`, `band`, `canary`.

The numbers each stage trains, measures and checks with, every one with its default, unit and
range in a comment; `config/schema.py` puts them under the root config beside the component
groups (task, model, reward, lora, rollout) and registers the group schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


# --------------------------------------------------------------------------- ppo


@dataclass
class PPOConfig:
    iterations: int = 100
    # rollout shape: responses per iteration = prompts_per_iteration * n_samples_per_prompt
    prompts_per_iteration: int = 32
    n_samples_per_prompt: int = 4
    # rows (responses) per optimizer step; must divide prompts_per_iteration * n_samples_per_prompt
    minibatch_rows: int = 64
    # rows per forward/backward pass (gradient accumulation); must divide minibatch_rows. Rows are
    # grouped by length and each micro-batch is cut to its longest row (ppo/batch.py), which changes
    # no loss: the losses divide by minibatch counts
    micro_batch_rows: int = 32
    # tokens (rows x the micro-batch's trimmed width) per forward/backward pass, or null: with a value,
    # micro-batches are sized by memory rather than by rows (short rows share one, a long row may run
    # alone), micro_batch_rows staying the cap on rows; the maths is the same either way; > 0
    micro_batch_tokens: Optional[int] = None
    # response tokens per LM-head chunk when computing logprobs/entropies from the hidden states
    # (models/token_scores.py): bounds the float32 logits alive at once to chunk x vocabulary; >= 1
    logit_chunk_tokens: int = 2048
    # none | bfloat16: bf16 autocast of the trainer's forwards (matmuls in bf16, the weights stay in
    # model.dtype). With model.dtype=float32 the fp32 weights are their own master copy (the GPU
    # recipe: fp32 master weights, bf16 compute); with model.dtype=bfloat16 the forwards already run in
    # bf16 and fp32 masters are kept beside the weights (prmppo/optim.py; LoRA factors included, which stay
    # in model.dtype), so autocast changes little.
    # Logprobs, entropies, the losses and the critic stay fp32 either way. Meant for CUDA (on CPU it runs, slowly)
    autocast: str = "none"
    # recompute each decoder layer's activations in backward (transformers' checkpointing): less
    # memory for ~1/3 more update compute; works with LoRA and with full fine-tuning
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer of the policy in place (inductor fuses its norms, activations and
    # LoRA branches; embeddings, LM-head chunks and losses stay eager), with dynamic shapes. The first
    # forwards pay the compilation; meant for CUDA. The old logprobs then run through the update's own
    # (grad-mode) graph, so the first minibatch's ratio stays 1 (ppo/first_minibatch_ratio_dev). One graph
    # per pass kind (policy, reference, PRM scoring), compiled in the start-up gate or the first iteration;
    # every sequence width is then padded to a multiple of 8 (inductor guards each graph on it; masked
    # columns, no loss changes); a micro-batch of one row (a row alone over ppo.micro_batch_tokens, or
    # ppo.micro_batch_rows=1) compiles its own once. Works under topology=fsdp too. With
    # gradient_checkpointing the checkpoint wraps each layer's compiled forward from outside
    # (models/compiled_checkpoint.py), so the update's graph is one the compile cache keeps.
    # `python benchmarks/compile_trace.py <overrides>` lists the graphs a run compiles
    compile: bool = False
    # with compile: keep the compiled graphs in <artifacts_dir>/compile_cache/, keyed by what decides them
    # (torch and device, model config and dtype, adapters, autocast, checkpointing, ranks), loaded before the
    # first compiled forward and saved after the first iteration, so that a later run of the same shapes,
    # on this machine or on another given the artifacts dir, starts without a cold compile. Changes no
    # number (models/compile_cache.py); false: every run compiles from this machine's own caches
    compile_cache: bool = True
    ppo_epochs: int = 1
    # tokens
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    # policy learning rate: the peak of warmup-cosine over policy optimizer steps
    lr: float = 1e-4
    # critic learning rate (gae only); the critic learns normalised returns (models/policy.py ValueHead)
    value_lr: float = 1e-3
    # policy optimizer steps of linear warmup
    warmup_steps: int = 2
    # final LR as a fraction of `lr`, in [0, 1]
    min_lr_ratio: float = 0.1
    # max gradient norm, applied to the policy's and the critic's gradients separately
    grad_clip: float = 1.0
    gamma: float = 1.0
    # GAE lambdas (gae only): advantages use lam_actor, value targets use lam_critic
    lam_actor: float = 1.0
    lam_critic: float = 1.0
    # gae (a critic with decoupled-lambda GAE) | rloo | grpo (critic-free: each reward term compared
    # step with step against the prompt's other samples, ppo/estimators.py group_baseline_advantages).
    # rloo: exact per-prompt baseline for both arms; for an outcome-only reward it is plain RLOO
    advantage_estimator: str = "rloo"
    # gae: centre and scale the batch's task advantages; rloo/grpo: scale only (they are centred per
    # prompt). The KL pull (kl_coef) is added after, unscaled, so its weight is the same in every arm
    # (ppo/advantages.py; logged as kl/effective_coef)
    whiten_advantages: bool = True
    # grpo only: the group std is at least this (reward units, >= 0), so step scores that differ by
    # numerical jitter between identical samples do not become full-size advantages. A group of 0/1
    # outcomes with one right and one wrong sample has std >= 1/sqrt(n) (0.5 at n=4), untouched by 0.1
    group_std_floor: float = 0.1
    # grpo only: a group whose samples pay a reward term at the same tokens with values within this of
    # each other (identical samples, PRM scores differing by numerical jitter) gets no advantage from
    # that term (reward units, >= 0; 0 turns it off). With the floor alone, identical samples still
    # carried 6.8% of grpo's advantage mass at a final policy with 72% identical groups
    # (scripts/grpo_identical_groups.py)
    group_same_tol: float = 0.01
    # DAPO's dynamic filtering, without the resampling: a prompt whose samples the verifier scores all
    # right or all wrong is dropped from the update (its rows masked out of every loss and its
    # denominators; counted as ppo/dropped_groups). Reads the outcome, not the reward, so both arms
    # drop the same groups; needs n_samples_per_prompt >= 2
    drop_uniform_groups: bool = False
    # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_low: float = 0.2
    clip_high: float = 0.2
    # dual-clip constant (> 1) or null for none
    clip_c: Optional[float] = None
    # value clip range around the old value, in normalised return units, or null for none
    value_clip: Optional[float] = 0.2
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    loss_agg: str = "token_mean"
    # KL to the reference in the reward: -kl_coef * kl_estimator per token (0 turns it off). Its
    # return-to-go joins the advantages after the task advantages are normalised, so kl_coef is the
    # effective weight in both arms (ppo/advantages.py)
    kl_coef: float = 0.01
    # k1 | k2 | k3
    kl_estimator: str = "k1"
    # KL to the reference as a loss term: kl_loss_coef * kl_loss_estimator, aggregated like the
    # policy loss (0 turns it off); k2 | k3 (k1's gradient is zero in expectation)
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    # iterations at the start that train only the critic (gae only)
    value_warmup_iterations: int = 0
    # value head reads hidden states without backpropagating into the backbone
    detach_value_hidden: bool = True
    # checkpoints kept (newest and pinned ones are never pruned)
    keep_checkpoints: int = 2
    # ratio tripwire (alarms, see guards/tripwires.py): max |ratio - 1| on an iteration's first
    # minibatch, where the policy is unchanged (dimensionless). The old logprobs are computed on the
    # update's own micro-batches (PPOTrainer.plan), so it is exactly 0 in any dtype unless the forward
    # itself is not deterministic; > 0
    max_first_ratio_dev: float = 1e-3
    # max mean |engine - trainer| logprob per response token, in nats (fp32 noise is ~1e-6;
    # a skipped sync after one update is ~1e-2 and more); > 0. The limit in force is the larger
    # of this and 3x the gap measured at launch with identical weights (banner.json gates.ratio_tripwire)
    max_engine_logprob_gap: float = 1e-2
    # abort when more optimizer steps than this in a row have a non-finite gradient; >= 1
    max_consecutive_skipped_steps: int = 3
    # abort when more than this fraction of the run's planned optimizer steps are skipped
    # for a non-finite gradient; in [0, 1]
    max_skipped_fraction: float = 0.1


# --------------------------------------------------------------------------- sft / eval


@dataclass
class SFTConfig:
    # optimizer steps; 0 accepts the model as it is (e.g. an existing HF checkpoint)
    steps: int = 1000
    # sequences per optimizer step
    batch_rows: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # test problems scored at the end (greedy); 0 skips the evaluation
    eval_problems: int = 200
    max_new_tokens: int = 64


@dataclass
class EvalConfig:
    # checkpoint to evaluate; "" = the pipeline's newest artifact
    checkpoint: str = ""
    # test problems scored (capped at the split size)
    n_problems: int = 200
    # samples per prompt at `temperature` for sampled accuracy and pass@k
    k: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 64
    # rows per generation batch
    batch_rows: int = 256
    # test evaluation during PPO (rows `stage: ppo_eval` in metrics.jsonl: `eval/test_greedy_accuracy`,
    # `eval/test_sampled_accuracy`, `eval/test_pass@k` at `eval/ppo_iterations` done): before the first iteration,
    # every this many iterations and after the last; 0 = off
    every: int = 10
    # the first this many `test` problems, the same ones each time; > 0
    during_ppo_problems: int = 64
    # samples per problem at `temperature` for the sampled accuracy and pass@k; 0 = greedy only
    during_ppo_k: int = 4


# --------------------------------------------------------------------------- prm stage


@dataclass
class PRMTrainConfig:
    # where step labels come from: checker (the task's exact step checker) | monte_carlo
    # (Math-Shepherd: completions by the policy from each step prefix)
    label_source: str = "checker"
    # monte_carlo only: hard (1 if any completion reaches the gold answer) | soft (the fraction)
    estimation: str = "hard"
    # mode_gap (an affine map of the gaps log pi_prm(token) - max_v log pi_sft(v) over the step's own
    # tokens: the implicit PRM's log-ratio plus the SFT model's margin to its greedy token, so the SFT
    # model's confidence in a greedy token never enters) | log_ratio (the log-ratio alone, the implicit
    # PRM; too slow for the default budget) | classifier (linear on the step-end hidden state) |
    # label_tokens (LM's p(good) vs p(bad)) | step_logprobs (a likelihood score: the lowest, mean and last
    # logprob of the step's tokens under the PRM-adapted LM, starting as the SFT model's own; its scores
    # largely restate the SFT model's confidence); models/prm_heads.py. On the default task mode_gap and
    # step_logprobs reach held-out step accuracy 0.97 in 200 steps, where the classifier needs about 3000
    head: str = "mode_gap"
    # label_tokens only: single-token strings of the tokenizer for a right / wrong step
    good_token: str = "+"
    bad_token: str = "-"
    # LoRA rank and alpha of the `prm` adapter
    r: int = 8
    alpha: int = 16
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # optimizer steps (AdamW, warmup then cosine), responses per step, peak learning rate. With the
    # classifier head the tiny PRM sits on a plateau (every step "right") until it learns to check
    # arithmetic: on the default task 3000 x 256 leaves it (held-out step accuracy 0.97-0.98), 1000 x
    # 256 only partly (0.89-0.93) and 300 x 256 not at all (0.77). The mode_gap and step_logprobs heads
    # start off the plateau: 200 x 256 gives 0.97 on the default seed (benchmarks/RESULTS.md)
    steps: int = 200
    batch_rows: int = 256
    lr: float = 3e-3
    warmup_steps: int = 30
    # weight of a wrong step's loss term relative to a right one's (> 1 counters the majority of
    # right steps in the labels); 1 = plain BCE
    negative_weight: float = 2.0
    # `train` problems labelled; each gives samples_per_problem policy samples + 1 corrupted
    # + 1 gold solution (checker), or samples_per_problem samples (monte_carlo)
    train_problems: int = 3000
    samples_per_problem: int = 4
    # monte_carlo only: completions per step prefix
    mc_completions: int = 4
    # held-out `test` problems for the evaluation (half of their gold solutions corrupted)
    eval_problems: int = 200
    # best-of-N reranking: policy samples per test problem; 0 skips it
    best_of_n: int = 8
    # rows per PRM forward when scoring (PPO rollouts and evaluation): bounds activation memory
    chunk_rows: int = 64
    # tokens per sampled response / completion
    max_new_tokens: int = 96


# --------------------------------------------------------------------------- band stage


@dataclass
class BandConfig:
    # PPO draws its prompts from this config's band artifact (stage=band; the pipeline makes it
    # between PRM and PPO); false = from every train prompt (unless `file` is given)
    enabled: bool = False
    # a band file (JSONL rows as stage=band writes them: problem, passes, k, pass_rate, seed,
    # checkpoint) PPO draws its prompts from; relative to the launch directory; "" = none.
    # Not together with enabled=true
    file: str = ""
    # responses sampled per train prompt to measure its pass rate (passes / k); >= 1
    k: int = 8
    # the band kept: prompts whose pass rate lies in [low, high], 0 <= low <= high <= 1. PRIME's
    # 0.2-0.8: an always-solved prompt gives no signal under a group baseline, a never-solved one
    # none under an outcome reward
    low: float = 0.2
    high: float = 0.8
    # distinct train prompts measured, the first ones of the `train` split: the cap on the band's size
    problems: int = 2000
    # sampling of the measurement: PPO's own by default (temperature > 0, top_p in (0, 1], tokens)
    temperature: float = "${ppo.temperature}"
    top_p: float = "${ppo.top_p}"
    max_new_tokens: int = "${ppo.max_new_tokens}"
    # responses per rollout-worker request (request_rows // k prompts, at least one, a request)
    request_rows: int = 256


# --------------------------------------------------------------------------- canary


@dataclass
class CanaryConfig:
    # PPO iterations between canary checks (greedy accuracy on held-out problems); 0 = off
    every: int = 0
    # the first this many `test` problems, the same ones at every check; > 0
    n_problems: int = 64
    # alarm when greedy accuracy falls more than this (a fraction, in [0, 1]) below the best so far
    max_drop: float = 0.1
