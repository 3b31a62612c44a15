"""engine-top: a live Rich view of a Glassbox instance (``docs/engine-top.md``).

- ``views``: pure functions, ``LiveState`` → Rich renderables (every panel).
- ``app``: the live loop — the collector's snapshots, the key reader, the full screen.
- ``source``: finding running instances and opening a collector (live or replay).
- ``cli``: ``engine-top``'s command line (``main(argv) -> int``).

Imports only ``tracing`` (the telemetry contract and the run-directory reader), rich,
psutil and the standard library — never ``engine``: engine-top works on a recording where
no engine can even be imported.
"""
