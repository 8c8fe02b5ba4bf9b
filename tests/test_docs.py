"""The docs name only what exists (issue 55: docs described a removed design, and nothing noticed).

README.md, docs/*.md and the module docstrings of ``loader/`` and ``shardgen/`` are read for what
they name, and each name is looked up:

* a path of ours (``loader/...py``, ``shardgen/...py``, ``benchmarks/...py``, ``tests/...py``), and
  a test named after it (``tests/x.py::test_y``; a bare ``::test_z`` after it is in the same file);
  a bare ``name.py`` on a line that names one of our folders must be in one of those folders;
* a dotted name of ours in backticks (``loader.x.y``, ``shardgen.x:name``): imported, and every
  name past the module an attribute of it;
* ``Class.attr`` in backticks, where ``Class`` is a class defined in ``loader/`` or ``shardgen/``;
* ``shardgen <command>`` and its ``--flags`` (the parser of ``shardgen/cli.py``), the flags of
  ``loader.tools.train`` and ``loader.tools.launch``, a bare ``--flag`` (one of all of those);
* every keyword of ``ShardIter(...)`` / ``ShardIter.for_kvstore(...)`` and every row of the
  README's argument table: a parameter of ``loader.ShardIter``.

Each failure names the doc, the line and what is missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("loader", "shardgen", "benchmarks", "tests")
_DIRS = "(?:" + "|".join(OURS) + ")"
_PATH = re.compile(rf"\b({_DIRS}/[\w/]*\.py)((?:::\w+)*)")
_FOLDER = re.compile(rf"\b({_DIRS}(?:/\w+)*)/(?![\w/]*\.py)")  # a folder of ours, not a file's path
_DOTTED = re.compile(r"(?<![\w./-])((?:loader|shardgen|benchmarks)(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?")
_FILE_EXT = re.compile(r"\.(?:toml|json|py|md|rec|idx|npy|log|lock)$")
_MEMBER = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*)")
_SPAN = re.compile(r"``(.+?)``|`([^`\n]+)`")
_CALL = re.compile(r"\bShardIter(?:\.for_kvstore)?\(")
_PROGRAMS = {"loader.tools.train": "train", "loader.tools.launch": "launch"}


def doc_lines(text: str):
    """``(line number, line, what to look in)`` of a Markdown text: its backtick spans, and a line of
    a fenced code block whole."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        spans = [a or b for a, b in _SPAN.findall(line)]
        yield number, line, (spans + [line] if fenced else spans)


def _flags_of_tool(path: Path) -> frozenset:
    """The ``--flags`` a tool's ``add_argument`` calls declare (read, not run: launch builds its parser in main)."""
    tree = ast.parse(path.read_text())
    return frozenset(arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and getattr(node.func, "attr", None) == "add_argument"
                     for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))


@lru_cache(maxsize=1)
def cli_flags() -> dict:
    """Flags by program: each ``shardgen`` command, ``train``, ``launch``, and ``None``: all of them."""
    from shardgen import cli

    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {f"shardgen {name}": frozenset(s for a in p._actions for s in a.option_strings)
             for name, p in sub.choices.items()}
    flags["shardgen"] = frozenset(s for a in parser._actions for s in a.option_strings).union(*flags.values())
    for module, name in _PROGRAMS.items():
        flags[name] = _flags_of_tool(ROOT / (module.replace(".", "/") + ".py")) | {"--help"}
    flags[None] = frozenset().union(*flags.values())
    return flags


@lru_cache(maxsize=1)
def shard_iter_parameters() -> frozenset:
    from loader import ShardIter

    params = inspect.signature(ShardIter.__init__).parameters.values()  # not **removed: what it refuses
    return frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD) - {"self"}


@lru_cache(maxsize=1)
def our_modules() -> list:
    """``(path, dotted name, parsed tree)`` of every module in ``loader/`` and ``shardgen/``."""
    return [(path, ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"),
             ast.parse(path.read_text()))
            for package in ("loader", "shardgen") for path in sorted((ROOT / package).rglob("*.py"))]


@lru_cache(maxsize=1)
def our_classes() -> dict:
    """Every class defined at the top of a module of ours: name -> the modules defining it."""
    found: dict = {}
    for _, module, tree in our_modules():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def _resolve(dotted: str, attr: str | None) -> str | None:
    """None if ``dotted`` (and ``:attr``) names a module of ours or something in one; else what is missing."""
    parts = dotted.split(".") + ([attr] if attr else [])
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not name.startswith(exc.name) and exc.name.split(".")[0] in OURS:
                return f"{name} fails to import: {exc}"
            continue
        for i, part in enumerate(parts[cut:], cut):
            if not hasattr(obj, part):
                return f"{'.'.join(parts[:i])} has no {part!r}"
            obj = getattr(obj, part)
        return None
    return f"no module {parts[0]!r}"


def _member_problem(cls: str, attr: str) -> str | None:
    for module in our_classes().get(cls, ()):
        if hasattr(getattr(importlib.import_module(module), cls), attr):
            return None
    return f"{cls} ({', '.join(our_classes()[cls])}) has no {attr!r}"


def _test_problem(path: str, names: str) -> str | None:
    """None if the test file at ``path`` defines every ``::name`` of ``names``."""
    source = (ROOT / path).read_text()
    for name in filter(None, names.split("::")):
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", source, re.M):
            return f"{path} has no test {name}"
    return None


def _path_problems(line: str, spans: list) -> list:
    """The paths, tests and bare ``name.py`` of a line that are not there."""
    problems, folders = [], set()
    for path in dict.fromkeys(_PATH.findall(line)):
        if (ROOT / path[0]).is_file():
            folders.add((ROOT / path[0]).parent)
        else:
            problems.append(f"no file {path[0]}")
    last = None  # the test file a bare ``::test_z`` is in: the one named before it
    for span in spans:
        for path, tests in _PATH.findall(span):
            last = path if (ROOT / path).is_file() else None
            if tests and last and path.startswith("tests/"):
                problems.append(_test_problem(path, tests))
        if re.fullmatch(r"(?:::\w+)+", span) and last:
            problems.append(_test_problem(last, span))
    folders |= {ROOT / f for f in _FOLDER.findall(line)}
    for span in spans if folders else ():
        for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", span):
            if not any(p.name == name for f in folders for p in f.rglob(name)):
                problems.append(f"no {name} in {', '.join(sorted(str(f.relative_to(ROOT)) + '/' for f in folders))}")
    return problems


def _cli_problems(span: str) -> list:
    """The commands and flags of a command line (or of a bare ``--flag``) that its program lacks."""
    flags, problems = cli_flags(), []
    program = None if span.lstrip().startswith("-") else "other"  # None: any program of ours
    for token in span.split():
        token = token.strip("[](),`'\"")
        if token.startswith("#"):  # a comment
            break
        if token in ("|", "||", "&&", ";"):
            program = "other"
        elif re.fullmatch(r"(?:\S*/)?shardgen", token):
            program = "shardgen"
        elif token in _PROGRAMS:
            program = _PROGRAMS[token]
        elif program == "shardgen" and re.fullmatch(r"[a-z]+(?:\|[a-z]+)*", token):
            missing = [c for c in token.split("|") if f"shardgen {c}" not in flags]
            problems += [f"no command 'shardgen {c}'" for c in missing]
            program = f"shardgen {token}" if f"shardgen {token}" in flags else "shardgen" if not missing else "other"
        elif re.fullmatch(r"--\w[\w-]*(?:=.*)?", token) and program != "other":
            flag = token.split("=")[0]
            if flag not in flags[program]:
                problems.append(f"{program or 'no program of ours'} has no flag {flag}")
    return problems


def _keyword_problems(span: str) -> list:
    """The keywords of each ``ShardIter(...)`` call in ``span`` that ShardIter does not take."""
    problems = []
    for call in _CALL.finditer(span):
        depth, end = 1, call.end()
        while end < len(span) and depth:
            depth += {"(": 1, ")": -1}.get(span[end], 0)
            end += 1
        for name in re.findall(r"(?<![\w=.])([a-z_]\w*)=(?!=)", span[call.end():end]):
            if name not in shard_iter_parameters():
                problems.append(f"ShardIter has no parameter {name!r}")
    return problems


def problems_in(text: str) -> list:
    """``(line, what is missing)`` for each name in a Markdown text that does not exist."""
    found = []
    table = False
    for number, line, spans in doc_lines(text):
        out = _path_problems(line, spans)
        for span in spans:
            for dotted, attr in _DOTTED.findall(span):
                if not (_FILE_EXT.search(dotted) and not attr):
                    out.append(_resolve(dotted, attr))
            for cls, attr in _MEMBER.findall(span):
                if cls in our_classes():
                    out.append(_member_problem(cls, attr))
            out += _cli_problems(span) + _keyword_problems(span)
        table = line.startswith("| argument |") or (table and line.startswith("|"))
        if table and not line.startswith(("| argument", "| ---")):
            for name in re.findall(r"`(\w+)`", line.split("|")[1]):
                if name not in shard_iter_parameters():
                    out.append(f"ShardIter has no parameter {name!r}")
        found += [(number, p) for p in dict.fromkeys(out) if p]
    return found


def _report(where: list) -> str:
    return "\n".join(f"{doc}:{line}: {problem}" for doc, line, problem in where)


def test_the_docs_name_only_what_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    where = [(doc.relative_to(ROOT), line, p) for doc in docs for line, p in problems_in(doc.read_text())]
    assert not where, "the docs name what does not exist:\n" + _report(where)


def test_module_docstrings_name_only_what_exists():
    where = []
    for path, _, tree in our_modules():
        doc = ast.get_docstring(tree, clean=False)
        if doc:  # a module's docstring is its first statement: its lines count from there
            where += [(path.relative_to(ROOT), tree.body[0].lineno - 1 + line, p) for line, p in problems_in(doc)]
    assert not where, "module docstrings name what does not exist:\n" + _report(where)


MADE_UP = """\
# a page naming what does not exist

The order is seeded in `loader/pipeline/seeding.py` by `loader.pipeline.order.seed_of(epoch)`.
The plug-in is `shardgen.process:no_such_processor`; reads are parked (`PlanFiles.park`).
`ShardIter(m, batch_size=8, readers=2)`, then `shardgen frobnicate -c x` and `shardgen build --no-such-flag`.
A test: `tests/test_cli.py::test_exit_codes_follow_the_table`, `::test_no_such_test`.
| folder | what |
| `loader/source/` | downloads (`nocache.py`) |

| argument | default | meaning |
| --- | --- | --- |
| `batch_size` / `no_such_argument` | required | ... |
| `native_batch` | 8-256 | ... |

```sh
python -m loader.tools.train --no-such-train-flag
```
"""

TRUE = """\
The order (`loader/pipeline/order.py`, `loader.pipeline.order.remainder`, `order.py` in `loader/pipeline/`),
`shardgen.process:sliding_windows`, `Arena.keep_whole`, `ShardIter(m, batch_size=8, seed=0, prefetch_buffer=1)`.
`shardgen build -c shardgen.toml --force`, `--stop-after N --checkpoint DIR`, `unshare --pid`, `loader.ShardIter`.
`tests/test_cli.py::test_exit_codes_follow_the_table`, `::test_build_status_verify`; `pip install 'shardgen[s3]'`.

```sh
.venv/bin/python -m loader.tools.launch -n 2 --straggler-s 9 -- .venv/bin/python -m loader.tools.train --kvstore x
shardgen status -c shardgen.toml | head --lines=1   # shardgen casts nothing here
```
"""


def test_the_checker_names_each_made_up_name_with_its_line():
    assert problems_in(MADE_UP) == [
        (3, "no file loader/pipeline/seeding.py"),
        (3, "loader.pipeline.order has no 'seed_of'"),
        (4, "shardgen.process has no 'no_such_processor'"),
        (4, "PlanFiles (loader.source.files) has no 'park'"),
        (5, "ShardIter has no parameter 'readers'"),
        (5, "no command 'shardgen frobnicate'"),
        (5, "shardgen build has no flag --no-such-flag"),
        (6, "tests/test_cli.py has no test test_no_such_test"),
        (8, "no nocache.py in loader/source/"),
        (12, "ShardIter has no parameter 'no_such_argument'"),
        (13, "ShardIter has no parameter 'native_batch'"),
        (16, "train has no flag --no-such-train-flag"),
    ]


def test_the_checker_passes_names_that_exist():
    assert problems_in(TRUE) == []
