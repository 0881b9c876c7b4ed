"""Run untrusted Python from a model in a contained subprocess: the `run_python` tool.

    from cohort_grpo.tools import Sandbox, run_python, sandbox_report

    run_python("print(6 * 7)")                    # '42\\n'
    Sandbox(timeout_s=2, memory_mb=256).run_python("while True: pass")   # 'timed out after 2 s'
    sandbox_report()                              # what is contained on this machine, measured

Every call starts a fresh interpreter (`python -I -S -u -X utf8`: isolated mode, no site-packages, the
standard library importable) through `sandbox_launcher.py`, which contains it as far as the OS allows:

* always: a wall-clock timeout (the whole process group killed on expiry), RLIMIT_CPU, RLIMIT_AS,
  RLIMIT_FSIZE, RLIMIT_NOFILE and RLIMIT_CORE = 0; an empty environment; stdin at EOF; a fresh
  working directory, removed afterwards; stdout + stderr read incrementally and capped;
* on Linux as root (or with unprivileged user namespaces): new mount, network, PID and IPC namespaces,
  a read-only filesystem with a private /tmp, hidden home and runtime folders, an unused uid of its
  own (root) and RLIMIT_NPROC. docs/howto/tools.md lists what is and is not contained in each case.

The string returned is what the model sees: the program's stdout (with stderr when it failed), or its
output so far followed by one line saying why it was stopped ("timed out after 5 s", "memory limit
exceeded (512 MiB)", "output truncated at 16384 bytes", ...).
"""

from __future__ import annotations

import errno
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
HIDE_PATHS = ("/root", "/home", "/run", "/var/tmp", "/dev/shm", "/mnt", "/media")
INSIDE_WORKDIR = "/tmp/sandbox"  # the working directory inside a mount namespace (sandbox_launcher.py)
NO_OUTPUT = "(no output)"


@dataclass
class SandboxResult:
    """One run. `text` is what the model sees; the rest is for the caller and the tests."""

    text: str
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: killed by the sandbox (timeout, output cap)
    stopped: str | None  # None, or "timeout", "output", "memory", "cpu", "file_size", "signal", "refused"
    seconds: float
    pgid: int  # the process group that was killed at the end (the tests check that it is gone)
    setup: dict = field(default_factory=dict)  # what the launcher contained (its status report)


class Sandbox:
    """A contained Python runner with its limits; `run_python` is the tool, `run` the full result.

    Args (all optional):
        timeout_s: wall-clock limit of one run, start-up included.
        memory_mb: RLIMIT_AS (address space) of the program's process.
        cpu_s: RLIMIT_CPU in seconds (default: the timeout, rounded up).
        output_bytes: cap on stdout + stderr kept; the program is stopped when it prints more.
        file_size_mb: RLIMIT_FSIZE, the largest file it may write.
        disk_mb: size of the private /tmp (a tmpfs) when there is a mount namespace.
        max_processes: RLIMIT_NPROC (processes and threads), set when the program has a uid of its own.
        max_open_files: RLIMIT_NOFILE.
        isolation: "auto" (namespaces and a private uid where the OS allows) or "none" (limits,
            environment and working directory only).
        require_isolation: refuse to run (the tool returns a one-line reason) unless the namespaces and
            the private filesystem could be set up.
        site_packages: let the program import the interpreter's site-packages (numpy, sympy, ...).
        python: the interpreter to run (default: this one).
    """

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None,
                 output_bytes: int = 16384, file_size_mb: int = 16, disk_mb: int = 64, max_processes: int = 16,
                 max_open_files: int = 256, isolation: str = "auto", require_isolation: bool = False,
                 site_packages: bool = False, python: str | None = None):
        if isolation not in ("auto", "none"):
            raise ValueError(f"isolation must be 'auto' or 'none', not {isolation!r}")
        if timeout_s <= 0 or memory_mb <= 0 or output_bytes <= 0:
            raise ValueError("timeout_s, memory_mb and output_bytes must be positive")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.cpu_s = int(cpu_s) if cpu_s is not None else max(1, math.ceil(timeout_s))
        self.output_bytes = int(output_bytes)
        self.file_size_mb = int(file_size_mb)
        self.disk_mb = int(disk_mb)
        self.max_processes = int(max_processes)
        self.max_open_files = int(max_open_files)
        self.isolation = isolation
        self.require_isolation = bool(require_isolation)
        self.site_packages = bool(site_packages)
        self.python = os.path.realpath(python or sys.executable)
        self._report: dict | None = None
        self._binary_names: list | None = None  # Python folders under /tmp that the interpreter's binary names
        self._remount_fallback = False  # the tests' way to take the path of kernels before 5.12
        self._report_lock = threading.Lock()

    # -- the tool ------------------------------------------------------------------------------------

    def run_python(self, code: str) -> str:
        """Run a Python program in a fresh, isolated interpreter and return what it prints.

        Only the standard library is available. There is no network, no persistent storage and no
        input; the program is stopped after a few seconds or when it prints too much. Print the values
        you want to see.

        Args:
            code: The complete Python program to run.
        """
        return self.run(code).text

    # -- the runner ----------------------------------------------------------------------------------

    def run(self, code: str) -> SandboxResult:
        """Run `code` as a program; never raises for anything the program does."""
        if not isinstance(code, str):
            code = str(code)
        start = time.monotonic()
        host_workdir = tempfile.mkdtemp(prefix="cohort-sandbox-")
        try:
            Path(host_workdir, "main.py").write_text(code, encoding="utf-8")
            return self._launch(host_workdir, start)
        finally:
            shutil.rmtree(host_workdir, ignore_errors=True)

    def _config(self, host_workdir: str, status_fd: int) -> dict:
        # sys.prefix is left out: a venv's folder is read only by its own bin/python, and the sandbox runs
        # the interpreter that one links to (a venv made with --copies has it inside: <prefix>/bin/python)
        prefixes = {os.path.realpath(sys.base_prefix)} if self._is_this_python() else set()
        prefixes.add(os.path.dirname(os.path.dirname(self.python)))  # <prefix>/bin/python
        prefixes.add(os.path.dirname(self.python))
        home = os.environ.get("HOME", "")
        hide = list(HIDE_PATHS) + ([os.path.realpath(home)] if home not in ("", "/") else [])
        return {
            "status_fd": status_fd,
            "host_workdir": host_workdir,
            "python": self.python,
            "python_args": ["-I", "-u", "-X", "utf8"] + ([] if self.site_packages else ["-S"]),
            "isolation": self.isolation,
            "require_isolation": self.require_isolation,
            "disk_mb": self.disk_mb,
            "keep_paths": sorted(prefixes),
            "moved_paths": self._movable(sorted(prefixes)),
            "exec_paths": [self.python],
            "hide_paths": hide,
            "force_remount_fallback": self._remount_fallback,
            "limits": {"cpu_s": self.cpu_s, "memory_mb": self.memory_mb, "file_size_mb": self.file_size_mb,
                       "open_files": self.max_open_files, "processes": self.max_processes},
        }

    def _movable(self, prefixes: list) -> list:
        """The Python folders under /tmp, which the launcher shows under /run/cohort-python instead, so the
        program's private /tmp is empty. Not where the interpreter's binary names one (an absolute
        RUNPATH, as pyenv builds have): the loader would look for libpython at the original path."""
        under_tmp = [p for p in prefixes if p == "/tmp" or p.startswith("/tmp/")]
        if under_tmp and self._binary_names is None:
            try:
                with open(self.python, "rb") as f:
                    data = f.read()
            except OSError:
                data = b""
            self._binary_names = [p for p in under_tmp if p.encode() in data]
        return [p for p in under_tmp if not any(n == p or n.startswith(p + "/") for n in self._binary_names or [])]

    def _is_this_python(self) -> bool:
        return self.python == os.path.realpath(sys.executable)

    def _launch(self, host_workdir: str, start: float) -> SandboxResult:
        """Run the launcher on `host_workdir` (main.py in it) until it ends, the timeout passes or the output
        passes its cap; then kill what is left and read its status lines."""
        proc, status_r = self._start_launcher(host_workdir)
        pgid = proc.pid  # start_new_session: the launcher leads its own process group
        out, err, status = bytearray(), bytearray(), bytearray()
        stopped = None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        sel.register(status_r, selectors.EVENT_READ, status)
        try:
            stopped = self._read_pipes(proc, sel, out, err, status, deadline=start + self.timeout_s)
        finally:
            _end_launcher(proc, pgid, stopped)
            _read_rest(status_r, status)  # whatever the launcher and init wrote before they ended
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
            os.close(status_r)
        seconds = time.monotonic() - start
        setup, exit_code, refused = _launcher_status(status)
        if refused:
            stopped = "refused"
        return self._result(bytes(out), bytes(err), exit_code, stopped, seconds, pgid, setup, host_workdir)

    def _start_launcher(self, host_workdir: str) -> tuple[subprocess.Popen, int]:
        """Start sandbox_launcher.py in a session of its own: (its process, the read end of its status pipe)."""
        status_r, status_w = os.pipe()
        # the configuration goes in a file, not argv, where the program would read it in /proc/1/cmdline
        config = Path(host_workdir, "sandbox.json")
        config.write_text(json.dumps(self._config(host_workdir, status_w)), encoding="utf-8")
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", str(LAUNCHER), str(config)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                cwd=host_workdir, pass_fds=(status_w,), start_new_session=True, close_fds=True)
        finally:
            os.close(status_w)
        return proc, status_r

    def _read_pipes(self, proc: subprocess.Popen, sel: selectors.BaseSelector, out: bytearray, err: bytearray,
                    status: bytearray, deadline: float) -> str | None:
        """Read the launcher's stdout, stderr and status pipes (`sel`) into `out`, `err` and `status` until they
        close. Returns why the program must be stopped: "timeout" at `deadline`, "output" when stdout and
        stderr together pass `output_bytes` (what fits is kept); None when the pipes closed, or stayed open
        half a second after the launcher exited."""
        exited_at = None
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                return None  # the launcher is gone; something it left behind holds the pipes
            for key, _ in sel.select(timeout=min(deadline - now, 0.05)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buffer = key.data
                if buffer is status:
                    buffer += chunk[: 65536 - len(status)]
                    continue
                room = self.output_bytes - len(out) - len(err)
                buffer += chunk[:max(room, 0)]
                if len(chunk) > room:
                    return "output"
        return None

    def _result(self, out: bytes, err: bytes, exit_code, stopped, seconds, pgid, setup, host_workdir) -> SandboxResult:
        def text_of(data: bytes) -> str:
            text = data.decode("utf-8", "replace")
            for folder in (setup.get("workdir"), host_workdir):
                if folder:
                    text = text.replace(folder + "/", "")
            return text

        stdout, stderr = text_of(out), text_of(err)
        if stopped is None and exit_code is not None and exit_code != 0:
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            if last.startswith("MemoryError"):
                stopped = "memory"
            elif exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and seconds >= self.cpu_s):
                stopped = "cpu"
            elif exit_code == -getattr(signal, "SIGXFSZ", 25):
                stopped = "file_size"
            elif exit_code < 0:
                stopped = "signal"
        reason = {
            "timeout": f"timed out after {self.timeout_s:g} s",
            "output": f"output truncated at {self.output_bytes} bytes",
            "memory": f"memory limit exceeded ({self.memory_mb} MiB)",
            "cpu": f"CPU time limit exceeded ({self.cpu_s} s)",
            "file_size": f"file size limit exceeded ({self.file_size_mb} MiB)",
            "signal": f"killed by signal {_signal_name(exit_code)}",
            "refused": "sandbox unavailable: the namespaces could not be set up here ("
                       + "; ".join(setup.get("errors", [])) + ")",
            None: None,
        }[stopped]
        if stopped is None and exit_code is None:
            reason, stopped = "the sandbox failed to start the program", "signal"
        if reason is None and exit_code and not stderr.strip():
            reason = f"exit code {exit_code}"  # a failure the output alone would not show
        failed = stopped is not None or exit_code != 0
        body = stdout + (stderr if failed else "")
        if stopped == "memory":  # the traceback's last line is the reason; keep the rest
            body = stdout
        if reason:
            text = body + ("" if not body or body.endswith("\n") else "\n") + reason
        else:
            text = body if body else NO_OUTPUT
        return SandboxResult(text=text, stdout=stdout, stderr=stderr, exit_code=exit_code, stopped=stopped,
                             seconds=seconds, pgid=pgid, setup=setup)

    # -- what is contained here ----------------------------------------------------------------------

    def report(self) -> dict:
        """What this sandbox contains on this machine, measured once by running a probe program in it."""
        # imported here: the rest of this file is standard library only, so it runs loaded from its file alone
        from cohort_grpo.tools.containment import measured_containment

        with self._report_lock:
            if self._report is None:
                self._report = measured_containment(self)
            return self._report


def _end_launcher(proc: subprocess.Popen, pgid: int, stopped: str | None) -> None:
    """Wait for the launcher, which exits right after init when the program ended by itself; stop it (and
    its process group) when the program was stopped or it is still running a second later."""
    if not stopped:
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    if stopped or proc.poll() is None:
        _stop(proc, pgid)
    proc.wait()


def _read_rest(status_r: int, status: bytearray) -> None:
    """Append what is left in the status pipe to `status` (up to 64 KiB in all), without waiting for more."""
    try:
        os.set_blocking(status_r, False)
        while len(status) < 65536:
            chunk = os.read(status_r, 65536)
            if not chunk:
                break
            status += chunk
    except (BlockingIOError, OSError):
        pass


def _launcher_status(status: bytearray) -> tuple[dict, int | None, bool]:
    """(setup, exit code, refused) from the launcher's JSON status lines: what it contained, the program's
    exit code (None: it never reported one), and whether it refused to run without the isolation required.
    Lines that are not JSON (cut off when the launcher was killed) are skipped; a later key wins.

        '{"setup": {"mode": "root"}}\n{"exit": 1}\n{"ex'  ->  ({"mode": "root"}, 1, False)
    """
    setup, exit_code, refused = {}, None, False
    for line in status.decode("utf-8", "replace").splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        setup = message.get("setup", setup)
        exit_code = message.get("exit", exit_code)
        refused = refused or bool(message.get("refused"))
    return setup, exit_code, refused


def _stop(proc: subprocess.Popen, pgid: int) -> None:
    """End a run. SIGTERM asks the launcher to kill init, so the kernel empties the PID namespace and the
    launcher reaps init (nothing is left, not even a zombie); then the process group is killed, for
    whatever is left of it (everything, when there is no PID namespace)."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        pass
    _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError as e:
        if e.errno not in (errno.ESRCH, errno.EPERM):
            raise


def _signal_name(code) -> str:
    try:
        return signal.Signals(-code).name
    except (TypeError, ValueError):
        return str(code)


DEFAULT_SANDBOX = Sandbox()
run_python = DEFAULT_SANDBOX.run_python


def sandbox_report() -> dict:
    """What the default sandbox (`run_python`) contains on this machine, measured (see `Sandbox.report`)."""
    return DEFAULT_SANDBOX.report()
