"""The paged-KV-cache picture in ``docs/pictures/``: current, and true to a real run.

``engine/kv_cache/pictures.py`` runs a scripted two-step workload through the real
``Scheduler`` (``KVCacheManager``, ``BlockPool``) and ``ModelRunner._prepare_inputs`` and
draws what they hold; the committed SVG must be exactly what it draws today.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from engine.distributed.pictures import DOCS_DIR
from engine.kv_cache import pictures

REGENERATE = "regenerate: python -m engine.distributed.pictures"
SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def snapshot() -> pictures.KVSnapshot:
    return pictures.run_workload()


def test_the_committed_picture_is_current(tmp_path):
    (path,) = pictures.write_pictures(tmp_path)
    committed = DOCS_DIR / pictures.FILE_NAME
    assert committed.exists(), REGENERATE
    assert committed.read_bytes() == path.read_bytes(), f"docs/pictures/{path.name} is stale; {REGENERATE}"


def test_drawing_twice_gives_the_same_bytes():
    assert pictures.render() == pictures.render()


def test_the_shared_prefix_is_two_cached_blocks_held_twice(snapshot):
    tables = snapshot.block_tables
    assert tables["A"][:2] == tables["B"][:2]
    for block_id in tables["A"][:2]:
        block = snapshot.blocks[block_id]
        assert (block.ref_cnt, block.holders) == (2, ["A", "B"])
        assert block.hash_hex is not None
    # B's first step started after the hit: 16 tokens, two blocks of 8.
    assert snapshot.steps[1].prefix_hits == {"B": 16}
    assert tables["A"][2] != tables["B"][2]


def test_the_null_block_and_the_free_queue(snapshot):
    null = snapshot.blocks[0]
    assert null.is_null and null.ref_cnt == 0 and not null.holders
    held = {b for ids in snapshot.block_tables.values() for b in ids}
    assert 0 not in snapshot.free_queue and not held & set(snapshot.free_queue)
    assert sorted([*held, *snapshot.free_queue, 0]) == list(range(pictures.NUM_BLOCKS))
    # C finished in step 1; its full block is free and still cached, at the queue's tail.
    assert snapshot.steps[0].finished == ["C"] and "C" not in snapshot.block_tables
    tail = snapshot.blocks[snapshot.free_queue[-1]]
    assert tail.hash_hex is not None and tail.ref_cnt == 0


def test_the_slot_mapping_is_the_block_tables(snapshot):
    last = snapshot.steps[-1]
    bs = snapshot.block_size
    assert last.req_ids == ["A", "B"]  # the decode first
    assert last.num_scheduled_tokens == {"A": 1, "B": 7}
    order = [r for r in last.req_ids for _ in range(last.num_scheduled_tokens[r])]
    for req_id, pos, slot in zip(order, last.positions, last.slot_mapping, strict=True):
        block_id = snapshot.block_tables[req_id][pos // bs]
        assert slot == block_id * bs + pos % bs
    # The worker's block tables are the scheduler's.
    assert last.block_tables == snapshot.block_tables


def test_the_picture_shows_every_block_once(snapshot):
    root = ET.fromstring(pictures.draw(snapshot))
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert [t for t in texts if t and t.startswith("block ") and t[6:].isdigit()] == [
        f"block {i}" for i in range(pictures.NUM_BLOCKS)
    ]
    background = next(root.iter(f"{SVG_NS}rect"))
    assert (background.get("fill"), background.get("width")) == ("#ffffff", root.get("width"))
