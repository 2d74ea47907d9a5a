"""``raylift prep`` at two sizes 10x apart, text and images: throughput and driver memory.

    python benchmarks/prep.py [--mb 200 2000] [--images 5000 50000] [--repeats 1] [--keep DIR]

For each size, writes deterministic data (generation is not timed): a JSONL corpus of
documents cut from the standard library's sources, each made unique by its number, and
a folder of JPEGs of drawn shapes, three classes (``tests/corpora.py``). One local Ray
serves the whole script. Per repeat, interleaved:

- raylift: ``raylift prep`` as its own process joined to that Ray (the ``gpt`` task
  with ``corpus: DIR/*.jsonl``): Ray Data reads the files, packs the windows on every
  CPU and writes the parquet shards. Its driver's peak RSS is sampled every 50 ms;
  Ray's own processes are not the driver.
- hand-written: a ``multiprocessing.Pool`` with one process per core, each taking whole
  JSONL files (packing the same ``block_size + 1`` windows with the same separator) or
  chunks of image paths (the images task's own decode and resize), and writing parquet
  with the same row groups (no shuffle: it does less than prep);
- Ray Data alone: the Pool's work as a plain Ray Data pipeline (``ray_data_prep.py``),
  joined to the same Ray: what Ray Data itself pays on this machine.

Prints MB/s (of JSONL read), rows/s (windows written) and peak driver RSS per size, the
RSS ratio between the sizes (goal: within 1.2x) and raylift / hand-written throughput
(goal: >= 0.8x).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.corpora import SHAPES, write_image_folder  # noqa: E402

BLOCK = 128
IMAGE_SIZE = 32
SEP = b"\x00"
DOCS_PER_FILE_MB = 64  # each JSONL file about this size


def write_corpus(folder: Path, megabytes: int) -> int:
    """JSONL files of about ``megabytes`` MB in total; returns the bytes written."""
    from raylift.tasks.gpt import corpus_files, stdlib_root

    pieces = [p.read_text(errors="replace")[:6000] for p in corpus_files(stdlib_root())[:2000]]
    folder.mkdir(parents=True, exist_ok=True)
    target, written, n, part = megabytes * 2**20, 0, 0, 0
    while written < target:
        with open(folder / f"part-{part:05d}.jsonl", "w") as f:
            size = 0
            while size < DOCS_PER_FILE_MB * 2**20 and written + size < target:
                line = json.dumps({"id": n, "text": f"# doc {n}\n" + pieces[n % len(pieces)]})
                f.write(line + "\n")
                size += len(line) + 1
                n += 1
        written += size
        part += 1
    return written


def raylift_prep(data: Path, out: Path) -> tuple[float, int, int]:
    """(seconds, rows, peak driver RSS bytes) of ``raylift prep`` on ``data``."""
    if any(data.glob("*.jsonl")):
        config = "gpt-tiny.yaml"
        task_args = f"{{corpus: '{data}/*.jsonl', block_size: {BLOCK}, max_bytes: null}}"
    else:
        config = "images.yaml"
        task_args = f"{{root: '{data}', image_size: {IMAGE_SIZE}, val_percent: 10}}"
    args = [
        sys.executable, "-m", "raylift.cli", "prep", str(REPO / "configs" / config),
        f"data.shards={out}", "--force", f"task_args={task_args}",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"raylift prep failed:\n{output[-3000:]}")
    manifest = json.loads((out / "_raylift_manifest.json").read_text())
    return seconds, sum(manifest["rows"].values()), peak


def pack_file(job: tuple[str, str]) -> int:
    """One JSONL file -> one parquet file of windows, as the gpt task packs them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src, dst = job
    with open(src, "rb") as f:
        docs = [json.loads(line)["text"].encode() for line in f]
    windows = []
    for i in range(0, len(docs), 64):  # prep's preprocess batch
        arr = np.frombuffer(SEP.join(docs[i : i + 64]), dtype=np.uint8)
        n = max((len(arr) - 1) // BLOCK, 0)
        idx = np.arange(n)[:, None] * BLOCK + np.arange(BLOCK + 1)[None, :]
        windows.append(arr[idx])
    tokens = np.concatenate(windows)
    flat = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), BLOCK + 1)
    pq.write_table(pa.table({"tokens": flat}), dst, row_group_size=128)
    return len(tokens)


def decode_chunk(job: tuple[list[str], str]) -> int:
    """Image files -> one parquet file of uint8 CHW images and labels."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylift.tasks.images import decode

    paths, dst = job
    images = np.stack([decode(Path(p).read_bytes(), IMAGE_SIZE) for p in paths])
    labels = [SHAPES.index(Path(p).parent.name) for p in paths]
    flat = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), images[0].size)
    pq.write_table(pa.table({"image": flat, "label": labels}), dst, row_group_size=128)
    return len(paths)


def pool_prep(data: Path, out: Path) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    jsonl = sorted(data.glob("*.jsonl"))
    if jsonl:
        fn, jobs = pack_file, [(str(p), str(out / f"{p.stem}.parquet")) for p in jsonl]
    else:
        images = sorted(str(p) for p in data.rglob("*.*"))
        chunks = [images[i : i + 2048] for i in range(0, len(images), 2048)]
        fn, jobs = decode_chunk, [(c, str(out / f"{i:05d}.parquet")) for i, c in enumerate(chunks)]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(os.cpu_count()) as pool:
        rows = sum(pool.map(fn, jobs))
    return time.perf_counter() - started, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="*", default=[200, 2000])
    parser.add_argument("--images", type=int, nargs="*", default=[5000, 50000])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="folder for the corpora (kept between runs)")
    args = parser.parse_args()
    print(describe(), flush=True)
    import ray

    work = args.keep or Path(tempfile.mkdtemp(prefix="raylift-bench-prep-"))
    ctx = ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    peaks: dict[str, dict[int, int]] = {"MiB JSONL": {}, "JPEGs": {}}
    try:
        for mb in args.mb:
            corpus = work / f"corpus-{mb}mb"
            if not corpus.exists():
                write_corpus(corpus, mb)
            size = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
            peaks["MiB JSONL"][mb] = measure(
                f"{size / 2**20:,.0f} MiB JSONL", corpus, work, args.repeats
            )
        for count in args.images:
            folder = work / f"images-{count}"
            if not folder.exists():
                write_image_folder(folder, per_class=count // len(SHAPES), size=64)
            peaks["JPEGs"][count] = measure(f"{count:,} JPEGs", folder, work, args.repeats)
    finally:
        ray.shutdown()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    for kind, by_size in peaks.items():
        if len(by_size) > 1:
            lo, hi = min(by_size.values()), max(by_size.values())
            print(f"{kind}: driver peak RSS, largest / smallest size {hi / lo:.2f}x (goal <= 1.2x)")
    save_rows()


def ray_data_prep(data: Path, out: Path) -> float:
    """Seconds of ``ray_data_prep.py``: the Pool's work in plain Ray Data, joined to this
    script's Ray like ``raylift prep``."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ray_data_prep.py"), str(data), str(out)],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def measure(label: str, data: Path, work: Path, repeats: int) -> int:
    """Times the three preps on ``data``; prints a line; returns raylift's peak driver RSS."""
    size = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
    ours, theirs, plain, rss = [], [], [], []
    for _ in range(repeats):
        secs, rows, peak = raylift_prep(data, work / "shards")
        ours.append(secs)
        rss.append(peak)
        base_secs, base_rows = pool_prep(data, work / "pool")
        theirs.append(base_secs)
        plain.append(ray_data_prep(data, work / "ray-data"))
    t, b, r = statistics.median(ours), statistics.median(theirs), statistics.median(plain)
    mib = size / 2**20
    print(
        f"{label:>16}  raylift prep {t:6.1f} s  {mib / t:6.1f} MiB/s  "
        f"{rows / t:>9,.0f} rows/s  driver peak RSS {max(rss) / 2**20:,.0f} MiB | Pool "
        f"{b:6.1f} s  {mib / b:6.1f} MiB/s  {base_rows / b:>9,.0f} rows/s | Ray Data alone "
        f"{r:6.1f} s  {mib / r:6.1f} MiB/s | throughput against the Pool: raylift "
        f"{b / t:.2f}x, Ray Data alone {b / r:.2f}x",
        flush=True,
    )
    peak = f"{max(rss) / 2**20:,.0f}"
    ROWS.append([label, f"{t:.1f} s", f"{mib / t:.1f}", f"{rows / t:,.0f}", peak,
                 f"{b:.1f} s", f"{r:.1f} s", f"{b / t:.2f}x"])  # fmt: skip
    return max(rss)


ROWS: list[list[str]] = []  # one per measure(), for the results file


def save_rows() -> None:
    if not ROWS:
        return
    last = ROWS[-1]
    save(
        __file__,
        "raylift prep against a multiprocessing.Pool and Ray Data alone",
        ["data", "raylift", "MiB/s", "rows/s", "driver peak RSS MiB", "Pool",
         "Ray Data alone", "raylift / Pool throughput"],
        ROWS,
        {"what": f"prep of {last[0]}", "raylift": last[1], "baseline": f"Pool {last[5]}",
         "ratio": f"{last[7]} the Pool's throughput"},
    )  # fmt: skip


if __name__ == "__main__":
    main()
