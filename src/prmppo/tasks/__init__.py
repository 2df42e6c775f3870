"""Tasks: what a problem means (prompts, gold solutions, verifier, steps).

`base` holds the contract (`Problem`, `Task`, `SPLITS`); `arith` is the synthetic default task
with an exact step checker; `gsm8k` reads the real GSM8K JSONL files.
"""

from prmppo.tasks.arith import ArithTask
from prmppo.tasks.base import SPLITS, Problem, Task
from prmppo.tasks.gsm8k import GSM8KTask

__all__ = ["SPLITS", "ArithTask", "GSM8KTask", "Problem", "Task"]
