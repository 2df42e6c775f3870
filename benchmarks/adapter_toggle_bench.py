"""Host time of switching a LoRA policy's adapters off and on again, as its reference passes do.

    python benchmarks/adapter_toggle_bench.py                    # the Qwen2-0.5B shape, LoRA on every linear
    python benchmarks/adapter_toggle_bench.py --layers 2 --repeats 3   # a smoke run

The model is built on the meta device (no weights: only the modules, which is all a toggle touches). Each side is
the mean wall time of an entry and exit of the context, measured alternately in one process:
peft's `PeftModel.disable_adapter` (which first builds `get_model_status`, a report on every adapter layer with
each layer's `repr`) and prmppo's `models.policy.adapters_off` (each adapter layer's `enable_adapters`, the
layers' on/off states and the parameters' requires_grad flags restored). The no-grad pass enters one of them once
per micro-batch, in the reference forward; on a GPU this time is device idle unless the queue is long.
"""

from __future__ import annotations

import argparse
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from prmppo.models.policy import adapters_off


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2-0.5B: 24)")
    parser.add_argument("--repeats", type=int, default=20, help="entries and exits per side and round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of both sides")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=args.layers,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=16384)
    with torch.device("meta"):
        model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=8, target_modules="all-linear"),
                               adapter_name="policy")

    def peft_side():
        with model.disable_adapter():
            pass

    def ours():
        with adapters_off(model):
            pass

    times: dict[str, list[float]] = {"peft disable_adapter": [], "adapters_off": []}
    for _ in range(args.rounds):
        for name, side in (("peft disable_adapter", peft_side), ("adapters_off", ours)):
            start = time.perf_counter()
            for _ in range(args.repeats):
                side()
            times[name].append((time.perf_counter() - start) / args.repeats * 1e3)
    out = {name: sorted(values)[len(values) // 2] for name, values in times.items()}  # median ms of the rounds
    for name, ms in out.items():
        print(f"{name:<22} {ms:8.2f} ms an entry and exit (median of {args.rounds} rounds)")
    print(f"peft / adapters_off: {out['peft disable_adapter'] / out['adapters_off']:.2f}x")
    return out


if __name__ == "__main__":
    main()
