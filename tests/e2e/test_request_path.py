"""``scripts/request_path.py`` counts the code one streamed completion runs, HTTP in to SSE
out, in every process of a real tree (API server, engine core, worker), on the defaults.

Checked: the functions a request must cross in each process are found on the threads that
run them (so the hook reached every spawned process and the time window caught the request),
start-up code is not (it ran before the window), and the totals line docs/architecture.md
quotes is printed. The counting rule itself (body lines without docstring, comments or blank
lines) is checked on a function written here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("request_path", ROOT / "scripts" / "request_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_function_counts_its_body_without_docstring_comments_or_blank_lines(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        textwrap.dedent('''
        import functools

        @functools.cache
        def f(x):
            """A docstring
            of two lines."""
            # a comment

            y = x + 1
            return y
    ''')
    )
    functions = _script()._functions(source)
    assert functions == {4: ("f", ["y = x + 1", "return y"])}  # keyed by the decorator's line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_streamed_completion_is_counted_in_every_process_of_the_tree(tmp_path: Path) -> None:
    rows_file = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "request_path.py"), "--max-tokens", "32", "--json", str(rows_file)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "one streamed completion of 32 chunks" in done.stdout  # a chunk a token
    rows = json.loads(rows_file.read_text())["rows"]
    on_path = {(r["file"], r["function"]) for r in rows if r["on_path"]}
    for expected in [
        ("engine/entrypoints/openai/serving_completion.py", "create_completion"),  # APIServer_0
        ("engine/core/engine_core_proc.py", "run_busy_loop"),  # EngineCore_DP0: a loop entered at start-up
        ("engine/core/engine_core_proc.py", "process_output_sockets"),
        ("engine/core/engine_core.py", "step"),
        ("engine/sched/scheduler.py", "schedule"),
        ("engine/worker/model_runner.py", "execute_model"),  # Worker_DP0_PP0_TP0
        ("engine/frontend/output_processor.py", "process_outputs"),  # back in APIServer_0
    ]:
        assert expected in on_path, expected
    assert ("engine/worker/model_runner.py", "load_model") not in on_path  # start-up, before the window
    reference = next(line for line in done.stdout.splitlines() if line.startswith("the reference path"))
    assert "of them observability or supervision" in reference, done.stdout
