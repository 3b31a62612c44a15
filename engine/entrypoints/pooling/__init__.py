"""The pooling routes of the API server (``--runner pooling``): ``POST /v1/embeddings`` and
``POST /pooling``.

Mirrors vLLM 0.32's ``vllm/entrypoints/pooling/`` package: ``protocol.py`` holds the request
and response bodies (``embed/protocol.py``, ``pooling/protocol.py``), ``serving.py`` the two
handlers and what they share (``embed/serving.py``, ``pooling/serving.py``,
``base/serving.py``). ``app.py`` registers these routes only on a pooling model's server, as
vLLM registers a router per supported task.
"""
