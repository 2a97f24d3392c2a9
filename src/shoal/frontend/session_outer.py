"""A torch optimizer as Local SGD / DiLoCo's outer step in a user's loop: `shoal.session(outer_optimizer=...)`, the form
of shoal.fit's `outer_optimizer=` (a factory on the params, e.g.
`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`, DiLoCo's).

At each meeting the groups' mean change since the anchor is the outer gradient (PeriodicExchange), and the outer step
is this optimizer's over the anchor. It is the job path's: the cluster's outer updater names fit's torch outer updater
(OUTER_OPTIMIZER_UPDATER, neuralnet/torch_optimizer.py's TorchOptimizer, its state checkpointed with the exchange's),
bound in every process to the module's trained params at run.model(), before the strategy builds the exchange.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from shoal.config import job_pb2
from shoal.neuralnet.torch_optimizer import OUTER_OPTIMIZER_UPDATER, OptimizerError, optimizer_factory, register_torch_optimizer

_given: Optional[Any] = None  # this process's session's outer_optimizer= (bound to its module at run.model())


class _Unbound:
    """What plans the job before the module exists (planning makes the cluster's outer updater once, to check it): no
    session trains with it (`bind` replaces it at run.model())."""

    def __call__(self, named: list) -> torch.optim.Optimizer:
        raise OptimizerError("shoal.session: outer_optimizer= is bound to the module at run.model()")


def torch_outer(job: job_pb2.JobProto) -> bool:
    """Whether the job's outer updater is a torch optimizer (shoal.session's or shoal.fit's outer_optimizer=)."""
    return job.cluster.outer_updater.user_type == OUTER_OPTIMIZER_UPDATER


def with_outer_optimizer(job: job_pb2.JobProto, given: Any) -> None:
    """`job` (a session's, the command line's --set applied) with `given` as its outer step: the cluster's outer updater
    names the torch one (refused in one line beside a SINGA cluster.outer_updater); planning can make it from now."""
    global _given
    from shoal.frontend.session_start import SessionError

    _given = given
    if given is None:
        if torch_outer(job):  # (fit's outer updater named by --set alone)
            raise SessionError("shoal.session: cluster.outer_updater names a torch outer optimizer: give it as "
                               "shoal.session(outer_optimizer=...)")
        return
    if not callable(given) and not isinstance(given, torch.optim.Optimizer):
        raise SessionError(f"shoal.session: outer_optimizer= is a factory returning a torch.optim.Optimizer (as shoal.fit's), "
                           f"got {type(given).__name__}")
    if job.cluster.HasField("outer_updater") and not torch_outer(job):
        raise SessionError("shoal.session: give cluster.outer_updater (SINGA's) or outer_optimizer (a torch.optim factory), not both")
    job.cluster.outer_updater.CopyFrom(job_pb2.UpdaterProto(
        type=job_pb2.kUserUpdater, user_type=OUTER_OPTIMIZER_UPDATER, learning_rate=job_pb2.LRGenProto(type=job_pb2.kFixed)))
    plannable(job)


def plannable(job: job_pb2.JobProto) -> None:
    """A job whose outer updater is the torch one can be planned in this process (planning makes it once)."""
    if torch_outer(job):
        register_for_planning()


def register_for_planning() -> None:
    """The stand-in (`bind` registers the session's own at run.model(), after it); also what a rank shoal's launcher
    starts runs before it plans the job, ahead of the script or fit's loop: its process_setup (`setup_of`)."""
    register_torch_optimizer(_Unbound(), [], user_type=OUTER_OPTIMIZER_UPDATER)


def setup_of(job: job_pb2.JobProto):
    """The process_setup of the ranks shoal's launcher starts for a session's `job` (RunOptions.process_setup)."""
    return register_for_planning if torch_outer(job) else None


def check_layout(plan) -> None:
    """outer_optimizer= is Local SGD / DiLoCo's: refused in one line under another layout."""
    from shoal.frontend.session_start import SessionError

    if torch_outer(plan.job) and not plan.strategy.meets:
        raise SessionError(f"shoal.session: outer_optimizer= is Local SGD / DiLoCo's (cluster.nworker_groups > 1 with "
                           f"cluster.local_steps), not {plan.label}'s")


def bind(plan, module: torch.nn.Module) -> None:
    """At run.model(): the outer optimizer over the module's trained params (the exchange's anchor holds their values),
    before the strategy makes it."""
    from shoal.frontend.session_start import SessionError

    if not torch_outer(plan.job) or _given is None:  # (a job naming it without outer_optimizer= was refused already)
        return
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    try:
        factory = optimizer_factory(_given, module, [n for n, _ in trained], "outer_optimizer")
    except OptimizerError as err:
        raise SessionError(str(err).replace("shoal.fit:", "shoal.session:", 1)) from None
    register_torch_optimizer(factory, trained, user_type=OUTER_OPTIMIZER_UPDATER)
