"""Cache-aware routing (``routing_policy: cache_aware``): a request goes where its prompt's
beginning is computed already, as the engines' KV events tell (:mod:`.block_index`), unless
that engine is loaded well past the others; a session stays on its engine, and a group of
submissions (the samples of one prompt) goes to one engine, on the same terms.

Contract (docs/protocol.md, *Routing*):
- An engine's load is its requests in flight plus its queued tokens (prompt tokens waiting for
  their prefill) over ``cache_aware_request_tokens``, the tokens that weigh as one request.
- Its score is its load less ``cache_aware_prefix_weight`` times the prefix of the prompt it
  holds (or is computing: predicted), in the same unit. The weight is high (8): a held prefix
  is worth more than the few requests' wait it may add, so the holder keeps the prompt until
  its affinity yields (below), the rule that balances the load; sessions that lost their home
  (a replica that restarted) find their engine by it. The lowest score wins, equal scores
  are broken at random. The candidates are the engines holding the prompt's longest prefixes (at
  most ``CANDIDATES``, from the index), the least loaded engine, and when no holder wins two
  drawn at random: O(prompt hashes + a few) whatever the fleet's size.
- Affinity yields: an engine whose requests in flight pass ``cache_aware_load_factor`` times the
  mean of the engines that may take the request, and that mean plus ``cache_aware_load_slack``,
  gets no credit for what it holds, is no session's or group's home for this request, and is
  scored on load alone. (Requests, not queued tokens: a long prompt's own prefill must not make
  its engine overloaded for the siblings that share it.)
- A session (``session_id``) goes to its home, the engine its last request went to, while that
  engine is in the pool, has room and does not pass the bound; otherwise it is routed as any
  request and the new engine becomes its home. A group (``group_id``) likewise, after the
  session. Homes are bounded (``session_table_size``, ``session_ttl_s``, :mod:`.affinity`).
- The choice counts at once: the request's slot is taken by the ledger as for every policy, and
  the prompt tokens the engine does not hold join its queued tokens (until its next KV event
  says how many wait). Routing predicts: the prompt's prefixes count as held by the chosen
  engine for ``cache_aware_prediction_ttl_s``, so a burst of siblings follows the first.
- A replica that just started routes no request with a key (prefix hashes, session or group)
  while it learns what the engines hold (``BlockIndex.learning``, :mod:`.kv_feed`): such
  requests wait, a heartbeat interval or so, then go where the engines' snapshots say.
- Engines that publish no KV events (no prefix cache, or an earlier release) are absent from
  the index: scored on load alone, never predicted. A request with no whole block of prompt,
  no session and no group, or one with no session and no group while no engine publishes KV
  events, is routed as ``least_loaded`` (with its batching slack).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Protocol

from service.coordinator.affinity import Homes
from service.coordinator.block_index import BlockIndex
from service.coordinator.pool import EngineGroup, EngineRecord
from service.coordinator.route_key import RouteKey, hashes_of, prefix_blocks
from service.ops.settings import Settings
from service.protocol.messages import SubmitEnvelope, SubmitRequest
from service.protocol.prefix import TOKENS_PER_BLOCK

# Holders read per prefix hash, and engines scored from the index, per request.
CANDIDATES = 4


class Fallback(Protocol):
    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None: ...

    def turn_ended(self) -> None: ...


class CacheAware:
    def __init__(self, fallback: Fallback, index: BlockIndex, settings: Settings) -> None:
        self._fallback = fallback
        self.index = index
        self._per_request = settings.cache_aware_request_tokens
        self._per_block = settings.cache_aware_prefix_weight * TOKENS_PER_BLOCK / settings.cache_aware_request_tokens
        self._factor = settings.cache_aware_load_factor
        self._slack = settings.cache_aware_load_slack
        self.sessions = Homes(settings.session_table_size, settings.session_ttl_s)
        self.groups = Homes(settings.session_table_size, settings.session_ttl_s)

    def key_of(self, submit: SubmitRequest | SubmitEnvelope) -> RouteKey | None:
        """None (routed on load alone, as ``least_loaded``) for a submission with no session and
        no group while no engine publishes KV events, its hashes uncomputed: they would steer
        nothing (a request still waiting when an engine starts publishing goes by load), or
        when its prompt has no whole block."""
        session_id, group_id = submit.session_id, submit.group_id
        if session_id is None and group_id is None:
            index = self.index
            if not index.engines and not index.learning:
                return None
            hashes = hashes_of(submit)
            return RouteKey(hashes) if hashes else None
        return RouteKey(hashes_of(submit), session_id, group_id)

    def load(self, record: EngineRecord) -> float:
        return len(record.requests) + record.queued_tokens / self._per_request

    def bound(self, group: EngineGroup) -> float:
        """The requests in flight past which an engine's affinity yields."""
        mean = group.requests / len(group)
        factor, slack = self._factor, self._slack
        return mean * factor if mean * factor > mean + slack else mean + slack

    def choose(self, group: EngineGroup, key: RouteKey | None = None) -> EngineRecord | None:
        index = self.index
        if key is None:
            return self._fallback.choose(group)  # nothing to be affine to: load alone
        if index.learning:
            return None  # a replica that just started: the engines' snapshots first
        session_id, group_id = key.session_id, key.group_id
        if not index.engines and session_id is None and group_id is None:
            return self._fallback.choose(group)
        least = group.least_loaded()
        if least is None:
            return None
        now = time.monotonic()
        bound = self.bound(group)
        chosen = None
        if session_id is not None:
            chosen = self._home(self.sessions.get(session_id, now), group, bound)
        if chosen is None and group_id is not None:
            chosen = self._home(self.groups.get(group_id, now), group, bound)
        held = -1  # blocks of the prompt the chosen engine holds; -1: not looked up yet
        if chosen is None:
            chosen, held = self._best(group, key.hashes, least, bound, now)
        if session_id is not None:
            self.sessions.set(session_id, chosen, now)
        if group_id is not None:
            self.groups.set(group_id, chosen, now)
        hashes = key.hashes
        if hashes:
            # The choice counts at once: the prompt joins the engine's queued tokens, less what
            # it holds, and its prefixes count as held there for the prediction's TTL (nothing
            # for an engine without KV events).
            engine = index.engines.get(chosen.engine_id)
            if engine is not None and engine.record is chosen:
                if held < 0:
                    held = index.held_blocks(engine, hashes, now)
                blocks = prefix_blocks(len(hashes) - 1, len(hashes))  # the prompt's, as far as its hashes tell
                if blocks > held:
                    chosen.queued_tokens += (blocks - held) * TOKENS_PER_BLOCK
                index.predict(engine, hashes, now)
        return chosen

    def _home(self, home: EngineRecord | None, group: EngineGroup, bound: float) -> EngineRecord | None:
        if home is None or not home.in_pool or home not in group:
            return None
        requests = len(home.requests)
        if requests >= home.capacity or requests > bound:
            return None
        return home

    def _best(
        self, group: EngineGroup, hashes: Sequence[int], least: EngineRecord, bound: float, now: float
    ) -> tuple[EngineRecord, int]:
        """The lowest score among the candidates, ties at random (one pass, each tie kept with
        the odds that leave every tied engine equally likely), and the blocks it holds."""
        per_request = self._per_request
        chosen, chosen_blocks, ties = least, 0, 1
        best = len(least.requests) + least.queued_tokens / per_request
        if hashes and self.index.engines:
            per_block = self._per_block
            model = group.model
            for engine, blocks in self.index.matches(hashes, now, CANDIDATES).items():
                record = engine.record
                requests = len(record.requests)
                if (
                    requests > bound
                    or requests >= record.capacity
                    or not record.in_pool
                    or (model is not None and record.model != model)
                ):
                    continue  # affinity yields (or the engine may not take it): scored on load alone, if drawn
                score = requests + record.queued_tokens / per_request - blocks * per_block
                if score < best:
                    chosen, chosen_blocks, best, ties = record, blocks, score, 1
                elif score == best:
                    ties += 1
                    if random.random() * ties < 1:
                        chosen, chosen_blocks = record, blocks
        if chosen_blocks == 0 and len(group) > 1:  # no holder won: two drawn at random, for load alone
            for record in group.sample_two():
                requests = len(record.requests)
                if record is least or requests >= record.capacity:
                    continue
                score = requests + record.queued_tokens / per_request
                if score < best:
                    chosen, chosen_blocks, best, ties = record, 0, score, 1
                elif score == best:
                    ties += 1
                    if random.random() * ties < 1:
                        chosen, chosen_blocks = record, 0
        return chosen, chosen_blocks

    def turn_ended(self) -> None:
        self._fallback.turn_ended()
