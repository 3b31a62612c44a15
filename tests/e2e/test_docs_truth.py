"""Sentences of the README and docs about paths, defaults and exit codes, checked against the code.

Each test reads what a user reads (README, ``--help``) and compares it with what the code
does, so a change to one without the other fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "engine.cli.main"]


def _flat(text: str) -> str:
    """Markdown text with line breaks and runs of spaces folded to one space."""
    return re.sub(r"\s+", " ", text)


def test_run_dir_base_order_is_what_the_readme_says(monkeypatch, tmp_path):
    from engine.utils.run_dir import run_dir_base

    readme = _flat((ROOT / "README.md").read_text())
    assert (
        "under `$GLASSBOX_RUN_DIR_BASE`, else `$XDG_RUNTIME_DIR`, else `/dev/shm`, else the temp dir"
        in readme
    )
    explicit, xdg = tmp_path / "explicit", Path("/tmp/gb-xdg")  # a short XDG_RUNTIME_DIR
    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(explicit))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert run_dir_base() == explicit
    monkeypatch.delenv("GLASSBOX_RUN_DIR_BASE")
    assert run_dir_base() == xdg
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/" + "x" * 60)  # too long for the sockets: skipped
    assert run_dir_base() != Path("/run/user/" + "x" * 60)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    shm = Path("/dev/shm")
    shm_usable = shm.is_dir() and os.access(shm, os.W_OK)
    assert run_dir_base() == (shm if shm_usable else Path(tempfile.gettempdir()))
    monkeypatch.setattr("os.path.isdir", lambda p: False if p == "/dev/shm" else Path(p).is_dir())
    assert run_dir_base() == Path(tempfile.gettempdir())


def test_run_dir_env_var_reference_names_the_same_order():
    from engine import envs

    doc = envs.ENV_VARS["GLASSBOX_RUN_DIR_BASE"].doc
    assert "$XDG_RUNTIME_DIR, else /dev/shm, else the temp dir" in doc


def test_serve_help_lists_the_exit_codes_the_server_returns():
    from engine.entrypoints.openai import api_server

    out = subprocess.run([sys.executable, "-m", "engine.cli.main", "serve", "--help"],
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    listed = dict(re.findall(r"^\s+(\d+)\s+(\S.*)$", out.split("exit status:")[1], flags=re.M))
    assert set(listed) == {"0", "1", "2", "130"}
    assert str(api_server.EXIT_OK) in listed and "SIGTERM" in listed[str(api_server.EXIT_OK)]
    assert "engine died" in listed[str(api_server.EXIT_ENGINE_DEAD)]
    assert "Ctrl-C during start-up" in listed[str(api_server.EXIT_INTERRUPTED)]
    assert "flag" in listed["2"]


@pytest.mark.parametrize("argv", [["serve", "--port", "99999"], ["generate", "--max-model-len", "0", "x"]])
def test_bad_flag_exits_2_as_help_says(argv):
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", *argv],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "error:" in proc.stderr


def test_readme_address_and_model_name_are_the_serve_defaults():
    from engine.cli.main import _make_parser
    from engine.config import DEFAULT_SERVED_NAME

    serve = _make_parser()._subparsers._group_actions[0].choices["serve"]
    defaults = {a.dest: a.default for a in serve._actions}
    readme = (ROOT / "README.md").read_text()
    assert f"serves the bundled model on http://{defaults['host']}:{defaults['port']}" in _flat(readme)
    assert f'"model": "{DEFAULT_SERVED_NAME}"' in readme


def test_generate_help_lists_its_exit_codes_and_a_bad_setting_found_by_the_worker_exits_2():
    out = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "--help"],
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    listed = dict(re.findall(r"^\s+(\d+)\s+(\S.*)$", out.split("exit status:")[1], flags=re.M))
    assert set(listed) == {"0", "1", "2", "130", "143"}
    if __import__("torch").cuda.is_available():
        return
    proc = subprocess.run(
        [*CLI, "generate", "hi", "--device", "cuda"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("glassbox generate: error: --device:")
    assert "Traceback" not in proc.stderr and "root cause" not in proc.stderr


_FAKE_PYTHON = """#!/bin/sh
# Stands in for python, glassbox and ruff: records each call; `-m venv DIR` makes DIR/bin of copies.
echo "$(basename "$0") $*" >> "$GLASSBOX_MAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"; for b in python glassbox ruff; do cp "$0" "$3/bin/$b"; done
fi
"""


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_run_installs_glassbox_alone_and_make_test_adds_the_test_extras_once(tmp_path):
    """README: `make run` installs what serving needs; `make test` the test extras too. Run with
    an interpreter that records its calls instead of installing (the real install is GBs)."""
    fake, log = tmp_path / "python3", tmp_path / "calls.log"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)

    def make(target: str, venv: Path) -> tuple[list[str], list[str]]:
        log.write_text("")
        proc = subprocess.run(["make", "-s", target, f"PYTHON={fake}", f"VENV={venv}"], cwd=ROOT, text=True,
                              capture_output=True, timeout=60, env={**os.environ, "GLASSBOX_MAKE_LOG": str(log)})  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        pips = [
            c.split(" -e ", 1)[1] for c in log.read_text().splitlines() if " pip install --quiet -e " in c
        ]
        return pips, [ln for ln in proc.stdout.splitlines() if ln.startswith("glassbox: ")]

    venv = tmp_path / "run-first"
    pips, steps = make("run", venv)
    assert pips == ["."]
    assert steps[2] == 'glassbox: [3/3] installing glassbox and its dependencies (pip install -e ".")'
    assert make("test", venv) == (
        [".[test]"],
        ['glassbox: installing the test extras (pip install -e ".[test]")'],
    )
    assert make("test", venv) == ([], [])
    assert make("run", venv) == ([], [])

    venv = tmp_path / "test-first"
    pips, steps = make("test", venv)
    assert pips == [".[test]"]
    assert [s.split("]")[0] for s in steps[:3]] == ["glassbox: [1/3", "glassbox: [2/3", "glassbox: [3/3"]
    assert steps[2].endswith('(pip install -e ".[test]")') and len(steps) == 4, steps
    assert make("run", venv) == ([], [])  # the extras include everything serving needs


def test_the_ray_install_hint_is_one_that_works_from_the_checkout():
    """Glassbox is not on PyPI, so ``pip install glassbox-engine[...]`` finds nothing: the error
    and docs/multi-node.md give the checkout's ``pip install -e ".[ray]"``, the same words."""
    from engine.config import RAY_INSTALL_HINT, ConfigError, ParallelConfig

    assert RAY_INSTALL_HINT.startswith('pip install -e ".[ray]"')
    multi_node = (ROOT / "docs" / "multi-node.md").read_text()
    assert 'pip install -e ".[ray]"\n' in multi_node
    assert f"Ray is not installed: {RAY_INSTALL_HINT})" in multi_node
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=re.escape(RAY_INSTALL_HINT)):
            ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "engine").rglob("*.py")]
    assert not [p for p in texts if "pip install glassbox-engine" in p.read_text()]


# A reference to one of this project's own issues ("issue 13", "the speed issue (13)", "issue
# #13", "issues 8 and 10", "the issue's first option", "this issue") means nothing to a reader
# of the checkout. A vLLM issue ("vLLM issue reports", a github.com/vllm-project link) is fine.
_ISSUE_REFERENCE = re.compile(r"\bissues? \(?#?\d+|\b(?:the|this) issue's\b|\bthis issue\b", re.IGNORECASE)
_VLLM_ISSUE = re.compile(r"vLLM issue|github\.com/vllm-project/", re.IGNORECASE)


def _project_issue_references(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        if _VLLM_ISSUE.search(line):
            continue
        found += [m.group(0) for m in _ISSUE_REFERENCE.finditer(line)]
    return found


def test_the_issue_reference_check_finds_what_it_is_for():
    for text in (
        "left to the speed issue (13).",
        "see issue 13",
        "issue #13",
        "Issues 8 and 10",
        "the issue's first option",
        "as this issue measured",
    ):
        assert _project_issue_references(text), text
    for text in (
        "vLLM issue reports of orphans",
        "https://github.com/vllm-project/vllm/issues/123",
        "strike the N-th time (#N, default #1)",
        "last step: #412",
        "the issue is the batch",
    ):
        assert not _project_issue_references(text), text


def test_no_readme_doc_or_tutorial_names_one_of_this_projects_issues():
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "tutorials").rglob("*.md")]
    found = {
        str(p.relative_to(ROOT)): refs for p in texts if (refs := _project_issue_references(p.read_text()))
    }
    assert not found, found
