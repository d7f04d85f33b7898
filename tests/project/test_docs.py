"""The code in README.md and docs/**/*.md runs, or the markdown says why it cannot.

Users copy the docs' code blocks; a block that no longer works is a bug this test finds. Every
fenced block (```python, ```bash / ```sh, unlabeled, any other) is one test:

- a ```python block is executed, as a script: in an empty temporary directory, fresh namespace;
- a ```bash / ```sh block whose every command is ``asyncckpt ...`` (the CLI) runs in an empty
  temporary directory, after its setup (which makes the checkpoint it looks at); each command must
  exit 0;
- any other block (installs, the test suite, benchmarks, diagrams, file listings, formats) must be
  marked as not runnable, with the reason; a block neither runnable nor marked fails.

What a block needs is declared in the markdown, in HTML comments right before its fence (blank
lines between are allowed), which readers of the rendered page never see:

    <!-- doc-test: skip (needs 2 GPUs) -->

    <!-- doc-test: setup
    import torch
    model = torch.nn.Linear(4, 2)
    -->

``setup`` is Python run first, in the block's directory and, for a Python block, in its namespace:
the names a fragment takes from the surrounding program, the checkpoint a CLI example looks at.
A ``doc-test`` comment that is malformed or not followed by a block fails ``test_markers``.

All runnable blocks run in one subprocess (``doc_runner.py``), one after the other, so the
frameworks are imported once; a traceback points at the block's lines in its markdown file.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNER = Path(__file__).resolve().parents[1] / "helpers" / "doc_runner.py"

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<ticks>`{3,})\s*(?P<language>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<body>.*?)\s*(?P<end>-->)?\s*$")
SKIP = re.compile(r"^skip \((?P<reason>[^)].*)\)$")
SHELLS = {"bash", "sh", "shell"}


@dataclass
class Block:
    where: str          # "docs/FORMAT.md:294", the line of the opening fence
    language: str       # the fence's info string ("" when unlabeled)
    code: str
    code_line: int      # the first line of ``code`` in its file
    setup: str = ""
    setup_line: int = 0
    skip: str = ""      # why it cannot run here

    @property
    def runs(self) -> bool:
        """Whether the test runs it: Python, or a shell block of asyncckpt commands only."""
        if self.language == "python":
            return True
        commands = [line for line in self.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        return self.language in SHELLS and bool(commands) and all(line.startswith("asyncckpt ") for line in commands)


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """Every fenced block of one markdown file with the markers before it, and what is wrong with the markers."""
    name = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks, problems = [], []
    pending: dict = {}  # the markers read since the last block: {"skip": ..., "setup": ..., "line": ...}
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        marker, fence = MARKER.match(line), FENCE.match(line)
        if marker:
            body, i = [marker["body"]], i + 1
            while not marker["end"] and i < len(lines) and "-->" not in lines[i]:
                body.append(lines[i])
                i += 1
            if not marker["end"]:
                if i == len(lines):
                    problems.append(f"{name}:{number}: doc-test comment never closed (-->)")
                    break
                body.append(lines[i].split("-->")[0])
                i += 1
            head, rest = body[0], "\n".join(body[1:])
            if head == "setup":
                pending.update(setup=rest + "\n", setup_line=number + 1, line=number)
            elif SKIP.match(head) and not rest.strip():
                pending.update(skip=SKIP.match(head)["reason"], line=number)
            else:
                problems.append(f"{name}:{number}: not a doc-test marker: expected 'skip (reason)' or "
                                f"'setup' followed by lines of Python, got {head!r}")
            continue
        if fence:
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip() == fence["ticks"] and lines[j].startswith(fence["indent"])), None)
            if end is None:
                problems.append(f"{name}:{number}: code block never closed")
                break
            indent = len(fence["indent"])
            code = "\n".join(text[indent:] for text in lines[i + 1:end]) + "\n"
            blocks.append(Block(f"{name}:{number}", fence["language"].lower(), code, number + 1,
                                setup=pending.get("setup", ""), setup_line=pending.get("setup_line", 0),
                                skip=pending.get("skip", "")))
            pending, i = {}, end + 1
            continue
        if line.strip() and pending:
            problems.append(f"{name}:{pending['line']}: doc-test marker not followed by a code block")
            pending = {}
        i += 1
    if pending:
        problems.append(f"{name}:{pending['line']}: doc-test marker not followed by a code block")
    return blocks, problems


PARSED = [parse(path) for path in DOCS]
BLOCKS = [block for blocks, _ in PARSED for block in blocks]


def test_markers():
    """Every doc-test comment is one the test understands and belongs to a block."""
    problems = [problem for _, found in PARSED for problem in found]
    problems += [f"{block.where}: marked skip, but has a setup (which would never run)"
                 for block in BLOCKS if block.skip and block.setup]
    assert not problems, "\n".join(problems)


def test_design_names_every_core_module():
    """DESIGN.md's picture of the packages names every package of core/ and every module in it, and
    its module table names each module as ``package/module.py`` (and no other): a module added,
    renamed or removed shows up here, not as a stale picture."""
    core = ROOT / "core"
    modules = {path.relative_to(core).with_suffix("").as_posix() for path in core.rglob("*.py")
               if path.stem not in ("__init__", "__main__") and "__pycache__" not in path.parts}
    design = ROOT / "docs" / "DESIGN.md"
    picture = parse(design)[0][0].code
    for package in {module.split("/")[0] for module in modules if "/" in module}:
        line = next((line for line in picture.splitlines() if f" {package}/ " in line), None)
        assert line is not None, f"package {package}/ missing from DESIGN.md's picture"
        block = picture[picture.index(line):].split("\n  │ ", 1)[0] if False else picture[picture.index(line):]
        names_after = set(re.findall(r"\w+", block.split("/ ", 1)[1]))
        missing = {m.split("/")[1] for m in modules if m.startswith(package + "/")} - names_after
        assert not missing, f"modules of {package}/ missing from DESIGN.md's picture: {missing}"
    rows = [line for line in design.read_text().splitlines() if line.startswith("| `")]
    table = set(re.findall(r"`([\w/]+)\.py`", "\n".join(rows)))
    assert table == modules, f"DESIGN.md's module table: missing {modules - table}, not in core/ {table - modules}"



def test_options_page_explains_every_field():
    """docs/options.md is the one place that explains each option: a row for every field of the option types."""
    import dataclasses

    from asyncckpt.core import CheckpointOptions, ExportOptions, MemoryTier, ObjectStoreOptions

    rows = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "options.md").read_text(), re.M))
    missing = {f"{kind.__name__}.{field.name}" for kind in (CheckpointOptions, MemoryTier, ExportOptions, ObjectStoreOptions)
               for field in dataclasses.fields(kind) if field.name not in rows}
    assert not missing, f"docs/options.md has no row for {sorted(missing)}"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Every runnable block run once, in one subprocess: {where: None or its error}."""
    directory = tmp_path_factory.mktemp("docs")
    blocks, results = directory / "blocks.json", directory / "results.json"
    blocks.write_text(json.dumps([asdict(block) for block in BLOCKS if block.runs and not block.skip]))
    done = subprocess.run([sys.executable, str(RUNNER), str(blocks), str(results)], cwd=directory,
                          capture_output=True, text=True, timeout=480)
    assert done.returncode == 0 and results.exists(), f"the block runner failed:\n{done.stdout}{done.stderr}"
    return json.loads(results.read_text())


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_block(block: Block, request):
    if block.skip:
        pytest.skip(f"{block.where} not runnable: {block.skip}")
    if not block.runs:
        pytest.fail(f"{block.where}: a ```{block.language} block runs only if it is Python or asyncckpt commands; "
                    "mark it <!-- doc-test: skip (why) --> if it cannot run here", pytrace=False)
    error = request.getfixturevalue("outcomes")[block.where]
    if error is not None:
        pytest.fail(f"{block.where} failed:\n{error}", pytrace=False)


LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)#\s]+)(?:#[^)]*)?\)")


def test_links():
    """Every relative link of the docs leads to a file of the repository (pages move: docs/benchmarks/)."""
    broken = [f"{path.relative_to(ROOT)}: {target}" for path in DOCS for target in LINK.findall(path.read_text())
              if not (path.parent / target).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


# ---------------------------------------------------------------------- docs/troubleshooting.md
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
ENTRY = re.compile(r"^### `(?P<message>[^`]+)`\s*$", re.M)
PRINTF = re.compile(r"%[-#0-9.]*[sdrfig]")
LOGGERS = {"warning", "error"}  # logger.warning / logger.error, any logger: what a user sees without configuring logging


def _rendered(node) -> str | None:
    """A string of the code as a user reads it, its variable parts as ``…``: a literal, an f-string, a %-format."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return PRINTF.sub("…", node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(PRINTF.sub("…", part.value) if isinstance(part, ast.Constant) else "…" for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _rendered(node.left), _rendered(node.right)
        return None if left is None or right is None else left + right
    return None


def _code_strings() -> tuple[list[str], list[tuple[str, str]]]:
    """Every string of the library's code (core/, adapters/; .ci/'s scripts as text), and each warning it emits to the
    user (``warnings.warn``, ``logger.warning``, ``logger.error``) with where: ``(message, "file:line")``."""
    import ast

    strings, warned = [], []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            text = _rendered(node)
            if text is not None:
                strings.append(text)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                    node.func.attr in LOGGERS and "log" in ast.unparse(node.func.value)
                    or node.func.attr == "warn" and ast.unparse(node.func.value) == "warnings"):
                message = _rendered(node.args[0])
                if message is not None and message.strip("… "):  # not a relay of another message ("%s")
                    warned.append((message, f"{path.relative_to(ROOT)}:{node.lineno}"))
    strings += [path.read_text() for path in (ROOT / ".ci").iterdir() if path.is_file()]
    return strings, warned


def _pattern(message: str) -> re.Pattern:
    return re.compile(".*?".join(re.escape(part) for part in message.split("…")), re.S)


def test_troubleshooting_lists_every_warning_and_only_messages_the_code_still_has():
    """docs/troubleshooting.md is keyed by the messages a user sees (``### `message` ``, its variable parts as ``…``):
    each of them is still in the code, and every warning the library emits has its entry."""
    entries = [_pattern(m) for m in ENTRY.findall(TROUBLESHOOTING.read_text())]
    strings, warned = _code_strings()
    assert entries and warned
    gone = [p.pattern for p in entries if not any(p.search(text) for text in strings)]
    assert not gone, "troubleshooting.md lists messages the code no longer has:\n" + "\n".join(gone)
    missing = [f"{where}: {message}" for message, where in warned if not any(p.search(message) for p in entries)]
    assert not missing, "warnings without an entry in docs/troubleshooting.md:\n" + "\n".join(missing)
