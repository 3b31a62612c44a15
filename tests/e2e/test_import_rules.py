"""Which way imports go (``ARCHITECTURE.md`` §9), one table row per rule.

Each row imports its modules in a fresh interpreter and looks at ``sys.modules``: no module
of the row may pull in a forbidden package (the package itself or any submodule). A row with
``own_imports_only`` reads its modules' own import statements instead (lazy ones included):
what they call may use the forbidden package, they may not name it. Module
lists are read off the source tree, so a new file under a covered folder is checked too. A
rule that does not hold yet is marked ``xfail`` with what it waits for (strict: once it
holds, drop the mark). A second table says which one module may call a function (the
process harness alone sets up tracing and starts live telemetry), read off the source with
``ast``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules(*folders: str) -> tuple[str, ...]:
    """Every module under ``folders`` (``engine/sched`` → ``engine.sched``, ``engine.sched.request``...)."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return tuple(found)


class Rule(NamedTuple):
    id: str
    modules: tuple[str, ...]
    forbidden: tuple[str, ...]
    xfail: str | None = None  # why it does not hold yet (and what fixes it)
    own_imports_only: bool = False  # only the modules' own import statements count


# What runs in the API server process: the HTTP app, the frontend, and `glassbox serve`
# itself (the offline LLM lives in entrypoints/ too and follows the same rule).
API_SERVER = _modules("engine/entrypoints", "engine/frontend") + ("engine.cli.serve",)
HTTP = ("fastapi", "uvicorn", "starlette")
# The reference path a reader follows: the attention and layer files, every model family,
# and the worker. The speed-ups (engine/model/cpu, engine/worker/cpu) plug in through their
# interfaces, chosen by the plug-in points: the loader (linear methods), the attention
# selector (backends by name), the model runner and the worker wrapper.
CPU_ROOM = ("engine.model.cpu", "engine.worker.cpu")
PLUG_IN_POINTS = ("engine.model.loader", "engine.model.attention_selector", *CPU_ROOM)
REFERENCE_MODEL = tuple(m for m in _modules("engine/model") if m.count(".") == 2 and m not in PLUG_IN_POINTS)

RULES = [
    Rule("tracing imports no engine, tui or torch", _modules("tracing"), ("engine", "tui", "torch")),
    Rule("tui imports no engine (engine-top works on a recording)", _modules("tui"), ("engine", "torch")),
    # Each alone, in its own interpreter: what glassbox ps and engine-top read a run directory with.
    Rule("the run-directory contract imports no engine or torch", ("tracing.run_dir",),
         ("engine", "tui", "torch")),
    Rule("the instance collector imports no engine or torch", ("tracing.instances",),
         ("engine", "tui", "torch")),
    Rule("fault injection imports no engine or torch (every process arms it)", ("tracing.faults",),
         ("engine", "tui", "torch")),
    Rule("live telemetry (events, state, publisher, collector) imports no engine, tui or torch",
         _modules("tracing/telemetry"), ("engine", "tui", "torch")),
    Rule("the telemetry contract and live state import no engine, tui, torch or ZMQ",
         ("tracing.telemetry.events", "tracing.telemetry.state"), ("engine", "tui", "torch", "zmq")),
    Rule("the telemetry collector imports no engine or torch (engine-top reads it)",
         ("tracing.telemetry.collector",), ("engine", "tui", "torch")),
    Rule("the hint catalogue and stack dumps import no engine, torch or ZMQ (doctor, engine-top)",
         ("tracing.hints", "tracing.stacks"), ("engine", "tui", "torch", "zmq")),
    Rule("engine-top's data path (tui, the contract, the collector) imports no engine",
         ("tui", "tracing.run_dir", "tracing.instances"), ("engine", "torch")),
    Rule("sched and kv_cache are pure logic: no torch, ZMQ or HTTP",
         _modules("engine/sched", "engine/kv_cache"), ("torch", "zmq", *HTTP)),
    Rule("config imports no kv_cache (kv_cache_planning reads the config: no config ↔ kv_cache circle)",
         ("engine.config",), ("engine.kv_cache",)),
    Rule("the API server imports no torch, model or worker", API_SERVER,
         ("torch", "engine.model", "engine.worker")),
    Rule("the API server imports no engine.sched", API_SERVER, ("engine.sched",)),
    Rule("the client ↔ engine-core messages import no engine.sched (no core ↔ sched cycle)",
         ("engine.core.messages",), ("engine.sched", "torch", "zmq")),
    Rule("the engine-core ↔ worker messages import no torch", ("engine.executor.messages",), ("torch",)),
    Rule("the head's join socket, beside head_link.py, imports no frontend (the client holds it)",
         ("engine.core.head_join",), ("engine.frontend", "torch")),
    Rule("the topology plan is torch-free", ("engine.distributed", "engine.distributed.topology"),
         ("torch", "zmq", *HTTP, "engine.model", "engine.worker", "engine.core", "engine.sched")),
    Rule("model knows nothing of scheduling, processes or HTTP", _modules("engine/model"),
         ("engine.sched", "engine.kv_cache", "engine.core", "engine.executor", "engine.frontend",
          "engine.entrypoints", "engine.cli", "engine.utils.processes", "engine.utils.supervisor", "zmq",
          *HTTP)),
    Rule("the reference model files import nothing from the CPU room", REFERENCE_MODEL, CPU_ROOM),
    Rule("the reference worker names nothing from the CPU room (CPUWorker extends it)",
         ("engine.worker.worker",), CPU_ROOM, own_imports_only=True),
    Rule("client-side commands (ps, bench) import no torch",
         ("engine", "engine.cli.main", "engine.cli.ps", "engine.cli.bench", "engine.bench.serve"),
         ("torch",)),
]  # fmt: skip

PROBE = """
import importlib, json, sys
modules, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in modules:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))))
"""


def _imported_forbidden(modules: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(modules), json.dumps(forbidden)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"importing {modules} failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _named_forbidden(modules: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """The forbidden modules that ``modules``' own source imports (absolute imports; the
    project uses no relative ones)."""
    named = set()
    for module in modules:
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                named.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
    return sorted(m for m in named if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize(
    "rule",
    [pytest.param(r, marks=pytest.mark.xfail(reason=r.xfail, strict=True) if r.xfail else ()) for r in RULES],
    ids=[r.id for r in RULES],
)
def test_import_rule(rule: Rule):
    assert rule.modules, f"{rule.id}: no modules found"
    check = _named_forbidden if rule.own_imports_only else _imported_forbidden
    bad = check(rule.modules, rule.forbidden)
    assert bad == [], f"{rule.id}: importing {', '.join(rule.modules)} pulled in {', '.join(bad)}"


def test_the_probe_sees_what_a_module_imports():
    """A negative control: the check can fail (a submodule counts under its package)."""
    found = _imported_forbidden(("engine.sched.utils",), ("engine.sched", "torch"))
    assert {"engine.sched", "engine.sched.utils"} <= set(found) and "torch" not in found
    listed = {
        "engine.entrypoints.openai.api_server",
        "engine.entrypoints.openai.app",
        "engine.frontend.async_llm",
    }
    assert listed | {"engine.cli.serve"} <= set(API_SERVER)
    assert "engine.sched.scheduler" in _modules("engine/sched")
    assert {"engine.model.attention", "engine.model.layers", "engine.model.llama"} <= set(REFERENCE_MODEL)
    # The own-imports check sees a lazy import inside a function, as the worker wrapper's.
    assert "engine.worker.cpu.cpu_worker" in _named_forbidden(("engine.worker.worker_base",), CPU_ROOM)


class CallRule(NamedTuple):
    id: str
    functions: tuple[str, ...]
    allowed: str  # the one module under engine/ that may call them


# Who may call what (``engine/utils/process_harness.py``): every process starts through it.
CALL_RULES = [
    CallRule("only the process harness sets up tracing", ("setup_tracing",), "engine.utils.process_harness"),
    CallRule("only the process harness starts live telemetry", ("start_telemetry",), "engine.utils.process_harness"),
]  # fmt: skip


def _callers(function: str) -> set[str]:
    """The modules under ``engine/`` with a call of ``function`` (``f(...)`` or ``x.f(...)``)."""
    import ast

    found = set()
    for module in _modules("engine"):
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / module.replace(".", "/") / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name == function:
                    found.add(module)
    return found


@pytest.mark.parametrize("rule", CALL_RULES, ids=[r.id for r in CALL_RULES])
def test_call_rule(rule: CallRule):
    for function in rule.functions:
        callers = _callers(function)
        # A negative control: the scan sees the allowed module's own call.
        assert rule.allowed in callers, f"{rule.id}: no call of {function} found in {rule.allowed}"
        assert callers == {rule.allowed}, (
            f"{rule.id}: {', '.join(sorted(callers - {rule.allowed}))} call {function}"
        )
