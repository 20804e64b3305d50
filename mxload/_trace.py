"""The profiler's raw records as a timeline: spans per track, written in the Trace Event
Format (Perfetto, chrome://tracing) by Profiler.save_chrome_trace."""
from __future__ import annotations

import json
import os
from typing import Any

# (track, label, batch index or None, start ns, duration ns)
Span = tuple[str, str, int | None, int, int]


def spans(records: list[tuple[Any, ...]]) -> list[Span]:
    """A profiler's raw records as (track, label, batch index or None, start ns, dur ns)."""
    out: list[Span] = []
    for record in records:
        kind = record[0]
        if kind == "batch":
            _, worker_id, idx, start, fetch_ns, collate_ns, sent, ready = record
            # In-process loading (worker -1) happens inside the consumer's next().
            track = f"worker {worker_id}" if worker_id >= 0 else "consumer"
            out.append((track, "fetch", idx, start, fetch_ns))
            out.append((track, "collate", idx, start + fetch_ns, collate_ns))
            if sent:
                out.append(("fetcher", "transport", idx, sent, max(0, ready - sent)))
        elif kind == "next":
            _, idx, call, now, previous = record
            if previous is not None:
                out.append(("consumer", "compute", None, previous, max(0, call - previous)))
            out.append(("consumer", "next() ->", idx, call, now - call))
        else:  # "epoch"
            out.append(("consumer", "start epoch", None, record[1], record[2]))
    return out


def write_chrome_trace(path: str, spans: list[Span], start_ns: int | None) -> None:
    """Write `spans` in the Trace Event Format: one track per worker, the fetcher and the consumer."""
    origin = start_ns or (min(sp[3] for sp in spans) if spans else 0)
    pid = os.getpid()
    tracks = sorted({sp[0] for sp in spans}, key=_track_order)
    tids = {name: i + 1 for i, name in enumerate(tracks)}
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "mxload"}}]
    for name, tid in tids.items():
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                      "args": {"sort_index": tid}})
    for track, label, batch_index, start, dur in spans:
        name = label if batch_index is None else f"{label} batch {batch_index}"
        trace.append({"name": name, "cat": track.split()[0], "ph": "X", "pid": pid, "tid": tids[track],
                      "ts": (start - origin) / 1e3, "dur": max(dur, 0) / 1e3,
                      "args": {} if batch_index is None else {"batch": batch_index}})
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def _track_order(name: str) -> tuple[Any, ...]:
    kind = name.split()[0]
    rank = {"consumer": 0, "fetcher": 1, "worker": 2}.get(kind, 3)
    return (rank, int(name.split()[1]) if kind == "worker" else 0)
