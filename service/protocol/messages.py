"""Typed wire messages: every body dpcoord sends or receives, as msgspec Structs.

Each Struct is the schema of one message; :mod:`service.protocol.codec` decodes them from
JSON or msgpack. ``array_like`` Structs travel as msgpack arrays between dpcoord processes
only, so their field names are not part of the wire contract.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from service.protocol.errors import WireError
from service.protocol.logprobs import LogprobCount, LogprobsMode, TopLogprob
from service.protocol.prefix import MAX_PREFIX_HASHES

# Integers that cross the wire fit msgpack's 64 bits: a bigger one (JSON allows any) would be
# accepted, then fail to encode on its way on, taking its batch neighbours with it.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]  # every tokenizer's ids fit 31 bits; engines check their vocabulary
ClientRequestId = str | Int64
FinishReason = Literal["length", "stop", "abort"]
# What a weight update names its checkpoint by, as the trainer chose it (an iteration, a tag).
WeightVersion = str | Int64
# What pause does to requests in flight: freeze them (keep), end them (abort), or let them finish (drain).
PauseMode = Literal["keep", "abort", "drain"]


# ---------------------------------------------------------------- from clients


class SamplingParams(Struct, omit_defaults=True):
    """Engines apply their own defaults to fields left out (see engines/backend.py)."""

    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: list[str] | None = None
    timeout_s: Annotated[float, Meta(gt=0.0)] | None = None
    # Extensions as vLLM has them (older engines ignore them): generate past EOS ids, and no EOS
    # or stop string ends the request before ``min_tokens`` tokens.
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    # Extensions (log-probabilities): each generated token's, with the ``logprobs`` most likely
    # tokens at its position; each prompt token's, with ``prompt_logprobs`` alternatives. None:
    # nothing computed, nothing sent. Older engines ignore them: the coordinator routes such a
    # request only to engines that announce them (docs/protocol.md).
    logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    logprobs_mode: LogprobsMode = "raw"

    @property
    def asks_logprobs(self) -> bool:
        """Whether a reply must carry log-probabilities (generated or prompt ones)."""
        return self.logprobs is not None or self.prompt_logprobs is not None


class ChatMessage(Struct, omit_defaults=True):
    """One turn of a conversation; the engine renders ``messages`` into a prompt with its model's
    chat template (engines/chat_template.py)."""

    role: str
    content: str = ""
    name: str | None = None


ModelName = Annotated[str, Meta(min_length=1, max_length=256)]
# A session's or a group's name (extensions): routing keeps a session, or a group of samples, on one engine.
AffinityId = Annotated[str, Meta(min_length=1, max_length=256)]


class SubmitRequest(Struct):
    """Exactly one of ``prompt`` and ``messages``; ``model`` limits routing to engines serving it."""

    prompt: str | list[TokenId] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    client_request_id: ClientRequestId | None = None
    client_id: str | None = None
    reply_to: Annotated[str, Meta(pattern=r"^[^\s*>]+$")] | None = None  # a subject one can publish to
    model: ModelName | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    # Extensions (docs/protocol.md, *Sessions and groups*): the conversation this turn belongs to,
    # and the group of submissions (say, the samples of one prompt) to run on one engine.
    session_id: AffinityId | None = None
    group_id: AffinityId | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")


class SubmitEnvelope(Struct, array_like=True):
    """The client library's submission: routing fields up front, the contract body as opaque bytes.

    A contract body is a msgpack map or a JSON object, so a msgpack array never is one: the
    coordinator tells an envelope by its first byte. It routes an envelope without decoding
    ``body``, which it forwards untouched; the engine validates it (400 to the client as
    usual). Plain bodies from the ``nats`` CLI keep working exactly as before.
    Trailing elements a newer client adds are ignored.

    ``prefix_hashes`` (an extension: older coordinators ignore it) are the prompt's prefix
    hashes (:mod:`service.protocol.prefix`), for prefix-aware routing.
    """

    version: Literal[1]
    body: bytes
    stream: bool = False
    client_request_id: ClientRequestId | None = None
    client_id: str | None = None
    reply_to: Annotated[str, Meta(pattern=r"^[^\s*>]+$")] | None = None  # as SubmitRequest.reply_to
    timeout_s: Annotated[float, Meta(gt=0.0)] | None = None
    model: ModelName | None = None  # the body's model, for routing without decoding the body
    prefix_hashes: Annotated[list[int], Meta(max_length=MAX_PREFIX_HASHES)] | None = None
    # An extension: set on every publish of a submission after its first, so a replica that does
    # not hold the request asks its peers before running it (docs/reliability.md, ownership).
    resubmission: bool = False
    # An extension: the client reads reply batches (service/protocol/reply_batches.py), so this
    # request's replies may arrive together with its other requests' ones.
    batched_replies: bool = False
    # An extension: the body asks for log-probabilities (``sampling_params.logprobs`` or
    # ``prompt_logprobs``), so only engines that compute them may run it.
    logprobs: bool = False
    # Extensions, as SubmitRequest's: the body's session and group, for routing without decoding it.
    session_id: AffinityId | None = None
    group_id: AffinityId | None = None
    # An extension: the client reads a :class:`Held` notice when its request waits because the
    # fleet is not running (paused, suspended); clients that leave it False never get one.
    held_notices: bool = False


class ConnectRequest(Struct):
    client_id: str | None = None


class AbortRequest(Struct):
    client_request_id: ClientRequestId | None = None
    client_id: str | None = None
    request_id: str | None = None


class HoldRequest(Struct):
    """The body of ``hold_request`` (an extension, docs/protocol.md *Backpressure*): a client
    whose reader fell behind asks that the request's generation be ``held`` (paused in its
    engine) or, once the reader caught up, released (``held`` false). ``seq`` counts the
    client's hold requests for this request, so an engine that gets two out of order keeps the
    newer."""

    request_id: str
    held: bool = True
    seq: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0


class ControlSignal(Struct):
    """Control and profiler signals need no fields; ``set_generation_epoch`` needs ``epoch``.
    ``mode`` (an extension, pause only; None means ``keep``) says what pause does to the
    requests in flight. ``retry`` (an extension) marks the same signal sent again because its
    answer never came (the replica taking it died): a replica that finds the control state is
    what the signal wrote broadcasts it again under that revision and acknowledges it once
    every engine confirmed, instead of refusing it (409) or acknowledging it at once."""

    epoch: int | None = None
    mode: PauseMode | None = None
    retry: bool = False


class UpdateWeights(Struct):
    """The body of ``update_weights`` (an extension): a Hugging Face directory of
    ``*.safetensors`` that every engine can read, and the version its tokens will carry."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    version: WeightVersion


class Empty(Struct):
    pass


# ---------------------------------------------------------------- to clients


class ErrorBody(Struct):
    code: int
    message: str


class Partial(Struct, tag="partial", tag_field="type"):
    """``text`` is the detokenised delta of ``new_tokens``.

    Extensions (docs/protocol.md, exact streams): ``offset`` is the index, within the generated
    tokens, of the first of ``new_tokens`` (None from engines of earlier releases: unknown);
    ``attempt`` is the run that produced it (0 for the first, one more per migration or retry).
    A client keeps a stream exact with them (:mod:`service.protocol.streams`).

    Extensions (log-probabilities), only when the request asked for them: ``token_logprobs``,
    aligned with ``new_tokens``; ``top_logprobs`` (None when it asked for 0 alternatives), for
    each of them the most likely ``[token_id, logprob]`` pairs, most likely first;
    ``token_bytes``: every token id those fields name, mapped to its bytes. A request that asked
    none gets :class:`PartialWithoutLogprobs` on the wire, so it pays no byte for them."""

    request_id: str
    client_request_id: ClientRequestId | None
    new_tokens: list[int]
    text: str
    offset: Int64 | None = None
    attempt: Int64 = 0
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    token_bytes: dict[int, bytes] | None = None


class PartialWithoutLogprobs(Struct, tag="partial", tag_field="type"):
    """A :class:`Partial` as an engine encodes it for a request that asked no log-probabilities:
    the same message, its fields up to ``attempt``. ``Partial`` cannot omit its defaults (its
    ``attempt`` 0 stays on the wire), so its logprob fields would otherwise travel as nulls.
    Encode only: every reader decodes a :class:`Partial`."""

    request_id: str
    client_request_id: ClientRequestId | None
    new_tokens: list[int]
    text: str
    offset: Int64 | None = None
    attempt: Int64 = 0


class EpochSpan(Struct):
    """Tokens ``[start, end)`` of a reply were generated under ``epoch``."""

    epoch: int | None
    start: int
    end: int


class WeightVersionSpan(Struct):
    """Tokens ``[start, end)`` of a reply were generated with weights ``version`` (None: the
    weights the engine started with, before any ``update_weights``)."""

    version: WeightVersion | None
    start: int
    end: int


class Timings(Struct):
    """An extension on every engine's final (docs/protocol.md, *Timings*), measured by the engine
    that ran this run of the request, in seconds from the routed request's arrival there:
    ``queued_s`` until the step that prefilled it began (its wait in the engine's queue; the
    coordinator's queue is not in it), ``ttft_s`` until its first token (None: it generated
    none), ``decode_s`` from the first token to the last; ``cached_prompt_tokens`` of the
    prompt were read from the prefix cache instead of being computed."""

    queued_s: float
    ttft_s: float | None = None
    decode_s: float = 0.0
    cached_prompt_tokens: int = 0


class Final(Struct, tag="final", tag_field="type", omit_defaults=True):
    request_id: str
    client_request_id: ClientRequestId | None
    engine_id: str | None
    generated_tokens: list[int]
    generated_text: str
    finish_reason: FinishReason
    epochs: list[EpochSpan] | None = None
    prompt_tokens: int | None = None  # the prompt's length in the engine's tokens (usage)
    weight_versions: list[WeightVersionSpan] | None = None  # an extension, like ``epochs``
    # Extensions (log-probabilities), only when asked: as :class:`Partial`'s, aligned with
    # ``generated_tokens``; with prompt logprobs, the prompt's tokens and theirs (the first has
    # none: null), ``token_bytes`` naming the prompt's tokens and alternatives too.
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[TopLogprob] | None] | None = None
    token_bytes: dict[int, bytes] | None = None
    timings: Timings | None = None  # an extension: None from the coordinator and older engines


class Held(Struct, tag="held", tag_field="type"):
    """An extension, sent to clients that asked (``SubmitEnvelope.held_notices``): the request
    was accepted and waits in the coordinator's queue because the fleet is ``state`` (the
    control state: ``paused``, ``suspended``); it runs once the fleet runs again. At most one
    per submission, before any other reply; never terminal."""

    request_id: str
    client_request_id: ClientRequestId | None
    state: str


class ErrorReply(Struct, tag="error", tag_field="type", omit_defaults=True):
    error: ErrorBody
    client_request_id: ClientRequestId | None = None
    request_id: str | None = None


class Ack(Struct, tag="ack", tag_field="type", omit_defaults=True):
    """``revision`` is the control-state revision a control signal wrote or found (see
    :class:`service.protocol.state.ControlRecord`); ``replicas`` is how many coordinator
    replicas a shutdown stops."""

    signal: str
    state: str | None = None
    request_id: str | None = None
    epoch: int | None = None
    engines: dict[str, str] | None = None
    revision: int | None = None
    replicas: int | None = None
    weight_version: WeightVersion | None = None  # update_weights: the version every engine serves now
    digest: str | None = None  # update_weights: the checkpoint's content digest, alike on every engine
    mode: PauseMode | None = None  # pause: the mode it was applied in


class ConnectAck(Struct, tag="connect_ack", tag_field="type"):
    client_id: str
    coordinator_id: str
    protocol_version: int


class ServedModel(Struct):
    """A model some engines serve, as one coordinator sees the fleet."""

    name: str
    engines: int
    capacity: int
    in_flight: int


class ModelList(Struct, tag="models", tag_field="type"):
    """The answer to ``list_models``."""

    models: list[ServedModel]


Reply = Partial | Final | Held | ErrorReply | Ack | ConnectAck | ModelList


def error_reply(
    err: WireError, client_request_id: ClientRequestId | None = None, request_id: str | None = None
) -> ErrorReply:
    return ErrorReply(
        error=ErrorBody(err.code, err.message), client_request_id=client_request_id, request_id=request_id
    )
