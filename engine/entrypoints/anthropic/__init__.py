"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), served through
the chat flow of ``engine/entrypoints/openai/`` (vLLM 0.32's ``vllm/entrypoints/anthropic/``):
``protocol.py`` (the bodies and Anthropic's error shape) and ``serving.py``
(``AnthropicServingMessages``). Its routes are in ``engine/entrypoints/openai/app.py``."""
