"""The OpenAI Responses API (``/v1/responses``), served through the chat flow (vLLM 0.32's
``vllm/entrypoints/openai/responses/``): ``protocol.py`` (the bodies and stream events) and
``serving.py`` (``OpenAIServingResponses`` and its bounded ``ResponsesStore``). Its routes are
in ``engine/entrypoints/openai/app.py``."""
