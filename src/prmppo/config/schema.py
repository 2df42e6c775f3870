"""Typed schemas behind every YAML file in `conf/`.

Each config group has a dataclass here (the stages' settings, `ppo`, `sft`, `eval`, `prm_train`,
`band`, `canary`, in `config/stage_schema.py`), registered in Hydra's ConfigStore (`config/store.py`) as
`<group>_<option>_schema` (outside any group, so `--help` lists only the real options); the YAML
option files start from it (`defaults: [/<group>_<option>_schema@_here_]`).
So an unknown key or a value of the wrong type fails when Hydra composes the config, before
any code runs. Every key has its default here; code reads attributes, never `.get(k, default)`.

Cross-field rules (divisibility, ranges that involve two keys) live in `config/validate.py`.
Plain dataclasses, no Hydra: components read their keyword defaults from these classes, so the
schema stays the one home of each default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from prmppo.config.stage_schema import BandConfig, CanaryConfig, EvalConfig, PPOConfig, PRMTrainConfig, SFTConfig

# --------------------------------------------------------------------------- stage


@dataclass
class StageConfig:
    # which stage `run(cfg)` executes: sft | prm | band | ppo | eval | pipeline
    name: str = "pipeline"


# --------------------------------------------------------------------------- task


@dataclass
class ChainDistribution:
    min_operands: int = 2
    max_operands: int = 4
    min_value: int = 0
    max_value: int = 30
    operators: list[str] = field(default_factory=lambda: ["+", "-"])


@dataclass
class TaskConfig:
    _target_: str = MISSING
    step_delimiter: str = "\n"


@dataclass
class ArithTaskConfig(TaskConfig):
    _target_: str = "prmppo.tasks.arith.ArithTask"
    seed: int = 0
    sft: ChainDistribution = field(default_factory=lambda: ChainDistribution(2, 5))
    rl: ChainDistribution = field(default_factory=lambda: ChainDistribution(3, 5))
    sft_size: int = 20000
    train_size: int = 20000
    test_size: int = 200
    # a systematic error in the SFT worked solutions only (RL prompts, the verifier, the step checker and
    # PRM labels stay true): none | carry (an addition step whose units digits carry is written without
    # the carry, result - 10, and the solution goes on from the written value; tasks/arith.py)
    sft_flaw: str = "none"
    # carry only: probability that a carrying step of an SFT solution is written flawed, drawn per step
    # from a stream seeded per solution; in [0, 1], and 0 with sft_flaw=none
    sft_flaw_rate: float = 0.0


@dataclass
class GSM8KTaskConfig(TaskConfig):
    _target_: str = "prmppo.tasks.gsm8k.GSM8KTask"
    data_dir: str = MISSING
    train_file: str = "train.jsonl"
    test_file: str = "test.jsonl"
    test_size: Optional[int] = None


@dataclass
class JsonlTaskConfig(TaskConfig):
    _target_: str = "prmppo.tasks.jsonl.JsonlTask"
    # JSONL (.jsonl/.json) or Parquet (.parquet/.pq) files of problems; relative paths are taken from the
    # launch directory (conf/task/jsonl.yaml)
    train_path: str = MISSING
    test_path: str = MISSING
    # the rows SFT trains on (each needs a gold solution); null = the train file
    sft_path: Optional[str] = None
    # dotted paths into a row; the defaults read verl's layout
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    solution_key: str = "extra_info.answer"
    # answer comparison: math_verify (symbolic, LaTeX) | numeric (plain numbers) | exact (strings)
    checker: str = "math_verify"
    # a row without a field or with an unparsable ground truth: refuse (name file and line) | skip (count it)
    bad_rows: str = "refuse"
    # score only the first N test rows (null = all)
    test_size: Optional[int] = None
    # plain prompts (no chat template): the messages' contents, joined by a blank line, replace {prompt}
    prompt_template: str = "{prompt}\n"
    # set from the model group by conf/task/jsonl.yaml (model.chat_template, model.system_prompt,
    # model.path): the prompt is rendered with that model's tokenizer
    chat_template: str = "false"
    system_prompt: Optional[str] = None
    tokenizer_path: Optional[str] = None


# --------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    _target_: str = MISSING
    # dtype the trainer holds weights in: float32 | bfloat16 | float16
    dtype: str = "float32"


@dataclass
class TinyModelConfig(ModelConfig):
    _target_: str = "prmppo.models.tiny.TinyModelSource"
    hidden_size: int = 96
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    # grouped-query attention: must divide num_attention_heads
    num_key_value_heads: int = 2
    # tokens: prompt + response must fit
    max_position_embeddings: int = 256
    seed: int = 0
    # tokenizer built for the task (models/tiny.py): char (one token per character of the task's
    # alphabet) | bpe (byte-level BPE trained on the task's SFT texts) | auto (char when every SFT
    # example fits max_position_embeddings as characters, else bpe; debug=smoke uses it)
    tokenizer: str = "char"
    # bpe only: vocabulary size in tokens, the 4 special tokens and 256 bytes included; > 260
    bpe_vocab_size: int = 1024


@dataclass
class HFModelConfig(ModelConfig):
    _target_: str = "prmppo.models.loading.HFDirSource"
    # local Hugging Face-layout directory (config.json, tokenizer files, *.safetensors)
    path: str = MISSING
    # a real checkpoint is trained in bfloat16 (half the memory of float32, the range of float32)
    dtype: str = "bfloat16"
    # task=jsonl prompts through the tokenizer's chat template: auto (when it has one) | true (refuse a
    # tokenizer without one) | false (plain text)
    chat_template: str = "auto"
    # task=jsonl: a system message put before every prompt's messages (null: none)
    system_prompt: Optional[str] = None


# --------------------------------------------------------------------------- arm / reward


@dataclass
class ArmConfig:
    # the arm's name, recorded in the banner and used to group runs; the arm's behaviour is
    # entirely the reward group it selects
    name: str = MISSING


@dataclass
class RewardConfig:
    _target_: str = MISSING
    # outcome reward for a verified-correct / incorrect response (placed on the last token)
    correct_reward: float = 1.0
    wrong_reward: float = 0.0
    w_outcome: float = 1.0
    # threshold of the PRM's `clip` transform, min(s - eta, 0). Every reward has the key so one
    # sweep can cross `arm=prm,orm` with `reward.eta=...`; only a step-level reward with
    # transform=clip reads it (see `config.validate.inert_keys`; reports do not split groups on it)
    eta: float = 1.0


@dataclass
class OutcomeRewardConfig(RewardConfig):
    _target_: str = "prmppo.rewards.orm.OutcomeReward"


@dataclass
class ProcessRewardConfig(RewardConfig):
    _target_: str = "prmppo.rewards.prm.ProcessReward"
    # plain | centered | log | clip | delta | min_form
    transform: str = "plain"
    w_prm: float = 1.0
    # softmax temperature of `min_form`
    min_form_temperature: float = 0.1
    # probability of flipping a step score (s -> 1 - s), to study reward hacking; in [0, 1]
    label_noise: float = 0.0
    # step scores come from: learned (the trained PRM) | oracle (the task's exact step checker) |
    # likelihood_control (no PRM: the untrained step_logprobs rule of the SFT model, adapters off)
    scorer: str = "learned"


@dataclass
class ExternalProcessRewardConfig(ProcessRewardConfig):
    _target_: str = "prmppo.rewards.prm_external.ExternalProcessReward"
    # step scores from an off-the-shelf PRM checkpoint (models/external_prm.py), no PRM stage
    scorer: str = "external"
    # local HF-layout directory of the PRM (its own tokenizer)
    path: str = MISSING
    # its step format: math_shepherd (a `ки` tag after each step, read as `+` vs `-`) | qwen_prm (steps
    # joined by `<extra_0>` in its chat template, a two-class head read at each)
    format: str = "math_shepherd"
    # where the PRM runs: "" = the trainer's device, or e.g. cuda:1
    device: str = ""
    dtype: str = "bfloat16"
    # PRM inputs per forward
    micro_batch_rows: int = 8


# --------------------------------------------------------------------------- lora


@dataclass
class LoraConfig:
    _target_: str = MISSING


@dataclass
class LoraAdapterConfig(LoraConfig):
    _target_: str = "prmppo.models.policy.LoraPolicy"
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    init_seed: int = 0
    # base modules the `policy` adapter trains in full (peft modules_to_save), by name suffix,
    # e.g. ["model.norm"]: the final norm scales every logit, i.e. the policy's own temperature
    modules_to_save: list[str] = field(default_factory=list)
    # peak learning rate of those modules (same warmup-cosine shape); null = ppo.lr
    modules_to_save_lr: Optional[float] = None


@dataclass
class FullFinetuneConfig(LoraConfig):
    _target_: str = "prmppo.models.policy.FullPolicy"


# --------------------------------------------------------------------------- rollout


@dataclass
class RolloutConfig:
    # the client of the worker process that runs the engine (`rollout/client.py`)
    _target_: str = "prmppo.rollout.client.rollout_client"
    # engine run by the worker process: hf (built-in) | vllm; inprocess: rollout=inprocess (no worker)
    engine: str = "hf"
    # interpreter that runs the worker; "" means the trainer's own interpreter
    python: str = ""
    # weight sync: checkpoint (merged HF dir) | adapter (LoRA adapter only) | shared (merged weights in
    # memory the built-in engine maps: a CUDA IPC handle or a /dev/shm file; rollout=hf only) | none
    # (rollout=inprocess only: the engine samples with the trainer's own weights)
    sync: str = "checkpoint"
    # the engine gets new weights every this many PPO iterations (1 = on-policy)
    sync_every_iterations: int = 1
    # seconds
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 1800.0
    heartbeat_timeout_s: float = 60.0
    # vllm only: fraction of device memory (of RAM on CPU) the engine may reserve, in (0, 1]
    gpu_memory_utilization: float = 0.3
    # hf and inprocess: decode loop. static (pre-allocated KV cache, finished rows dropped in buckets, CUDA
    # graphs on CUDA) | static_eager (the same without CUDA graphs) | dynamic (the model's own growing
    # cache, every row fed until all are done: the fallback); rollout/hf_engine.py
    decode: str = "static"
    # hf and inprocess: true: in each decode step of the static loop (decode=static or static_eager, batches
    # of 2 rows or more) every decoder layer runs one torch.compile graph, a layer's, shared by all layers,
    # its batch and slot count dynamic, so that inductor fuses each layer's norms, rotary embedding,
    # activation and residual adds: fewer kernels per step where a small model's step is launch-bound
    # (rollout/compiled_decode.py; dynamo traces one layer at start-up, not the model). It compiles in the first request
    # (the engine-gap gate); under rollout=inprocess with ppo.compile=true, `ppo.compile_cache` keeps it
    # with the artifacts (a worker compiles from its machine's own caches). Llama, Mistral and Qwen2 layers run
    # q/k/v and gate/up as one matmul each, over stacked copies of those weights held as long as the static
    # decoder (between requests too in the worker; in-process, while a request runs): 0.47 GB at Qwen2-0.5B.
    # false: the step runs eager
    compile_decode: bool = False
    # hf only: `python -m prmppo stage=ppo` starts the worker process as soon as the config is composed,
    # so that its imports (torch, transformers, peft, the model's module) run beside the trainer's;
    # the run hands it its arguments when it launches the engine (rollout/standby.py)
    standby: bool = True


@dataclass
class InProcessRolloutConfig(RolloutConfig):
    # the engine in the trainer's process, sampling with the trainer's own policy model: no worker, no
    # second copy of the weights (`rollout/inprocess.py`); of the keys above it reads `decode` and
    # `compile_decode` only; merge_adapter is its own
    _target_: str = "prmppo.rollout.inprocess.InProcessEngine"
    engine: str = "inprocess"
    # none: the engine sees the trainer's weights as they are (nothing to ship); it must be, with
    # sync_every_iterations 1
    sync: str = "none"
    # LoRA: true samples each request with W + scale * B A swapped in for every adapted base weight (a
    # transient copy, freed before the update) and the LoRA branches off: one matmul per linear on every
    # decode step instead of three. On an H100 at 0.5B generation took 1.46 s instead of 1.99; at the 7B
    # shape on an H200 the copy raised the run's peak to 34.8 GiB (benchmarks/RESULTS.md). false (the
    # default: this engine is for runs the weights' memory limits): the branches run as they are, no copy
    merge_adapter: bool = False


# --------------------------------------------------------------------------- topology


@dataclass
class TopologyConfig:
    name: str = "cpu"
    # device of the trainer (rank-local index appended for fsdp): cpu | cuda
    train_device: str = "cpu"
    # device of the rollout engine: cpu | cuda:N
    engine_device: str = "cpu"
    # number of training ranks (torchrun processes); 1 unless name=fsdp
    train_world_size: int = 1
    # engine shares the training GPU (fsdp only)
    colocated: bool = False
    # PyTorch's CUDA caching-allocator settings for the trainer and the rollout worker, put in
    # PYTORCH_CUDA_ALLOC_CONF before CUDA starts unless that variable is already set (the user's value
    # wins); "" leaves the allocator's defaults. Expandable segments keep the memory of micro-batches of
    # varying widths from fragmenting into ever new cached blocks (benchmarks/RESULTS.md); no effect on CPU
    cuda_alloc_conf: str = "expandable_segments:True"


# --------------------------------------------------------------------------- logger


@dataclass
class LoggerConfig:
    # metrics.jsonl is always written; these add outputs on top
    # progress bars (only on an interactive terminal) and one summary line per PPO iteration
    console: bool = True
    wandb: bool = False
    wandb_project: str = "prmppo"
    wandb_entity: Optional[str] = None
    # W&B mode: auto (online when an API key is configured: WANDB_API_KEY or a netrc entry from
    # `wandb login`; else offline) | offline | online (needs a key)
    mode: str = "auto"


# --------------------------------------------------------------------------- root


@dataclass
class RootConfig:
    stage: StageConfig = MISSING
    task: TaskConfig = MISSING
    model: ModelConfig = MISSING
    arm: ArmConfig = MISSING
    reward: RewardConfig = MISSING
    lora: LoraConfig = MISSING
    rollout: RolloutConfig = MISSING
    topology: TopologyConfig = MISSING
    ppo: PPOConfig = MISSING
    logger: LoggerConfig = MISSING
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    prm_train: PRMTrainConfig = field(default_factory=PRMTrainConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    band: BandConfig = field(default_factory=BandConfig)
    # experiment name: groups runs in W&B and in reports
    experiment_name: str = "default"
    seed: int = 0
    # where reusable stage artifacts (SFT checkpoint, PRM adapter, band file) are kept,
    # keyed by the config that made them; relative to the launch directory
    artifacts_dir: str = "artifacts"
    # this run's output directory (Hydra's job directory)
    run_dir: str = "${hydra:runtime.output_dir}"
    # max seconds of wall time before a coordinated stop; 0 = unlimited
    max_wall_seconds: float = 0.0
    # the number `python -m prmppo` returns to a Hydra sweeper (e.g. Optuna): a dotted path into the
    # stage's summary (stage_result.json); a run without it (or a failed run) returns nan
    objective: str = "eval.ppo.greedy_accuracy"


SCHEMAS: dict[str, dict[str, type]] = {
    "stage": {"stage": StageConfig},
    "task": {"arith": ArithTaskConfig, "gsm8k": GSM8KTaskConfig, "jsonl": JsonlTaskConfig},
    "model": {"tiny": TinyModelConfig, "hf": HFModelConfig},
    "arm": {"arm": ArmConfig},
    "reward": {"orm": OutcomeRewardConfig, "prm": ProcessRewardConfig, "prm_external": ExternalProcessRewardConfig},
    "lora": {"adapter": LoraAdapterConfig, "none": FullFinetuneConfig},
    "rollout": {"rollout": RolloutConfig, "inprocess": InProcessRolloutConfig},
    "topology": {"topology": TopologyConfig},
    "ppo": {"ppo": PPOConfig},
    "logger": {"logger": LoggerConfig},
}

