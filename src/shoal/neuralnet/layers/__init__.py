"""Layers, registered by SINGA LayerType name when this package is imported.

One module per family: inputs (input, image, embedding, char_rnn, dummy),
neurons (inner_product, activation, dropout, batchnorm, conv, pooling, lrn,
rnn, rbm), loss, output, connection, and the deprecated types.
"""
from shoal.neuralnet.layers import (  # noqa: F401  (imported for their @register side effects)
    activation,
    batchnorm,
    char_rnn,
    connection,
    conv,
    deprecated,
    dropout,
    dummy,
    embedding,
    image,
    inner_product,
    input,
    loss,
    lrn,
    output,
    pooling,
    rbm,
    rnn,
)
from shoal.neuralnet.layers.base import Context, Layer, LayerConfigError
from shoal.neuralnet.layers.registry import (
    layer_class,
    register,
    register_layer,
    register_user_layer,
    registered_types,
)

__all__ = ["Context", "Layer", "LayerConfigError", "layer_class", "register", "register_layer", "register_user_layer", "registered_types"]
