"""The echo backend's simulated prefix cache: it holds the prefixes of the last prompts it
"prefilled", so echo fleets publish KV events as engines with a prefix cache do
(docs/protocol.md, *KV events*) and cache-aware routing can be tested without a model.

Contract: :meth:`SimulatedPrefixCache.prefilled` puts a prompt (its prefixes) first in line,
and the least recently prefilled beyond ``prompts`` leaves, its prefixes with it unless a
prompt still cached shares them. :meth:`served_tokens` is the part of a prompt the cache would
serve: the tokens of its longest prefix held (a prefix that names no token count, a text or chat
prompt's, serves the whole prompt, as the torch backend counts it). :meth:`drain` says which
prefixes it began and stopped holding since it was last drained, comparing each with its state
then, so a prefix that came and went in between is not reported at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engines.backend import PromptPrefix


class SimulatedPrefixCache:
    def __init__(self, prompts: int) -> None:
        if prompts < 1:
            raise ValueError(f"the simulated prefix cache holds at least one prompt, not {prompts}")
        self._capacity = prompts
        self._prompts: OrderedDict[int, Sequence[PromptPrefix]] = OrderedDict()  # by longest hash, oldest first
        self._holders: dict[int, int] = {}  # prefix hash -> prompts cached that have it
        self._blocks: dict[int, int] = {}  # prefix hash -> its length in blocks, while held
        self._before: dict[int, bool] = {}  # prefix hash -> whether it was held at the last drain

    def __len__(self) -> int:
        return len(self._prompts)

    def held(self, prefix_hash: int) -> bool:
        return prefix_hash in self._holders

    def prefilled(self, prefixes: Sequence[PromptPrefix]) -> None:
        if not prefixes:
            return
        key = prefixes[-1].prefix_hash
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return
        self._prompts[key] = prefixes
        for prefix in prefixes:
            self._take(prefix)
        while len(self._prompts) > self._capacity:
            _, oldest = self._prompts.popitem(last=False)
            for prefix in oldest:
                self._drop(prefix.prefix_hash)

    def served_tokens(self, prefixes: Sequence[PromptPrefix], prompt_tokens: int) -> int:
        for prefix in reversed(prefixes):
            if prefix.prefix_hash in self._holders:
                return prompt_tokens if prefix.tokens is None else min(prefix.tokens, prompt_tokens)
        return 0

    def drain(self) -> tuple[list[tuple[int, int]], list[int]]:
        """``(stored, evicted)`` since the last drain: ``stored`` as ``(prefix_hash, blocks)``."""
        stored: list[tuple[int, int]] = []
        evicted: list[int] = []
        holders, blocks = self._holders, self._blocks
        for prefix_hash, was_held in self._before.items():
            if prefix_hash in holders and not was_held:
                stored.append((prefix_hash, blocks[prefix_hash]))
            elif was_held and prefix_hash not in holders:
                evicted.append(prefix_hash)
        self._before.clear()
        return stored, evicted

    def _take(self, prefix: PromptPrefix) -> None:
        prefix_hash = prefix.prefix_hash
        count = self._holders.get(prefix_hash, 0)
        if count == 0:
            self._before.setdefault(prefix_hash, False)
            self._blocks[prefix_hash] = prefix.blocks
        self._holders[prefix_hash] = count + 1

    def _drop(self, prefix_hash: int) -> None:
        count = self._holders[prefix_hash] - 1
        if count:
            self._holders[prefix_hash] = count
            return
        self._before.setdefault(prefix_hash, True)
        del self._holders[prefix_hash]
        del self._blocks[prefix_hash]
