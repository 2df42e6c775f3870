"""The PPO update alone: tokens/s, MFU, peak memory.

    # on a GPU, the issue-16 shape (Qwen2-0.5B, 16k vocabulary, random weights, built in memory):
    PYTHONPATH=src python benchmarks/gpu_update_bench.py --lora
    PYTHONPATH=src python benchmarks/gpu_update_bench.py            # full fine-tuning
    PYTHONPATH=src python benchmarks/gpu_update_bench.py --model models/qwen2-0.5b-shape --lora
    PYTHONPATH=src python benchmarks/gpu_update_bench.py --lora --profile       # where the time goes
    PYTHONPATH=src python benchmarks/gpu_update_bench.py --lora --compile            # compiled layers
    # CPU smoke check (seconds):
    PYTHONPATH=src python benchmarks/gpu_update_bench.py --shape tiny-qwen2 --rows 8 --lora

What runs: `PPOTrainer.update` from ppo/loop.py on the real policy classes of models/policy.py
(`LoraPolicy` or `FullPolicy`), on a synthetic rollout of the issue's shape: `--rows` responses
(64 prompts x 4 samples) after prompts of ~`--prompt-tokens` tokens (uniform in +-20%), responses
uniform in [`--min-new-tokens`, `--new-tokens`] (set both equal for all-full-length rows), random
token ids, random advantages, `ppo.advantage_estimator=rloo` (no critic; `--critic` for gae). The
no-grad forwards that make the old and reference logprobs (`_old_and_reference`, step 3 of the
loop, over the update's plan) are timed too. `--profile` prints torch.profiler's top-20 ops of
one more update, the share of that update's wall time the device was busy, and how many
host calls that can wait on the device it made. One untimed warm-up update, then `--repeats` timed ones.

The update is the code as it is (chunked LM-head logprobs, length-bucketed micro-batches cut to
their longest row, fused AdamW on CUDA, `--autocast` / `--gradient-checkpointing` / `--compile` as
given; with `--compile` the untimed warm-up update pays the compilation). The figures of the earlier
micro-batch code beside it (full [B, T, V] float32 logits, padded micro-batches, unfused AdamW) in
benchmarks/RESULTS.md were measured with this script at commit b5d27e8, which still carried that code.

Figures: tokens/s = real (non-padding) prompt + response tokens per update / update seconds
(median of the repeats); MFU = 6 * N * tokens/s / peak, with N = every parameter of the base
model (embeddings included, the tied LM head counted once; LoRA factors and the value head
excluded): the usual 6N-per-token count of training FLOPs, which ignores attention's FLOPs and,
under LoRA, counts the frozen weights' gradients that are never computed (the exact count there
is nearer 4N), the count every figure in benchmarks/RESULTS.md uses. Peak: the GPU's dense bf16 tensor throughput, from
`PEAK_BF16_TFLOPS` by `torch.cuda.get_device_name` or `--peak-tflops`. Memory:
`torch.cuda.max_memory_allocated` over the updates (model, optimizer and activations).
First ratio dev: max |ratio - 1| on the warm-up update's first micro-batch, where the policy has not
moved: what the ratio tripwire (`ppo.max_first_ratio_dev`, 1e-3) sees from kernel noise alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# dense (no sparsity) bf16 tensor-core peak, TFLOP/s; the first name found in the device name wins
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
                    "A10G": 125.0, "L4": 121.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF-layout model dir; default: --shape built in memory")
    parser.add_argument("--shape", default="qwen2-0.5b", help="scripts/make_shape_model.py shape (no --model)")
    parser.add_argument("--vocab", type=int, default=16384, help="vocabulary of the built shape")
    parser.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                        help="model.dtype; default bfloat16 on a GPU, float32 on CPU (where bf16 matmuls crawl)")
    parser.add_argument("--autocast", default="none", choices=["none", "bfloat16"], help="ppo.autocast")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="ppo.gradient_checkpointing")
    parser.add_argument("--compile", action="store_true", help="ppo.compile: compiled decoder layers")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on every linear layer; else full fine-tuning")
    parser.add_argument("--critic", action="store_true", help="gae with a value head; else rloo")
    parser.add_argument("--rows", type=int, default=256, help="responses per update (prompts x samples)")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=256, help="longest response (max_new_tokens)")
    parser.add_argument("--min-new-tokens", type=int, default=64, help="shortest response")
    parser.add_argument("--minibatch-rows", type=int, default=0, help="ppo.minibatch_rows; default min(64, rows)")
    parser.add_argument("--micro-batch-rows", type=int, default=0,
                        help="ppo.micro_batch_rows; default min(32, minibatch rows)")
    parser.add_argument("--logit-chunk-tokens", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=0,
                        help="ppo.micro_batch_tokens: size micro-batches by tokens; 0: by rows only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's bf16 peak")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler's top-20 ops (by CUDA time) of one more update")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.minibatch_rows = args.minibatch_rows or min(64, args.rows)
    args.micro_batch_rows = args.micro_batch_rows or min(32, args.minibatch_rows)
    if args.rows % args.minibatch_rows or args.minibatch_rows % args.micro_batch_rows:
        parser.error(f"--micro-batch-rows {args.micro_batch_rows} must divide --minibatch-rows "
                     f"{args.minibatch_rows}, which must divide --rows {args.rows}")
    if not 1 <= args.min_new_tokens <= args.new_tokens:
        parser.error(f"--min-new-tokens {args.min_new_tokens} must be in [1, --new-tokens {args.new_tokens}]")
    return args


def peak_tflops(args) -> float | None:
    if args.peak_tflops > 0:
        return args.peak_tflops
    if not args.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(args.device))
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def load_base(args):
    """The base causal LM on the device in --dtype: --model's weights, or the --shape at random."""
    from prmppo.models.loading import load_model

    if args.model:
        return load_model(args.model, args.dtype, args.device)
    spec = importlib.util.spec_from_file_location("make_shape_model", REPO / "scripts" / "make_shape_model.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    if args.shape not in shapes.SHAPES:
        sys.exit(f"--shape {args.shape!r} is not one of {', '.join(shapes.SHAPES)}")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=args.vocab, tie_word_embeddings=True, use_sliding_window=False,
                         max_position_embeddings=4096, **shapes.SHAPES[args.shape])
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(getattr(torch, args.dtype)).to(args.device).eval()


def build_policy(args):
    """(policy, N): the policy and the base model's parameter count (shared tensors once, LoRA excluded)."""
    from prmppo.models.policy import FullPolicy, LoraPolicy

    base = load_base(args)
    n_params = sum(p.numel() for p in base.parameters())  # before any adapter joins it
    if args.lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        policy = LoraPolicy(base, detach_value_hidden=True, critic=args.critic, r=16, alpha=32, dropout=0.0,
                            target_modules=targets, modules_to_save=[])
        return policy, n_params
    return FullPolicy(base, detach_value_hidden=True, critic=args.critic), n_params


def ppo_config(args):
    """The PPO settings of the benchmark's update."""
    from prmppo.config.schema import PPOConfig

    return PPOConfig(iterations=10, prompts_per_iteration=args.rows // 4, n_samples_per_prompt=4,
                     minibatch_rows=args.minibatch_rows, micro_batch_rows=args.micro_batch_rows,
                     max_new_tokens=args.new_tokens, advantage_estimator="gae" if args.critic else "rloo",
                     logit_chunk_tokens=args.logit_chunk_tokens, autocast=args.autocast,
                     micro_batch_tokens=args.micro_batch_tokens or None,
                     gradient_checkpointing=args.gradient_checkpointing, compile=args.compile,
                     warmup_steps=0, lr=1e-6,
                     max_skipped_fraction=1.0, max_consecutive_skipped_steps=1000)


def synthetic_rollout(args, vocab_size: int):
    """A RolloutBatch of the issue's shape with random token ids (ids 4.. : no special tokens)."""
    from prmppo.ppo.batch import RolloutBatch, collate, pad_floats

    g = torch.Generator().manual_seed(0)
    low, high = int(args.prompt_tokens * 0.8), int(args.prompt_tokens * 1.2) + 1
    prompt_lengths = torch.randint(max(low, 1), max(high, 2), (args.rows // 4,), generator=g).repeat_interleave(4)
    response_lengths = torch.randint(args.min_new_tokens, args.new_tokens + 1, (args.rows,), generator=g)
    prompts = [torch.randint(4, vocab_size, (int(n),), generator=g).tolist() for n in prompt_lengths]
    responses = [torch.randint(4, vocab_size, (int(n),), generator=g).tolist() for n in response_lengths]
    ids, att, pos, resp, mask, plen = collate(prompts, responses, pad_token_id=0)
    finish = ["length" if int(n) == args.new_tokens else "stop" for n in response_lengths]
    return RolloutBatch(list(range(args.rows)), [""] * args.rows, finish, ids, att, pos, resp, mask,
                        pad_floats([[0.0] * len(r) for r in responses], resp.shape[1]), torch.zeros(args.rows), plen)


class _Task:
    def problems(self, split):  # noqa: ARG002 - PPOTrainer reads the RL prompts from the task
        return list(range(8))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _no_grad_pass(trainer, rollout, plan):
    """Step 3's forwards: old and reference logprobs and values of every row, over `plan`."""
    return trainer._old_and_reference(rollout, plan, torch.ones(len(rollout)))


def _train_batch(trainer, rollout, plan, device: torch.device):
    """The TrainBatch the update reads: the trainer's own old/reference logprobs, random advantages."""
    from prmppo.ppo.batch import TrainBatch

    old_lp, ref_lp, values, _ = _no_grad_pass(trainer, rollout, plan)
    mask = rollout.response_mask.to(device)  # [B, T]
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(mask.shape, generator=g).to(device) * mask
    returns = torch.rand(mask.shape, generator=g).to(device) * mask
    values = torch.zeros_like(mask) if values is None else values * mask
    columns = (rollout.input_ids, rollout.attention_mask, rollout.position_ids, rollout.response_ids)
    return TrainBatch(*(t.to(device) for t in columns), mask, old_lp, ref_lp, values, advantages, returns,
                      rollout.prompt_length)


def measure(args, rollout) -> dict:
    """Median seconds of the no-grad forwards and of the update, and peak memory."""
    from prmppo.distributed.ranks import OneProcess
    from prmppo.ppo.loop import PPOTrainer

    cuda = args.device.startswith("cuda")
    policy, n_params = build_policy(args)
    trainer = PPOTrainer(policy=policy, tokenizer=None, task=_Task(), reward=None, engine=None, sync=None,
                         ppo=ppo_config(args), logger=None, ranks=OneProcess(torch.device(args.device)), seed=0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    plan = trainer.plan(rollout, 0)  # the micro-batches the no-grad pass and the update share
    forwards = [_timed(lambda: _no_grad_pass(trainer, rollout, plan), args.device) for _ in range(args.repeats)]
    train = _train_batch(trainer, rollout, plan, torch.device(args.device))
    # warm-up (allocator, kernels, optimizer state); its first minibatch runs the unchanged policy, so
    # its ratio to the old logprobs is the ratio tripwire's noise floor in this dtype (0 when the no-grad
    # pass runs the update's own micro-batches, as it does)
    ratio_dev = trainer.update(train, 0, plan)["ppo/first_minibatch_ratio_dev"]
    updates = [_timed(lambda: trainer.update(train, 0, plan), args.device) for _ in range(args.repeats)]
    if args.profile:
        profile_update(trainer, train, plan, args.device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"update_s": statistics.median(updates), "forwards_s": statistics.median(forwards), "peak_gib": peak,
            "n_params": n_params, "ratio_dev": ratio_dev}


def profile_update(trainer, train, plan, device: str, rows: int = 20) -> None:
    """torch.profiler's table of one more update: the top `rows` ops by device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        trainer.update(train, 0, plan)
        _sync(device)
        wall = time.perf_counter() - start
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    averages = prof.key_averages()
    print(f"profile of one more update, top {rows} ops by {sort}:")
    print(averages.table(sort_by=sort, row_limit=rows))
    if cuda:
        # device time summed over the device's own events (kernels and copies, which run one at a time on one
        # stream; the table's "Self CUDA time total"), against the wall time of the same update: the rest is
        # time the GPU waited for the host
        busy = sum(e.self_device_time_total for e in averages
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        waits = {e.key: e.count for e in averages if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                 "cudaMemcpyAsync", "cudaEventSynchronize")}
        print(f"device busy {busy:.3f} s of {wall:.3f} s wall ({100 * busy / wall:.0f}%) under the profiler; "
              f"host calls that can wait on the device: {waits}")


def report(args, result: dict, tokens: int, padded: int) -> None:
    peak = peak_tflops(args)
    device = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    n_params = result["n_params"]
    micro_tokens = f" (at most {args.micro_batch_tokens} tokens)" if args.micro_batch_tokens else ""
    policy = "LoRA r 16" if args.lora else "full"
    print(f"device: {device}; bf16 dense peak: {f'{peak:.0f} TFLOP/s' if peak else 'unknown (--peak-tflops)'}")
    print(f"model: {args.model or args.shape}, N = {n_params / 1e6:.1f}M parameters (base model, embeddings "
          f"included, tied head once); {'LoRA r=16, all linear layers' if args.lora else 'full fine-tuning'}; "
          f"model.dtype={args.dtype}, ppo.autocast={args.autocast}, "
          f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, ppo.compile="
          f"{str(args.compile).lower()}")
    print(f"rollout: {args.rows} rows, prompts ~{args.prompt_tokens} tokens, responses {args.min_new_tokens}-"
          f"{args.new_tokens} tokens; {tokens} real tokens per update of {padded} padded "
          f"({100 * (1 - tokens / padded):.0f}% padding); minibatch {args.minibatch_rows} rows, micro-batch "
          f"{args.micro_batch_rows} rows{micro_tokens}; medians of {args.repeats}")
    print("| policy | update s | update tok/s | MFU (6N) | no-grad forwards s | peak GiB | first ratio dev |")
    print("|---|---|---|---|---|---|---|")
    rate = tokens / result["update_s"]
    mfu = f"{100 * 6 * n_params * rate / (peak * 1e12):.1f}%" if peak else "n/a"
    mem = f"{result['peak_gib']:.1f}" if result["peak_gib"] is not None else "n/a"
    print(f"| {policy} | {result['update_s']:.3f} | {rate:,.0f} | {mfu} | {result['forwards_s']:.3f} | {mem} | "
          f"{result['ratio_dev']:.2g} |")


def main() -> int:
    args = parse_args()
    vocab = args.vocab
    if args.model:
        from prmppo.models.loading import check_model_dir

        vocab = check_model_dir(args.model).vocab_size
    rollout = synthetic_rollout(args, vocab)
    tokens = int(rollout.attention_mask.sum())
    report(args, measure(args, rollout), tokens, rollout.attention_mask.numel())
    return 0


if __name__ == "__main__":
    sys.exit(main())
