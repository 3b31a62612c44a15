"""Benchmarks that measure a running server from the outside (``glassbox bench ...``).

``serve`` is the load generator behind ``glassbox bench serve`` (vLLM: ``vllm bench serve``,
``vllm/benchmarks/``). Nothing here imports torch: a benchmark client must start fast and
must not compete with the server for memory.
"""
