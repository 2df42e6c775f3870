"""Run by test_ranks.py under `torchrun --nproc_per_node=2`: each rank exercises `TorchRanks` and writes
what it saw to `<out>/rank<N>.json`. Usage: ranks_worker.py <out_dir> <run_dir_of_rank0> <run_dir_of_rank1>."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from prmppo.distributed.launch import LaunchError, close_ranks, init_ranks
from prmppo.distributed.shard import check_identical_init
from prmppo.errors import PrmppoError

out, dirs = Path(sys.argv[1]), sys.argv[2:4]
rank = int(os.environ["RANK"])
Path(dirs[rank]).mkdir(parents=True, exist_ok=True)
seen: dict = {}
try:
    ranks = init_ranks("fsdp", "cpu", Path(dirs[rank]))
except LaunchError as err:
    seen["refused"] = str(err)
    seen["group_left"] = torch.distributed.is_initialized()  # a refusal leaves no process group to exit time
else:
    # 3 micro-batches of 5 rows on 2 ranks: rank 0 takes the first and third, rank 1 the second and an idle turn
    dealt = ranks.deal([torch.tensor([4, 0]), torch.tensor([1, 3]), torch.tensor([2])])
    seen["dealt"] = [None if rows is None else rows.tolist() for rows in dealt]
    filled = torch.zeros(5, 2)  # [5, 2] this rank's rows filled, the others 0
    for rows in dealt:
        if rows is not None:
            filled[rows] = torch.stack([rows.float(), 10 * rows.float()], dim=1)
    seen["gathered"] = ranks.sum_rows(filled).tolist()
    idle = []
    ranks.idle_pass(lambda: idle.append(rank))
    seen["idle_ran"] = idle
    seen["sums"] = ranks.sum_floats({"b": float(rank + 1), "a": 0.5})
    seen["from_main"] = ranks.from_main(lambda: {"made_on": rank})
    seen["any"] = [ranks.any(rank == 1), ranks.any(False)]
    grad = torch.nn.Parameter(torch.zeros(3))
    grad.grad = torch.full((3,), float(rank + 1))
    ranks.sum_grads([grad])
    seen["summed_grad"] = grad.grad.tolist()
    for name, seed in (("same_init", 0), ("different_init", rank)):  # a rank-dependent seed must be refused
        torch.manual_seed(seed)
        try:
            check_identical_init(SimpleNamespace(model=torch.nn.Linear(3, 2), value_head=None), ranks)
            seen[name] = "accepted"
        except PrmppoError as err:
            seen[name] = str(err)
    close_ranks(ranks)
(out / f"rank{rank}.json").write_text(json.dumps(seen))
