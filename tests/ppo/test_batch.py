"""Micro-batch shaping: length buckets and the columns a micro-batch keeps (ppo/batch.py)."""

from __future__ import annotations

import torch

from prmppo.ppo.batch import collate, length_buckets, trim_columns


def _rows():
    # prompts of 1, 3, 2, 1 tokens and responses of 4, 1, 2, 0 tokens: P = 3, T = 4
    return collate([[5], [5, 6, 7], [5, 6], [9]], [[1, 2, 3, 4], [1], [1, 2], []], pad_token_id=0)


def test_trim_keeps_from_the_first_used_prompt_column_to_the_longest_response():
    ids, att, pos, resp, mask, plen = _rows()
    assert plen == 3 and resp.shape[1] == 4
    # rows 0 and 3 (1-token prompts at column 2, responses of 4 and 0 tokens): the prompt pad columns
    # 0-1 are padding in both; the longest response is 4
    columns, width, new_plen = trim_columns(att[[0, 3]], mask[[0, 3]], plen)
    assert (columns, width, new_plen) == (slice(2, 7), 4, 1)
    # rows 1 and 2: every prompt column used by row 1, responses of 1 and 2 tokens
    columns, width, new_plen = trim_columns(att[[1, 2]], mask[[1, 2]], plen)
    assert (columns, width, new_plen) == (slice(0, 5), 2, 3)
    # a row without response tokens keeps one response column (the loss masks it out)
    assert trim_columns(att[[3]], mask[[3]], plen) == (slice(2, 4), 1, 1)


def test_trimmed_rows_keep_every_real_token_and_its_position():
    ids, att, pos, resp, mask, plen = _rows()
    columns, width, new_plen = trim_columns(att[[1, 2]], mask[[1, 2]], plen)
    kept = att[[1, 2]][:, columns]
    assert int(kept.sum()) == int(att[[1, 2]].sum())  # nothing real was cut
    assert torch.equal(ids[[1, 2]][:, columns][:, new_plen:new_plen + width], resp[[1, 2], :width])


def test_length_buckets_group_rows_of_similar_length():
    ids, att, pos, resp, mask, plen = _rows()
    buckets = length_buckets(att, mask, rows_per_bucket=2)
    # response lengths 4, 1, 2, 0 -> order 3, 1, 2, 0
    assert [b.tolist() for b in buckets] == [[3, 1], [2, 0]]
    assert sorted(torch.cat(buckets).tolist()) == [0, 1, 2, 3]  # every row exactly once


def test_a_token_budget_closes_buckets_before_they_outgrow_it():
    ids, att, pos, resp, mask, plen = _rows()
    # sorted: row 3 (prompt 1, response 0 -> 1 column), 1 (3 + 1), 2 (2 + 2), 0 (1 + 4)
    # budget 8: [3, 1] is 2 x (3 + 1) = 8; adding 2 gives 3 x (3 + 2) = 15; [2, 0] is 2 x (2 + 4) = 12 > 8
    buckets = length_buckets(att, mask, rows_per_bucket=4, max_tokens=8)
    assert [b.tolist() for b in buckets] == [[3, 1], [2], [0]]
    # the row cap still holds under a large budget, and a row over the budget runs alone
    assert [b.tolist() for b in length_buckets(att, mask, rows_per_bucket=3, max_tokens=1000)] == [[3, 1, 2], [0]]
    assert [b.tolist() for b in length_buckets(att, mask, rows_per_bucket=4, max_tokens=1)] == [[3], [1], [2], [0]]
