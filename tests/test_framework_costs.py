"""The cost model's per-framework part (planning/framework_costs/) counts what the runtime's exchanges send without
importing them (planning sits below runtime): its counts agree with the runtime's own."""
from __future__ import annotations

import pytest
import torch

from shoal.config import job_pb2
from shoal.planning.cluster_facts import Compression
from shoal.planning.framework_costs import COSTS
from shoal.planning.framework_costs.base import encoded_parts
from shoal.planning import sparse_chunks
from shoal.planning.strategy import Framework
from shoal.runtime.exchanges.compression import codec_factory
from shoal.runtime.exchanges.sparse_outer import SparseOuterStep


@pytest.mark.parametrize("kind", [job_pb2.kNone, job_pb2.kBF16, job_pb2.kFP16, job_pb2.kTopK])
def test_encoded_parts_are_the_codecs_buffers(kind):
    """Each encoded part is its own collective or message: as many as the codec's buffers (uncompressed: one)."""
    codecs = codec_factory(kind, 0.1)
    assert encoded_parts(Compression(kind, 0.1)) == (len(codecs(error_feedback=False).buffers(100)) if codecs else 1)


@pytest.mark.parametrize("chunk_size, topk, bits", [(64, 4, 2), (64, 4, 16), (4096, 32, 2), (5000, 7, 2), (3, 3, 16), (1000, 1, 2)])
def test_sparse_outer_message_bytes_are_the_runtimes(chunk_size, topk, bits):
    """SparseLoCo's message, counted by the cost model (planning/sparse_chunks.py, which the runtime also cuts by), is the
    length of the buffer the runtime encodes (small params, a param smaller than a chunk, an empty one, 12- and 16-bit
    positions, 2- and 16-bit values)."""
    conf = job_pb2.SparseOuterStepProto(chunk_size=chunk_size, topk_per_chunk=topk, value_bits=bits)
    sizes = [7, 0, 130, 10_000, 64]
    step = SparseOuterStep.configured(conf, sizes)
    buffer, _ = step.encode(torch.randn(sum(sizes)))
    assert sparse_chunks.message_bytes(conf, sizes) == step.message_bytes() == buffer.numel() * buffer.element_size()


def test_every_framework_has_a_cost_model():
    assert set(COSTS) == set(Framework)
