"""How ``glassbox ps`` breaks a worker's long "runs as" line: between phrases, never inside one."""

from __future__ import annotations

from engine.cli.ps import wrap_phrases
from tracing.instances import runs_as_parts, runs_as_text

# What a bfloat16 worker on an AMX Xeon records once warm: 13 phrases, over 300 characters.
RUNS_AS = {
    "device": "cpu",
    "dtype": "bfloat16",
    "compile": "compiled (inductor, 1 graph)",
    "attention": "CPU_PAGED_CPP",
    "cpu_threads": "2 of 2",
    "kv_cache_pages": "2 MiB pages",
    "bf16_linear": "native (measured)",
    "linear_kernel": "up to 1 row (measured)",
    "brgemm_linear": "up to 128 rows (measured)",
    "bf16_attention": "native (cached)",
    "step_threads": "2 (measured)",
    "compiled_step": "compiled (measured)",
    "attention_task_shape": "all KV heads per task (measured)",
}


def test_runs_as_breaks_only_between_phrases_at_every_width():
    parts = runs_as_parts(RUNS_AS)
    assert ", ".join(parts) == runs_as_text(RUNS_AS)
    assert "brgemm linears up to 128 rows (measured)" in parts
    head = "Worker_DP0_PP0_TP0 runs as: "
    for width in (60, 80, 100, 120, 200):
        lines = wrap_phrases(parts, width, first_used=len(head), indent=4)
        # Every phrase whole on one line, in order, and nothing lost or added.
        rejoined = " ".join(lines)
        assert rejoined == ", ".join(parts), width
        for phrase in parts:
            assert any(phrase in line for line in lines), (width, phrase)
        assert len(head) + len(lines[0]) <= width and all(4 + len(line) <= width for line in lines[1:]), width
        assert all(line.endswith(",") for line in lines[:-1]) and not lines[-1].endswith(",")
    assert len(wrap_phrases(parts, 1000, first_used=len(head))) == 1, "a wide terminal keeps one line"


def test_a_phrase_wider_than_the_line_gets_a_line_of_its_own():
    lines = wrap_phrases(["a", "x" * 50, "b"], 20, first_used=5, indent=2)
    assert lines == ["a,", "x" * 50 + ",", "b"]
