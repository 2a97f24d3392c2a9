"""Which layers belong to the train, validation and test nets (SINGA's include/exclude filter)."""

from __future__ import annotations

from shoal.config import job_pb2

PHASE_NAMES = {job_pb2.kTrain: "kTrain", job_pb2.kVal: "kVal", job_pb2.kTest: "kTest"}


def in_phase(layer: job_pb2.LayerProto, phase: int) -> bool:
    """A layer is in `phase` if its include lists it, or, without include, unless its exclude does."""
    return phase in layer.include if layer.include else phase not in layer.exclude


def layers_in_phase(net: job_pb2.NetProto, phase: int) -> list[job_pb2.LayerProto]:
    return [layer for layer in net.layer if in_phase(layer, phase)]


def phases_built(job: job_pb2.JobProto) -> list[int]:
    """The nets a run builds: SINGA builds the test and validation nets only when they will run."""
    phases = [job_pb2.kTrain] if job.train_steps > 0 else []
    if job.test_steps > 0:
        phases.append(job_pb2.kTest)
    if job.validate_steps > 0:
        phases.append(job_pb2.kVal)
    return phases or [job_pb2.kTrain]


def fires(freq: int, after: int, step: int) -> bool:
    """SINGA's trigger rule for display, test, validation and checkpoints: every `freq` steps from `after`."""
    return freq > 0 and step >= after and (step - after) % freq == 0
