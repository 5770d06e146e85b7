"""Local data files — JSONL, JSON, Parquet, a ``datasets`` directory — read for the examples and for
``trl-tree inspect``, with errors that name the file, the line and what to do.

Why not ``datasets.load_dataset`` alone: on a malformed JSONL line it ends 23 frames deep in
``DatasetGenerationError`` without naming the line, and on an empty file in a bare
``StopIteration``; per-line ``json.loads`` reports every bad line as "line 1". Here a file that
``datasets`` cannot read is read again line by line to say which line is at fault.
"""

from __future__ import annotations

import json
import os


class DataError(ValueError):
    """A data file, column or row problem, said in one line (the CLI and the examples print it
    without a traceback)."""


def _kind(path: str) -> str:
    """``"dir"`` (a ``datasets`` directory), ``"parquet"`` or ``"json"`` (.jsonl, .json); anything else
    — or nothing there — is a :class:`DataError`."""
    if not os.path.exists(path):
        raise DataError(f"no such file or directory: {path}")
    if os.path.isdir(path):
        return "dir"
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".jsonl", ".json")):
        return "json"
    raise DataError(f"{path}: expected .jsonl, .json, .parquet or a datasets directory")


def _from_disk(path: str):
    """A ``datasets`` directory (``save_to_disk``): the dataset, or a DatasetDict's first split."""
    from datasets import load_from_disk

    try:
        data = load_from_disk(path)
    except Exception as e:
        raise DataError(f"{path} is not a dataset saved with save_to_disk ({e})") from e
    return data[next(iter(data.keys()))] if hasattr(data, "keys") else data


def read_rows(path: str) -> list[dict]:
    """Rows of a JSONL / JSON / Parquet file or of a ``datasets`` directory (``save_to_disk``)."""
    kind = _kind(path)
    if kind == "dir":
        return [dict(row) for row in _from_disk(path)]
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataError(f"cannot read {path} as Parquet ({e})") from e
    lower = path.lower()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if lower.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                                "that line (JSON lines: one JSON object per line)") from e
            if not isinstance(rows[-1], dict):
                raise DataError(f"{path}, line {number}: a JSON {type(rows[-1]).__name__}, not an object; every line "
                                "must be one row with named columns, e.g. {\"messages\": [...]}")
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{path}: every row must be a JSON object (a row with named columns)")
    return rows


def load_local_dataset(path: str):
    """A local file or ``datasets`` directory as a ``datasets.Dataset`` (its first split), loaded by
    ``datasets`` as stock TRL scripts load it; a file it cannot read, or one with no rows, raises
    :class:`DataError` naming the line at fault."""
    kind = _kind(path)
    if kind == "dir":
        data = _from_disk(path)
    else:
        from datasets import load_dataset

        try:
            data = load_dataset(kind, data_files=path, split="train")
        except Exception as e:  # say where the file is at fault, where it can be read line by line
            if not read_rows(path):
                raise DataError(f"{path} has no rows: nothing to train on") from e
            raise DataError(f"cannot load {path} ({type(e).__name__}: {e})") from e
    if len(data) == 0:
        raise DataError(f"{path} has no rows: nothing to train on")
    return data
