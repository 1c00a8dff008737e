"""Chat templates rendered by the engine match transformers' ``apply_chat_template``, text and
token ids, for a tokenizer built here; templates that refuse a conversation give 400; models
without a template get the documented plain fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines.chat_template import ChatTemplate, message_dicts, plain_prompt
from service.protocol.errors import WireError
from service.protocol.messages import ChatMessage

# Exercises what real templates use: a system message taken apart with a namespace, the BOS
# token, loop variables, raise_exception, tojson, whitespace control, add_generation_prompt.
TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- endif %}
{% if ns.system %}<|system|>
{{ ns.system | trim }}{{ eos_token }}
{% endif %}
{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
<|{{ message['role'] }}|>{% if message.name is defined %} {{ message.name | tojson }}{% endif %}

{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

CONVERSATION = [
    ChatMessage("system", "  You are terse. "),
    ChatMessage("user", "Héllo, who are you?", name="ann"),
    ChatMessage("assistant", "An engine."),
    ChatMessage("user", "Stream tokens <please>"),
]


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["héllo wörld, the engine streams tokens to the user"] * 20, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    wrapped.chat_template = TEMPLATE
    return wrapped


def transformers_text(tokenizer: Any, messages: list[ChatMessage]) -> str:
    return tokenizer.apply_chat_template(message_dicts(messages), tokenize=False, add_generation_prompt=True)


def test_the_saved_template_renders_as_transformers_does(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    template = ChatTemplate.from_dir(tmp_path)
    assert template is not None
    for messages in (CONVERSATION, CONVERSATION[1:2], [ChatMessage("user", "")]):
        assert template.render(messages) == transformers_text(tokenizer, messages)
    assert template.render(CONVERSATION).startswith("<s><|system|>\nYou are terse.</s>")
    assert template.render(CONVERSATION).endswith("<|assistant|>\n")


def test_a_template_inside_tokenizer_config_with_added_token_objects(tmp_path: Path) -> None:
    """The older layout: ``chat_template`` in tokenizer_config.json (here a list of named
    templates), special tokens written as AddedToken objects."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {
                    "content": "<s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "tool_use", "template": "unused"},
                    {"name": "default", "template": TEMPLATE},
                ],
            }
        )
    )
    template = ChatTemplate.from_dir(tmp_path)
    assert template is not None and template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert template.render(CONVERSATION) == transformers_text(build_tokenizer(), CONVERSATION)


def test_a_refusing_template_is_a_400_with_its_message(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    template = ChatTemplate.from_dir(tmp_path)
    assert template is not None
    with pytest.raises(WireError) as caught:
        template.render([ChatMessage("user", "a"), ChatMessage("user", "b")])
    assert caught.value.code == 400 and "roles must alternate" in caught.value.message


def test_the_sandbox_refuses_escapes() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(WireError) as caught:
        template.render(CONVERSATION)
    assert caught.value.code == 400


def test_no_template_means_none_and_the_plain_fallback(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert ChatTemplate.from_dir(tmp_path) is None
    assert plain_prompt(CONVERSATION[1:3]) == "user: Héllo, who are you?\nassistant: An engine.\nassistant:"


def test_the_torch_backend_tokenises_the_rendered_chat_as_transformers(tmp_path: Path) -> None:
    """Token ids too: the template writes BOS itself, so the engine must not add another."""
    pytest.importorskip("torch")
    from safetensors.torch import save_file

    from engines.torch_backend.backend import TorchBackend
    from engines.torch_backend.families import hf_config
    from engines.torch_backend.weights import random_weights
    from tests.torch.reference import engine_options, tiny

    config = tiny(vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config)))
    save_file(random_weights(config, seed=0), str(tmp_path / "model.safetensors"))
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    backend = TorchBackend(engine_options(), str(tmp_path))
    expected = tokenizer.apply_chat_template(
        message_dicts(CONVERSATION), tokenize=True, add_generation_prompt=True, return_dict=False
    )
    rendered = backend.render_chat(CONVERSATION)
    assert rendered == list(expected)
    assert rendered[0] == tokenizer.bos_token_id and rendered.count(tokenizer.bos_token_id) == 1
    assert backend.default_model_name == tmp_path.name
