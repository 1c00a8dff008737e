"""Requests routed to this engine: started on the backend (or refused with their own error
reply), aborted, superseded by a newer run, and terminal replies sent again on request."""

from __future__ import annotations

import logging

from engines.backend import GenerationRequest
from engines.handlers import ENGINE_HANDLERS
from engines.limits import check_limits, check_resume
from engines.replies import ActiveRequest
from engines.runtime_core import RuntimeCore
from service.bus.registry import Incoming
from service.protocol.codec import Encoding, PayloadDecoder, encode_msgpack
from service.protocol.errors import ErrorCode, WireError
from service.protocol.membership import ResendAnswer, ResendReplies
from service.protocol.messages import RoutedRequest, SubmitRequest
from service.protocol.subjects import Header

log = logging.getLogger(__name__)

_submit_decoder = PayloadDecoder(SubmitRequest)


class RequestIntake(RuntimeCore):
    async def _on_routed(self, subject: str, reply: str, data: bytes) -> None:
        """Messages routed to this engine alone; direct handlers, which publish and never wait
        for another message."""
        header = self.subjects.header_of(subject)
        spec = ENGINE_HANDLERS.get(header)
        try:
            if spec is None or spec.fanout:
                raise WireError(ErrorCode.NOT_FOUND, f"no routed message {header!r}")
            await self._dispatch(spec, reply, data)
        except WireError as exc:
            self.counters["malformed"] += 1
            self._malformed_log.warning(
                "engine_id=%s dropped %s message (%d bytes): %s", self.engine_id, header, len(data), exc
            )

    async def start_request(self, routed: RoutedRequest) -> None:
        return_path = routed.return_path
        try:
            encoding = Encoding(return_path.encoding)
        except ValueError:
            self.counters["malformed"] += 1
            self._malformed_log.warning(
                "engine_id=%s request_id=%s: unknown encoding %r; dropped",
                self.engine_id,
                return_path.request_id,
                return_path.encoding,
            )
            return
        if not self._supersede(routed):
            return
        active = ActiveRequest(return_path, encoding, body=routed.body, attempt=routed.attempt)
        try:
            submit = _submit_decoder.decode(routed.body, encoding)
            check_limits(submit, self.settings, self.backend.max_context)
            prompt = submit.prompt if submit.prompt is not None else self.backend.render_chat(submit.messages or ())
            request = GenerationRequest.from_submit(return_path.request_id, submit, prompt)
            resume = routed.resume_tokens
            if resume:
                check_resume(resume, request.max_tokens)
                request.resume_tokens = tuple(resume)
            active.prompt_tokens = self.backend.add(request)
            if resume:
                active.resume(resume, self.backend.resumed_text(return_path.request_id), self.epoch)
        except Exception as exc:
            if isinstance(exc, WireError):
                err = exc
                self._malformed_log.warning(
                    "engine_id=%s request_id=%s refused: %s", self.engine_id, return_path.request_id, err
                )
            else:
                err = WireError(ErrorCode.INTERNAL, f"engine {self.engine_id} could not start the request")
                self._malformed_log.exception(
                    "engine_id=%s request_id=%s: starting it failed", self.engine_id, return_path.request_id
                )
            await self._replies.publish(Header.ENGINE_REPLY, [active.error(err)])
            return
        self._active[return_path.request_id] = active
        self._wake.set()

    def _supersede(self, routed: RoutedRequest) -> bool:
        """Whether to start ``routed``: a request routed twice is ignored, unless it starts a
        newer run (a migration back to this engine), which replaces the older one silently."""
        request_id = routed.return_path.request_id
        active = self._active.get(request_id)
        if active is None:
            return True
        if routed.attempt <= active.attempt:
            log.warning("engine_id=%s request_id=%s routed twice; ignored", self.engine_id, request_id)
            return False
        del self._active[request_id]
        self.backend.abort(request_id)
        self.counters["runs_superseded"] += 1
        return True

    async def abort_request(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is None:
            return
        self.backend.abort(request_id)
        await self._replies.publish(Header.ENGINE_REPLY, [active.final(self.engine_id, "abort")])
        self._stepped.set()

    async def resend_replies(self, incoming: Incoming, resend: ResendReplies) -> None:
        again = [reply for request_id in resend.request_ids if (reply := self._replies.recent(request_id))]
        unknown = [
            request_id
            for request_id in resend.request_ids
            if self._replies.recent(request_id) is None and request_id not in self._active
        ]
        log.info(
            "engine_id=%s: sending %d replies again; %d requests never arrived",
            self.engine_id,
            len(again),
            len(unknown),
        )
        await self._replies.publish(Header.ENGINE_REPLY, again, remember=False)
        if incoming.reply:
            await self.nc.publish(incoming.reply, encode_msgpack(ResendAnswer(unknown)))
