"""Which engine core gets a new request, with data parallelism.

vLLM 0.32 does this in ``DPLBAsyncMPClient`` (``vllm/v1/engine/core_client.py``): each new
request goes to the engine with the lowest score ``waiting * 4 + running``
(``coordinator_messages.score``), from the counts the ``DPCoordinator`` publishes, plus the
requests this client sent each engine since that publish (counted as waiting, so a burst
between two publishes spreads out instead of piling on one engine); a request that pins
``data_parallel_rank`` goes to that engine. An abort goes to the engine that has the
request. Glassbox keeps the rule in this one class, which every multiprocess client holds
(``MPClient.load_balancer``), so the offline ``LLM`` balances too.

Pure bookkeeping apart from the coordinator's SUB socket, which it drains without blocking
when it scores; no socket at all without a coordinator (one engine, or a test).
"""

from __future__ import annotations

import zmq

from engine.core.coordinator_messages import EngineLoads, score
from engine.core.coordinator_messages import decode_as as decode_coordinator
from engine.core.messages import EngineCoreOutputs, EngineCoreRequest


class DPLoadBalancer:
    """The routing state of one client over ``data_parallel_size`` engines.

    Attributes:
        engine_loads: the coordinator's latest (waiting, running) per engine.
        sent_since_loads: requests this client sent each engine since that publish.
        requests_sent: requests sent each engine since start (tests, introspection; with one
            engine only the pinned ones).
        request_engine: request id → the engine that has it, until it finishes or is aborted
            (with one engine only the pinned ones: an abort goes to it anyway).
        current_wave, engines_running: the coordinator's wave state, as last published.
    """

    def __init__(self, data_parallel_size: int) -> None:
        self.data_parallel_size = data_parallel_size
        self.engine_loads: list[tuple[int, int]] = [(0, 0)] * data_parallel_size
        self.sent_since_loads = [0] * data_parallel_size
        self.requests_sent = [0] * data_parallel_size
        self.loads_seq = 0
        self.current_wave, self.engines_running = 0, False
        self.request_engine: dict[str, int] = {}
        self.coordinator_sub: zmq.Socket | None = None
        self.publish_address: str | None = None

    def subscribe(self, ctx: zmq.Context, publish_address: str) -> None:
        """Follow the coordinator's published counts at ``publish_address`` (its PUB)."""
        self.publish_address = publish_address
        self.coordinator_sub = ctx.socket(zmq.SUB)
        self.coordinator_sub.setsockopt(zmq.LINGER, 0)
        self.coordinator_sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.coordinator_sub.connect(publish_address)

    def _drain_coordinator(self) -> None:
        """Take the coordinator's newest published counts, if any arrived (non-blocking)."""
        if self.coordinator_sub is None:
            return
        while True:
            try:
                frame = self.coordinator_sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            loads: EngineLoads = decode_coordinator(EngineLoads, frame)
            if loads.seq > self.loads_seq and len(loads.counts) == self.data_parallel_size:
                self.loads_seq = loads.seq
                self.engine_loads = [tuple(c) for c in loads.counts]
                self.sent_since_loads = [0] * self.data_parallel_size
                self.current_wave, self.engines_running = loads.current_wave, loads.engines_running

    def engine_scores(self) -> list[int]:
        """Each engine's score ``waiting * 4 + running``: the coordinator's latest counts, with
        the requests sent since counted as waiting."""
        self._drain_coordinator()
        return [
            score(waiting + sent, running)
            for (waiting, running), sent in zip(self.engine_loads, self.sent_since_loads)
        ]

    def get_core_engine_for_request(self, request: EngineCoreRequest) -> int:
        """The engine for a new request: its pinned ``data_parallel_rank``, else the lowest
        score (ties to the lower rank). Counts the request as sent there, and remembers it
        for its abort (not with one engine, unless pinned).

        A pinned rank was checked against ``data_parallel_size`` where the request was built
        (``InputProcessor.process_inputs``, as in vLLM); it is taken as it is.
        """
        dp = self.data_parallel_size
        if request.data_parallel_rank is not None:
            engine = request.data_parallel_rank
        elif dp == 1:
            return 0  # nothing to choose, nothing to remember: an abort goes to the one engine
        else:
            scores = self.engine_scores()
            engine = min(range(dp), key=lambda k: (scores[k], k))
        self.sent_since_loads[engine] += 1
        self.requests_sent[engine] += 1
        self.request_engine[request.request_id] = engine
        return engine

    def engines_for_abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Engine → the ids it has (an id this client does not know goes to every engine)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.request_engine.pop(request_id, None)
            for k in [engine] if engine is not None else range(self.data_parallel_size):
                by_engine.setdefault(k, []).append(request_id)
        return by_engine

    def forget_finished(self, outputs: EngineCoreOutputs) -> None:
        """Finished requests are no engine's any more (the client calls this only while
        ``request_engine`` holds any, as vLLM's ``reqs_in_flight`` check)."""
        for output in outputs.outputs:
            if output.finished:
                self.request_engine.pop(output.request_id, None)
        for request_id in outputs.finished_requests or ():
            self.request_engine.pop(request_id, None)

    def close(self) -> None:
        if self.coordinator_sub is not None:
            self.coordinator_sub.close(linger=0)
