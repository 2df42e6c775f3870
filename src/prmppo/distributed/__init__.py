"""Training on N ranks under torchrun (`topology=fsdp`): process group, sharding, collectives, checkpoints.

    launch.py      gates (torchrun present, WORLD_SIZE == topology.train_world_size, one run dir),
                   the process group (gloo on CPU, NCCL on CUDA, one rank per GPU), per-rank log files
    ranks.py       `OneProcess` / `TorchRanks`: the one object the stages and the PPO loop ask about their
                   ranks: rows of this rank, gathers, sums, the batch from rank 0, and what differs from one
                   process (`sharded`, `load_for_training`, `shard`, `weight_sync`, `checkpoints`,
                   `main_metrics`, `main_engine`, `publish`, `barrier`); on one process the plain answer
    shard.py       FSDP2 `fully_shard` per decoder block and at the root; full weights gathered to rank 0;
                   gradient clipping on the global norm
    checkpoint.py  `torch.distributed.checkpoint` sharded saves beside the ordinary checkpoint files

The PPO loop, SFT and PRM training are written once: they ask `ranks` for their share of rows and
for global sums, and a single process answers with the whole batch and the sums it already has.
Nothing outside this package asks which kind of ranks it holds. It builds on `models/` (loading,
the root forward) and `checkpoint_format.py`, never on `ppo/` or `stages/`.
"""
