"""The process that `Sandbox` starts: it contains itself, then runs the untrusted program.

Run as `python -I -S sandbox_launcher.py CONFIG.json` (standard library only; it must not import cohort_grpo),
the configuration in a file of the run's working folder, which it deletes once read.
It is trusted code; the program it runs is not. Three processes:

    launcher (the host's namespaces)   sets up new namespaces and mounts, forks:
      init   (PID 1 of the new PID namespace, when there is one)   mounts a fresh /proc, forks:
        program   sets its limits, drops to an unprivileged user, closes every other file, execs Python

The launcher writes one JSON line to the status pipe (`status_fd`) saying what containment it set up,
and init writes one more with the program's exit. When init exits (the program finished) or is killed
(the parent's timeout kills the launcher's process group, and init dies with its parent), the kernel
kills every process left in the PID namespace: a program's children cannot outlive it, even those that
called setsid(). Without a PID namespace, init is a child subreaper (Linux) and kills what is left.

What is tried, best first (each step is reported, none is fatal unless the parent asks):

* root (CAP_SYS_ADMIN): unshare the mount, network, PID and IPC namespaces.
* not root: the same inside a new user namespace (the caller's uid mapped to 65534).
* neither (macOS, a container that forbids unshare): only the resource limits, the empty environment
  and the temporary directory.

With a mount namespace: everything is remounted read-only (recursively); /tmp becomes a private,
size-limited tmpfs holding the working directory /tmp/sandbox; /root, /home, $HOME, /run, /var/tmp,
/dev/shm, /mnt and /media are hidden under empty read-only tmpfs mounts, except the directories of the
Python installation, which are bound back read-only at their own paths, or, those under /tmp, at
/run/cohort-python/tmp/... (the program then runs the interpreter from there), so /tmp is empty.
"""

import ctypes
import ctypes.util
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every Linux architecture (added in 5.12)

P_ALL = getattr(os, "P_ALL", 0)  # waitid's id types (missing where the platform has no waitid)
P_PID = getattr(os, "P_PID", 1)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

INSIDE_WORKDIR = "/tmp/sandbox"
MOVED_ROOT = "/run/cohort-python"  # where Python folders that lie under /tmp are bound (in /run's tmpfs)
USERNS_UID = 65534  # what the caller's uid is called inside a user namespace ("nobody")
PRIVATE_UID_BASE = 2_000_000_000  # root mode: the program runs as this + the launcher's pid

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {target}")


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def remount_all_read_only(force_fallback: bool) -> str:
    """Make every mount of this (private) mount namespace read-only and nosuid; returns how."""
    if not force_fallback:
        attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
        done = libc().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/",
                              ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        if done == 0:
            return "mount_setattr"
        if ctypes.get_errno() not in (38, 22):  # ENOSYS (kernel < 5.12), EINVAL
            check(done, "mount_setattr /")
    # Older kernels: remount each mount point, keeping the flags a user namespace may not clear.
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 for a space, and so on
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
            for option in fields[5].split(","):
                flags |= keep.get(option, 0)
            points.append((point, flags))
    failed = []
    for point, flags in points:
        try:
            mount(None, point, None, flags)
        except OSError:
            failed.append(point)
    if failed:
        raise OSError(1, f"could not make read-only: {', '.join(failed[:5])}")
    return "remount of each mount point"


def mount_tmpfs(path: str, flags: int, options: str) -> None:
    mount("tmpfs", path, "tmpfs", flags | MS_NOSUID | MS_NODEV, options)


def bind_back(fd: int, path: str) -> None:
    """Bind the directory open as `fd` (opened before it was hidden) at `path`, read-only."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    try:  # already read-only when its source was (it was); make sure of it
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    except OSError:
        pass


def inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def contain_filesystem(cfg: dict, uid: int, gid: int, code: bytes) -> dict:
    """In a fresh mount namespace: read-only everything, private /tmp, hidden private folders."""
    report = {}
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below may reach the host's namespace
    keep = []  # (fd, path, where it is bound) of the Python installation's folders, opened before hiding
    moved = set(cfg.get("moved_paths", ())) if os.path.dirname(MOVED_ROOT) in cfg["hide_paths"] else set()
    for path in cfg["keep_paths"]:
        try:
            keep.append((os.open(path, os.O_PATH | os.O_DIRECTORY), path, MOVED_ROOT + path if path in moved else path))
        except OSError:
            pass
    report["read_only"] = remount_all_read_only(cfg.get("force_remount_fallback", False))
    hidden = []
    for folder in sorted(set(cfg["hide_paths"]) | {"/tmp"}, key=lambda p: (len(p), p)):
        if not os.path.isdir(folder) or os.path.islink(folder) or any(inside(folder, h) for h in hidden):
            continue
        writable = folder == "/tmp"
        options = f"size={cfg['disk_mb']}m,mode=1777" if writable else "size=64k,mode=755"
        try:
            mount_tmpfs(folder, 0, options)
        except OSError as e:
            report.setdefault("not_hidden", []).append(f"{folder} ({e.strerror})")
            continue
        if folder == "/tmp" and os.path.dirname(MOVED_ROOT) not in hidden:  # nowhere else to bind them
            keep = [(fd, path, path) for fd, path, _ in keep]
        hidden.append(folder)
        for fd, path, where in keep:
            if inside(where, folder):
                bind_back(fd, where)
        if not writable:
            mount(None, folder, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    report["hidden"] = [h for h in hidden if h != "/tmp"]
    for fd, path, where in sorted(keep, key=lambda k: -len(k[1])):  # the deepest folder holding it
        if inside(cfg["python"], path):
            report["python"] = where + cfg["python"][len(path):]
            break
    for fd, _, _ in keep:
        os.close(fd)
    os.mkdir(INSIDE_WORKDIR, 0o700)
    with open(os.path.join(INSIDE_WORKDIR, "main.py"), "wb") as f:
        f.write(code)
    os.chown(os.path.join(INSIDE_WORKDIR, "main.py"), uid, gid)
    os.chown(INSIDE_WORKDIR, uid, gid)
    report["private_tmp_mb"] = cfg["disk_mb"]
    return report


def write_id_maps(outer_uid: int, outer_gid: int) -> None:
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{USERNS_UID} {outer_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{USERNS_UID} {outer_gid} 1")


def isolate(cfg: dict, code: bytes, uid: int) -> dict:
    """Enter new namespaces (as far as allowed) and contain the filesystem. Returns the report."""
    report = {"mode": "none", "namespaces": [], "errors": []}
    if not sys.platform.startswith("linux") or cfg["isolation"] == "none":
        return report
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
    outer_uid, outer_gid = os.getuid(), os.getgid()
    try:
        check(libc().unshare(flags), "unshare(mount, net, pid, ipc)")
        report["mode"] = "root"
    except OSError as e:
        report["errors"].append(str(e))
        try:
            check(libc().unshare(flags | CLONE_NEWUSER), "unshare(user, mount, net, pid, ipc)")
            write_id_maps(outer_uid, outer_gid)
            report["mode"] = "user"
            uid = USERNS_UID
        except OSError as e2:
            report["errors"].append(str(e2))
            return report
    report["namespaces"] = ["mount", "network", "pid", "ipc"] + (["user"] if report["mode"] == "user" else [])
    try:
        report.update(contain_filesystem(cfg, uid, uid, code))
        report["workdir"] = INSIDE_WORKDIR
    except OSError as e:
        report["errors"].append(f"filesystem: {e}")
    return report


def set_limits(cfg: dict, nproc: bool) -> None:
    limits = cfg["limits"]
    mib = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    if nproc and hasattr(resource, "RLIMIT_NPROC"):
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    try:  # macOS refuses RLIMIT_AS below the current usage; the program then runs without it
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mib,) * 2)
    except (ValueError, OSError):
        pass


def prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        libc().prctl(option, ctypes.c_ulong(value), 0, 0, 0)


def can_run_as(uid: int, gid: int, paths: list) -> bool:
    """Whether `uid` can reach the interpreter: tried in a forked child (no exec), so nothing runs."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os._exit(0 if all(os.access(p, os.X_OK) for p in paths) else 1)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def run_program(cfg: dict, identity: dict, workdir: str, python: str) -> None:
    """The program's process: limits, unprivileged user, no inherited files, exec. Never returns."""
    try:
        set_limits(cfg, nproc=identity["nproc"])
        if identity["setuid"] is not None:
            os.setgroups([])
            os.setgid(identity["setuid"])
            os.setuid(identity["setuid"])
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        os.chdir(workdir)
        os.closerange(3, 1 << 16)
        os.execve(python, [python, *cfg["python_args"], "main.py"], {})
    except BaseException as e:  # noqa: BLE001 - report anything, then leave without cleanup
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
        os._exit(127)


def kill_children() -> None:
    """Without a PID namespace: kill whatever the program left behind (they were reparented to us)."""
    for _ in range(100):
        children = set()
        try:
            for task in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{task}/children") as f:
                    children.update(int(p) for p in f.read().split())
        except OSError:
            return
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass


def exited_child(idtype: int, pid: int) -> int:
    """Wait until a child (`pid`, or any with P_ALL) has exited, without reaping it: until reaped, its pid
    cannot be reused, so a signal sent to it meanwhile cannot reach another process. Where waitid is
    missing (or unreliable, as on macOS), this waits for any child and returns -1 (waitpid(-1) reaps
    it then), accepting that small race."""
    if sys.platform.startswith("linux"):
        return os.waitid(idtype, pid, os.WEXITED | os.WNOWAIT).si_pid
    return pid if idtype == P_PID else -1


def identity_for(cfg: dict, report: dict, uid: int, workdir: str) -> dict:
    """Which user the program runs as, and whether RLIMIT_NPROC means anything for it.

    RLIMIT_NPROC counts every process of the real uid, so it is set only for a uid of the program's
    own: the private uid (root), or the user namespace's (Linux 5.14 and later count per namespace)."""
    if report["mode"] == "user":
        return {"uid": USERNS_UID, "setuid": None, "nproc": True}
    if os.geteuid() != 0 or cfg["isolation"] == "none" or not sys.platform.startswith("linux"):
        return {"uid": os.geteuid(), "setuid": None, "nproc": False}
    if report.get("workdir") is None:  # no private filesystem: the uid must reach Python as it is
        if not can_run_as(uid, uid, cfg["exec_paths"]):
            report["errors"].append("the interpreter is not reachable by an unprivileged uid: runs as root")
            return {"uid": 0, "setuid": None, "nproc": False}
        os.chown(workdir, uid, uid)
        os.chown(os.path.join(workdir, "main.py"), uid, uid)
    return {"uid": uid, "setuid": uid, "nproc": True}


def init(cfg: dict, report: dict, status, workdir: str, uid: int) -> None:
    """PID 1 of the new namespace (or a subreaper): start the program, reap, report its exit."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the parent's kill reaches us, and with us the namespace
    in_pid_namespace = "pid" in report["namespaces"]
    if in_pid_namespace:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            report["fresh_proc"] = True
        except OSError as e:
            report["fresh_proc"] = False
            report["errors"].append(f"/proc: {e}")
    else:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    identity = identity_for(cfg, report, uid, workdir)
    report["uid"] = identity["uid"]
    report["process_limit"] = identity["nproc"]
    status.write(json.dumps({"setup": report}) + "\n")
    status.flush()
    program = os.fork()
    if program == 0:
        run_program(cfg, identity, workdir, report.get("python", cfg["python"]))
    reaped = False

    def stop(signum, frame):  # no PID namespace: the launcher asks us to end the run
        if not reaped:
            os.kill(program, signal.SIGKILL)  # alive or a zombie: its pid cannot have been reused

    if not in_pid_namespace:
        signal.signal(signal.SIGTERM, stop)
    exit_code = None
    while not reaped:
        try:
            pid = exited_child(P_ALL, 0)
        except ChildProcessError:
            break
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid, st = os.waitpid(pid, 0)
        if pid == program:
            reaped = True
            exit_code = os.waitstatus_to_exitcode(st)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if not in_pid_namespace:
        kill_children()  # what the program left behind was reparented to us (child subreaper)
    status.write(json.dumps({"exit": exit_code}) + "\n")
    status.flush()
    os._exit(0)


def main() -> None:
    init_pid = None

    def stop(signum, frame):  # the parent's way to end a run
        if init_pid is None:
            os._exit(1)
        # init is alive or a zombie until reaped below, so its pid is never a reused one. With a PID
        # namespace, killing init kills everything in it; without, init kills the program and its
        # descendants itself.
        os.kill(init_pid, signal.SIGKILL if "pid" in report["namespaces"] else signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    with open(sys.argv[1], encoding="utf-8") as f:
        cfg = json.load(f)
    os.unlink(sys.argv[1])  # the program has no business reading it
    status = os.fdopen(cfg["status_fd"], "w")
    host_workdir = cfg["host_workdir"]
    with open(os.path.join(host_workdir, "main.py"), "rb") as f:
        code = f.read()
    uid = PRIVATE_UID_BASE + os.getpid()  # unused by anyone else while this launcher lives
    report = {"namespaces": []}
    report = isolate(cfg, code, uid)
    workdir = report.get("workdir", host_workdir)
    if cfg.get("require_isolation") and report.get("workdir") is None:
        status.write(json.dumps({"setup": report, "refused": True}) + "\n")
        status.flush()
        os._exit(3)
    init_pid = os.fork()
    if init_pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            init(cfg, report, status, workdir, uid)
        finally:
            os._exit(1)
    status.close()
    exited_child(P_PID, init_pid)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _, st = os.waitpid(init_pid, 0)
    os._exit(os.waitstatus_to_exitcode(st) & 0xFF)


if __name__ == "__main__":
    main()
