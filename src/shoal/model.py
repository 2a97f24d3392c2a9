"""`shoal.model`: SINGA's name (singa.model) for the Keras-like front end, shoal.frontend.keras."""
from shoal.frontend.keras import *  # noqa: F401,F403
from shoal.frontend.keras import __all__  # noqa: F401
