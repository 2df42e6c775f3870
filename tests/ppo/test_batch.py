"""Micro-batch shaping: length buckets and the columns a micro-batch keeps (ppo/batch.py)."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from prmppo.ppo.batch import TrainBatch, collate, length_buckets, trim_columns


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


def test_a_width_multiple_pads_the_prompts_on_the_left_and_moves_no_token():
    ids, att, pos, resp, mask, plen = _rows()  # P + T = 3 + 4
    wide_ids, wide_att, wide_pos, wide_resp, wide_mask, wide_plen = collate(
        [[5], [5, 6, 7], [5, 6], [9]], [[1, 2, 3, 4], [1], [1, 2], []], pad_token_id=0, width_multiple=4)
    assert wide_plen == 4 and wide_ids.shape[1] == 8  # one more prompt column: 4 + 4 is a multiple of 4
    assert not wide_att[:, 0].any() and torch.equal(wide_ids[:, 0], torch.zeros(4, dtype=torch.long))
    for wide, narrow in ((wide_ids, ids), (wide_att, att), (wide_pos, pos)):
        assert torch.equal(wide[:, 1:], narrow)  # every real token keeps its column from the end and its position
    assert torch.equal(wide_resp, resp) and torch.equal(wide_mask, mask)


def test_a_width_multiple_widens_the_cut_by_prompt_padding_first_then_response_columns():
    ids, att, pos, resp, mask, plen = collate([[5], [5, 6, 7], [5, 6], [9]], [[1, 2, 3, 4], [1], [1, 2], []],
                                              pad_token_id=0, width_multiple=4)  # P = 4, T = 4
    # row 2 alone: prompt columns 2-3 and 2 response tokens, 4 wide already: the exact cut
    assert trim_columns(att[[2]], mask[[2]], plen, 4) == trim_columns(att[[2]], mask[[2]], plen) == (slice(2, 6), 2, 2)
    # row 3 alone: its prompt token at column 3 and one response column, 2 wide -> 2 more prompt columns
    assert trim_columns(att[[3]], mask[[3]], plen) == (slice(3, 5), 1, 1)
    assert trim_columns(att[[3]], mask[[3]], plen, 4) == (slice(1, 5), 1, 3)
    # rows 1 and 2: prompt columns 1-3 and 2 response tokens, 5 wide -> 8: the one prompt column left, then 2
    # response columns that no row uses
    assert trim_columns(att[[1, 2]], mask[[1, 2]], plen) == (slice(1, 6), 2, 3)
    columns, width, new_plen = trim_columns(att[[1, 2]], mask[[1, 2]], plen, 4)
    assert (columns, width, new_plen) == (slice(0, 8), 4, 4)
    assert not mask[[1, 2], 2:width].any()  # the added response columns are masked out of every loss
    assert torch.equal(ids[[1, 2]][:, columns][:, new_plen:new_plen + width], resp[[1, 2], :width])


def test_a_widened_cut_never_passes_the_rows_own_width():
    ids, att, pos, resp, mask, plen = _rows()  # P + T = 7, not a multiple of 4
    # rows 0 and 3: 1 + 4 = 5 wide, 8 would pass the 7 columns there are: the whole rows
    assert trim_columns(att[[0, 3]], mask[[0, 3]], plen, 4) == (slice(0, 7), 4, 3)


def test_a_token_budget_counts_the_widened_cut():
    ids, att, pos, resp, mask, plen = _rows()
    # sorted: row 3 (1 + 1 -> 4 wide at a multiple of 4), 1 (3 + 1 = 4), 2 (2 + 2 = 4), 0 (1 + 4 -> 8)
    # budget 12, exact widths: [3, 1] 2 x 4; + 2 is 3 x 5 = 15; [2, 0] is 2 x 6 = 12
    assert [b.tolist() for b in length_buckets(att, mask, rows_per_bucket=4, max_tokens=12)] == [[3, 1], [2, 0]]
    # widths of 4s: [3, 1] 2 x 4; + 2 is 3 x 8 = 24; [2, 0] would be 2 x 8 = 16 > 12
    assert [b.tolist() for b in length_buckets(att, mask, rows_per_bucket=4, max_tokens=12, multiple=4)] == [
        [3, 1], [2], [0]]


def _train_batch():
    ids, att, pos, resp, mask, plen = _rows()
    zeros = torch.zeros(resp.shape)
    return TrainBatch(ids, att, pos, resp, mask, zeros, zeros, zeros, zeros, zeros, plen)


def test_a_trimmed_micro_batch_hands_the_layers_contiguous_rows_and_compiles_no_second_graph():
    # a column cut of a wider batch is a view (row stride: the full width); a compiled layer's graph from a
    # contiguous pass (the no-grad passes copy their rows to the device) guards on position_ids' row stride being
    # the width, so a view would compile another graph in the middle of the first update
    train = _train_batch()
    rows = torch.tensor([1, 2])
    cut = trim_columns(train.attention_mask[rows], train.response_mask[rows], train.prompt_length)
    part = train.rows(rows).trimmed(cut)
    assert part.input_ids.shape[1] < train.input_ids.shape[1]  # the cut dropped columns
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert getattr(part, name).is_contiguous(), name

    counter = CompileCounter()
    layer = torch.compile(lambda hidden, position_ids: hidden * position_ids[..., None].float().cos(),
                          backend=counter, dynamic=True)
    torch._dynamo.reset()
    first = train.rows(torch.tensor([0, 3])).trimmed()  # another width, contiguous as a no-grad pass's rows are
    layer(torch.ones(*first.position_ids.shape, 4), first.position_ids.clone())
    layer(torch.ones(*part.position_ids.shape, 4), part.position_ids)
    assert counter.frame_count == 1
    torch._dynamo.reset()
