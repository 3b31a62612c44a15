"""Every ``GLASSBOX_*`` variable is checked in the first process, before anything is spawned:
a bad value is one line naming the variable, exit 2, and no child process
is ever started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import envs

# A value each kind of variable refuses (plain strings accept anything and are left out).
BAD = {
    "float": "lots",
    "_log_level": "LOUD",
    "_bool": "maybe",
    "_auto_bool": "sometimes",
    "_non_negative_int": "-1",
    "_positive_float": "-1",
    "parse_seconds": "-1",  # tracing.waits' parser, which envs uses for every deadline
    "_non_negative_float": "-0.5",
    "_layer_partition": "2,x",
    "_faults": "no.such.stage:hang",
    "_omp_threads_bind": "0-x",
    "_cache_root": "/dev/null/cache",  # under a file: neither a directory nor creatable
    "_stage_delay": "-1",
    "_fused_loop_threads": "two",
}
CHECKED = [
    (name, BAD[var.parse.__name__]) for name, var in envs.ENV_VARS.items() if var.parse.__name__ in BAD
]


def test_every_variable_that_can_be_wrong_is_covered():
    plain = {name for name, var in envs.ENV_VARS.items() if var.parse is str}
    assert {name for name, _ in CHECKED} | plain == set(envs.ENV_VARS)


@pytest.mark.parametrize(("name", "value"), CHECKED, ids=[name for name, _ in CHECKED])
def test_a_bad_value_is_one_line_naming_it_and_nothing_starts(name, value, tmp_path):
    env = {**os.environ, name: value, "GLASSBOX_RUN_DIR_BASE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "hi", "--max-tokens", "1"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], lines
    assert not list(tmp_path.iterdir()), "nothing was started (no run directory)"
