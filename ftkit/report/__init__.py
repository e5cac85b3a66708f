"""``ftkit report``: one self-contained HTML page of a run (goodput, loss curves, timeline, throughput, checkpoints,
plan), made from ``events.jsonl`` and ``metrics.jsonl``, for any run directory, live or finished.

Import-light: matplotlib is imported only when a page is drawn (:mod:`ftkit.report.charts`).
"""

from ftkit.report.goodput import CATEGORIES, DEFINITION, Attempt, Goodput, goodput
from ftkit.report.live import REPORT_ENV, ReportRefresher, launch_refresher, plan_record
from ftkit.report.page import build_report, write_report

__all__ = [
    "CATEGORIES",
    "DEFINITION",
    "REPORT_ENV",
    "Attempt",
    "Goodput",
    "ReportRefresher",
    "build_report",
    "goodput",
    "launch_refresher",
    "plan_record",
    "write_report",
]
