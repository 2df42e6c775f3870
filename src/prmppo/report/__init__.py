"""Reports over runs and sweeps: `python -m prmppo.report <run or sweep dirs>`; see `__main__.py`.

The functions are the notebook's API too: `find_runs`, `group_runs`, `accuracy_figure`,
`metrics_figure`, `measures`, `group_rows`, `difference_rows`, `markdown`, `write_report`.
"""

from prmppo.report.plots import HACK_METRICS, REWARD_METRICS, accuracy_figure, metrics_figure
from prmppo.report.runs import Grouping, ReportError, Run, find_runs, group_runs
from prmppo.report.stats import difference_ci, mean_ci
from prmppo.report.markdown import markdown
from prmppo.report.tables import difference_rows, group_rows, measures
from prmppo.report.write import write_report

__all__ = ["HACK_METRICS", "REWARD_METRICS", "Grouping", "ReportError", "Run", "accuracy_figure", "difference_ci",
           "difference_rows", "find_runs", "group_rows", "group_runs", "markdown", "mean_ci", "measures",
           "metrics_figure",
           "write_report"]
