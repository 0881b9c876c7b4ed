"""The `run_python` sandbox against hostile programs: endless loops, memory and fork bombs, floods of
output, secrets in the environment, writes outside its folder, the network, escaping children.

Each test asserts what happens here and agrees with `sandbox_report()`: where this OS gives the sandbox
no namespaces (not Linux, or neither root nor user namespaces), the tests that need them check the
report says so, and skip the rest. docs/howto/tools.md has the table of what is contained where.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cohort_grpo.tools import Sandbox, run_python, sandbox_report, tool_schema

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the sandbox needs POSIX rlimits and process groups")


@pytest.fixture(scope="module")
def report():
    return sandbox_report()


def namespaced(report) -> bool:
    return report["mode"].startswith("namespaces") and report["setup"].get("workdir") == "/tmp/sandbox"


def process_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def processes_with(token: str) -> list[int]:
    """Host processes whose command line holds `token` (Linux /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


# -- ordinary programs ----------------------------------------------------------------------------------


def test_prints_what_the_program_prints():
    assert run_python("print(6 * 7)") == "42\n"
    assert run_python("x = 1") == "(no output)"
    assert run_python("print('héllo ✓')") == "héllo ✓\n"


def test_a_failing_program_shows_its_traceback_with_a_neutral_path():
    text = run_python("print('before')\n1 / 0")
    assert text.startswith("before\n")
    assert 'File "main.py", line 2' in text and "ZeroDivisionError: division by zero" in text
    assert "cohort-sandbox-" not in text and "/tmp/sandbox" not in text
    assert run_python("import sys; print('x'); sys.exit(3)") == "x\nexit code 3"


def test_stdin_is_at_end_of_file_and_site_packages_are_not_importable():
    assert "EOFError" in run_python("input()")
    assert "ModuleNotFoundError" in run_python("import numpy")
    assert run_python("import json, math, fractions; print(json.dumps(math.comb(5, 2)))") == "10\n"


def test_the_tool_has_a_schema():
    schema = tool_schema(run_python)
    assert schema["function"]["name"] == "run_python"
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The complete Python program to run."}},
        "required": ["code"],
    }


# -- time -------------------------------------------------------------------------------------------------


def test_endless_loop_is_stopped_at_the_default_timeout_and_its_process_group_is_gone():
    sandbox = Sandbox()  # the defaults of run_python: 5 s
    start = time.monotonic()
    result = sandbox.run("print('looping', flush=True)\nwhile True:\n    pass")
    elapsed = time.monotonic() - start
    assert result.stopped == "timeout"
    assert result.text == "looping\ntimed out after 5 s"
    assert 5.0 <= elapsed < 7.0
    assert process_gone(result.pgid)


def test_cpu_time_limit():
    result = Sandbox(timeout_s=8, cpu_s=1).run("while True:\n    pass")
    assert result.stopped == "cpu", result
    assert result.text == "CPU time limit exceeded (1 s)"
    assert result.seconds < 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds stray processes through /proc")
@pytest.mark.parametrize("isolation", ["auto", "none"])
def test_children_that_leave_the_process_group_are_killed_too(isolation):
    token = f"cohortstray{os.getpid()}{isolation}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {token}'], start_new_session=True)\n"
        "print('spawned', flush=True)\n"
        "while True:\n    pass\n"
    )
    result = Sandbox(timeout_s=1.5, isolation=isolation).run(code)
    assert result.stopped == "timeout" and result.text.startswith("spawned\n")
    try:
        assert processes_with(token) == []
        assert process_gone(result.pgid)
    finally:
        for pid in processes_with(token):
            os.kill(pid, signal.SIGKILL)
    # and when the program ends by itself, what it left running is killed too
    result = Sandbox(isolation=isolation).run(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)  # " + token + "\nprint('done')")
    assert result.text == "done\n" and result.seconds < 3
    assert processes_with(token) == []


# -- memory and output ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["x = bytearray(2 * 1024 ** 3)", "a = []\nwhile True:\n    a.append(' ' * 10 ** 7)"])
def test_memory_bomb_is_stopped_by_the_memory_limit_and_the_parent_is_unaffected(code):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = Sandbox(memory_mb=256).run(code)
    assert result.stopped == "memory", result
    assert result.text == "memory limit exceeded (256 MiB)"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 * 1024  # KiB on Linux
    assert run_python("print('still fine')") == "still fine\n"


def test_huge_output_is_capped_and_read_incrementally():
    code = "import sys\nsys.stdout.write('x' * (64 * 1024 * 1024))\nprint('never seen')"
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = Sandbox().run(code)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.stopped == "output"
    assert result.text == "x" * 16384 + "\noutput truncated at 16384 bytes"
    assert peak < 2 * 1024 * 1024, f"the parent held {peak} bytes for a 64 MiB output"
    assert process_gone(result.pgid)


def test_endless_printing_is_capped_quickly():
    result = Sandbox(output_bytes=1000).run("while True:\n    print('spam')")
    assert result.stopped == "output" and result.seconds < 3
    assert result.text.endswith("\noutput truncated at 1000 bytes")
    assert len(result.text) <= 1000 + len("\noutput truncated at 1000 bytes")


def test_file_size_limit():
    text = Sandbox(file_size_mb=1).run_python("open('big', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert "File too large" in text  # Python ignores SIGXFSZ, so the write fails with EFBIG


# -- environment, files, network, processes --------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["auto", "none"])
def test_the_environment_is_empty(monkeypatch, isolation):
    monkeypatch.setenv("COHORT_FAKE_SECRET", "hunter2")
    text = Sandbox(isolation=isolation).run_python("import os; print(sorted(os.environ.items()))")
    assert "hunter2" not in text and "COHORT_FAKE_SECRET" not in text
    # the only variable is the one the interpreter sets itself when it coerces the C locale (PEP 538)
    assert text in ("[]\n", "[('LC_CTYPE', 'C.UTF-8')]\n")


def test_other_processes_environments_are_out_of_reach(report):
    code = f"print(open('/proc/{os.getpid()}/environ', 'rb').read()[:20])"
    text = run_python(code)
    if namespaced(report):
        assert "No such file or directory" in text  # a fresh /proc of its own PID namespace
        assert report["contained"]["other_processes"]
    elif os.geteuid() == 0 and report["setup"].get("uid") == 0:
        assert report["contained"]["other_processes"] is False


def test_writes_outside_the_working_folder(report):
    """Namespaced: / is read-only, /tmp is a private tmpfs, so nothing reaches the host. With
    isolation="none" and root, a write to the host's /tmp succeeds: not contained."""
    token = f"cohort-escape-{os.getpid()}-{time.monotonic_ns()}"
    host_tmp = Path(tempfile.gettempdir()) / token
    repo_file = Path(__file__).resolve().parent / token
    code = (
        "import os\n"
        f"for path in [{str(host_tmp)!r}, {str(repo_file)!r}, '/etc/{token}', 'inside.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print(path.rsplit('/', 1)[-1][:6], 'written')\n"
        "    except OSError as e:\n"
        "        print(path.rsplit('/', 1)[-1][:6], e.strerror)\n"
    )
    try:
        if namespaced(report):
            text = run_python(code)
            lines = text.splitlines()
            # The repository's folder is read-only inside, or absent when it lies under /tmp (the
            # sandbox's /tmp is its own): either way nothing is written there.
            assert lines[0] == "cohort written" and lines[3] == "inside written", lines
            assert lines[1] in ("cohort Read-only file system", "cohort No such file or directory"), lines
            assert lines[2] == "cohort Read-only file system", lines
            assert not host_tmp.exists() and not repo_file.exists()  # the /tmp write went to its own /tmp
            assert report["contained"]["filesystem_writes"]
        text = Sandbox(isolation="none").run_python(code)
        if os.geteuid() == 0:
            assert "cohort written" in text and host_tmp.exists()  # NOT contained without namespaces
    finally:
        for path in (host_tmp, repo_file):
            if path.exists():
                path.unlink()


def test_the_private_tmp_and_dev_null_work(report):
    if not namespaced(report):
        pytest.skip("no mount namespace here")
    text = run_python(
        "import os, tempfile\n"
        "open('/dev/null', 'w').write('x')\n"
        "with tempfile.NamedTemporaryFile() as f:\n"
        "    f.write(b'data'); f.flush(); print(os.path.dirname(f.name), os.getcwd())\n"
        "print(sorted(os.listdir('/tmp')))\n"
        "import sys\nseen = []\n"  # of the hidden home folders, only the Python installation is there
        "for top in ('/root', '/home'):\n"
        "    for folder, subfolders, files in os.walk(top):\n"
        "        if folder.startswith(os.path.realpath(sys.base_prefix)):\n"
        "            subfolders[:] = []\n"
        "        else:\n"
        "            seen += files\n"
        "print(seen)\n")
    assert text == "/tmp /tmp/sandbox\n['sandbox']\n[]\n"


@pytest.mark.parametrize("copies", [False, True], ids=["venv", "interpreter"])
def test_the_private_tmp_is_empty_when_python_lies_under_tmp(report, copies):
    """A clean clone set up by a new user may put its virtual environment (a venv's prefix) or the
    interpreter itself (`venv --copies`) under /tmp; the private /tmp must not show them."""
    if not namespaced(report):
        pytest.skip("no mount namespace here")
    home = tempfile.mkdtemp(prefix="cohort-newcomer-", dir="/tmp")
    try:
        venv.EnvBuilder(symlinks=not copies, with_pip=False).create(os.path.join(home, "venv"))
        python = os.path.join(home, "venv", "bin", "python")
        assert os.path.realpath(python).startswith("/tmp/") == copies
        # sandbox.py is standard library only: loaded from its file, it runs without cohort's dependencies
        script = (
            "import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('sandbox', sys.argv[1])\n"
            "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(sandbox)\n"
            "assert sys.prefix.startswith('/tmp/'), sys.prefix\n"
            "print(sandbox.run_python('import os, sys; print(sorted(os.listdir(\"/tmp\")), sys.version_info[:2])'), end='')\n"
        )
        sandbox_py = Path(__file__).resolve().parent.parent / "cohort_grpo" / "tools" / "sandbox.py"
        done = subprocess.run([python, "-I", "-c", script, str(sandbox_py)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"['sandbox'] {tuple(sys.version_info[:2])}\n"
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_private_tmp_is_size_limited(report):
    if not namespaced(report):
        pytest.skip("no mount namespace here")
    text = Sandbox(disk_mb=4, file_size_mb=64).run_python(
        "try:\n    open('/tmp/fill', 'wb').write(b'x' * (8 * 1024 * 1024))\nexcept OSError as e:\n    print(e.strerror)")
    assert text == "No space left on device\n"


def test_the_remount_fallback_of_older_kernels_is_read_only_too(report):
    if not namespaced(report):
        pytest.skip("no mount namespace here")
    sandbox = Sandbox()
    sandbox._remount_fallback = True  # what kernels without mount_setattr (before 5.12) get
    result = sandbox.run("open('/etc/cohort-probe', 'w')")
    assert result.setup["read_only"] == "remount of each mount point"
    assert "Read-only file system" in result.text


def test_network(report):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = (
        "import socket\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close(); print('connected')\n"
        "except OSError as e:\n    print(e.strerror)\n"
    )

    def accepted() -> bool:
        try:
            listener.accept()[0].close()
            return True
        except OSError:
            return False

    try:
        if "network" in report["setup"].get("namespaces", []):
            assert run_python(code) == "Network is unreachable\n"  # its own network namespace, loopback down
            assert not accepted()
            assert report["contained"]["network"]
        else:
            assert report["contained"]["network"] is False and run_python(code) == "connected\n"
            assert accepted()
        # without namespaces the network is NOT contained
        assert Sandbox(isolation="none").run_python(code) == "connected\n"
        assert accepted()
    finally:
        listener.close()


def test_fork_bomb_is_bounded_by_the_process_limit(report):
    if not report["contained"]["process_count"]:
        pytest.skip("RLIMIT_NPROC is not set here (the program has no uid of its own)")
    bounded = Sandbox(max_processes=16).run(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('forks:', n, e.strerror)")
    text = bounded.text
    forks = int(text.split()[1])
    assert 10 <= forks < 16 and "Resource temporarily unavailable" in text
    result = Sandbox(timeout_s=2).run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                      "        pass")
    assert result.stopped == "timeout"
    assert process_gone(result.pgid)
    if report["setup"].get("mode") == "root":  # no process of either run's private uid is left
        # only these two runs' uids: under pytest -n, other workers' sandboxes run beside this one
        uids = {bounded.setup["uid"], result.setup["uid"]}
        assert len(uids) == 2 and min(uids) >= 2_000_000_000
        assert [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) in uids] == []


def _uid_of(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def test_privileges_are_dropped(report):
    text = run_python("import os; print(os.getuid(), os.geteuid())")
    uid = int(text.split()[0])
    if namespaced(report) or os.geteuid() == 0 and report["contained"]["privileges"]:
        assert uid != 0 and report["contained"]["privileges"]
        capabilities = run_python("print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0])")
        assert capabilities.split()[1] == "0000000000000000"
        assert "Operation not permitted" in run_python(
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.mount(None, b'/', None, 32 | 4096, None)\nimport os; print(os.strerror(ctypes.get_errno()))")


def test_a_user_namespace_of_its_own_does_not_undo_the_containment(report):
    """The program may create a user namespace where the kernel allows it (root in it, with every
    capability there), but the mounts it inherits are locked: it cannot unhide or remount them."""
    if not namespaced(report):
        pytest.skip("no mount namespace here")
    text = run_python(
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nuid = os.getuid()\n"
        "if libc.unshare(0x10000000 | 0x00020000) != 0:\n    print('no user namespace')\nelse:\n"
        "    open('/proc/self/setgroups', 'w').write('deny')\n"
        "    open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')\n"
        "    print('umount', libc.umount2(b'/root', 2), libc.mount(None, b'/', None, 32 | 4096, None))\n"
        "    try:\n        open('/etc/cohort-probe', 'w')\n    except OSError as e:\n        print(e.strerror)\n")
    assert text in ("no user namespace\n", "umount -1 -1\nRead-only file system\n")


def test_require_isolation_refuses_when_there_is_none():
    result = Sandbox(isolation="none", require_isolation=True).run("print('ran')")
    assert result.stopped == "refused"
    assert result.text.startswith("sandbox unavailable: ") and "ran" not in result.text


# -- the report and concurrency -----------------------------------------------------------------------------------


def test_report_is_measured_and_consistent(report):
    assert set(report["contained"]) == {"network", "filesystem_writes", "environment", "other_processes",
                                        "privileges", "process_count", "stray_children"}
    assert report["contained"]["environment"]
    assert report["measured"]["escaped_writes"] == [] or not report["contained"]["filesystem_writes"]
    if namespaced(report):
        assert all(report["contained"].values()), report
        assert report["measured"]["network"] == "Network is unreachable"
        assert report["measured"]["visible_processes"] <= 3


def test_concurrent_runs_are_separate():
    sandbox = Sandbox()
    code = "import time\nopen('mine', 'w').write('{i}')\ntime.sleep(0.2)\nprint({i}, open('mine').read())"
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: sandbox.run_python(code.format(i=i)), range(16)))
    assert texts == [f"{i} {i}\n" for i in range(16)]
