"""The span catalogue says nothing the code does not do.

Every attribute key declared in ``tracing/catalogue.py`` is set somewhere — its constant or
its key appears in the code of ``engine/`` or ``tracing/`` — and every span name is opened
somewhere, and every span event added somewhere. (That each span carries the attributes the catalogue lists for it is
checked at run time, on a real tree's trace, in ``test_request_trace.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path

from tracing import catalogue

ROOT = Path(__file__).resolve().parents[3]
CATALOGUE = ROOT / "tracing" / "catalogue.py"


def _code() -> str:
    files = [p for d in ("engine", "tracing") for p in (ROOT / d).rglob("*.py") if p != CATALOGUE]
    return "\n".join(p.read_text() for p in files)


def _constants(kind: str) -> dict[str, str]:
    """Constant name → value, for the catalogue's attribute keys or span names."""
    table = {"_attr": catalogue.ATTRIBUTES, "_span": catalogue.SPANS, "_event": catalogue.EVENTS}[kind]
    found = {name: value for name, value in vars(catalogue).items()
             if name.isupper() and isinstance(value, str) and value in table}  # fmt: skip
    assert set(found.values()) == set(table), "every definition is bound to a constant"
    return found


def test_every_declared_attribute_is_set_somewhere():
    code = _code()
    unused = [
        key
        for name, key in _constants("_attr").items()
        if not re.search(rf"\b{name}\b", code) and f'"{key}"' not in code
    ]
    assert not unused, f"declared in tracing/catalogue.py but never set: {unused}"


def test_every_declared_span_is_opened_somewhere():
    code = _code()
    unused = [key for name, key in _constants("_span").items() if not re.search(rf"\b{name}\b", code)]
    assert not unused, f"declared in tracing/catalogue.py but never opened: {unused}"


def test_every_declared_event_is_added_somewhere():
    code = _code()
    unused = [key for name, key in _constants("_event").items() if not re.search(rf"\b{name}\b", code)]
    assert not unused, f"declared in tracing/catalogue.py but never added: {unused}"
