"""The picture of one request's path in ``docs/pictures/``: current, named from the code,
numbered as ``docs/architecture.md``'s walk."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from engine.distributed import pictures, request_path_picture

REGENERATE = "regenerate: python -m engine.distributed.pictures"
SVG_NS = "{http://www.w3.org/2000/svg}"
ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


def _texts() -> list[str]:
    root = ET.fromstring(request_path_picture.render()[request_path_picture.FILE_NAME])
    return [t.text or "" for t in root.iter(f"{SVG_NS}text")]


def test_the_committed_picture_is_current(tmp_path):
    (path,) = request_path_picture.write_pictures(tmp_path)
    committed = pictures.DOCS_DIR / request_path_picture.FILE_NAME
    assert committed.exists(), REGENERATE
    assert committed.read_bytes() == path.read_bytes(), f"docs/pictures/{path.name} is stale; {REGENERATE}"


def test_drawing_twice_gives_the_same_bytes():
    assert request_path_picture.render() == request_path_picture.render()


def test_the_steps_are_the_walks_in_order():
    """Each step label once, in the walk's order: 1 … 8, lettered within a step."""
    badges = [t for t in _texts() if re.fullmatch(r"[1-8][a-c]?", t)]
    labels = ["1", "2", "3a", "3b", "3c", "4", "5a", "5b", "6", "7a", "7b", "7c", "8a", "8b"]
    assert sorted(badges) == sorted([*labels, "3a"])  # 3a is in the legend too
    walk = ARCHITECTURE.read_text(encoding="utf-8").split("## One request, in eight steps", 1)[1]
    walk = walk.split("\n## ", 1)[0]
    assert re.findall(r"^(\d)\. ", walk, flags=re.M) == [str(i) for i in range(1, 9)]
    assert "(pictures/request-path.svg)" in walk


def test_the_names_are_the_codes():
    texts = " ".join(_texts())
    for name in ("EngineCoreInputThread", "EngineCoreOutputThread", "AsyncLLM.output_handler", "input_queue",
                 "output_queue", "ROUTER (bind)", "DEALER (connect)", "PUSH (connect)", "PULL (bind)",
                 "rpc_broadcast_mq", "glassbox::APIServer_0", "glassbox::EngineCore_DP0",
                 "glassbox::Worker_DP0_PP0_TP0", "Scheduler.schedule"):  # fmt: skip
        assert name in texts, name


def test_a_name_the_code_no_longer_has_is_refused():
    from engine.core.engine_core_proc import EngineCoreProc

    with pytest.raises(LookupError, match="EngineCoreInputThreadX"):
        request_path_picture._lit(EngineCoreProc.__init__, 'name="EngineCoreInputThreadX"')
