"""docs/architecture.md's rules are each checked by a test, and each architecture test is a rule the page states.

The page's table "What the tests check on this page" names, for each claim, the tests that fail when the code breaks
it. This file fails when a named test is gone (the claim would be unchecked), when a test of tests/test_architecture*.py
is named nowhere (a rule the page does not state), or when a layering rule of test_architecture.py is not in the table.
It also checks the page's prose against the tree (issue 41 point 4): every file, module, class, function and job field
it names exists, and the lists and counts it states (the layers' modules, the picture, the table of strategies, the
interfaces, Downpour's and Distributed Hogwild's files, the cost model's modules) are the code's.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Optional

import pytest
from test_architecture import parse

# the source parsed once for these checks and tests/test_architecture.py's rules: one test process (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("architecture_source")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
TESTS = ROOT / "tests"
SRC = ROOT / "src" / "shoal"
TITLE = "### What the tests check on this page"


def claims_table(text: str) -> list[tuple[str, list[str]]]:
    """(claim, ["file.py::test_name", ...]) for each row of the page's table of checked claims."""
    if TITLE not in text:
        return []
    section = text.split(TITLE, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) == 2 and cells[0] != "claim":
            rows.append((cells[0], re.findall(r"`([\w./]+\.py::\w+)`", cells[1])))
    return rows


@functools.lru_cache(maxsize=None)  # each file parsed once, for the many checks that name it
def functions_of(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def missing_checks(text: str) -> list[str]:
    """The page's named checks that are not a test function of tests/ (a claim naming none counts as missing)."""
    missing = []
    for claim, checks in claims_table(text):
        if not checks:
            missing.append(f"(nothing, for {claim[:60]!r})")
        for check in checks:
            file, name = check.split("::")
            if not (TESTS / file).is_file() or name not in functions_of(TESTS / file):
                missing.append(check)
    return missing


def test_every_claim_names_tests_that_exist():
    assert len(claims_table(PAGE.read_text())) >= 20, f"{PAGE}: no table under {TITLE!r}"
    assert missing_checks(PAGE.read_text()) == []


def test_every_architecture_test_is_a_claim_of_the_page():
    named = {check for _, checks in claims_table(PAGE.read_text()) for check in checks}
    unnamed = [f"{path.name}::{name}" for path in sorted(TESTS.glob("test_architecture*.py")) if path != Path(__file__)
               for name in sorted(functions_of(path)) if f"{path.name}::{name}" not in named]
    assert not unnamed, f"tests not named in {PAGE.name}'s table {TITLE!r}: {unnamed}"


def test_every_layering_rule_is_stated_on_the_page():
    from test_architecture import RULES

    stated = " ".join(claim for claim, _ in claims_table(PAGE.read_text()))
    assert [rule for rule in RULES if rule not in stated] == []


def test_the_check_sees_a_claim_whose_test_is_gone():
    page = (f"{TITLE}\n\n| claim | checked by |\n|---|---|\n| a rule | `test_architecture.py::test_nothing_like_it` |\n"
            "| a kept rule | `test_architecture.py::test_layering` |\n| an unchecked rule | by reading |\n")
    assert missing_checks(page) == ["test_architecture.py::test_nothing_like_it", "(nothing, for 'an unchecked rule')"]


# -- the names the page mentions are the code's ------------------------------------------------------------------------
# A `backticked` span of the page's prose that names code names code that exists: a file or folder of the repository
# (`launcher/rejoin.py`, `frontend/cli.py::_run`, `planning/plan.sliced_for`), what a module defines (`rejoin.Restarter`,
# `launch.ProcessLost`), a class's member (`Strategy.process_groups`; `plan.strategy`: a JobPlan's, `run.batches`: a
# Session's, `exchange.step`: an Exchange's, `cluster.max_restarts`: a field of job.proto), or a name some module
# defines (a function, class, attribute, parameter, a record's key). A call written with its parameters
# (`after_values(run, spec)`) has those parameters first. Commands, options and code are not names; what the page
# names that is not shoal's, or not built, is listed here with why.
NOT_SHOAL = {  # python's, torch's, torchft's, a user's
    "Manager", "PrefixStore", "Dataset", "atexit", "__main__", "isinstance", "match", "backward", "no_sync", "clip_grad_norm_",
    "importlib", "torch", "sys", "model", "opt", "lr", "weight_decay", "state_dict", "SystemExit", "ProcessGroupGloo",
    "ProcessGroupNCCL", "new_group", "broadcast", "gather"}
NOT_NAMES = {  # examples the page builds, and names it says are not (or not yet) in the code
    "job.conf",  # a user's job file
    "strategies/easgd.py", "planning/framework_costs/easgd.py",  # "To add a framework (e.g. EASGD)"
    "runtime/commit.py", "Commit.begin",  # "The design named that layer runtime/commit.py ...; as built it is comm/quorum"
    "member_state", "load_member_state", "ShardUpdater",  # the Worker/Exchange contract's: its "today ..." is what is built
    "mirror_freq",  # the design's point 6; "Built ...": mirror_interval
}
PLACES = {"plan": "JobPlan", "run": "Session", "exchange": "Exchange", "trainer": "Trainer"}  # the page's names for objects
MESSAGES = {"job": "JobProto", "cluster": "ClusterProto"}  # job.proto's messages, by the page's names for them
ALIASES = {"comm": "dist"}  # `from shoal.comm import dist as comm`: the code's name for shoal.comm.dist
USER_CALLS = {"run"}  # `run.optimizer(opt)`: a user's call, written with the user's values, not the parameters' names


class Code:
    """What the source under `root` defines: each file's top-level names, each class's members (and bases), each
    function's parameters, and every name defined anywhere."""

    def __init__(self, root: Path = SRC):
        self.root, self.files, self.classes, self.bases, self.params, self.names = root, {}, {}, {}, {}, set()
        for path in sorted(root.rglob("*.py")):
            tree = parse(path)  # (test_architecture.py's: the rules there parse the same files)
            top = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    top.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)):
                    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                    top |= {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
                    top |= {(a.asname or a.name).split(".")[0] for a in getattr(node, "names", [])}
            self.files[str(path.relative_to(root))] = top
            classes, own = [], []  # (name, first line, last line); (attribute, line) of each `self.x = ...`
            for node in ast.walk(tree):  # one walk: a class's members are its body's names and its methods' self.x
                if isinstance(node, ast.arg):  # keywords (fit's val_steps)
                    self.names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    self.names.add(node.value)  # a record's keys and phases (`samples`, `test`)
                elif isinstance(node, ast.ClassDef):
                    classes.append((node.name, node.lineno, node.end_lineno))
                    self.bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
                    members = self.classes.setdefault(node.name, set())
                    for sub in node.body:
                        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                            members.add(sub.name)
                        elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                            members |= {t.id for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                                        if isinstance(t, ast.Name)}
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    own += [(t.attr, node.lineno) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # nested ones too (the trainer's run_phase)
                    self.names.add(node.name)
                    args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                    self.params.setdefault(node.name, []).append(args[1:] if args[:1] in (["self"], ["cls"]) else args)
            for attr, line in own:  # the innermost class around the assignment
                around = [c for c in classes if c[1] <= line <= c[2]]
                if around:
                    self.classes[max(around, key=lambda c: c[1])[0]].add(attr)
        protos = "\n".join(p.read_text() for p in root.rglob("*.proto"))
        self.messages = {m: set(re.findall(r"\s(\w+)\s*=\s*\d+", protos.split(f"message {m} ", 1)[1].split("\n}", 1)[0]))
                         for m in MESSAGES.values() if f"message {m} " in protos}
        self.names |= ({n for top in self.files.values() for n in top} | {m for ms in self.classes.values() for m in ms}
                       | set(re.findall(r"(\w+)\s*=\s*\d+", protos)) | {Path(f).stem for f in self.files}
                       | {p.name for p in root.rglob("*") if p.is_dir()}
                       | {name for p in TESTS.glob("test_*.py") for name in re.findall(r"^def (test_\w+)", p.read_text(), re.M)})

    def members(self, cls: str) -> set[str]:
        """A class's members, its bases' too (by name)."""
        seen, todo, found = set(), [cls], set()
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                found |= self.classes.get(name, set())
                todo += sorted(self.bases.get(name, ()))
        return found

    def ancestors(self, cls: str) -> set[str]:
        """A class's bases, and theirs (by name)."""
        found, todo = set(), [cls]
        while todo:
            for base in self.bases.get(todo.pop(), ()):
                if base not in found:
                    found.add(base)
                    todo.append(base)
        return found

    def modules(self, stem: str) -> list[str]:
        return [f for f in self.files if Path(f).stem == stem or f == f"{stem}/__init__.py" or f.endswith(f"/{stem}/__init__.py")]

    def in_module(self, files: list[str], name: str) -> bool:
        """Whether one of `files` defines `name`, or is a package with a module `name`."""
        return any(name in self.files[f] or (f.endswith("__init__.py") and any(
            g == str(Path(f).parent / f"{name}.py") or g.startswith(str(Path(f).parent / name) + "/") for g in self.files))
            for f in files)

    def check_dotted(self, parts: list[str]) -> Optional[str]:
        head, rest = parts[0], parts[1:]
        if head in NOT_SHOAL:
            return None
        if head == "shoal":
            if (self.root / f"{rest[0]}.py").is_file() or (self.root / rest[0]).is_dir():
                return self.check_dotted(rest) if len(rest) > 1 else None
            exported = re.search(r"__all__ = \[([^\]]*)\]", (self.root / "__init__.py").read_text())
            return None if exported and f'"{rest[0]}"' in exported.group(1) else f"shoal exports no {rest[0]}"
        if head in MESSAGES:
            fields = self.messages.get(MESSAGES[head], set())
            return None if rest[0] in fields else f"job.proto's {MESSAGES[head]} has no field {rest[0]}"
        if head in PLACES or head in self.classes:
            cls = PLACES.get(head, head)
            for name in rest:
                if name not in self.members(cls):
                    return f"{cls} has no {name}"
                if name not in ("strategy", "framework"):  # a plan's strategy and framework: their members follow
                    return None
                cls = name.capitalize()
            return None
        files = self.modules(head) + (self.modules(ALIASES[head]) if head in ALIASES else [])
        if not files:
            return f"no module or class {head}"
        if not self.in_module(files, rest[0]):
            return f"{head} defines no {rest[0]}"
        if len(rest) > 1 and rest[0] in self.classes and rest[1] not in self.members(rest[0]):
            return f"{rest[0]} has no {rest[1]}"
        return None

    def check_path(self, path: str, qual: str) -> Optional[str]:
        module, attr = (path, "") if path.endswith((".py", ".md", "/")) else path.partition(".")[::2]
        module = module.removeprefix("src/shoal/").removeprefix("shoal/")
        found = [p for p in (ROOT / module, self.root / module, self.root / f"{module}.py", TESTS / module) if p.exists()]
        found = found or [self.root / f for f in self.files if f.endswith("/" + module)]
        if not found:  # a file the code writes (visualization/train_net.json) is named in it
            return None if any(Path(module).name in p.read_text() for p in self.root.rglob("*.py")) else f"no file {path}"
        name, _, member = (attr or qual).partition(".")
        if not name:
            return None
        file = found[0]
        top = self.files[str(file.relative_to(self.root))] if file.is_relative_to(self.root) else functions_of(file)
        if name not in top:
            return f"{path} defines no {name}"
        return f"{name} has no {member}" if member and member not in self.members(name) else None

    def check_call(self, token: str) -> Optional[str]:
        """`f(a, b)`: some function f has the parameters a, b first; `f(..., k=v)`, `f(a, k=0, b)`: it has a parameter k
        (a call written with `...` for what it leaves out: only its keywords are checked)."""
        called = re.fullmatch(r"([\w.]+)\(((?:\.\.\.|[A-Za-z_]\w*(?:=[\w.]*)?)(?:, (?:\.\.\.|[A-Za-z_]\w*(?:=[\w.]*)?))*)\)", token)
        if not called or called.group(1).split(".")[0] in USER_CALLS | NOT_SHOAL or called.group(1) in NOT_NAMES:
            return None
        name, args = called.group(1).split(".")[-1], called.group(2).split(", ")
        if name[:1].isupper():  # a class: its __init__'s parameters
            name = "__init__" if called.group(1).split(".")[-1] in self.classes else name
        names, keywords = [a.split("=")[0] for a in args], {a.split("=")[0] for a in args if "=" in a}
        known = self.params.get(name, [])
        signature = "..." not in args and len(keywords) < len(args)  # `after_values(run, spec)`, `run_process(plan, rank=0, spec)`
        fits = any(keywords <= set(p) and (not signature or p[:len(names)] == names) for p in known)  # a call: its keywords
        return None if not known or fits else f"{name} takes {known[0]}"

    def check(self, token: str) -> Optional[str]:
        """Why `token` names nothing in the code (None: it does, or it is no name)."""
        first = token.split(" ")[0]
        bad_call = self.check_call(token)
        token = re.sub(r"\(.*\)$", "", first if "/" in first else token)
        if token in NOT_NAMES or token in NOT_SHOAL or token.startswith(".") or not re.fullmatch(r"[\w./]+(::[\w.]+)?", token):
            return None
        path, _, qual = token.partition("::")
        if "/" in path or path.endswith((".py", ".md")):
            return self.check_path(path, qual) or bad_call
        if "." in token:
            return self.check_dotted(token.split(".")) or bad_call
        return (None if token in self.names else f"nothing defines {token}") or bad_call


def page_names(text: str) -> list[str]:
    """Every `backticked` span of the page's prose (not its code blocks), once each, in order."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return list(dict.fromkeys(re.findall(r"`([^`\n]+)`", prose)))


def unknown_names(text: str, code: Code) -> list[str]:
    return [f"`{name}`: {why}" for name in page_names(text) for why in [code.check(name)] if why]


@functools.lru_cache(maxsize=1)
def the_code() -> Code:
    return Code()


def test_the_page_names_only_code_that_exists():
    assert len(page_names(PAGE.read_text())) > 400
    assert unknown_names(PAGE.read_text(), the_code()) == []


def test_the_name_check_sees_a_name_that_is_gone():
    page = ("`launcher/rejoin.py` `launcher/rejoin.py::door_of` `launcher/rejoin.py::door_gone` `rejoin.Restarter` "
            "`rejoin.Gone` `Strategy.meets` `Strategy.gone` `plan.strategy.meets` `plan.gone` `cluster.max_restarts` "
            "`cluster.gone` `JobPlan` `GoneClass` `after_values(run, spec)` `after_values(run, gone)` `runtime/gone.py` "
            "`shoal.fit` `shoal.gone` `shoal run job.conf --set x=1` `--max-restarts` `plan_job(..., strategies=REGISTRY)` "
            "`plan_job(..., registry=REGISTRY)` `run_process(plan, rank=0, spec)`\n```\n`in/a/code/block.py`\n```\n")
    assert [line.split(" takes ")[0] for line in unknown_names(page, the_code())] == [
        "`launcher/rejoin.py::door_gone`: launcher/rejoin.py defines no door_gone", "`rejoin.Gone`: rejoin defines no Gone",
        "`Strategy.gone`: Strategy has no gone", "`plan.gone`: JobPlan has no gone",
        "`cluster.gone`: job.proto's ClusterProto has no field gone", "`GoneClass`: nothing defines GoneClass",
        "`after_values(run, gone)`: after_values", "`runtime/gone.py`: no file runtime/gone.py",
        "`shoal.gone`: shoal exports no gone", "`plan_job(..., registry=REGISTRY)`: plan_job"]


# -- what the page lists and counts is the tree's ----------------------------------------------------------------------
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
DESCRIBED_MODULE_BY_MODULE = ("frontend", "launcher", "runtime", "strategies", "planning", "comm")  # in "The layers"


def section(text: str, title: str) -> str:
    """The page's text from the heading (or sentence) `title` to the next heading."""
    return text.split(title, 1)[1].split("\n#", 1)[0] if title in text else ""


def layer_paragraphs(text: str) -> dict[str, str]:
    """"The layers"' tree: each package of src/shoal/ → its paragraph."""
    block = section(text, "## The layers").split("```", 2)[1] if "```" in section(text, "## The layers") else ""
    paragraphs, package = {}, None
    for line in block.splitlines():
        start = re.match(r"  (\w+)(/|\.py)\s", line)
        if start:
            package = start.group(1)
            paragraphs[package] = line
        elif package and line.startswith("    "):
            paragraphs[package] += " " + line
    return paragraphs


def layer_problems(text: str, root: Path = SRC) -> list[str]:
    """A package of src/shoal/ without its paragraph in "The layers"; a module (or sub-package, `name/`) of the packages
    described module by module that its paragraph does not name."""
    paragraphs = layer_paragraphs(text)
    problems = [f"no paragraph for {p.name}" for p in sorted(root.iterdir())
                if (p.is_dir() and (p / "__init__.py").is_file() or p.name == "errors.py") and p.stem not in paragraphs]
    for package in DESCRIBED_MODULE_BY_MODULE:
        words = set(re.findall(r"\w+/?", paragraphs.get(package, "")))
        for path in sorted((root / package).iterdir()):
            name = f"{path.name}/" if path.is_dir() and (path / "__init__.py").is_file() else path.stem if path.suffix == ".py" else None
            if name and name != "__init__" and name not in words:
                problems.append(f"{package}/'s paragraph does not name {name}")
    return problems


def picture_problems(text: str, root: Path = SRC) -> list[str]:
    """"The house in one picture": its layers in the order of the import rules (test_architecture_path.LAYERS, the order
    that defines a call back up), and each module it names in a layer a module or sub-package of that package."""
    block = section(text, "### The house in one picture").split("```text", 1)[-1].split("```", 1)[0]
    rows = [re.split(r"\s{3,}", line.strip()) for line in block.splitlines() if re.match(r"  \w", line) and "beside" not in line]
    layers = [name for row in rows for name in row[0].split(" · ")]
    order = ast.literal_eval(re.search(r"^LAYERS = (\[.*\])$", (TESTS / "test_architecture_path.py").read_text(), re.M).group(1))
    problems = [] if [n for n in layers if n != "data"] == order else [f"the picture's layers {layers} are not {order}"]
    for row in rows:
        if row[0] in DESCRIBED_MODULE_BY_MODULE and len(row) > 1:
            for name in re.split(r" · |, ", row[1]):
                if name != "one module per framework" and not ((root / row[0] / f"{name}.py").is_file() or (root / row[0] / name).is_dir()):
                    problems.append(f"the picture's {row[0]} has no module {name}")
    return problems


def strategy_table(text: str) -> set[tuple[str, str]]:
    """(module, Framework member) of each row of the table of strategies."""
    return set(re.findall(r"^\| `(\w+)` \| (\w+) \|", section(text, "## One strategy per framework"), re.M))


def strategies_of(root: Path = SRC) -> set[tuple[str, str]]:
    """(module, Framework member) of each strategy module: its class's `framework = Framework.X`."""
    return {(path.stem, found.group(1)) for path in sorted((root / "strategies").glob("*.py"))
            for found in [re.search(r"^    framework = Framework\.(\w+)$", path.read_text(), re.M)] if found}


def count_problems(text: str, root: Path = SRC) -> list[str]:
    """The counts the page states: Downpour's and Distributed Hogwild's files, the cost model's modules per framework,
    the job in ten files."""
    problems = []
    moves = section(text, "### What stays and what moves")
    for family, sentence in (("downpour", r"Downpour is (\w+) files"), ("hogwild", r"Distributed Hogwild likewise is (\w+) files")):
        named = set(re.findall(rf"`({family}\w*\.py)`", moves))
        files = {p.name for p in (root / "runtime" / "exchanges").glob(f"{family}*.py")}
        said = re.search(sentence, moves)
        if named != files or not said or NUMBERS.get(said.group(1)) != len(files):
            problems.append(f"{family}: the page says {said.group(1) if said else '?'} files, {sorted(named)}; "
                            f"runtime/exchanges/ holds {sorted(files)}")
    costs = text.split("Not a strategy's: its **cost model**", 1)[-1].split("the base", 1)[0]
    named = set(re.findall(r"`(\w+)`", costs))
    files = {p.stem for p in (root / "planning" / "framework_costs").glob("*.py")} - {"__init__", "base"}
    if named != files:
        problems.append(f"framework_costs: the page names {sorted(named)}, the package holds {sorted(files)}")
    steps = re.findall(r"^\d+\. `", section(text, "### The same job in ten files"), re.M)
    if len(steps) != 10:
        problems.append(f"the job in ten files lists {len(steps)}")
    return problems


def interface_problems(text: str, code: Code) -> list[str]:
    """"The interfaces": each protocol's listed methods are its public methods in runtime/interfaces.py, all of them."""
    problems = []
    for name, listed in re.findall(r"^- \*\*`(\w+)`\*\*: (.*?)\.", section(text, "## The interfaces"), re.M | re.S):
        listed = re.split(r":\s", listed)[-1]  # (after "a `Worker` or a `PartitionedGroup` (...):")
        methods, named = {m for m in code.classes.get(name, set()) if not m.startswith("_")}, set(re.findall(r"`(\w+)`", listed))
        if named != methods:
            problems.append(f"{name}: the page lists {sorted(named)}, the code has {sorted(methods)}")
    return problems


def strategy_member_problems(text: str, code: Code) -> list[str]:
    """"What a strategy answers": each member it names (`recognises(layout)`, `meets`) is the Strategy base's."""
    answers = text.split("What a strategy answers (`Strategy`'s members", 1)[-1].split("Not a strategy's", 1)[0]
    return [f"Strategy has no {name}" for name in re.findall(r"`([a-z_]\w*)(?:\([^`]*\))?`", answers)
            if name not in code.members("Strategy")]


def example_problems(text: str, root: Path = SRC) -> list[str]:
    """"The smallest real module is `strategies/single_worker.py`": the code the page shows is that module's, verbatim."""
    shown = text.split("The smallest real module is", 1)[-1].split("```python\n", 1)[-1].split("```", 1)[0]
    return [] if shown.strip() and shown in (root / "strategies" / "single_worker.py").read_text() else [
        "the page's strategies/single_worker.py is not the module's"]


# sentences of the page that say which strategies set a flag (`Strategy`'s, True in the strategy's module), and which
# errors are or are not ShoalErrors (what the CLI prints in one line)
FLAG_CLAIMS = [
    ("only Downpour and Distributed Hogwild keep theirs in host memory", "params_on_host", {"downpour", "distributed_hogwild"}),
    ("restarts a dead Downpour, Local SGD or Distributed Hogwild group's process", "rejoins",
     {"downpour", "local_sgd", "distributed_hogwild"}),
]
ERROR_CLAIMS = [
    ("Errors that are control flow inside the runtime (`GroupsAborted`, `GroupAborted`, `GroupDropped`) are not ShoalErrors",
     {"GroupsAborted": False, "GroupAborted": False, "GroupDropped": False}),
    ("A failure in a spawned process reaches the user as `ProcessFailed`", {"ProcessFailed": True}),
    ("is `report/writes.py::WorkspaceWriteError`, naming the file", {"WorkspaceWriteError": True}),
    ("(`UnsupportedClusterError`, one line)", {"UnsupportedClusterError": True}),
]


def pinned_problems(text: str, code: Code, root: Path = SRC) -> list[str]:
    """The sentences above, each on the page and true of the code."""
    prose, problems = " ".join(text.split()), []
    for sentence, flag, modules in FLAG_CLAIMS:
        setting = {p.stem for p in (root / "strategies").glob("*.py") if re.search(rf"^    {flag} = True\b", p.read_text(), re.M)}
        if sentence not in prose or setting != modules:
            problems.append(f"{sentence!r}: {flag} is set by {sorted(setting)}")
    for sentence, errors in ERROR_CLAIMS:
        wrong = [name for name, is_one in errors.items() if ("ShoalError" in code.ancestors(name)) != is_one]
        if sentence not in prose or wrong:
            problems.append(f"{sentence!r}: {wrong}")
    return problems


def test_the_layers_name_every_package_and_the_modules_of_the_step():
    assert layer_problems(PAGE.read_text()) == []


def test_the_picture_is_the_house():
    assert picture_problems(PAGE.read_text()) == []


def test_the_table_of_strategies_is_the_strategies():
    assert len(strategy_table(PAGE.read_text())) >= 8
    assert strategy_table(PAGE.read_text()) == strategies_of()


def test_the_counts_on_the_page_are_the_trees():
    assert count_problems(PAGE.read_text()) == []
    assert example_problems(PAGE.read_text()) == []


def test_the_interfaces_and_what_a_strategy_answers_are_the_codes():
    assert interface_problems(PAGE.read_text(), the_code()) == []
    assert strategy_member_problems(PAGE.read_text(), the_code()) == []
    assert pinned_problems(PAGE.read_text(), the_code()) == []


def test_the_list_checks_see_a_page_that_is_wrong():
    page = PAGE.read_text()
    wrong = (page.replace("Downpour is four files", "Downpour is five files")
             .replace("`in_memory`, `local_sgd`", "`local_sgd`")
             .replace("`use_view_updater`,\n", "")
             .replace("`refuse(layout)`", "`refuses(layout)`")
             .replace("| `downpour` | DOWNPOUR |", "| `downpour` | LOCAL_SGD |")
             .replace("runtime      assemble · trainer", "runtime      assemble · trainers")
             .replace("  strategies   one module", "  planning     plan\n  strategies   one module")
             .replace("checkpoint_schedule;", ";").replace("session_exchange (the exchange", "the exchange")
             .replace("    synchronous = True\n", "    synchronous = False\n")
             .replace("only Downpour and Distributed", "only Distributed").replace("`GroupAborted`, `GroupDropped`)", "`GroupAborted`)"))
    assert pinned_problems(wrong, the_code()) == [
        "'only Downpour and Distributed Hogwild keep theirs in host memory': params_on_host is set by ['distributed_hogwild', "
        "'downpour']",
        "'Errors that are control flow inside the runtime (`GroupsAborted`, `GroupAborted`, `GroupDropped`) are not "
        "ShoalErrors': []"]
    assert example_problems(wrong) == ["the page's strategies/single_worker.py is not the module's"]
    assert len(count_problems(wrong)) == 2 and count_problems(wrong)[0].startswith("downpour: the page says five files")
    assert interface_problems(wrong, the_code()) == [
        "GroupMember: the page lists ['compute', 'computed_nodes', 'feeds', 'generator', 'index', 'placed_workers', 'share', "
        "'stream_gradients', 'take_rows'], the code has ['compute', 'computed_nodes', 'feeds', 'generator', 'index', "
        "'placed_workers', 'share', 'stream_gradients', 'take_rows', 'use_view_updater']"]
    assert strategy_member_problems(wrong, the_code()) == ["Strategy has no refuses"]
    assert strategy_table(page) - strategy_table(wrong) == {("downpour", "DOWNPOUR")}
    assert picture_problems(wrong)[0].startswith("the picture's layers ['frontend', 'launcher', 'planning', 'strategies'")
    assert picture_problems(wrong)[1:] == ["the picture's runtime has no module trainers"]
    assert layer_problems(wrong) == ["runtime/'s paragraph does not name checkpoint_schedule",
                                     "runtime/'s paragraph does not name session_exchange"]


def test_shoal_plan_prints_exactly_the_plan(blobs_job):
    """"`shoal plan` prints exactly this object (`planning/describe.py`, text or `--json`)": the command's JSON is
    `describe` of the plan the launcher computes for the job, and its text starts with `render` of it."""
    import json

    import shoal
    from cli_in_process import run_cli
    from shoal.planning.describe import describe, render
    from shoal.planning.plan import plan_job
    from shoal.strategies.registry import REGISTRY

    job = blobs_job(layout="Sandblaster, 2 workers + 2 servers, 4 processes")
    plan = plan_job(shoal.load_job(job), nnodes=1, strategies=REGISTRY)  # (as the command plans it)
    as_json = run_cli("plan", job, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == json.loads(json.dumps(describe(plan)))
    as_text = run_cli("plan", job)
    assert as_text.returncode == 0 and as_text.stdout.startswith(render(plan)), as_text.stdout
