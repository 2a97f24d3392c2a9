"""Layer types SINGA 0.3 deprecated or removed: building one says what to use instead."""
from __future__ import annotations

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error
from shoal.neuralnet.layers.registry import register

REPLACEMENTS = {
    "kShardData": "kRecordInput with store_conf { backend: \"kvfile\" path: ... }",
    "kLMDBData": "kRecordInput with store_conf { backend: \"kvfile\" ... } (shoal reads no LMDB)",
    "kMnist": "kRecordInput with store_conf { mean_value, std_value } for the normalisation",
    "kRGBImage": "kRecordInput (store_conf.mean_file) followed by kImagePreprocess for crop and mirror",
    "kLabel": "kRecordInput: its labels travel with the data",
    "kPrefetch": "store_conf { prefetching: true } on the input layer",
}


@register(*REPLACEMENTS)
class Deprecated(Layer):
    """Refuses to build, naming the SINGA 0.3 replacement."""

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        name = job_pb2.LayerType.Name(conf.type)
        raise config_error(conf, f"{name} is deprecated in SINGA 0.3 and not supported; use {REPLACEMENTS[name]}")
