"""What a setting cost or gained in loss or accuracy, as measured here: the accuracy side of `shoal plan --recommend`.

Each row is a measurement recorded in docs/benchmarks.md (or an issue's text), copied with its source
and date; nothing here is estimated. A recommendation cites the rows it rests on (`cite`), and says
so when no row covers the case (a transformer under Local SGD, a lag bound for more than 2 groups).
Add a row when a benchmark measures a new case; never a number that was not measured.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    model: str
    setting: str  # what was tried
    baseline: str  # what it was compared with, at equal steps or samples
    result: str  # the measured figures
    source: str  # the script that measured it and when

    def cite(self) -> str:
        return f"{self.model}, {self.setting} against {self.baseline}: {self.result} ({self.source})"


MLP = "MNIST MLP 784-256-128-10"
GPT = "the character GPT (examples/gpt, 4 layers, 128 wide)"

LOCAL_SGD_H50 = Measured(MLP, "Local SGD H=50, 2 groups", "synchronous training at equal samples (51,200)",
                         "test accuracy 0.9503 against 0.9467 (+0.36 pt, mean of 2 seeds); 99x fewer bytes on the wire than Downpour",
                         "benchmarks/local_sgd.py, 2026-11-24")
DILOCO_H50 = Measured(MLP, "DiLoCo H=50 (outer Nesterov, lr 0.7, momentum 0.9), 2 groups", "synchronous training at equal samples",
                      "test accuracy 0.9523 against 0.9467 (+0.56 pt, mean of 2 seeds)", "benchmarks/local_sgd.py, 2026-11-24")
LOCAL_SGD_H10 = Measured(MLP, "Local SGD H=10, 2 groups, 400 steps per group", "the same run's other exchanges",
                         "test accuracy 0.9452 dense, 0.9485 with top-k 1 % (+0.33 pt), 66.7x fewer bytes",
                         "benchmarks/compression.py, 2026-11-23")
TOPK_ALLREDUCE_MLP = Measured(MLP, "AllReduce with top-k 1 % + error feedback", "dense float32 at 400 steps",
                              "test accuracy 0.9330 against 0.9380 (-0.50 pt), 66.6x fewer bytes per step",
                              "benchmarks/compression.py, 2026-11-23")
BF16_ALLREDUCE_MLP = Measured(MLP, "AllReduce with bf16", "dense float32 at 400 steps",
                              "test accuracy 0.9342 against 0.9380 (-0.38 pt), 2x fewer bytes per step",
                              "benchmarks/compression.py, 2026-11-23")
TOPK_DOWNPOUR_MLP = Measured(MLP, "Downpour with top-k 1 %", "dense float32 at 400 steps per group",
                             "test accuracy 0.9502 against 0.9533 (-0.31 pt), 66.7x fewer bytes", "benchmarks/compression.py, 2026-11-23")
TOPK_ALLREDUCE_GPT = Measured(GPT, "AllReduce with top-k 1 %", "dense at 400 steps",
                              "validation loss 2.5763 against 2.1131 (+22 %)", "issue 28, measured on main before the module path")
LAG_DOWNPOUR = Measured("SINGA's MNIST LeNet, worker 1 slowed 2x", "Downpour, 2 groups, max_update_lag 2",
                        "Sandblaster's time to 95 % test accuracy",
                        "0.59x its time (0.48x in one process); with overlap_push and max_update_lag 5, 1.01x (385 steps instead of 205)",
                        "benchmarks/async_uneven.py, 2026-11-24")
SYNC_EXACT_GPT = Measured(GPT, "AllReduce over 2 processes", "one worker",
                          "validation loss 4.8e-8 from one worker's after 200 steps", "benchmarks/gpt.py, 2026-11-26")

# H values whose accuracy was measured (cluster.local_steps); a recommendation never goes past them
MEASURED_H = (10, 50)
