"""Comparing runs: summaries, plots, tables and TensorBoard events of run workspaces.

    import shoal
    shoal.compare_runs(["ws/single", "ws/allreduce"])          # rows of the comparison table
    shoal.plot_runs(["ws/single", "ws/allreduce"], "runs.png")  # loss and accuracy vs step and time
"""
from shoal.report.errors import ReportError

__all__ = ["ReportError"]
