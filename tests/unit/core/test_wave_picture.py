"""The DP-wave picture (``docs/pictures/dp-wave.svg``): current, and true to the wave logic.

``engine/core/wave_picture.py`` plays one request through two engines and the coordinator
with the real ``EngineCoreProc`` wave methods and a real ``DPCoordinator``; the committed SVG
must be exactly what it draws today.
"""

from __future__ import annotations

from engine.core import wave_picture
from engine.distributed import pictures

REGENERATE = "regenerate: python -m engine.distributed.pictures"


def test_the_committed_picture_is_current(tmp_path):
    (path,) = wave_picture.write_pictures(tmp_path)
    committed = pictures.DOCS_DIR / wave_picture.FILE_NAME
    assert committed.read_bytes() == path.read_bytes(), f"docs/pictures/{path.name} is stale; {REGENERATE}"


def test_the_idle_engine_runs_dummy_batches_exactly_while_the_wave_runs():
    turns = wave_picture.run_scenario()
    busy = [t.did[0] for t in turns]
    idle = [t.did[1] for t in turns]
    assert busy == ["idle", "prefill", "decode", "decode", "decode (finished)", "dummy", "idle"]
    # DP1 hears of the wave one turn after DP0 starts it, and steps dummy batches until it ends.
    assert idle == ["idle", "idle", "dummy", "dummy", "dummy", "dummy", "idle"]
    assert turns[1].to_coordinator[0] == (0, "StartWave(0)")
    assert turns[1].from_coordinator == [(1, "DPWave(0, running)")]  # not to the engine that started it
    # The wave ends when both report zero; everyone moves to wave 1.
    assert turns[5].from_coordinator == [(0, "DPWave(1, ended)"), (1, "DPWave(1, ended)")]
    assert turns[-1].coordinator == (1, False) and turns[-1].wave == [(1, False), (1, False)]


def test_drawing_twice_gives_the_same_bytes():
    assert wave_picture.render_all() == wave_picture.render_all()


# ---------------------------------------------------------------------- under expert parallelism


def test_the_committed_expert_parallel_picture_is_current(tmp_path):
    from engine.core import ep_wave_picture

    (path,) = ep_wave_picture.write_pictures(tmp_path)
    committed = pictures.DOCS_DIR / ep_wave_picture.FILE_NAME
    assert committed.read_bytes() == path.read_bytes(), f"docs/pictures/{path.name} is stale; {REGENERATE}"


def test_under_expert_parallelism_the_forwards_meet_and_the_engines_end_the_wave_together():
    from engine.core import ep_wave_picture

    columns = ep_wave_picture.run_scenario()
    assert [c.did[0] for c in columns] == ["idle", "prefill", "cont. prefill", "decode", "decode (finished)",
                                           "dummy", "idle"]  # fmt: skip
    assert [c.did[1] for c in columns] == ["idle", "idle", "dummy", "dummy", "dummy", "dummy", "idle"]
    # engine 0's prefill waits in the all-to-all until engine 1's first dummy batch joins it
    assert columns[1].waiting == [True, False] and columns[1].forward is None
    assert [c.forward for c in columns] == [None, None, 1, 2, 3, 4, None]
    # the all-reduce at the 4th forward finds no work: both leave wave 0 after that same forward
    assert columns[5].synced is False and columns[5].wave == [(1, False), (1, False)]
    assert (0, "WaveComplete(0)") in columns[5].to_coordinator and columns[5].coordinator == (1, False)
    assert all(c.from_coordinator == [] for c in columns[2:])  # the coordinator never ends it itself
