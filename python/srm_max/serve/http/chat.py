"""Chat: messages turned into one prompt by the model's chat template, if it has one.

A template is the Jinja ``chat_template`` of a ``tokenizer_config.json`` next to
the checkpoint's ``tokenizer.json`` (the Hugging Face convention). A model
without one (the embedded model is a plain language model) gets a 400 on
/v1/chat/completions: guessing a format would give answers the model was never
trained to continue.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import GenerationError
from ..sampling import check_text
from .errors import bad_request

TOKENIZER_CONFIG = "tokenizer_config.json"


def find_chat_template(model_dir: str | Path | None) -> str | None:
    if model_dir is None:
        return None
    path = Path(model_dir) / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def no_template_error(model: str):
    return bad_request(f"The model {model!r} has no chat template (no chat_template in its {TOKENIZER_CONFIG}), "
                       "so it cannot take chat messages; send a text prompt to /v1/completions instead.",
                       "messages", "chat_template_missing")


def render(template: str, messages) -> str:
    """The prompt text of ``messages`` ([{"role", "content"}]), ready for the assistant's turn.
    A content may be OpenAI's list of parts: text parts only, joined by newlines (as vLLM
    joins them) before the template sees them."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    messages = [_with_text_content(i, m) for i, m in enumerate(messages)]
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role and a string content "
                              "(or a list of text parts)", "messages")
        for key in ("role", "content"):
            try:
                check_text(m[key], f"messages[{i}].{key}")
            except GenerationError as e:
                raise bad_request(str(e), "messages") from None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001
        # the template decides which messages it takes (a TemplateError, or a TypeError
        # from its own expressions on a value it did not expect): this request's fault
        raise bad_request(f"the chat template cannot render these messages: {str(e)[:300]}",
                          "messages") from None


def _with_text_content(i: int, message) -> dict:
    """``message`` with a content given as parts ([{"type": "text", "text": ...}]) as one string."""
    if not isinstance(message, dict):
        raise bad_request(f"messages[{i}] must be an object with a string role and a string content", "messages")
    parts = message.get("content")
    if not isinstance(parts, list):
        return message
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}].content[{j}] must be a text part ({{\"type\": \"text\", \"text\": "
                              "a string}): this model reads text only", "messages")
        texts.append(part["text"])
    return message | {"content": "\n".join(texts)}
