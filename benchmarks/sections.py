"""Every section of ``python -m benchmarks``, in ``--list`` order: the one registry.

A new benchmark is a module with a :class:`benchmarks.section.Section` (``SECTION``) added here.

Example:
    >>> list(SECTIONS)[:5]
    ['default', 'conv', 'attention', 'onnx', 'targets']
    >>> all(name == section.name for name, section in SECTIONS.items())
    True
"""

from __future__ import annotations

from benchmarks import (
    against,
    auto_prepare,
    breaks,
    dynamic,
    first_calls,
    fusions,
    guard_overhead,
    int8,
    interop,
    memory_reorder,
    onnx_forms,
    optimize_time,
    parallel_plans,
    parallel_scale,
    pipeline,
    precision,
    throughput,
    timed,
    training,
    zoo,
)
from benchmarks.section import Section

SECTIONS: dict[str, Section] = {
    section.name: section
    for section in (
        *timed.SECTIONS,           # default, conv, attention, onnx, targets: the suite's models, timed in rounds
        dynamic.SECTION,
        training.SECTION,
        pipeline.SECTION,
        parallel_plans.SECTION,
        parallel_scale.SECTION,
        zoo.SECTION,
        onnx_forms.SECTION,
        optimize_time.SECTION,
        against.SECTION,
        guard_overhead.SECTION,
        first_calls.SECTION,
        auto_prepare.SECTION,
        memory_reorder.SECTION,
        breaks.SECTION,
        fusions.SECTION,
        precision.SECTION,
        int8.SECTION,
        interop.SECTION,
        throughput.SECTION,
    )
}
