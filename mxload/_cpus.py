"""How many CPU cores this process may really use: the CPU affinity mask and
the cgroup CPU quota (containers, Kubernetes limits, systemd slices), not
``os.cpu_count()``, which counts the machine's cores."""
from __future__ import annotations

import math
import os
import warnings

__all__ = ["usable_cores", "cgroup_cpu_quota", "warn_if_oversubscribed"]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ancestors(path: str) -> list[str]:
    """`path` and every parent cgroup up to the root: a quota set on any of them applies."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(root: str, path: str) -> float | None:
    quotas = []
    for cgroup in _ancestors(path):
        text = _read(os.path.join(root, cgroup.lstrip("/"), "cpu.max"))
        if text:
            fields = text.split()   # "max 100000" or "<quota> <period>", both in microseconds
            if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
                quotas.append(int(fields[0]) / int(fields[1]))
    return min(quotas) if quotas else None


def _v1_quota(root: str, path: str) -> float | None:
    quotas = []
    for controller in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        base = os.path.join(root, controller)
        if not os.path.isdir(base):
            continue
        for cgroup in _ancestors(path):
            folder = os.path.join(base, cgroup.lstrip("/"))
            quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), \
                _read(os.path.join(folder, "cpu.cfs_period_us"))
            if quota and period and int(quota) > 0 and int(period) > 0:   # -1: no quota
                quotas.append(int(quota) / int(period))
        break
    return min(quotas) if quotas else None


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """This process's cgroup CPU quota in cores (``1.5`` = 150 ms of CPU per
    100 ms), or None when there is no quota (or no cgroup file system).

    Reads cgroup v2 ``cpu.max`` and cgroup v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us`` of the process's cgroup and its ancestors (the
    smallest applies)."""
    text = _read(proc_cgroup)
    if not text:
        return None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            quota = _v2_quota(root, path)
        elif "cpu" in controllers.split(","):
            quota = _v1_quota(root, path)
        else:
            continue
        if quota is not None:
            return quota
    # Inside a container the cgroup path may be shown relative to a namespace
    # whose root is mounted at `root` itself.
    return _v2_quota(root, "/")


def usable_cores() -> int:
    """CPU cores this process can keep busy: the affinity mask's size
    (``os.sched_getaffinity``), capped by the cgroup CPU quota rounded up;
    ``os.cpu_count()`` where neither is available.  Always at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # macOS has no sched_getaffinity
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has used since boot (/proc/stat); None without it."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds this process and its reaped children used."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def warn_if_oversubscribed(num_workers: int, stacklevel: int = 3) -> None:
    """Warn when `num_workers` worker processes exceed the cores this process
    may use, as PyTorch's DataLoader does (when it is built, and when an
    iteration starts its workers): each time, the warnings filters deciding
    what shows (by default, once per line of the program that made it)."""
    cores = usable_cores()
    if num_workers <= cores:
        return
    warnings.warn(
        f"This DataLoader will create {num_workers} worker processes in total, but this process can "
        f"use only {cores} CPU cores (its CPU affinity and cgroup CPU quota), which is smaller than "
        f"what this DataLoader is going to create. Please be aware that excessive worker creation "
        f"might get DataLoader running slow or even freeze: lower num_workers to {cores} or fewer "
        f"(more workers than cores only help when __getitem__ waits on I/O).", UserWarning,
        stacklevel=stacklevel)
