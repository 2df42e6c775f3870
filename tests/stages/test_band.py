"""Stage `band`: pass rates from a scripted engine land in the right band, band files are validated row
by row, PPO draws only band prompts, and the real stage (and the pipeline with `band.enabled`) runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from conftest import RIGHT_SOMETIMES, compose_config, tiny_mistral
from prmppo import artifacts
from prmppo.app import run
from prmppo.config.build import build
from prmppo.distributed.ranks import OneProcess
from prmppo.validate import ConfigError, validate_config
from prmppo.errors import DataError, DataFileMissing, PrmppoError
from prmppo.models.policy import LoraPolicy
from prmppo.models.tiny import build_char_tokenizer
from prmppo.ppo.loop import PPOTrainer
from prmppo.rollout.protocol import RolloutResult, WeightsSpec
from prmppo.stages.band import (BandRow, distinct_train_problems, ensure_band, in_band, measure_pass_rates,
                                pass_rate_histogram, read_band, worker_sampler, write_rows)
from prmppo.tasks.arith import ArithTask


def _task() -> ArithTask:
    return ArithTask(seed=0, train_size=40, test_size=10)


class ScriptedEngine:
    """A rollout worker stand-in: prompt q gets `passes[q]` right responses (its gold solution) of n, then
    wrong ones; records every request."""

    def __init__(self, task, tokenizer, passes: dict[str, int] | None = None):
        self.by_question = {p.question: p for p in task.problems("train")}
        self.tokenizer, self.passes, self.requests = tokenizer, passes or {}, []

    def generate(self, request):
        self.requests.append(request)
        rows = []
        for ids in request.prompt_token_ids:
            problem = self.by_question[self.tokenizer.decode(ids, skip_special_tokens=True).strip()]
            for j in range(request.n_samples_per_prompt):
                right = j < self.passes.get(problem.question, 0)
                text = problem.solution if right else f"Answer: {int(problem.answer) + 1}"
                rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        return RolloutResult(request.request_id, request.weights, rows, [[0.0] * len(r) for r in rows],
                             ["stop"] * len(rows), 0.0, 0.0)


def _measure(task, passes: list[int], k: int = 4, request_rows: int = 8):
    tokenizer = build_char_tokenizer(task.alphabet())
    problems = distinct_train_problems(task, len(passes))
    engine = ScriptedEngine(task, tokenizer, {p.question: n for p, n in zip(problems, passes)})
    sample = worker_sampler(engine, tokenizer, temperature=1.0, top_p=1.0, max_new_tokens=64, seed=3)
    prompt_ids = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems]
    rows = measure_pass_rates(task, problems, prompt_ids, sample, k=k, request_rows=request_rows, seed=3,
                              checkpoint="/ckpt/sft")
    return problems, rows, engine


# ------------------------------------------------------------------------------ measuring


def test_scripted_pass_rates_land_in_the_right_band():
    task = _task()
    problems, rows, engine = _measure(task, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    assert [r.problem for r in rows] == [p.question for p in problems]
    assert [r.passes for r in rows] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert [r.pass_rate for r in rows] == [0.0, 0.25, 0.5, 0.75, 1.0] * 2
    assert {(r.k, r.seed, r.checkpoint) for r in rows} == {(4, 3, "/ckpt/sft")}
    # default band 0.2-0.8 keeps 1, 2 and 3 passes of 4; both ends of [low, high] are kept
    assert [r.passes for r in in_band(rows, 0.2, 0.8)] == [1, 2, 3, 1, 2, 3]
    assert [r.passes for r in in_band(rows, 0.25, 0.5)] == [1, 2, 1, 2]
    assert in_band(rows, 0.8, 0.9) == []
    histogram = pass_rate_histogram(rows)
    assert histogram["never_solved"] == 2 and histogram["always_solved"] == 2
    assert histogram["bins"] == {"0.0-0.1": 2, "0.1-0.2": 0, "0.2-0.3": 2, "0.3-0.4": 0, "0.4-0.5": 0,
                                 "0.5-0.6": 2, "0.6-0.7": 0, "0.7-0.8": 2, "0.8-0.9": 0, "0.9-1.0": 2}
    assert histogram["by_passes"] == {"0/4": 2, "1/4": 2, "2/4": 2, "3/4": 2, "4/4": 2}
    # 8 responses a request at k=4: two prompts each, base weights, a seed of its own per request
    assert len(engine.requests) == 5 and {len(r.prompt_token_ids) for r in engine.requests} == {2}
    assert {r.weights for r in engine.requests} == {WeightsSpec("base", None, 0)}
    assert len({r.seed for r in engine.requests}) == 5 and {r.n_samples_per_prompt for r in engine.requests} == {4}


def test_distinct_train_problems_skip_repeated_questions():
    task = SimpleNamespace(problems=lambda split: [SimpleNamespace(question=q) for q in "abacbd"])
    assert [p.question for p in distinct_train_problems(task)] == ["a", "b", "c", "d"]
    assert [p.question for p in distinct_train_problems(task, 3)] == ["a", "b", "c"]


# ------------------------------------------------------------------------------ reading band files


def _band_file(tmp_path: Path, task, passes: list[int], k: int = 4) -> tuple[Path, list]:
    problems = distinct_train_problems(task, len(passes))
    rows = [BandRow(p.question, n, k, n / k, 0, "/ckpt/sft") for p, n in zip(problems, passes)]
    path = tmp_path / "band.jsonl"
    write_rows(path, rows)
    return path, problems


def test_a_band_file_reads_back_in_train_order(tmp_path):
    task = _task()
    path, problems = _band_file(tmp_path, task, [1, 2, 3, 1, 2, 3])
    lines = path.read_text().splitlines()
    path.write_text("\n".join(reversed(lines)) + "\n\n")  # file order and a blank line do not matter
    band = read_band(path, task, min_prompts=4)
    assert band.problems == problems
    assert band.summary() == {"file": str(path.resolve()), "size": 6, "pass_rate_min": 0.25, "pass_rate_max": 0.75,
                              "k": [4], "checkpoints": ["/ckpt/sft"]}


def _second_line(task, **changes) -> str:
    question = distinct_train_problems(task, 2)[1].question
    row = {"problem": question, "passes": 1, "k": 4, "pass_rate": 0.25, "seed": 0, "checkpoint": "/c", **changes}
    return json.dumps({k: v for k, v in row.items() if v is not ...})


@pytest.mark.parametrize("line, fragment", [
    (lambda t: _second_line(t, passes=...), "missing field 'passes'"),
    (lambda t: _second_line(t, passes="1"), "field 'passes' must be int, got str '1'"),
    (lambda t: _second_line(t, passes=True), "field 'passes' must be int, got bool True"),
    (lambda t: _second_line(t, pass_rate="high"), "field 'pass_rate' must be int or float"),
    (lambda t: _second_line(t, problem="1+1"), "problem '1+1' is not a `train` problem"),
    (lambda t: _second_line(t, pass_rate=0.5), "pass_rate = passes / k"),
    (lambda t: _second_line(t, passes=5), "0 <= passes <= k"),
    (lambda t: _second_line(t, passes=0, k=0, pass_rate=0.0), "need k >= 1"),
    (lambda t: '{"problem": ', "bad JSON"),
    (lambda t: "[1, 2]", "expected a JSON object"),
    (lambda t: _second_line(t, problem=distinct_train_problems(t, 1)[0].question), "repeats line 1"),
])
def test_a_malformed_band_file_is_refused_naming_the_line(tmp_path, line, fragment):
    task = _task()
    path, _ = _band_file(tmp_path, task, [1])
    path.write_text(path.read_text() + line(task) + "\n")
    where = re.escape(f"band file {path.resolve()}: line 2: ")
    with pytest.raises(DataError, match=where + ".*" + re.escape(fragment)):
        read_band(path, task, min_prompts=1)


def test_an_empty_small_or_missing_band_file_is_refused(tmp_path):
    task = _task()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds 0 prompts, fewer than ppo.prompts_per_iteration=1"):
        read_band(tmp_path / "empty.jsonl", task, min_prompts=1)
    path, _ = _band_file(tmp_path, task, [1, 2])
    with pytest.raises(DataError, match="holds 2 prompts, fewer than ppo.prompts_per_iteration=4"):
        read_band(path, task, min_prompts=4)
    with pytest.raises(DataFileMissing, match="band file not found"):
        read_band(tmp_path / "nowhere.jsonl", task, min_prompts=1)
    assert issubclass(DataError, PrmppoError) and issubclass(DataFileMissing, PrmppoError)  # the CLI exits 2


# ------------------------------------------------------------------------------ PPO on a band


def _sampled_questions(task, prompts) -> list[str]:
    tokenizer = build_char_tokenizer(task.alphabet())
    engine = ScriptedEngine(task, tokenizer)
    ppo = OmegaConf.to_object(compose_config(["debug=smoke", "ppo.iterations=3"]).ppo)  # 4 prompts x 2 samples
    policy = LoraPolicy(tiny_mistral(32), detach_value_hidden=True, critic=False, r=4, alpha=8, dropout=0.0,
                        target_modules=["q_proj", "v_proj"])
    trainer = PPOTrainer(policy=policy, tokenizer=tokenizer, task=task, reward=None, engine=engine,
                         sync=SimpleNamespace(served=WeightsSpec("base", None, 0)), ppo=ppo, logger=None,
                         ranks=OneProcess(None), seed=0, prompts=prompts)
    for iteration in range(3):
        trainer.sample(iteration)
    return [tokenizer.decode(ids, skip_special_tokens=True).strip()
            for request in engine.requests for ids in request.prompt_token_ids]


def test_ppo_with_a_band_draws_only_band_prompts(tmp_path):
    task = _task()
    path, _ = _band_file(tmp_path, task, [1, 2, 3, 2, 1, 2])
    band = read_band(path, task, min_prompts=4)
    seen = _sampled_questions(task, band.problems)
    assert len(seen) == 12 and set(seen) == {row.problem for row in band.rows}  # 3 iterations x 4 prompts
    everything = _sampled_questions(task, None)  # the control: without a band, other train prompts come up
    assert set(everything) - {row.problem for row in band.rows}


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides, fragment", [
    (["band.low=0.9", "band.high=0.1"], "band.low=0.9 and band.high=0.1 must satisfy 0 <= low <= high <= 1"),
    (["band.k=0"], "band.k=0 must be > 0"),
    (["band.top_p=0"], "band.top_p=0.0 must be in (0, 1]"),
    (["band.enabled=true", "band.file=b.jsonl"], "band.file='b.jsonl' with band.enabled=true"),
    (["band.enabled=true", "band.problems=8"], "band.problems=8 with band.enabled=true"),
])
def test_band_keys_are_validated(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        validate_config(compose_config(overrides))


def test_the_band_key_follows_the_sft_checkpoint_and_the_measurement_only():
    key = lambda *o: artifacts.artifact_key(compose_config(list(o)), "band")[0]  # noqa: E731
    base = key()
    assert key("band.enabled=true") == key("band.file=x.jsonl") == key("ppo.lr=0.5") == base
    assert key("band.k=16") != base and key("sft.steps=10") != base and key("band.low=0.1") != base
    assert key("ppo.temperature=0.7") != base  # the measurement samples at PPO's temperature by default
    ppo_key = lambda *o: artifacts.artifact_key(compose_config(list(o)), "ppo")[0]  # noqa: E731
    assert ppo_key("band.enabled=true") != ppo_key()


# ------------------------------------------------------------------------------ the real stages


@pytest.mark.slow  # SFT, then the band measured through the worker
def test_band_stage_smoke_writes_the_band_and_reuses_it(smoke_cfg):
    cfg = smoke_cfg("stage=band")
    summary = run(cfg)
    final = artifacts.artifact_dir(cfg, "band")
    measured = [json.loads(line) for line in (final / "pass_rates.jsonl").read_text().splitlines()]
    kept = [json.loads(line) for line in (final / "band.jsonl").read_text().splitlines()]
    sft = str(artifacts.artifact_dir(cfg, "sft"))
    assert len(measured) == 8 and {(r["k"], r["seed"], r["checkpoint"]) for r in measured} == {(2, 0, sft)}
    task = build(cfg.task, "task")
    assert [r["problem"] for r in measured] == [p.question for p in distinct_train_problems(task, 8)]
    assert kept == [r for r in measured if 0.2 <= r["pass_rate"] <= 0.8]
    assert summary["measured"] == 8 and summary["band_size"] == len(kept)
    assert sum(summary["histogram"]["bins"].values()) == 8
    assert summary["histogram"]["never_solved"] == sum(r["passes"] == 0 for r in measured)
    result = json.loads((Path(cfg.run_dir) / "stage_result.json").read_text())
    assert result["stage"] == "band" and result["summary"]["band_file"] == str(final / "band.jsonl")
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["band/measured"] for r in rows if r["stage"] == "band"] == [8]
    path, again = ensure_band(cfg, task, Path(cfg.run_dir), Path(sft), reuse=True)
    assert again["reused"] and path == final / "band.jsonl"


def test_ppo_refuses_a_malformed_band_file_before_any_weights(smoke_cfg, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+2+3", "passes": 1, "k": 2, "pass_rate": 0.5, "seed": 0, "checkpoint": "c"}\n')
    cfg = smoke_cfg("stage=ppo", f"band.file={bad}")
    with pytest.raises(DataError, match=re.escape(f"band file {bad}: line 1: problem '1+2+3' is not a `train`")):
        run(cfg)
    assert not Path(cfg.artifacts_dir).exists()  # refused before SFT


@pytest.mark.slow  # SFT and PPO on the band
def test_ppo_smoke_on_a_band_file_dropping_uniform_groups(smoke_cfg, tmp_path):
    cfg = smoke_cfg("stage=ppo", "ppo.drop_uniform_groups=true")
    task = build(cfg.task, "task")
    path, problems = _band_file(tmp_path, task, [1] * 6, k=2)
    with_band = OmegaConf.merge(cfg, {"band": {"file": str(path)}})
    summary = run(with_band)
    banner = json.loads((Path(cfg.run_dir) / "banner.json").read_text())
    assert banner["band"] == {"file": str(path), "size": 6, "pass_rate_min": 0.5, "pass_rate_max": 0.5, "k": [2],
                              "checkpoints": ["/ckpt/sft"]}
    assert summary["band"] == banner["band"]
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    ppo = [r for r in rows if r["stage"] == "ppo"]
    assert len(ppo) == 2 and all(0 <= r["ppo/dropped_groups"] <= 4 for r in ppo)
    # a group is dropped exactly when it is uniform; an iteration dropping all 4 updates nothing
    assert [r["ppo/dropped_group_fraction"] for r in ppo] == [r["rollout/uniform_group_fraction"] for r in ppo]
    assert [r["ppo/update_skipped"] for r in ppo] == [float(r["ppo/dropped_groups"] == 4) for r in ppo]
    assert summary["dropped_groups"] == sum(r["ppo/dropped_groups"] for r in ppo)
    assert summary["policy_steps"] == summary["planned_policy_steps"] == 4  # the schedule kept its horizon


@pytest.mark.slow  # the right-sometimes SFT policy, then band and PPO
def test_pipeline_runs_band_between_sft_and_ppo(smoke_cfg, right_sometimes_sft):
    # from a policy right part of the time, so that some of 16 prompts have a pass rate inside the band
    cfg = smoke_cfg("arm=orm", *RIGHT_SOMETIMES, "band.enabled=true", "band.problems=16", "band.k=4")
    right_sometimes_sft(Path(cfg.artifacts_dir), cfg.seed)
    summary = run(cfg)
    band_file = artifacts.artifact_dir(cfg, "band") / "band.jsonl"
    kept = [json.loads(line) for line in band_file.read_text().splitlines()]
    assert len(kept) >= cfg.ppo.prompts_per_iteration and all(0.2 <= r["pass_rate"] <= 0.8 for r in kept)
    banner = json.loads((Path(cfg.run_dir) / "banner.json").read_text())
    assert banner["band"]["file"] == str(band_file) and banner["band"]["size"] == len(kept)
    assert banner["band"]["checkpoints"] == [banner["base_checkpoint"]]  # measured on the policy PPO starts from
    assert summary["band"] == banner["band"] and "delta" in summary
    stages = [json.loads(line)["stage"] for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert stages.index("band") < stages.index("ppo")


@pytest.mark.slow  # SFT, then the band's samples drawn through the worker and in process
def test_band_samples_in_process_what_the_worker_samples(smoke_cfg, monkeypatch):
    import prmppo.stages.band as band_stage

    texts: dict[str, list[str]] = {}
    real_sampler = band_stage.worker_sampler

    def recording_sampler(engine, tokenizer, **settings):
        sample, name = real_sampler(engine, tokenizer, **settings), type(engine).__name__

        def recorded(prompt_ids, n, index):
            texts.setdefault(name, []).extend(out := sample(prompt_ids, n, index))
            return out

        return recorded

    monkeypatch.setattr(band_stage, "worker_sampler", recording_sampler)
    worker_cfg = smoke_cfg("stage=band")
    run(worker_cfg)  # SFT, then the band through the worker
    sft = artifacts.artifact_dir(worker_cfg, "sft")
    in_process_cfg = smoke_cfg("stage=band", "rollout=inprocess")
    rows = band_stage._measure(in_process_cfg, build(in_process_cfg.task, "task"), Path(in_process_cfg.run_dir), sft)
    assert set(texts) == {"RolloutClient", "InProcessEngine"} and len(rows) == 8
    assert texts["InProcessEngine"] == texts["RolloutClient"] and len(set(texts["RolloutClient"])) > 1
