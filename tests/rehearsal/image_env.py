"""An image's Python environment, installed as its Dockerfile installs it, without Docker.

The build context is what ``.dockerignore`` lets through (docker-py's own matcher reads it).
Each stage's ``COPY`` from the context lands in a folder standing for the image's filesystem
(container path ``/x`` is ``root/x``), and its ``RUN`` commands are replayed there: ``python
-m venv`` and ``pip install`` with their arguments as written; anything else must be one of
``overrides.SKIPPED_COMMANDS``. A bare ``python``/``pip`` is the base image's interpreter: a
venv at ``root/base-python``, seeing ``overrides.BASE_IMAGE_PACKAGES`` through a .pth file.

Environments are cached by a hash of everything that goes into them (the Dockerfile, the
copied files, the overrides, this Python's version) under ``cache_root()``, built under a lock
so that parallel runs share one. A fresh clone builds them (pip reaches PyPI) and later runs
reuse them until a copied file changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from docker.utils.build import exclude_paths

from tests.rehearsal import overrides
from tests.rehearsal.dockerfile import Copy, Dockerfile, Run, Stage, parse, pip_install_targets

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = PurePosixPath("/base-python")
_COMPLETE = ".complete"
_UNUSED_FOR_S = 2 * 24 * 3600  # cached environments untouched this long are removed
_HOST_ENV_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


def cache_root() -> Path:
    """``$DPCOORD_REHEARSAL_CACHE``, else a folder in the system's temporary directory."""
    return Path(os.environ.get("DPCOORD_REHEARSAL_CACHE") or Path(tempfile.gettempdir()) / "dpcoord-rehearsal")


@dataclass(frozen=True)
class ImageEnvironment:
    """An image's filesystem, as far as its Python environment goes."""

    dockerfile: Dockerfile
    root: Path
    build_log: str

    def host_path(self, container_path: str | PurePosixPath) -> Path:
        return self.root / PurePosixPath(container_path).relative_to("/")

    @property
    def base_path(self) -> str:
        """The base image's PATH: its interpreter first, then this machine's system folders."""
        return f"{self.host_path(BASE_PYTHON / 'bin')}:/usr/local/bin:/usr/bin:/bin"

    def process_env(self) -> dict[str, str]:
        """The final stage's ENV, its PATH folders mapped into ``root``."""
        env = dict(self.dockerfile.final.env)
        path = env.get("PATH", "$PATH").replace("$PATH", self.base_path).replace("${PATH}", self.base_path)
        env["PATH"] = ":".join(
            str(self.host_path(part)) if part.startswith("/") and self.host_path(part).exists() else part
            for part in path.split(":")
        )
        return env

    def python(self) -> Path:
        """The interpreter that runs the image's ENTRYPOINT: the script's own shebang."""
        script = shutil.which(self.dockerfile.final.entrypoint[0], path=self.process_env()["PATH"])
        assert script is not None, f"{self.dockerfile.final.entrypoint[0]} is not on the image's PATH"
        shebang = Path(script).read_text().splitlines()[0]
        return Path(shebang.removeprefix("#!").strip())


def context_files(dockerfile: Path) -> list[str]:
    """The build context's files (relative, POSIX), as ``.dockerignore`` leaves it."""
    ignore = ROOT / ".dockerignore"
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    included = exclude_paths(str(ROOT), patterns, dockerfile=str(dockerfile.resolve().relative_to(ROOT)))
    return sorted(path for path in included if (ROOT / path).is_file())


def _copied_files(stage: Stage, step: Copy, context: list[str]) -> Iterator[tuple[str, PurePosixPath]]:
    """``(context file, container path)`` for one COPY from the build context."""
    folder_target = step.dest.endswith("/") or len(step.sources) > 1
    for source in step.sources:
        source = source.rstrip("/").removeprefix("./")
        if source in context:
            yield source, (step.target / PurePosixPath(source).name if folder_target else step.target)
            continue
        inside = [path for path in context if path.startswith(f"{source}/")]
        assert inside, (
            f"{stage.name or stage.base}: COPY {source}: not in the build context (missing, or .dockerignore'd)"
        )
        for path in inside:
            yield path, step.target / PurePosixPath(path).relative_to(source)


def _base_packages(stage: Stage) -> tuple[str, ...]:
    repository = stage.base.rsplit(":", 1)[0]
    return overrides.BASE_IMAGE_PACKAGES.get(repository, ())


def _content_key(dockerfile: Dockerfile, copies: list[tuple[str, PurePosixPath]]) -> str:
    digest = hashlib.sha256()
    digest.update(dockerfile.path.read_bytes())
    digest.update(Path(overrides.__file__).read_bytes())
    digest.update(Path(__file__).read_bytes())
    digest.update(sys.version.encode())
    for source, target in copies:
        digest.update(f"\0{source}\0{target}\0".encode())
        digest.update((ROOT / source).read_bytes())
    return digest.hexdigest()[:16]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prune(folder: Path, keep: Path) -> None:
    """Remove cached environments nobody used for a while (never the one in use)."""
    for entry in folder.iterdir():
        marker = entry / _COMPLETE
        if entry != keep and marker.exists() and time.time() - marker.stat().st_mtime > _UNUSED_FOR_S:
            shutil.rmtree(entry, ignore_errors=True)


class _Builder:
    """Replays one Dockerfile's COPY and RUN steps under ``root``."""

    def __init__(self, dockerfile: Dockerfile, root: Path) -> None:
        self.dockerfile = dockerfile
        self.root = root
        self.log: list[str] = []

    def host(self, container_path: PurePosixPath) -> Path:
        return self.root / container_path.relative_to("/")

    def run_env(self, run: Run) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in _HOST_ENV_DROPPED}
        env |= run.env
        env["PATH"] = f"{self.host(BASE_PYTHON / 'bin')}:{os.environ['PATH']}"
        return env

    def base_python(self, stage: Stage, with_pip: bool) -> Path:
        """The base image's interpreter (a venv, made on first use), seeing the base image's packages."""
        venv = self.host(BASE_PYTHON)
        if not venv.exists():
            self.call([sys.executable, "-m", "venv", "--without-pip", str(venv)], self.root, dict(os.environ))
            packages = _base_packages(stage)
            if packages:
                [site] = venv.glob("lib/python*/site-packages")
                (site / "base-image-packages.pth").write_text(f"{base_layer(packages)}\n")
        if with_pip and not (venv / "bin" / "pip").exists():
            self.call([str(venv / "bin" / "python"), "-m", "ensurepip", "--default-pip"], self.root, dict(os.environ))
        return venv / "bin" / "python"

    def call(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.log.append(f"$ {' '.join(argv)}  (in {cwd})")
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        self.log.append(result.stdout[-4000:] + result.stderr[-4000:])
        if result.returncode != 0:
            raise RuntimeError(f"{self.dockerfile.path.name}: {' '.join(argv)} failed:\n{result.stderr[-4000:]}")

    def replay(self, stage: Stage, run: Run) -> None:
        if any(skip.matches(run.argv) for skip in overrides.SKIPPED_COMMANDS):
            self.log.append(f"skipped (tests/rehearsal/overrides.py): {' '.join(run.argv)}")
            return
        if pip_install_targets(run) is None and list(run.argv[1:3]) != ["-m", "venv"]:
            raise AssertionError(
                f"{self.dockerfile.path.name}: RUN {' '.join(run.argv)} is neither a venv nor pip; "
                "replay it in tests/rehearsal/image_env.py or skip it in tests/rehearsal/overrides.py"
            )
        program, *arguments = run.argv
        argv = [str(self.host(PurePosixPath(word))) if word.startswith("/") else word for word in arguments]
        if program.startswith("/"):
            argv.insert(0, str(self.host(PurePosixPath(program))))
        elif program in ("python", "python3"):
            argv.insert(0, str(self.base_python(stage, with_pip=argv[:2] == ["-m", "pip"])))
        elif program in ("pip", "pip3"):
            argv[:0] = [str(self.base_python(stage, with_pip=True)), "-m", "pip"]
        else:
            raise AssertionError(f"{self.dockerfile.path.name}: no interpreter for RUN {' '.join(run.argv)}")
        workdir = self.host(run.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.call(argv, workdir, self.run_env(run))

    def build(self, copies: dict[tuple[int, int], list[tuple[str, PurePosixPath]]]) -> None:
        for stage_index, stage in enumerate(self.dockerfile.stages):
            for step_index, step in enumerate(stage.steps):
                if isinstance(step, Run):
                    self.replay(stage, step)
                elif step.from_stage is not None:
                    # The stages share one root here, so copying a path to itself is already done.
                    assert [step.target] == [step.workdir / source for source in step.sources], (
                        f"COPY --from={step.from_stage} {step.sources} {step.dest}: only same-path copies are replayed"
                    )
                else:
                    for source, target in copies[stage_index, step_index]:
                        self.host(target).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(ROOT / source, self.host(target))


def base_layer(packages: tuple[str, ...]) -> Path:
    """A folder holding ``packages`` (pip --target), shared by every environment that needs it."""
    folder = cache_root() / "base-layers" / hashlib.sha256("\n".join(packages).encode()).hexdigest()[:16]
    with _locked(folder):
        if not (folder / _COMPLETE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", str(folder), *packages],
                check=True,
                capture_output=True,
                timeout=900,
            )
            (folder / _COMPLETE).touch()
    return folder


def image_environment(dockerfile_path: Path) -> ImageEnvironment:
    """The image's environment, from the cache or built now."""
    dockerfile = parse(dockerfile_path)
    context = context_files(dockerfile_path)
    copies = {
        (stage_index, step_index): list(_copied_files(stage, step, context))
        for stage_index, stage in enumerate(dockerfile.stages)
        for step_index, step in enumerate(stage.steps)
        if isinstance(step, Copy) and step.from_stage is None
    }
    key = _content_key(dockerfile, [pair for pairs in copies.values() for pair in pairs])
    folder = cache_root() / "images" / f"{dockerfile_path.name.split('.')[0]}-{key}"
    with _locked(folder):
        if not (folder / _COMPLETE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            builder = _Builder(dockerfile, folder / "root")
            builder.build(copies)
            (folder / "build.log").write_text("\n".join(builder.log))
        (folder / _COMPLETE).touch()
    _prune(folder.parent, keep=folder)
    return ImageEnvironment(dockerfile, folder / "root", (folder / "build.log").read_text())
