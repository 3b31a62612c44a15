"""The glass of a mixture of experts: each MoE layer's phases timed, the experts' load counted.

Not in vLLM (its ``FusedMoE`` has no per-phase telemetry). ``MoETelemetry`` is the
``MoEObserver`` (``engine/model/moe.py``) the worker puts on every ``FusedMoE`` of its model.
Each phase of each layer — ``router``, ``dispatch``, ``experts``, ``combine`` — runs inside its
``phase``, which measures the time spent inside expert-parallel all-to-alls during it (the EP
group's own count, ``CommStats.all_to_all_s``: with gloo mostly waiting for the slowest rank)
and, with ``--collect-detailed-traces model`` (or ``worker``, ``all``) or a fault aimed at it,
enters it as a stage: ``moe.router``, ``moe.dispatch``, ``moe.experts``, ``moe.combine`` (a span
with the layer, the rows sent and received, the all-to-all time). Around each forward (a step
or a DP dummy batch) ``forward`` sums what the layers did: the rows each of this rank's experts
took, the time in all-to-alls, the forward's time, from the first step on (``reset`` after the
warm-up). The live-telemetry gauges (``gauges``) carry them to engine-top.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.distributed.parallel_state import get_ep_group
from engine.model.moe import FusedMoE
from tracing import catalogue, faults, stage
from tracing.telemetry import events

# An MoE layer's phase → its span.
PHASE_SPANS = {
    "router": catalogue.MOE_ROUTER,
    "dispatch": catalogue.MOE_DISPATCH,
    "experts": catalogue.MOE_EXPERTS,
    "combine": catalogue.MOE_COMBINE,
}
_FIGURE_ATTRS = {
    "num_tokens": catalogue.ATTR_MOE_NUM_TOKENS,
    "rows_sent": catalogue.ATTR_MOE_ROWS_SENT,
    "rows_received": catalogue.ATTR_MOE_ROWS_RECEIVED,
}


class MoETelemetry:
    """One worker's MoE figures (``layers``: its ``FusedMoE`` by local layer index; each gets
    this as its observer). ``detailed``: make every phase a span (``--collect-detailed-traces``).

    Counters: ``expert_rows`` (rows each of this rank's experts took since start, all layers),
    ``last_rows`` (in the last forward), ``last_a2a_ms`` (the last forward's time inside
    all-to-alls, ms), ``a2a_total_s`` and ``forward_total_s`` (since start, s), ``forwards``,
    ``phase_s`` (seconds in each phase, all layers, since start).
    """

    def __init__(self, layers: dict[int, FusedMoE], detailed: bool = False) -> None:
        self.layers = list(layers.values())
        self.detailed = detailed
        first = self.layers[0]
        self.num_experts = first.num_experts
        self.first_expert = first.first_local_expert
        self.expert_rows = [0] * first.num_local_experts
        self.last_rows = 0
        self.last_a2a_ms = 0.0
        self.a2a_total_s = 0.0
        self.forward_total_s = 0.0
        self.forwards = 0
        self._a2a_s = 0.0  # in the forward running now
        self.phase_s = dict.fromkeys(PHASE_SPANS, 0.0)  # seconds in each phase since start, all layers
        for layer in self.layers:
            layer.observer = self

    @contextmanager
    def phase(self, name: str, layer_index: int) -> Iterator[dict[str, int]]:
        """Phase ``name`` of layer ``layer_index``: timed, its all-to-alls counted, a span when
        asked. Yields the dict the layer fills with the phase's figures."""
        ep = get_ep_group()
        a2a_before = ep.stats.all_to_all_s if ep is not None else 0.0
        figures: dict[str, int] = {}
        span = PHASE_SPANS[name]
        start = time.perf_counter()
        if not (self.detailed or span in faults.armed_stages()):
            yield figures
            if ep is not None:
                self._a2a_s += ep.stats.all_to_all_s - a2a_before
            self.phase_s[name] += time.perf_counter() - start
            return
        with stage(span, **{catalogue.ATTR_MOE_LAYER: layer_index}) as st:
            yield figures
            for key, value in figures.items():
                st.set(_FIGURE_ATTRS[key], value)
            if ep is not None:
                waited = ep.stats.all_to_all_s - a2a_before
                self._a2a_s += waited
                if name in ("dispatch", "combine"):
                    st.set(catalogue.ATTR_MOE_WAIT_MS, round(waited * 1e3, 3))
        self.phase_s[name] += time.perf_counter() - start

    @contextmanager
    def forward(self) -> Iterator[None]:
        """One forward (a step's or a dummy batch's): afterwards the layers' load and the time
        in all-to-alls are this forward's figures. A forward that raises is not counted."""
        self._a2a_s = 0.0
        start = time.perf_counter()
        yield
        self.forward_total_s += time.perf_counter() - start
        self.forwards += 1
        load = [0] * len(self.expert_rows)
        for layer in self.layers:
            for i, n in enumerate(layer.take_expert_load().tolist()):
                load[i] += n
        self.expert_rows = [a + b for a, b in zip(self.expert_rows, load)]
        self.last_rows = sum(load)
        self.last_a2a_ms = self._a2a_s * 1e3
        self.a2a_total_s += self._a2a_s

    def reset(self) -> None:
        """Forget what start-up did (the profile and warm-up forwards route their dummy tokens
        too): the counters start at the first step."""
        for layer in self.layers:
            layer.take_expert_load()
        self.expert_rows = [0] * len(self.expert_rows)
        self.last_rows, self.last_a2a_ms, self.forwards = 0, 0.0, 0
        self.times(reset=True)

    def times(self, reset: bool = False) -> dict[str, float]:
        """Seconds since start (or the last reset) in forwards (``moe_forward_s``), in each
        phase of every layer (``moe_router_s``, ``moe_dispatch_s``, ``moe_experts_s``,
        ``moe_combine_s``) and inside the all-to-alls (``moe_a2a_s``): the benchmarks' shares."""
        out = {"moe_forward_s": self.forward_total_s, "moe_a2a_s": self.a2a_total_s}
        out.update({f"moe_{name}_s": seconds for name, seconds in self.phase_s.items()})
        if reset:
            self.forward_total_s = self.a2a_total_s = 0.0
            self.phase_s = dict.fromkeys(PHASE_SPANS, 0.0)
        return out

    def gauges(self) -> dict[str, float]:
        """Live-telemetry gauges (``events.GAUGE_MOE_*``): this rank's experts, their rows since
        start and in the last forward, the time in all-to-alls."""
        gauges = {
            events.GAUGE_MOE_NUM_EXPERTS: self.num_experts,
            events.GAUGE_MOE_FIRST_EXPERT: self.first_expert,
            events.GAUGE_MOE_LOCAL_EXPERTS: len(self.expert_rows),
            events.GAUGE_MOE_STEP_ROWS: self.last_rows,
            events.GAUGE_MOE_A2A_MS: self.last_a2a_ms,
            events.GAUGE_MOE_A2A_TOTAL_S: self.a2a_total_s,
            events.GAUGE_MOE_FORWARD_TOTAL_S: self.forward_total_s,
        }
        for i, rows in enumerate(self.expert_rows):
            gauges[events.moe_expert_gauge(self.first_expert + i)] = rows
        return gauges


def moe_forward(telemetry: MoETelemetry | None):
    """``telemetry.forward()``, or nothing for a dense model."""
    return telemetry.forward() if telemetry is not None else contextlib.nullcontext()
