"""Rollout engines side by side: tokens/s of `vllm` vs `hf`, and sync latency of `adapter` vs `checkpoint`.

    bash scripts/setup_vllm_env.sh                       # once: the vLLM engine environment
    PYTHONPATH=src python benchmarks/rollout_bench.py    # ~3 min on a 2-core CPU; --help for the knobs

Both engines run as the trainer runs them (a worker process each, started through `RolloutClient`,
requests through the spool), on the same model and the same request, in one run, interleaved
repeat by repeat so that a busy machine slows both alike; figures are medians over the repeats.

- model: the embedded default's tiny Mistral for `task=arith` (hidden size 96, 4 layers) with 3
  attention heads and 1 KV head (head size 32, which vLLM's CPU attention supports; the default
  4 heads give 24, which it does not), freshly initialised: it rarely emits EOS, so nearly every
  row runs to `--max-new-tokens` and both engines generate the same number of tokens;
- request: the first `--prompts` test prompts x `--samples` samples at temperature 1;
- throughput: response tokens / generate seconds as the worker measures them, once with the base
  weights and once with a LoRA adapter served (peft on the hf engine, a LoRARequest on vLLM);
- sync latency: `WeightSync.push` (the trainer saving a merged HF checkpoint or the LoRA adapter,
  or writing the merged weights into the buffer it shares with the hf engine,
  exactly what PPO does) and the engine's load of those weights as the worker reports it
  (`RolloutResult.load_seconds` of the next request), per sync mode.

Threads: vLLM on CPU binds its worker to one core and leaves the others to the caller; the hf
engine uses torch's default thread count unless `--hf-threads` sets it. Both are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"),
                        help="the vLLM engine environment's interpreter (scripts/setup_vllm_env.sh)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5, help="generate requests per engine and weights")
    parser.add_argument("--syncs", type=int, default=5, help="syncs per engine and sync mode")
    parser.add_argument("--hf-threads", type=int, default=0, help="OMP/torch threads of the hf worker; 0: default")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    parser.add_argument("--out", default="", help="also write the figures as JSON here")
    return parser.parse_args()


def build_policy(work: Path):
    """The tiny model for task=arith (head size 32), its tokenizer, the task and a LoRA policy on it."""
    from hydra import compose, initialize_config_dir

    from prmppo.config.build import build
    from prmppo.config.store import register_schemas
    from prmppo.models.loading import load_model, load_tokenizer

    register_schemas()
    # LoRA factors alone: vLLM serves no full-weight copy of the final norm beside an adapter (the config
    # refuses rollout=vllm with adapter sync and lora.modules_to_save), so neither engine gets one here
    overrides = ["model.num_attention_heads=3", "model.num_key_value_heads=1", "lora.modules_to_save=[]"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    task = build(cfg.task, "task")
    model_dir = build(cfg.model, "model").materialize(task, work / "model")
    tokenizer = load_tokenizer(model_dir)
    policy = build(cfg.lora, "policy", base_model=load_model(model_dir, "float32", "cpu"), detach_value_hidden=True,
                   critic=False)  # only its weights are synced here
    return model_dir, tokenizer, task, policy, cfg.lora.r


@torch.no_grad()
def nudge(policy, generator: torch.Generator) -> None:
    """Move every LoRA weight a little, as an optimizer step would (B starts at zero: the adapter is a no-op)."""
    for name, parameter in policy.model.named_parameters():
        if "lora_" in name:
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


class Bench:
    """One worker per engine, and the request helpers both share."""

    def __init__(self, args, model_dir: Path, tokenizer, task, lora_rank: int, work: Path):
        from prmppo.config.schema import RolloutConfig
        from prmppo.rollout.client import RolloutClient
        from prmppo.rollout.protocol import WeightsSpec

        # the worker timeouts a run gets by default
        timeouts = {key: getattr(RolloutConfig, key)
                    for key in ("startup_timeout_s", "request_timeout_s", "heartbeat_timeout_s")}

        self.args, self.tokenizer = args, tokenizer
        problems = task.problems("test")[: args.prompts]
        self.prompts = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems]
        self.ids = 0
        hf_env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.hf_threads)} if args.hf_threads else {}))
        self.clients = {
            "hf": RolloutClient(work / "spool-hf", "hf", model_dir, work / "worker-hf.log", env=hf_env,
                                **timeouts),
            "vllm": RolloutClient(work / "spool-vllm", "vllm", model_dir, work / "worker-vllm.log",
                                  python=args.vllm_python, **{**timeouts, "startup_timeout_s": 600},
                                  engine_options={"max_lora_rank": lora_rank,
                                                  "gpu_memory_utilization": args.gpu_memory_utilization}),
        }
        self.weights = {name: WeightsSpec("base", None, 0) for name in self.clients}

    def request(self, engine: str, weights, prompts: list[list[int]], samples: int, max_new_tokens: int):
        from prmppo.rollout.protocol import RolloutRequest

        self.ids += 1
        request = RolloutRequest(request_id=f"bench{self.ids}", weights=weights, prompt_token_ids=prompts,
                                 n_samples_per_prompt=samples, max_new_tokens=max_new_tokens, temperature=1.0,
                                 top_p=1.0, seed=self.ids, eos_token_id=self.tokenizer.eos_token_id,
                                 pad_token_id=self.tokenizer.pad_token_id)
        start = time.perf_counter()
        result = self.clients[engine].generate(request)
        self.weights[engine] = weights
        return result, time.perf_counter() - start

    def throughput(self, engine: str, weights) -> float:
        """Response tokens per second of generate time, for the full request."""
        result, _ = self.request(engine, weights, self.prompts, self.args.samples, self.args.max_new_tokens)
        return sum(len(row) for row in result.token_ids) / result.generate_seconds

    def load(self, engine: str, weights) -> float:
        """Seconds the worker spent loading `weights`, reported with a 1-prompt, 1-token request naming them."""
        return self.request(engine, weights, self.prompts[:1], 1, 1)[0].load_seconds


def measure_throughput(bench: Bench, adapter_specs: dict) -> dict:
    """Median tokens/s per weights kind and engine."""
    from prmppo.rollout.protocol import WeightsSpec

    figures: dict[str, dict[str, list[float]]] = {"base": {}, "adapter": {}}
    for kind in ("base", "adapter"):
        for engine in bench.clients:  # load the weights first: throughput excludes loading
            bench.load(engine, adapter_specs[engine] if kind == "adapter" else WeightsSpec("base", None, 0))
        for _ in range(bench.args.repeats):
            for engine in bench.clients:
                figures[kind].setdefault(engine, []).append(bench.throughput(engine, bench.weights[engine]))
    return {kind: {engine: statistics.median(values) for engine, values in per.items()}
            for kind, per in figures.items()}


def measure_sync(bench: Bench, policy, tokenizer, work: Path) -> dict:
    """Median seconds to save (trainer) and load (engine) one sync, per engine and sync mode."""
    from prmppo.ppo.sync import WeightSync

    generator = torch.Generator().manual_seed(0)
    out: dict = {}
    for mode in ("adapter", "checkpoint", "shared"):
        engines = [engine for engine in bench.clients if mode != "shared" or engine == "hf"]  # shared: hf only
        syncs = {engine: WeightSync(mode, 1, work / f"sync-{mode}-{engine}", tokenizer) for engine in engines}
        saves, loads = {e: [] for e in engines}, {e: [] for e in engines}
        for _ in range(bench.args.syncs):
            nudge(policy, generator)
            for engine, sync in syncs.items():
                start = time.perf_counter()
                spec = sync.push(policy)
                saves[engine].append(time.perf_counter() - start)
                loads[engine].append(bench.load(engine, spec))
        out[mode] = {engine: {"save_s": statistics.median(saves[engine]), "load_s": statistics.median(loads[engine])}
                     for engine in engines}
        for sync in syncs.values():
            if sync.shared is not None:
                sync.shared.close()
    return out


def main() -> int:
    args = parse_args()
    if not os.path.isfile(args.vllm_python):
        print(f"no vLLM engine environment at {args.vllm_python}: run `bash scripts/setup_vllm_env.sh` first",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        work = Path(tmp)
        model_dir, tokenizer, task, policy, rank = build_policy(work)
        nudge(policy, torch.Generator().manual_seed(1))  # a non-trivial adapter for the adapter throughput
        bench = Bench(args, model_dir, tokenizer, task, rank, work)
        started = {}
        for engine, client in bench.clients.items():
            start = time.perf_counter()
            client.start()
            started[engine] = time.perf_counter() - start
        try:
            from prmppo.ppo.sync import WeightSync

            adapter_specs = {engine: WeightSync("adapter", 1, work / f"adapter-{engine}", tokenizer).push(policy)
                             for engine in bench.clients}
            throughput = measure_throughput(bench, adapter_specs)
            sync = measure_sync(bench, policy, tokenizer, work)
        finally:
            for client in bench.clients.values():
                client.close()
    figures = {"request": {"prompts": len(bench.prompts), "samples_per_prompt": args.samples,
                           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "syncs": args.syncs},
               "threads": {"hf": args.hf_threads or torch.get_num_threads(), "vllm": "1 (vLLM's CPU binding)"},
               "engine_start_s": started, "tokens_per_s": throughput, "sync": sync}
    print(json.dumps(figures, indent=2))
    report(figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def report(figures: dict) -> None:
    """The figures as Markdown tables (what benchmarks/RESULTS.md records)."""
    tps = figures["tokens_per_s"]
    print("\n| weights served | hf tokens/s | vllm tokens/s | vllm / hf |\n|---|---|---|---|")
    for kind in ("base", "adapter"):
        print(f"| {kind} | {tps[kind]['hf']:.0f} | {tps[kind]['vllm']:.0f} | {tps[kind]['vllm'] / tps[kind]['hf']:.2f}x |")
    print("\n| engine | sync | trainer save (ms) | engine load (ms) | total (ms) |\n|---|---|---|---|---|")
    for engine in ("hf", "vllm"):
        for mode in ("adapter", "checkpoint", "shared"):
            cell = figures["sync"][mode].get(engine)
            if cell is None:
                continue
            print(f"| {engine} | {mode} | {cell['save_s'] * 1e3:.0f} | {cell['load_s'] * 1e3:.0f} | "
                  f"{(cell['save_s'] + cell['load_s']) * 1e3:.0f} |")
    print(f"\nengine start (s): {', '.join(f'{k} {v:.1f}' for k, v in figures['engine_start_s'].items())}")


if __name__ == "__main__":
    sys.exit(main())
