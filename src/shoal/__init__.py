"""shoal: SINGA-style distributed training on PyTorch.

    import shoal
    job = shoal.load_job("examples/mnist/job.conf")
    history = shoal.train(job)
    shoal.evaluate(job)
    shoal.compare_runs(["ws/single", "ws/allreduce"]); shoal.plot_runs([...], "runs.png")
"""
__all__ = ["load_job", "train", "evaluate", "plot_runs", "compare_runs"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # import the API lazily so `import shoal.config` stays light (no torch)
    if name in __all__:
        from shoal import api

        return getattr(api, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
