"""Layers, registered by SINGA LayerType name on import."""
from shoal.layers import connection, conv, input, loss, neuron, output  # noqa: F401  (registration)
from shoal.layers.base import Context, Layer, LayerConfigError
from shoal.layers.registry import layer_class, register, register_user_layer, registered_types

__all__ = ["Context", "Layer", "LayerConfigError", "layer_class", "register", "register_user_layer", "registered_types"]
