"""What a `Sandbox` contains on this machine, measured rather than assumed: a probe program run inside it tries
the network (a listener on the host's loopback), writes outside its working directory, reads the parent's
environment and counts the processes it can see; the host then checks what got through. `Sandbox.report()`
(and `sandbox_report()` for `run_python`'s) measures once and keeps the answer; docs/howto/tools.md reads it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SANDBOX_FOLDER = Path(__file__).resolve().parent  # a folder a contained program must not be able to write


def measured_containment(sandbox) -> dict:
    """`Sandbox.report()`'s answer for `sandbox`: what is contained, the launcher's setup, the probe's findings, the limits."""
    token = f"cohort-probe-{os.getpid()}-{time.monotonic_ns()}"
    outside_files = [Path(tempfile.gettempdir()) / token, SANDBOX_FOLDER / token]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    probe = textwrap.dedent(f"""
        import json, os, socket
        out = {{"uid": os.getuid(), "environ": sorted(os.environ)}}
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
            out["network"] = "connected"
        except OSError as e:
            out["network"] = e.strerror or str(e)
        out["writes"] = {{}}
        for path in {[str(p) for p in outside_files]!r}:
            try:
                with open(path, "w") as f:
                    f.write("x")
                out["writes"][path] = "written"
            except OSError as e:
                out["writes"][path] = e.strerror or str(e)
        try:
            with open("/proc/{os.getpid()}/environ", "rb") as f:
                out["parent_environ"] = "readable" if f.read() else "empty"
        except OSError as e:
            out["parent_environ"] = e.strerror or str(e)
        out["visible_processes"] = sum(name.isdigit() for name in os.listdir("/proc")) if os.path.isdir("/proc") else None
        print(json.dumps(out))
    """)
    try:
        result = sandbox.run(probe)
        try:
            listener.accept()[0].close()
            host_saw_connection = True
        except OSError:
            host_saw_connection = False
    finally:
        listener.close()
    escaped = [str(p) for p in outside_files if p.exists()]
    for p in outside_files:
        try:
            p.unlink()
        except OSError:
            pass
    try:
        measured = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        measured = {"error": result.text}
    setup = result.setup
    contained = {
        "network": not host_saw_connection and measured.get("network") != "connected",
        "filesystem_writes": not escaped,
        # the interpreter itself sets LC_CTYPE when it coerces the C locale (PEP 538)
        "environment": set(measured.get("environ", ["?"])) <= {"LC_CTYPE"},
        "other_processes": measured.get("parent_environ") != "readable",
        "privileges": setup.get("uid") not in (None, 0) and (setup.get("mode") == "user" or os.geteuid() == 0),
        "process_count": bool(setup.get("process_limit")),
        # a PID namespace, or else (Linux) init as child subreaper, kills what the program leaves behind
        "stray_children": "pid" in setup.get("namespaces", []) or sys.platform.startswith("linux"),
    }
    return {
        "platform": sys.platform,
        "mode": {"root": "namespaces (root)", "user": "namespaces (user namespace)"}.get(setup.get("mode"),
                                                                                       "limits only"),
        "contained": contained,
        "setup": setup,
        "measured": {**measured, "host_saw_connection": host_saw_connection, "escaped_writes": escaped,
                     "seconds": round(result.seconds, 3)},
        "limits": {"timeout_s": sandbox.timeout_s, "cpu_s": sandbox.cpu_s, "memory_mb": sandbox.memory_mb,
                   "output_bytes": sandbox.output_bytes, "file_size_mb": sandbox.file_size_mb,
                   "disk_mb": sandbox.disk_mb, "max_processes": sandbox.max_processes,
                   "max_open_files": sandbox.max_open_files},
    }
