"""The process harness's outcome mapping (``engine/utils/process_harness.run_process``).

Each case runs one target in a fresh interpreter (the harness installs signal handlers and
replaces the tracer provider, which a test process must keep) and checks its exit status,
its crash report and the order of its end: crash report, last words, cleanups.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import json, sys
from pathlib import Path
from engine.utils.process_harness import ProcessSpec, run_process
from tracing import run_dir as run_dirs

run_dir, case = Path(sys.argv[1]), sys.argv[2]
said = []

def target(ctx):
    ctx.at_exit(lambda: said.append("cleanup: crash report " + str(run_dirs.crash_path(run_dir, "Worker_DP0_PP0_TP0").exists())))
    if case == "raises":
        raise ValueError("boom")
    if case == "exits":
        raise SystemExit(143)

last_words = (lambda ctx, e: said.append("last words: " + type(e).__name__)) if case != "traceback" else None
code = run_process(ProcessSpec("Worker_DP0_PP0_TP0", run_dir, rank=3, target=target if case != "traceback" else
                               (lambda ctx: 1 / 0), last_words=last_words))
print(json.dumps({"code": code, "said": said}))
"""


@pytest.mark.parametrize(
    "case, code, said, crash",
    [
        ("returns", 0, ["cleanup: crash report False"], None),
        ("exits", 143, ["cleanup: crash report False"], None),
        ("raises", 1, ["last words: ValueError", "cleanup: crash report True"], "ValueError: boom"),
        ("traceback", 1, [], "ZeroDivisionError: division by zero"),
    ],
)
def test_run_process_maps_the_outcome(
    tmp_path: Path, case: str, code: int, said: list[str], crash: str | None
):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), case], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": code, "said": said}
    report = tmp_path / "Worker_DP0_PP0_TP0.crash.json"
    if crash is None:
        assert not report.exists()
        return
    fields = json.loads(report.read_text())
    assert (fields["role"], fields["rank"], fields["exception"]) == ("Worker_DP0_PP0_TP0", 3, crash)
    # No last words: the traceback is printed, as Python prints an uncaught exception's.
    assert ("Traceback (most recent call last)" in proc.stderr) == (case == "traceback")
