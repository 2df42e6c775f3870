"""`task=jsonl` on committed fixtures in verl's row layout: a JSONL file (string prompts and chat-message
prompts, worked solutions under `extra_info.answer`) and a Parquet file (chat-message prompts, some rows
without a solution), bad rows refused with file and line or skipped and counted, and the Task contract the
stages use (prompts, verifier, steps, corruption for the verifier receipt)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import compose_config
from prmppo.config.build import build
from prmppo.errors import ConfigError, DataError, DataFileMissing
from prmppo.guards.gates import verifier_receipt
from prmppo.tasks import JsonlTask, Task
from prmppo.tasks.jsonl import answer_only_solution
from prmppo.validate import validate_config

FIXTURES = Path(__file__).parent / "fixtures"
TRAIN, TEST = FIXTURES / "verl_train.jsonl", FIXTURES / "verl_test.parquet"


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _row(prompt="What is 1 + 1?", truth="2", solution=None):
    row = {"data_source": "t", "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": truth}}
    if solution is not None:
        row["extra_info"] = {"answer": solution}
    return row


@pytest.fixture(scope="module")
def task() -> JsonlTask:
    return JsonlTask(train_path=str(TRAIN), test_path=str(TEST))


def test_reads_verl_jsonl_and_parquet_with_string_and_chat_prompts(task):
    assert isinstance(task, Task)
    train, test, sft = task.problems("train"), task.problems("test"), task.problems("sft")
    assert len(train) == 12 and len(test) == 8 and sft == train  # sft_path unset: the train file
    # row 1 has a string prompt, row 2 a list of chat messages: both become one user message
    assert train[0].meta["messages"] == [{"role": "user", "content": train[0].question}]
    assert train[0].question == "Compute 3 + 4, then halve it. Put the final answer in \\boxed{}."
    assert train[1].meta["messages"] == [{"role": "user", "content": "Compute 9 - 2, then halve it. Put the final "
                                                                      "answer in \\boxed{}."}]
    assert train[0].answer == "\\frac{7}{2}"
    assert train[0].solution == "3 + 4 = 7\n7 / 2 = 3.5\nThe answer is $\\boxed{\\frac{7}{2}}$."
    assert train[0].meta["where"] == f"{TRAIN}: line 1"
    # Parquet: a system + user conversation kept whole; the question is the user's message
    assert test[0].meta["messages"][0]["role"] == "system" and test[0].meta["where"] == f"{TEST}: row 1"
    assert test[0].question == test[0].meta["messages"][-1]["content"]
    # a Parquet row without a solution gets the answer-only one
    without = [p for p in test if p.solution == answer_only_solution(p.answer)]
    assert 0 < len(without) < len(test)


def test_plain_prompt_without_a_chat_template(task):
    # no tokenizer (model=tiny): the messages' contents joined by a blank line, then task.prompt_template
    problem = task.problems("test")[0]
    system, user = (m["content"] for m in problem.meta["messages"])
    assert task.format_prompt(problem) == f"{system}\n\n{user}\n"
    assert task.format_prompt(task.problems("train")[0]) == task.problems("train")[0].question + "\n"


def test_gold_solutions_verify_and_corrupted_ones_do_not(task):
    receipt = verifier_receipt(task, seed=0)
    assert receipt["gold_pass_rate"] == 1.0 and receipt["corrupted_pass_rate"] == 0.0
    problem = task.problems("train")[0]  # gold 7/2
    corrupted = task.corrupt(problem, 0, random.Random(0))
    steps = task.split_steps(corrupted)
    assert steps[0] != "3 + 4 = 7" and steps[0].startswith("3 + 4 = ")  # the step's number moved
    assert steps[1] == "7 / 2 = 3.5" and not task.verify(problem, corrupted)
    assert task.verify(problem, "so it is 3.5\nThe answer is 3.5.")  # 3.5 == 7/2 under math-verify


def test_test_size_takes_the_first_rows():
    task = JsonlTask(train_path=str(TRAIN), test_path=str(TEST), test_size=3)
    assert [p.question for p in task.problems("test")] == [p.question for p in
                                                           JsonlTask(str(TRAIN), str(TEST)).problems("test")[:3]]


@pytest.mark.parametrize("delimiter,response,steps", [
    ("\n", "a = 1\nb = 2\n\nThe answer is 3.", ["a = 1", "b = 2", "The answer is 3."]),
    ("\n\n", "a = 1\nstill a\n\nb = 2\n\nThe answer is 3.", ["a = 1\nstill a", "b = 2", "The answer is 3."]),
    (" ки", "a = 1 ки\nb = 2 ки\nThe answer is 3. ки", ["a = 1", "b = 2", "The answer is 3."]),
])
def test_step_splitter_by_config(delimiter, response, steps):
    task = JsonlTask(train_path=str(TRAIN), test_path=str(TEST), step_delimiter=delimiter)
    assert task.split_steps(response) == steps


def test_bad_rows_are_refused_with_file_and_line(tmp_path):
    bad = FIXTURES / "bad_rows.jsonl"
    with pytest.raises(DataError) as refused:
        JsonlTask(train_path=str(bad), test_path=str(TEST))
    message = str(refused.value)
    assert "3 bad row(s) in the train split" in message
    assert f"{bad}: line 2: missing field 'reward_model'" in message
    assert f"{bad}: line 3: ground truth '\\\\frac{{1}}{{' at 'reward_model.ground_truth' cannot be parsed" in message
    assert f"{bad}: line 5: 'prompt' must be a string or a non-empty list" in message
    assert "task.bad_rows=skip" in message


def test_bad_rows_skipped_and_counted_when_asked(tmp_path, caplog):
    bad = FIXTURES / "bad_rows.jsonl"
    task = JsonlTask(train_path=str(bad), test_path=str(TEST), bad_rows="skip")
    assert [p.meta["where"] for p in task.problems("train")] == [f"{bad}: line 1", f"{bad}: line 4"]
    assert task.skipped_rows == {"train": 3, "sft": 3}
    assert "skipped 3 bad row(s)" in caplog.text


def test_sft_rows_need_a_solution_train_rows_do_not(tmp_path):
    rows = _write_jsonl(tmp_path / "no_solution.jsonl", [_row(), _row(truth="3")])
    with pytest.raises(DataError, match=r"no_solution.jsonl: line 1: missing field 'extra_info.answer': SFT rows"):
        JsonlTask(train_path=str(rows), test_path=str(TEST))
    sft = _write_jsonl(tmp_path / "sft.jsonl", [_row(solution="1 + 1 = 2\nThe answer is 2.")])
    task = JsonlTask(train_path=str(rows), test_path=str(TEST), sft_path=str(sft))
    assert task.problems("train")[1].solution == "The answer is $\\boxed{3}$."
    assert task.problems("sft")[0].solution.endswith("The answer is 2.")


def test_bad_json_missing_file_and_unknown_kind_are_named(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(_row(solution="x = 2")) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl: line 2: bad JSON"):
        JsonlTask(train_path=str(broken), test_path=str(TEST))
    with pytest.raises(DataFileMissing, match=r"task.test_path='.*nowhere.parquet': no such file"):
        JsonlTask(train_path=str(TRAIN), test_path=str(tmp_path / "nowhere.parquet"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"task.train_path=.*unknown file kind '.csv'"):
        JsonlTask(train_path=str(tmp_path / "rows.csv"), test_path=str(TEST))


def test_numeric_and_exact_checkers(tmp_path):
    rows = _write_jsonl(tmp_path / "rows.jsonl", [_row(truth="1,000", solution="so 1000\nThe answer is 1000.")])
    numeric = JsonlTask(train_path=str(rows), test_path=str(rows), checker="numeric")
    problem = numeric.problems("test")[0]
    assert numeric.verify(problem, "#### 1000.0") and not numeric.verify(problem, "#### 999")
    assert not numeric.verify(problem, "\\boxed{10^3}")  # numeric reads plain numbers only
    exact = JsonlTask(train_path=str(rows), test_path=str(rows), checker="exact")
    assert exact.verify(problem, "\\boxed{ 1,000 }") and not exact.verify(problem, "\\boxed{1000}")
    with pytest.raises(DataError, match=r"ground truth 'seven' at 'reward_model.ground_truth' cannot be parsed by "
                                        r"task.checker=numeric"):
        JsonlTask(train_path=str(_write_jsonl(tmp_path / "w.jsonl", [_row(truth="seven", solution="s")])),
                  test_path=str(rows), checker="numeric")


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="task.bad_rows='drop' is not one of refuse, skip"):
        JsonlTask(train_path=str(TRAIN), test_path=str(TEST), bad_rows="drop")
    with pytest.raises(ConfigError, match="task.checker='sympy' is not one of math_verify, numeric, exact"):
        JsonlTask(train_path=str(TRAIN), test_path=str(TEST), checker="sympy")


def test_composes_as_task_jsonl_with_verl_defaults_and_any_step_delimiter():
    cfg = compose_config(["task=jsonl", f"task.train_path={TRAIN}", f"task.test_path={TEST}",
                          "task.step_delimiter=' ки'", "prm_train.label_source=monte_carlo"])
    assert cfg.task.prompt_key == "prompt" and cfg.task.answer_key == "reward_model.ground_truth"
    assert cfg.task.chat_template == "false" and cfg.task.tokenizer_path is None  # model=tiny: no template
    validate_config(cfg)  # task=jsonl may split steps at a tag
    task = build(cfg.task, "task")
    assert isinstance(task, JsonlTask) and task.step_delimiter == " ки"


def test_choices_refused_at_launch_from_the_lists_of_their_modules():
    base = ["task=jsonl", f"task.train_path={TRAIN}", f"task.test_path={TEST}", "prm_train.label_source=monte_carlo"]
    with pytest.raises(ConfigError, match=r"task.checker='sympy' is not one of math_verify, numeric, exact.*"
                                          r"task.bad_rows='drop' is not one of refuse, skip"):
        validate_config(compose_config([*base, "task.checker=sympy", "task.bad_rows=drop"]))
    hf = ["model=hf", "model.path=/nonexistent/checkpoint"]
    with pytest.raises(ConfigError, match=r"model.chat_template='maybe' is not one of auto, true, false"):
        validate_config(compose_config([*base, *hf, "model.chat_template=maybe"]))
    validate_config(compose_config([*base, *hf, "model.chat_template=true"]))  # a YAML boolean is a mode too
    # the step delimiter is free only under task=jsonl
    with pytest.raises(ConfigError, match=r"task.step_delimiter=' ки': only"):
        validate_config(compose_config(["task.step_delimiter=' ки'"]))


def test_missing_paths_are_refused_by_name():
    cfg = compose_config(["task=jsonl", "prm_train.label_source=monte_carlo"])
    with pytest.raises(ConfigError, match=r"task.test_path is not set: your JSONL or Parquet file.*"
                                          r"task.train_path is not set"):
        validate_config(cfg)
