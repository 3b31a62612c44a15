"""The waiting queue, in two orders: first-come-first-served, or by priority.

The idea: the scheduler only ever asks the waiting queue "who is next?" (``peek``), takes
that request (``pop``) once it fits, and puts a preempted request back at the front
(``prepend``). The policy decides what "front" means.

Mirrors vLLM's ``vllm/v1/core/sched/request_queue.py``. Pure Python: no torch.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from engine.sched.request import Request


class SchedulingPolicy(enum.Enum):
    """``--scheduling-policy``: ``fcfs`` (arrival order) or ``priority``."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue:
    """What the scheduler needs from a waiting queue (vLLM's abstract ``RequestQueue``)."""

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def pop_request(self) -> Request:
        """Remove and return the next request. Raises IndexError when empty."""
        raise NotImplementedError

    def peek_request(self) -> Request:
        """The next request, left in place. Raises IndexError when empty."""
        raise NotImplementedError

    def prepend_request(self, request: Request) -> None:
        """Put a preempted request back where it will be picked soonest."""
        raise NotImplementedError

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def remove_request(self, request: Request) -> None:
        raise NotImplementedError

    def remove_requests(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        """The requests in the order they would be popped."""
        raise NotImplementedError


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # extendleft reverses, so reverse first: the list keeps its order at the front.
        self._queue.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._queue = deque(r for r in self._queue if r not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``priority`` value first, then earliest ``arrival_time``.

    A heap of ``(priority, arrival_time, request)``. "Prepend" is an ordinary push: a
    preempted request's place follows from its priority and arrival, not from having run.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request))

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[2]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][2]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._heap = [entry for entry in self._heap if entry[2] not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        heap = list(self._heap)
        while heap:
            yield heapq.heappop(heap)[2]


def create_request_queue(policy: str | SchedulingPolicy) -> RequestQueue:
    """The waiting queue for ``policy`` ("fcfs" or "priority"). Raises ValueError otherwise."""
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
