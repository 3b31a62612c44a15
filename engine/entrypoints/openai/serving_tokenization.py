"""``POST /tokenize`` and ``POST /detokenize``: the server's tokenizer, over HTTP.

Mirrors vLLM's ``vllm/entrypoints/openai/serving_tokenization.py``
(``OpenAIServingTokenization``). ``/tokenize`` takes ``{"prompt": str}`` or
``{"messages": [...]}`` (rendered by the chat template first, exactly as
``/v1/chat/completions`` would) and answers ``{"count", "max_model_len", "tokens"}``;
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": str}``. Neither checks
the length against ``max_model_len`` (vLLM does not either): they answer what the text is.

Both are CPU-heavy for a large body (10 MB of text is ~3 M tokens and seconds of work), so
``app.py`` runs them in a worker thread, and they call the Rust tokenizer directly, which
lets go of the GIL while it works: the event loop (other clients' streams) runs meanwhile.
The answer is built without re-validating the millions of ids (``model_construct``).

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
from engine.frontend.detokenizer import backend_tokenizer


class OpenAIServingTokenization(OpenAIServing):
    """The tokenization routes (vLLM's ``OpenAIServingTokenization``)."""

    def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The token ids of the prompt (or of the rendered conversation). CPU-heavy: run it
        in a worker thread.

        Raises:
            OpenAIError: unknown model (404), a field that is not valid text or a chat
                template that fails (400).
        """
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text, _ = self.render_chat(request.messages, request.add_generation_prompt)
        else:
            text = request.prompt
        # As ``tokenizer.encode`` (the same ids), without transformers' Python-side
        # conversion of every output field, which would hold the GIL for a large text.
        encoding = backend_tokenizer(self.tokenizer).encode_batch(
            [text], add_special_tokens=request.add_special_tokens
        )[0]
        tokens = encoding.ids
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse.model_construct(count=len(tokens), max_model_len=self.max_model_len,
                                                tokens=tokens, token_strs=token_strs)  # fmt: skip

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of the token ids. CPU-heavy: run it in a worker thread.

        Raises:
            OpenAIError: unknown model (404), a token id outside the vocabulary (400).
        """
        self.check_model(request.model)
        tokens = request.tokens
        if tokens and not (min(tokens) >= 0 and max(tokens) < self.vocab_size):
            bad = next(t for t in tokens if not 0 <= t < self.vocab_size)
            raise OpenAIError(
                f"Token id {bad} is out of vocabulary (vocab_size={self.vocab_size}).", param="tokens"
            )
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            text = self.tokenizer.decode(tokens)
        else:  # the same text; the Rust tokenizer lets go of the GIL while it decodes
            text = backend_tokenizer(self.tokenizer).decode(tokens, skip_special_tokens=False)
        return DetokenizeResponse.model_construct(prompt=text)
