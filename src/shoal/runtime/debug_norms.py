"""`debug: true`: at each display step, the L1 norms of every layer's output, its gradient and its params.

SINGA's debug mode: each worker W of group 0 writes WORKSPACE/visualization/fp-step<N>-loc<W>.json
after forward and bp-step<N>-loc<W>.json after backward: the partitioned train net as
node-link (train_net.json's nodes), each node W computes carrying its norms:

- fp: `data_l1` (sum of |output|) and each param's `value_l1`;
- bp: `grad_l1` (sum of |d loss / d output|) and each param's `value_l1` and `grad_l1`.

`numel` fields give the element counts: SINGA printed "norm1" as the mean absolute value
(L1 / numel). Values are those of the step's forward and backward (params before the update).

Nothing in the workers changes: at display steps only, each layer's forward is wrapped to
record its output and to hook the gradients of its output and params (autograd tensor
hooks, removed after the step). Other steps run untouched.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Optional

import torch

from shoal.config.phases import fires
from shoal.planning.partition import ParamView
from shoal.report.node_link import write_json
from shoal.report.writes import own_folder
from shoal.runtime.interfaces import TrainerHook
from shoal.runtime.visualization import FOLDER

if TYPE_CHECKING:
    from shoal.runtime.trainer import Trainer


class _NodeNorms:
    """What one node's forward and backward produced at a display step (0-d tensors and gradients; numbers when written).

    Norms are taken as 0-d tensors when recorded (the params change at the update after
    backward) and turned into numbers only when written, so a GPU is synchronised once.
    """

    def __init__(self):
        self.data: Optional[tuple[torch.Tensor, int]] = None  # (L1, numel)
        self.grad: Optional[torch.Tensor] = None  # summed over the hook's calls
        self.params: dict[str, dict] = {}  # name -> {"value": (L1, numel), "grad": summed gradient}

    def add_grad(self, grad: torch.Tensor) -> None:
        self.grad = grad.detach() if self.grad is None else self.grad + grad.detach()

    def add_param_grad(self, name: str, grad: torch.Tensor) -> None:
        entry = self.params[name]
        entry["grad"] = grad.detach() if entry.get("grad") is None else entry["grad"] + grad.detach()


def _l1(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs().sum()


class DebugNorms(TrainerHook):
    """Records the norms of one trainer's workers (group 0) at display steps and writes SINGA's fp/bp files."""

    def __init__(self, trainer: "Trainer"):
        self.job = trainer.job
        self.folder = trainer.workspace / FOLDER
        self.graph = trainer.plan.partition.to_node_link()
        self.armed = False
        self.records: dict[int, dict[str, _NodeNorms]] = {}  # worker -> node id -> norms
        self.handles: list = []
        for member in trainer.workers:
            for worker, node_id, node in member.computed_nodes():
                self._wrap(worker, node_id, node)

    def before_step(self, step: int) -> None:
        if fires(self.job.disp_freq, self.job.disp_after, step):
            self.armed, self.records = True, {}

    def after_step(self, step: int) -> None:
        if not self.armed:
            return
        self.armed = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.write(step)
        self.records = {}  # the gradients it held are not needed until the next display

    def _wrap(self, worker: int, node_id: str, node) -> None:
        layer = node.layer
        forward = layer.forward
        names = [p.name if isinstance(p, ParamView) else p for p in node.params]  # a partitioned node holds views

        def recording_forward(xs, params, labels, ctx):
            result = forward(xs, params, labels, ctx)
            if self.armed:
                self._record(worker, node_id, result, names, params)
            return result

        layer.forward = recording_forward

    def _record(self, worker: int, node_id: str, result, names: list[str], params: list[torch.Tensor]) -> None:
        norms = self.records.setdefault(worker, {}).setdefault(node_id, _NodeNorms())
        output = result[0] if isinstance(result, tuple) else result
        if isinstance(output, torch.Tensor):
            norms.data = (_l1(output), output.numel())
            if output.requires_grad:
                output.register_hook(norms.add_grad)
        for name, leaf in zip(names, params):
            norms.params[name] = {"value": (_l1(leaf), leaf.numel())}
            if leaf.requires_grad:
                self.handles.append(leaf.register_hook(lambda g, name=name: norms.add_param_grad(name, g)))

    def write(self, step: int) -> None:
        """fp-step<N>-loc<W>.json and bp-step<N>-loc<W>.json for every worker recorded this step."""
        own_folder(self.folder)  # through no link, as every file shoal writes in a workspace
        for worker, recorded in sorted(self.records.items()):
            for kind in ("fp", "bp"):
                graph = copy.deepcopy(self.graph)
                graph["graph"].update({"step": step, "worker": worker, "pass": kind})
                for node in graph["nodes"]:
                    norms = self._norms(recorded[node["id"]], kind) if node["id"] in recorded else None
                    if norms:
                        node["norms"] = norms
                write_json(self.folder / f"{kind}-step{step}-loc{worker}.json", graph)

    @staticmethod
    def _norms(recorded: _NodeNorms, kind: str) -> dict:
        out: dict = {}
        if kind == "fp" and recorded.data is not None:
            out.update(data_l1=recorded.data[0].item(), numel=recorded.data[1])
        if kind == "bp" and recorded.grad is not None:
            out.update(grad_l1=_l1(recorded.grad).item(), numel=recorded.grad.numel())
        params = []
        for name, entry in recorded.params.items():
            value, numel = entry["value"]
            p = {"name": name, "value_l1": value.item(), "numel": numel}
            if kind == "bp" and entry.get("grad") is not None:
                p["grad_l1"] = _l1(entry["grad"]).item()
            params.append(p)
        if params:
            out["params"] = params
        return out


def install(trainer: "Trainer") -> Optional[DebugNorms]:
    """With `debug: true`, record group 0's norms at display steps (SINGA records group 0's only)."""
    if not trainer.job.debug or trainer.group != 0 or not trainer.workers:
        return None
    return DebugNorms(trainer)
