"""Log-probabilities through the gateway from the torch engine with a real tokenizer: a tiny
random Llama saved by transformers with a byte-level BPE ``tokenizer.json`` that adds BOS, so
tokens hold parts of characters and a special token has no bytes. The official ``openai`` SDK
reads OpenAI's formats; an echoed prompt's logprobs match transformers' log-softmax of one
forward pass, and a greedy token's logprob is its position's best, the same float."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engines.runtime import EngineRuntime
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.gateway_helpers import legacy_logprobs

pytest.importorskip("torch")
pytest.importorskip("transformers")

TEXT = "héllo wörld, the engine streams tökens ✓"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("models") / "tiny-bpe"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT] * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture
async def engine(settings: Settings, coordinator: Coordinator, model_dir: Path) -> AsyncIterator[EngineRuntime]:
    from engines.factory import make_backend

    engine_settings = settings.model_copy(
        update={"backend": "torch", "device": "cpu", "max_context": 128, "kv_cache_gb": 0.005}
    )
    async with EngineRuntime(engine_settings, make_backend(engine_settings, str(model_dir))) as running:
        await running.registered.wait()
        yield running


async def test_chat_logprobs_carry_the_tokenizers_bytes_streamed_or_not(
    engine: EngineRuntime, aclient: openai.AsyncOpenAI
) -> None:
    body: dict[str, Any] = {
        "model": "tiny-bpe",
        "messages": [{"role": "user", "content": TEXT}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    chat = await aclient.chat.completions.create(**body)
    [choice] = chat.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 12
    raw = b"".join(bytes(entry.bytes or []) for entry in content)  # a random model's bytes: UTF-8 or not
    assert raw.decode("utf-8", "replace") == choice.message.content
    for entry in content:
        assert entry.token == bytes(entry.bytes or []).decode("utf-8", "backslashreplace")
        assert len(entry.top_logprobs) == 3
        assert [top.logprob for top in entry.top_logprobs] == sorted(
            (top.logprob for top in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].logprob == entry.logprob and entry.top_logprobs[0].bytes == entry.bytes  # greedy
    stream = await aclient.chat.completions.create(**body, stream=True)
    streamed = [
        entry
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    # Another run (its prompt now cached): the same tokens, logprobs equal to float32's noise.
    assert [(entry.token, entry.bytes) for entry in streamed] == [(entry.token, entry.bytes) for entry in content]
    assert [entry.logprob for entry in streamed] == pytest.approx([entry.logprob for entry in content], abs=1e-4)


async def test_an_echoed_prompts_logprobs_are_transformers_log_softmax(
    engine: EngineRuntime, aclient: openai.AsyncOpenAI, model_dir: Path
) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    completion = await aclient.completions.create(model="tiny-bpe", prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    [choice] = completion.choices
    scored = legacy_logprobs(choice)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT).ids
    assert choice.text == TEXT and ids[0] == 0 and len(scored.tokens) == len(ids)
    assert scored.tokens[0] == ""  # BOS: a special token without bytes
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(model_dir).eval()(torch.tensor([ids])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    for position in range(1, len(ids)):
        logprob = scored.token_logprobs[position]
        assert logprob is not None and abs(logprob - reference[position - 1, ids[position]].item()) <= 1e-4
        top = scored.top_logprobs[position]
        assert top is not None and 2 <= len(top) <= 3  # the 2 best, and the prompt's token when it is not one of them
        assert max(top.values()) == pytest.approx(reference[position - 1].max().item(), abs=1e-4)
    assert completion.usage is not None and completion.usage.completion_tokens == 0
