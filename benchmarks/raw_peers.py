"""Plain nats-py peers with no dpcoord logic: the baselines the coordinator is measured against.

Each role is its own process, as the coordinator and the engines are:

- ``echo``: answers every request on ``<prefix>.raw.echo`` with a canned body (the 2-hop
  request-reply limit, and the "engine" behind the relay);
- ``relay``: the 4-hop shape of a coordinator with no logic. It re-publishes each request on
  ``<prefix>.raw.relay`` to the echo with its own inbox and maps the answer back to the client;
- ``stream_source``: for each request on ``<prefix>.raw.stream`` it publishes ``--tokens``
  partial bodies, one final body and one empty message, one message each, towards the client
  through the one-way relay (the client's inbox travels as the reply subject);
- ``stream_relay``: the one-way relay: re-publishes each message to its reply subject.

Run: ``python -m benchmarks.raw_peers ROLE --nats-url URL --prefix P``; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from service.ops.event_loop import run


class Subjects:
    def __init__(self, prefix: str) -> None:
        self.echo = f"{prefix}.raw.echo"
        self.relay = f"{prefix}.raw.relay"
        self.relay_inbox = f"{prefix}.raw.relay_inbox"
        self.stream = f"{prefix}.raw.stream"
        self.stream_relay = f"{prefix}.raw.stream_relay"


async def serve_echo(nc: NATS, subjects: Subjects, args: argparse.Namespace) -> None:
    answer = b"x" * args.reply_bytes

    async def on_request(msg: Msg) -> None:
        await nc.publish(msg.reply, answer)

    await nc.subscribe(subjects.echo, cb=on_request)


async def serve_relay(nc: NATS, subjects: Subjects, args: argparse.Namespace) -> None:
    waiting: dict[str, str] = {}
    ids = itertools.count()
    inbox_prefix = f"{subjects.relay_inbox}."

    async def on_request(msg: Msg) -> None:
        token = str(next(ids))
        waiting[token] = msg.reply
        await nc.publish(subjects.echo, msg.data, reply=inbox_prefix + token)

    async def on_answer(msg: Msg) -> None:
        reply = waiting.pop(msg.subject[len(inbox_prefix) :], None)
        if reply is not None:
            await nc.publish(reply, msg.data)

    await nc.subscribe(inbox_prefix + "*", cb=on_answer)
    await nc.subscribe(subjects.relay, cb=on_request)


async def serve_stream_source(nc: NATS, subjects: Subjects, args: argparse.Namespace) -> None:
    partial = b"p" * args.partial_bytes
    final = b"f" * args.reply_bytes

    async def on_request(msg: Msg) -> None:
        for _ in range(args.tokens):
            await nc.publish(subjects.stream_relay, partial, reply=msg.reply)
        await nc.publish(subjects.stream_relay, final, reply=msg.reply)
        await nc.publish(subjects.stream_relay, b"", reply=msg.reply)

    await nc.subscribe(subjects.stream, cb=on_request)


async def serve_stream_relay(nc: NATS, subjects: Subjects, args: argparse.Namespace) -> None:
    async def on_message(msg: Msg) -> None:
        await nc.publish(msg.reply, msg.data)

    await nc.subscribe(subjects.stream_relay, cb=on_message)


ROLES = {
    "echo": serve_echo,
    "relay": serve_relay,
    "stream_source": serve_stream_source,
    "stream_relay": serve_stream_relay,
}


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    nc = await nats.connect(args.nats_url, name=f"bench-raw-{args.role}")
    await ROLES[args.role](nc, Subjects(args.prefix), args)
    await nc.flush()
    await stop.wait()
    await nc.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.raw_peers")
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--reply-bytes", type=int, default=128, help="size of the echo's answer and the stream's final")
    parser.add_argument("--partial-bytes", type=int, default=96, help="size of one streamed partial")
    parser.add_argument("--tokens", type=int, default=64, help="partials per streamed request")
    parser.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    run(main(arguments), arguments.event_loop)
