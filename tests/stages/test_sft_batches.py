"""SFT batches: loss only on response tokens, and a model too short for the data is refused."""

import pytest
import torch

from prmppo.errors import PrmppoError
from prmppo.models.tiny import build_char_tokenizer
from prmppo.stages.sft_training import IGNORE, SFTBatchSource
from prmppo.tasks import ArithTask


def _setup():
    task = ArithTask(sft_size=20, train_size=10, test_size=4)
    return task, task.problems("sft")[:5], build_char_tokenizer(task.alphabet())


def test_labels_cover_exactly_the_response_and_eos():
    task, problems, tok = _setup()
    source = SFTBatchSource.build(task, problems, tok, max_length=128)
    first = problems[0]
    prompt_len = len(tok(task.format_prompt(first))["input_ids"])  # BOS + question + "\n"
    response_len = len(first.solution) + 1  # one token per character, plus EOS
    labels = source.labels[0]
    assert int((labels != IGNORE).sum()) == response_len
    assert torch.all(labels[:prompt_len] == IGNORE)
    assert int(labels[prompt_len + response_len - 1]) == tok.eos_token_id
    assert int(source.lengths[0]) == prompt_len + response_len


def test_examples_longer_than_the_model_are_refused_with_the_longest_length():
    task, problems, tok = _setup()
    longest = max(len(tok(task.format_prompt(p))["input_ids"]) + len(p.solution) + 1 for p in problems)
    with pytest.raises(PrmppoError, match=rf"5 of 5 SFT examples exceed .*max_position_embeddings=8 .*longest has {longest}"):
        SFTBatchSource.build(task, problems, tok, max_length=8)
