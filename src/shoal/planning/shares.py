"""Batch shares: how many rows of a group's batch each of its workers reads (pure arithmetic on the job)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shoal.config import job_pb2
from shoal.config.validate import in_phase


def batch_conf(layer: job_pb2.LayerProto) -> Optional[job_pb2.StoreProto]:
    """The StoreProto an input layer reads (kCharRNN's char_rnn_conf as one), or None for other layers."""
    if layer.HasField("store_conf"):
        return layer.store_conf
    if layer.type == job_pb2.kCharRNN:
        return job_pb2.StoreProto(batchsize=[layer.char_rnn_conf.batchsize])
    if layer.type == job_pb2.kUserLayer and layer.user_type:  # a plugin's input layer that reads its own data
        from shoal.neuralnet.layers.registry import user_batch_size

        size = user_batch_size(layer)
        return job_pb2.StoreProto(batchsize=[size]) if size else None
    return None


def batch_shares(store: job_pb2.StoreProto, npartitions: int) -> list[int]:
    """Per-partition batch sizes: one value split evenly (remainder to the first), or one per partition."""
    sizes = list(store.batchsize) or [1]
    if len(sizes) == npartitions:
        return sizes
    if len(sizes) != 1:
        raise ValueError(f"store_conf.batchsize has {len(sizes)} values for {npartitions} partitions")
    base, extra = divmod(sizes[0], npartitions)
    return [base + (1 if i < extra else 0) for i in range(npartitions)]


def train_input_shares(job: job_pb2.JobProto) -> list[list[int]]:
    """Per training input layer, the rows of a group's batch each of its nworkers_per_group workers reads."""
    return [
        batch_shares(batch_conf(layer), job.cluster.nworkers_per_group)
        for layer in job.neuralnet.layer
        if batch_conf(layer) is not None and in_phase(layer, job_pb2.kTrain)
    ]


def global_batch(job: job_pb2.JobProto) -> int:
    """Samples per training step of a group: the train input layers' batch (one value, or the shares' sum)."""
    return max((sum(shares) for shares in train_input_shares(job)), default=0)


@dataclass(frozen=True)
class GroupShards:
    """Where each worker group starts reading a training input: its draw of random_skip, then (without one, or
    always where groups meet: Local SGD, whose groups must not train on overlapping windows) at evenly spaced
    offsets, so that groups read disjoint shards of one epoch. Group 0 reads from its draw."""

    ngroups: int = 1
    always_disjoint: bool = False

    def offset(self, group: int, skip: int, records: int) -> int:
        """Records to skip past the group's drawn `skip` of a store of `records`."""
        if group <= 0 or (skip and not self.always_disjoint):
            return 0
        return group * (records // max(self.ngroups, group + 1))
