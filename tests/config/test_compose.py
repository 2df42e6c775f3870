"""Every shipped config option composes and validates; schemas reject typos and wrong types."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import REPO, compose_config
from prmppo.config.build import check_targets
from prmppo.validate import ConfigError, validate_config

# groups a user picks (debug_model is picked by conf/config.yaml from the debug and model choices)
GROUPS = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "debug_model")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


def test_every_group_is_present():
    assert set(GROUPS) >= {"stage", "task", "model", "arm", "reward", "lora", "rollout", "topology",
                           "ppo", "logger", "experiment", "debug"}


# options whose config exists ahead of their code: they compose, and refuse to run with a sentence
NOT_YET: set[tuple[str, str]] = set()
# options that run only with other choices (none now: several training ranks run the default pipeline too)
ALONGSIDE: dict[tuple[str, str], list[str]] = {}
# options that leave a key without a default (`???`) for the user to give
NEEDS = {("model", "hf"): ["model.path=/nonexistent/checkpoint"],
         ("experiment", "math_shepherd_gsm8k"): ["model.path=/nonexistent/checkpoint"],
         ("task", "jsonl"): ["task.train_path=/nonexistent/train.jsonl", "task.test_path=/nonexistent/test.parquet"],
         ("reward", "prm_external"): ["reward.path=/nonexistent/prm"]}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}", *ALONGSIDE.get((group, option), [])]
    if (group, option) in NEEDS:
        overrides += NEEDS[(group, option)]  # the path itself is only checked when used
    cfg = compose_config(overrides)
    OmegaConf.to_container(cfg, resolve=False, throw_on_missing=True)
    check_targets(cfg)
    if (group, option) in NOT_YET:
        with pytest.raises(ConfigError, match="not available yet"):
            validate_config(cfg)
    else:
        validate_config(cfg)


def test_debug_smoke_composes_with_either_model_source():
    tiny = compose_config(["debug=smoke"])
    assert (tiny.model.hidden_size, tiny.model.num_hidden_layers, tiny.ppo.iterations) == (32, 2, 2)
    hf = compose_config(["debug=smoke", "model=hf", "model.path=/nonexistent/checkpoint"])
    assert set(hf.model) == {"_target_", "path", "dtype", "chat_template", "system_prompt"} and hf.ppo.iterations == 2
    validate_config(hf)
    # the command line still wins over the smoke shape
    assert compose_config(["debug=smoke", "model.hidden_size=48"]).model.hidden_size == 48


@pytest.mark.parametrize("arm", ["orm", "prm"])
@pytest.mark.parametrize("topology", ["cpu", "gpu", "fsdp"])
@pytest.mark.parametrize("experiment", ["prm_vs_orm_arith", "math_shepherd_gsm8k"])
def test_arm_topology_experiment_grid(arm, topology, experiment):
    extra = [*NEEDS.get(("experiment", experiment), [])]
    extra += ALONGSIDE.get(("topology", topology), [])
    cfg = compose_config([f"arm={arm}", f"topology={topology}", f"experiment={experiment}", *extra])
    assert cfg.arm.name == arm
    if ("topology", topology) in NOT_YET:
        with pytest.raises(ConfigError, match="not available yet"):
            validate_config(cfg)
    else:
        validate_config(cfg)


def test_arms_differ_only_in_reward_and_name():
    orm = OmegaConf.to_container(compose_config(["arm=orm"]), resolve=False)
    prm = OmegaConf.to_container(compose_config(["arm=prm"]), resolve=False)
    differing = {key for key in orm if orm[key] != prm[key]}
    assert differing == {"arm", "reward"}


def test_arm_picks_reward_and_command_line_wins():
    assert compose_config(["arm=prm"]).reward._target_.endswith("ProcessReward")
    assert compose_config(["arm=orm"]).reward._target_.endswith("OutcomeReward")
    assert compose_config(["arm=prm", "reward=prm_oracle"]).reward.scorer == "oracle"
    assert compose_config(["arm=prm", "reward=prm_likelihood_control"]).reward.scorer == "likelihood_control"


@pytest.mark.parametrize("override,fragment", [
    ("task.operand_count=3", "operand_count"),   # unknown key in a group
    ("ppo.lr=fast", "ppo.lr"),                  # wrong type
    ("ppo.minibatch_rowz=4", "minibatch_rowz"),  # typo
    ("seed=zero", "seed"),
])
def test_schema_rejects_at_compose_time(override, fragment):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config([override])
    assert fragment in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("overrides,fragments", [
    (["ppo.minibatch_rows=48"], ["ppo.minibatch_rows=48", "32 * 4 = 128", "128 % 48 = 32"]),
    (["ppo.micro_batch_rows=24"], ["ppo.micro_batch_rows=24", "64 % 24 = 16"]),
    (["ppo.clip_c=0.5"], ["ppo.clip_c=0.5", "> 1"]),
    (["ppo.kl_estimator=k4"], ["ppo.kl_estimator='k4'", "k1, k2, k3"]),
    (["task.rl.min_operands=7"], ["task.rl.min_operands=7", "task.rl.max_operands=5"]),
    (["stage=sft", "sft.warmup_steps=5000"], ["sft.warmup_steps=5000", "sft.steps=1000"]),
    (["lora=none", "rollout.sync=adapter"], ["rollout.sync=adapter", "lora=none"]),
    (["rollout=vllm", "ppo.top_p=0.9"], ["rollout=vllm with ppo.top_p=0.9", "ppo.top_p=1.0 or rollout=hf"]),
    (["rollout=vllm", "rollout.sync=adapter"], ["lora.modules_to_save=['model.norm'] with rollout=vllm",
                                                 "rollout.sync=checkpoint or lora.modules_to_save=[]"]),
    (["rollout=vllm", "rollout.sync=shared"], ["rollout=vllm with rollout.sync=shared", "rollout=hf"]),
    (["rollout.sync=file"], ["rollout.sync='file'", "checkpoint, adapter, shared, none"]),
    # the in-process engine reads the trainer's weights: no sync, no lag, one process
    (["rollout=inprocess", "rollout.sync=checkpoint"], ["rollout=inprocess with rollout.sync=checkpoint",
                                                        "rollout.sync=none"]),
    (["rollout=inprocess", "rollout.sync_every_iterations=2"], ["rollout.sync_every_iterations=2", "use 1"]),
    (["rollout=inprocess", "rollout.decode=dynamic", "rollout.compile_decode=true"],
     ["rollout.compile_decode=true with rollout.decode=dynamic", "static or static_eager"]),
    (["rollout.decode=dynamic", "rollout.compile_decode=true"], ["rollout.compile_decode=true with rollout.decode"]),
    (["rollout=inprocess", "topology=fsdp", "stage=ppo"], ["rollout=inprocess with topology=fsdp", "rollout=hf"]),
    (["rollout.sync=none"], ["rollout.sync=none with rollout=hf", "rollout=inprocess"]),
    (["rollout.engine=inprocess"], ["rollout.engine=inprocess under a worker's rollout config",
                                    "rollout=inprocess"]),
    (["rollout=inprocess", "rollout.engine=hf"], ["rollout=inprocess with rollout.engine=hf", "rollout=hf"]),
    (["lora.modules_to_save_lr=0"], ["lora.modules_to_save_lr=0", "> 0"]),
    (["rollout.decode=fast"], ["rollout.decode='fast'", "static_eager"]),
    (["rollout=vllm", "rollout.gpu_memory_utilization=1.5"], ["rollout.gpu_memory_utilization=1.5", "(0, 1]"]),
    (["arm=prm", "reward.transform=cube"], ["reward.transform='cube'", "min_form"]),
    (["ppo.max_engine_logprob_gap=0"], ["ppo.max_engine_logprob_gap=0", "> 0"]),
    (["ppo.max_first_ratio_dev=-1"], ["ppo.max_first_ratio_dev=-1", "> 0"]),
    (["ppo.max_consecutive_skipped_steps=0"], ["ppo.max_consecutive_skipped_steps=0", "> 0"]),
    (["ppo.max_skipped_fraction=1.5"], ["ppo.max_skipped_fraction=1.5", "[0, 1]"]),
    (["canary.every=-1"], ["canary.every=-1", ">= 0"]),
    (["canary.max_drop=2"], ["canary.max_drop=2", "[0, 1]"]),
    (["ppo.advantage_estimator=vtrace"], ["ppo.advantage_estimator='vtrace'", "gae, rloo, grpo"]),
    (["ppo.advantage_estimator=rloo", "ppo.n_samples_per_prompt=1", "ppo.minibatch_rows=32"],
     ["ppo.advantage_estimator=rloo", "ppo.n_samples_per_prompt >= 2"]),
    # k1's gradient on the policy's own samples is zero in expectation: a KL loss that does nothing
    (["ppo.kl_loss_coef=0.1", "ppo.kl_loss_estimator=k1"], ["ppo.kl_loss_estimator=k1", "use k2 or k3"]),
    (["ppo.kl_loss_coef=-1"], ["ppo.kl_loss_coef=-1", ">= 0"]),
    (["ppo.autocast=float16"], ["ppo.autocast='float16'", "none, bfloat16"]),
    (["ppo.logit_chunk_tokens=0"], ["ppo.logit_chunk_tokens=0", "> 0"]),
    (["ppo.micro_batch_tokens=-5"], ["ppo.micro_batch_tokens=-5", "> 0"]),
    (["ppo.advantage_estimator=rloo", "ppo.value_warmup_iterations=2"],
     ["ppo.value_warmup_iterations=2 warms up a critic", "uses none"]),
    # choice keys: the valid values are the implementing module's table (stages, model loading, rollout worker,
    # PRM heads, the arith chains)
    (["stage.name=train"], ["stage.name='train'", "sft, prm, band, ppo, eval, pipeline"]),
    (["model.dtype=int8"], ["model.dtype='int8'", "float32, bfloat16, float16"]),
    (["rollout.engine=sglang"], ["rollout.engine='sglang'", "hf, vllm, inprocess"]),
    (["prm_train.head=bogus"], ["prm_train.head='bogus'", "mode_gap, log_ratio, classifier"]),
    (["task.rl.operators=['/']"], ["task.rl.operators=['/'] must be a non-empty subset of ['+', '-', '*']"]),
])

def test_cross_field_rejections_name_keys_and_arithmetic(overrides, fragments):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_kl_in_the_reward_and_a_kl_loss_together_are_accepted():
    validate_config(compose_config(["ppo.kl_coef=0.01", "ppo.kl_loss_coef=0.01", "ppo.kl_loss_estimator=k3"]))


def test_schema_alone_holds_the_ppo_defaults():
    # conf/ppo/default.yaml restates nothing: a config built from the schema runs the same algorithm
    from prmppo.config.schema import PPOConfig

    composed = compose_config([]).ppo
    assert {key: composed[key] for key in composed} == vars(PPOConfig())


def test_target_outside_allowed_packages_is_refused():
    cfg = compose_config(["task._target_=os.system"])
    with pytest.raises(ConfigError, match="task._target_='os.system'"):
        check_targets(cfg)


def test_conf_dir_is_the_one_the_app_uses():
    import prmppo.__main__ as entry

    assert Path(entry.CONF_DIR) == REPO / "conf"


def test_a_key_without_default_is_refused_by_name_before_any_work():
    cfg = compose_config(["experiment=math_shepherd_gsm8k"])
    with pytest.raises(ConfigError, match=r"model.path is not set: a local Hugging Face-layout checkpoint"):
        validate_config(cfg)


def test_math_shepherd_experiment_passes_its_gates_up_to_the_checkpoint(tmp_path):
    """With a placeholder checkpoint path (and the CPU in place of the GPU), config validation, the
    verifier receipt on GSM8K and the step-scorer gate pass; the first refusal is the checkpoint dir."""
    from prmppo.app import run
    from prmppo.models.loading import ModelDirError

    data_dir = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"  # beside the repository
    if not (data_dir / "test.jsonl").is_file():
        pytest.skip(f"no GSM8K data at {data_dir}")
    cfg = compose_config(["experiment=math_shepherd_gsm8k", "arm=prm", "topology=cpu", "model.path=/nonexistent/ckpt",
                          f"task.data_dir={data_dir}", f"artifacts_dir={tmp_path / 'artifacts'}"], run_dir=tmp_path / "run")
    assert cfg.ppo.kl_coef == 0.04 and cfg.prm_train.label_source == "monte_carlo"
    with pytest.raises(ModelDirError, match=r"/nonexistent/ckpt does not exist \(model.path"):
        run(cfg)


def test_default_prm_and_ppo_length_are_the_12_minute_ones():
    cfg = compose_config()
    assert (cfg.prm_train.head, cfg.prm_train.steps, cfg.prm_train.train_problems) == ("mode_gap", 200, 3000)
    assert cfg.ppo.iterations == 100


@pytest.mark.parametrize("experiment,prm_steps", [("prm_vs_orm_arith", 3000), ("prm_vs_orm_sparse", 3000),
                                                  ("prm_hacking", 300)])
def test_recorded_experiments_keep_the_prm_and_ppo_they_were_measured_with(experiment, prm_steps):
    cfg = compose_config([f"experiment={experiment}"])
    assert (cfg.prm_train.head, cfg.prm_train.steps, cfg.prm_train.train_problems) == ("classifier", prm_steps, 10000)
    assert cfg.ppo.iterations == 200
    shipped = (REPO / "experiments/band_vs_all/run.sh").read_text()
    for override in ("prm_train.head=classifier", "prm_train.steps=3000", "prm_train.train_problems=10000",
                     "ppo.iterations=200"):
        assert override in shipped
