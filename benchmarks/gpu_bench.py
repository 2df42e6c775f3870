"""The built-in rollout engine against plain `transformers` `generate`: tokens/s, side by side in one run.

    # on a GPU machine: the Qwen2-0.5B shape (built into a temp dir unless --model names one)
    PYTHONPATH=src python benchmarks/gpu_bench.py --data-dir ../shared/data/gsm8k --out benchmarks/out
    # CPU smoke check of the same code paths (a tiny model, seconds)
    PYTHONPATH=src python benchmarks/gpu_bench.py --shape tiny-qwen2 --rows 8 --new-tokens 16 --out /tmp/bench

What it measures, for each `--rows` (default 64 and 256 rows = rows/samples GSM8K test prompts x
`--samples` samples, prompts formatted by the repo's GSM8K task and tokenized by the model's
tokenizer):

- `generate`: `model.generate` on the left-padded prompt batch, `num_return_sequences=samples`,
  sampling at `--temperature` with top_k=0 and top_p=1 (the full distribution, as the engine
  samples), the model's default cache;
- `engine:<decode>`: `HFEngine.generate` for each `--decode` loop (`static`: static KV cache with
  CUDA graphs on CUDA; `static_eager`: without graphs; `dynamic`: the previous loop), in process;
  with `--compile-decode`, `engine:static+compile` too: the static loop with each decode step's layers
  through one torch.compile graph of a decoder layer (`rollout.compile_decode`; it compiles in the warm-up
  call).

Every row is forced to exactly `--new-tokens` tokens, so both sides do the same work: `generate`
with `min_new_tokens = max_new_tokens` (EOS suppressed), the engine with an EOS id outside the
vocabulary (never sampled). tokens/s = rows x new tokens / seconds of one call (CUDA synchronised),
the median over `--repeats` calls after one warm-up call; the warm-up call's time (which for the
engine includes allocating the static cache and capturing the CUDA graphs) is reported apart.
All sides stay loaded for the whole run and their timed calls are interleaved (one call of each
side per round), so a machine busy with other work slows every side alike. Memory (CUDA): `call
GiB` is what a call allocates above what was resident before it (the static loop's KV cache and
graph pool stay allocated between calls, so they count in `resident_gib`, the allocator's total
after the last round, all sides together).

Writes `<out>/gpu_bench.json` with the figures, the device name and the library versions, and
prints a table. With `--profile`, one more call of each static engine side (`static`,
`static_eager`, `static+compile`) at the largest `--rows` runs under torch.profiler, and its top 20 ops by self
device time (CPU time on a CPU) are printed and written to `<out>/gpu_bench_profile.txt`; under
CUDA graphs the profiler sees the replayed kernels, not the ops that launched them, so
`static_eager` is the side that names the ops. The update and the PPO iteration are measured
elsewhere (`gpu_update_bench.py`).

The decode step's memory-bandwidth bound, per `--rows`: a decode step reads every weight once
(the parameters in the serving dtype; an untied input embedding only gathers its rows, so it is
left out) and every row's keys and values (layers x 2 x KV heads x head size x dtype bytes x rows x
context). At the mean context of the call (the mean prompt length + new tokens / 2: decode step k
attends over the prompt and k tokens), bytes per step / the device's peak bandwidth is the fastest
a step can be, and rows / that time the most tokens/s the device's memory allows (`decode_bound`).
Each side's tokens/s is printed as a percentage of it; prefill is inside the measured time, so the
percentage is a slight underestimate. The bandwidth: `PEAK_MEMORY_TBPS` by the device name,
`--peak-tbps`, or else measured here with a large device-to-device copy (always so on a CPU), which
the table says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DECODE_LOOPS = ("static", "static_eager", "dynamic")
# peak memory bandwidth, TB/s (10^12 bytes/s); the first name found in `torch.cuda.get_device_name` wins.
# From NVIDIA's datasheets: H200 (SXM and NVL) 4.8 TB/s; H100 SXM 3.35 TB/s, H100 NVL 3.9 TB/s, H100 PCIe
# 2 TB/s; A100 80GB SXM 2.039 TB/s, A100 80GB PCIe 1.935 TB/s, A100 40GB 1.555 TB/s; L40S 0.864 TB/s
PEAK_MEMORY_TBPS = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35, "A100-SXM4-80GB": 2.039,
                    "A100 80GB PCIe": 1.935, "A100": 1.555, "L40S": 0.864}


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF-layout model dir; built with scripts/make_shape_model.py "
                        "(--shape) when absent; default: a temp dir")
    parser.add_argument("--shape", default="qwen2-0.5b", help="shape to build when --model is absent")
    parser.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary of a built model")
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "gsm8k"),
                        help="GSM8K dir (train.jsonl for a built tokenizer, test.jsonl for the prompts)")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="rows per call (prompts x samples)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt; must divide every --rows")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side after the warm-up call")
    parser.add_argument("--decode", nargs="+", default=list(DECODE_LOOPS), choices=DECODE_LOOPS)
    parser.add_argument("--compile-decode", action="store_true",
                        help="also time the static loop with its decode step compiled (side engine:static+compile)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16"])
    parser.add_argument("--peak-tbps", type=float, default=0.0,
                        help="the device's peak memory bandwidth in TB/s, for the decode bound (default: by the "
                        "device name, else measured with a copy)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one call of each static engine side at the largest --rows")
    parser.add_argument("--out", required=True, help="directory for gpu_bench.json")
    args = parser.parse_args(argv)
    bad = [rows for rows in args.rows if rows < 1 or rows % args.samples]
    if bad or args.samples < 1:
        parser.error(f"--rows {bad or args.rows} must be positive multiples of --samples {args.samples}")
    for name in ("new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (Path(args.data_dir) / "test.jsonl").is_file():
        parser.error(f"--data-dir {args.data_dir} has no test.jsonl")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    return args


def ensure_model(args) -> Path:
    """The model dir: --model if it exists, else built there (or in a temp dir) by make_shape_model.py."""
    if args.model and (Path(args.model) / "config.json").is_file():
        return Path(args.model)
    out = Path(args.model) if args.model else Path(tempfile.mkdtemp(prefix="gpu_bench_")) / args.shape
    command = [sys.executable, str(REPO / "scripts" / "make_shape_model.py"), "--out", str(out), "--data-dir",
               args.data_dir, "--shape", args.shape, "--vocab", str(args.vocab), "--dtype", args.dtype]
    print("building the model:", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return out


def load_prompts(model_dir: Path, data_dir: str, count: int) -> tuple[list[list[int]], object]:
    """The first `count` GSM8K test prompts as the repo formats them, tokenized; and the tokenizer."""
    from prmppo.models.loading import load_tokenizer
    from prmppo.tasks.gsm8k import GSM8KTask

    task = GSM8KTask(data_dir, test_size=None)
    problems = task.problems("test")
    if count > len(problems):
        raise ValueError(f"{count} prompts asked, {data_dir}/test.jsonl holds {len(problems)}")
    tokenizer = load_tokenizer(str(model_dir))
    return [tokenizer(task.format_prompt(p))["input_ids"] for p in problems[:count]], tokenizer


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(call, device: str) -> tuple[float, int, float | None]:
    """Seconds, tokens and the GiB the call allocated above what was resident before it (CUDA only)."""
    cuda = device.startswith("cuda")
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    tokens = call()
    synchronize(device)
    seconds = time.perf_counter() - start
    working = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
    return seconds, tokens, working


def measure(calls: dict, device: str, repeats: int) -> dict:
    """One warm-up call per side, then `repeats` rounds of one timed call per side, interleaved so that
    a machine busy with other work slows every side alike; medians per side."""
    warmup = {name: timed(call, device)[0] for name, call in calls.items()}
    runs = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            runs[name].append(timed(call, device))
    figures = {}
    for name, results in runs.items():
        median = statistics.median(seconds for seconds, _, _ in results)
        tokens = results[-1][1]
        working = [gib for _, _, gib in results if gib is not None]
        figures[name] = {"warmup_s": round(warmup[name], 3), "seconds": round(median, 4), "tokens": tokens,
                         "tokens_per_s": round(tokens / median, 1),
                         "call_gib": round(max(working), 2) if working else None}
    return figures


def profile_table(call, device: str, row_limit: int = 20) -> str:
    """torch.profiler's top `row_limit` ops of one call, by self device time (self CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        call()
        synchronize(device)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=sort_by, row_limit=row_limit)


def profile_static_sides(calls: dict, rows: int, args) -> str:
    """The profile tables of the static engine sides of `calls`, one after the other."""
    tables = []
    for side, call in calls.items():
        if side.startswith("engine:static"):
            tables.append(f"{side}, {rows} rows x {args.new_tokens} new tokens, one call:\n"
                          f"{profile_table(call, args.device)}")
    return "\n".join(tables)


def generate_call(model, tokenizer, prompts, args):
    """Plain `generate` on the left-padded batch of `prompts`, `args.samples` sequences each."""
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(args.device)
    settings = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                    max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    num_return_sequences=args.samples, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id)

    @torch.inference_mode()
    def call() -> int:
        out = model.generate(**batch, **settings)  # [rows, prompt + new]
        return int((out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])

    return call


def engine_call(engine, prompts, args):
    """`HFEngine.generate`; EOS is an id outside the vocabulary, so rows never stop early."""
    vocab = engine.model.get_input_embeddings().num_embeddings
    seeds = iter(range(10**6))

    def call() -> int:
        tokens, _, _ = engine.generate(prompts, args.samples, args.new_tokens, args.temperature, 1.0, next(seeds),
                                       eos_token_id=vocab, pad_token_id=0)
        return sum(map(len, tokens))

    return call


def load_sides(model_dir: Path, args) -> tuple:
    """The model `generate` runs and one engine per decode loop, all resident for the whole run."""
    from transformers import AutoModelForCausalLM

    from prmppo.rollout.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                 dtype=getattr(torch, args.dtype)).to(args.device).eval()
    engines = {decode: HFEngine(str(model_dir), device=args.device, dtype=args.dtype, decode=decode)
               for decode in args.decode}
    if args.compile_decode:  # the static loop with its decode step compiled (rollout.compile_decode)
        engines["static+compile"] = HFEngine(str(model_dir), device=args.device, dtype=args.dtype, decode="static",
                                             compile_decode=True)
    return model, engines


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, rows: int,
                   context_tokens: float) -> float:
    """Bytes of keys and values one decode step reads: each layer's K and V of every row's context."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes * rows * context_tokens


def decode_bound(weight_bytes: float, kv_bytes: float, bandwidth_bytes_per_s: float, rows: int) -> float:
    """The most tokens/s a decode step of `rows` rows allows when reading `weight_bytes + kv_bytes` at
    `bandwidth_bytes_per_s`: rows / (bytes per step / bandwidth)."""
    return rows / ((weight_bytes + kv_bytes) / bandwidth_bytes_per_s)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter once in its dtype (tied ones once), but for an
    input embedding that is not the output's, of which a step gathers only its tokens' rows."""
    inputs, outputs = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (inputs.numel() * inputs.element_size() if inputs is not outputs else 0)


def copy_bandwidth(device: str, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy of `megabytes` (each byte read once and written once)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return 2 * source.numel() * repeats / (time.perf_counter() - start)


def bandwidth(args) -> tuple[float, str]:
    """The device's memory bandwidth in bytes/s and where it came from."""
    if args.peak_tbps > 0:
        return args.peak_tbps * 1e12, "--peak-tbps"
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(args.device))
        peak = next((tbps for key, tbps in PEAK_MEMORY_TBPS.items() if key in name), None)
        if peak is not None:
            return peak * 1e12, f"{name} datasheet peak"
    megabytes = 1024 if args.device.startswith("cuda") else 256
    return copy_bandwidth(args.device, megabytes), f"measured: a {megabytes} MiB copy (not a peak)"


def bound_figures(config: dict, weight_bytes: int, dtype_bytes: int, rows: int, mean_context: float,
                  bandwidth_bytes_per_s: float, source: str) -> dict:
    """The decode bound of one `--rows` shape, with the numbers it comes from."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv = kv_cache_bytes(config["num_hidden_layers"], kv_heads, head_dim, dtype_bytes, rows, mean_context)
    return {"weight_gb": weight_bytes / 1e9, "mean_context": mean_context, "kv_gb": kv / 1e9,
            "bandwidth_tbps": bandwidth_bytes_per_s / 1e12, "bandwidth_source": source,
            "bound_tokens_per_s": decode_bound(weight_bytes, kv, bandwidth_bytes_per_s, rows)}


def print_bound(results: dict) -> None:
    print(f"\ndecode-step memory-bandwidth bound (bytes per step: the weights once + every row's KV at the mean "
          f"context; bandwidth: {next(iter(results['bound'].values()))['bandwidth_source']})")
    print("| rows | weights GB/step | mean context | KV GB/step | TB/s | bound tokens/s | side | tokens/s | "
          "% of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows, bound in results["bound"].items():
        for side, fig in results["rows"][rows].items():
            print(f"| {rows} | {bound['weight_gb']:.4g} | {bound['mean_context']:.1f} | {bound['kv_gb']:.4g} | "
                  f"{bound['bandwidth_tbps']:.4g} | {bound['bound_tokens_per_s']:.0f} | {side} | "
                  f"{fig['tokens_per_s']:.0f} | {fig['pct_of_bound']:.1f}% |")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def print_table(results: dict) -> None:
    print(f"\ndevice: {results['device']}; model: {results['model']} ({results['shape']}, {results['dtype']}); "
          f"{results['new_tokens']} new tokens per row, every row forced to full length")
    print(f"{'rows':>5} {'side':<20} {'tokens/s':>10} {'s/call':>8} {'ms/token step':>14} {'warm-up s':>10} "
          f"{'call GiB':>9} {'x generate':>11}  loop (CUDA graph buckets) decode attention")
    for rows, sides in results["rows"].items():
        for side, fig in sides.items():
            peak = "-" if fig["call_gib"] is None else f"{fig['call_gib']:.2f}"
            step_ms = 1000 * fig["seconds"] / results["new_tokens"]  # prefill included
            print(f"{rows:>5} {side:<20} {fig['tokens_per_s']:>10.0f} {fig['seconds']:>8.3f} {step_ms:>14.2f} "
                  f"{fig['warmup_s']:>10.2f} {peak:>9} {fig['x_generate']:>10.2f}x  "
                  f"{fig.get('loop', '')} {fig.get('cuda_graph_buckets') or ''} {fig.get('decode_attention') or ''}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    model_dir = ensure_model(args)
    config = json.loads((model_dir / "config.json").read_text())
    prompts, tokenizer = load_prompts(model_dir, args.data_dir, max(args.rows) // args.samples)
    shape = (f"{config.get('model_type')}: hidden {config.get('hidden_size')}, {config.get('num_hidden_layers')} "
             f"layers, vocabulary {config.get('vocab_size')}")
    results = {"device": device_name(args.device), "torch": torch.__version__,
               "transformers": transformers.__version__, "model": str(model_dir), "shape": shape,
               "dtype": args.dtype, "new_tokens": args.new_tokens, "samples_per_prompt": args.samples,
               "temperature": args.temperature,
               "forced_length": "generate: min_new_tokens=max_new_tokens; engine: EOS id outside the vocabulary",
               "rows": {}}
    model, engines = load_sides(model_dir, args)
    memory = bandwidth(args)  # (bytes/s, its source)
    weight_bytes, dtype_bytes = weight_bytes_per_step(model), torch.finfo(getattr(torch, args.dtype)).bits // 8
    results["bound"] = {}
    profiles = ""
    for rows in args.rows:
        chosen = prompts[: rows // args.samples]
        calls = {"generate": generate_call(model, tokenizer, chosen, args)}
        calls.update({f"engine:{decode}": engine_call(engine, chosen, args) for decode, engine in engines.items()})
        sides = measure(calls, args.device, args.repeats)
        for figures in sides.values():
            figures["x_generate"] = round(figures["tokens_per_s"] / sides["generate"]["tokens_per_s"], 2)
        for decode, engine in engines.items():
            sides[f"engine:{decode}"].update(engine.decode_info)  # the loop, the graphs, the decode attention
        results["rows"][rows] = sides
        mean_context = statistics.mean(map(len, chosen)) + args.new_tokens / 2
        bound = results["bound"][rows] = bound_figures(config, weight_bytes, dtype_bytes, rows, mean_context,
                                                       *memory)
        for figures in sides.values():
            figures["pct_of_bound"] = round(100 * figures["tokens_per_s"] / bound["bound_tokens_per_s"], 2)
        if args.profile and rows == max(args.rows):
            profiles = profile_static_sides(calls, rows, args)
        if args.device.startswith("cuda"):
            results["resident_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    if profiles:
        (out / "gpu_bench_profile.txt").write_text(profiles)
        print(f"\n{profiles}")
    print_table(results)
    print_bound(results)
    print(f"\nwrote {out / 'gpu_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
