"""Who runs where: ``topology.py`` (the one plan of every process, torch-free) and
``parallel_state.py`` (the torch.distributed groups inside the worker), plus ``utils.py``
(which decoder layers each pipeline stage holds; torch-free).

Importing this package imports neither: the API server, ``glassbox ps`` and the run-directory
code read the plan without loading torch.
"""
