"""`TorchRanks` on two CPU processes (gloo, torchrun): the micro-batches dealt to each rank, their rows
gathered back, sums, the batch from rank 0, agreement on a stop, and the refusals of ranks given
different run dirs or different starting weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

WORKER = Path(__file__).with_name("ranks_worker.py")


def torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=<nproc> <args>` with this checkout's prmppo importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_torch_ranks_split_gather_and_sum(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = torchrun([str(WORKER), str(tmp_path), run_dir, run_dir], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    zero, one = _seen(tmp_path)
    assert zero["dealt"] == [[4, 0], [2]] and one["dealt"] == [[1, 3], None]  # in turn; every rank 2 turns
    whole = [[float(i), 10.0 * i] for i in range(5)]
    assert zero["gathered"] == one["gathered"] == whole  # disjoint rows summed: every row, in row order
    assert zero["idle_ran"] == [0] and one["idle_ran"] == [1]  # an idle turn still runs its passes
    assert zero["sums"] == one["sums"] == {"a": 1.0, "b": 3.0}
    assert zero["from_main"] == one["from_main"] == {"made_on": 0}
    assert zero["any"] == one["any"] == [True, False]
    assert zero["summed_grad"] == one["summed_grad"] == [3.0, 3.0, 3.0]
    assert (Path(run_dir) / "rank0.log").is_file() and (Path(run_dir) / "rank1.log").is_file()
    assert zero["same_init"] == one["same_init"] == "accepted"
    for seen in (zero, one):  # FSDP would silently mix shards of different weights
        assert "ranks [1] start from different weights than rank 0" in seen["different_init"]


def test_ranks_given_different_run_dirs_are_refused(tmp_path):
    proc = torchrun([str(WORKER), str(tmp_path), str(tmp_path / "a"), str(tmp_path / "b")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for seen in _seen(tmp_path):
        assert "the ranks were given different run dirs" in seen["refused"]
        assert "hydra.run.dir=<dir>" in seen["refused"]
        assert seen["group_left"] is False
