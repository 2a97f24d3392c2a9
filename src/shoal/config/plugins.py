"""Plugins: a user's layer classes (.py) and their configuration (.proto), as SINGA's users wrote them.

A .proto file extends SINGA's messages (`extend singa.LayerProto { optional DataProto data_conf = 1003; }`):
it is compiled with protoc (grpcio-tools) into a temporary folder and its module is importable as
`<stem>_pb2`, so that jobs parse `[data_conf] { ... }`. A .py file registers layer classes
(`@shoal.register_layer("kData")`); its folder is importable too, for its helper modules.

Who may load what: a .py plugin runs code, so only the user loads one, by `--plugin PATH` on the
command line or `shoal.load_plugins([...])` (`load_plugins`). A job (file, dict, `--set plugin=`)
is data: it may name .proto plugins, which are declarative and load (`load_job_plugins`), and .py
plugins only if the user has loaded that very file already; any other .py it names is refused.

Every process loads the same plugins before it reads a job: the loader writes the resolved path
of every plugin loaded in this process into the job's `plugin` field, and a process the launcher
spawns decodes the job it is handed in memory with `decode_job`, which loads those paths first
(they were all given by the user to the launching process). Loading is idempotent: a file
already loaded in this process is not loaded again.

Nothing of the working folder runs: a job may be run in a folder that came with it, and Python puts the
working folder first on the import path of `python -m` and `python -c`. The compiler therefore runs as
`python -I` given this process's import path without the working folder (`import_path`), and
multiprocessing's forkserver, which ranks and probes fork from, starts without it (`forkserver_context`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from shoal.config import common_pb2, job_pb2
from shoal.config.errors import JobError, did_you_mean

__all__ = ["PluginError", "PluginRefused", "decode_job", "extension", "extensions_of", "forkserver_context", "import_path",
           "load_job_plugins", "load_plugins", "loaded_plugins", "rank_environment"]

CONFIG_DIR = Path(__file__).resolve().parent
SUFFIXES = (".proto", ".py")
# shoal's schema files, as a user's .proto imports them (`import "job.proto";`)
SCHEMA_MODULES = {"job_pb2": job_pb2, "common_pb2": common_pb2}
WELL_KNOWN_PREFIX = "google/protobuf/"  # protobuf's own .proto files, whose modules ship with protobuf
_PROTOC_MESSAGE = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): (?P<message>.*)$")
# the compiler's interpreter, started isolated (-I: nothing from the working folder or the environment), is handed
# this process's import path less the working folder (its first argument), so that it imports the grpc_tools and
# protobuf shoal would; grpc_tools' entry point adds the include folder of protobuf's .proto files last
_PROTOC = "import json, sys; sys.path[:] = json.loads(sys.argv.pop(1)); from grpc_tools import protoc; protoc.entrypoint()"

_loaded: dict[str, ModuleType] = {}  # resolved path -> its module, in load order


class PluginError(JobError):
    """A plugin file that cannot be found, compiled or imported: `path:line:col: message`."""


class PluginRefused(PluginError):
    """A job names a .py plugin the user did not load: a job file must not be able to run code."""


def load_plugins(paths: Iterable[str | Path], base_dirs: Sequence[str | Path] = ()) -> list[str]:
    """Load each plugin file once per process; return their resolved paths, in the order given.

    A relative path resolves as a job's data paths do: from the working directory, else from
    each of `base_dirs` (the job file's folder). The .proto files load first, since a layer
    module imports the `_pb2` module its .proto becomes.
    """
    resolved = [_resolve(Path(p), [Path(d) for d in base_dirs]) for p in paths]
    for path in sorted(dict.fromkeys(resolved), key=lambda p: p.suffix != ".proto"):
        if str(path) not in _loaded:
            _loaded[str(path)] = _load_proto(path) if path.suffix == ".proto" else _load_module(path)
    return [str(p) for p in resolved]


def load_job_plugins(names: Iterable[str], base_dirs: Sequence[str | Path] = ()) -> list[str]:
    """The plugins a job names (its file, a dict, `--set plugin=`): load the .proto ones; return all, resolved.

    A .py plugin named by a job is accepted only when the user loaded that file already
    (`--plugin`, `shoal.load_plugins`); otherwise PluginRefused, with `source` the name as given.
    """
    dirs = [Path(d) for d in base_dirs]
    resolved = []
    for name in names:
        path = _resolve(Path(name), dirs)
        if path.suffix == ".py" and str(path) not in _loaded:
            raise PluginRefused(
                str(name),
                f"a job may name only .proto plugins, since a .py plugin runs code; pass it yourself: --plugin {path} "
                "(shoal run, plan, viz; Python: shoal.load_plugins)",
            )
        resolved.append(path)
    load_plugins([p for p in resolved if p.suffix == ".proto"])
    return [str(p) for p in resolved]


def loaded_plugins() -> list[str]:
    """The resolved paths of every plugin this process has loaded, in load order."""
    return list(_loaded)


def decode_job(data: bytes) -> job_pb2.JobProto:
    """A serialized job, after loading the plugins it names: what a spawned process reads its job with.

    Only for the bytes a shoal process hands the processes it spawns (in memory): their plugins are
    the ones the user gave that process (the loader refuses any other .py). Never for bytes read
    from a file or the network.
    """
    job = job_pb2.JobProto.FromString(data)
    if any(path not in _loaded for path in job.plugin):
        load_plugins(job.plugin)
        job = job_pb2.JobProto.FromString(data)  # now with the plugins' extensions decoded
    return job


def extensions_of(desc: Descriptor) -> dict[str, FieldDescriptor]:
    """The extensions the loaded plugins declare for a message, by full name (`data_conf`, `rnnlm.data_conf`)."""
    return {ext.full_name: ext for ext in descriptor_pool.Default().FindAllExtensions(desc)}


def extension(message, name: str):
    """The extension field `name` of `message` (a LayerProto's `data_conf`), for a plugin layer to read its conf.

    KeyError naming the message's extensions when no loaded plugin declares it.
    """
    known = extensions_of(message.DESCRIPTOR)
    if name not in known:
        raise KeyError(f"{message.DESCRIPTOR.name} has no extension [{name}]{did_you_mean(name, known)}; loaded: {sorted(known)}")
    return message.Extensions[known[name]]


# -- the interpreters shoal starts: never with the working folder on their import path ---------------------------
def import_path() -> list[str]:
    """This process's import path without the working folder (nor '' or any relative entry, which name it): where an
    interpreter shoal starts finds its packages (the compiler's grpc_tools and protobuf)."""
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # the working folder was removed: nothing can be imported from it
        here = None
    return [entry for entry in sys.path if os.path.isabs(entry) and os.path.realpath(entry) != here]


# Imported by the launching process, so its ranks will import them too: the server imports them once, before any rank
# forks, instead of every rank after it starts (torch's optimizers import torch._dynamo on first use: a second of CPU).
SHARED_IMPORTS = ("torch._dynamo",)


# What the processes shoal starts get unless the user's environment sets it. OpenMP's threads (libgomp: torch's
# intra-op pool, MKL's, oneDNN's) otherwise spin for a while after each parallel region, burning a core another rank,
# or another job, needs: on a shared machine about 30 % of the training processes' CPU. Sleeping costs only a wake-up.
RANK_ENVIRONMENT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def rank_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` with RANK_ENVIRONMENT_DEFAULTS for what it does not set: the environment of a rank shoal starts."""
    return {**RANK_ENVIRONMENT_DEFAULTS, **environment}


def forkserver_context(preload: Sequence[str]):
    """multiprocessing's forkserver context, its server running; started here, once per process, without the working
    folder on its import path.

    multiprocessing starts the server (and its resource tracker) as `python -c ...`, which puts the working folder
    first on sys.path: the server's first imports (multiprocessing, then `preload`: torch, google.protobuf, shoal)
    would come from a package lying there. PYTHONSAFEPATH (Python 3.11+) keeps it off, in the server's environment
    only: a rank forked from it takes the launcher's environment and sys.path (launch._entry, multiprocessing's own).
    The server starts with RANK_ENVIRONMENT_DEFAULTS too: OpenMP reads its settings once, when torch loads it (in the
    server, by `preload`), so a rank's own environment comes too late for them.
    """
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    preload = list(preload) + [name for name in SHARED_IMPORTS if name in sys.modules and name not in preload]
    preload.append("shoal.config.forkserver_heap")  # last: freezes the heap the others built
    context.set_forkserver_preload(preload)  # effective until the server starts (once per process)
    server_only = {**{name: value for name, value in RANK_ENVIRONMENT_DEFAULTS.items() if name not in os.environ},
                   "PYTHONSAFEPATH": "1"}
    before = {name: os.environ.get(name) for name in server_only}
    os.environ.update(server_only)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return context


# -- finding and loading ---------------------------------------------------------------
def _resolve(path: Path, base_dirs: list[Path]) -> Path:
    candidates = [path] if path.is_absolute() else [Path.cwd() / path] + [d / path for d in base_dirs]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise PluginError(str(path), "no such plugin file" + (f" (looked in {', '.join(str(d) for d in base_dirs)} too)" if base_dirs and not path.is_absolute() else ""))
    resolved = found.resolve()
    if found.suffix not in SUFFIXES or resolved.suffix != found.suffix:  # (a link named .proto to a module is a module)
        raise PluginError(str(path), "a plugin is a Python module (.py) or a protobuf schema (.proto)"
                          + (f"; this is a link to {resolved}" if resolved.suffix != found.suffix else ""))
    return resolved


def _claim_module_name(name: str, path: Path) -> None:
    """Refuse a module name some other module already has: importing the plugin by name would find that one."""
    other = sys.modules.get(name)
    if other is not None and getattr(other, "__file__", None) != str(path):
        where = getattr(other, "__file__", None) or "elsewhere"
        raise PluginError(str(path), f"a module named '{name}' is already imported (from {where}); rename the plugin")


def _load_proto(path: Path) -> ModuleType:
    """Compile a .proto with protoc against shoal's schema and import the module it becomes, as `<stem>_pb2`."""
    if path.name in ("job.proto", "common.proto"):
        raise PluginError(str(path), f"{path.name} is shoal's schema file name; give the plugin another name")
    module_name = path.stem + "_pb2"
    _claim_module_name(module_name, path)
    try:
        descriptor_pool.Default().FindFileByName(path.name)
        raise PluginError(str(path), f"a schema file named {path.name} is already loaded (from another folder); rename one")
    except KeyError:
        pass
    with tempfile.TemporaryDirectory(prefix="shoal-plugin-") as out:
        _compile(path, Path(out))
        file = _compiled_file(Path(out) / "descriptor.pb")
        _refuse_unloaded_imports(path, file)
        _refuse_taken_numbers(path, file)
        module = _exec_module(module_name, Path(out) / (path.stem + "_pb2.py"), path, SCHEMA_MODULES)
    module.__file__ = str(path)  # the schema it came from; the generated code lived in a temporary folder
    return module


def _compile(path: Path, out: Path) -> None:
    command = [sys.executable, "-I", "-c", _PROTOC, json.dumps(import_path()), f"-I{CONFIG_DIR}", f"-I{path.parent}",
               f"--python_out={out}", f"--descriptor_set_out={out / 'descriptor.pb'}", "--include_source_info", str(path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PluginError(str(path), f"cannot run protoc: {err}") from None
    if done.returncode == 0:
        return
    if "No module named 'grpc_tools'" in done.stderr:
        raise PluginError(str(path), "shoal compiles .proto plugins with grpcio-tools: pip install grpcio-tools")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    for line in lines:
        m = _PROTOC_MESSAGE.match(line)
        if m and not m["message"].startswith("warning:"):
            source = str(path) if Path(m["file"]).name == path.name else m["file"]
            raise PluginError(source, m["message"], int(m["line"]), int(m["col"]))
    errors = [line for line in lines if "warning" not in line.lower() and not line.startswith(("WARNING:", "W0000"))]
    raise PluginError(str(path), errors[-1] if errors else f"protoc failed with exit code {done.returncode}")


def _compiled_file(descriptor_set: Path) -> descriptor_pb2.FileDescriptorProto:
    (file,) = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    return file


def _refuse_unloaded_imports(path: Path, file: descriptor_pb2.FileDescriptorProto) -> None:
    """An import that no loaded plugin provides: its generated code would import `<name>_pb2` from sys.path (code)."""
    pool = descriptor_pool.Default()
    for dependency in file.dependency:
        if dependency.startswith(WELL_KNOWN_PREFIX) or dependency in ("job.proto", "common.proto"):
            continue
        try:
            pool.FindFileByName(dependency)
        except KeyError:
            raise PluginError(str(path), f'imports "{dependency}", which no loaded plugin provides; '
                                         "name that .proto as a plugin before this one") from None


def _refuse_taken_numbers(path: Path, file: descriptor_pb2.FileDescriptorProto) -> None:
    """An extension number another loaded plugin already uses for the same message (protobuf's own words name neither)."""
    pool = descriptor_pool.Default()
    where = {tuple(loc.path): loc.span for loc in file.source_code_info.location}
    for i, ext in enumerate(file.extension):  # top-level `extend` blocks (FileDescriptorProto field 7)
        try:
            other = pool.FindExtensionByNumber(pool.FindMessageTypeByName(ext.extendee.lstrip(".")), ext.number)
        except KeyError:
            continue
        span = where.get((7, i, 3), where.get((7, i), [None, None]))  # the number's position, else the field's
        raise PluginError(
            str(path),
            f"{ext.name} = {ext.number}: {ext.extendee.lstrip('.')} extension number {ext.number} is taken by "
            f"[{other.full_name}] (from {other.file.name}); each plugin needs its own numbers",
            span[0] + 1 if span[0] is not None else None,
            span[1] + 1 if span[1] is not None else None,
        )


def _load_module(path: Path) -> ModuleType:
    """Import a layer module by its file name; its folder becomes importable for its helper modules."""
    _claim_module_name(path.stem, path)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    return _exec_module(path.stem, path, path, {})


def _exec_module(name: str, code: Path, plugin: Path, aliases: dict[str, ModuleType]) -> ModuleType:
    """Run `code` as module `name`; any failure is one PluginError naming `plugin` and, if known, the line."""
    spec = importlib.util.spec_from_file_location(name, code)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    hidden = {alias: sys.modules.get(alias) for alias in aliases}
    sys.modules.update(aliases)  # generated code imports its dependencies as top-level modules
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # sys.exit() and KeyboardInterrupt too: they must not end shoal silently
        del sys.modules[name]
        raise _import_error(err, code, plugin) from None
    finally:
        for alias, previous in hidden.items():
            if previous is None:
                sys.modules.pop(alias, None)
            else:
                sys.modules[alias] = previous
    return module


def _import_error(err: BaseException, code: Path, plugin: Path) -> PluginError:
    if isinstance(err, PluginError):
        return err
    if isinstance(err, SyntaxError) and err.filename and Path(err.filename).resolve() == code.resolve():
        return PluginError(str(plugin), f"SyntaxError: {err.msg}", err.lineno, err.offset)
    line = None
    if code == plugin:  # the deepest line of the plugin itself that the error passed through
        lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if Path(frame.filename).resolve() == code.resolve()]
        line = lines[-1] if lines else None
    if isinstance(err, SystemExit):
        return PluginError(str(plugin), f"cannot load plugin: it exits at import (SystemExit: {err.code})", line)
    message = " ".join(str(err).split())
    said = f"{type(err).__name__}: {message}" if message else f"{type(err).__name__} at import"
    return PluginError(str(plugin), f"cannot load plugin: {said}", line)
