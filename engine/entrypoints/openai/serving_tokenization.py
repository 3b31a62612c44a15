"""``POST /tokenize`` and ``POST /detokenize``: the server's tokenizer, over HTTP.

Mirrors vLLM's ``vllm/entrypoints/openai/serving_tokenization.py``
(``OpenAIServingTokenization``). ``/tokenize`` takes ``{"prompt": str}`` or
``{"messages": [...]}`` (rendered by the chat template first, exactly as
``/v1/chat/completions`` would) and answers ``{"count", "max_model_len", "tokens"}``;
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": str}``. Neither checks
the length against ``max_model_len`` (vLLM does not either): they answer what the text is.

Left out: ``/tokenizer_info``, tools in the chat template, multimodal messages.
"""

from __future__ import annotations

from engine.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from engine.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing
from engine.frontend.tokenizer import encode


class OpenAIServingTokenization(OpenAIServing):
    """The tokenization routes (vLLM's ``OpenAIServingTokenization``)."""

    def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Raises ``OpenAIError``: unknown model (404), a field that is not valid text or a
        chat template that fails (400)."""
        self.check_model(request.model)
        self.check_fields(request)
        if isinstance(request, TokenizeChatRequest):
            text, _ = self.render_chat(request.messages, request.add_generation_prompt)
        else:
            text = request.prompt
        tokens = encode(self.tokenizer, text, add_special_tokens=request.add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=token_strs)  # fmt: skip

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Raises ``OpenAIError``: unknown model (404), a token id outside the vocabulary (400)."""
        self.check_model(request.model)
        for token_id in request.tokens:
            if not 0 <= token_id < self.vocab_size:
                raise OpenAIError(
                    f"Token id {token_id} is out of vocabulary (vocab_size={self.vocab_size}).",
                    param="tokens",
                )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
