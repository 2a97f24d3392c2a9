"""One module per framework: recognising its layout and building its exchanges (docs/architecture.md); its cost
model is planning's (shoal/planning/framework_costs/).

Each module defines one `shoal.planning.strategy.Strategy`; `registry.REGISTRY` lists them. This package
sits above runtime/ (it builds exchanges) and planning/ (it recognises layouts): neither imports it.
"""
