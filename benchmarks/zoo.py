"""The model zoo: torchvision and timm models, random weights, through fxforge as a new user would try them.

For each model: capture, rewrite and run natively (``fxforge.optimize``), compare with eager on fresh inputs;
export to ONNX plainly (``rewrites=[]``) and after fxforge's rewrites, and run the file in ONNX Runtime on
fresh inputs. :func:`run_model` returns one row; ``python -m benchmarks --suite zoo`` writes the table to
``benchmarks/RESULTS.md`` (its own ``zoo`` block) and ``tests/zoo`` asserts on the same rows.

The zoo needs torchvision and timm, which the main environment does not have: the torchvision wheel the
package registries serve (0.28, matching torch 2.13) is a CUDA build whose compiled ops do not load with the
CPU torch, and ``import torchvision`` then fails registering fake kernels for ``torchvision::nms``/``qnms``
(and so does ``import transformers``, which imports torchvision when it is installed). So the zoo has its own
environment, ``make zoo`` (``.venv-zoo``), and :func:`define_torchvision_op_schemas` declares those two ops'
schemas before torchvision is imported, when its compiled library cannot load: the models never call them.

Example:
    >>> sorted(ZOO)[:2]
    ['timm/coatnet_0_rw_224', 'timm/convnext_atto']
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import tempfile
import time
import warnings
from datetime import datetime, timezone

import torch
from torch import nn

from benchmarks import report
from benchmarks.section import Section, UsageError, csv_list

NAME = "zoo"
IMAGE_SIZE = 224
SEED = 0
# Segmentation heads of torchvision (they take weights_backbone=None: no download).
SEGMENTATION = ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")
TORCHVISION = ("resnet18", "resnet50", "resnext50_32x4d", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0",
               "regnet_y_400mf", "densenet121", "shufflenet_v2_x1_0", "squeezenet1_1", "mnasnet0_5", "googlenet",
               "convnext_tiny", "vit_b_16", "swin_t", "maxvit_t", *SEGMENTATION)
TIMM = ("efficientnet_b0", "regnetx_002", "coatnet_0_rw_224", "swin_tiny_patch4_window7_224", "resnet50d",
        "mobilenetv3_large_100", "convnext_atto", "vit_tiny_patch16_224", "deit_tiny_patch16_224", "ghostnet_100")
ZOO = {**{f"torchvision/{n}": ("torchvision", n) for n in TORCHVISION}, **{f"timm/{n}": ("timm", n) for n in TIMM}}


def define_torchvision_op_schemas() -> bool:
    """Declare ``torchvision::nms`` and ``torchvision::qnms`` when torchvision is installed but its compiled
    ops cannot load (the CUDA wheel with the CPU torch), so that ``import torchvision`` can register their
    fake kernels. Returns whether it declared them.

    Example:
        >>> define_torchvision_op_schemas() in (True, False)
        True
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    if hasattr(torch.ops.torchvision, "nms"):  # loaded already, or declared by an earlier call
        return False
    for library in glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")):
        try:
            torch.ops.load_library(library)
            return False  # the compiled ops load: torchvision defines its own schemas
        except OSError:
            pass
    # Kept for the life of the process: a Library object un-registers its definitions when collected.
    define_torchvision_op_schemas.library = library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo model ``name`` with random weights, its BatchNorm statistics set by three train-mode passes
    (random-init statistics give degenerate, denormal activations), in eval mode; and example inputs.

    Example:
        >>> model, (x,) = build("timm/regnetx_002")  # doctest: +SKIP
    """
    source, arch = ZOO[name]
    return build_arch(source, arch)


def build_arch(source: str, arch: str, size: int = IMAGE_SIZE) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:func:`build` for any ``torchvision`` or ``timm`` architecture (inputs ``size`` x ``size``).

    Example:
        >>> model, (x,) = build_arch("torchvision", "inception_v3", size=299)  # doctest: +SKIP
    """
    define_torchvision_op_schemas()
    torch.manual_seed(SEED)
    if source == "timm":
        import timm

        model = timm.create_model(arch, pretrained=False)
    else:
        import torchvision

        if arch in SEGMENTATION:
            model = getattr(torchvision.models.segmentation, arch)(weights=None, weights_backbone=None)
        else:
            model = getattr(torchvision.models, arch)(weights=None)
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 3, size, size, generator=gen))
    return model.eval(), (torch.randn(1, 3, size, size, generator=gen),)


@dataclasses.dataclass
class ZooRow:
    """What fxforge did with one zoo model (``error`` fields: max abs difference from eager on fresh inputs)."""

    name: str
    method: str = ""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    near_misses: int = 0
    rolled_back: list[str] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    native_ok: bool = False
    native_error: float | None = None
    native_problem: str = ""
    optimize_s: float | None = None
    plain_export: str = ""      # "ok" or the error's first line
    export: str = ""            # after fxforge's rewrites: "ok", "ok, <rewrite> left out ... (why)", or the error
    ort_ok: bool = False
    ort_error: float | None = None
    export_s: float | None = None
    has_batchnorm: bool = False

    def problems(self) -> list[str]:
        """Every way the row falls short of the zoo's bar (empty: it passes).

        Example:
            >>> ZooRow("m", native_ok=True, plain_export="ok", export="ok", ort_ok=True).problems()
            []
        """
        out = [f"fell back: {f}" for f in self.fallbacks]
        out += [f"rolled back: {r}" for r in self.rolled_back]
        if not self.native_ok:
            out.append(f"native differs from eager: {self.native_problem}")
        if self.plain_export == "ok" and not self.export.startswith("ok"):
            out.append(f"export fails after the rewrites where plain export succeeds: {self.export}")
        if "left out" in self.export:
            out.append(f"the export after the rewrites failed until a rewrite was left out ({self.export})")
        if self.export.startswith("ok") and not self.ort_ok:
            out.append(f"ONNX Runtime differs from eager (max abs error {self.ort_error})")
        if self.has_batchnorm and not self.counts.get("conv_bn_fold"):
            out.append("no conv_bn_fold in a model with BatchNorm")
        return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def run_model(name: str, workdir: str | None = None) -> ZooRow:
    """Optimize ``name`` natively, export it to ONNX plainly and after the rewrites, and compare both with
    eager on fresh inputs.

    Example:
        >>> run_model("timm/regnetx_002").problems()  # doctest: +SKIP
        []
    """
    import fxforge
    from fxforge.core.verify import compare_outputs
    from fxforge.exporters import OnnxRuntimeModule
    from fxforge.runtime.plans import FallbackWarning

    model, example = build(name)
    row = ZooRow(name, has_batchnorm=any(isinstance(m, nn.BatchNorm2d) for m in model.modules()))
    gen = torch.Generator().manual_seed(SEED + 1)
    fresh = (torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen),)
    with torch.no_grad():
        expected = model(*fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        start = time.perf_counter()
        opt = fxforge.optimize(model, example)
        row.optimize_s = time.perf_counter() - start
        with torch.no_grad():
            actual = opt(*fresh)
    row.fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    opt_report = opt.report
    row.method, row.counts = opt_report.method, dict(opt_report.counts)
    row.near_misses, row.rolled_back = len(opt_report.near_misses), [str(r) for r in opt_report.rolled_back]
    compared = compare_outputs(expected, actual)
    row.native_ok, row.native_error, row.native_problem = compared.ok, compared.max_abs_err, compared.reason or ""
    del opt
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for field, rewrites in (("plain_export", []), ("export", "default")):
            path = os.path.join(tmp, f"{field}.onnx")
            start = time.perf_counter()
            try:
                exported = fxforge.export_onnx(model, path, example, rewrites=rewrites)
            except Exception as error:  # noqa: BLE001 - the row records why
                setattr(row, field, _first_line(error))
                continue
            setattr(row, field, "ok")
            if field == "export" and exported.left_out:
                row.export = f"ok, {exported.left_out}"
            if field == "export":
                row.export_s = time.perf_counter() - start
                with torch.no_grad():
                    compared = compare_outputs(expected, OnnxRuntimeModule(path, exported.io)(*fresh), rtol_scale=10.0)
                row.ort_ok, row.ort_error = compared.ok, compared.max_abs_err
    return row


# --------------------------------------------------------------------------------------------------
# the RESULTS.md block


RULES = ("conv_bn_fold", "conv_activation", "attention", "cleanup")


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cell(value: float | None, fmt: str = ".1e") -> str:
    return "" if value is None else format(value, fmt)


def markdown(rows: list[ZooRow], command: str, commit: str | None) -> str:
    """The zoo block of ``RESULTS.md``: one line per model, then the models that fall short and why."""
    versions = ", ".join(f"{m} {_installed(m)}" for m in ("torch", "torchvision", "timm", "onnxruntime-gpu"))
    lines = ["### Model zoo: torchvision and timm with random weights (issue 20)", "",
             (f"Command: `{command}`; commit {commit or '?'}; "
             f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; "
             f"{report.machine_info(torch.get_num_threads()).get('cpu', 'cpu')}, "
             f"{torch.get_num_threads()} threads; {versions}; inputs 1x3x{IMAGE_SIZE}x{IMAGE_SIZE}. "
             "Errors are the max abs difference from eager on fresh inputs (not the example); "
             "ORT runs the file exported after fxforge's rewrites."), "",
             "| model | capture | " + " | ".join(RULES) + " | near misses | rolled back | native error | "
             "plain export | export after rewrites | ORT error | optimize s |",
             "|---|---|" + "---:|" * len(RULES) + "---:|---|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.method} | " + " | ".join(str(r.counts.get(k, 0)) for k in RULES)
                     + f" | {r.near_misses} | {len(r.rolled_back) or ''} | {_cell(r.native_error)} | "
                     f"{report.md_cell(r.plain_export, 80)} | {report.md_cell(r.export, 80)} | "
                     f"{_cell(r.ort_error)} | {_cell(r.optimize_s, '.1f')} |")
    short = [(r.name, p) for r in rows for p in r.problems()]
    lines += ["", (f"{len(rows) - len({n for n, _ in short})} of {len(rows)} models meet every point of the zoo's "
              "bar (no fallback, no rollback, float32-level errors, export after the rewrites wherever plain "
              "export succeeds, a fold in every model with BatchNorm).")]
    lines += [f"- {n}: {report.md_cell(p, 240)}" for n, p in short]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite zoo``."""
    parser.add_argument("--models", type=csv_list, default=list(ZOO), metavar="NAME,...",
                        help="comma-separated zoo models (default all)")
    parser.add_argument("--threads", type=int, default=2)
    report.add_markdown_options(parser, NAME)


def run(opts: argparse.Namespace) -> int:
    """Run the zoo and write its block of ``RESULTS.md``; exit status 0 when every model meets the bar."""
    unknown = [n for n in opts.models if n not in ZOO]
    if unknown:
        raise UsageError(f"unknown model(s): {', '.join(unknown)}; the zoo has {', '.join(ZOO)}")
    torch.set_num_threads(opts.threads)
    rows = []
    for name in opts.models:
        row = run_model(name)
        print(f"{name}: {row.method} {row.counts} native {row.native_error} export {row.export} "
              f"ORT {row.ort_error} {'; '.join(row.problems()) or 'ok'}", flush=True)
        rows.append(row)
    block = markdown(rows, opts.command, report.git_commit())
    if opts.no_markdown:
        print(block)
    else:
        report.write_block(opts.markdown, block, NAME)
    return 0 if not any(r.problems() for r in rows) else 1


SECTION = Section(NAME, "torchvision and timm models with random weights through fxforge as a new user would try "
                  "them: optimize, plain export and export after the rewrites, ONNX Runtime (issue 20; the zoo "
                  "environment, make zoo)", add_arguments, run)
