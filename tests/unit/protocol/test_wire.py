from __future__ import annotations

import json

import msgpack
import pytest

from service.protocol.codec import Encoding, PayloadDecoder, detect_encoding
from service.protocol.errors import WireError
from service.protocol.messages import SubmitRequest
from service.protocol.reply_batches import batch_subject


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"", Encoding.JSON),
        (b"{}", Encoding.JSON),
        (b' \n{"prompt": "x"}', Encoding.JSON),
        (msgpack.packb({"prompt": "x"}), Encoding.MSGPACK),
        (msgpack.packb({}), Encoding.MSGPACK),
        (b"\x00garbage", Encoding.MSGPACK),
    ],
)
def test_encoding_detection(body: bytes, expected: Encoding) -> None:
    assert detect_encoding(body) is expected


def test_json_and_msgpack_decode_to_the_same_model() -> None:
    payload = {"prompt": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0}, "stream": True, "extra": 1}
    decoder = PayloadDecoder(SubmitRequest)
    from_json = decoder.decode(json.dumps(payload).encode(), Encoding.JSON)
    from_msgpack = decoder.decode(msgpack.packb(payload), Encoding.MSGPACK)
    assert from_json == from_msgpack
    assert from_json.prompt == [1, 2, 3] and from_json.sampling_params.max_tokens == 4


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({}, "exactly one of `prompt` and `messages`"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of `prompt` and `messages`"),
        ({"messages": []}, "$.messages"),
        ({"messages": [{"content": "x"}]}, "$.messages[0]"),
        ({"prompt": "x", "model": ""}, "$.model"),
        ({"prompt": 3}, "$.prompt"),
        ({"prompt": "x", "stream": "yes"}, "$.stream"),
        ({"prompt": "x", "sampling_params": {"max_tokens": 0}}, "$.sampling_params.max_tokens"),
        ({"prompt": "x", "sampling_params": {"top_p": 1.5}}, "$.sampling_params.top_p"),
        ({"prompt": "x", "client_request_id": [1]}, "$.client_request_id"),
        ({"prompt": [1, -2]}, "$.prompt[1]"),
    ],
)
def test_wrong_types_and_missing_fields_are_400_naming_the_field(payload: dict, fragment: str) -> None:
    with pytest.raises(WireError) as caught:
        PayloadDecoder(SubmitRequest).decode(json.dumps(payload).encode(), Encoding.JSON)
    assert caught.value.code == 400
    assert fragment in caught.value.message


def test_undecodable_bodies_are_400() -> None:
    decoder = PayloadDecoder(SubmitRequest)
    for body, encoding in [
        (b"{not json", Encoding.JSON),
        (b"\xc1", Encoding.MSGPACK),
        (msgpack.packb([1]), Encoding.MSGPACK),
    ]:
        with pytest.raises(WireError) as caught:
            decoder.decode(body, encoding)
        assert caught.value.code == 400


def test_a_reply_subjects_batch_subject_replaces_its_last_token() -> None:
    assert batch_subject("_INBOX.abc.17") == "_INBOX.abc.b"
    assert batch_subject("_INBOX.17") == "_INBOX.b"
    assert batch_subject("_INBOX") is None and batch_subject(".17") is None
    assert batch_subject("_INBOX.abc.b") is None  # the batch token: its replies go alone
