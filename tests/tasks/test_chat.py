"""Chat templates for `task=jsonl` prompts (`model.chat_template=auto|true|false`, `model.system_prompt`), on a
tiny model whose tokenizer is given a small Jinja chat template here."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compose_config
from prmppo.config.build import build
from prmppo.errors import ConfigError
from prmppo.models.loading import load_tokenizer
from prmppo.tasks import JsonlTask
from prmppo.tasks.chat import ChatPrompts

from chat_models import TEST, TRAIN, make_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    out = make_chat_model(tmp_path_factory.mktemp("plain") / "model", template=None)
    assert not load_tokenizer(out).chat_template
    return out


def test_rendered_prompt_of_one_row_and_its_token_ids(chat_model):
    task = JsonlTask(train_path=str(TRAIN), test_path=str(TEST), chat_template="true",
                     tokenizer_path=str(chat_model), system_prompt="Think step by step.")
    problem = task.problems("train")[1]  # a chat-message prompt
    rendered = task.format_prompt(problem)
    print(rendered)
    assert rendered == ("<|system|>\nThink step by step.\n"
                        "<|user|>\nCompute 9 - 2, then halve it. Put the final answer in \\boxed{}.\n"
                        "<|assistant|>\n")
    # the stages tokenize format_prompt's text with the tokenizer's defaults: exactly the template's own ids,
    # one BOS (the template's BOS text is dropped because the tokenizer adds it)
    tokenizer = load_tokenizer(chat_model)
    ids = tokenizer(rendered)["input_ids"]
    conversation = task.chat.messages(problem.meta["messages"])
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)  # transformers 5: a BatchEncoding
    assert ids == expected and ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    # a row's own system message is kept instead of model.system_prompt
    parquet_row = task.problems("test")[0]
    assert task.format_prompt(parquet_row).startswith("<|system|>\n" + parquet_row.meta["messages"][0]["content"])


def test_auto_uses_a_template_when_there_is_one(chat_model, plain_model):
    with_template = JsonlTask(train_path=str(TRAIN), test_path=str(TEST), chat_template="auto",
                              tokenizer_path=str(chat_model))
    without = JsonlTask(train_path=str(TRAIN), test_path=str(TEST), chat_template="auto",
                        tokenizer_path=str(plain_model))
    problem = with_template.problems("train")[0]  # a string prompt: one user message
    assert with_template.format_prompt(problem) == f"<|user|>\n{problem.question}\n<|assistant|>\n"
    assert without.format_prompt(problem) == f"{problem.question}\n"
    off = JsonlTask(train_path=str(TRAIN), test_path=str(TEST), chat_template="false", tokenizer_path=str(chat_model))
    assert off.format_prompt(problem) == f"{problem.question}\n"


def test_true_without_a_template_is_refused_by_name(plain_model):
    with pytest.raises(ConfigError, match=r"model.chat_template=true but the tokenizer in .*plain.* has no chat "
                                          r"template"):
        JsonlTask(train_path=str(TRAIN), test_path=str(TEST), chat_template="true", tokenizer_path=str(plain_model))
    with pytest.raises(ConfigError, match=r"model.chat_template=true but model=tiny's tokenizer has no chat template"):
        ChatPrompts("true", None, None, "{prompt}\n")
    with pytest.raises(ConfigError, match=r"model.chat_template='maybe' is not one of auto, true, false"):
        ChatPrompts("maybe", None, None, "{prompt}\n")


def test_model_group_reaches_the_task(chat_model):
    # as `python -m prmppo task=jsonl model=hf model.path=... model.chat_template=true` composes it
    cfg = compose_config(["task=jsonl", f"task.train_path={TRAIN}", f"task.test_path={TEST}", "model=hf",
                          f"model.path={chat_model}", "model.chat_template=true", "model.system_prompt=Be brief."])
    assert cfg.task.tokenizer_path == str(chat_model) and cfg.task.system_prompt == "Be brief."
    task = build(cfg.task, "task")
    assert task.chat.templated
    assert task.format_prompt(task.problems("train")[0]).startswith("<|system|>\nBe brief.\n<|user|>\n")


def test_chat_settings_are_inert_outside_task_jsonl():
    from prmppo.config.validate import inert_keys

    gsm8k = compose_config(["task=gsm8k", "model=hf", "model.path=/nonexistent/checkpoint"])
    assert {"model.chat_template", "model.system_prompt"} <= set(inert_keys(gsm8k))
    jsonl = compose_config(["task=jsonl", f"task.train_path={TRAIN}", f"task.test_path={TEST}", "model=hf",
                            "model.path=/nonexistent/checkpoint"])
    assert not {"model.chat_template", "model.system_prompt"} & set(inert_keys(jsonl))
