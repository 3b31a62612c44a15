"""The OpenAI-compatible HTTP API, as the API server process runs it.

Mirrors vLLM's ``vllm/entrypoints/openai/`` package, one concept per module:

- ``protocol.py``: the request and response bodies (pydantic), OpenAI's field names plus
  vLLM's extras (``top_k``, ``ignore_eos``, ...), and the error shape.
- ``serving_engine.py``: what every route shares — model check, prompt rendering,
  ``max_tokens`` rules, turning errors into ``ErrorResponse``s, Server-Sent Events.
- ``serving_completion.py`` (``/v1/completions``), ``serving_chat.py``
  (``/v1/chat/completions``), ``serving_models.py`` (``/v1/models``),
  ``serving_tokenization.py`` (``/tokenize``, ``/detokenize``).
- ``responses/``: the Responses API (``/v1/responses``, retrieve, cancel), run through the chat
  flow, and its bounded store (vLLM 0.32's ``vllm/entrypoints/openai/responses/``). Anthropic's
  Messages API (``/v1/messages``) is its sibling package ``engine/entrypoints/anthropic/``, and
  the pooling routes (``/v1/embeddings``, ``/pooling``) ``engine/entrypoints/pooling/``.
- ``app.py``: ``build_app`` — the FastAPI app with its routes, middleware, error handlers,
  health and Prometheus metrics.

Nothing here imports torch (ARCHITECTURE.md §3, §9): the API server needs only the
tokenizer and the engine client (``AsyncLLM``).
"""
