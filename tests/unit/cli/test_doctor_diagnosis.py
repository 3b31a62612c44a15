"""``engine.cli.doctor.diagnose`` on a hand-made report: the words doctor prints under
``diagnosis:`` and ``what to check:`` for a culprit the blame rule named."""

from __future__ import annotations

import pytest

from engine.cli import doctor
from tracing import hints
from tracing.blame import Blame


def _report(verdict: str) -> doctor.Report:
    engine = doctor.ProcessReport(role="EngineCore_DP1", kind="engine_core", pid=1906, rank=1,
                                  os_state="exited", state="dead", stage="engine_core.dummy_step")  # fmt: skip
    report = doctor.Report(run_dir="/tmp/x", mode="serve", expected=1, found=0, live_telemetry=False,
                           processes=[engine], alerts=[], problems=[])  # fmt: skip
    report.blame = Blame(role="EngineCore_DP1", verdict=verdict, stage="engine_core.dummy_step",
                         reason="EngineStepHung: the step ran too long", pid=1906)  # fmt: skip
    return report


@pytest.mark.parametrize("verdict", ["failed", "dead"])
def test_a_dead_culprits_hint_and_its_stages_hint_are_two_sentences(verdict: str) -> None:
    report = _report(verdict)
    doctor.diagnose(report)
    stage_words = f"engine_core.dummy_step: {hints.stage_hint('engine_core.dummy_step').hint}."
    assert (report.culprit, report.hint) == ("EngineCore_DP1", f"{hints.DEAD}. {stage_words}")
