"""Every line a Glassbox child process writes starts with its role and pid, once.

A child started through the process harness (``spawn_process`` → ``process_entry``) runs
``proc_utils.write_every_way``: ``print``, pieces written to ``sys.stdout``, ``warnings.warn``,
a third-party logger with no handler and one with its own, and a Glassbox logger. Each line
must come out once, with ``(Worker_DP0_PP0_TP1 pid=N) `` in front and nowhere else in it, as
vLLM's ``decorate_logs`` makes its workers' lines. (Under ``-tp 2`` each worker writes its own
copy of such a line, which looked like one line written twice until they carried the prefix.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.utils import processes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_every_line_a_child_writes_carries_its_prefix_once(tmp_path, capfd, reap_children):
    role, tag = "Worker_DP0_PP0_TP1", "XYZZY"
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    child = processes.spawn_process(role, "proc_utils:write_every_way", tag.encode(), tmp_path, env=env)
    try:
        assert child.popen.wait(timeout=60) == 0
    finally:
        child.stop()
    out, err = capfd.readouterr()
    prefix = f"({role} pid={child.pid}) "
    expected = {
        "stdout": [f"{tag} print", f"{tag} print two lines, first", f"{tag} print two lines, second",
                   f"{tag} written in pieces"],
        "stderr": [f"UserWarning: {tag} warnings.warn", f"{tag} third-party logger, no handler",
                   f"{tag} third-party logger with its own handler", f"{tag} glassbox logger"],
    }  # fmt: skip
    for name, text in (("stdout", out), ("stderr", err)):
        lines = text.splitlines()
        for line in lines:  # every line of the child's, the warning's source line included
            assert line.startswith(prefix) and line.count(f"({role} pid=") == 1, (name, line, text)
        for want in expected[name]:
            hits = [ln for ln in lines if ln.endswith(want)]
            assert len(hits) == 1, (name, want, text)
    assert any(
        ln.startswith(prefix + "WARNING ") and f"{tag} glassbox logger" in ln for ln in err.splitlines()
    ), err
