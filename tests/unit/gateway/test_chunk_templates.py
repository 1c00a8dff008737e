"""A streamed text event built from its template (ChunkWriter._template in
service/gateway/streaming.py) is byte for byte the chunk the structs encode to, whatever the
text and the model name hold."""

from __future__ import annotations

import json

import pytest

from service.gateway.schemas import chat_decoder, completion_decoder
from service.gateway.streaming import ChunkWriter
from service.gateway.translate import Plan, chat_plan, completion_plan

TEXTS = ["", "plain", 'a "quoted" \\ back\\slash', "\x00\x1f\n\t\u2028", "ünïcødé 漢字 🙂", '"text":""', '"content":""']
MODELS = ["m", 'quo"te', 'x","text":"', "back\\", "\x00", '"content":""']


def _plan(chat: bool, model: str, n: int) -> Plan:
    body: dict[str, object] = {"model": model, "stream": True, "n": n}
    if chat:
        return chat_plan(chat_decoder.decode(json.dumps({**body, "messages": [{"role": "user", "content": "hi"}]})))
    return completion_plan(completion_decoder.decode(json.dumps({**body, "prompt": "p"})))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_a_templated_text_event_is_the_encoded_chunk(chat: bool, model: str) -> None:
    writer = ChunkWriter(_plan(chat, model, n=3), chat)
    for index in range(3):
        for text in TEXTS:
            assert writer._piece(index, text, None) == writer._encoded(index, text, None)
            if chat:
                assert json.loads(writer._piece(index, text, None)[len(b"data: ") :])["choices"][0]["delta"] == {
                    "content": text
                }
            else:
                assert json.loads(writer._piece(index, text, None)[len(b"data: ") :])["choices"][0]["text"] == text
