"""A Dockerfile read as the image builder reads it, for the steps the rehearsal replays.

Only what an image's Python environment and its process start depend on is kept: each stage's
base image, ``WORKDIR``, ``ENV``, the ``COPY`` of files from the build context, the ``RUN``
commands split at ``&&``, and the final stage's ``USER``, ``ENTRYPOINT`` and ``CMD``. An
instruction this module does not know fails loudly, so a Dockerfile that grows one is seen.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

# Instructions that change nothing the rehearsal replays.
_IGNORED = {"EXPOSE", "LABEL", "HEALTHCHECK", "STOPSIGNAL", "SHELL", "VOLUME", "ONBUILD", "MAINTAINER"}


@dataclass(frozen=True)
class Copy:
    """``COPY sources dest`` from the build context (``from_stage`` None) or from another stage."""

    sources: tuple[str, ...]
    dest: str  # as written: relative to ``workdir``; a trailing / names a folder
    workdir: PurePosixPath
    from_stage: str | None

    @property
    def target(self) -> PurePosixPath:
        return self.workdir / self.dest


@dataclass(frozen=True)
class Run:
    """One command of a ``RUN`` line (the line split at ``&&``), with the stage's state when it runs."""

    argv: tuple[str, ...]
    workdir: PurePosixPath
    env: dict[str, str]


@dataclass
class Stage:
    base: str
    name: str | None
    workdir: PurePosixPath = PurePosixPath("/")
    env: dict[str, str] = field(default_factory=dict)
    steps: list[Copy | Run] = field(default_factory=list)
    user: str | None = None
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        [found] = [stage for stage in self.stages if stage.name == name]
        return found


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line]


def _exec_form(arguments: str) -> list[str]:
    """ENTRYPOINT/CMD: the JSON form as written, the shell form as ``/bin/sh -c``."""
    if arguments.lstrip().startswith("["):
        return list(json.loads(arguments))
    return ["/bin/sh", "-c", arguments]


def _expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced where known; others (the base image's ``$PATH``) kept for later."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def _env_pairs(arguments: str, variables: dict[str, str]) -> dict[str, str]:
    words = shlex.split(arguments)
    if "=" not in words[0]:
        return {words[0]: _expand(" ".join(words[1:]), variables)}  # the legacy ``ENV NAME value`` form
    pairs: dict[str, str] = {}
    for word in words:
        name, _, value = word.partition("=")
        pairs[name] = _expand(value, variables | pairs)
    return pairs


def _commands(arguments: str) -> list[tuple[str, ...]]:
    """A shell-form RUN split at ``&&`` into argument vectors."""
    commands: list[tuple[str, ...]] = []
    current: list[str] = []
    for word in [*shlex.split(arguments), "&&"]:
        if word == "&&":
            if current:
                commands.append(tuple(current))
            current = []
        elif word in (";", "||", "|"):
            raise ValueError(f"RUN {arguments!r}: only commands joined by && are replayed")
        else:
            current.append(word)
    return commands


def parse(path: Path) -> Dockerfile:
    build_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction, arguments in instructions(path.read_text()):
        if instruction == "ARG":
            name, _, default = arguments.partition("=")
            build_args.setdefault(name.strip(), default.strip())
            continue
        if instruction == "FROM":
            words = _expand(arguments, build_args).split()
            stages.append(Stage(base=words[0], name=words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
            continue
        stage = stages[-1]
        if instruction == "WORKDIR":
            stage.workdir = stage.workdir / _expand(arguments, stage.env)
        elif instruction == "ENV":
            stage.env.update(_env_pairs(arguments, stage.env))
        elif instruction == "COPY":
            words = arguments.split()
            options = [word for word in words if word.startswith("--")]
            *sources, dest = [word for word in words if not word.startswith("--")]
            from_stage = next((option.split("=", 1)[1] for option in options if option.startswith("--from=")), None)
            stage.steps.append(Copy(tuple(sources), dest, stage.workdir, from_stage))
        elif instruction == "RUN":
            for argv in _commands(arguments):
                stage.steps.append(Run(argv, stage.workdir, dict(stage.env)))
        elif instruction == "USER":
            stage.user = arguments.strip()
        elif instruction == "ENTRYPOINT":
            stage.entrypoint = _exec_form(arguments)
        elif instruction == "CMD":
            stage.cmd = _exec_form(arguments)
        elif instruction not in _IGNORED:
            raise ValueError(f"{path.name}: {instruction} is not replayed by tests/rehearsal/dockerfile.py")
    return Dockerfile(path, stages)


def pip_install_targets(run: Run) -> list[str] | None:
    """What a ``pip install`` command installs (its non-option arguments); None for other commands."""
    argv = list(run.argv)
    if PurePosixPath(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "pip"]:
        argv = ["pip", *argv[3:]]
    if not PurePosixPath(argv[0]).name.startswith("pip") or "install" not in argv:
        return None
    return [word for word in argv[argv.index("install") + 1 :] if not word.startswith("-")]
