"""``raylift VERB ...``: parses arguments and calls into the package; no logic of its own.

The entry point, and the one module that imports raylift's own modules inside functions:
each command loads what it runs when it runs, so ``raylift --help``, ``raylift verify``
and a bad command line answer without loading torch, Ray or MLflow. Everywhere else
imports sit at the top of the module (tests/unit/test_lint.py holds it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from raylift.core import console, storage
from raylift.core.config import ConfigError, EnvironmentProblem
from raylift.core.errors import RefusedPickle, SourceError
from raylift.core.parsing import RUN_CONFIG, run_config_text
from raylift.core.runlock import RunLocked
from raylift.core.startup import Startup, process_start

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


DEFAULT_MAX_SHARD = "5GB"  # as save_pretrained shards


def load_config(path: str, overrides: Sequence[str] = ()) -> Any:
    """:func:`raylift.validation.load_config`: the registries it checks against bring torch."""
    from raylift import validation

    return validation.load_config(path, overrides)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to a YAML config, e.g. configs/quickstart.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. optim.lr=1e-3 scaling.num_workers=4",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show Ray's, MLflow's and DeepSpeed's own console lines (RAYLIFT_VERBOSE=1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylift", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    _config_args(verbs.add_parser("train", help="one training run on local Ray or RAY_ADDRESS"))
    _config_args(verbs.add_parser("tune", help="a Ray Tune sweep from the config's tune: section"))
    sub = verbs.add_parser("submit", help="submit train or tune as a Ray Job, follow its logs")
    sub.add_argument("config", help="path to a YAML config inside the current folder")
    sub.add_argument(
        "overrides",
        nargs="*",
        metavar="[train|tune] key=value",
        help="what the job runs (default train), then dotted overrides",
    )
    sub.add_argument("--address", required=True, help="the Ray dashboard, http://HOST:8265")
    sub.add_argument("--no-wait", action="store_true", help="print the job id and return")
    sub.add_argument(
        "--in-place",
        action="store_true",
        help="every node mounts this folder at the same path (NFS): run there, ship no copy",
    )
    _config_args(verbs.add_parser("validate", help="load and check a config, print it resolved"))
    prep = verbs.add_parser("prep", help="preprocess once with Ray Data into parquet shards")
    _config_args(prep)
    prep.add_argument("--force", action="store_true", help="prepare again, replacing the shards")
    prep.add_argument(
        "--show", type=int, default=0, metavar="N",
        help="print N training examples as the model gets them, the trained tokens set apart",
    )  # fmt: skip
    prep.add_argument("--json", action="store_true", help="with --show: one JSON object each")
    plan = verbs.add_parser("plan", help="memory per worker for each strategy; auto's choice")
    _config_args(plan)
    plan.add_argument("--gpus", type=int, required=True, help="world size (workers)")
    plan.add_argument("--gpu-mem", type=float, required=True, help="memory per worker, GiB")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the workers span (default 1)")
    doc = verbs.add_parser("doctor", help="a short profiled run: the bottleneck and what to change")
    _config_args(doc)
    doc.add_argument(
        "--steps", type=int, default=20, help="steps per window: warm-up, measured, profiled"
    )
    exp = verbs.add_parser("export", help="consolidated fp32 state_dict from a checkpoint")
    exp.add_argument("path", help="a run folder (storage/name) or a checkpoint-step* folder")
    exp.add_argument("--out", required=True, help="where to write it, e.g. model.safetensors")
    exp.add_argument(
        "--format",
        choices=("pt", "safetensors", "hf", "peft"),
        help="torch.save state_dict, safetensors (what model.weights reads), hf (a "
        "from_pretrained folder, for a task whose model is a Hugging Face model; a run with "
        "adapters: the base with them merged), or peft (a run's adapters, as "
        "PeftModel.from_pretrained loads them); default: from the --out suffix",
    )
    exp.add_argument(
        "--config",
        help="--format hf: a config to use instead of the one the run recorded (and "
        "overrides after it)",
    )
    exp.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD,
        help="--format hf: safetensors files of at most this size (e.g. 2GB, 500MB), with an "
        f"index, as save_pretrained writes them (default {DEFAULT_MAX_SHARD})",
    )
    exp.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    chk = verbs.add_parser(
        "check", help="can this run start on this cluster: storage, tracking, versions, fit"
    )
    _config_args(chk)
    chk.add_argument(
        "--cluster-config",
        help="the cluster's `ray up` YAML: its node types say what the autoscaler can add",
    )
    ver = verbs.add_parser(
        "verify", help="check a run's checkpoints (sizes, checksums, pickles) offline"
    )
    ver.add_argument("run", help="a run folder: storage/name, e.g. runs/digits-ddp")
    return parser


AGAIN = "rerun the same command"  # what a command that changes nothing says once the store answers


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from raylift.artifacts.export import export
    from raylift.tensors.checkpoints import CheckpointError

    try:
        with console.library_quiet(), storage.reaching(args.path, "reading it", AGAIN):
            if args.format in ("hf", "peft") or _adapted(args):
                ckpt, n = _export_hf(args)
            else:
                ckpt, n = export(args.path, Path(args.out), args.format)
    except CheckpointError as exc:
        print(f"raylift: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"raylift: wrote {n} tensors (fp32) from {ckpt} to {args.out}")
    return EXIT_OK


def _adapted(args: argparse.Namespace) -> bool:
    """Whether the run trained adapters (its recorded config, or ``--config``, says)."""

    if not args.config and run_config_text(args.path) is None:
        return False
    try:
        return bool(load_config(args.config or args.path, args.overrides).model.adapter.type)
    except ConfigError:  # said when a format needs the config; the weights need none
        return False


def _export_hf(args: argparse.Namespace) -> tuple[Any, int]:
    from pathlib import Path

    from raylift.artifacts.export import export_hf, require_checkpoint
    from raylift.tasks import build_task
    from raylift.tensors.checkpoints import CheckpointError

    require_checkpoint(args.path)  # a folder with no checkpoint: said first
    if not args.config and run_config_text(args.path) is None:
        raise CheckpointError(
            f"--format {args.format}: {args.path} holds no {RUN_CONFIG} (runs record the "
            "config they ran with); pass the run's config with --config CONFIG"
        )
    cfg = load_config(args.config or args.path, args.overrides)
    task = build_task(cfg.task, cfg.task_args)
    out = Path(args.out)
    if cfg.model.adapter.type:
        from raylift.artifacts.adapter_export import export_merged, export_merged_file, export_peft

        if args.format == "peft":
            return export_peft(args.path, out, cfg, task)
        if args.format == "hf":
            return export_merged(args.path, out, cfg, task, args.max_shard_size)
        fmt = args.format or ("safetensors" if out.suffix == ".safetensors" else "pt")
        return export_merged_file(args.path, out, cfg, task, fmt)
    if args.format == "peft":
        raise CheckpointError(
            "--format peft: the run trained every parameter (model.adapter.type: null); "
            "export it with --format hf or safetensors"
        )
    return export_hf(args.path, out, task, args.max_shard_size)


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when the newest checkpoint is intact, 1 when only older ones are, 2 when none
    is or when any holds a file whose pickle is refused (raylift would load it nowhere)."""

    from raylift.tensors.checkpoints import verify_run

    with storage.reaching(args.run, "reading its checkpoints", AGAIN):
        results = verify_run(args.run)
        if not results:
            print(f"raylift: no checkpoint-step* folders in {args.run}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(_run_summary(args.run))
    for ckpt, problem in results:
        print(f"{storage.name(ckpt)}: {'intact' if problem is None else problem}")
    refused = [storage.name(c) for c, problem in results if isinstance(problem, RefusedPickle)]
    if refused:
        print(
            f"raylift: {', '.join(refused)} of {args.run} hold(s) a file whose pickle raylift "
            "refuses: a resume, an export or a logged model stops there, never loading it",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    intact = [c for c, problem in results if problem is None]
    if not intact:
        print("raylift: no intact checkpoint; a rerun starts over", file=sys.stderr)
        return EXIT_BAD_INPUT
    if results[-1][1] is not None:
        print(f"raylift: a rerun resumes from {storage.name(intact[-1])}, the newest intact one")
        return EXIT_FAILED
    return EXIT_OK


def _run_summary(run: str) -> str:
    """One line naming what a run folder holds, from the config it recorded."""

    import yaml

    text = run_config_text(run)
    if text is None:
        return f"raylift: {run}: no {RUN_CONFIG} (a run from before runs recorded their config)"
    # Read as text, not loaded: loading imports the module its task names, and verify runs
    # on folders it does not trust.
    raw = yaml.safe_load(text) or {}
    strategy = (raw.get("strategy") or {}).get("name", "ddp")
    workers = (raw.get("scaling") or {}).get("num_workers", "?")
    return (
        f"raylift: {run}: run {raw.get('name')!r}, task {raw.get('task')}, strategy {strategy}, "
        f"precision {raw.get('precision')}, {workers} worker(s)"
    )


def _run_error(exc: Exception) -> int:
    """A run that could not start (bad data or shards: exit 2) or that failed (exit 1)."""
    from raylift.data.manifest import ShardError
    from raylift.run.launch import StorageFailed

    print(f"raylift: {exc}", file=sys.stderr)
    bad_input = (ShardError, SourceError, RunLocked, StorageFailed)
    return EXIT_BAD_INPUT if isinstance(exc, bad_input) else EXIT_FAILED


def cmd_doctor(args: argparse.Namespace) -> int:
    from raylift.commands.doctor import run_doctor
    from raylift.data.manifest import ShardError
    from raylift.run.launch import RunFailed

    startup = Startup.begin(process_start())
    cfg = load_config(args.config, args.overrides)
    if args.steps < 2:
        print("raylift: --steps must be >= 2", file=sys.stderr)
        return EXIT_BAD_INPUT
    startup.mark("launch")
    try:
        result = run_doctor(cfg, args.steps, startup=startup)
    except (ShardError, SourceError, RunFailed) as exc:
        return _run_error(exc)
    print(result.render())
    print(f"raylift: trace, chart and verdict in {result.folder} and MLflow run {result.run_id}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from raylift.run.plan import PlanError, make_plan, render

    cfg = load_config(args.config, args.overrides)
    if args.gpus < 1 or args.gpu_mem <= 0:
        print("raylift: --gpus must be >= 1 and --gpu-mem > 0 (GiB)", file=sys.stderr)
        return EXIT_BAD_INPUT
    # --gpus plans GPU workers whatever the config says: `precision: auto` is resolved as
    # on an Ampere or newer GPU, not as on the host the plan is made on (a laptop's CPU
    # with or without bf16 would otherwise change every activation figure).
    cfg = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, use_gpu=True))
    try:
        plan = make_plan(cfg, args.gpus, args.gpu_mem, args.nodes)
    except PlanError as exc:
        print(f"raylift: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(render(plan, args.gpus, args.gpu_mem))
    return EXIT_OK


def cmd_prep(args: argparse.Namespace) -> int:
    from raylift.data.manifest import ShardError, shard_root
    from raylift.data.shards import prep
    from raylift.run.check import writable
    from raylift.run.connect import connect_ray
    from raylift.tasks import build_task

    cfg = load_config(args.config, args.overrides)
    task = build_task(cfg.task, cfg.task_args)
    try:
        root, _ = shard_root(cfg, task)  # the data's version: its files are listed here
        writable(root, "data.shards")
        result = prep(cfg, task, root, force=args.force, connect=lambda: connect_ray(cfg))
    except (ShardError, SourceError) as exc:
        print(f"raylift: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    m = result.manifest
    rows = ", ".join(f"{s} {m.rows(s):,} rows in {len(m.splits[s])} file(s)" for s in m.splits)
    if result.skipped:
        print(f"raylift: {root} is already prepared for this task ({rows}); nothing to do")
    else:
        print(f"raylift: prepared {root} in {result.seconds:.1f} s: {rows}")
    return show_examples(task, m, args.show, args.json) if args.show else EXIT_OK


def show_examples(task: Any, manifest: Any, n: int, as_json: bool) -> int:
    """``prep --show N``: the first N training examples of the shards, token by token,
    which tokens carry loss set apart (``--json``: one object per example)."""
    import json

    from raylift.data.manifest import head
    from raylift.tasks.chat import shown, unpacked

    tokenizer = getattr(task, "tokenizer", None)
    columns = head(manifest, "train", n * 64)  # a window holds one example or more
    if tokenizer is None or "labels" not in columns:
        print("raylift: --show needs a task whose rows are examples with a loss mask "
              f"(hf-sft); task {task.__class__.__name__} has none", file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    colour = sys.stdout.isatty() and not as_json
    for ids, trained in unpacked(columns, n):
        pieces = [
            tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for t in ids
        ]
        if as_json:
            print(json.dumps({"tokens": pieces, "trained": trained}, ensure_ascii=False))
        else:
            print(
                f"--- {sum(trained)} of {len(ids)} tokens trained\n{shown(pieces, trained, colour)}"
            )
    return EXIT_OK


def cmd_tune(args: argparse.Namespace) -> int:
    from raylift.commands.tune import parse_sweep, render, tune_run

    cfg = load_config(args.config, args.overrides)
    spec = parse_sweep(cfg)  # a bad tune: section fails here, before Ray starts
    try:
        result = tune_run(cfg)
    except RunLocked as exc:
        return _run_error(exc)
    print(render(result, spec.metric))
    if result.best is None:
        print(f"raylift: sweep {result.name!r}: no trial reported {spec.metric}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"raylift: sweep {result.name!r} finished in {result.seconds:.0f} s; best trial "
        f"{result.best.trial_id}: {spec.metric} {result.best.metric:.4f}"
    )
    if result.best_config:
        print(f"raylift: best config: {result.best_config} (raylift train {result.best_config})")
    print(f"raylift: MLflow parent run {result.parent_run_id}")
    return EXIT_OK


def cmd_submit(args: argparse.Namespace) -> int:
    from raylift.commands.submit import follow, submit

    verb = "train"
    if args.overrides and args.overrides[0] in ("train", "tune"):
        verb, args.overrides = args.overrides[0], args.overrides[1:]
    cfg = load_config(args.config, args.overrides)
    if verb == "tune":
        from raylift.commands.tune import parse_sweep

        parse_sweep(cfg)  # a bad tune: section fails here, not on the cluster
    try:
        jobs, job_id = submit(
            cfg, args.config, verb, args.overrides, args.address, in_place=args.in_place
        )
    except (RuntimeError, ConnectionError) as exc:
        print(f"raylift: submitting to {args.address} failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"raylift: submitted {job_id} to {args.address}")
    if args.no_wait:
        print(job_id)
        return EXIT_OK
    status = follow(jobs, job_id)
    print(f"raylift: job {job_id} {status}")
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0 when the run can start on the cluster, 2 with each problem and its fix."""
    from raylift.run.check import check, render
    from raylift.run.connect import connect_ray

    cfg = load_config(args.config, args.overrides)
    connect_ray(cfg)
    import ray

    address = ray.get_runtime_context().gcs_address
    report = check(cfg, args.cluster_config)
    print(render(report, f"the cluster at {address}"))
    return EXIT_OK if report.ok else EXIT_BAD_INPUT


def cmd_validate(args: argparse.Namespace) -> int:
    from raylift.artifacts.tracking import redacted_yaml

    print(redacted_yaml(load_config(args.config, args.overrides)), end="")
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from raylift.data.manifest import ShardError
    from raylift.run.launch import RunFailed, train

    startup = Startup.begin(process_start())  # the user waits from the command, not from here
    cfg = load_config(args.config, args.overrides)
    startup.mark("launch")
    try:
        result = train(cfg, startup=startup)
    except (ShardError, SourceError, RunFailed, RunLocked) as exc:
        return _run_error(exc)
    shown = "  ".join(
        f"{k} {v:.4f}"
        for k, v in sorted(result.metrics.items())
        if k.startswith(("val_", "train_"))
    )
    print(
        f"raylift: run {result.name!r} finished in {result.seconds:.0f} s at step "
        f"{int(result.metrics.get('step', 0))}: {shown}"
    )
    print(f"raylift: checkpoint {result.checkpoint}")
    print(f"raylift: MLflow run {result.run_id} in {result.tracking_uri}")
    return EXIT_OK


COMMANDS = {
    "train": cmd_train,
    "validate": cmd_validate,
    "prep": cmd_prep,
    "tune": cmd_tune,
    "submit": cmd_submit,
    "export": cmd_export,
    "verify": cmd_verify,
    "check": cmd_check,
    "plan": cmd_plan,
    "doctor": cmd_doctor,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`plan CONFIG --gpus 8 optim.lr=1e-3`): collect them too.
    args, extra = parser.parse_known_args(argv)
    if args.verb == "submit" and extra and extra[0] in ("train", "tune"):
        args.overrides, extra = [extra[0], *args.overrides], extra[1:]  # CONFIG --address URL tune
    stray = [t for t in extra if "=" not in t or t.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "verbose", False):
        os.environ["RAYLIFT_VERBOSE"] = "1"  # before anything reads it: workers inherit it
    console.quiet_driver()
    # `task: mypkg.mod:Class` resolves from the current folder, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return COMMANDS[args.verb](args)
    except (ConfigError, EnvironmentProblem, RefusedPickle, storage.StorageError) as exc:
        print(f"raylift: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(
            "raylift: interrupted; rerun the same command to resume from the latest checkpoint",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
