"""One module per framework: everything specific to it, planning side and runtime side (docs/architecture.md).

Each module defines one `shoal.planning.strategy.Strategy`; `registry.REGISTRY` lists them. This package
sits above runtime/ (it builds exchanges) and planning/ (it recognises layouts): neither imports it.
"""
