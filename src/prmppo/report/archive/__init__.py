"""A study's runs as one small, deterministic archive, and reports read straight from it.

    python -m prmppo.report.archive multirun/<study>/rloo multirun/<study>/gae --out experiments/<study>/runs.tar.xz
    python -m prmppo.report experiments/<study>/runs.tar.xz --out experiments/<study> --name RESULTS.md

`pack` keeps, for every run under the given directories (a run is a directory with
`.hydra/config.yaml`), what a report and a reanalysis read: `RUN_FILES` (the resolved config and the
overrides typed, metrics.jsonl, eval.json with each test problem's outcomes, stage_result.json,
run_info.json, banner.json, canary.jsonl) and what `RUN_GLOBS` match (each during-PPO evaluation's
per-problem outcomes); and, for every sweep directory on the way, `SWEEP_FILES`
(Hydra's multirun.yaml, which holds the sweep's command, and sweep_result.json). No weights, no
checkpoints, no logs. Members are named `<given dir's name>/<path below it>`, so the archive does not
depend on where the runs lay; they are sorted, with mtime 0, uid/gid 0, no owner names and mode 0644,
so packing the same files twice gives the same bytes whatever their dates and owners. An archive
above `MAX_BYTES` is refused before anything is written: a study's runs belong in git only while they
stay small.

`opened` is the way back: archives among the report's inputs are unpacked into a temporary directory
(regular files with relative names only), and `shown` names what came from one as `<archive's file
name>:<member dir>`, so a report made from an archive prints the same paths on every machine and from
every working directory (`experiments/<study>/runs.tar.xz` from the repository's root and `runs.tar.xz`
from the study's directory give the same markdown).
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

from prmppo.report.runs import ReportError

SUFFIX = ".tar.xz"
RUN_FILES = (".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml", "metrics.jsonl", "eval.json",
             "stage_result.json", "run_info.json", "banner.json", "canary.jsonl")
RUN_GLOBS = ("ppo_eval/iteration_*.json",)
SWEEP_FILES = ("multirun.yaml", "sweep_result.json")
MAX_BYTES = 25_000_000  # 25 MB, compressed


class ArchiveError(ReportError):
    """An archive that cannot be made or read; the message names the file and what would be valid."""


def is_archive(path: str | Path) -> bool:
    return str(path).endswith(SUFFIX) and Path(path).is_file()


def source_name(path: str | Path) -> str:
    """How a report names one of its inputs: an archive by its file name, a directory as given."""
    return Path(path).name if is_archive(path) else str(path)


def members(dirs: list[str | Path]) -> dict[str, Path]:
    """`{member name: file}` of everything `pack` keeps from the runs under `dirs`, sorted by name."""
    out: dict[str, Path] = {}
    prefixes: dict[str, Path] = {}
    for given in map(Path, dirs):
        if not given.is_dir():
            raise ArchiveError(f"{given} is not a directory: give run or sweep directories (python -m prmppo -m ...)")
        prefix = given.resolve().name
        if prefix in prefixes:
            raise ArchiveError(f"{prefixes[prefix]} and {given} have the same name {prefix!r}, which names their "
                               "members in the archive; give their parent directory instead")
        prefixes[prefix] = given
        runs = sorted(marker.parent.parent for marker in given.rglob(".hydra/config.yaml"))
        if not runs:
            raise ArchiveError(f"no runs under {given}: a run directory holds .hydra/config.yaml")
        for run in runs:
            wanted = [run / name for name in RUN_FILES] + sorted(f for g in RUN_GLOBS for f in run.glob(g))
            walk = run.parent
            while walk == given or given in walk.parents:  # every directory from the run's parent up to `given`
                wanted += [walk / name for name in SWEEP_FILES]
                walk = walk.parent
            for file in wanted:
                if file.is_file():
                    out[str(PurePosixPath(prefix, *file.relative_to(given).parts))] = file
    return dict(sorted(out.items()))


def pack_bytes(files: dict[str, Path]) -> bytes:
    """The `.tar.xz` of `files` (`{member name: file}`), every member's metadata fixed (see the module docstring)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", format=tarfile.PAX_FORMAT, preset=9) as tar:
        for name in sorted(files):
            data = files[name].read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def pack(dirs: list[str | Path], out: str | Path, max_bytes: int = MAX_BYTES) -> dict[str, Path]:
    """Write the archive of the runs under `dirs` to `out` (a `*.tar.xz` path); returns what it holds. Refuses,
    writing nothing, an archive above `max_bytes`."""
    out = Path(out)
    if not out.name.endswith(SUFFIX):
        raise ArchiveError(f"the archive's name must end in {SUFFIX}, got {out.name!r}")
    files = members(dirs)
    data = pack_bytes(files)
    if len(data) > max_bytes:
        sizes = sorted(((file.stat().st_size, name) for name, file in files.items()), reverse=True)[:3]
        largest = ", ".join(f"{name} ({size / 1e6:.1f} MB)" for size, name in sizes)
        raise ArchiveError(f"the archive of {len(files)} files would be {len(data) / 1e6:.1f} MB, above the "
                           f"{max_bytes / 1e6:g} MB limit for archives kept in the repository; the largest files: "
                           f"{largest}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return files


def unpack(archive: str | Path, dest: str | Path) -> Path:
    """Extract `archive` into `dest`; only regular files with relative names inside it are accepted."""
    dest = Path(dest)
    try:
        with tarfile.open(archive, mode="r:xz") as tar:
            for member in tar:
                name = PurePosixPath(member.name)
                if not member.isreg() or name.is_absolute() or ".." in name.parts:
                    raise ArchiveError(f"{archive}: member {member.name!r} is not a regular file with a relative "
                                       f"name; an archive made by python -m prmppo.report.archive holds only those")
                target = dest.joinpath(*name.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    except (tarfile.TarError, EOFError, OSError) as err:  # lzma's errors are OSError (LZMAError)
        raise ArchiveError(f"{archive} cannot be read as a {SUFFIX} archive: {err}") from None
    return dest


@contextlib.contextmanager
def opened(paths: list[str | Path]) -> Iterator[tuple[list[Path], Callable[[Path], str]]]:
    """`(local paths, shown)` for the report's inputs: directories as given, archives unpacked into a temporary
    directory (removed on exit); `shown(path)` names a path below an unpacked archive `<archive's file
    name>:<member path>` (any other as it is). A `ReportError` raised inside names the archive as given, not
    the temporary directory."""
    with tempfile.TemporaryDirectory(prefix="prmppo-report-") as scratch:
        local, roots = [], {}
        for index, given in enumerate(paths):
            if is_archive(given):
                root = unpack(given, Path(scratch) / str(index))
                roots[root] = str(given)
                local.append(root)
            else:
                local.append(Path(given))

        def shown(path: Path) -> str:
            for root, given in roots.items():
                if path == root or root in path.parents:
                    return f"{source_name(given)}:{path.relative_to(root).as_posix()}"
            return str(path)

        try:
            yield local, shown
        except ReportError as err:
            message = str(err)
            for root, name in roots.items():
                message = message.replace(f"{root}/", f"{name}:").replace(str(root), name)
            raise type(err)(message) from None
