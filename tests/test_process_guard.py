"""A child that starts processes of its own (vLLM's server: an engine core and a worker) runs under
a guard (``store.process.spawn_guarded``): whatever ends us, when the guard is told to stop, or
when the child exits by itself, every process of the child's session goes. Without it, vLLM's
engine core and worker outlived a SIGKILLed test process (seen: reparented to init)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mooncake_keys.store.process import spawn_guarded
from support.child import gone, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

#: A child that starts a grandchild of its own (no death signal: as vLLM's engine core), prints
#: the grandchild's PID and stays; ``EXIT`` in its environment makes it exit at once instead.
TREE = textwrap.dedent("""
    import os, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(grandchild.pid, flush=True)
    if os.environ.get("EXIT"):
        sys.exit(3)
    time.sleep(300)
""")


def read_pid(path, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text.split()[0])
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"no PID in {path}")


def start(tmp_path, **env):
    out = tmp_path / "tree.out"
    pid_file = str(tmp_path / "child.pid")
    with open(out, "w") as f:
        guard = spawn_guarded([sys.executable, "-c", TREE], pid_file=pid_file, grace=2.0, stdout=f,
                              env=dict(os.environ, **env))
    return guard, read_pid(pid_file), read_pid(out)


def test_stopping_the_guard_ends_the_child_and_what_it_started(tmp_path):
    guard, child, grandchild = start(tmp_path)
    assert not gone(child) and not gone(grandchild)
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(30) == 128 + signal.SIGTERM  # the child's own end, passed on
    assert wait_gone([child, grandchild]) == []


def test_a_child_that_exits_by_itself_takes_what_it_started_with_it(tmp_path):
    guard, child, grandchild = start(tmp_path, EXIT="1")
    assert guard.wait(30) == 3
    assert wait_gone([child, grandchild]) == []


def test_whatever_ends_us_ends_the_whole_tree(tmp_path):
    """A parent SIGKILLed (it cannot clean up): its guard is told by the kernel, and the child,
    and the grandchild no signal of the parent's would reach, go too."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys, time
        from mooncake_keys.store.process import spawn_guarded
        guard = spawn_guarded([sys.executable, "-c", {TREE!r}], pid_file={str(tmp_path / "child.pid")!r}, grace=2.0,
                              stdout=open({str(tmp_path / "tree.out")!r}, "w"))
        print(guard.pid, flush=True)
        time.sleep(300)
    """))
    with open(tmp_path / "driver.out", "w") as f:
        parent = subprocess.Popen([sys.executable, str(driver)], stdout=f, cwd=os.getcwd())
    try:
        guard = read_pid(tmp_path / "driver.out")
        child, grandchild = read_pid(tmp_path / "child.pid"), read_pid(tmp_path / "tree.out")
        assert not gone(guard) and not gone(child) and not gone(grandchild)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone([guard, child, grandchild], timeout=30) == []
