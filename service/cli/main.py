"""The ``dpcoord`` command line. Every setting is also a flag (``--nats-url`` for
``DPCOORD_NATS_URL``); flags win over the environment."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, get_args

import msgspec
from pydantic import ValidationError

from service.ops import event_loop, gc_tuning
from service.ops.settings import Settings
from service.protocol.subjects import Header

BENCHMARK_MODULE = "benchmarks.coordinator"
FLEET_BENCHMARK_MODULE = "benchmarks.fleet"  # dpcoord bench --simulated-engines N,...

CONTROL_COMMANDS: dict[str, Header] = {
    "pause": Header.PAUSE,
    "unpause": Header.UNPAUSE,
    "suspend": Header.SUSPEND,
    "resume": Header.RESUME,
    "stop": Header.STOP,
    "epoch": Header.SET_GENERATION_EPOCH,
    "profile-start": Header.START_CUDA_PROFILER,
    "profile-stop": Header.STOP_CUDA_PROFILER,
    "shutdown": Header.SHUTDOWN,
}


def _settings_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("settings (each also DPCOORD_<NAME> in the environment)")
    for name, field in Settings.model_fields.items():
        choices = get_args(field.annotation) if str(field.annotation).startswith("typing.Literal") else None
        group.add_argument(
            f"--{name.replace('_', '-')}", dest=f"setting_{name}", default=None, choices=choices,
            metavar=None if choices else name.upper(), help=f"{field.description} (default: {field.default})",
        )
    return parser


def build_parser() -> argparse.ArgumentParser:
    settings = _settings_parser()
    parser = argparse.ArgumentParser(prog="dpcoord", description="Data-parallel LLM inference coordinator on NATS")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("coordinator", parents=[settings], help="run a coordinator")
    engine = commands.add_parser("engine", parents=[settings], help="run one engine (data-parallel rank)")
    engine.add_argument("--model", default=None, help="local Hugging Face-format model directory (torch backend)")
    up = commands.add_parser("up", parents=[settings], help="run NATS (embedded unless --nats-url), a coordinator and engines")
    up.add_argument("--engines", type=int, default=2, help="number of engines (default 2)")
    up.add_argument("--model", default=None, help="local Hugging Face-format model directory (torch backend)")
    submit = commands.add_parser("submit", parents=[settings], help="submit a prompt and print the reply")
    submit.add_argument("prompt")
    submit.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    submit.add_argument("--max-tokens", type=int, default=None)
    submit.add_argument("--temperature", type=float, default=None)
    submit.add_argument("--top-k", type=int, default=None)
    submit.add_argument("--top-p", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    submit.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the reply")
    control = commands.add_parser("control", parents=[settings], help="send a control signal")
    control.add_argument("signal", choices=sorted(CONTROL_COMMANDS))
    control.add_argument("epoch", nargs="?", type=int, help="the epoch, for 'epoch'")
    control.add_argument("--timeout", type=float, default=30.0)
    bench = commands.add_parser(
        "bench", add_help=False,
        help="coordinator benchmark (from a source checkout): dpcoord against raw NATS baselines measured in one run; "
        "with --simulated-engines N,...: the fleet-size benchmark",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (dpcoord bench --help)")
    return parser


def _run_bench(argv: list[str]) -> int:
    """The benchmarks live in the source checkout, not in the images: load them only here.
    With ``--simulated-engines`` it is the fleet-size benchmark, else the coordinator benchmark."""
    fleet = any(arg.split("=", 1)[0] == "--simulated-engines" for arg in argv)
    module = FLEET_BENCHMARK_MODULE if fleet else BENCHMARK_MODULE
    try:
        benchmark = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise
        print(
            f"dpcoord bench: {module} is not installed here; run it from a source checkout "
            "(pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    args = benchmark.build_parser(prog="dpcoord bench").parse_args(argv)
    return int(benchmark.main(args))


def settings_from(args: argparse.Namespace) -> Settings:
    overrides = {
        key.removeprefix("setting_"): value
        for key, value in vars(args).items()
        if key.startswith("setting_") and value is not None
    }
    return Settings(**overrides)


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


async def _serve(start: Callable[[], Awaitable[None]], wait: Callable[[], Awaitable[None]],
                 request_stop: Callable[[], None], stop: Callable[[], Awaitable[None]]) -> None:
    """Run a service until it stops itself or SIGINT/SIGTERM asks it to."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop)
    await start()
    try:
        await wait()
    finally:
        await stop()


async def _run_coordinator(settings: Settings) -> int:
    from handlers import HANDLERS
    from service.coordinator.coordinator import Coordinator
    from service.coordinator.observability import coordinator_observability

    coordinator = Coordinator(settings, HANDLERS)
    observability = coordinator_observability(coordinator, settings.http_host, settings.http_port or None)

    gc_tuning.tune_for_throughput()

    async def start() -> None:
        await coordinator.start()
        await observability.start(coordinator.nc)

    async def stop() -> None:
        await observability.stop()
        await coordinator.stop()

    await _serve(start, coordinator.run_until_stopped, coordinator.request_stop, stop)
    return 0


async def _run_engine(settings: Settings, model: str | None) -> int:
    from engines.factory import make_backend
    from engines.observability import engine_observability
    from engines.runtime import EngineRuntime

    runtime = EngineRuntime(settings, make_backend(settings, model))
    observability = engine_observability(runtime, settings.http_host, settings.http_port or None)

    gc_tuning.tune_for_throughput()

    async def start() -> None:
        await runtime.start()
        await observability.start(runtime.nc)

    async def stop() -> None:
        await observability.stop()
        await runtime.stop()

    await _serve(start, runtime.run_until_stopped, runtime.request_stop, stop)
    return 0


def _print_json(message: msgspec.Struct) -> None:
    print(msgspec.json.encode(message).decode())


async def _submit(settings: Settings, args: argparse.Namespace) -> int:
    from service.client import DpcoordClient
    from service.protocol.messages import Partial

    sampling: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
        "top_p": args.top_p, "seed": args.seed, "stop": args.stop,
    }
    async with await DpcoordClient.connect(settings, timeout=args.timeout) as client:
        if not args.stream:
            _print_json(await client.submit(args.prompt, timeout=args.timeout, **sampling))
            return 0
        async for reply in client.stream(args.prompt, timeout=args.timeout, **sampling):
            if isinstance(reply, Partial):
                print(reply.text, end="", flush=True)
            else:
                print()
                _print_json(reply)
    return 0


async def _control(settings: Settings, args: argparse.Namespace) -> int:
    from service.client import DpcoordClient

    header = CONTROL_COMMANDS[args.signal]
    if header is Header.SET_GENERATION_EPOCH and args.epoch is None:
        raise SystemExit("dpcoord control epoch needs an integer: dpcoord control epoch 3")
    async with await DpcoordClient.connect(settings, timeout=args.timeout) as client:
        if header is Header.SHUTDOWN:
            _print_json(await client.shutdown(timeout=args.timeout))
        else:
            _print_json(await client.control(header, epoch=args.epoch, timeout=args.timeout))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark parses its own arguments, options included
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        print(f"dpcoord: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    _configure_logging(settings)
    from service.client import ClientError

    try:
        if args.command == "coordinator":
            return event_loop.run(_run_coordinator(settings), settings.event_loop)
        if args.command == "engine":
            return event_loop.run(_run_engine(settings, args.model), settings.event_loop)
        if args.command == "up":
            from service.cli.stack import run_stack

            return asyncio.run(run_stack(settings, args.engines, args.model))
        if args.command == "submit":
            return asyncio.run(_submit(settings, args))
        return asyncio.run(_control(settings, args))
    except ClientError as exc:
        print(f"dpcoord: error {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError) as exc:
        print(f"dpcoord: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
