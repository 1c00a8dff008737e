"""The ``dpcoord`` command line. Every setting is also a flag (``--nats-url`` for
``DPCOORD_NATS_URL``) of the commands that use it, and ``--help`` lists only those; flags win
over the environment, which every command reads in full."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import get_args

from pydantic import ValidationError

from service.cli import fleet_commands
from service.cli.fleet_commands import CONTROL_COMMANDS, CommandFailed
from service.ops import event_loop, gc_tuning
from service.ops.setting_groups import SettingGroup, group_of
from service.ops.settings import Settings, settings_in

log = logging.getLogger(__name__)

BENCHMARK_MODULE = "benchmarks.coordinator"
GATEWAY_BENCHMARK_MODULE = "benchmarks.gateway"  # dpcoord bench --gateway
# Settings of the coordinator's group that the gateway reads too: its body limit and deadline.
GATEWAY_SHARED_SETTINGS = ("max_payload_bytes", "request_timeout_s")
FLEET_BENCHMARK_MODULE = "benchmarks.fleet"  # dpcoord bench --simulated-engines N,...
INSTRUCTIONS_BENCHMARK_MODULE = "benchmarks.instructions"  # dpcoord bench --instructions


def _settings_parser(*groups: SettingGroup, shared: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The settings read by ``groups`` as flags, one help section per group; ``shared`` names
    settings of other groups this command reads too."""
    parser = argparse.ArgumentParser(add_help=False)
    sections = {
        group: parser.add_argument_group(
            f"settings: {group}",
            None if index else "each also DPCOORD_<NAME> in the environment, where every command reads all of them",
        )
        for index, group in enumerate(groups)
    }
    fields = settings_in(groups) | {name: Settings.model_fields[name] for name in shared}
    for name, field in fields.items():
        choices = get_args(field.annotation) if str(field.annotation).startswith("typing.Literal") else None
        group = group_of(field)
        if group not in sections:
            sections[group] = parser.add_argument_group(f"settings: {group}")
        sections[group].add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"setting_{name}",
            default=None,
            choices=choices,
            metavar=None if choices else name.upper(),
            help=f"{field.description} (default: {field.default})",
        )
    return parser


UP_DESCRIPTION = """\
Runs NATS, one coordinator and --engines engines on this machine, prints how to reach them once
every engine has registered, and stops them all on Ctrl-C.

NATS: an embedded nats-server on a free port, unless --nats-url (DPCOORD_NATS_URL) points at an
existing server, for example --nats-url nats://nats.example:4222 (its auth and TLS settings below).

Engines: the torch backend runs the model in --model, a local Hugging Face-format directory
(config.json, *.safetensors, tokenizer.json); without --model, a seeded random 3 M-parameter
model whose output is noise. --backend echo runs the protocol test double instead.

Logs: every process logs to this command's stderr (dpcoord up 2> up.log keeps them in a file);
the banner goes to stdout, once every part serves (the gateway included).

Exit: 0 after Ctrl-C or SIGTERM, or when a part was asked to stop (dpcoord control stop after a
pause, dpcoord control shutdown); 1 when a part fails, named with its last log lines.
"""


def build_parser() -> argparse.ArgumentParser:
    settings = _settings_parser(*SettingGroup)
    client_settings = _settings_parser(SettingGroup.NATS)
    coordinator_settings = _settings_parser(SettingGroup.NATS, SettingGroup.SERVICE, SettingGroup.COORDINATOR)
    engine_settings = _settings_parser(SettingGroup.NATS, SettingGroup.SERVICE, SettingGroup.ENGINE, SettingGroup.TORCH)
    parser = argparse.ArgumentParser(prog="dpcoord", description="Data-parallel LLM inference coordinator on NATS")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("coordinator", parents=[coordinator_settings], help="run a coordinator")
    engine = commands.add_parser("engine", parents=[engine_settings], help="run one engine (data-parallel rank)")
    engine.add_argument("--model", default=None, help="local Hugging Face-format model directory (torch backend)")
    up = commands.add_parser(
        "up",
        parents=[settings],
        help="run NATS (embedded unless --nats-url), a coordinator and engines",
        description=UP_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--engines", type=int, default=2, help="number of engines (default 2)")
    up.add_argument("--model", default=None, help="local Hugging Face-format model directory (torch backend)")
    up.add_argument("--no-gateway", action="store_true", help="do not start the OpenAI-compatible HTTP gateway")
    gateway_settings = _settings_parser(
        SettingGroup.NATS, SettingGroup.SERVICE, SettingGroup.GATEWAY, shared=GATEWAY_SHARED_SETTINGS
    )
    gateway = commands.add_parser("gateway", parents=[gateway_settings], help="run the OpenAI-compatible HTTP gateway")
    gateway.add_argument(
        "--workers",
        dest="setting_gateway_workers",
        default=None,
        metavar="N",
        help="gateway processes sharing the port through SO_REUSEPORT (the same as --gateway-workers)",
    )
    gateway.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key clients must send as 'Authorization: Bearer KEY' (repeatable; see also --gateway-api-key-file)",
    )
    submit = commands.add_parser("submit", parents=[client_settings], help="submit a prompt and print the reply")
    submit.add_argument("prompt")
    submit.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    submit.add_argument(
        "--raw",
        action="store_true",
        help="write the generated text as it is; without it a terminal gets control and other non-printable "
        "characters as \\uXXXX escapes (pipes always get the raw text)",
    )
    submit.add_argument("--max-tokens", type=int, default=None)
    submit.add_argument("--temperature", type=float, default=None)
    submit.add_argument("--top-k", type=int, default=None)
    submit.add_argument("--top-p", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    submit.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="each generated token's log-probability and its K most likely alternatives (0 to 20)",
    )
    submit.add_argument("--prompt-logprobs", type=int, default=None, metavar="K", help="the same for the prompt")
    submit.add_argument(
        "--logprobs-mode",
        choices=["raw", "processed"],
        default=None,
        help="of the model (raw, the default) "
        "or of the distribution sampled from (processed: after temperature, top-k and top-p)",
    )
    submit.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the reply (default 60); reaching NATS has --nats-connect-timeout-s",
    )
    control = commands.add_parser("control", parents=[client_settings], help="send a control signal")
    control.add_argument("signal", choices=sorted(CONTROL_COMMANDS))
    control.add_argument(
        "epoch",
        nargs="?",
        metavar="EPOCH|PATH",
        help="the epoch, for 'epoch'; the checkpoint directory, for 'update-weights'",
    )
    control.add_argument("--version", dest="weight_version", help="the weights' version, for 'update-weights'")
    control.add_argument("--mode", choices=["keep", "abort", "drain"], help="what 'pause' does to requests in flight")
    control.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the answer; default: as long as the coordinator may take, by its limits "
        "in this environment (DPCOORD_CONTROL_TIMEOUT_S; DPCOORD_LONG_CONTROL_TIMEOUT_S for a drain pause "
        "and update-weights) plus 10 s, at least 30 s; reaching NATS has --nats-connect-timeout-s",
    )
    bench = commands.add_parser(
        "bench",
        add_help=False,
        help="coordinator benchmark (from a source checkout): dpcoord against raw NATS baselines measured in one run; "
        "with --simulated-engines N,...: the fleet-size benchmark; with --instructions [--baseline REV]: the "
        "coordinator's instructions per request under callgrind",
    )
    bench.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (dpcoord bench --help)"
    )
    return parser


def _run_bench(argv: list[str]) -> int:
    """The benchmarks live in the source checkout, not in the images: load them only here.
    ``--gateway`` runs the gateway benchmark, ``--simulated-engines`` the fleet-size benchmark,
    ``--instructions`` the coordinator's instruction count, and anything else the coordinator
    benchmark."""
    if "--gateway" in argv:
        module = GATEWAY_BENCHMARK_MODULE
    elif "--instructions" in argv:
        module = INSTRUCTIONS_BENCHMARK_MODULE
    elif any(arg.split("=", 1)[0] == "--simulated-engines" for arg in argv):
        module = FLEET_BENCHMARK_MODULE
    else:
        module = BENCHMARK_MODULE
    argv = [arg for arg in argv if arg not in ("--gateway", "--instructions")]
    try:
        benchmark = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise
        print(
            f"dpcoord bench: {module} is not installed here; run it from a source checkout (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    prog = {
        GATEWAY_BENCHMARK_MODULE: "dpcoord bench --gateway",
        INSTRUCTIONS_BENCHMARK_MODULE: "dpcoord bench --instructions",
    }.get(module, "dpcoord bench")
    parser = benchmark.build_parser(prog=prog)
    if module == BENCHMARK_MODULE:
        _name_other_benchmarks(parser)
    return int(benchmark.main(parser.parse_args(argv)))


def _name_other_benchmarks(parser: argparse.ArgumentParser) -> None:
    """List, in the coordinator benchmark's ``--help``, the options that run another benchmark
    instead (``_run_bench`` routes them before this parser sees them)."""
    others = parser.add_argument_group(
        "other benchmarks", "each runs instead of this one, with options of its own: dpcoord bench --gateway --help"
    )
    others.add_argument(
        "--gateway", action="store_true", help="OpenAI HTTP requests through dpcoord gateway against the client library"
    )
    others.add_argument(
        "--simulated-engines",
        metavar="N,N,...",
        help="the fleet-size benchmark: the coordinator with N simulated engines, for each N",
    )
    others.add_argument(
        "--instructions",
        action="store_true",
        help="the coordinator's instructions per request under callgrind (--baseline REV compares a revision)",
    )


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


async def _serve(
    name: str,
    start: Callable[[], Awaitable[None]],
    wait: Callable[[], Awaitable[None]],
    request_stop: Callable[[], None],
    stop: Callable[[], Awaitable[None]],
) -> None:
    """Run a service until it stops itself or SIGINT/SIGTERM asks it to (logged: what follows is
    its way out)."""
    loop = asyncio.get_running_loop()

    def signalled(signum: signal.Signals) -> None:
        log.info("%s stopping on %s", name, signum.name)
        request_stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signalled, signum)
    await start()
    try:
        await wait()
    finally:
        await stop()


async def _run_coordinator(settings: Settings) -> int:
    from handlers import HANDLERS
    from service.coordinator.coordinator import Coordinator
    from service.coordinator.observability import coordinator_observability
    from service.coordinator.shared_state import ReplicaConflict

    coordinator = Coordinator(settings, HANDLERS)
    observability = coordinator_observability(
        coordinator, settings.http_host, settings.http_port or None, "http_port" in settings.model_fields_set
    )

    gc_tuning.tune_for_throughput()

    async def start() -> None:
        await observability.bind()
        await coordinator.start()
        await observability.start(coordinator.nc)

    async def stop() -> None:
        await observability.stop()
        await coordinator.stop()

    try:
        await _serve("coordinator", start, coordinator.run_until_stopped, coordinator.request_stop, stop)
    except ReplicaConflict as exc:
        print(f"dpcoord: {exc}", file=sys.stderr)
        return 1
    return 0 if coordinator.failure is None else 1


async def _run_engine(settings: Settings, model: str | None) -> int:
    from engines.factory import make_backend
    from engines.observability import engine_observability
    from engines.runtime import EngineRuntime

    runtime = EngineRuntime(settings, make_backend(settings, model))
    observability = engine_observability(
        runtime, settings.http_host, settings.http_port or None, "http_port" in settings.model_fields_set
    )

    gc_tuning.tune_for_throughput()

    async def start() -> None:
        await observability.bind()
        await runtime.start()
        await observability.start(runtime.nc)

    async def stop() -> None:
        await observability.stop()
        await runtime.stop()

    await _serve("engine", start, runtime.run_until_stopped, runtime.request_stop, stop)
    return 0


async def _run_gateway(settings: Settings, api_keys: list[str]) -> int:
    from service.gateway.auth import ApiKeys
    from service.gateway.server import serve

    try:
        keys = ApiKeys.load(api_keys, settings.gateway_api_key_file)
    except ValueError as exc:
        print(f"dpcoord gateway: {exc}", file=sys.stderr)
        return 2
    return await serve(settings, keys)


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
    from service.bus.connection import NatsUnreachable
    from service.client import ClientError

    try:
        if args.command == "coordinator":
            return event_loop.run(_run_coordinator(settings), settings.event_loop)
        if args.command == "engine":
            return event_loop.run(_run_engine(settings, args.model), settings.event_loop)
        if args.command == "gateway":
            return event_loop.run(_run_gateway(settings, args.api_key), settings.event_loop)
        if args.command == "up":
            from service.cli.stack import run_stack

            return asyncio.run(run_stack(settings, args.engines, args.model, gateway=not args.no_gateway))
        if args.command == "submit":
            return asyncio.run(fleet_commands.submit(settings, args))
        return asyncio.run(fleet_commands.control(settings, args))
    except ClientError as exc:
        print(f"dpcoord: error {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except (CommandFailed, NatsUnreachable, TimeoutError) as exc:
        print(f"dpcoord {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"dpcoord {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.command == "control":
            print(
                f"dpcoord control: interrupted; a {args.signal} already sent may still be taking effect",
                file=sys.stderr,
            )
        return 130
