"""Chat templates: a conversation (``messages``) rendered into one prompt, by the engine that owns
the model's tokenizer.

A model directory's template is the ``chat_template`` of its ``tokenizer_config.json`` (a string,
or a list of named templates of which ``default`` is used) or the file ``chat_template.jinja``,
which wins. It is rendered as transformers' ``apply_chat_template`` renders it: Jinja2 in an
immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension,
transformers' ``tojson``, ``raise_exception`` and ``strftime_now``, the tokenizer's named special
tokens (``bos_token``, ``eos_token``, ...) as variables, and ``add_generation_prompt=True``. A
template that raises (say, roles that do not alternate) is a 400 naming its message.

A model without a template gets the plain fallback: one ``role: content`` line per message, then
``assistant:`` to prompt the reply. The echo backend uses the fallback too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import ChatMessage

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PLAIN_GENERATION_PROMPT = "assistant:"


def plain_prompt(messages: Sequence[ChatMessage]) -> str:
    """The fallback rendering: ``user: Hi\\nassistant:`` for one user message."""
    return "".join(f"{message.role}: {message.content}\n" for message in messages) + PLAIN_GENERATION_PROMPT


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the template sees them: ``role``, ``content`` and ``name`` when given."""
    return [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name is not None else {}) for m in messages]


class ChatTemplate:
    """One compiled template and the special tokens it may use."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self._template = _compile(source)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None when it has none."""
        config_path = model_dir / TOKENIZER_CONFIG
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / TEMPLATE_FILE
        source = template_path.read_text() if template_path.is_file() else _config_template(config.get("chat_template"))
        if source is None:
            return None
        tokens = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
        return cls(source, tokens)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=message_dicts(messages),
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except (TemplateError, TypeError, ValueError) as exc:
            raise WireError(ErrorCode.MALFORMED, f"the chat template refused the messages: {exc}") from None


def _config_template(value: object) -> str | None:
    """``chat_template`` of tokenizer_config.json: a string, or ``[{"name", "template"}, ...]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _compile(source: str) -> Any:
    """The template in transformers' sandbox: chat templates from a model hub are untrusted code."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc}") from None
