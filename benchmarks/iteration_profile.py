"""Where one PPO iteration's time and memory go: `python -m prmppo` with each phase timed and profiled.

    PYTHONPATH=src python benchmarks/iteration_profile.py --out /tmp/prof --profile-iteration 3 -- \
        --model <model dir> --data-dir <gsm8k dir> --engine inprocess --sync none --iterations 4 ...

Everything after `--` is `benchmarks/trl_compare.py`'s own arguments: the run is that script's prmppo side
(the same overrides of `python -m prmppo`, its run dir OUT/run), here in this process. For every iteration it
records, per phase (sample, assemble, update), the wall seconds and on CUDA the allocator's peak
(`torch.cuda.max_memory_allocated` and `max_memory_reserved`, reset at each phase's start): written to
OUT/phases.jsonl. For iteration `--profile-iteration` it also runs torch.profiler (CPU and CUDA) and writes
OUT/ops_cuda.txt (the ops by device time), OUT/ops_cpu.txt (by host self time), OUT/phases.txt (each
phase's device-busy time against its wall time, from the `phase:*` ranges), OUT/trace.json (a Chrome
trace, for `chrome://tracing` or Perfetto) and OUT/kernels_by_phase.txt (each phase's kernels from that trace:
device time by family, matmul, attention, inductor's fused kernels, and by kernel name, and the time the device
sat idle inside the phase, in gaps between its kernels and copies). With `--stack` the profiled iteration records
Python frames too, and kernels_by_phase.txt says what the host ran during each phase's idle gaps: the time by
the innermost frame of prmppo's code and by the innermost frame of all (a `nonzero`, a guard check, a peft
context manager, ...), and where other threads (a CUDA backward's autograd engine thread) ran prmppo's code.

With `--sync-iteration N` (CUDA), iteration N runs with CUDA's sync debug mode on warn: every operation that
makes the host wait for the device (`.item()`, a copy to the host, `nonzero`, ...) is recorded with its phase
and the line of prmppo's code that made it (the innermost frame under src/prmppo, and the innermost frame of
all), counted in OUT/syncs.txt. After such a wait the device idles until the host queues its next kernel.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import json
import runpy
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

PHASES = ("sample", "assemble", "update")


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("give the run's overrides after `--` (see the docstring)")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for phases.jsonl and the profile's files")
    parser.add_argument("--profile-iteration", type=int, default=None,
                        help="the iteration (0-based) to run under torch.profiler; none by default")
    parser.add_argument("--stack", action="store_true",
                        help="record Python frames in the profiled iteration (with_stack): kernels_by_phase.txt then "
                        "says what the host ran while the device sat idle; it slows the host")
    parser.add_argument("--sync-iteration", type=int, default=None,
                        help="the iteration (0-based) whose host-device synchronisations are recorded (CUDA); "
                        "none by default")
    args = parser.parse_args(argv[:cut])
    if args.sync_iteration is not None and args.sync_iteration == args.profile_iteration:
        parser.error("--sync-iteration and --profile-iteration name the same iteration: give them different ones "
                     "(sync debug mode's warnings would distort the profile)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trl_compare

    compare = trl_compare.parse_args(argv[cut + 1:])
    return args, trl_compare.prmppo_overrides(compare, Path(args.out) / "run")


def _phase_wrapper(method, name: str, state: dict):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        state["phase"] = name
        with torch.profiler.record_function(f"phase:{name}"):
            result = method(self, *args, **kwargs)
        state["phase"] = None
        if cuda:
            torch.cuda.synchronize()
        row = {"seconds": time.perf_counter() - start}
        if cuda:
            row |= {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
        state["current"][name] = row
        return result
    return wrapped


SYNC_MESSAGE = "synchronizing"  # CUDA's sync debug warning: "called a synchronizing CUDA operation"
SRC = str(Path(__file__).resolve().parents[1] / "src" / "prmppo")


class SyncSites:
    """Counts of the host-device synchronisations CUDA's sync debug mode warns of, by (phase, prmppo's line,
    innermost line): installed as `warnings.showwarning` while `record()` runs."""

    def __init__(self, state: dict) -> None:
        self.state, self.counts = state, {}

    def show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE not in str(message):
            return self.previous(message, category, filename, lineno, file, line)
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if f.filename.startswith(SRC)]
        site = f"{Path(ours[-1].filename).relative_to(Path(SRC).parent)}:{ours[-1].lineno} {ours[-1].line}" if ours \
            else "(outside src/prmppo)"
        inner = f"{filename}:{lineno}"
        key = (self.state.get("phase") or "(between phases)", site, inner)
        self.counts[key] = self.counts.get(key, 0) + 1
        return None

    @contextlib.contextmanager
    def record(self):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            self.previous, warnings.showwarning = warnings.showwarning, self.show
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")

    def table(self) -> str:
        lines = [f"{sum(self.counts.values())} synchronisations"]
        for (phase, site, inner), count in sorted(self.counts.items(), key=lambda kv: (kv[0][0], -kv[1])):
            lines.append(f"{phase:<16} {count:5d}x  {site}    [{inner}]")
        return "\n".join(lines) + "\n"


def install(out: Path, profile_iteration: int | None, sync_iteration: int | None = None,
            stack: bool = False) -> None:
    """Wrap PPOTrainer's phases and its iteration; the records go to `out`."""
    from prmppo.ppo.loop import PPOTrainer

    state = {"current": {}, "phase": None}
    for name, attribute in (("sample", "sample"), ("assemble", "assemble"), ("update", "update")):
        setattr(PPOTrainer, attribute, _phase_wrapper(getattr(PPOTrainer, attribute), name, state))
    iteration = PPOTrainer.iteration

    @functools.wraps(iteration)
    def profiled_iteration(self, number: int):
        state["current"] = {}
        if number == sync_iteration:
            with SyncSites(state).record() as sites:
                metrics = iteration(self, number)
            (out / "syncs.txt").write_text(sites.table())
        elif number != profile_iteration:
            metrics = iteration(self, number)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities, record_shapes=False, with_stack=stack) as prof:
                metrics = iteration(self, number)
            _write_profile(prof, out)
        with (out / "phases.jsonl").open("a") as handle:
            handle.write(json.dumps({"iteration": number, **state["current"],
                                     "iteration_s": metrics.get("perf/iteration_s")}) + "\n")
        return metrics

    PPOTrainer.iteration = profiled_iteration


def _write_profile(prof, out: Path) -> None:
    averages = prof.key_averages()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    (out / "ops_cuda.txt").write_text(averages.table(sort_by=sort, row_limit=50))
    (out / "ops_cpu.txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=50))
    lines = []
    for event in averages:
        if event.key.startswith("phase:"):
            device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
            lines.append(f"{event.key}: wall {event.cpu_time_total / 1e6:.3f} s, device {device_us / 1e6:.3f} s")
    (out / "phases.txt").write_text("\n".join(lines) + "\n")
    with contextlib.suppress(Exception):  # a trace too large to write is not worth failing the run over
        prof.export_chrome_trace(str(out / "trace.json"))
    if (out / "trace.json").exists():
        with contextlib.suppress(Exception):
            (out / "kernels_by_phase.txt").write_text(kernels_by_phase(json.loads((out / "trace.json").read_text())))


# a kernel's family, by the first pattern its lower-cased name contains (inductor's kernels first: their names
# carry the ops they fuse, `triton_poi_fused__scaled_dot_product_cudnn_attention_...` among them)
KERNEL_FAMILIES = (("fused (inductor)", ("triton",)),
                   ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
                   ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
                   ("memory copy / fill", ("memcpy", "memset", "copy", "fill")))


def kernel_family(name: str) -> str:
    lower = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in lower for k in keys)), "other")


def idle_gaps(work: list[tuple[float, float]], start: float, end: float, least: float = 100.0):
    """The device's idle time inside [start, end) given its work intervals `work` (sorted (begin, end) pairs, in
    the trace's microseconds; overlapping streams merge), and the idle gaps longer than `least` us, as (begin, end)
    pairs."""
    idle, gaps, cursor = 0.0, [], start
    for begin, finish in work:
        if begin >= end:
            break
        if finish <= cursor:
            continue
        if begin > cursor:
            idle += begin - cursor
            if begin - cursor > least:
                gaps.append((cursor, begin))
        cursor = max(cursor, min(finish, end))
    if end > cursor:
        idle += end - cursor
        if end - cursor > least:
            gaps.append((cursor, end))
    return idle, gaps


def _innermost(frames: list[tuple[float, float, str]], starts: list[float], t: float, scan: int = 20000):
    """The innermost of `frames` (one thread's properly nested (begin, end, name) ranges, sorted by begin;
    `starts` their begins) that contains time `t`, or None: the latest-begun range still open at `t`."""
    i = bisect.bisect_right(starts, t) - 1
    for j in range(i, max(i - scan, -1), -1):
        if frames[j][1] >= t:
            return frames[j][2]
    return None


def host_in_gaps(frames: list[tuple[float, float, str]], gaps: list[tuple[float, float]], step: float = 10.0):
    """What the host ran while the device sat idle: over the idle `gaps` ((begin, end) us), sampled every `step`
    us, the microseconds spent in each innermost Python frame of prmppo's own code and in each innermost frame
    of all (`frames`: the host thread's `python_function` ranges of a trace made with `with_stack=True`).
    Returns (ours, any), each {frame name: us}; a time in no frame counts as "(no Python frame)"."""
    ours_frames = sorted(f for f in frames if "prmppo/" in f[2])
    all_frames = sorted(frames)
    ours_starts, all_starts = [f[0] for f in ours_frames], [f[0] for f in all_frames]
    ours: dict[str, float] = {}
    every: dict[str, float] = {}
    for begin, end in gaps:
        t = begin + step / 2
        while t < end:
            weight = min(step, end - (t - step / 2))
            name = _innermost(ours_frames, ours_starts, t)
            name = name[name.find("prmppo/"):] if name else "(no prmppo frame)"
            ours[name] = ours.get(name, 0.0) + weight
            name = _innermost(all_frames, all_starts, t) or "(no Python frame)"
            every[name] = every.get(name, 0.0) + weight
            t += step
    return ours, every


def kernels_by_phase(trace: dict, top: int = 25, top_frames: int = 12) -> str:
    """Per phase of a Chrome trace (torch.profiler's export): the device time of its kernels, by family and by
    kernel name. A phase's span is its `phase:*` range on the device timeline (`gpu_user_annotation`), else its
    host range run on to the next phase's start (the wrappers synchronise the device at each phase's end), the
    last one to its own end or the last kernel's, whichever is later."""
    events = trace.get("traceEvents", [])
    spans = [(e["name"][6:], e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("phase:")]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    device_work = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                         if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    host_tids = {e.get("tid") for e in events
                 if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("phase:")}
    frames, others = [], {}  # the phase thread's Python frames; every other thread's, by thread
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e:
            frame = (e["ts"], e["ts"] + e["dur"], str(e.get("name")))
            (frames if e.get("tid") in host_tids else others.setdefault(e.get("tid"), [])).append(frame)
    if not spans:  # the last phase runs on to the last kernel's end
        host = sorted((e["ts"], e["name"][6:], e["ts"] + e.get("dur", 0)) for e in events
                      if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("phase:"))
        last = max((k["ts"] + k["dur"] for k in kernels), default=0)
        ends = [ts for ts, _, _ in host[1:]] + [max(last, host[-1][2]) if host else 0]
        spans = [(name, ts, end) for (ts, name, _), end in zip(host, ends)]
    lines = []
    for name, start, end in spans:
        inside = [k for k in kernels if start <= k["ts"] < end]
        total = sum(k["dur"] for k in inside)
        lines.append(f"== {name}: span {(end - start) / 1e6:.3f} s, kernels {total / 1e6:.3f} s, {len(inside)} launches")
        idle, gaps = idle_gaps(device_work, start, end)
        lengths = [b - a for a, b in gaps]
        lines.append(f"  device idle {idle / 1e3:.1f} ms of the span; gaps over 100 us: {len(gaps)}, "
                     f"{sum(lengths) / 1e3:.1f} ms, the largest {max(lengths, default=0) / 1e3:.1f} ms")
        if frames and gaps:
            ours, every = host_in_gaps(frames, gaps)
            for title, table in (("innermost frame of src/prmppo", ours), ("innermost frame", every)):
                lines.append(f"  the host in those gaps, by {title}:")
                for frame, us in sorted(table.items(), key=lambda kv: -kv[1])[:top_frames]:
                    lines.append(f"    {us / 1e3:9.1f} ms  {frame[:150]}")
            # a CUDA backward runs on the autograd engine's own thread: its Python (a checkpoint's recompute, hooks)
            # launches kernels there, so its frames in the gaps are counted too, where it ran prmppo's code
            elsewhere: dict[str, float] = {}
            for thread_frames in others.values():
                for frame, us in host_in_gaps(thread_frames, gaps)[0].items():
                    if frame != "(no prmppo frame)":
                        elsewhere[frame] = elsewhere.get(frame, 0.0) + us
            if elsewhere:
                lines.append("  other threads (the autograd engine's) in those gaps, by innermost frame of src/prmppo:")
                for frame, us in sorted(elsewhere.items(), key=lambda kv: -kv[1])[:top_frames]:
                    lines.append(f"    {us / 1e3:9.1f} ms  {frame[:150]}")
        families: dict[str, float] = {}
        by_name: dict[str, list] = {}
        for k in inside:
            families[kernel_family(k["name"])] = families.get(kernel_family(k["name"]), 0.0) + k["dur"]
            row = by_name.setdefault(k["name"], [0.0, 0])
            row[0] += k["dur"]
            row[1] += 1
        for family, us in sorted(families.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {family:<20} {us / 1e3:9.1f} ms  {100 * us / max(total, 1):5.1f}%")
        for kernel, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"    {us / 1e3:9.1f} ms {count:6d}x  {kernel[:150]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    install(out, args.profile_iteration, args.sync_iteration, args.stack)
    sys.argv = ["prmppo", *overrides]
    try:
        runpy.run_module("prmppo", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
