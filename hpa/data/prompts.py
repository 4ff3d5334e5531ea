"""Reading records (JSONL or Parquet) and the prompt dataset used for rollouts.

Record reading lives here and is shared by ``preferences.py`` and ``data_tools``: every record
carries its location (``file:line`` for JSONL, ``file[row N]`` for Parquet, both 1-based). A
malformed record raises ``RecordError`` naming file, line and key (``on_error="raise"``) or is
counted and written to a rejects JSONL file (``on_error="skip"``). Records skipped by policy (too
long, duplicate) are always counted and written there too. Blank JSONL lines are not records; they
are counted in the stats as ``num_blank_lines``. A JSONL line that is not valid UTF-8 or holds a
NUL byte is a malformed record like any other. A Parquet file that cannot be read (truncated,
corrupt) or whose columns have the wrong types raises ``DataFileError`` naming the file and column,
whatever ``on_error`` says: no record of it can be trusted.

A rejects file has one JSON object per line:
``{"location": "data.jsonl:7", "reason": "malformed", "key": "prompt", "message": "...", "record": ...}``
where ``record`` is the parsed record, or the raw line when it was not valid JSON (bytes that are
not UTF-8 and control characters written as ``\\xNN`` escapes).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from hpa.config.errors import UserError
from hpa.data.tokenizer import Tokenizer

# Implementation names of the data config's choices (tests compare them with hpa.config.data).
ON_ERROR_MODES = ("raise", "skip")
PROMPT_TRUNCATION_MODES = ("skip", "truncate_left")


class RecordError(UserError):
    """A malformed record. The message names the file, the line and the key, and the fix (a user's mistake: one
    line from the command line, whichever data file it is in)."""

    def __init__(self, location: str, message: str, key: Optional[str] = None):
        self.location = location
        self.key = key
        self.message = message
        where = f"key {key!r}: " if key else ""
        super().__init__(f"{location}: {where}{message} (fix the record, or set data.on_error=skip "
                         f"to count it and write it to the rejects file)")


class DataFileError(UserError):
    """A data file that cannot be read as a whole; the message names the file (and column) and the fix."""

    def __init__(self, path: str, message: str, column: Optional[str] = None):
        self.path = path
        self.column = column
        where = f"column {column!r}: " if column else ""
        super().__init__(f"{path}: {where}{message}")


class SkipRecord(Exception):
    """Raised by an example builder to skip a record by policy (counted and written out)."""

    def __init__(self, reason: str, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.reason = reason
        self.key = key
        self.message = message


class RejectLog:
    """Counts skipped records by reason and writes each one to a JSONL file.

    Args:
        path: the rejects file (created, or truncated, on the first reject; parent directories are
            made). None keeps rejects in ``self.records`` and warns with the count on ``close``.
    """

    def __init__(self, path: Optional[str] = None):
        self.path = path
        self.counts: Dict[str, int] = collections.Counter()
        self.records: List[Dict[str, Any]] = []
        self._file = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, location: str, reason: str, record: Any, *, key: Optional[str] = None, message: str = "",
            **extra: Any) -> None:
        entry = {"location": location, "reason": reason, "key": key, "message": message, **extra, "record": record}
        self.counts[reason] += 1
        if self.path is None:
            self.records.append(entry)
            return
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self.path is None and self.total:
            warnings.warn(f"{self.total} records were skipped ({dict(self.counts)}); they are kept in "
                          f"RejectLog.records because no rejects path was given", stacklevel=2)

    def __enter__(self) -> "RejectLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rejects_path_for(rejects_dir: Optional[str], data_path: str) -> Optional[str]:
    """``<rejects_dir>/<name>.rejects.jsonl`` where name is the data file's name without extension."""
    if rejects_dir is None:
        return None
    name = os.path.basename(data_path)
    for ext in (".jsonl", ".json", ".parquet"):
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    return os.path.join(rejects_dir, f"{name}.rejects.jsonl")


# field name -> (accepted types, required). An empty (whitespace-only) string counts as missing.
FieldSpec = Dict[str, Tuple[Tuple[type, ...], bool]]


def check_fields(record: Any, fields: FieldSpec) -> Optional[Tuple[Optional[str], str]]:
    """Return ``(key, problem)`` for the first problem of ``record``, or None when it is well formed."""
    if not isinstance(record, dict):
        return None, f"is a JSON {type(record).__name__}, expected an object with keys {sorted(fields)}"
    for key, (types, required) in fields.items():
        value = record.get(key)
        if value is None:
            if required:
                return key, f"is missing; every record needs {sorted(k for k, (_, r) in fields.items() if r)}"
            continue
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            expected = " or ".join(t.__name__ for t in types)
            return key, f"has type {type(value).__name__}, expected {expected}"
        if isinstance(value, str) and not value.strip():
            return key, "is empty"
        if isinstance(value, list) and not value:
            return key, "is an empty list"
    return None


def show_bytes(raw: bytes) -> str:
    """``raw`` as printable text: UTF-8 where it decodes, ``\\xNN`` for other bytes and control characters."""
    text = raw.decode("utf-8", errors="backslashreplace")
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", text)


def decode_line(raw: bytes) -> Tuple[str, Optional[str]]:
    """A JSONL line's text and None, or its safe display (``show_bytes``) and what is wrong with it."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        return show_bytes(raw), f"has a NUL byte at column {nul + 1}"
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return show_bytes(raw), f"is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"


def _iter_jsonl(path: str, stats: Dict[str, int]) -> Iterator[Tuple[str, Any, Optional[str]]]:
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 must not end the file
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                stats["num_blank_lines"] += 1
                continue
            line, problem = decode_line(raw.rstrip(b"\r\n"))
            if problem is not None:
                yield f"{path}:{line_no}", line, problem
                continue
            try:
                yield f"{path}:{line_no}", json.loads(line), None
            except json.JSONDecodeError as e:
                yield f"{path}:{line_no}", line, f"is not valid JSON ({e.msg} at column {e.colno})"


def _arrow_python_type(arrow_type) -> Optional[type]:
    """The Python type ``to_pylist`` gives a Parquet column's values, or None for other types."""
    import pyarrow as pa

    t = pa.types
    if t.is_dictionary(arrow_type):
        return _arrow_python_type(arrow_type.value_type)
    checks = ((t.is_string, str), (t.is_large_string, str), (t.is_boolean, bool), (t.is_integer, int),
              (t.is_floating, float), (t.is_list, list), (t.is_large_list, list), (t.is_fixed_size_list, list),
              (t.is_struct, dict), (t.is_null, type(None)))
    return next((py for check, py in checks if check(arrow_type)), None)


def _check_parquet_columns(path: str, schema, fields: FieldSpec) -> None:
    names = list(schema.names)
    for key, (types, required) in fields.items():
        if key not in names:
            if required:
                raise DataFileError(path, f"is missing; the file has columns {names}, every record needs "
                                          f"{sorted(k for k, (_, r) in fields.items() if r)}", column=key)
            continue
        arrow_type = schema.field(key).type
        py = _arrow_python_type(arrow_type)
        ok = not required if py is type(None) else py in types
        if not ok:
            expected = " or ".join(t.__name__ for t in types)
            what = "holds only nulls" if py is type(None) else f"has Parquet type {arrow_type}"
            raise DataFileError(path, f"{what}, expected {expected}; fix the column's type where the file is "
                                      "written (or convert it with data_tools)", column=key)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _iter_parquet(path: str, fields: FieldSpec) -> Iterator[Tuple[str, Any, Optional[str]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(path, f"is not a readable Parquet file ({_one_line(e)}); it is truncated or not Parquet: "
                                  "download or write it again") from None
    _check_parquet_columns(path, schema, fields)
    row = 0
    batches = parquet.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise DataFileError(path, f"cannot be read after row {row} ({_one_line(e)}); the file is corrupt: "
                                      "download or write it again") from None
        if batch is None:
            return
        for record in batch.to_pylist():
            row += 1
            yield f"{path}[row {row}]", record, None


def _iter_raw(path: str, fields: FieldSpec, stats: Dict[str, int]) -> Iterator[Tuple[str, Any, Optional[str]]]:
    """Yield ``(location, parsed record or raw line, problem or None)``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if path.endswith(".parquet"):
        return _iter_parquet(path, fields)
    return _iter_jsonl(path, stats)


def read_records(path: str, fields: FieldSpec, *, on_error: str, rejects: RejectLog,
                 stats: Optional[Dict[str, int]] = None) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Yield ``(location, record)`` for each well-formed record of a JSONL or Parquet file.

    Args:
        path: ``.parquet`` files are read with pyarrow; anything else is JSONL.
        fields: the keys every record must (or may) have and their types.
        on_error: ``raise`` a ``RecordError`` on a malformed record, or ``skip`` it into ``rejects``.
        rejects: where skipped records are counted and written.
        stats: counters updated in place (``num_read``, ``num_blank_lines``).

    Raises:
        DataFileError: a Parquet file that cannot be read, or a column of the wrong type.
    """
    if on_error not in ON_ERROR_MODES:
        raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
    stats = stats if stats is not None else collections.Counter()
    for location, record, problem in _iter_raw(path, fields, stats):
        stats["num_read"] += 1
        problem = (None, problem) if problem else check_fields(record, fields)
        if problem is None:
            yield location, record
            continue
        key, message = problem
        if on_error == "raise":
            raise RecordError(location, message, key)
        rejects.add(location, "malformed", record, key=key, message=message)


def build_records(path: str, fields: FieldSpec, build: Callable[[Dict[str, Any]], Any], *, on_error: str,
                  rejects: RejectLog, stats: Optional[Dict[str, int]] = None
                  ) -> Iterator[Tuple[str, Dict[str, Any], Any]]:
    """``read_records``, then ``build(record)``: yield ``(location, record, built)`` for each record built.

    ``build`` may raise ``SkipRecord`` (policy skip, always counted and written out) or ``ValueError``
    (a malformed record, subject to ``on_error``). Every reader of records (datasets, converters) goes
    through here, so they all count and write out the same way.
    """
    for location, record in read_records(path, fields, on_error=on_error, rejects=rejects, stats=stats):
        try:
            built = build(record)
        except SkipRecord as skip:
            rejects.add(location, skip.reason, record, key=skip.key, message=skip.message)
            continue
        except ValueError as e:
            if on_error == "raise":
                raise RecordError(location, str(e)) from e
            rejects.add(location, "malformed", record, message=str(e))
            continue
        yield location, record, built


def load_examples(path: str, fields: FieldSpec, build: Callable[[Dict[str, Any]], Any], *, on_error: str,
                  rejects_path: Optional[str]) -> Tuple[List[Any], Dict[str, Any]]:
    """Read ``path`` and turn each record into an example with ``build(record)`` (see ``build_records``).

    Returns the examples (``source`` set to each record's location) and the stats.
    """
    stats: Dict[str, int] = collections.Counter()
    with RejectLog(rejects_path) as rejects:
        examples = [dataclasses.replace(example, source=location) for location, _, example in
                    build_records(path, fields, build, on_error=on_error, rejects=rejects, stats=stats)]
    summary: Dict[str, Any] = {"path": path, "num_read": stats["num_read"], "num_examples": len(examples),
                               "num_blank_lines": stats["num_blank_lines"], "num_rejected": rejects.total,
                               "rejected_by_reason": dict(rejects.counts), "rejects_path": rejects_path,
                               "rejects": rejects.records}
    return examples, summary


class ExampleDataset(Sequence):
    """Examples of one file and the ``stats`` of reading it (read, kept, rejected by reason, ...)."""

    def __init__(self, examples: List[Any], stats: Dict[str, Any]):
        self.examples = examples
        self.stats = stats

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def encode_prompt(tokenizer: Tokenizer, prompt: str, apply_chat_template: bool) -> List[int]:
    """Token ids of a prompt, rendered as one user turn when ``apply_chat_template``."""
    if apply_chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def fit_prompt(ids: List[int], max_prompt_length: int, prompt_truncation: str) -> Tuple[List[int], bool]:
    """Apply the prompt length policy; returns ``(ids, truncated)`` or raises ``SkipRecord``.

    ``truncate_left`` keeps the last ``max_prompt_length`` tokens, the ones next to the response.
    """
    if len(ids) <= max_prompt_length:
        return ids, False
    if prompt_truncation == "truncate_left":
        return ids[-max_prompt_length:], True
    if prompt_truncation == "skip":
        raise SkipRecord("prompt_too_long", f"prompt has {len(ids)} tokens > max_prompt_length={max_prompt_length}",
                         key="prompt")
    raise ValueError(f"prompt_truncation must be one of {PROMPT_TRUNCATION_MODES}, got {prompt_truncation!r}")


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One rollout prompt.

    Attributes:
        prompt: the prompt text as written in the file.
        prompt_ids: token ids fed to the policy, ``[p]`` with p <= max_prompt_length.
        ground_truth: reference answer for rule rewards, or None.
        category: an optional label of the prompt's kind; evaluation reports the gold score per category.
        truncated: whether the prompt was cut on the left.
        source: ``file:line`` of the record.
    """

    prompt: str
    prompt_ids: List[int]
    ground_truth: Optional[str] = None
    category: Optional[str] = None
    truncated: bool = False
    source: str = ""


PROMPT_FIELDS: FieldSpec = {"prompt": ((str,), True), "ground_truth": ((str,), False), "category": ((str,), False)}


class PromptDataset(ExampleDataset):
    """Tokenised rollout prompts. ``stats`` holds counts of read, kept, truncated and rejected records."""

    @classmethod
    def load(cls, path: str, tokenizer: Tokenizer, *, max_prompt_length: int, prompt_truncation: str = "truncate_left",
             on_error: str = "raise", rejects_path: Optional[str] = None,
             apply_chat_template: bool = False) -> "PromptDataset":
        """Read ``{"prompt": str, "ground_truth"?: str, "category"?: str}`` records from JSONL or Parquet."""

        def build(record):
            ids = encode_prompt(tokenizer, record["prompt"], apply_chat_template)
            ids, truncated = fit_prompt(ids, max_prompt_length, prompt_truncation)
            return PromptExample(prompt=record["prompt"], prompt_ids=ids, ground_truth=record.get("ground_truth"),
                                 category=record.get("category"), truncated=truncated)

        examples, stats = load_examples(path, PROMPT_FIELDS, build, on_error=on_error, rejects_path=rejects_path)
        stats["num_truncated"] = sum(e.truncated for e in examples)
        return cls(examples, stats)

    @classmethod
    def from_config(cls, cfg, tokenizer: Tokenizer, *, rejects_dir: Optional[str], split: str = "train") -> "PromptDataset":
        """Load ``cfg.prompt_path`` (split ``train``), ``cfg.eval_prompt_path`` (``eval``) or
        ``cfg.adversarial_prompt_path`` (``adversarial``).

        Args:
            cfg: the ``DataConfig`` (paths already resolved by the config loader).
            rejects_dir: ``cfg.rejects_dir`` or ``<run_dir>/rejects``, chosen by the caller.
        """
        key = {"train": "prompt_path", "eval": "eval_prompt_path", "adversarial": "adversarial_prompt_path"}[split]
        path = getattr(cfg, key)
        if path is None:
            raise ValueError(f"data.{key} is not set; set it to load the {split!r} prompts")
        return cls.load(path, tokenizer, max_prompt_length=cfg.max_prompt_length,
                        prompt_truncation=cfg.prompt_truncation, on_error=cfg.on_error,
                        rejects_path=rejects_path_for(rejects_dir, path), apply_chat_template=cfg.apply_chat_template)
