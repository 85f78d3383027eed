"""The process a sandboxed tool call runs in (pipeline_rl/tasks/sandbox.py starts it, inside its own
mount namespace, limits and all):

    python -I sandbox_child.py --box BOX [--drop-to UID] TOOL_FILE FUNCTION < arguments.json
    python -I sandbox_child.py --box BOX [--drop-to UID] --probe

BOX is a directory holding `work/` (the call's working directory) and `python/` (an empty mount point).
First the process confines itself: every mount of its namespace becomes read-only except BOX/work. Where
it will drop to UID and its interpreter's installation is not readable by others (a Python under a
0700 /root), that installation is bound read-only at BOX/python and the process re-executes itself from
there, so imports keep working after the drop. Then it loads FUNCTION from TOOL_FILE, drops to UID (uid
and gid; as root only), calls the function with the JSON object on stdin as keyword arguments and
writes its result (as text) to stdout. An exception is one line `Type: message` on stderr and exit
status 1. --probe confines (and drops) and exits: the start-up check that this works on the machine.
Standard library only: `-I` leaves this process no project packages to import.
"""

import ctypes
import importlib.util
import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flags a remount must keep (a user namespace may not clear them: EPERM) -> mount flags
KEPT = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
# Kernel filesystems: read-only for an unprivileged uid already, and remounting them is refused in a
# user namespace. Everything else (/, /tmp, /dev/shm, /home, bind mounts, ...) is made read-only.
SKIPPED = ("/proc", "/sys")


class SandboxError(Exception):
    pass


def _mount(libc, source, target: str, flags: int) -> None:
    src = source.encode() if source else None
    if libc.mount(src, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"sandbox: mount {target}: {os.strerror(err)}")


def _mountpoints() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # field 5 is the mount point, with space, tab, newline and backslash as octal escapes
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))
    return points


def _readable_by_others(path: str) -> bool:
    """Whether a uid other than the owner can traverse every directory up to `path` and read it."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        mode = os.stat("/".join(parts[:i]) or "/").st_mode
        if not mode & 0o001 or (i == len(parts) and not mode & 0o004):
            return False
    return True


def confine(box: str, python_mount: str | None) -> None:
    workdir = os.path.join(box, "work")
    libc = ctypes.CDLL(None, use_errno=True)
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)  # nothing done here reaches the host's namespace
    _mount(libc, workdir, workdir, MS_BIND)  # its own mount, left writable below
    if python_mount is not None:  # made read-only with every other mount below
        _mount(libc, sys.base_prefix, python_mount, MS_BIND | MS_REC)
    for point in _mountpoints():
        if point == workdir or any(point == s or point.startswith(s + "/") for s in SKIPPED):
            continue
        try:
            kept = os.statvfs(point).f_flag
        except OSError:  # covered by a later mount, or gone: nothing reachable to write there
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(mount_flag for st_flag, mount_flag in KEPT.items() if kept & st_flag)
        _mount(libc, None, point, flags)


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def main() -> int:
    args = sys.argv[1:]
    box = args[args.index("--box") + 1]
    uid = int(args[args.index("--drop-to") + 1]) if "--drop-to" in args else None
    if "--confined" not in args:
        rebind = uid is not None and not _readable_by_others(sys.base_prefix)
        python_mount = os.path.join(box, "python") if rebind else None
        try:
            confine(box, python_mount)
        except (SandboxError, OSError) as e:
            sys.stderr.write(f"SandboxError: {e}\n")
            return 3
        if python_mount is not None:  # the same process, namespace and limits; stdin still unread
            exe = os.path.relpath(os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix))
            python = os.path.join(python_mount, exe)  # argv[0] too: Python finds its library from it
            os.execv(python, [python, "-I", __file__, "--confined", *args])
    os.chdir(os.path.join(box, "work"))
    if "--probe" in args:
        if uid is not None:
            drop_to(uid)
        return 0
    path, function = args[-2], args[-1]
    try:
        arguments = json.load(sys.stdin)
        if not isinstance(arguments, dict):
            raise TypeError("the arguments must be a JSON object")
        spec = importlib.util.spec_from_file_location("tool", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        call = getattr(module, function)
        if uid is not None:
            drop_to(uid)
        result = call(**arguments)
        sys.stdout.write(str(result))
    except BaseException as e:  # noqa: BLE001 - every failure is an observation for the model
        sys.stderr.write(f"{type(e).__name__}: {e}"[:500] + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
