"""shoal: SINGA-style distributed training on PyTorch.

    import shoal
    job = shoal.load_job("examples/mnist/job.conf")
    history = shoal.train(job)
    shoal.evaluate(job)
    shoal.fit(torch_module, loss_fn, (inputs, targets), cluster=shoal.Cluster(nworker_groups=2, nworkers_per_procs=2))
    run = shoal.session(); model = run.model(model); opt = run.optimizer(opt)   # your own loop (docs/python.md)
    shoal.SingaOptimizer(model.parameters(), {"type": "kSGD", "momentum": 0.9})   # a job file's updater, for that loop
    shoal.compare_runs(["ws/single", "ws/allreduce"]); shoal.plot_runs([...], "runs.png")
    shoal.draw_net("examples/cifar10/hybrid.conf", "net.png")   # which worker computes what
    shoal.estimate(job, compare=True)   # predicted samples/s of every framework layout (docs/planning.md)
    shoal.prestart()   # first in a script whose fit starts several processes: their server imports torch beside it
    shoal.register_layer("kFoo", Foo); shoal.load_plugins(["rnnlm.proto", "rnnlm.py"])  # user layers (docs/layers.md)
"""
__all__ = ["load_job", "train", "evaluate", "estimate", "fit", "session", "SingaOptimizer", "Cluster", "perplexity", "plot_runs", "compare_runs", "draw_net", "register_layer", "load_plugins", "prestart"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # import the API lazily so `import shoal.config` stays light (no torch)
    if name == "register_layer":
        from shoal.neuralnet.layers.registry import register_layer

        return register_layer
    if name == "load_plugins":
        from shoal.config.plugins import load_plugins

        return load_plugins
    if name == "perplexity":
        from shoal.frontend.fit_metrics import perplexity

        return perplexity
    if name == "SingaOptimizer":
        from shoal.neuralnet.singa_optimizer import SingaOptimizer

        return SingaOptimizer
    if name == "prestart":
        from shoal.launcher.process_server import prestart

        return prestart
    if name == "session":
        from shoal.frontend.session import session

        return session
    if name in ("fit", "Cluster"):
        from shoal.frontend import fit as fitting

        return getattr(fitting, name)
    if name in __all__:
        from shoal.frontend import api

        return getattr(api, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
