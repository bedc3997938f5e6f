"""CPU seconds a server's processes spend, per thread, read from ``/proc`` (Linux).

``snapshot(pgid)`` reads every thread of every process in a process group (a server started
in its own session: the HTTP process and its engine process); ``spent(before, after)`` says
where the CPU went between two snapshots: the busiest process (the engine) split into its
main thread (the step loop) and its other threads (the compute library's workers, storage
I/O), and the rest of the group (the HTTP front end). Elsewhere it reports nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

Snapshot = dict[int, dict[int, float]]  # pid -> thread id -> CPU seconds


def _cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def snapshot(pgid: int) -> Snapshot:
    out: Snapshot = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            threads = {}
            for task in (stat.parent / "task").iterdir():
                threads[int(task.name)] = _cpu_seconds(task / "stat")
            out[int(stat.parent.name)] = threads
        except (OSError, IndexError, ValueError):
            continue  # a process or thread that ended meanwhile
    return out


def spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds between the snapshots: ``engine_main_s``, ``engine_threads_s`` (its other
    threads, ``engine_threads`` of them busy for more than 0.1 s), ``front_end_s``."""
    if not after:
        return {}
    delta = {
        pid: {t: s - before.get(pid, {}).get(t, 0.0) for t, s in threads.items()}
        for pid, threads in after.items()
    }
    engine = max(delta, key=lambda pid: sum(delta[pid].values()))
    others = [s for t, s in delta[engine].items() if t != engine]
    return {
        "engine_main_s": delta[engine].get(engine, 0.0),
        "engine_threads_s": sum(others),
        "engine_threads": sum(s > 0.1 for s in others),
        "front_end_s": sum(sum(d.values()) for pid, d in delta.items() if pid != engine),
    }
