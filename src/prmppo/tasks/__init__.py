"""Tasks: what a problem means (prompts, gold solutions, verifier, steps).

`base` holds the contract (`Problem`, `Task`, `SPLITS`); `arith` is the synthetic default task
with an exact step checker; `gsm8k` reads the real GSM8K JSONL files; `jsonl` reads any JSONL or
Parquet file in verl's row layout (answers in `answers`, prompts rendered by `chat`, rows read by `rows`).
"""

from prmppo.tasks.arith import ArithTask
from prmppo.tasks.base import SPLITS, Problem, Task
from prmppo.tasks.gsm8k import GSM8KTask
from prmppo.tasks.jsonl import JsonlTask

__all__ = ["SPLITS", "ArithTask", "GSM8KTask", "JsonlTask", "Problem", "Task"]
