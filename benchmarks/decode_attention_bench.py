"""The decode step's attention alone: torch's sdpa backends on the grouped decode shape, against the bandwidth bound.

    python benchmarks/decode_attention_bench.py                       # Qwen2-0.5B's decode at 256 rows, on CUDA
    python benchmarks/decode_attention_bench.py --rows 8 --slots 64 --device cpu   # a smoke run of the same code

The static decoder's attention (`rollout/grouped_attention.py`) folds the g = H / H_kv query heads of a group into
the query axis: query [rows, H_kv, g, d] against the cache's keys and values [rows, H_kv, S, d] with an additive
mask [rows, 1, 1, S] (the slots a row may attend to). This times one such call per sdpa backend (cuDNN,
memory-efficient, math), each with the additive and with a bool mask, the two batched matmuls around a float32
softmax that the decoder ran before, cuDNN over the first half of the slots (a view: what reading only the
filled part of the cache would cost), and torch's compiled `flex_attention` with the mask as a score
modification (the [rows, S] additive mask added to each score): over the heads as the model has them with
`enable_gqa` (flex's decoding kernel, which packs a group's queries into one tile), and over the folded query.
Each figure is the mean over `--calls` calls after 10 warm-up calls (CUDA events). The bound is the keys and
values read once at the device's `--tbps` (H100 SXM: 3.35 TB/s; H200: 4.8). A backend that cannot run the shape
prints its error instead of a time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def mean_us(fn, calls: int, device: torch.device) -> float:
    """Mean microseconds of `fn()` over `calls` calls, after 10 warm-up calls."""
    for _ in range(10):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(stop) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--kv-heads", type=int, default=2, help="Qwen2-0.5B: 2")
    parser.add_argument("--group", type=int, default=7, help="query heads per KV head (Qwen2-0.5B: 14 / 2)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--slots", type=int, nargs="+", default=[384, 512], help="cache slots S")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tbps", type=float, default=3.35, help="the device's memory bandwidth, TB/s")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"{args.rows} rows, {args.kv_heads} KV heads x {args.group} query heads, head size {args.head_dim}; "
          f"microseconds a call")
    print("| slots | side | us | x bound |")
    print("|---|---|---|---|")
    for slots in args.slots:
        shape = (args.rows, args.kv_heads, slots, args.head_dim)
        query = torch.randn(args.rows, args.kv_heads, args.group, args.head_dim, device=device, dtype=dtype,
                            generator=generator)
        keys = torch.randn(shape, device=device, dtype=dtype, generator=generator)
        values = torch.randn(shape, device=device, dtype=dtype, generator=generator)
        keep = torch.rand(args.rows, slots, device=device, generator=generator) < 0.5  # [rows, S]
        keep[:, -1] = True  # every row attends somewhere
        additive = torch.zeros(args.rows, 1, 1, slots, device=device, dtype=dtype).masked_fill(
            ~keep[:, None, None], torch.finfo(dtype).min)
        masks = {"additive": additive, "bool": keep[:, None, None, :]}
        bound_us = 2 * keys.numel() * keys.element_size() / (args.tbps * 1e12) * 1e6
        sides = {}
        for name, backend in BACKENDS.items():
            for mask_name, mask in masks.items():
                def call(backend=backend, mask=mask):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
                sides[f"sdpa {name}, {mask_name} mask"] = call
        scale = args.head_dim ** -0.5

        def matmuls():
            scores = (query @ keys.transpose(-1, -2)).float() * scale + additive.float()
            return scores.softmax(-1).to(dtype) @ values

        sides["two matmuls, float32 softmax"] = matmuls
        half = slots // 2

        def half_window():
            with sdpa_kernel([BACKENDS["cudnn"]]):
                return F.scaled_dot_product_attention(query, keys[:, :, :half], values[:, :, :half],
                                                      attn_mask=additive[..., :half])

        sides["sdpa cudnn, additive mask, first half of the slots"] = half_window
        bias = additive[:, 0, 0]  # [rows, S]

        def add_mask(score, b, h, q_idx, kv_idx):
            return score + bias[b, kv_idx]

        flex = torch.compile(flex_attention, dynamic=False)
        flex_dynamic = torch.compile(flex_attention, dynamic=True)  # as the compiled decode step marks rows, slots
        heads = query.reshape(args.rows, args.kv_heads * args.group, 1, args.head_dim)  # [rows, H, 1, d]
        flex_sides = {
            "flex, compiled, H heads, enable_gqa": lambda: flex(heads, keys, values, score_mod=add_mask,
                                                                enable_gqa=True),
            "flex, compiled dynamic, H heads, enable_gqa": lambda: flex_dynamic(heads, keys, values,
                                                                                score_mod=add_mask, enable_gqa=True),
            "flex, compiled, folded query": lambda: flex(query, keys, values, score_mod=add_mask)}
        sides.update(flex_sides)
        reference = matmuls().float()
        for name in flex_sides:
            try:
                out = sides[name]().reshape(reference.shape).float()
                print(f"# {name}: max abs difference from the two matmuls {(out - reference).abs().max().item():.2e}")
            except Exception as err:  # noqa: BLE001 - a backend that cannot run the shape says why
                print(f"# {name}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        for name, fn in sides.items():
            try:
                us = mean_us(fn, args.calls, device)
                print(f"| {slots} | {name} | {us:.1f} | {us / bound_us:.2f} |")
            except Exception as err:  # noqa: BLE001 - a backend that cannot run the shape says why
                print(f"| {slots} | {name} | {str(err).splitlines()[0][:80]} | |")
        print(f"| {slots} | bound: keys and values read once at {args.tbps} TB/s | {bound_us:.1f} | 1.00 |")


if __name__ == "__main__":
    main()
