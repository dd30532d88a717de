"""A sandbox's control group: one memory budget and one process count for every process of an episode at once.

cgroup v2 where the host mounts it with the ``memory`` and ``pids`` controllers available to a cgroup this process
may create children in; otherwise cgroup v1's ``memory`` and ``pids`` hierarchies (a child of this process's own
cgroup in each). Both need root. :func:`create_cgroup` answers None where neither works; the sandbox then polls the
resident memory of its processes instead (:func:`resident_bytes`).

A command joins the cgroup itself, before it becomes bwrap: :func:`join_argv` prefixes the command line with a shell
(still root) that writes its own pid into each ``cgroup.procs`` and then ``exec``\\ s the rest (which drops to the
sandbox's uid), so no code runs between ``fork`` and ``exec`` in this (threaded) process.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: where the kernel lists mounts and this process's cgroups (module attributes, so tests can point them elsewhere)
MOUNTINFO = Path("/proc/self/mountinfo")
SELF_CGROUP = Path("/proc/self/cgroup")
#: how long :meth:`SandboxCgroup.remove` waits for killed processes to leave before it gives up
_REMOVE_SECONDS = 5.0
#: settings that exist only where swap accounting is on
_OPTIONAL = ("memory.memsw.limit_in_bytes", "memory.swap.max")


@dataclass(frozen=True)
class SandboxCgroup:
    """The cgroup directories of one sandbox (one for v2; the ``memory`` and ``pids`` ones for v1)."""

    version: int
    directories: tuple[Path, ...]

    @property
    def description(self) -> str:
        return f"cgroup v{self.version} ({', '.join(map(str, self.directories))})"

    def procs_files(self) -> list[Path]:
        return [directory / "cgroup.procs" for directory in self.directories]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files():
            try:
                found.update(int(line) for line in path.read_text().split())
            except OSError:
                pass
        return found

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory budget so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for directory in self.directories:
            try:
                for line in (directory / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                continue
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        """Kill what is left and delete the directories (waiting a little for the processes to be gone).

        Raises:
            OSError: a directory still busy after the wait (a process that would not die).
        """
        deadline = time.monotonic() + _REMOVE_SECONDS
        for directory in self.directories:
            while True:
                self.kill()
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


def create_cgroup(name: str, memory_bytes: int, max_processes: int) -> SandboxCgroup | None:
    """A new cgroup ``name`` capped at ``memory_bytes`` and ``max_processes``; None where none can be made.

    Raises:
        OSError: the hierarchy looked usable but creating or configuring the cgroup failed (nothing is left behind).
    """
    v2 = _v2_parent()
    if v2 is not None:
        settings = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": max_processes}
        return _make(2, [(v2 / name, settings)])
    memory, pids = _v1_directory("memory"), _v1_directory("pids")
    if memory is None or pids is None:
        return None
    memory_settings = {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}
    return _make(1, [(memory / name, memory_settings), (pids / name, {"pids.max": max_processes})])


def sweep_cgroups(leaked: Callable[[str], bool]) -> None:
    """Remove the cgroups whose name ``leaked`` accepts where :func:`create_cgroup` makes them (those of a sandbox
    whose process was killed before it could close it). A cgroup that will not go is left."""
    places = [(2, _v2_parent()), (1, _v1_directory("memory")), (1, _v1_directory("pids"))]
    for version, parent in places:
        for child in parent.iterdir() if parent is not None else []:
            if child.is_dir() and leaked(child.name):
                try:
                    SandboxCgroup(version, (child,)).remove()
                except OSError:
                    pass


def _make(version: int, layout: list[tuple[Path, dict[str, int]]]) -> SandboxCgroup:
    made: list[Path] = []
    try:
        for directory, settings in layout:
            directory.mkdir()
            made.append(directory)
            for key, value in settings.items():
                if key not in _OPTIONAL or (directory / key).exists():
                    (directory / key).write_text(str(value))
    except BaseException:
        SandboxCgroup(version, tuple(made)).remove()
        raise
    return SandboxCgroup(version, tuple(made))


def join_argv(cgroup: SandboxCgroup | None, argv: list[str]) -> list[str]:
    """``argv``, run by a shell that first moves itself into ``cgroup`` (exit 125 if it cannot)."""
    if cgroup is None:
        return argv
    script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *map(str, cgroup.procs_files()), "--", *argv]


def _mounts(fstype: str) -> list[tuple[str, Path, set[str]]]:
    """(root, mount point, super options) of each mount of ``fstype``."""
    found = []
    for line in MOUNTINFO.read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        if fields[separator + 1] == fstype:
            found.append((fields[3], Path(fields[4]), set(fields[separator + 3].split(","))))
    return found


def _own_path(hierarchy: str) -> str | None:
    """This process's cgroup path in ``hierarchy`` ("" for v2's, else the controller's name)."""
    for line in SELF_CGROUP.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (hierarchy == "" and controllers == "") or hierarchy in controllers.split(","):
            return path
    return None


def _inside(root: str, mount_point: Path, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``root`` at ``mount_point``."""
    if path != root and not path.startswith(root.rstrip("/") + "/"):
        return None
    return mount_point / path[len(root) :].lstrip("/")


def _v1_directory(controller: str, writable: bool = True) -> Path | None:
    """This process's cgroup directory in the v1 hierarchy of ``controller`` (one root may create children in)."""
    own = _own_path(controller)
    if own is None or (writable and os.geteuid() != 0):
        return None
    for root, mount_point, options in _mounts("cgroup"):
        directory = _inside(root, mount_point, own) if controller in options else None
        if directory is not None and (os.access(directory, os.W_OK) or not writable):
            return directory
    return None


def memory_available() -> int:
    """Bytes of memory free for new work: the machine's ``MemAvailable``, or less where this process's memory cgroup
    (v1 or v2) has less room left under its limit."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    places = [(_v1_directory("memory", writable=False), "memory.limit_in_bytes", "memory.usage_in_bytes")]
    own_v2 = _own_path("")
    if own_v2 is not None:
        for root, mount_point, _ in _mounts("cgroup2"):
            places.append((_inside(root, mount_point, own_v2), "memory.max", "memory.current"))
    for directory, limit, usage in places:
        if directory is None:
            continue
        try:
            room = int((directory / limit).read_text()) - int((directory / usage).read_text())
        except (OSError, ValueError):  # no such file, or a limit of "max"
            continue
        available = min(available, max(room, 0))
    return available


def _v2_parent() -> Path | None:
    """The nearest cgroup at or above this process's that hands ``memory`` and ``pids`` to its children.

    This process's own cgroup qualifies only as the root one (elsewhere a cgroup with processes has no children).
    """
    own = _own_path("")
    if own is None or os.geteuid() != 0:
        return None
    for root, mount_point, _ in _mounts("cgroup2"):
        directory = _inside(root, mount_point, own)
        if directory is None:
            continue
        candidates = [directory] if directory == mount_point else []
        candidates += [parent for parent in directory.parents if parent.is_relative_to(mount_point)]
        for candidate in candidates:
            try:
                enabled = set((candidate / "cgroup.subtree_control").read_text().split())
            except OSError:
                continue
            if {"memory", "pids"} <= enabled and os.access(candidate, os.W_OK):
                return candidate
    return None


def resident_bytes(root_pid: int) -> int:
    """Resident memory of ``root_pid`` and all its descendants (the polled budget where no cgroup is available)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdecimal():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    total, stack, page = 0, [root_pid], os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total
