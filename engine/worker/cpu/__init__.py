"""The CPU worker's speed-ups, behind ``Worker``'s interface: its torch threads, planned
(``cpu_threads.py``), pinned and governed while other processes take its CPUs
(``cpu_thread_governor.py``), in ``CPUWorker`` (``cpu_worker.py``), which the executor builds
for a worker on the CPU. ``engine/worker/worker.py`` imports nothing from here.

Beside the worker rather than in ``engine/model/cpu/``: planning threads and pinning CPUs is
about processes, which the model knows nothing of (``tests/e2e/test_import_rules.py``); the model's
side of it, the thread count a step's parallel work runs with, is
``engine/model/cpu/op_threads.py``.
"""
