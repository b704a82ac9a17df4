"""The ``gcmoe-bench`` command line (typer). ``python -m gcmoe_bench``, the ``gcmoe-bench`` script and
``torchrun --nproc-per-node N -m gcmoe_bench ...`` all run this app. Commands stay thin: each parses its options
and calls the module that does the work."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    name="gcmoe-bench",
    help="GC-MoE benchmark harness: sweeps, accuracy, the paper's tables and figures, regression checks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

DEFAULT_RESULTS = Path("results")


def _split(values: list[str] | None) -> list[str] | None:
    """Accept both ``--models a,b`` and ``--models a --models b``."""
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _tokens(values: list[str] | None) -> list[int] | None:
    items = _split(values)
    if not items:
        return None
    try:
        return [int(v) for v in items]
    except ValueError:
        raise typer.BadParameter(f"--tokens takes integers, e.g. --tokens 1,2,4; got {values}") from None


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _report_unreported(exc: BaseException) -> None:
    """A failure the collective run did not report yet (e.g. raised before the job was joined): its one line on
    stderr, its traceback after it, so no failure exits silently."""
    from gcmoe_bench.distributed import report_failure, was_reported

    if not was_reported(exc):
        report_failure(None, exc)


@app.command()
def sweep(
    gpu: Annotated[str | None, typer.Option(
        help="Profile to run: sweeps/<GPU>.toml (b300, h20, h200, cpu) or a path to a .toml file.")] = None,
    layout: Annotated[str | None, typer.Option(
        help="A \\[layouts.NAME] section of the profile, e.g. eight-rank in h200.toml (default: the top level).")] = None,
    models: Annotated[list[str] | None, typer.Option(
        help="Only these models (name or Table 4 base name), comma-separated or repeated.")] = None,
    tokens: Annotated[list[str] | None, typer.Option(
        help="Tokens per rank to scan instead of the profile's, e.g. 1,8,64.")] = None,
    suite: Annotated[list[str] | None, typer.Option(
        help="Only these suites of the profile (e.g. routed, shared).")] = None,
    out: Annotated[Path, typer.Option(
        help="Results root: the run is written to OUT/<gpu>/<run-id>/, a new directory every run.")] = DEFAULT_RESULTS,
    skip_gate: Annotated[bool, typer.Option(
        "--skip-gate", help="Do not wait for idle GPUs (recorded in env.json: such numbers are not clean).")] = False,
    l2: Annotated[str | None, typer.Option(
        help="flush: flush L2 between windows, only a window's first replay is cold (the paper's protocol); "
             "rotate: cycle cloned input sets inside the graph so every replay starts cold.")] = None,
    resume: Annotated[Path | None, typer.Option(
        help="Continue an interrupted run in RUN_DIR with its recorded profile; finished points are kept.")] = None,
    windows: Annotated[int | None, typer.Option(
        help="Measured windows per point (profile default: 30). For quick runs only.")] = None,
    warmup: Annotated[int | None, typer.Option(
        help="Warmup windows per point (profile default: 10). For quick runs only.")] = None,
    replays: Annotated[int | None, typer.Option(
        help="Invocations per window (profile default: 100). For quick runs only.")] = None,
    dispatch_sms: Annotated[int | None, typer.Option(
        help="GC-MoE's dispatch-partition request in SMs (>= 1) instead of the profile's dispatch_sm_request: "
             "the partition-size ablation. Recorded in env.json and in every row.")] = None,
    overlap: Annotated[str | None, typer.Option(
        metavar="on|off",
        help="on: GC-MoE's dispatch and W1 run as concurrent graph roots (the default); off: W1 after dispatch "
             "(GC_MOE_OVERLAP_ROOTS=0), the overlap ablation. Recorded in env.json and in every row.")] = None,
    operators: Annotated[list[str] | None, typer.Option(
        help="Measure only these operators of each suite, comma-separated or repeated; the suite's baseline only "
             "if named (then rows have no speedup). E.g. --operators gc.")] = None,
) -> None:
    """Measure every point of a sweep profile under the Section 6.1 protocol and write a new run directory.

    Run it under torchrun with one process per GPU (one or more processes on CPU):
    torchrun --nproc-per-node 2 -m gcmoe_bench sweep --gpu cpu
    """
    from gcmoe_bench import profiles
    from gcmoe_bench import sweep as sweep_module

    try:
        if resume is not None:
            if any(v is not None for v in (gpu, layout, models, tokens, suite, l2, windows, warmup, replays,
                                           dispatch_sms, overlap, operators)):
                raise profiles.ProfileError(
                    "--resume continues a run with the profile recorded in its env.json; leave out --gpu, --layout, "
                    "--models, --tokens, --suite, --l2, --windows, --warmup, --replays, --dispatch-sms, --overlap "
                    "and --operators")
            from gcmoe_bench.results import RunDirError, open_for_resume

            try:
                recorded = open_for_resume(resume).read_env()["profile"]
            except RunDirError as exc:
                _fail(f"--resume {exc}")
            except KeyError:
                _fail(f"--resume {resume}: its env.json records no profile (not a sweep run this tool wrote)")
            profile = profiles.profile_from_resolved(recorded)
            if skip_gate:
                profile = profiles.apply_overrides(profile, skip_gate=True)
        else:
            if gpu is None:
                raise profiles.ProfileError(
                    f"name a profile with --gpu; available: {', '.join(profiles.available_profiles())}")
            profile = profiles.load_profile(gpu, layout=layout)
            profile = profiles.apply_overrides(
                profile, models=_split(models), tokens=_tokens(tokens), suites=_split(suite), l2=l2,
                windows=windows, warmup=warmup, replays=replays, skip_gate=skip_gate, dispatch_sms=dispatch_sms,
                overlap=overlap, operators=_split(operators))
    except (profiles.ProfileError, FileNotFoundError, KeyError) as exc:
        _fail(str(exc))
    try:
        sweep_module.run_sweep(profile, out_root=out, resume=resume, console=console)
    except Exception as exc:  # noqa: BLE001 - every rank exits non-zero, each saying why
        _report_unreported(exc)
        raise typer.Exit(1) from None


@app.command()
def accuracy(
    gpu: Annotated[str, typer.Option(help="Profile whose device and models to use (sweeps/<GPU>.toml).")] = "cpu",
    layout: Annotated[str | None, typer.Option(help="A \\[layouts.NAME] section of the profile.")] = None,
    models: Annotated[list[str] | None, typer.Option(help="Only these models, comma-separated or repeated.")] = None,
    operators: Annotated[list[str] | None, typer.Option(
        help="Operators to check against the float32 reference (default: gc, gc-unfused).")] = None,
    cases: Annotated[list[str] | None, typer.Option(
        help="Only these cases of gc_moe.cases.ACCURACY_SUITE (names or categories).")] = None,
    out: Annotated[Path, typer.Option(help="Results root: writes OUT/<gpu>/<run-id>/accuracy.csv.")] = DEFAULT_RESULTS,
    into: Annotated[Path | None, typer.Option(
        help="Write accuracy.csv into this existing sweep run instead (its recorded profile is used).")] = None,
) -> None:
    """Run the accuracy suite (gc_moe.cases.ACCURACY_SUITE) through the operators; write accuracy.csv.

    Each case's output is compared, with gc_moe.metrics and the paper's thresholds, against the float32
    expert-parallel reference on the same quantized inputs (processed difference, max abs error, relative L2)
    and against a BF16 forward on the unquantized inputs and weights (cosine). Runs on any number of ranks:
    torchrun --nproc-per-node 2 -m gcmoe_bench accuracy --gpu cpu. Exits 1 when any case fails."""
    from gcmoe_bench import accuracy as accuracy_module
    from gcmoe_bench import profiles

    try:
        if into is not None:
            from gcmoe_bench.results import RunDirError, open_for_resume

            try:
                recorded = open_for_resume(into).read_env()["profile"]
            except RunDirError as exc:
                raise profiles.ProfileError(f"--into {exc}") from None
            except KeyError:
                raise profiles.ProfileError(f"--into {into}: its env.json records no profile (not a sweep run "
                                            f"this tool wrote)") from None
            profile = profiles.profile_from_resolved(recorded)
        else:
            profile = profiles.load_profile(gpu, layout=layout)
        profile = profiles.apply_overrides(profile, models=_split(models))
    except profiles.ProfileError as exc:
        _fail(str(exc))
    try:
        passed = accuracy_module.run_accuracy(profile, out_root=out, operators=_split(operators),
                                              case_filter=_split(cases), console=console, into=into)
    except Exception as exc:  # noqa: BLE001 - every rank exits non-zero, each saying why
        _report_unreported(exc)
        raise typer.Exit(1) from None
    raise typer.Exit(0 if passed else 1)


@app.command()
def report(
    run_dirs: Annotated[list[Path] | None, typer.Argument(
        metavar="RUN_DIR...", help="Measured run directories (results/<gpu>/<run-id>/); none: the paper reproduction alone.")] = None,
    out: Annotated[Path, typer.Option(help="Output directory for tables (md, tex, csv), figures and report.md.")] = Path(
        "report"),
    figures_out: Annotated[Path | None, typer.Option(help="Where figures go (default: OUT/figures).")] = None,
    formats: Annotated[list[str] | None, typer.Option(
        "--format", help="Figure formats, comma-separated or repeated (default: png,pdf).")] = None,
    no_figures: Annotated[bool, typer.Option("--no-figures", help="Write the tables only.")] = False,
) -> None:
    """Write the paper's Tables 5-10 and Figures 3-8, measured runs beside the published numbers."""
    from gcmoe_bench.report import run_report

    try:
        files = run_report(list(run_dirs or []), out, figures_out=figures_out,
                           figure_formats=tuple(_split(formats) or ("png", "pdf")), with_figures=not no_figures)
    except (FileNotFoundError, ValueError) as exc:  # a missing or malformed run: say which, no traceback
        _fail(str(exc))
    console.print(f"report written: {files.index}")


@app.command()
def ablation(
    run_dirs: Annotated[list[Path], typer.Argument(
        metavar="RUN_DIR...", help="Sweep run directories of one GPU kind and the same models, e.g. one per "
                                   "--dispatch-sms value and one with --overlap off.")],
    out: Annotated[Path, typer.Option(
        help="Output directory: partition.{md,csv}, overlap.{md,csv}, partition-latency.{png,pdf}. Files already "
             "there are never overwritten (the command stops before writing anything).")],
) -> None:
    """The partition-size and overlap ablations of GC-MoE: mean latency per dispatch request (with the actual
    communication / compute SMs) and speedup against request 4, overlap on against off, and latency against
    communication SMs per model and token count."""
    from gcmoe_bench.ablation import run_ablation
    from gcmoe_bench.results import RunDirError

    try:
        files = run_ablation(list(run_dirs), out)
    except (FileNotFoundError, FileExistsError, ValueError, RunDirError) as exc:
        _fail(str(exc))
    for path in files.all_paths():
        console.print(f"written: {path}", highlight=False)


@app.command()
def compare(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="The measured run directory to check.")],
    baseline: Annotated[Path, typer.Option(help="Committed baseline file, e.g. results/baselines/cpu.csv.")],
    tolerance: Annotated[float, typer.Option(
        help="Allowed relative drop: a speedup below baseline x (1 - TOLERANCE) fails.")] = 0.03,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Also write customBiggerIsBetter JSON (benchmark dashboards) here.")] = None,
    allow_missing: Annotated[bool, typer.Option(
        "--allow-missing", help="Do not fail on baseline points the run did not measure.")] = False,
    write_baseline: Annotated[bool, typer.Option(
        "--write-baseline", help="Instead of comparing, make RUN_DIR's speedups the new BASELINE file.")] = False,
) -> None:
    """Compare a run's per-point speedups and suite means with a baseline; exit 1 on a regression."""
    from gcmoe_bench import regress

    try:
        if write_baseline:
            path = regress.write_baseline(run_dir, baseline)
            console.print(f"baseline written: {path}")
            raise typer.Exit(0)
        verdict = regress.run_compare(run_dir, baseline, tolerance=tolerance, json_out=json_out,
                                      allow_missing=allow_missing)
    except (FileNotFoundError, ValueError) as exc:  # bad inputs exit 2, a regression exits 1
        _fail(str(exc))
    raise typer.Exit(verdict)


@app.command()
def gate(
    min_free_mib: Annotated[int, typer.Option(help="Free memory each GPU must show, MiB.")] = 51200,
    samples: Annotated[int, typer.Option(help="NVML samples per GPU (at least 3).")] = 3,
    span: Annotated[float, typer.Option(help="Seconds the samples span (at least 10).")] = 10.0,
    max_utilization: Annotated[int, typer.Option(help="Highest utilization allowed in any sample, %.")] = 0,
) -> None:
    """Check that every local GPU is idle; exit 1 naming each GPU that is not.

    Idle: 0% utilization, no compute processes and enough free memory in every NVML sample. Creates no CUDA
    context."""
    from gcmoe_bench.gate import GateError, run_gate

    try:
        report = run_gate(min_free_mib=min_free_mib, samples=samples, span_s=span,
                          max_utilization_percent=max_utilization)
    except GateError as exc:
        _fail(str(exc), code=1)
    for g in report.to_dict()["gpus"]:
        console.print(f"GPU {g['index']} ({g['name']}): idle; max util {g['max_utilization_percent']}%, "
                      f"min free {g['min_free_mib']:.0f} MiB")
    console.print(f"[green]gate passed[/]: {report.samples} samples over {report.span_s:.1f} s")


@app.command()
def env(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Print the environment: versions, driver, git state, partition, workqueue mode, kernel cache.

    The partition, workqueue mode and kernel cache come from gc_moe.runtime's description of this machine."""
    from gcmoe_bench.env import git_state, nvml_driver, package_versions

    info = {"packages": package_versions(), "git": git_state(), **nvml_driver()}
    try:
        from gc_moe.runtime import describe_environment
    except ImportError as exc:
        info["gc_moe.runtime"] = f"not available: gc_moe.runtime.describe_environment does not import ({exc})"
    else:
        try:
            info["gc_moe.runtime"] = describe_environment()
        except Exception as exc:  # noqa: BLE001 - env must print even when the runtime cannot describe itself
            info["gc_moe.runtime"] = f"describe_environment failed: {type(exc).__name__}: {exc}"
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    from rich.pretty import pprint

    pprint(info, expand_all=True)


@app.command()
def build(
    arch: Annotated[str, typer.Option(help="Target architecture, e.g. sm_90a (H20, H200) or sm_103f (B300).")],
    profile: Annotated[str, typer.Option(help="Sweep profile whose shapes to compile (sweeps/<PROFILE>.toml).")],
    layout: Annotated[str | None, typer.Option(help="A \\[layouts.NAME] section of the profile.")] = None,
) -> None:
    """Compile (offline, no GPU needed) every kernel variant a profile needs into the cubin cache."""
    from gcmoe_bench import profiles

    try:
        resolved = profiles.load_profile(profile, layout=layout)
    except profiles.ProfileError as exc:
        _fail(str(exc))
    try:
        from gc_moe.runtime.jit import build_profile
    except ImportError as exc:
        _fail(f"gc_moe.runtime.jit.build_profile is not available ({exc}); the offline build needs the GC-MoE "
              f"runtime and nvidia-cutlass-dsl (pip install -e '.[kernels]')")
    try:
        rows = build_profile(arch, resolved.to_dict(), log=console.print) or []
    except ValueError as exc:  # e.g. an unknown arch: the message lists the allowed ones
        _fail(str(exc))
    if rows:
        from rich.table import Table

        table = Table(*rows[0].keys(), title=f"kernels for {profile} on {arch}")
        for row in rows:
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)
    console.print(f"{len(rows)} kernel variant(s) in the cache for {arch}")


def main() -> None:
    """Console-script entry point (``gcmoe-bench``)."""
    app(prog_name="gcmoe-bench")


if __name__ == "__main__":
    sys.exit(main())
