"""Run outputs that every stage writes: metrics JSONL (the source of truth), console, W&B."""

from prmppo.logger.metrics import DiscardMetrics, MetricsLogger, write_json_atomic

__all__ = ["DiscardMetrics", "MetricsLogger", "write_json_atomic"]
