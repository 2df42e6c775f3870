"""PPO on one process (`topology=gpu`) vs FSDP2 ranks under torchrun (`topology=fsdp`), same shapes.

    python benchmarks/fsdp_compare.py --model /tmp/q05 --data-dir ../shared/data/gsm8k             # 1 GPU
    python benchmarks/fsdp_compare.py --model /tmp/q05 --data-dir ../shared/data/gsm8k --nproc 2   # 2 training GPUs
    python benchmarks/fsdp_compare.py --model /tmp/q05 --data-dir ../shared/data/gsm8k --nproc 1 \
        --engine-device cuda:1                                                                     # a dedicated engine GPU
    python benchmarks/fsdp_compare.py --shape-cpu --iterations 3                                   # tiny model, CPU, gloo
    python benchmarks/fsdp_compare.py --shape-cpu --nproc 4 ppo.micro_batch_rows=1                 # 4 gloo ranks

Arguments after the options are overrides given to both sides.

Each side is `stage=ppo` of the same config (`task=gsm8k arm=orm`, `model=hf` on `--model`, LoRA or full
fine-tuning, `--prompts` x `--group` completions of `--new-tokens`, one optimizer step per
`--minibatch-rows`): the one-process side with `python -m prmppo topology=gpu`, the FSDP2 side with
`torchrun --nproc_per_node=N -m prmppo topology=fsdp` and the same global batch. The sides run one after
the other. Per side: the median of each `perf/` time over the iterations after the first (the first
holds the warm-up), tokens per second per training GPU, and the peak memory of every GPU as
`nvidia-smi` saw it every 0.2 s (all processes: trainer ranks and the rollout worker). The table ends
with the largest per-iteration difference of the training metrics between the sides (how far the
FSDP2 run is from the one-process run on the same data).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# per-iteration metrics compared between the sides (the parity check of the FSDP2 tests)
PARITY_KEYS = ("ppo/policy_loss", "ppo/approx_kl", "ppo/clip_fraction", "ppo/policy_grad_norm", "ppo/kl_ref",
               "ppo/entropy", "rollout/accuracy", "reward/total_mean")
PERF_KEYS = ("iteration_s", "generate_s", "score_s", "assemble_s", "update_s", "sync_s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF-layout checkpoint dir (scripts/make_shape_model.py makes a 0.5B shape)")
    parser.add_argument("--data-dir", help="GSM8K JSONL dir (task.data_dir)")
    parser.add_argument("--shape-cpu", action="store_true", help="the debug=smoke tiny model on the CPU over gloo")
    parser.add_argument("--nproc", type=int, default=1, help="FSDP2 training ranks (one GPU each: cuda:0..N-1)")
    parser.add_argument("--engine-device", default="", help="the rollout engine's device (default: colocated on cuda:0)")
    parser.add_argument("--lora", choices=("adapter", "none"), default="adapter")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--minibatch-rows", type=int, default=64)
    parser.add_argument("--micro-rows", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=4, help="PPO iterations per side (the first is warm-up)")
    parser.add_argument("--sides", default="gpu,fsdp")
    parser.add_argument("--out", default="runs/fsdp_compare")
    parser.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. ppo.micro_batch_rows=1")
    args = parser.parse_args(argv)
    if not args.shape_cpu and not (args.model and args.data_dir):
        parser.error("give --model and --data-dir (or --shape-cpu)")
    if args.iterations < 2:
        parser.error("--iterations must be >= 2: the first iteration is warm-up")
    return args


def overrides(args, run_dir: Path, side: str) -> list[str]:
    common = [f"hydra.run.dir={run_dir.resolve()}", f"artifacts_dir={(run_dir / 'artifacts').resolve()}",
              "stage=ppo", "arm=orm", f"ppo.iterations={args.iterations}", "eval.every=0", "logger.console=false"]
    if args.shape_cpu:
        shape = ["debug=smoke"]
        devices = ["topology.train_device=cpu", "topology.engine_device=cpu"]
    else:
        shape = ["model=hf", f"model.path={Path(args.model).resolve()}", "model.dtype=bfloat16", "task=gsm8k",
                 f"task.data_dir={Path(args.data_dir).resolve()}", "sft.steps=0", "sft.eval_problems=0",
                 f"ppo.prompts_per_iteration={args.prompts}", f"ppo.n_samples_per_prompt={args.group}",
                 f"ppo.max_new_tokens={args.new_tokens}", f"ppo.minibatch_rows={args.minibatch_rows}",
                 f"ppo.micro_batch_rows={args.micro_rows}", f"lora={args.lora}"]
        engine = args.engine_device or "cuda:0"
        devices = [f"topology.engine_device={engine}", f"topology.colocated={str(engine == 'cuda:0').lower()}"]
    if side == "gpu":
        return [*common, *shape, "topology=cpu" if args.shape_cpu else "topology=gpu",
                *([] if args.shape_cpu else devices), *args.overrides]
    return [*common, *shape, "topology=fsdp", f"topology.train_world_size={args.nproc}", *devices, *args.overrides]


class PeakGPUMemory:
    """Every GPU's `nvidia-smi` memory.used (MiB, all processes), sampled every 0.2 s; the max per GPU."""

    def __init__(self):
        self.peak_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.strip().splitlines():
                index, used = (float(x) for x in line.split(","))
                self.peak_mib[int(index)] = max(self.peak_mib.get(int(index), 0.0), used)
            self._stop.wait(0.2)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def run_side(args, side: str, out: Path) -> dict:
    run_dir = out / side
    words = overrides(args, run_dir, side)
    if side == "gpu":
        command = [sys.executable, "-m", "prmppo", *words]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m", "prmppo",
                   *words]
    print("running:", " ".join(command), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with PeakGPUMemory() as memory:
        start = time.perf_counter()
        code = subprocess.run(command, env=env).returncode
        wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{side}: exit {code}; see {run_dir}/__main__.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "perf/iteration_s" in row]
    timed = rows[1:]
    perf = {key: statistics.median(row[f"perf/{key}"] for row in timed) for key in PERF_KEYS
            if all(f"perf/{key}" in row for row in timed)}
    rows_per_iteration = args.prompts * args.group if not args.shape_cpu else None
    tokens = (statistics.median(row["rollout/response_length"] for row in timed) * rows_per_iteration
              if rows_per_iteration else float("nan"))
    banner = json.loads((run_dir / "banner.json").read_text()) if (run_dir / "banner.json").exists() else {}
    return {"command": command, "wall_s": wall, "perf": perf, "iterations": len(rows),
            "response_tokens": tokens, "peak_gib": {k: v / 1024 for k, v in sorted(memory.peak_mib.items())},
            "startup_s": banner.get("startup_s", {}).get("total"), "metrics": rows}


def parity(a: list[dict], b: list[dict]) -> dict[str, float]:
    """The largest |a - b| per metric over the iterations both sides logged."""
    gaps = {}
    for key in PARITY_KEYS:
        pairs = [(x[key], y[key]) for x, y in zip(a, b) if key in x and key in y]
        if pairs:
            gaps[key] = max(abs(x - y) for x, y in pairs)
    return gaps


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"--out {out} already holds runs; give a new --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    sides = args.sides.split(",")
    results = {side: run_side(args, side, out) for side in sides}
    shape = ("debug=smoke (CPU, gloo)" if args.shape_cpu else
             f"{args.prompts} prompts x {args.group} completions x {args.new_tokens} new tokens, lora={args.lora}")
    print(f"\nGPU: {gpu}; {shape}; {args.iterations - 1} timed iterations per side; fsdp ranks: {args.nproc}; "
          f"engine: {'cpu' if args.shape_cpu else args.engine_device or 'colocated on cuda:0'}")
    print("| side | iteration s | generation s | update s | sync s | response tokens/s per training GPU | "
          "peak GiB per GPU | start-up s |")
    print("|---|---|---|---|---|---|---|---|")
    for side, fig in results.items():
        perf, ranks = fig["perf"], args.nproc if side == "fsdp" else 1
        rate = fig["response_tokens"] / perf["iteration_s"] / ranks if perf.get("iteration_s") else float("nan")
        peaks = ", ".join(f"{i}: {g:.1f}" for i, g in fig["peak_gib"].items()) or "n/a"
        print(f"| {side} | {perf.get('iteration_s', float('nan')):.2f} | {perf.get('generate_s', float('nan')):.2f} | "
              f"{perf.get('update_s', float('nan')):.2f} | {perf.get('sync_s', float('nan')):.2f} | {rate:,.0f} | "
              f"{peaks} | {fig['startup_s'] or float('nan'):.1f} |")
    if "gpu" in results and "fsdp" in results:
        gaps = parity(results["gpu"]["metrics"], results["fsdp"]["metrics"])
        print("largest per-iteration |gpu - fsdp|: " + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items()))
        ratio = results["fsdp"]["perf"]["iteration_s"] / results["gpu"]["perf"]["iteration_s"]
        print(f"fsdp / gpu iteration time: {ratio:.2f}x")
        results["parity"] = gaps
    (out / "figures.json").write_text(json.dumps({"gpu": gpu, "shape": shape, "args": vars(args),
                                                  **results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
