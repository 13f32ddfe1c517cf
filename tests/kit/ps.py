"""What ps shows of a process."""

from pathlib import Path


def shown(pid: int) -> str:
    """/proc/PID/cmdline as ps prints it: its arguments on one line (a title and the NULs after it, once the
    process set one)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()
