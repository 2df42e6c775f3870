"""Every graph dynamo compiles during `python -m prmppo ...`, with the grad mode and prmppo's call site.

    python benchmarks/compile_trace.py debug=smoke stage=ppo ppo.compile=true ppo.gradient_checkpointing=true
    python benchmarks/compile_trace.py debug=smoke stage=ppo lora=none ppo.compile=true ppo.iterations=6

The arguments are the run's own (Hydra overrides). The run goes on as usual, in this process; each
compilation (one per graph, also a recompilation) prints one line to stdout as it starts:
`compile N at +S s, grad mode G, from a > b > c`, the innermost prmppo frames last, and the total
comes at the end. With `ppo.compile=true` every decoder layer shares its graphs, so the count is the
number of distinct (grad mode, adapter, input) variants the run's passes make the layers see; a
compilation after the first PPO iteration is a stall mid-run.
"""

from __future__ import annotations

import runpy
import sys
import time
import traceback

import torch
from torch._dynamo.callback import callback_handler

START = time.monotonic()
COMPILES: list[str] = []


def _on_compile_start(*args, **kwargs) -> None:
    frames = [f"{frame.name}:{frame.lineno}" for frame in traceback.extract_stack() if "prmppo" in frame.filename
              and "compile_trace" not in frame.filename]
    COMPILES.append(" > ".join(frames[-6:]))
    print(f"compile {len(COMPILES)} at +{time.monotonic() - START:.1f} s, grad mode {torch.is_grad_enabled()}, "
          f"from {COMPILES[-1]}", flush=True)


def main() -> int:
    callback_handler.register_start_callback(_on_compile_start)
    sys.argv = ["prmppo", *sys.argv[1:]]
    code = 0
    try:
        runpy.run_module("prmppo", run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    print(f"{len(COMPILES)} graphs compiled", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
