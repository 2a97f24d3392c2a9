"""SINGA's updaters as a torch optimizer, for a loop that steps a torch.optim.Optimizer (your own, under
`shoal.session()`): the same formulas, gradient preparation and learning-rate schedules a job file's `updater` runs.

    opt = run.optimizer(shoal.SingaOptimizer(model.parameters(), {"type": "kSGD", "momentum": 0.9, "weight_decay": 5e-4,
                                                                  "learning_rate": {"type": "kStep", "base_lr": 0.01,
                                                                                    "step_conf": {"gamma": 0.1, "change_freq": 1000}}}))

The updater is a dict in the job file's UpdaterProto fields (docs/jobs.md) or an UpdaterProto. Each param group may set
`lr_scale` and `wd_scale` (SINGA's per-param multipliers, default 1). The learning rate at each update is the updater's
schedule at that group's update count (0 at the first `step()`, as a job's step), times lr_scale: it is the updater's
own, so torch's lr_scheduler (which sets a group's `lr`) does not apply to it. Params without a gradient are left as
they are, their state too. `state_dict()` holds each param's slots (SINGA's `history`, `mean` ...) and each group's
update count, so a checkpoint resumes the schedule where it was.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch
from google.protobuf import json_format

from shoal.config import job_pb2
from shoal.errors import ShoalError
from shoal.neuralnet.updaters import ParamUpdate, Updater, make_updater

UPDATES = "updates"  # a param group's update count: the step its schedule reads


class SingaOptimizerError(ShoalError, ValueError):
    """An updater the optimizer cannot run: one line naming the field."""


def updater_conf(updater: Union[dict, job_pb2.UpdaterProto]) -> job_pb2.UpdaterProto:
    """`updater` as an UpdaterProto (a dict's fields are the job file's), its learning rate fixed unless it says."""
    if isinstance(updater, job_pb2.UpdaterProto):
        conf = job_pb2.UpdaterProto()
        conf.CopyFrom(updater)
    elif isinstance(updater, dict):
        conf = job_pb2.UpdaterProto()
        try:
            json_format.ParseDict(updater, conf)
        except json_format.ParseError as err:
            raise SingaOptimizerError(f"shoal.SingaOptimizer: updater: {str(err).splitlines()[0]}") from None
    else:
        raise SingaOptimizerError(f"shoal.SingaOptimizer: updater must be a dict of UpdaterProto's fields, got {type(updater).__name__}")
    if not conf.learning_rate.HasField("type"):
        conf.learning_rate.type = job_pb2.kFixed
    return conf


class SingaOptimizer(torch.optim.Optimizer):
    """SINGA's `updater` (kSGD, kNesterov, kAdaGrad, kRMSProp, kAdaDelta, kAdam, kAdamMax, or a registered user
    updater) over `params`, stepped as any torch optimizer."""

    shoal_elementwise = True  # SINGA's updaters read each element alone: an owner may update a slice of a param

    def __init__(self, params: Iterable, updater: Union[dict, job_pb2.UpdaterProto], lr_scale: float = 1.0, wd_scale: float = 1.0):
        conf = updater_conf(updater)
        try:
            self.updater: Updater = make_updater(conf)
        except ValueError as err:
            raise SingaOptimizerError(f"shoal.SingaOptimizer: {err}") from None
        self.conf = conf
        # the updater as JSON among the defaults: what rebuilds this optimizer from its defaults (a session's scratch copy
        # for state a param has not made yet) is given it, and a checkpoint's param groups say which updater ran
        super().__init__(params, {"updater": json_format.MessageToDict(conf), "lr_scale": float(lr_scale),
                                  "wd_scale": float(wd_scale), UPDATES: 0})

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key in ("lr_scale", "wd_scale"):
            if isinstance(group[key], bool) or not isinstance(group[key], (int, float)) or not group[key] >= 0:
                raise SingaOptimizerError(f"shoal.SingaOptimizer: param group {len(self.param_groups) - 1}'s {key} must be a "
                                          f"number from 0, got {group[key]!r}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            updates = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise SingaOptimizerError("shoal.SingaOptimizer: sparse gradients are not supported")
                state = self.state[p]
                if not state:
                    state.update(self.updater.init_state(p))
                updates.append(ParamUpdate(p, p.grad, state, group["lr_scale"], group["wd_scale"]))
            self.updater.update_many(group[UPDATES], updates)
            group[UPDATES] += 1
        return loss
