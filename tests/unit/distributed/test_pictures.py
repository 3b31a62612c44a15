"""The process-tree pictures in ``docs/pictures/``: current, and true to the topology plan.

``engine/distributed/pictures.py`` draws each picture from the plan of one ``glassbox serve``
command; the committed SVG files must be exactly what it draws today.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from engine.distributed import pictures

REGENERATE = "regenerate: python -m engine.distributed.pictures"
SVG_NS = "{http://www.w3.org/2000/svg}"


def test_the_committed_pictures_are_current(tmp_path):
    written = pictures.write_pictures(tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(p.name for p in pictures.DOCS_DIR.glob("process-tree-*.svg")), REGENERATE
    for path in written:
        committed = (pictures.DOCS_DIR / path.name).read_bytes()
        assert committed == path.read_bytes(), f"docs/pictures/{path.name} is stale; {REGENERATE}"


def test_drawing_twice_gives_the_same_bytes():
    assert pictures.render_all() == pictures.render_all()


@pytest.mark.parametrize(("stem", "flags"), list(pictures.SHAPES.items()), ids=list(pictures.SHAPES))
def test_each_picture_shows_every_planned_process_once(stem, flags):
    plan = pictures.plan_for(flags)
    root = ET.fromstring(pictures.draw(plan, flags))
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    titles = sorted(t for t in texts if t and t.startswith("glassbox::"))
    assert titles == sorted(r.title for r in plan.roles)
    assert plan.describe() + " processes" in texts
    # Light and dark pages alike: the first thing drawn is a white background.
    background = next(root.iter(f"{SVG_NS}rect"))
    assert (background.get("fill"), background.get("width")) == ("#ffffff", root.get("width"))


def test_the_pictures_are_the_trees_the_cli_plans():
    """Built the way `glassbox serve` builds them: -dp 2 brings a second API server by default."""
    default, tp2, dp2 = (pictures.plan_for(f) for f in pictures.SHAPES.values())
    assert [r.name for r in default.roles] == ["APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"]
    assert [r.name for r in tp2.workers] == ["Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]
    assert dp2.expected_process_count == 7
    assert [r.name for r in dp2.api_servers] == ["APIServer_0", "APIServer_1"]
    assert dp2.coordinator is not None


def test_a_tree_the_layout_cannot_draw_is_refused():
    flags = ("-dp", "4")
    with pytest.raises(ValueError, match="no picture layout"):
        pictures.draw(pictures.plan_for(flags), flags)
