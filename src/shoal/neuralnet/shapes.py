"""Shape checking for validation: build every phase's net without touching data."""
from __future__ import annotations

import torch

from shoal.config import job_pb2
from shoal.config.errors import JobShapeError
from shoal.neuralnet.algorithms import rbm_pairs
from shoal.neuralnet.net import NetBuildError, NeuralNet
from shoal.neuralnet.params import ParamStore


def check_shapes(job: job_pb2.JobProto) -> None:
    """Raise JobShapeError(field_path, message) if a layer's conf does not fit its sources."""
    store = ParamStore(allocate=False)
    generator = torch.Generator().manual_seed(0)
    phases = [job_pb2.kTrain]
    if job.test_steps > 0:
        phases.append(job_pb2.kTest)
    if job.validate_steps > 0:
        phases.append(job_pb2.kVal)
    for phase in phases:
        try:
            net = NeuralNet(job.neuralnet, phase, store, generator)
        except NetBuildError as err:
            raise JobShapeError(err.field_path, err.message) from None
        if phase == job_pb2.kTrain and job.train_one_batch.alg == job_pb2.kCD and not rbm_pairs(net):
            raise JobShapeError("train_one_batch.alg", "kCD needs a kRBMVis/kRBMHid pair in the kTrain net")
