"""Who runs where: ``topology.py`` (the one plan of every process, torch-free) and
``parallel_state.py`` (the torch.distributed groups inside the worker).

Importing this package imports neither: the API server, ``glassbox ps`` and the run-directory
code read the plan without loading torch.
"""
