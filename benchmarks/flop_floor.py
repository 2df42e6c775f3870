"""The least time a PPO iteration's arithmetic allows on a device, phase by phase, for a model shape and a workload.

    python benchmarks/flop_floor.py --shape qwen2-7b --prompt-tokens 120 --new-tokens 256 --rows 256 \
        --measured generation=4.67,no_grad=5.96,update=11.38 --peer-s 32.36 --ratio 3
    python benchmarks/flop_floor.py --model <HF dir> --data-dir <gsm8k dir> ...   # the prompt length measured

A GPU run says how long each phase took; this says how long it must take at least: each phase's matmul and
attention FLOPs at the device's dense bf16 peak (`--tflops`, 989 for an H100 SXM or H200), and for the decode
steps also the bytes they read (every weight once a step, and every row's KV cache at its context) at the
memory bandwidth (`--tbps`, 4.8 for an H200, 3.35 for an H100). Phases, as `python -m prmppo stage=ppo` runs them:

- generation: the prefill over the prompts, then `--new-tokens` decode steps of `--rows` rows; each step the
  longer of its compute and its memory time;
- no-grad forwards: `--no-grad-passes` forwards over every row (the old policy's and the reference's logprobs:
  2 with a KL to the reference, as the trainer runs them; a critic shares the policy's forward);
- update: a forward, its recompute under gradient checkpointing, and the backward: the input gradients (as
  much matmul work as the forward) and, under full fine-tuning, the weight gradients (as much again); under
  LoRA no weight gradient of the frozen base (the rank-r factors' work is left out). Attention's backward is
  counted at twice its forward.

FLOPs: 2 per multiply-add. A token's matmuls are those of the decoder layers (q, k, v, o, gate, up, down) and
the output head; the input embedding is a gather (no FLOPs). Attention per layer and token: 4 x query width x
the positions attended (scores and the weighted sum); in a causal forward over S tokens a token attends to
(S + 1) / 2 on average, a decode step to the prompt plus the tokens so far. With `--peer-s` and `--ratio` it
prints the iteration time the ratio asks for and the share of the device's peak the whole iteration would have
to run at to meet it; with `--measured` each phase's measured time as a multiple of its floor.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shapes() -> dict:
    """scripts/make_shape_model.py's SHAPES (the shapes the GPU benchmarks build)."""
    spec = importlib.util.spec_from_file_location("make_shape_model", REPO / "scripts" / "make_shape_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SHAPES


def dims(config: dict) -> dict:
    """The widths the counts need, from an HF config (`head_dim` absent: hidden / heads)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
            "mlp": config["intermediate_size"], "q_width": heads * head_dim,
            "kv_width": (config.get("num_key_value_heads") or heads) * head_dim, "vocab": config["vocab_size"]}


def matmul_weights(d: dict) -> int:
    """Weights one token multiplies through: each layer's q, k, v, o, gate, up, down, and the output head."""
    layer = d["hidden"] * (2 * d["q_width"] + 2 * d["kv_width"]) + 3 * d["hidden"] * d["mlp"]
    return d["layers"] * layer + d["hidden"] * d["vocab"]


def attention_flops(d: dict, positions: float) -> float:
    """FLOPs of one token's attention over `positions` positions, all layers: scores and weighted sum."""
    return d["layers"] * 4 * d["q_width"] * positions


def phase_flops(d: dict, rows: int, prompt: float, new: float, no_grad_passes: int, lora: bool,
                checkpointing: bool) -> dict:
    """FLOPs per phase of one iteration: `rows` rows of `prompt` + `new` tokens on average."""
    weights, length = matmul_weights(d), prompt + new
    tokens = rows * length
    forward_mm, forward_attn = 2 * weights * tokens, tokens * attention_flops(d, (length + 1) / 2)
    prefill = rows * prompt * (2 * weights + attention_flops(d, (prompt + 1) / 2))
    decode = rows * new * (2 * weights + attention_flops(d, prompt + (new + 1) / 2))
    passes = 1 + checkpointing  # the forward, and its recompute in the backward
    update = forward_mm * (passes + 1 + (not lora)) + forward_attn * (passes + 2)
    return {"generation": prefill + decode, "generation_prefill": prefill, "generation_decode": decode,
            "no_grad": no_grad_passes * (forward_mm + forward_attn), "update": update}


def decode_bytes(d: dict, weight_bytes: float, dtype_bytes: int, rows: int, prompt: float, new: float) -> float:
    """Bytes all decode steps read: the weights once a step, and every row's K and V at its context."""
    kv_per_position = d["layers"] * 2 * d["kv_width"] * dtype_bytes
    return new * (weight_bytes + rows * kv_per_position * (prompt + (new + 1) / 2))


def floors(d: dict, args) -> dict:
    """Seconds per phase at `args.tflops` and `args.tbps`, with the FLOPs and bytes they come from."""
    flops = phase_flops(d, args.rows, args.prompt_tokens, args.new_tokens, args.no_grad_passes, args.lora,
                        args.checkpointing)
    peak = args.tflops * 1e12
    # bytes a decode step reads in weights: every matmul weight, plus an untied input embedding's used rows (none)
    weight_bytes = matmul_weights(d) * args.dtype_bytes
    memory = decode_bytes(d, weight_bytes, args.dtype_bytes, args.rows, args.prompt_tokens, args.new_tokens)
    decode_s = max(flops["generation_decode"] / peak, memory / (args.tbps * 1e12))
    seconds = {"generation": flops["generation_prefill"] / peak + decode_s, "no_grad": flops["no_grad"] / peak,
               "update": flops["update"] / peak}
    return {"flops": flops, "decode_bytes": memory, "decode_memory_s": memory / (args.tbps * 1e12),
            "seconds": seconds, "total_s": sum(seconds.values()),
            "total_flops": flops["generation"] + flops["no_grad"] + flops["update"]}


def parse_measured(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in ("generation", "no_grad", "update"):
            raise SystemExit(f"--measured: {name!r} is no phase (generation, no_grad, update)")
        out[name] = float(value)
    return out


def mean_prompt_tokens(model_dir: str, data_dir: str, count: int) -> float:
    """Mean tokens of the first `count` GSM8K train prompts as the repo formats them, with the model's tokenizer."""
    sys.path.insert(0, str(REPO / "src"))
    from prmppo.models.loading import load_tokenizer
    from prmppo.tasks.gsm8k import GSM8KTask

    tokenizer = load_tokenizer(model_dir)
    task = GSM8KTask(data_dir, test_size=None)
    return statistics.mean(len(tokenizer(task.format_prompt(p))["input_ids"]) for p in task.problems("train")[:count])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2-0.5b", help="a shape of scripts/make_shape_model.py")
    parser.add_argument("--vocab", type=int, default=16384, help="vocabulary of --shape (the GSM8K BPE's)")
    parser.add_argument("--model", default="", help="an HF model dir: its config.json instead of --shape")
    parser.add_argument("--data-dir", default="", help="GSM8K dir: measure --prompt-tokens with --model's tokenizer")
    parser.add_argument("--prompt-tokens", type=float, default=0.0, help="mean prompt tokens of a row")
    parser.add_argument("--new-tokens", type=float, default=256.0, help="mean response tokens of a row")
    parser.add_argument("--rows", type=int, default=256, help="responses per iteration (prompts x samples)")
    parser.add_argument("--no-grad-passes", type=int, default=2, help="forwards over every row before the update")
    parser.add_argument("--full", dest="lora", action="store_false", help="full fine-tuning (default: LoRA)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="no recompute in the backward (default: gradient checkpointing on)")
    parser.add_argument("--tflops", type=float, default=989.0, help="dense bf16 peak, TFLOP/s")
    parser.add_argument("--tbps", type=float, default=4.8, help="memory bandwidth, TB/s")
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--measured", default="", help="measured seconds, e.g. generation=4.7,no_grad=6.0,update=11.4")
    parser.add_argument("--peer-s", type=float, default=0.0, help="the peer's measured iteration, s")
    parser.add_argument("--ratio", type=float, default=0.0, help="the speed-up over the peer asked for")
    parser.add_argument("--json", default="", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.model:
        args.config = json.loads((Path(args.model) / "config.json").read_text())
    else:
        known = shapes()
        if args.shape not in known:
            parser.error(f"--shape {args.shape!r} is unknown; known: {sorted(known)}")
        args.config = {**known[args.shape], "vocab_size": args.vocab}
    if args.data_dir:
        if not args.model:
            parser.error("--data-dir measures the prompts with --model's tokenizer: give --model")
        args.prompt_tokens = mean_prompt_tokens(args.model, args.data_dir, args.rows)
    if args.prompt_tokens <= 0:
        parser.error("give --prompt-tokens (> 0), or --model and --data-dir to measure it")
    if (args.peer_s > 0) != (args.ratio > 0):
        parser.error("--peer-s and --ratio go together")
    args.measured_s = parse_measured(args.measured)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    d = dims(args.config)
    result = floors(d, args)
    print(f"shape: {d['layers']} layers, hidden {d['hidden']}, MLP {d['mlp']}, vocab {d['vocab']}: "
          f"{matmul_weights(d) / 1e9:.3f}B matmul weights a token")
    print(f"workload: {args.rows} rows x ({args.prompt_tokens:.1f} prompt + {args.new_tokens:.0f} new) tokens, "
          f"{'LoRA' if args.lora else 'full fine-tuning'}, checkpointing {'on' if args.checkpointing else 'off'}, "
          f"{args.no_grad_passes} no-grad passes; peak {args.tflops:g} TFLOP/s, {args.tbps:g} TB/s")
    print("| phase | TFLOP | floor s | measured s | measured / floor |")
    print("|---|---|---|---|---|")
    for name, seconds in result["seconds"].items():
        measured = args.measured_s.get(name)
        tail = f"{measured:.3f} | {measured / seconds:.1f}x" if measured is not None else "- | -"
        print(f"| {name} | {result['flops'][name] / 1e12:.1f} | {seconds:.3f} | {tail} |")
    print(f"decode steps read {result['decode_bytes'] / 1e9:.1f} GB: {result['decode_memory_s']:.3f} s at "
          f"{args.tbps:g} TB/s")
    print(f"iteration floor: {result['total_s']:.3f} s ({result['total_flops'] / 1e12:.1f} TFLOP)")
    if args.peer_s > 0:
        target = args.peer_s / args.ratio
        result["target_s"], result["needed_peak_share"] = target, result["total_s"] / target
        print(f"{args.ratio:g}x the peer's {args.peer_s:g} s is {target:.3f} s: the whole iteration at "
              f"{100 * result['needed_peak_share']:.1f}% of the floor's rates")
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items()}, indent=1))
    return result


if __name__ == "__main__":
    main()
