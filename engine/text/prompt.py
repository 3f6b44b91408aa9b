"""A request's prompt as token ids: given ids (checked against the vocabulary), text, or a chat
rendered with the tokenizer's template. Problems are InvalidRequest naming the field."""

from __future__ import annotations

from ..params import GenerationRequest, InvalidRequest


def render_chat(tokenizer, model: str, messages: list[dict[str, str]]) -> str:
    """The prompt text of a chat: the tokenizer's chat template with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages", f"model {model} has no chat template: send a prompt")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # templates raise on roles or orders they do not support
        raise InvalidRequest("messages", f"the chat template refused them: {e}") from None


def prompt_ids(tokenizer, model: str, request: GenerationRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        vocab = len(tokenizer)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequest("prompt_token_ids", f"every id must be an integer in [0, {vocab})")
        return ids
    if isinstance(request.prompt, str):
        ids = tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        if not ids and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id]
        return ids
    if request.messages is not None:
        return tokenizer(render_chat(tokenizer, model, request.messages), add_special_tokens=False)["input_ids"]
    raise InvalidRequest("prompt", "give a prompt string, prompt_token_ids or messages")
