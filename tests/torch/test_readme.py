"""The README's "First five minutes", run as written: `make up` in one terminal, the commands of
the second terminal in bash, and the `nats` CLI lines reproduced with nats-py (the same subjects
and bodies; `--replies 0 --wait-for-empty` reads until the empty message; `nats sub` subscribes, `nats pub`
publishes). The banner the README shows must be the one `dpcoord up` prints, ports apart."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from typing import Any

import nats

from tests.helpers import REPO_ROOT, decode_reply, new_shell_env, read_up_banner, request_stream

SECTION = "## First five minutes"
MAKE_UP = ".venv/bin/dpcoord up --engines 2"  # the Makefile's up recipe with its default ENGINES
DPCOORD = ".venv/bin/dpcoord"


def first_five_minutes() -> list[tuple[str, str]]:
    """The section's fenced blocks as (language, text)."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index(SECTION) :]
    section = section[: section.find("\n## ", len(SECTION))]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.DOTALL)


def commands(block: str) -> list[list[str]]:
    return [words for line in block.splitlines() if (words := shlex.split(line, comments=True))]


def without_ports(text: str) -> str:
    return re.sub(r"\d{4,5}", "PORT", text)


def replies(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"type":')]


async def nats_cli(url: str, lines: list[list[str]]) -> list[Any]:
    """Each `nats request SUBJECT BODY` line's reply; a list of replies for `--replies 0 --wait-for-empty`."""
    nc = await nats.connect(url)
    try:
        answered: list[Any] = []
        for words in lines:
            assert words[:2] == ["nats", "request"]
            subject, body, flags = words[2], words[3].encode(), words[4:]
            if flags == ["--replies", "0", "--wait-for-empty"]:
                answered.append(
                    [decode_reply(msg.data) if msg.data else {} for msg in await request_stream(nc, subject, body)]
                )
            else:
                assert flags == []
                answered.append(decode_reply((await nc.request(subject, body, timeout=30)).data))
        return answered
    finally:
        await nc.close()


async def nats_sub_pub(url: str, sub: list[str], pub: list[str]) -> list[dict[str, Any]]:
    """The replies `nats sub SUBJECT` prints after `nats pub SUBJECT BODY`, up to the final."""
    assert sub[:2] == ["nats", "sub"] and pub[:2] == ["nats", "pub"] and len(sub) == 3 and len(pub) == 4
    nc = await nats.connect(url)
    try:
        printed: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def print_reply(msg: Any) -> None:
            printed.put_nowait(decode_reply(msg.data) if msg.data else {})

        await nc.subscribe(sub[2], cb=print_reply)
        await nc.flush()
        await nc.publish(pub[2], pub[3].encode())
        got = [await asyncio.wait_for(printed.get(), 30)]
        while got[-1].get("type") != "final":
            got.append(await asyncio.wait_for(printed.get(), 30))
        return got
    finally:
        await nc.close()


def test_first_five_minutes_runs_as_written() -> None:
    blocks = first_five_minutes()
    assert [language for language, _ in blocks] == ["bash", "text", "bash", "bash", "bash", "bash"]
    (_, up_block), (_, shown_banner), (_, terminal_2), (_, nats_block), (_, sub_block), (_, pub_block) = blocks
    assert commands(up_block) == [["make", "up"]]
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "\nENGINES ?= 2\n" in makefile and "\t$(VENV)/bin/dpcoord up --engines $(ENGINES)" in makefile

    env = new_shell_env(os.environ)
    # A smaller KV cache than an idle laptop would size: this machine runs other tests too.
    up_env = env | {"DPCOORD_KV_CACHE_GB": "0.02", "DPCOORD_MAX_CONTEXT": "256"}
    stack = subprocess.Popen(
        [sys.executable, "-m", "service", *shlex.split(MAKE_UP)[1:]],
        env=up_env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert stack.stdout is not None
        banner = "".join(read_up_banner(stack.stdout))
        submit_line = next(line for line in banner.splitlines() if line.startswith("Submit: "))
        dpcoord = submit_line.removeprefix("Submit: ").split(" submit ")[0]
        assert without_ports(banner.replace(dpcoord, DPCOORD)) == without_ports(shown_banner)
        url = next(line.split()[1] for line in banner.splitlines() if line.startswith("NATS:"))
        shown_url = next(line.split()[1] for line in shown_banner.splitlines() if line.startswith("NATS:"))

        script = terminal_2.replace(shown_url, url).replace(DPCOORD, dpcoord)
        ran = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert ran.returncode == 0, ran.stderr
        answers = replies(ran.stdout)
        finals = [reply for reply in answers if reply["type"] == "final"]
        assert [len(final["generated_tokens"]) for final in finals] == [16, 16, 4]
        assert [reply["state"] for reply in answers if reply["type"] == "ack"] == ["paused", "running"]

        lines = commands(nats_block)
        assert lines[0] == ["export", "NATS_URL=$DPCOORD_NATS_URL"]
        final, stream, paused, running = asyncio.run(nats_cli(url, lines[1:]))
        assert final["type"] == "final" and len(final["generated_tokens"]) == 16
        assert stream[-1] == {} and stream[-2]["type"] == "final"
        assert {reply["type"] for reply in stream[:-2]} == {"partial"}
        assert (paused["state"], running["state"]) == ("paused", "running")

        [sub], [pub] = commands(sub_block), commands(pub_block)
        printed = asyncio.run(nats_sub_pub(url, sub, pub))
        assert printed[-1]["type"] == "final" and len(printed) > 1
        assert {reply["type"] for reply in printed[:-1]} == {"partial"}
    finally:
        stack.send_signal(signal.SIGINT)
        assert stack.wait(timeout=30) == 0
