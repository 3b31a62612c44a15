"""Every lesson of the course (``tutorials/*.md``) runs as written, against its own server.

A lesson is read with Sybil (its Markdown lexers, its ``skip`` directive and its document
namespace), and its blocks are evaluated in the order a student meets them. Each lesson
file gets ONE ``glassbox serve`` on the shipped defaults (the compiled step; port 0, its
own run-directory base), standing for the ``make run`` the student has in the first
terminal. What the runner does with each kind of block:

- ```` ```bash ````: run by ``bash -e -o pipefail``; it must exit 0. Its output is not compared.
- ```` ```console ````: ``$ command`` lines, each followed by the output it prints. Each
  command runs and its output (stdout and stderr, as a terminal shows them) must match
  the text after masking (below).
- ```` ```python ````: run as a script by the course's Python; it must exit 0. An
  ```` ```output ```` block right after it is what it prints, compared like a console block.
- ``<!-- check: what it checks`` … ``-->``: hidden from the reader (an HTML comment), Python
  run in the lesson's namespace to assert the facts the text claims, through the JSON
  modes. It has ``sh(cmd)`` (runs a shell command like a block, asserts exit 0, returns its
  output), ``sh_json(cmd)`` (the same, parsed as JSON), ``server_log()`` (the lesson
  server's log: the first terminal's output) and ``last_output`` (the output of the last
  command a block ran).
- ``<!-- skip: next "why" -->``: Sybil's skip directive: the next block is not run. The
  reason is required (a test below checks it) and says why, e.g. ``make run``, which this
  runner replaces by its own server.
- Any other block (```` ```text ````, ```` ```json ````, …) is prose: not run.

The lesson's server is ``make run`` (``glassbox serve`` on the shipped defaults) unless the
lesson says otherwise in one comment, ``<!-- lesson-server: glassbox serve FLAGS -->``
(``VAR=value`` words may come first), whose command must also appear in the lesson's text
for the student to type; or ``<!-- lesson-server: none "why" -->`` for a lesson whose
blocks start what they need themselves. The runner waits until the server answers /health
with 200, unless the comment starts with ``ready=run-dir`` (``<!-- lesson-server:
ready=run-dir glassbox serve --inject-fault ... -->``, the command after it shown in the
text as usual): then it waits only until the server's run directory and manifest exist, for
a server whose start-up hangs on purpose and never gets healthy (the lesson's own hidden
check then waits for what it needs, the fault's strike say). A ``/tmp/`` path among the
server's flags lands in the test's temporary directory, as in a block.

The lesson server's command is rewritten as the blocks are: a path under ``/tmp/`` in its
flags or ``VAR=value`` words (``--trace-file /tmp/startup.jsonl``) lands in the test's own
temporary directory, where the lesson's blocks find it.

A block runs as the student types it, with four things rewritten: ``127.0.0.1:8000`` becomes
the lesson server's address; ``glassbox``, ``engine-top`` and ``python`` are this
interpreter's (shims first on ``PATH``); ``GLASSBOX_RUN_DIR_BASE`` is the lesson server's
run-directory base, so ``glassbox ps``, ``engine-top`` and ``glassbox doctor`` find that
server and no other; and a path under ``/tmp/`` lands in the test's own temporary
directory (the lesson server's own command too: its ``--trace-file /tmp/…`` is the file the
blocks read), and is ``/tmp/`` again in what a command prints. Blocks run from the
repository root, as a student's second terminal does.

Masking, applied to the text and to the real output alike, then compared with doctest's
``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` (so ``...`` in the text stands for anything, and
column alignment does not matter): run-directory paths, ports, request ids, Unix
timestamps, log-line dates and source line numbers, durations (``24.4s``, ``1m11s``),
``pid=N`` / ``pid N``, and in a ``glassbox ps`` row the PID, PPID, STATE, RSS and THREADS
columns. Anything else that differs from machine to machine is ``...`` in the text.

The docs (``docs/*.md``) are held to their console blocks the same way: a block that shows
what each command prints is run (no server; these show the first process's refusals) and
compared; bare ``$ command`` lines with no output are illustrations. README's blocks are
run by ``tests/e2e/test_readme_examples.py``.

Cheap by design: one server start per lesson (about 10-20 s warm on 2 cores) and each
command a client call; every command has a timeout and runs in its own process group,
killed when it ends.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple
from unittest import SkipTest

import pytest
from server_utils import start_server
from sybil import Document, Sybil
from sybil.example import NotEvaluated
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
LESSONS = sorted(p for p in TUTORIALS.glob("*.md") if p.name != "README.md")
COMMAND_TIMEOUT_S = 120

# ------------------------------------------------------------------------ masking

_ROLE_ROW = re.compile(
    r"^(?P<role>\s*(?:APIServer|EngineCore|Worker|DPCoordinator|LLM)\w*(?: \([^)]*\))*)"
    r"\s+\d+\s+(?:\d+|-)\s+[a-z-]+\s+(?P<middle>.*?)\s+(?:\d+|-)\s+(?:\d+|-)\s*$",
    flags=re.M,
)
_MASKS = [
    (re.compile(r"\S*glassbox-\d+-[a-z0-9_]+"), "<RUN_DIR>"),
    (re.compile(r"\b(127\.0\.0\.1|localhost):\d+"), r"\1:<PORT>"),
    (re.compile(r"\b((?:chat)?cmpl|req)-[0-9a-f]{8,}\b"), r"\1-<ID>"),
    # Unix times, 2020 to 2039 (so 1073741824 bytes stays compared)
    (re.compile(r"\b(?:1[6-9]|2[0-1])\d{8}(?:\.\d+)?\b"), "<TIME>"),
    (re.compile(r"\b\d\d-\d\d \d\d:\d\d:\d\d\b"), "<TIME>"),
    (re.compile(r"(\.py):\d+\]"), r"\1:<LINE>]"),
    (re.compile(r"\b(pid[= ])\d+"), r"\1<PID>"),
    (re.compile(r"\b\d+h\d+m\b|\b\d+m\d+s\b|\b\d+(?:\.\d+)?(?:ms|s)\b"), "<T>"),
]
_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def mask(text: str) -> str:
    """``text`` with what differs from run to run replaced by placeholders (the docstring's list)."""
    text = _ROLE_ROW.sub(r"\g<role> <PID> <PID> <STATE> \g<middle> <RSS> <THREADS>", text)
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def output_matches(expected: str, actual: str) -> bool:
    return _CHECKER.check_output(mask(expected).strip() + "\n", mask(actual).strip() + "\n", _FLAGS)


def console_commands(source: str) -> list[tuple[str, str]]:
    """A console block's ``(command, expected output)`` pairs; a ``\\`` line continues the command."""
    pairs: list[tuple[str, list[str]]] = []
    continuing = False
    for line in source.splitlines():
        if continuing:
            pairs[-1] = (pairs[-1][0] + "\n" + line, pairs[-1][1])
        elif line.startswith("$ "):
            pairs.append((line[2:], []))
        elif pairs:
            pairs[-1][1].append(line)
        else:
            raise ValueError(f"console block output before any '$ ' command: {line!r}")
        continuing = (continuing or line.startswith("$ ")) and line.endswith("\\")
    return [(cmd, "\n".join(out)) for cmd, out in pairs]


# ------------------------------------------------------------------------ a lesson's world

_LESSON_SERVER = re.compile(r"<!--\s*lesson-server:\s*(?P<command>.*?)\s*-->", re.S)


class LessonServer(NamedTuple):
    """What a lesson's ``lesson-server`` comment asks for."""

    env: dict[str, str]
    flags: list[str]  # after ``glassbox serve``
    ready: str = "health"  # or "run-dir": wait only for the run directory (start_server's ``ready``)


def lesson_server(path: Path) -> LessonServer | None:
    """The lesson's server; None for ``none "why"``.

    Raises:
        ValueError: more than one ``lesson-server`` comment, a command that is not
            ``[ready=run-dir] [VAR=value ...] glassbox serve ...``, or one the lesson's text
            never shows.
    """
    text = path.read_text()
    found = _LESSON_SERVER.findall(text)
    if not found:
        return LessonServer({}, [])
    if len(found) > 1:
        raise ValueError(f"{path.name}: more than one lesson-server comment")
    command = found[0]
    if re.fullmatch(r'none "[^"]{10,}"', command):
        return None
    ready = "health"
    if command.startswith("ready="):
        option, _, command = command.partition(" ")
        ready = option.removeprefix("ready=")
        if ready not in ("health", "run-dir"):
            raise ValueError(f"{path.name}: lesson-server ready= must be health or run-dir: {option!r}")
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:2] != ["glassbox", "serve"]:
        raise ValueError(f"{path.name}: lesson-server must be 'glassbox serve ...': {command!r}")
    shown = _LESSON_SERVER.sub("", text)
    if command not in shown:
        raise ValueError(f"{path.name}: the lesson never shows its server command {command!r}")
    return LessonServer(env, words[2:], ready)


def localize_tmp(text: str, tmp: Path) -> str:
    """``text`` with each path under ``/tmp/`` moved under ``tmp`` (the lesson's own /tmp)."""
    return re.sub(r"(?<![\w.])/tmp/", f"{tmp}/", text)


class _NoServer:
    """A lesson with ``lesson-server: none``: its blocks start what they need."""

    def __init__(self, base: Path) -> None:
        self.run_dir, self.port = base / "srv" / "none", 8000
        self.run_dir.parent.mkdir(parents=True)

    def log(self) -> str:
        raise AssertionError("this lesson has no server of its own (lesson-server: none)")

    def kill_group(self) -> None:
        pass


class Lesson:
    """Where a lesson's blocks run: its server, shims on PATH, its own /tmp."""

    def __init__(self, server, tmp: Path) -> None:
        self.server, self.tmp = server, tmp
        shims = tmp / "bin"
        shims.mkdir()
        for name, argv in {
            "glassbox": f"{sys.executable} -m engine.cli.main",
            "engine-top": f"{sys.executable} -m tui",
            "python": sys.executable,
            "python3": sys.executable,
        }.items():
            (shims / name).write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
            (shims / name).chmod(0o755)
        self.env = {
            **os.environ,
            "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "GLASSBOX_RUN_DIR_BASE": str(server.run_dir.parent),
            "COLUMNS": "200",  # Rich tables as wide as the text shows them, not cut to a pipe's 80
        }
        self.last_output = ""

    def localize(self, text: str) -> str:
        text = re.sub(r"\b(127\.0\.0\.1|localhost):8000\b", rf"\1:{self.server.port}", text)
        return localize_tmp(text, self.tmp)

    def shell(self, command: str, localize: bool = True) -> subprocess.CompletedProcess:
        """Run ``command`` as a student would (rewritten: the module docstring, unless it is
        the runner's own), in its own process group, killed when it ends or times out.
        Output: stdout and stderr together."""
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", self.localize(command) if localize else command],
            cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"timed out after {COMMAND_TIMEOUT_S}s: {command}\n{out[-3000:]}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything it left in the background
            except ProcessLookupError:
                pass
        out = out.replace(f"{self.tmp}/", "/tmp/")  # what it prints names /tmp/, as the student's does
        self.last_output = out
        return subprocess.CompletedProcess(command, proc.returncode, out)

    def sh(self, command: str) -> str:
        done = self.shell(command)
        assert done.returncode == 0, f"exit {done.returncode}: {command}\n{done.stdout[-3000:]}"
        return done.stdout

    def sh_json(self, command: str):
        return json.loads(self.sh(command))


# ------------------------------------------------------------------------ evaluators


def _lesson(example) -> Lesson:
    return example.namespace["lesson"]


def _failure(what: str, expected: str, actual: str) -> str:
    return f"{what}\n--- the text says\n{expected}\n--- it printed\n{actual}\n--- masked, it printed\n{mask(actual)}"


def evaluate_bash(example) -> str | None:
    done = _lesson(example).shell(example.parsed)
    if done.returncode != 0:
        return f"exit {done.returncode}:\n{example.parsed}\n{done.stdout[-3000:]}"
    return None


def evaluate_console(example) -> str | None:
    lesson = _lesson(example)
    for command, expected in console_commands(example.parsed):
        done = lesson.shell(command)
        if done.returncode != 0:
            return f"exit {done.returncode}: $ {command}\n{done.stdout[-3000:]}"
        if not output_matches(expected, done.stdout):
            return _failure(f"$ {command}", expected, done.stdout)
    return None


def evaluate_python(example) -> str | None:
    lesson = _lesson(example)
    script = lesson.tmp / f"block_{example.line}.py"
    script.write_text(lesson.localize(example.parsed))
    done = lesson.shell(f"python {script}", localize=False)  # the script is localized already
    example.namespace["python_output"] = done.stdout
    if done.returncode != 0:
        return f"exit {done.returncode}:\n{done.stdout[-3000:]}"
    return None


def evaluate_output(example) -> str | None:
    printed = example.namespace.pop("python_output", None)
    if printed is None:
        return "an ```output block must follow a ```python block"
    if not output_matches(example.parsed, printed):
        return _failure("the python block above", example.parsed, printed)
    return None


def evaluate_check(example) -> str | None:
    lesson = _lesson(example)
    namespace = {
        "sh": lesson.sh,
        "sh_json": lesson.sh_json,
        "server_log": lesson.server.log,
        "last_output": lesson.last_output,
    }
    source = example.parsed
    try:
        exec(compile(source, f"{example.path}:{example.line} (check)", "exec"), namespace)
    except AssertionError as err:
        return f"check failed: {example.region.lexemes['arguments']}\n{source}\n{err}"
    return None


EVALUATORS = {
    "bash": evaluate_bash,
    "console": evaluate_console,
    "python": evaluate_python,
    "output": evaluate_output,
}


def parse_blocks(document):
    for region in FencedCodeBlockLexer("|".join(EVALUATORS))(document):
        region.parsed = str(region.lexemes["source"])
        region.evaluator = EVALUATORS[region.lexemes["language"]]
        yield region


def parse_checks(document):
    for region in DirectiveInHTMLCommentLexer("check")(document):
        region.parsed = str(region.lexemes["source"])
        region.evaluator = evaluate_check
        yield region


SYBIL = Sybil(parsers=[parse_blocks, parse_checks, SkipParser()], path=str(TUTORIALS), pattern="*.md")


# ------------------------------------------------------------------------ tests


def test_the_course_has_lessons_and_the_runner_reads_them():
    assert TUTORIALS.joinpath("README.md").is_file() and LESSONS
    for path in LESSONS:
        kinds = [ex.region.evaluator for ex in SYBIL.parse(path)]
        assert evaluate_console in kinds and evaluate_check in kinds, (
            f"{path.name}: no console or check block"
        )


def test_every_skip_says_why():
    for path in [*LESSONS, TUTORIALS / "README.md"]:
        for line in re.findall(r"<!--\s*skip:.*?-->", path.read_text()):
            assert re.fullmatch(r'<!--\s*skip: (next|start) "[^"]{10,}"\s*-->', line), f"{path.name}: {line}"


def test_a_lesson_server_is_the_command_the_lesson_shows(tmp_path):
    lesson = tmp_path / "lesson.md"
    lesson.write_text("<!-- lesson-server: GLASSBOX_X=1 glassbox serve --step-delay-ms 50 -->\n"
                      "    GLASSBOX_X=1 glassbox serve --step-delay-ms 50\n")  # fmt: skip
    assert lesson_server(lesson) == ({"GLASSBOX_X": "1"}, ["--step-delay-ms", "50"], "health")
    lesson.write_text("<!-- lesson-server: ready=run-dir glassbox serve --inject-fault x:hang -->\n"
                      "    glassbox serve --inject-fault x:hang\n")  # fmt: skip
    assert lesson_server(lesson) == ({}, ["--inject-fault", "x:hang"], "run-dir")
    lesson.write_text("<!-- lesson-server: ready=soon glassbox serve -->\n    glassbox serve\n")
    with pytest.raises(ValueError, match="ready= must be"):
        lesson_server(lesson)
    lesson.write_text("<!-- lesson-server: glassbox serve --step-delay-ms 50 -->\n    glassbox serve\n")
    with pytest.raises(ValueError, match="never shows"):
        lesson_server(lesson)
    lesson.write_text('<!-- lesson-server: none "it starts its own trees" -->\n')
    assert lesson_server(lesson) is None
    for path in LESSONS:
        lesson_server(path)  # each lesson's own comment is well-formed
    assert (
        localize_tmp("--trace-file /tmp/startup.jsonl", Path("/x/gbt1"))
        == "--trace-file /x/gbt1/startup.jsonl"
    )
    assert localize_tmp("/var/tmp/a", Path("/x")) == "/var/tmp/a"


def test_masking_keeps_what_the_text_claims():
    row = "  EngineCore_DP0        5164  5139  sleeping  idle, after engine_core.init  24.4s  1m07s  39  12"
    other = "  EngineCore_DP0   77  1  running  idle, after engine_core.init  0.1s  3.0s  1453  9"
    assert output_matches(row, other)
    assert not output_matches(row, other.replace("engine_core.init", "engine_core.step"))
    assert not output_matches("processes: found 3 of expected 3", "processes: found 2 of expected 3")
    assert output_matches(
        '{"id":"cmpl-8c5fad69f80b4204","created":1796220896}',
        '{"id":"cmpl-0123456789abcdef","created":1796229999}',
    )
    assert not output_matches('"available_bytes": 1073741824', '"available_bytes": 1073741825')
    assert console_commands("$ a \\\n  b\nout\n$ c\n") == [("a \\\n  b", "out"), ("c", "")]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_runs_as_written(path):
    document = SYBIL.parse(path)
    base = Path(tempfile.mkdtemp(prefix="gbt", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    try:
        wanted = lesson_server(path)
        if wanted is None:
            server = _NoServer(base)
        else:  # its /tmp paths (flags and VAR=value words) are the lesson's, as its blocks' are
            env = {key: localize_tmp(value, base) for key, value in wanted.env.items()}
            flags = [localize_tmp(flag, base) for flag in wanted.flags]
            server = start_server(base / "srv", *flags, env=env, ready=wanted.ready)
        try:
            document.namespace["lesson"] = Lesson(server, base)
            ran = []
            for example in document.examples():
                try:
                    example.evaluate()
                except (SkipTest, NotEvaluated):
                    continue
                except Exception as err:
                    raise AssertionError(f"{path.name}, line {example.line}: {err}") from None
                ran.append(example.region.evaluator)
            assert evaluate_console in ran and evaluate_check in ran, f"{path.name}: ran only {ran}"
        finally:
            server.kill_group()
    finally:
        shutil.rmtree(base, ignore_errors=True)


DOCS_WITH_OUTPUT = sorted((ROOT / "docs").glob("*.md"))


def _docs_console_blocks() -> list[tuple[str, int, list[tuple[str, str]]]]:
    """The docs' console blocks that show what each command prints: ``(doc, line, pairs)``.
    A block of bare ``$ command`` lines (a server to start, no output shown) is an
    illustration and is not collected."""
    blocks = []
    for path in DOCS_WITH_OUTPUT:
        text = path.read_text()
        for region in FencedCodeBlockLexer("console")(Document(text, str(path))):
            pairs = console_commands(str(region.lexemes["source"]))
            if pairs and all(out.strip() for _, out in pairs):
                blocks.append((path.name, text.count("\n", 0, region.start) + 1, pairs))
    return blocks


@pytest.mark.parametrize(
    "doc, line, pairs", _docs_console_blocks(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_docs_console_block_prints_what_it_shows(tmp_path, doc, line, pairs):
    """A doc's console block that shows output prints it (masked as a lesson's). Its exit
    status is not a claim: such blocks show refusals (a bad flag, exit 2) as often as not."""
    base = Path(tempfile.mkdtemp(prefix="gbd", dir="/tmp"))
    try:
        lesson = Lesson(_NoServer(base), base)
        for command, expected in pairs:
            done = lesson.shell(command)
            assert output_matches(expected, done.stdout), _failure(
                f"{doc}:{line}: $ {command}", expected, done.stdout
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
