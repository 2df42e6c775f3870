"""prmppo's GRPO iteration vs TRL's `GRPOTrainer` on the same model, prompts and batch shape.

One run, two sides, one after the other on the same machine:

- prmppo: `python -m prmppo stage=ppo` with `ppo.advantage_estimator=grpo`, `lora=adapter`,
  `arm=orm`, `sft.steps=0` (the model as given), its built-in engine (`rollout=hf`, or
  `--engine inprocess --sync none`: the engine in the trainer's process, one copy of the weights); the
  iteration time is the median of `perf/iteration_s` in its metrics.jsonl after the first
  iteration, with the split into generation, scoring, update and sync.
- TRL: `trl.GRPOTrainer` with a peft `LoraConfig` of the same rank and modules, transformers
  `generate` (no vLLM), the same group size, completions per iteration, optimizer-step rows and
  micro-batch rows, the outcome reward from the task's own verifier. An iteration is the
  optimizer steps that consume one generation batch; its time is the median over iterations
  after the first, from trainer-callback timestamps.

Each side runs in its own process; the peak GPU memory of each is `nvidia-smi`'s `memory.used`
sampled every 0.2 s while it runs (all processes: prmppo's trainer and rollout worker together),
so both are measured the same way. trl, datasets, dill and multiprocess are needed for the TRL
side only; they are not prmppo dependencies.

    python scripts/make_shape_model.py --out models/qwen2-0.5b-shape --data-dir ../shared/data/gsm8k
    python benchmarks/trl_compare.py --model models/qwen2-0.5b-shape --data-dir ../shared/data/gsm8k
    python benchmarks/trl_compare.py --model /tmp/tq --data-dir ../shared/data/gsm8k --device cpu \
        --prompts 4 --new-tokens 8 --iterations 2      # a CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SIDES = ("prmppo", "trl")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF-layout model directory (scripts/make_shape_model.py)")
    parser.add_argument("--data-dir", required=True, help="GSM8K directory (train.jsonl, test.jsonl)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per iteration")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=5, help="the first is warm-up, not counted")
    parser.add_argument("--minibatch-rows", type=int, default=64, help="completions per optimizer step")
    parser.add_argument("--micro-rows", type=int, default=32, help="completions per forward/backward")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--kl", type=float, default=0.01, help="prmppo ppo.kl_coef and TRL beta (>0: both run a reference pass)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--gradient-checkpointing", default="off", choices=["on", "off"],
                        help="both sides: ppo.gradient_checkpointing / GRPOConfig.gradient_checkpointing "
                             "(TRL's own default is on)")
    parser.add_argument("--sync", default="checkpoint", choices=["checkpoint", "adapter", "shared", "none"],
                        help="prmppo's rollout.sync (none: the only one --engine inprocess takes)")
    parser.add_argument("--engine", default="hf", choices=["hf", "inprocess"],
                        help="prmppo's rollout engine: hf (a worker process of its own) or inprocess (in the "
                        "trainer's process, sampling with the trainer's own weights: one copy of them)")
    parser.add_argument("--prmppo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="one more Hydra override of the prmppo side (repeatable), e.g. ppo.compile=true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--sides", default="prmppo,trl")
    parser.add_argument("--out", default="runs/trl_compare", help="run directories and figures.json go here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side here
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prompts * args.group % args.minibatch_rows or args.minibatch_rows % args.micro_rows:
        parser.error(f"--prompts x --group = {args.prompts * args.group} must be a multiple of --minibatch-rows "
                     f"{args.minibatch_rows}, itself a multiple of --micro-rows {args.micro_rows}")
    if args.iterations < 2:
        parser.error("--iterations must be >= 2: the first iteration is warm-up")
    for name in args.sides.split(","):
        if name not in SIDES:
            parser.error(f"--sides: {name!r} is not one of {SIDES}")
    return args


# --------------------------------------------------------------------------- prmppo side


def prmppo_overrides(args, run_dir: Path) -> list[str]:
    topology = "gpu" if args.device == "cuda" else "cpu"
    return [
        "stage=ppo", "model=hf", f"model.path={Path(args.model).resolve()}", "model.dtype=bfloat16" if args.device == "cuda"
        else "model.dtype=float32", "task=gsm8k", f"task.data_dir={Path(args.data_dir).resolve()}", "arm=orm",
        f"topology={topology}", "lora=adapter", f"lora.r={args.lora_r}", f"lora.alpha={2 * args.lora_r}",
        "lora.modules_to_save=[]", "sft.steps=0", "sft.eval_problems=0", "ppo.advantage_estimator=grpo",
        f"ppo.prompts_per_iteration={args.prompts}", f"ppo.n_samples_per_prompt={args.group}",
        f"ppo.max_new_tokens={args.new_tokens}", f"ppo.iterations={args.iterations}",
        f"ppo.minibatch_rows={args.minibatch_rows}", f"ppo.micro_batch_rows={args.micro_rows}",
        f"ppo.kl_coef={args.kl}", f"ppo.lr={args.lr}", "eval.every=0", f"hydra.run.dir={run_dir.resolve()}",
        f"artifacts_dir={(run_dir / 'artifacts').resolve()}",
        f"ppo.gradient_checkpointing={args.gradient_checkpointing == 'on'}", f"rollout={args.engine}",
        f"rollout.sync={args.sync}",
        *args.prmppo_override,
    ]


def run_prmppo(args, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "prmppo", *prmppo_overrides(args, run_dir)]
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "perf/iteration_s" in row]
    first, rows = rows[0] if rows else None, rows[1:]  # the first iteration is warm-up
    if not rows:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no iteration after the first")
    keys = ("iteration_s", "generate_s", "score_s", "assemble_s", "update_s", "sync_s")
    startup = json.loads((run_dir / "banner.json").read_text()).get("startup_s", {})
    return ({key: statistics.median(row[f"perf/{key}"] for row in rows) for key in keys}
            | {"iterations": len(rows), "first_iteration_s": first["perf/iteration_s"], "startup_s": startup})


# --------------------------------------------------------------------------- TRL side


def run_trl(args, run_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prmppo.tasks.gsm8k import GSM8KTask

    task = GSM8KTask(data_dir=args.data_dir)
    problems = task.problems("train")[: args.prompts * args.iterations]
    by_prompt = {task.format_prompt(p): p for p in problems}
    # a fixed fingerprint: hashing the table can fail for some datasets/pyarrow pairs
    data = Dataset(InMemoryTable.from_pydict({"prompt": list(by_prompt)}), fingerprint="gsm8k-train-prompts")

    def outcome(prompts, completions, **_):
        return [float(task.verify(by_prompt[p], c)) for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    rows = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(run_dir), max_steps=args.iterations * rows // args.minibatch_rows,
        per_device_train_batch_size=args.micro_rows, gradient_accumulation_steps=args.minibatch_rows // args.micro_rows,
        generation_batch_size=rows, num_generations=args.group, max_completion_length=args.new_tokens,
        temperature=1.0, top_p=1.0, beta=args.kl, learning_rate=args.lr, num_iterations=1,
        bf16=args.device == "cuda", use_cpu=args.device == "cpu", use_vllm=False, logging_steps=1,
        report_to="none", save_strategy="no", remove_unused_columns=False, shuffle_dataset=False,
        dataloader_num_workers=0, seed=0, gradient_checkpointing=args.gradient_checkpointing == "on")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    tokenizer.padding_side = "left"
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=outcome, args=config, train_dataset=data,
                          processing_class=tokenizer, peft_config=lora, callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    steps = rows // args.minibatch_rows  # optimizer steps per generation batch
    ends = [start, *clock.ends]
    iteration_s = [ends[i + steps] - ends[i] for i in range(steps, len(ends) - steps, steps)]
    if not iteration_s:
        raise RuntimeError(f"TRL ran {len(clock.ends)} optimizer steps: too few for one timed iteration")
    return {"iteration_s": statistics.median(iteration_s), "iterations": len(iteration_s)}


# --------------------------------------------------------------------------- driver


class PeakGPUMemory:
    """`nvidia-smi`'s memory.used (MiB, all processes on GPU 0), sampled every 0.2 s; the max."""

    def __init__(self):
        self.peak_mib, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                self.peak_mib = max(self.peak_mib, float(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()


def one_side(args, side: str, out: Path) -> dict:
    """Run `side` in a child process of this script; its figures plus the GPU memory peak."""
    result = out / f"{side}.json"
    cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--result", str(result)]
    with PeakGPUMemory() as memory:
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - start
    figures = json.loads(result.read_text())
    return figures | {"peak_gpu_gib": memory.peak_mib / 1024 if args.device == "cuda" else None, "process_s": wall}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.side:
        run_dir = out / args.side
        figures = run_prmppo(args, run_dir) if args.side == "prmppo" else run_trl(args, run_dir)
        Path(args.result).write_text(json.dumps(figures))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if any((out / side).exists() for side in SIDES):
        print(f"--out {out} already holds runs; give a new --out", file=sys.stderr)
        return 2
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    results = {side: one_side(args, side, out) for side in args.sides.split(",")}
    shape = f"{args.prompts} prompts x {args.group} completions x {args.new_tokens} new tokens"
    print(f"\nGPU: {gpu}; {shape}; LoRA r {args.lora_r}; optimizer steps of {args.minibatch_rows} rows, "
          f"micro-batches of {args.micro_rows}; gradient checkpointing {args.gradient_checkpointing}; "
          f"{args.iterations - 1} timed iterations each"
          + (f"; prmppo overrides {args.prmppo_override} (they win over the shape above)"
             if args.prmppo_override else ""))
    print("| side | iteration s (median) | generation s | update s | peak GPU memory GiB |")
    print("|---|---|---|---|---|")
    for side, fig in results.items():
        memory = f"{fig['peak_gpu_gib']:.1f}" if fig["peak_gpu_gib"] is not None else "n/a"
        print(f"| {side} | {fig['iteration_s']:.2f} | {fig.get('generate_s', float('nan')):.2f} | "
              f"{fig.get('update_s', float('nan')):.2f} | {memory} |")
    prm = results.get("prmppo")
    if prm is not None:
        print(f"prmppo (rollout={args.engine}, rollout.sync={args.sync}): assemble {prm['assemble_s']:.2f} s, sync {prm['sync_s']:.2f} s, "
              f"first iteration {prm['first_iteration_s']:.2f} s; start-up (s) {prm['startup_s']}")
    if len(results) == 2:
        ratio = results["trl"]["iteration_s"] / results["prmppo"]["iteration_s"]
        print(f"TRL / prmppo iteration time: {ratio:.2f}x")
    (out / "figures.json").write_text(json.dumps({"gpu": gpu, "shape": shape, "args": vars(args), **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
