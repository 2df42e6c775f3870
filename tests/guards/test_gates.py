"""Every launch gate passes a sound setup and refuses a broken one with a sentence that says why."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from prmppo.errors import PrmppoError
from prmppo.guards.gates import GateError, check_topology, derive_eos, verifier_receipt
from prmppo.models.loading import load_tokenizer
from prmppo.models.tiny import TinyModelSource
from prmppo.ppo.loop import HorizonError, Shape, check_horizon, count_policy_steps
from prmppo.tasks import ArithTask


@pytest.fixture(scope="module")
def task():
    return ArithTask(sft_size=10, train_size=10, test_size=50)


class _ConstantVerifier(ArithTask):
    """ArithTask whose verifier ignores the response and always answers `verdict`."""

    def __init__(self, verdict: bool):
        super().__init__(sft_size=10, train_size=10, test_size=50)
        self.verdict = verdict

    def verify(self, problem, response):
        return self.verdict


# --------------------------------------------------------------------------- verifier receipt

def test_verifier_receipt_passes_the_real_arith_verifier(task):
    receipt = verifier_receipt(task, n=50)
    assert receipt["n_problems"] == 50
    assert receipt["gold_pass_rate"] == 1.0 and receipt["corrupted_pass_rate"] == 0.0


def test_verifier_receipt_refuses_a_verifier_that_passes_everything():
    with pytest.raises(GateError) as err:
        verifier_receipt(_ConstantVerifier(True), n=50)
    message = str(err.value)
    assert "corrupted solutions verify at 1.000 > 0.01" in message
    assert "gold solutions" not in message  # gold ones do verify: only the corrupted rate is wrong
    assert message.count("problem '") == 3  # up to 3 examples shown
    assert isinstance(err.value, PrmppoError)


def test_verifier_receipt_refuses_a_verifier_that_passes_nothing():
    with pytest.raises(GateError, match=r"gold solutions verify at 0.000 < 0.99") as err:
        verifier_receipt(_ConstantVerifier(False), n=50)
    assert "corrupted solutions verify" not in str(err.value)


def test_verifier_receipt_thresholds_are_respected(task):
    # the real verifier passes 100% of gold: demanding more than that cannot be met
    with pytest.raises(GateError, match="gold solutions verify at 1.000 < 1.5"):
        verifier_receipt(task, n=20, min_gold=1.5)


# --------------------------------------------------------------------------- topology

def test_topology_accepts_cpu_and_reports_the_layout():
    derived = check_topology("cpu", "cpu", 1, False, visible_gpus=0)
    assert derived["train_gpus"] == [] and derived["engine_gpu"] is None and derived["world_size"] == 1


def test_topology_refuses_cuda_when_no_gpu_is_visible():
    with pytest.raises(GateError, match=r"topology.train_device='cuda' but no CUDA device is visible"):
        check_topology("cuda", "cpu", 1, False, visible_gpus=0)
    with pytest.raises(GateError, match=r"topology.engine_device='cuda:0' but no CUDA device is visible"):
        check_topology("cpu", "cuda:0", 1, False, visible_gpus=0)


def test_topology_refuses_a_world_size_below_one():
    with pytest.raises(GateError, match=r"topology.train_world_size=0 must be >= 1"):
        check_topology("cpu", "cpu", 0, False, visible_gpus=0)


def test_topology_refuses_two_roles_on_one_gpu_unless_colocated():
    with pytest.raises(GateError, match=r"engine_device='cuda:3' is also training GPU 3 .*colocated=false"):
        check_topology("cuda", "cuda:3", 4, False, visible_gpus=8)
    derived = check_topology("cuda", "cuda:0", 1, True, visible_gpus=1)  # the `gpu` topology
    assert derived["train_gpus"] == [0] and derived["engine_gpu"] == 0
    derived = check_topology("cuda", "cuda:7", 7, False, visible_gpus=8)  # the `fsdp` topology
    assert derived["train_gpus"] == list(range(7)) and derived["engine_gpu"] == 7


def test_topology_refuses_a_gpu_index_that_is_not_visible():
    with pytest.raises(GateError, match=r"needs GPU index 7 .* only 2 GPU\(s\) are visible"):
        check_topology("cuda", "cuda:7", 1, False, visible_gpus=2)


# --------------------------------------------------------------------------- EOS

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    return TinyModelSource(**small).materialize(ArithTask(sft_size=10, train_size=10, test_size=4),
                                                tmp_path_factory.mktemp("m") / "tiny")


def _copy_with_config(tiny_dir, tmp_path, **edits):
    import shutil

    target = tmp_path / "model"
    shutil.copytree(tiny_dir, target)
    for name, value in edits.items():
        path = target / name
        data = json.loads(path.read_text()) if path.exists() else {}
        data["eos_token_id"] = value
        path.write_text(json.dumps(data))
    return target


def test_derive_eos_agrees_on_the_tiny_model(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    derived = derive_eos(tiny_dir, tokenizer)
    assert derived["eos_token_id"] == tokenizer.eos_token_id == 2
    assert derived["config.json"] == [2]


def test_derive_eos_accepts_a_list_that_contains_the_tokenizer_eos(tiny_dir, tmp_path):
    model_dir = _copy_with_config(tiny_dir, tmp_path, **{"config.json": [7, 2]})
    assert derive_eos(model_dir, load_tokenizer(model_dir))["config.json"] == [7, 2]


def test_derive_eos_refuses_a_config_that_disagrees_with_the_tokenizer(tiny_dir, tmp_path):
    model_dir = _copy_with_config(tiny_dir, tmp_path, **{"config.json": 5})
    with pytest.raises(GateError, match=r"config.json says eos_token_id=\[5\] but the tokenizer .* says 2") as err:
        derive_eos(model_dir, load_tokenizer(model_dir))
    assert "never stop" in str(err.value) and "wrong token" in str(err.value)


def test_derive_eos_refuses_a_generation_config_that_disagrees(tiny_dir, tmp_path):
    model_dir = _copy_with_config(tiny_dir, tmp_path, **{"generation_config.json": [0, 1]})
    with pytest.raises(GateError, match=r"generation_config.json says eos_token_id=\[0, 1\]"):
        derive_eos(model_dir, load_tokenizer(model_dir))


# --------------------------------------------------------------------------- horizon

def test_horizon_compares_the_schedule_with_the_loops_own_count():
    ppo = SimpleNamespace(prompts_per_iteration=4, n_samples_per_prompt=2, minibatch_rows=4, micro_batch_rows=2,
                          iterations=3, value_warmup_iterations=1, ppo_epochs=2)
    shape = Shape.derive(ppo)
    assert shape.policy_steps == (3 - 1) * 2 * 2  # (iterations - warmup) * epochs * minibatches per epoch
    assert count_policy_steps(ppo) == 8  # counted by walking iterations, epochs and minibatch slices
    check_horizon(shape.policy_steps, count_policy_steps(ppo), ppo)
    # 8 rows in slices of 3 (a config validation would refuse): the schedule assumes 8 // 3 = 2
    # minibatches per epoch, the loop takes 3 slices (3, 3, 2), so the LR would not end with the run
    uneven = SimpleNamespace(**{**vars(ppo), "minibatch_rows": 3, "micro_batch_rows": 3})
    assert (Shape.derive(uneven).policy_steps, count_policy_steps(uneven)) == (8, 12)
    with pytest.raises(HorizonError, match=r"spans 8 steps but the update loop takes 12 policy optimizer steps"):
        check_horizon(Shape.derive(uneven).policy_steps, count_policy_steps(uneven), uneven)


class _NoCheckerTask(ArithTask):
    def check_steps(self, problem, response):
        return None


@pytest.mark.parametrize("reward_kwargs,expected", [
    ({"scorer": "oracle"}, "exact step checker"),
    ({"scorer": "learned"}, "learned PRM"),
])
def test_step_scorer_gate_accepts_a_usable_source(reward_kwargs, expected):
    from prmppo.guards.gates import check_step_scorer
    from prmppo.rewards.prm import ProcessReward

    task = ArithTask(sft_size=10, train_size=10, test_size=4)
    assert check_step_scorer(task, ProcessReward(**reward_kwargs)) == {"step_scores": expected}


def test_step_scorer_gate_refuses_oracle_without_a_checker():
    from prmppo.guards.gates import check_step_scorer
    from prmppo.rewards.orm import OutcomeReward
    from prmppo.rewards.prm import ProcessReward

    task = _NoCheckerTask(sft_size=10, train_size=10, test_size=4)
    with pytest.raises(GateError, match="reward.scorer=oracle .* task 'arith' has none"):
        check_step_scorer(task, ProcessReward(scorer="oracle"))
    assert check_step_scorer(task, OutcomeReward())["step_scores"].startswith("none")  # ORM needs no checker
    # nor does the likelihood control, which reads the SFT model
    assert check_step_scorer(task, ProcessReward(scorer="likelihood_control"))["step_scores"].startswith("the SFT")


def test_trainable_modules_gate_checks_names_on_a_weightless_skeleton(tiny_dir):
    from prmppo.guards.gates import check_trainable_modules

    tiny = {"model_type": "mistral", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert check_trainable_modules(["model.norm"], tiny, "model=tiny") == {"modules_to_save": ["model.norm"],
                                                                          "checked": True}
    with pytest.raises(GateError, match=r"\['ln_f'\].*model=tiny.*\['model.norm'\].*lora.modules_to_save=\[\]"):
        check_trainable_modules(["ln_f"], tiny, "model=tiny")
    with pytest.raises(GateError, match=r"\['lm_head'\].*tied input/output embedding"):
        check_trainable_modules(["lm_head"], {**tiny, "tie_word_embeddings": True}, "model=tiny")
    # a saved model dir's own config.json
    saved = json.loads((tiny_dir / "config.json").read_text())
    assert check_trainable_modules(["norm"], saved, "config.json")["checked"] is True
    assert check_trainable_modules([], None) == {"modules_to_save": []}
    assert check_trainable_modules(["model.norm"], None)["checked"] is False  # no config yet: the loader decides
