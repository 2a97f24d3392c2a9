"""The only package that touches torch.distributed: process groups and the collectives shoal uses."""
