"""Measuring this machine's links: the alpha-beta figures of ``torch.distributed`` collectives between local
processes (gloo on CPU; NCCL, one GPU per rank, where there are GPUs), cached per machine.

:func:`measured_link` starts ``ranks`` processes on a free local TCP port; each joins the process group and
times ``all_reduce``, ``all_gather`` and ``reduce_scatter`` (:data:`KINDS`) on float32 tensors of
:data:`SIZES` bytes (the full tensor: what :meth:`fxforge.core.links.Link.seconds` takes). Repetitions are
interleaved (every size and kind once per round, the first round a warm-up), each collective is started
after a barrier and timed on every rank, the slowest rank's time counts, and the median over the rounds is
kept. :func:`fxforge.core.links.fit_link` then fits the latency and the bus bandwidth of the ring model,
over all timings and per kind. It takes a few seconds on a two-core machine, most of it the processes'
start (importing torch).

The result is remembered per backend, rank count, host, torch build and processor (CPU or GPU model) in
``$FXFORGE_CACHE_DIR/links.json`` (default ``~/.cache/fxforge/links.json``) and in memory, so it runs
once per machine; the roofline's switch (:func:`fxforge.runtime.roofline.disk_cache_enabled`:
``FXFORGE_MACHINE_CACHE=0``, or ``FXFORGE_AUTOTUNE_CACHE=0`` as the test suite sets) keeps it off the disk.
A measurement taken while other work loaded the machine says so in the link's ``source``.

Example (starts processes the first time on a machine)::

    link = measured_link("gloo", 2)          # Link(name='gloo 2 ranks on host', alpha_s=..., bandwidth_gbs=...)
    link.seconds("all_reduce", 2**20, 2)      # predicted seconds of a 1 MiB all-reduce between 2 processes

Example:
    >>> cache_key("gloo", 2).startswith("v4 gloo ranks 2 host ")
    True
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

from fxforge.core.disk_cache import BUSY_LOAD, cpu_model, machine_load, open_cache
from fxforge.core.links import Link, Timing, fit_link, fit_sync
from fxforge.runtime.roofline import disk_cache_enabled

FILE_NAME = "links.json"
VERSION = 4  # 2: the in-step waits measured too; 3: and the overlap of asynchronous all-reduces; 4: behind
# products that do not stay in cache, up to DDP's bucket size
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives timed."""
SIZES = tuple(4096 * 4**i for i in range(7))
"""The full tensor's bytes of each timed collective: 4 KiB to 16 MiB."""
ROUNDS = 7
"""Timed rounds after one warm-up round: every size and kind once per round, the median kept. Tensors up to
:data:`SMALL` bytes, whose times are short and noisier, run :data:`SMALL_ROUNDS` rounds instead."""
SMALL, SMALL_ROUNDS = 2**18, 21
SEGMENTS_S = (0.0, 0.002, 0.008, 0.032)
"""The stretches of compute (seconds of 256 x 256 matrix products on one thread) each collective of a stream
follows, on CPU links: the in-step waits (:attr:`fxforge.core.links.Link.sync_s`, ``sync_fraction``) are
fitted over them."""
STREAM, STREAM_ROUNDS, STREAM_BYTES = 12, 9, 2**16
"""Collectives per stream, timed rounds (after a warm-up one) and the all-reduce's bytes."""
OVERLAP_BYTES = (2**20, 2**24, 25 * 2**20)
"""The asynchronous all-reduces each timed behind twice its own time of compute, on CPU links (the overlap,
:attr:`fxforge.core.links.Link.overlap`): DDP's first bucket's size, a middle one and DDP's default cap."""
TIMEOUT_S = 120.0
PORT_TRIES = 3
BACKENDS = ("gloo", "nccl")

# Links measured or read in this process, by (cache file or "<memory>", key).
_KNOWN: dict[tuple[str, str], Link] = {}


def cache_key(backend: str, ranks: int) -> str:
    """What a measured link depends on: backend, rank count, host, torch build and the processor.

    Example:
        >>> torch.__version__ in cache_key("gloo", 4)
        True
    """
    if backend == "nccl" and torch.cuda.is_available():
        processor = torch.cuda.get_device_name(0)
    else:
        processor = cpu_model()
    return f"v{VERSION} {backend} ranks {ranks} host {platform.node()} torch {torch.__version__} {processor}"


def measured_link(backend: str = "gloo", ranks: int = 2, *, refresh: bool = False, cache: bool = True) -> Link:
    """The :class:`~fxforge.core.links.Link` of ``ranks`` local processes on ``backend``, measured once per
    machine (see the module docstring), read back from the cache afterwards.

    Args:
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one GPU per rank: needs ``ranks`` GPUs).
        ranks: processes to start, at least 2.
        refresh: measure again even when a result is cached (and store the new one).
        cache: use the cache, in memory and on disk unless the switch says no (False: always measure,
            store nothing).

    Raises:
        ValueError: an unknown backend, fewer than 2 ranks, or NCCL with fewer GPUs than ranks.
        RuntimeError: a worker failed (its last error line is given) or did not finish in time.

    Example:
        >>> measured_link("nccl", 2**20)
        Traceback (most recent call last):
            ...
        ValueError: measuring NCCL between 1048576 ranks needs a GPU per rank; this machine has ...
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if ranks < 2 or int(ranks) != ranks:
        raise ValueError(f"measuring a link needs a whole number of ranks >= 2, not {ranks!r}")
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        raise ValueError(f"measuring NCCL between {ranks} ranks needs a GPU per rank; this machine has "
                         f"{torch.cuda.device_count()} (measure gloo instead, or plan with fxforge.core.links.PUBLISHED)")
    key = cache_key(backend, ranks)
    disk = cache and disk_cache_enabled()
    store = open_cache(FILE_NAME) if disk else None
    memo = (str(store.path) if store is not None else "<memory>", key)
    if cache and not refresh:
        if memo in _KNOWN:
            return _KNOWN[memo]
        entry = store.get(key) if store is not None else None
        if isinstance(entry, dict):
            try:
                link = Link.from_dict(entry)
            except (KeyError, TypeError, ValueError):
                link = None
            if link is not None:
                _KNOWN[memo] = link
                return link
    load = machine_load()
    timings, waits, overlaps = _launch(backend, ranks, SIZES, ROUNDS, SMALL_ROUNDS, SMALL)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    host = platform.node() or "this host"
    note = f"; machine busy while measured (other work {load:.1f} per core)" if load > BUSY_LOAD else ""
    link = fit_link(timings, name=f"{backend} {ranks} ranks on {host}",
                    source=f"measured {backend} {ranks} ranks on {host} at {now}: {', '.join(KINDS)} of "
                           f"{SIZES[0]} B to {SIZES[-1]} B, median of {ROUNDS} interleaved rounds ({SMALL_ROUNDS} up to "
                           f"{SMALL} B){note}")
    if waits:  # over the fitted link's time of the same all-reduce: what the planner prices it at
        alone = link.seconds("all_reduce", STREAM_BYTES, ranks)
        sync_s, fraction = fit_sync([(compute, seconds - alone) for compute, seconds in waits])
        link = dataclasses.replace(
            link, sync_s=sync_s, sync_fraction=fraction,
            source=f"{link.source}; in a step, each collective waits {sync_s * 1e3:.2f} ms + {fraction:.1%} of the "
                   f"compute before it (streams of {STREAM} all-reduces of {STREAM_BYTES} B, each after "
                   f"{', '.join(f'{x * 1e3:g}' for x in SEGMENTS_S)} ms of compute, median of {STREAM_ROUNDS} rounds)")
    if overlaps:  # (the all-reduce's own seconds, what it added behind compute), per size
        alone, added = sum(a for a, _ in overlaps), sum(max(0.0, x) for _, x in overlaps)
        hidden = min(1.0, max(0.0, 1 - added / alone)) if alone > 0 else 0.0
        link = dataclasses.replace(
            link, overlap=hidden,
            source=f"{link.source}; an all-reduce started before compute hides {hidden:.0%} of its time behind "
                   f"it ({', '.join(f'{n} B' for n in OVERLAP_BYTES)}, each behind twice its time of 1024 x 1024 "
                   f"products, median of {2 * STREAM_ROUNDS} rounds)")
    if cache:
        if store is not None:
            store.put(key, link.to_dict())
            store.save()
        _KNOWN[memo] = link
    return link


def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``; every local multi-process run takes one).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(backend: str, ranks: int, sizes: tuple[int, ...], rounds: int, small_rounds: int, small: int
            ) -> tuple[list[Timing], list[tuple[float, float]], list[tuple[float, float]]]:
    """Start the ``ranks`` worker processes (:func:`_time_collectives`, run from its own source so that a
    worker imports torch and nothing of fxforge) and return rank 0's medians, the streams' collectives
    (``(compute seconds before a collective, its seconds there)``) and the asynchronous all-reduces
    (``(seconds alone, seconds added behind compute)``, one per :data:`OVERLAP_BYTES`); the last two none on
    GPUs. A port another process took
    between choosing it and binding it is chosen again (up to :data:`PORT_TRIES` times)."""
    for _ in range(PORT_TRIES - 1):
        try:
            return _run_workers(backend, ranks, sizes, rounds, small_rounds, small)
        except _PortTaken:
            continue
    try:
        return _run_workers(backend, ranks, sizes, rounds, small_rounds, small)
    except _PortTaken as taken:
        raise RuntimeError(f"measuring the {backend} link: no free local port ({taken})") from None


class _PortTaken(RuntimeError):
    pass


def _run_workers(backend: str, ranks: int, sizes: tuple[int, ...], rounds: int, small_rounds: int, small: int
                 ) -> tuple[list[Timing], list[tuple[float, float]], list[tuple[float, float]]]:
    port = free_port()
    code = textwrap.dedent(inspect.getsource(_time_collectives))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="fxforge-links-") as folder:
        procs, outs, errs = [], [], []
        try:
            for rank in range(ranks):
                call = (f"_time_collectives({backend!r}, {rank}, {ranks}, {port}, {list(sizes)!r}, {rounds}, "
                        f"{small_rounds}, {small}, {list(KINDS)!r}, {list(SEGMENTS_S)!r}, "
                        f"{(STREAM, STREAM_ROUNDS, STREAM_BYTES)!r}, {list(OVERLAP_BYTES)!r})")
                outs.append(open(os.path.join(folder, f"{rank}.out"), "w+", encoding="utf-8"))  # noqa: SIM115
                errs.append(open(os.path.join(folder, f"{rank}.err"), "w+", encoding="utf-8"))  # noqa: SIM115
                procs.append(subprocess.Popen([sys.executable, "-c", f"{code}\n{call}\n"], env=env,
                                              stdout=outs[-1], stderr=errs[-1]))
            failed = _wait(procs, backend)
            errors = {}
            for rank in failed:
                errs[rank].seek(0)
                text = errs[rank].read()
                if "EADDRINUSE" in text or "ddress already in use" in text:
                    raise _PortTaken(f"port {port}")
                lines = [line for line in text.strip().splitlines() if line.strip()]
                errors[rank] = lines[-1] if lines else f"exit code {procs[rank].returncode}"
            if errors:
                rank, line = min(errors.items())
                raise RuntimeError(f"measuring the {backend} link: rank {rank} failed: {line}")
            outs[0].seek(0)
            result = json.loads(outs[0].read().strip().splitlines()[-1])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for file in (*outs, *errs):
                file.close()
    return ([Timing(kind, int(nbytes), ranks, float(seconds)) for kind, nbytes, seconds in result["timings"]],
            [(float(x), float(y)) for x, y in result["waits"]],
            [(float(x), float(y)) for x, y in result.get("overlaps", [])])


def _wait(procs: list[subprocess.Popen], backend: str) -> list[int]:
    """Wait for the workers; the first to fail ends the others (they would wait for it). Returns the ranks
    that failed on their own."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            return failed
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {backend} link measurement did not finish in {TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def _time_collectives(backend: str, rank: int, world: int, port: int, sizes: list[int], rounds: int,
                      small_rounds: int, small: int, kinds: list[str], segments: list[float],
                      stream: tuple[int, int, int], overlap_sizes: list[int]) -> None:
    """One worker: join the group, time ``kinds`` on ``sizes`` (full tensor bytes) for ``rounds`` interleaved
    rounds (``small_rounds`` for sizes up to ``small`` bytes) after a warm-up round; on CPU, time streams of
    ``stream = (count, rounds, nbytes)`` all-reduces, each after ``segments`` seconds of compute on every rank,
    and an asynchronous all-reduce of each of ``overlap_sizes`` bytes started before twice its time of compute.
    Rank 0 prints one JSON line: ``{"timings": [[kind, nbytes, median seconds of the slowest rank], ...],
    "waits": [[compute seconds before each collective, the collective's seconds in the stream], ...],
    "overlaps": [[an all-reduce's seconds alone, the seconds it added behind compute], ...]}``.
    Self-contained: :func:`_launch` runs its source in a fresh interpreter."""
    import json
    import statistics
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    cases = []
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)  # float32, divisible among the ranks
        full = torch.ones(numel, device=device)
        part = torch.ones(numel // world, device=device)
        ops = {"all_reduce": lambda full=full: dist.all_reduce(full),
               "all_gather": lambda full=full, part=part: all_gather(full, part),
               "reduce_scatter": lambda full=full, part=part: reduce_scatter(part, full)}
        cases += [(kind, numel * 4, ops[kind], small_rounds if nbytes <= small else rounds) for kind in kinds]
    seconds = [[] for _ in cases]
    for round_ in range(max(rounds, small_rounds) + 1):
        shift = round_ % len(cases)  # each round starts elsewhere: no case always follows the same one
        for index in [*range(shift, len(cases)), *range(shift)]:
            if round_ > cases[index][3]:
                continue
            dist.barrier()
            sync()
            start = time.perf_counter()
            cases[index][2]()
            sync()
            if round_:
                seconds[index].append(time.perf_counter() - start)
    # The slowest rank's time of each collective in each round.
    flat = torch.tensor([t for row in seconds for t in row], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    waits = []
    count, stream_rounds, nbytes = stream
    a, b = torch.randn(256, 256), torch.randn(256, 256)  # (the compute: one matrix product takes ``product`` s)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    product = (time.perf_counter() - start) / 20
    if device.type == "cpu" and segments:
        # Each rank computes (matrix products) for a segment, then joins the all-reduce, ``count`` times; and,
        # in the same round, the same compute without the collectives, every rank at once (as a step's compute
        # is timed beside the other ranks' twins). The stream's wall time over that compute's, per collective,
        # is what a collective costs inside a step: its own time, the wait for the others, and what the
        # communication threads took from the shared cores.
        x = torch.ones(max(world, nbytes // 4))
        inside = [[] for _ in segments]
        computed = [[] for _ in segments]
        for round_ in range(stream_rounds + 1):
            for index, segment in enumerate(segments):
                reps = round(segment / product)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(count):
                    for _ in range(reps):
                        a @ b
                    dist.all_reduce(x)
                wall = time.perf_counter() - start
                dist.barrier()
                start = time.perf_counter()
                for _ in range(count * reps):
                    a @ b
                compute = time.perf_counter() - start
                if round_:
                    inside[index].append((wall - compute) / count)
                    computed[index].append(compute / count)
        # Each rank's medians, averaged over the ranks (each arrives first in some collectives, last in others).
        mine = torch.tensor([[statistics.median(c), statistics.median(e)] for c, e in zip(computed, inside)],
                            dtype=torch.float64)
        dist.all_reduce(mine)
        waits = (mine / world).tolist()
    overlaps = []
    if device.type == "cpu" and overlap_sizes:
        # An all-reduce started asynchronously (as DDP starts a bucket's), then twice its own time of compute on
        # every rank, then waited for; against the same compute alone. What it added over the compute is the
        # part of its time the compute did not hide (the communication threads share the cores and the memory
        # with it). The compute: 1024 x 1024 products, whose operands do not stay in cache (a backward's
        # products do not either).
        c, d = torch.randn(1024, 1024), torch.randn(1024, 1024)
        start = time.perf_counter()
        for _ in range(5):
            c @ d
        large = (time.perf_counter() - start) / 5
        for nbytes in overlap_sizes:
            x = torch.ones(max(world, nbytes // 4))
            alone = []
            for _ in range(stream_rounds + 1):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                alone.append(time.perf_counter() - start)
            own = torch.tensor([statistics.median(alone[1:])], dtype=torch.float64)
            dist.all_reduce(own, op=dist.ReduceOp.MAX)
            reps = max(1, round(2 * own.item() / large))
            added = []
            for round_ in range(2 * stream_rounds + 1):
                dist.barrier()
                start = time.perf_counter()
                work = dist.all_reduce(x, async_op=True)
                for _ in range(reps):
                    c @ d
                work.wait()
                wall = time.perf_counter() - start
                dist.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    c @ d
                if round_:
                    added.append(wall - (time.perf_counter() - start))
            mine = torch.tensor([own.item(), statistics.median(added)], dtype=torch.float64)
            dist.all_reduce(mine)
            overlaps.append((mine / world).tolist())
    dist.destroy_process_group()
    if rank == 0:
        values, rows = flat.cpu().tolist(), []
        for (kind, nbytes, _, _), row in zip(cases, seconds):
            rows.append([kind, nbytes, statistics.median(values[:len(row)])])
            values = values[len(row):]
        print(json.dumps({"timings": rows, "waits": waits, "overlaps": overlaps}))
