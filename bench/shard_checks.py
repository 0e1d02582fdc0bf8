"""What checking a shard's bytes costs: Parquet page checksums (written by `albert preprocess`, checked as the
training input reads each row group: services/train/data.py) against a full sha256 pass over the file (the opt-in
`albert pretrain --verify-shards`).

A shard of the sample shard set's rows (.cache/albert/sample-shards-8000-128, repeated to `--mb` megabytes, row
groups of 1,400 rows as preprocess writes them) is written twice, without and with page checksums; then, interleaved
`--rounds` times, timed in CPU seconds of this process (all its threads: what the check costs, and robust to other
processes sharing the CPUs, which stretch wall times); the median and the minimum are printed:

- write         ParquetWriter, zstd, without / with write_page_checksum
- read          every row group read with the training input's columns: no checksums in the file / checksums
                read and verified (page_checksum_verification=True)
- sha256        the whole file hashed in 4 MB chunks (albert_core.files.file_sha256), from the page cache
- crc32         the whole file's CRC32 (zlib), from the page cache: what verifying every page computes, alone

    python bench/shard_checks.py [--mb 36] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.examples.shards import EXAMPLE_SCHEMA
from albert_core.files import file_sha256

SOURCE = Path(".cache/albert/sample-shards-8000-128/train")
GROUP_ROWS = 1400
COLUMNS = [f.name for f in EXAMPLE_SCHEMA]


def write(table: pa.Table, path: Path, copies: int, checksums: bool) -> float:
    started = time.process_time()
    with pq.ParquetWriter(path, table.schema, compression="zstd", write_page_checksum=checksums) as writer:
        for _ in range(copies):
            for first in range(0, table.num_rows, GROUP_ROWS):
                part = table.slice(first, GROUP_ROWS)
                writer.write_table(part, row_group_size=part.num_rows)
    return time.process_time() - started


def read(path: Path, verify: bool) -> float:
    started = time.process_time()
    shard = pq.ParquetFile(path, page_checksum_verification=verify)
    for group in range(shard.metadata.num_row_groups):
        shard.read_row_group(group, columns=COLUMNS)
    return time.process_time() - started


def sha256(path: Path) -> float:
    started = time.process_time()
    file_sha256(path)
    return time.process_time() - started


def crc32(path: Path) -> float:
    started = time.process_time()
    with open(path, "rb") as f:
        value = 0
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=36)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    table = pa.concat_tables(pq.read_table(p) for p in sorted(SOURCE.glob("*.parquet")))
    one_copy = sum(p.stat().st_size for p in SOURCE.glob("*.parquet"))
    copies = max(1, round(args.mb * 1e6 / one_copy))
    work = Path(tempfile.mkdtemp(prefix="shard-checks-"))
    plain, checked = work / "plain.parquet", work / "checked.parquet"
    times: dict[str, list[float]] = {}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    try:
        for _ in range(args.rounds):
            for name, run in (
                ("write, no checksums", lambda: write(table, plain, copies, False)),
                ("write, page checksums", lambda: write(table, checked, copies, True)),
                ("read, no checksums", lambda: read(plain, False)),
                ("read, checksums verified", lambda: read(checked, True)),
                ("sha256 of the file", lambda: sha256(checked)),
                ("crc32 of the file", lambda: crc32(checked)),
            ):
                times.setdefault(name, []).append(run())
        sizes = {"plain": plain.stat().st_size, "checked": checked.stat().st_size}
        groups = pq.ParquetFile(checked).metadata.num_row_groups
    finally:
        for path in (plain, checked):
            path.unlink(missing_ok=True)
        work.rmdir()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"shard: {table.num_rows * copies:,} rows in {groups} row groups; {sizes['plain']:,} bytes without page "
          f"checksums, {sizes['checked']:,} with (+{sizes['checked'] - sizes['plain']:,})")  # fmt: skip
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<28} median {median * 1e3:8.1f} ms CPU  ({sizes['checked'] / median / 1e6:7.0f} MB/s)  "
              f"min {min(values) * 1e3:8.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
