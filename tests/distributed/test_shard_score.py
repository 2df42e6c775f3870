"""The chunked scoring pass on FSDP2 ranks (`models/root_forward.py as_root_forward`, the policy's
`scoring_call` once `distributed/shard.py` shards it): `policy.score` calls the decoder and the tied
LM head directly, so it must run as the sharded root's forward; then its logprobs equal the unsharded
policy's and the tied embedding's gradient is reduced over the ranks. Without it the root's own
weights stay sharded and the pass does not give the unsharded logprobs."""

from __future__ import annotations

import json
from pathlib import Path

from test_ranks import torchrun

WORKER = Path(__file__).with_name("score_worker.py")


def test_score_runs_as_the_sharded_roots_forward(tmp_path):
    proc = torchrun([str(WORKER), str(tmp_path), str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["tied_grad_norm"] > 0  # the comparison below is of a gradient that exists
        assert seen["logprobs_equal"] and seen["tied_grad_equal"], seen
        assert seen["direct"] != "equal", seen  # bypassing the root's forward is what as_root_forward fixes
