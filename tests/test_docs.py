"""The documents name only things that exist: README.md, docs/*.md and benchmarks/README.md.

- Every command in a fenced shell block that is this project's (`kvledger SUB`, `./scripts/up`,
  `python benchmarks/X.py`, `.venv/bin/python -m kvledger.cli SUB`, ...) answers `--help` with a
  usage and exit 0, and every `--flag` the documents give it appears in that help. The `--help`
  calls run in parallel, one per distinct command.
- Scripts that cannot answer `--help` without doing their work are only checked to exist
  (`NO_HELP` says which and why), and so are the test paths given to pytest or `./scripts/test`
  and the files given to `docker compose -f`.
- Every relative markdown link leads to an existing file, and its `#anchor` to a heading there.
- Every backticked repository path in the prose (`services/routing/replicas.py`, `tests/faults/`)
  exists, except in the sections `SKIPPED_SECTIONS` names.
- The request-field list in docs/api.md is `gateway.support.markdown_field_list()`.

So a document that names a command, flag, benchmark, file or section that no longer exists fails.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}  # fenced blocks read as commands
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
HELP_TIMEOUT_S = 120

# Scripts the documents run that have no `--help`: running one would do its work. Checked to
# exist only.
NO_HELP = {
    "scripts/test": "sets up a venv and redis-server, lints and runs every test",
    "scripts/vllm-oracle-venv.sh": "builds vLLM 0.33's venv (minutes, needs a package index)",
    "benchmarks/run_on_device.sh": "installs wheels, builds the kernels and runs the GPU tests",
}
# `./scripts/up ARGS` is `kvledger up ARGS` after set-up (scripts/up), so it is checked as that.
SCRIPT_ALIASES = {"scripts/up": ("kvledger", "up")}

# Sections whose backticked paths are not meant to exist: (document, heading) -> why.
SKIPPED_SECTIONS = {
    ("docs/layout.md", "Where things moved (issue 21)"): "lists the old paths on purpose",
}
# The first path segments that make a backticked word a repository path.
TOP_LEVEL = {
    "engine", "ledger", "services", "observability", "gateway", "gpu_worker", "indexer",
    "kernels", "kvledger", "tests", "benchmarks", "scripts", "docs", "docker", ".ci",
}  # fmt: skip


@dataclass
class Command:
    """One distinct command the documents run, and where and with which flags."""

    kind: str  # "kvledger" or "benchmark"
    name: str  # the subcommand, or the benchmark's path
    flags: set[str] = field(default_factory=set)
    where: set[str] = field(default_factory=set)

    @property
    def argv(self) -> list[str]:
        if self.kind == "kvledger":
            return [sys.executable, "-m", "kvledger.cli", self.name, "--help"]
        return [sys.executable, self.name, "--help"]

    @property
    def id(self) -> str:
        return f"kvledger {self.name}" if self.kind == "kvledger" else self.name


@dataclass
class Document:
    path: Path
    prose: list[tuple[int, str]]  # (line number, text) outside fenced blocks
    shell: list[tuple[int, str]]  # (line number, logical line) inside shell blocks

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def read_document(path: Path) -> Document:
    prose: list[tuple[int, str]] = []
    shell: list[tuple[int, str]] = []
    fence: str | None = None
    info = ""
    pending = ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if stripped.startswith(("```", "~~~")):
                fence, info = stripped[:3], stripped[3:].strip().lower()
            else:
                prose.append((number, line))
            continue
        if stripped.startswith(fence):
            fence = None
            continue
        if info in SHELL_BLOCKS:
            pending += line
            if pending.endswith("\\"):  # a continued line
                pending = pending[:-1] + " "
                continue
            shell.append((number, pending))
            pending = ""
    return Document(path, prose, shell)


@functools.cache
def documents() -> list[Document]:
    return [read_document(path) for path in DOCUMENTS if path.exists()]


def split_commands(line: str) -> Iterator[list[str]]:
    """The simple commands of one shell line, comments dropped."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # not shell after all (an unbalanced quote): words as they stand
        words = line.split("#", 1)[0].split()
    command: list[str] = []
    for word in words:
        if word in {";", "&&", "||", "|"}:
            yield command
            command = []
        elif word.endswith(";"):
            command.append(word.rstrip(";"))
            yield command
            command = []
        else:
            command.append(word)
    yield command


def flags_of(words: list[str]) -> set[str]:
    flags = set()
    for word in words:
        word = word.strip("[]")
        if word.startswith("--") and len(word) > 2:
            flags.add(word.split("=", 1)[0].rstrip("]"))
    return flags


@dataclass
class Found:
    commands: dict[tuple[str, str], Command] = field(default_factory=dict)
    files: dict[str, set[str]] = field(default_factory=dict)  # path -> where
    scripts: dict[str, set[str]] = field(default_factory=dict)  # run without --help -> where

    def command(self, kind: str, name: str, args: list[str], where: str) -> None:
        entry = self.commands.setdefault((kind, name), Command(kind, name))
        entry.flags |= flags_of(args)
        entry.where.add(where)

    def file(self, path: str, where: str) -> None:
        self.files.setdefault(path.removeprefix("./"), set()).add(where)

    def script(self, path: str, where: str) -> None:
        self.file(path, where)
        self.scripts.setdefault(path.removeprefix("./"), set()).add(where)


def classify(words: list[str], where: str, found: Found) -> None:
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]  # VAR=value before the command
    if not words:
        return
    program, args = words[0], words[1:]
    script = program.removeprefix("./")
    if program == "kvledger":
        if args and not args[0].startswith("-"):
            found.command("kvledger", args[0], args[1:], where)
    elif script in SCRIPT_ALIASES:
        found.file(script, where)
        found.command(*SCRIPT_ALIASES[script], args, where)
    elif script.startswith("scripts/"):
        found.script(script, where)
        if script == "scripts/test":
            add_test_paths(args, where, found)
    elif program in PYTHONS and args:
        if args[:2] == ["-m", "pytest"]:
            add_test_paths(args[2:], where, found)
        elif args[:2] in (["-m", "kvledger.cli"], ["-m", "kvledger"]) and len(args) > 2:
            found.command("kvledger", args[2], args[3:], where)
        elif args[0].endswith(".py"):
            found.command("benchmark", args[0].removeprefix("./"), args[1:], where)
    elif program in {"bash", "sh"} and args:
        found.script(args[0], where)
    elif program == "pytest":
        add_test_paths(args, where, found)
    elif program == "docker":
        for flag, value in itertools.pairwise(args):
            if flag == "-f":
                found.file(value, where)


def add_test_paths(args: list[str], where: str, found: Found) -> None:
    for arg in args:
        if arg == "tests" or arg.startswith("tests/"):
            found.file(arg.split("::", 1)[0], where)


@functools.cache
def found_in_documents() -> Found:
    found = Found()
    for document in documents():
        for number, line in document.shell:
            for words in split_commands(line):
                classify(words, f"{document.name}:{number}", found)
    return found


@functools.cache
def help_texts() -> dict[tuple[str, str], subprocess.CompletedProcess[str]]:
    """Every command's `--help`, run in parallel, from the repository root."""
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    commands = list(found_in_documents().commands.items())

    def run(command: Command) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                command.argv, cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=HELP_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(command.argv, -1, "", f"timed out: {exc}")

    with ThreadPoolExecutor(max_workers=min(8, len(commands) or 1)) as pool:
        results = list(pool.map(run, [command for _, command in commands]))
    return {key: result for (key, _), result in zip(commands, results, strict=True)}


def _commands() -> list[Command]:
    return sorted(found_in_documents().commands.values(), key=lambda c: (c.kind, c.name))


def _files() -> list[tuple[str, str]]:
    files = found_in_documents().files
    return sorted((path, ", ".join(sorted(where))) for path, where in files.items())


def test_the_documents_are_there():
    assert [d.name for d in documents()] == [p.relative_to(ROOT).as_posix() for p in DOCUMENTS]
    kinds = {c.kind for c in _commands()}
    assert kinds == {"kvledger", "benchmark"}, "no command found: is the parser broken?"


@pytest.mark.parametrize("command", _commands(), ids=lambda c: c.id)
def test_each_documented_command_answers_help(command: Command):
    result = help_texts()[(command.kind, command.name)]
    where = ", ".join(sorted(command.where))
    assert result.returncode == 0, (
        f"`{' '.join(command.argv[1:])}` exited {result.returncode} (named in {where}):\n"
        f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
    )
    assert "usage:" in result.stdout, (
        f"`{' '.join(command.argv[1:])}` exits 0 but prints no usage: it does not answer --help "
        f"(named in {where})"
    )
    unknown = sorted(
        flag for flag in command.flags
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout)
    )  # fmt: skip
    assert not unknown, f"{command.id}: flags its --help does not list: {unknown} (in {where})"


def test_each_script_without_help_is_listed_with_its_reason():
    unlisted = {
        path: sorted(where)
        for path, where in found_in_documents().scripts.items()
        if path not in NO_HELP
    }
    assert not unlisted, (
        f"scripts the documents run that are only checked to exist: {unlisted}; "
        "check their --help here, or list them in NO_HELP with the reason"
    )


@pytest.mark.parametrize(("path", "where"), _files(), ids=[p for p, _ in _files()])
def test_each_documented_script_and_test_path_exists(path: str, where: str):
    assert (ROOT / path).exists(), f"{path} (named in {where}) does not exist"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(document: Document) -> list[tuple[int, int, str]]:
    """(line number, level, text) of each heading outside fenced blocks."""
    found = []
    for number, line in document.prose:
        match = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            found.append((number, len(match.group(1)), match.group(2)))
    return found


def anchors(document: Document) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, _, text in headings(document):
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def prose_lines(document: Document) -> Iterator[tuple[int, str]]:
    """The prose outside the sections SKIPPED_SECTIONS names, inline code kept."""
    skipping_level = 0
    for number, line in document.prose:
        match = re.match(r"(#{1,6})\s+(.*?)\s*$", line)
        if match:
            level = len(match.group(1))
            if skipping_level and level <= skipping_level:
                skipping_level = 0
            if (document.name, match.group(2)) in SKIPPED_SECTIONS:
                skipping_level = level
        if not skipping_level:
            yield number, line


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links() -> list[tuple[str, str, str]]:
    links = []
    for document in documents():
        numbers = [number for number, _ in document.prose]
        text = "\n".join(line for _, line in document.prose)
        text = re.sub(r"`[^`\n]*`", lambda m: "`" * len(m.group()), text)  # code is not a link
        for match in LINK.finditer(text):  # link text may run over a line break
            target = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            number = numbers[text.count("\n", 0, match.start(1))]
            links.append((document.name, f"{document.name}:{number}", target))
    return links


@pytest.mark.parametrize(
    ("source", "where", "target"), _links(), ids=[f"{w} {t}" for _, w, t in _links()]
)
def test_each_relative_link_leads_somewhere(source: str, where: str, target: str):
    path_part, _, anchor = target.partition("#")
    path = (ROOT / source).parent / path_part if path_part else ROOT / source
    assert path.exists(), f"{where}: link to {target}: {path_part} does not exist"
    if anchor and path.suffix == ".md":
        names = anchors(read_document(path))
        assert anchor in names, f"{where}: link to {target}: no heading #{anchor} in {path.name}"


def repository_paths(text: str) -> Iterator[tuple[int, str]]:
    """(offset, path) of each backticked word that names a file or folder of this repository.
    Words with a placeholder or a pattern (`<name>`, `*`, `{a,b}`, `...`) and words whose first
    segment is no top-level folder (`csrc/host_emulation.cuh`, `../shared/seeds/`) are not
    checked."""
    for match in re.finditer(r"`([^`]+)`", text):  # a code span may run over a line break
        word = match.group(1).strip()
        if re.search(r"\s", word) or "/" not in word or re.search(r"[*<>{}\[\]|]|\.\.\.", word):
            continue
        word = re.sub(r"(\.\w+):\w+$", r"\1", word)  # services/environment.py:ENV_VARS
        if word.split("/", 1)[0] in TOP_LEVEL:
            yield match.start(1), word


def _repository_paths() -> list[tuple[str, str]]:
    found: dict[str, set[str]] = {}
    for document in documents():
        lines = list(prose_lines(document))
        text = "\n".join(line for _, line in lines)
        for offset, path in repository_paths(text):
            number = lines[text.count("\n", 0, offset)][0]
            found.setdefault(path, set()).add(f"{document.name}:{number}")
    return sorted((path, ", ".join(sorted(where))) for path, where in found.items())


@pytest.mark.parametrize(
    ("path", "where"), _repository_paths(), ids=[p for p, _ in _repository_paths()]
)
def test_each_backticked_repository_path_exists(path: str, where: str):
    assert (ROOT / path).exists(), f"{path} (named in {where}) does not exist"


def test_the_api_documents_every_request_field():
    from gateway.support import markdown_field_list

    api = (ROOT / "docs" / "api.md").read_text()
    assert markdown_field_list() in api, (
        "docs/api.md's field list is not gateway/support.py's: regenerate it from "
        "gateway.support.markdown_field_list()"
    )
