"""Step ends derived from the tokenizer: a char tokenizer, and a BPE where "\\n" merges with other text."""

from __future__ import annotations

import pytest
import torch

from prmppo.models.tiny import build_char_tokenizer
from prmppo.rewards.steps import (StepBoundaries, align_step_labels, delimiter_token_ids, step_end_mask, to_steps,
                                  to_tokens)
from prmppo.tasks import ArithTask
from prmppo.tasks.arith import make_problem

ALPHABET = ArithTask(sft_size=10, train_size=10, test_size=4).alphabet()


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer(ALPHABET)


def _ends(tok, boundaries, *texts, eos=True):
    """Step-end positions per text (rows right-padded as the PPO batch is)."""
    rows = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else []) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1.0
    ends = boundaries.mask(ids, mask)
    return [e.nonzero().squeeze(-1).tolist() for e in ends]


def test_char_tokenizer_delimiter_is_the_newline_token_only(char_tok):
    newline = char_tok.convert_tokens_to_ids("\n")
    assert delimiter_token_ids(char_tok, "\n") == frozenset({newline})
    boundaries = StepBoundaries.from_tokenizer(char_tok, "\n")
    space = char_tok.convert_tokens_to_ids(" ")
    digit = char_tok.convert_tokens_to_ids("7")
    assert {newline, space, char_tok.eos_token_id} <= boundaries.blank_ids and digit not in boundaries.blank_ids


def test_char_tokenizer_step_ends_by_hand(char_tok):
    b = StepBoundaries.from_tokenizer(char_tok, "\n")
    # "17+5=22\n" -> "\n" at 7; "22-3=19\n" spans 8..15 -> "\n" at 15; "Answer: 19" 16..25; EOS at 26
    assert _ends(char_tok, b, "17+5=22\n22-3=19\nAnswer: 19") == [[7, 15, 26]]
    # "1","\n","\n","2",EOS: the second "\n" follows no content, so it opens no empty step
    assert _ends(char_tok, b, "1\n\n2") == [[1, 4]]
    # a leading "\n" closes nothing; "1\n" then EOS: the step is closed by "\n", EOS adds none
    assert _ends(char_tok, b, "\n1", "1\n") == [[2], [1]]
    # a whitespace-only line is no step: "1","\n"," ","\n","2",EOS
    assert _ends(char_tok, b, "1\n \n2") == [[1, 5]]
    # an empty response (EOS only) still gets one step end; a truncated row closes at its last token
    assert _ends(char_tok, b, "") == [[0]]
    assert _ends(char_tok, b, "1\n2", eos=False) == [[1, 2]]


def test_padding_never_ends_a_step(char_tok):
    b = StepBoundaries.from_tokenizer(char_tok, "\n")
    # row 1 is padded after its EOS at index 2; pad id 0 must not be mistaken for anything
    assert _ends(char_tok, b, "12\n34\n5", "1\n") == [[2, 5, 7], [1]]


def test_default_blank_set_is_the_delimiters(char_tok):
    newline = char_tok.convert_tokens_to_ids("\n")
    text = "1\n \n2"
    ids = torch.tensor([char_tok(text, add_special_tokens=False)["input_ids"] + [char_tok.eos_token_id]])
    ends = step_end_mask(ids, torch.ones_like(ids), frozenset({newline}), char_tok.eos_token_id)
    # without a blank set the space counts as content: "1" | " " | "2"
    assert ends[0].nonzero().squeeze(-1).tolist() == [1, 3, 5]


def _bpe_tokenizer():
    """A tiny BPE trained in memory, with a GPT-4-like pre-tokenizer that lets punctuation and
    newlines merge (".\\n", "\\n\\n", ".\\n\\n") but never a newline with the next line's letters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\s\w]*\n+|[A-Za-z]+|\d+|[^\S\n]+|[^\s\w]"), "isolated")
    core.decoder = decoders.Fuse()
    corpus = ["One plus two is 3.\nThree plus four is 7.\n\nAnswer: 7", "Then 5.\nSo 6.\n\nAnswer: 6"] * 50
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  show_progress=False)
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_bpe_delimiter_merged_with_other_characters():
    tok = _bpe_tokenizer()
    ids = frozenset(delimiter_token_ids(tok, "\n"))
    merged = {t for t in (".\n", ".\n\n", "\n\n") if tok.convert_tokens_to_ids(t) != tok.unk_token_id}
    assert merged, "the trained BPE has no merged newline token: this test would prove nothing"
    assert {tok.convert_tokens_to_ids(t) for t in merged} <= ids
    assert tok.convert_tokens_to_ids("Answer") not in ids and tok.eos_token_id not in ids
    text = "One plus two is 3.\nThree plus four is 7.\n\nAnswer: 7"
    row = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert any("\n" in tok.decode([i]) and len(tok.decode([i])) > 1 for i in row)  # a merged one is used
    boundaries = StepBoundaries.from_tokenizer(tok, "\n")
    ends = _ends(tok, boundaries, text)[0]
    # three steps whatever the merges: the two sentences and the answer line (closed by EOS)
    assert len(ends) == 3 and ends[-1] == len(row) - 1
    pieces = [tok.decode(row[a + 1:b + 1], skip_special_tokens=True)
              for a, b in zip([-1] + ends[:-1], ends)]
    assert [p.strip() for p in pieces] == ["One plus two is 3.", "Three plus four is 7.", "Answer: 7"]


def test_compact_step_layout_round_trips():
    ends = torch.tensor([[False, True, False, True], [False, False, True, False]])
    values = torch.tensor([[9.0, 0.8, 9.0, 0.4], [9.0, 9.0, 0.9, 9.0]])
    steps, step_mask = to_steps(values, ends)
    # row 0 has steps at 1 and 3, row 1 one step at 2; K = 2
    assert torch.allclose(steps, torch.tensor([[0.8, 0.4], [0.9, 0.0]]))
    assert step_mask.tolist() == [[True, True], [True, False]]
    assert torch.allclose(to_tokens(steps, step_mask, ends), torch.tensor([[0, 0.8, 0, 0.4], [0, 0, 0.9, 0]]))


def test_task_labels_align_with_token_step_ends(char_tok):
    task = ArithTask(sft_size=10, train_size=10, test_size=4)
    problem = make_problem([17, 5, 23], ["+", "-"])  # 17+5=22, 22-23=-1
    # second step wrong (-2); the answer line is then wrong too (first-error semantics)
    response = char_tok("17+5=22\n\n22-23=-2\nAnswer: -2", add_special_tokens=False)["input_ids"]
    response += [char_tok.eos_token_id]
    boundaries = StepBoundaries.from_tokenizer(char_tok, "\n")
    ends = _ends(char_tok, boundaries, "17+5=22\n\n22-23=-2\nAnswer: -2")[0]
    assert ends == [7, 17, 28]  # the blank line between steps adds no step
    labels = align_step_labels(task, problem, char_tok, response, ends, boundaries.delimiter_ids)
    assert labels == [True, False, False]
