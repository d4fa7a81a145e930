"""The race behind ``target="auto"``: build each target, check it against eager, time them all with eager.

Eager is a contender: the model as it is, timed in the same rounds. Each :class:`Entrant` is built in turn
(its build time is its prepare time); a build expected to take longer than what is left of the time budget,
or longer than :data:`PAYBACK_CALLS` eager calls (it could not pay its build back), is skipped with that
reason (Inductor's compile can take minutes on CPU); on a busy machine an estimate is scaled by the load per
core (the build shares the cores). A built target is run on fresh random inputs of the
example's shapes and compared with eager's outputs there; an entrant that runs a file exported for some
sizes (``fixed_sizes``) is run on inputs of the new sizes eager serves too
(:func:`~fxforge.runtime.served.new_sizes`). One that differs, raises, or fell back to eager is refused with
the reason. The targets that pass are timed together with eager, in interleaved blocks of calls
(:func:`~fxforge.lowering.timing.time_in_blocks`), on the example inputs with gradients off, and the fastest
median wins if it beats eager by more than :data:`TIE`; else eager wins (the model runs as it is). Targets
within :data:`TIE` of the fastest are timed again head to head, in longer blocks without eager and the
others, for the whole timing budget; if they are still within :data:`RUNOFF_TIE` of each other (the finer
resolution of that longer, two-way timing), the target first in the caller's ``preference`` wins
(``target="auto"`` ranks targets by their contracts: live weights and PyTorch's own autograd first). A
timing taken while the machine was busy, or whose samples varied, is taken once more; if it is still
disturbed, each contender's fastest sample stands for it (other work only adds to a call) and its ``busy``
says so. Each step is logged as progress
(:mod:`fxforge.runtime.progress`).

Example:
    >>> import time, torch
    >>> model = torch.nn.Linear(4, 4).eval()
    >>> class Slower(torch.nn.Module):  # the model, then a wait: slower than eager on any machine
    ...     def forward(self, x):
    ...         time.sleep(0.002)
    ...         return model(x)
    >>> built, result = race(model, (torch.ones(2, 4),), {}, [Entrant("native", Slower)])
    >>> result.winner, sorted(built)   # no target beats eager: eager itself wins
    ('eager', ['native'])
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxforge.core.accuracy import Tolerance, agreement
from fxforge.core.disk_cache import BUSY_LOAD, machine_load
from fxforge.core.report import Contender, Race
from fxforge.core.source import first_line
from fxforge.core.target_cache import device_of
from fxforge.core.verify import compare_outputs, isolated, random_like
from fxforge.lowering.timing import time_in_blocks
from fxforge.runtime.progress import step
from fxforge.runtime.served import Served

# Latencies within this fraction of the fastest count as a tie (the machines' noise).
TIE = 0.03
# Seconds of timing, roughly; rounds at least; timed calls per target per round, back to back (each block's
# first call, which pays for switching from the other runtimes, is run untimed).
TIMING_BUDGET_S = 3.0
MIN_ROUNDS, BLOCK = 3, 3
# Timed calls per block when targets within TIE of the fastest are timed again, alone together; at most this
# many rounds (a fast model's runoff fills its budget), and the tie they resolve.
RUNOFF_BLOCK, RUNOFF_MAX_ROUNDS, RUNOFF_TIE = 5, 40, 0.01
# A target agrees with eager within this many times the float32 tolerance of
# :func:`~fxforge.core.verify.compare_outputs` (ONNX Runtime's and Inductor's kernels round differently).
RTOL_SCALE = 10.0
# Samples whose median is more than this many times their fastest (and slower by more than the floor, which
# a call of a few microseconds varies by anyway) were disturbed: not remembered. On a quiet 2-core machine a
# race's samples spread 1.02-1.16x (BERT S=128/1024, ResNet-50, MobileNetV3: eager, native and ORT); an
# eager reference whose median was 1.8x its fastest (119.6 against 66 ms) was remembered under a bound of 2
# and made the next optimize's re-timing contradict it.
NOISY_SPREAD, NOISY_FLOOR_MS = 1.5, 0.1
# Where the timings stayed disturbed, a target must beat eager by more than this to be chosen over it.
BUSY_MARGIN = 0.15
# An entrant whose build is expected to take longer than this many eager calls is skipped: even if it then ran
# in no time, a user would need more calls than that to get its build back (at an eager call of 0.5 ms: 5 s).
PAYBACK_CALLS = 10_000


class RaceWarning(UserWarning):
    """``target="auto"``'s race chose eager: no target ran faster than the model as it is.

    Example:
        >>> issubclass(RaceWarning, UserWarning)
        True
    """


class Narrows(Exception):
    """An entrant cannot be built to serve the inputs eager serves (its message is the reason, as the race
    reports it).

    Example:
        >>> str(Narrows("cannot export it with input 0 dim 1 dynamic"))
        'cannot export it with input 0 dim 1 dynamic'
    """


@dataclasses.dataclass
class Entrant:
    """A target to race: its name and how to build it (an ``nn.Module`` run like the model).

    Attributes:
        target: ``"native"``, ``"inductor"`` or ``"onnxruntime"``.
        build: makes the module, prepared for the example inputs.
        estimate_s: seconds its build is expected to take, where that can be known before (the budget
            skips it when this would not fit); a callable is asked just before the build.
        built: called with the module and its build's seconds once it is built.
        refusal: why it cannot run here at all (it is then not built, and the report says why).
        fixed_sizes: it runs a file exported for some sizes (it does not re-plan): the race checks it on
            the inputs of new sizes eager serves.
        what: what building it does, for the progress line ("export to ONNX").

    Example:
        >>> Entrant("native", lambda: torch.nn.ReLU()).target
        'native'
    """

    target: str
    build: Callable[[], nn.Module]
    estimate_s: float | Callable[[], float | None] | None = None
    built: Callable[[nn.Module, float], None] | None = None
    refusal: str | None = None
    fixed_sizes: bool = False
    what: str = ""


def fell_back(module: nn.Module) -> str:
    """Why ``module`` runs the model eagerly instead of its target, or "" (an optimized module whose plan
    could not be built reports ``method="eager"``).

    Example:
        >>> fell_back(torch.nn.ReLU())
        ''
    """
    report = getattr(module, "report", None)
    if report is not None and getattr(report, "method", None) == "eager":
        return "fell back to eager: " + ("; ".join(report.notes) or "no plan")
    return ""


def _skipped(entrant: Entrant, began: float, budget_s: float | None, eager_ms: float | None) -> str:
    """Why ``entrant`` is not built (the budget is spent, its build would not fit or could not pay back), or ""."""
    spent = time.perf_counter() - began
    estimate = entrant.estimate_s() if callable(entrant.estimate_s) else entrant.estimate_s
    load = machine_load() if estimate is not None else 0.0
    if load > BUSY_LOAD:  # a build estimated from quiet compiles shares the cores with the other work
        estimate *= max(1.0, load)
    if budget_s is not None and spent >= budget_s:
        return f"skipped: the budget of {budget_s:.0f} s was spent"
    if budget_s is not None and estimate is not None and spent + estimate > budget_s:
        return (f"skipped: building it would take about {estimate:.0f} s, past the budget of {budget_s:.0f} s "
                f"({spent:.0f} s spent)")
    if eager_ms is not None and estimate is not None and estimate * 1000 > eager_ms * PAYBACK_CALLS:
        busy = f" with the machine busy (load {load:.2f} per core)" if load > BUSY_LOAD else ""
        return (f"skipped: it cannot pay back its build: about {estimate:.0f} s{busy}, while eager takes "
                f"{eager_ms:.3g} ms a call (more than {PAYBACK_CALLS} calls' worth, even if it then ran in no time)")
    return ""


def _differs(expected: Any, actual: Any, tolerance: Tolerance | None) -> tuple[str, float | None]:
    """Why ``actual`` does not agree with eager's ``expected`` ("" where it does), and the largest absolute
    difference: within :data:`RTOL_SCALE` times float32's tolerance, or for a reduced-precision race within
    ``tolerance`` (:class:`~fxforge.core.accuracy.Tolerance`)."""
    compared = compare_outputs(expected, actual, rtol_scale=RTOL_SCALE)
    if tolerance is None or compared.ok:
        return ("" if compared.ok else compared.reason), compared.max_abs_err
    refusal = tolerance.refusal(agreement([expected], [actual], tolerance.metric))
    return (f"outside the precision tolerance: {refusal}" if refusal else ""), compared.max_abs_err


def _entered(entrant: Entrant, model: nn.Module, fresh: tuple, expected: Any, seed: int, began: float,
             budget_s: float | None, eager_ms: float | None = None, served: Served | None = None,
             tolerance: Tolerance | None = None) -> tuple[nn.Module | None, Contender]:
    """Build one entrant and check it on the fresh inputs (and, for a file of fixed sizes, on ``served``):
    (the module or None, its contender line)."""
    if entrant.refusal:
        return None, Contender(entrant.target, refused=entrant.refusal)
    skipped = _skipped(entrant, began, budget_s, eager_ms)
    if skipped:
        return None, Contender(entrant.target, refused=skipped)
    start = time.perf_counter()
    try:
        with step(f"building {entrant.target}" + (f" ({entrant.what})" if entrant.what else "")), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fallback warning becomes this contender's refusal instead
            module = entrant.build()
        prepare_s = time.perf_counter() - start
        reason = fell_back(module)
        if reason:
            return None, Contender(entrant.target, prepare_s=prepare_s, refused=reason)
        if entrant.built is not None:
            entrant.built(module, prepare_s)
        with step(f"checking {entrant.target} against eager on fresh inputs"), torch.no_grad(), \
                isolated(model, seed=seed, inputs=fresh):  # the reference's random numbers
            actual = module(*fresh[0], **fresh[1])
    except Exception as error:  # noqa: BLE001 - any failure refuses this target, with its reason
        return None, Contender(entrant.target, prepare_s=time.perf_counter() - start,
                               refused=str(error) if isinstance(error, Narrows) else f"failed: {first_line(error)}")
    reason, max_abs_err = _differs(expected, actual, tolerance)
    if reason:
        return None, Contender(entrant.target, prepare_s=prepare_s, max_abs_err=max_abs_err,
                               refused=f"differs from eager on fresh inputs: {reason}")
    if entrant.fixed_sizes and served is not None:
        refused = _serves(entrant.target, module, model, served, seed, tolerance)
        if refused:
            return None, Contender(entrant.target, prepare_s=prepare_s, max_abs_err=max_abs_err, refused=refused)
    return module, Contender(entrant.target, prepare_s=prepare_s, max_abs_err=max_abs_err)


def _serves(target: str, module: nn.Module, model: nn.Module, served: Served, seed: int,
            tolerance: Tolerance | None = None) -> str:
    """Why ``module`` does not serve the new sizes eager serves (``served``) like eager, or ""."""
    what = f"does not serve inputs of new sizes that eager serves ({served.text})"
    try:
        with step(f"checking {target} on new sizes ({served.text})"), torch.no_grad(), \
                isolated(model, seed=seed, inputs=(served.args, served.kwargs)):
            actual = module(*served.args, **served.kwargs)
    except Exception as error:  # noqa: BLE001 - a size it does not take refuses it, with the reason
        return f"{what}: {first_line(error)}"
    reason, _ = _differs(served.expected, actual, tolerance)
    return f"{what}: differs from eager there: {reason}" if reason else ""


def eager_call_ms(model: nn.Module, args: tuple, kwargs: dict, calls: int = 3) -> float:
    """Eager's fastest milliseconds per call on the inputs, of a few calls after a warm-up (one call when it
    takes over half a second): what the race weighs a build against before anything is built.

    Example:
        >>> eager_call_ms(torch.nn.ReLU(), (torch.ones(2),), {}) > 0
        True
    """
    call, samples = timed_call(model, args, kwargs), []
    with torch.no_grad(), isolated(model, inputs=(args, kwargs)):
        for _ in range(calls + 1):
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1000)
            if samples[-1] > 500:
                break
    timed = samples[1:] or samples
    return min(timed)  # other work on the machine only adds to a call: its fastest is the nearest to its cost


def _timed(model: nn.Module, built: dict[str, nn.Module], args: tuple, kwargs: dict) -> tuple[dict, dict, float]:
    """Eager and every built target timed together: (medians, samples, the load per core meanwhile)."""
    samples: dict[str, list[float]] = {}
    calls = {"eager": model, **built}
    with step(f"timing {', '.join(calls)} on the example inputs"), torch.no_grad(), \
            isolated(model, inputs=(args, kwargs)):
        medians = time_in_blocks({name: timed_call(m, args, kwargs) for name, m in calls.items()},
                                 reps=BLOCK, budget_s=TIMING_BUDGET_S, min_rounds=MIN_ROUNDS, samples=samples)
    return medians, samples, round(machine_load(), 2)


def _disturbed(medians: dict, samples: dict, load: float) -> dict[str, str]:
    """Per contender, why its timing is disturbed (samples varied; the machine was busy), or nothing."""
    marks = {}
    for name, values in samples.items():
        spread = statistics_spread(values)
        if spread > NOISY_SPREAD and medians[name] - min(values) > NOISY_FLOOR_MS:
            marks[name] = f"samples varied {spread:.2f}x between rounds"
    if load > BUSY_LOAD:
        marks = {name: f"load {load:.2f} per core while timing" + (f"; {marks[name]}" if name in marks else "")
                 for name in medians}
    return marks


def _summary(marks: dict[str, str], load: float) -> str:
    """The disturbed timings in one phrase: the load, and whose samples varied."""
    varied = sorted(name for name, mark in marks.items() if "varied" in mark)
    parts = [f"load {load:.2f} per core"] if load > BUSY_LOAD else []
    return "; ".join(parts + ([f"samples of {', '.join(varied)} varied"] if varied else []))


def race(model: nn.Module, args: tuple, kwargs: dict, entrants: list[Entrant], *, budget_s: float | None = None,
         began: float | None = None, seed: int = 1, preference: tuple[str, ...] = (),
         served: Served | None = None, payback: bool = False, tolerance: Tolerance | None = None
         ) -> tuple[dict[str, nn.Module], Race]:
    """Build, check and time ``entrants`` against eager; returns the modules that passed, by target, and
    the :class:`~fxforge.core.report.Race` (``winner``: a target, ``"eager"`` where none beat eager, or empty
    where none passed; ``contenders``: eager first, then every entrant, refused ones with their reason).

    Args:
        model: the model, run eagerly as the reference and a contender.
        args, kwargs: the example inputs (timed on them; checked on random inputs of their shapes).
        entrants: in the order to build them.
        budget_s: seconds the whole race may take: once one target is built, a build that would not fit
            (or any, once the budget is spent) is skipped with the reason; None: no limit.
        began: when the search began (``time.perf_counter()``), if before this call.
        seed: of the fresh inputs.
        preference: targets in the order a near tie is settled (see :func:`choose`).
        served: inputs of new sizes eager serves (:func:`~fxforge.runtime.served.new_sizes`), on which every
            ``fixed_sizes`` entrant is checked.
        payback: skip an entrant whose build is expected to take longer than :data:`PAYBACK_CALLS` eager
            calls, once one target is built.
        tolerance: for entrants built in a reduced precision, what they must keep against eager (else within
            :data:`RTOL_SCALE` times float32's tolerance).
    """
    began = time.perf_counter() if began is None else began
    fresh = random_like((args, kwargs), seed)
    # Every run is isolated: seeded (dropout in training mode draws the same numbers in eager and in each
    # target) and the model's buffers put back after (BatchNorm statistics are not moved by the race).
    with step("running eager on fresh inputs"), torch.no_grad(), isolated(model, seed=seed, inputs=fresh):
        expected = model(*fresh[0], **fresh[1])
    eager_ms = eager_call_ms(model, args, kwargs) if payback else None
    built: dict[str, nn.Module] = {}
    contenders = []
    for entrant in entrants:  # the budget skips nothing before one target is built: the race needs one
        module, contender = _entered(entrant, model, fresh, expected, seed, began, budget_s if built else None,
                                     eager_ms if built else None, served, tolerance)
        contenders.append(contender)
        if module is not None:
            built[entrant.target] = module
    result = Race(winner="", why="no target built and agreed with eager", contenders=contenders)
    if not built:
        return built, result
    medians, samples, result.load = _timed(model, built, args, kwargs)
    marks = _disturbed(medians, samples, result.load)
    if marks:  # taken once more; what is still disturbed is marked
        result.notes.append(f"timed again: the first timing was disturbed ({_summary(marks, result.load)})")
        medians, samples, result.load = _timed(model, built, args, kwargs)
        marks = _disturbed(medians, samples, result.load)
        if marks and all(samples.get(name) for name in medians):
            # other work only adds to a call: each one's fastest sample is the nearest to its cost, and one
            # disturbed median (eager's 780 ms beside a fastest call of 0.5 ms) would decide the race alone
            medians = {name: min(samples[name]) for name in medians}
            marks = {name: mark + "; its fastest sample is shown" for name, mark in marks.items()}
    eager = Contender("eager", latency_ms=medians["eager"], vs_eager=1.0, busy=marks.get("eager", ""))
    result.contenders.insert(0, eager)
    for contender in contenders:
        if contender.target in built:
            contender.latency_ms, contender.busy = medians[contender.target], marks.get(contender.target, "")
    result.eager_ms = medians["eager"]
    latencies = {t: medians[t] for t in built}
    tied = [t for t in latencies if latencies[t] <= min(latencies.values()) * (1 + TIE)]
    if len(tied) > 1:  # a near tie is settled head to head, longer, before the preference may decide it
        with step(f"timing {', '.join(tied)} again, head to head"), torch.no_grad(), \
                isolated(model, inputs=(args, kwargs)):
            runoff = time_in_blocks({t: timed_call(built[t], args, kwargs) for t in tied}, reps=RUNOFF_BLOCK,
                                    budget_s=TIMING_BUDGET_S, min_rounds=MIN_ROUNDS, max_rounds=RUNOFF_MAX_ROUNDS)
        result.notes.append("near tie of " + ", ".join(f"{t} {latencies[t]:.3g} ms" for t in tied)
                            + " re-timed head to head: " + ", ".join(f"{t} {runoff[t]:.3g} ms" for t in tied))
        latencies.update(runoff)
        for contender in contenders:
            if contender.target in runoff:
                contender.latency_ms = runoff[contender.target]
    for contender in contenders:
        if contender.latency_ms:
            contender.vs_eager = result.eager_ms / contender.latency_ms
    result.winner, result.why = choose(latencies, medians["eager"], RUNOFF_TIE if len(tied) > 1 else TIE,
                                       preference, busy_margin=bool(marks))
    noisy = sorted(name for name, mark in marks.items() if "varied" in mark)
    if noisy:
        result.notes.append(f"timings of {', '.join(noisy)} varied more than {NOISY_SPREAD:g}x between rounds: "
                            "not remembered")
    if result.load > BUSY_LOAD:
        result.notes.append(f"the machine was busy while timing (load {result.load:.2f} per core): not remembered")
    return built, result


def timed_call(module: nn.Module, args: tuple, kwargs: dict) -> Callable[[], None]:
    """A call of ``module`` on the inputs that returns when its work is done: on a GPU, CUDA kernels run
    asynchronously, so the call waits for the device (else a timing measures only the kernel launches).

    Example:
        >>> timed_call(torch.nn.ReLU(), (torch.ones(2),), {})()
    """
    sync = torch.cuda.synchronize if device_of(args, kwargs, module).type == "cuda" else None

    def call() -> None:
        module(*args, **kwargs)
        if sync is not None:
            sync()

    return call


def statistics_spread(values: list[float]) -> float:
    """Median over fastest of a list of samples (1.0: steady).

    Example:
        >>> statistics_spread([1.0, 1.1, 3.0])
        1.1
    """
    ordered = sorted(values)
    return ordered[len(ordered) // 2] / ordered[0] if ordered and ordered[0] > 0 else 1.0


def remembrable(result: Race) -> bool:
    """Whether a race's timings may be remembered: a winner, timed on a quiet machine, with steady samples.

    Example:
        >>> remembrable(Race("native", "fastest", load=0.2)), remembrable(Race("native", "fastest", load=3.0))
        (True, False)
    """
    return bool(result.winner) and not any("not remembered" in note for note in result.notes) and (
        result.load is None or result.load <= BUSY_LOAD)


def choose(latencies: dict[str, float], eager_ms: float, tie: float = TIE,
           preference: tuple[str, ...] = (), busy_margin: bool = False) -> tuple[str, str]:
    """The winner among targets' median latencies and eager's, and why: the fastest target, unless a target
    earlier in ``preference`` is within ``tie`` of it (:data:`TIE`; :data:`RUNOFF_TIE` for a runoff's
    figures); ``"eager"`` unless that target beats eager by more than :data:`TIE` (the model as it is serves
    everything, so a target must be clearly faster to be worth what it narrows), or by more than
    :data:`BUSY_MARGIN` where the timings were disturbed (``busy_margin``: a gain within their noise is none).

    Example:
        >>> choose({"native": 1.0, "onnxruntime": 0.5}, 2.0)
        ('onnxruntime', '0.5 ms: 4.00x eager, 2.00x native')
        >>> choose({"native": 1.01, "onnxruntime": 1.0}, 2.0, preference=("native", "onnxruntime"))[0]
        'native'
        >>> choose({"inductor": 13.9}, 11.0)
        ('eager', 'no target beat eager: eager 11 ms, inductor 13.9 ms (0.79x eager)')
        >>> choose({"inductor": 0.825}, 0.874, busy_margin=True)[1]
        'no target beat eager by more than 15% (the timings were disturbed): eager 0.874 ms, inductor 0.825 ms (1.06x eager)'

    """
    fastest = min(latencies, key=latencies.__getitem__)
    ranked = sorted(latencies, key=lambda t: (preference.index(t) if t in preference else len(preference), t))
    winner = next(t for t in ranked if latencies[t] <= latencies[fastest] * (1 + tie))
    ms = latencies[winner]
    within_noise = busy_margin and ms * (1 + TIE) < eager_ms <= ms * (1 + BUSY_MARGIN)
    if ms * (1 + TIE) >= eager_ms or within_noise:
        return "eager", ("no target beat eager" + (f" by more than {BUSY_MARGIN:.0%} (the timings were disturbed)"
                                                   if within_noise else "")
                         + f": eager {eager_ms:.3g} ms, {fastest} {latencies[fastest]:.3g} ms "
                         f"({eager_ms / latencies[fastest]:.2f}x eager)")
    why = f"{ms:.3g} ms: {eager_ms / ms:.2f}x eager"
    others = sorted((t for t in latencies if t != winner), key=latencies.__getitem__)
    if others:
        why += f", {latencies[others[0]] / ms:.2f}x {others[0]}"
    if winner != fastest:
        why += f" (within {tie:.0%} of {fastest}, a tie: {winner} is preferred)"
    return winner, why
