"""Glassbox tracing: the stage helper, the span catalogue, exporters and bounded waits.

The engine depends on this package, never the reverse: nothing here imports ``engine``,
``tui`` or torch (a test checks it in a fresh interpreter), so engine-top and the API
server can use it cheaply.

- ``catalogue``: every span name and attribute key, defined once (``docs/spans.md``).
- ``stage(name, **attrs)``: the one way into a stage (span, stage stack, status file, hooks).
- ``setup_tracing(role, ...)``: this process's tracer provider and exporters.
- ``wait_for(what, condition, timeout_s=...)`` / ``bounded_get``: waits with a deadline.
- ``tracing.run_dir``: the run-directory contract — manifest, status file and crash report
  as typed records, one atomic writer, one reader per kind, listing and the stale sweep.
- ``tracing.instances``: the collector of running instances (run directory + psutil) that
  ``glassbox ps`` and engine-top render. Reach both by module (``from tracing import
  run_dir``); ``import tracing`` does not load the collector (nor psutil).

``tracing.stage`` is the function (it shadows the submodule of the same name): reach the
module's other names with ``from tracing.stage import open_stages``.
"""

from __future__ import annotations

import warnings

# `python -m tracing.catalogue` runs a module this package has already imported; that is
# harmless here (it only prints), so runpy's warning about it is silenced.
warnings.filterwarnings("ignore", message="'tracing.catalogue' found in sys.modules", category=RuntimeWarning)

from tracing import catalogue  # noqa: E402
from tracing.setup import (  # noqa: E402
    TracingHandle,
    clear_finished_spans,
    get_finished_spans,
    get_handle,
    setup_tracing,
    shutdown_tracing,
)
from tracing.stage import (  # noqa: E402
    OpenStage,
    Stage,
    add_span_event,
    add_stage_hook,
    current_stage,
    is_recording,
    open_stages,
    record_span,
    remove_stage_hook,
    stage,
    start_span,
)
from tracing.waits import WaitCancelled, WaitTimeout, bounded_get, wait_for  # noqa: E402

__all__ = [
    "catalogue",
    "TracingHandle",
    "setup_tracing",
    "shutdown_tracing",
    "get_handle",
    "get_finished_spans",
    "clear_finished_spans",
    "Stage",
    "OpenStage",
    "stage",
    "record_span",
    "start_span",
    "is_recording",
    "current_stage",
    "open_stages",
    "add_span_event",
    "add_stage_hook",
    "remove_stage_hook",
    "wait_for",
    "bounded_get",
    "WaitTimeout",
    "WaitCancelled",
]
