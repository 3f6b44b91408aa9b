"""A batch run's output file: which lines it already holds, the record of what produced it, and its
rewrite in input order.

The output is appended to as jobs end, so an interrupted run leaves a valid file and a rerun resumes.
A line's outcome is its last record: a failed line retried on a rerun appends its new outcome, and the
rewrite (`--ordered`, or after a rerun retried lines) keeps one record per line.

Beside it, `<output>.jobs` (the `Journal`) names the job of each line in flight, written before the job
is submitted: a client killed outright (SIGKILL, a lost machine) leaves jobs that go on running, and the
rerun collects their results instead of generating them again.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


def json_line(record: dict) -> str:
    """A record as one line of a UTF-8 file: non-ASCII text as is, unless the record holds a lone
    surrogate (a JSON "\\ud83d" from an emoji cut in two), which UTF-8 cannot hold: then escaped, so
    that it reads back as the same string (the line's id, its columns) instead of failing the write."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(record)
    return line + "\n"


def line_id_of(record: dict) -> str:
    return str(record["custom_id"] if "custom_id" in record else record["id"])


def succeeded(record: dict) -> bool:
    """Whether a record is a result: weightq's own lines carry "result", OpenAI's a 200 response."""
    if record.get("error"):
        return False
    response = record.get("response")
    return "result" in record or (isinstance(response, dict) and response.get("status_code") == 200)


def cut_torn_line(output: Path) -> None:
    """A run killed mid-write leaves a last line without its newline: cut it (its line runs again)."""
    with open(output, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if not size:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        pos = size - 1
        while pos > 0:  # find the last newline and truncate after it
            step = min(65536, pos)
            f.seek(pos - step)
            nl = f.read(step).rfind(b"\n")
            if nl >= 0:
                pos = pos - step + nl + 1
                break
            pos -= step
        f.truncate(max(pos, 0))


def outcomes(output: Path) -> dict[str, bool]:
    """Each line id the output holds an outcome for (`custom_id` of OpenAI's lines, else `id`), and
    whether its last outcome is a result. A torn last line is cut first."""
    if not output.exists():
        return {}
    cut_torn_line(output)
    last: dict[str, bool] = {}
    with open(output, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                last[line_id_of(record)] = succeeded(record)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return last


def foreign_line(output: Path) -> int | None:
    """The number of the output's first whole line that is no record of `weightq batch` (an id with a
    result, an error or OpenAI's response), or None: an output without its RunRecord is still one of
    ours when every line is a record, and a data set given as the output is not."""
    with open(output, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.endswith("\n"):
                return None  # a torn last line: cut_torn_line's
            try:
                record = json.loads(line)
                line_id_of(record)
            except (ValueError, KeyError, TypeError):
                return n
            if not isinstance(record, dict) or not {"result", "error", "response"} & record.keys():
                return n
    return None


def done_ids(output: Path, failed: bool = True) -> set[str]:
    """Line ids the output holds an outcome for: all of them, or (failed=False) those whose last
    outcome is a result, so that failed lines run again."""
    return {i for i, ok in outcomes(output).items() if ok or failed}


def write_in_input_order(output: Path, order: list[str]) -> int:
    """Rewrite the output with one record per line, the last one, in `order` (the input's line ids;
    ids not in it follow in the order they were written). Atomic: a crash leaves the old file.
    Returns the records written. Holds the records' offsets, not the records."""
    where: dict[str, tuple[int, int]] = {}
    with open(output, "rb") as f:
        offset = 0
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):  # not a record: dropped
                where[line_id_of(json.loads(line))] = (offset, len(line))
            offset += len(line)
    ranked = [i for i in dict.fromkeys(order) if i in where]
    placed = set(ranked)
    ranked += [i for i in where if i not in placed]
    tmp = output.with_name(output.name + ".ordering")
    with open(output, "rb") as src, open(tmp, "wb") as dst:
        for line_id in ranked:
            start, size = where[line_id]
            src.seek(start)
            dst.write(src.read(size))
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, output)
    return len(ranked)


@dataclass(frozen=True)
class RunRecord:
    """What produced an output file, kept beside it (`<output>.run.json`): a rerun against another
    input or other parameters is named, not resumed as if nothing had changed."""

    input_sha256: str
    priority: int
    model: str

    @staticmethod
    def path(output: Path) -> Path:
        return output.with_name(output.name + ".run.json")

    def changes_from(self, output: Path) -> list[str]:
        """What differs from the run that started `output` (none when there was none)."""
        try:
            was = json.loads(self.path(output).read_text())
        except (OSError, ValueError):
            return []
        names = {"input_sha256": "the input file's contents", "priority": "--priority", "model": "the served model"}
        return [
            f"{names[k]} ({was.get(k)!r} then, {v!r} now)"
            for k, v in asdict(self).items()
            if was.get(k) not in (None, v)
        ]

    def save(self, output: Path) -> None:
        self.path(output).write_text(json.dumps(asdict(self)) + "\n")


class Journal:
    """`<output>.jobs`: a line {"id", "job"} for each line's job, written (and flushed) before the job is
    submitted, and {"end": job} once its outcome is in the output. The jobs submitted and not ended are
    in flight, or ended while their client was dead: a rerun collects them (`pending`). A machine that
    loses its page cache may lose the last entries; their lines then run again."""

    def __init__(self, output: Path) -> None:
        self.path = self.of(output)
        self.file = None

    @staticmethod
    def of(output: Path) -> Path:
        return output.with_name(output.name + ".jobs")

    def pending(self) -> dict[str, str]:
        """line id -> the job of its last submission that has not ended (a torn last entry is skipped)."""
        if not self.path.exists():
            return {}
        latest: dict[str, str] = {}
        ended: set[str] = set()
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    if "end" in entry:
                        ended.add(str(entry["end"]))
                    else:
                        latest[str(entry["id"])] = str(entry["job"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
        return {line_id: job for line_id, job in latest.items() if job not in ended}

    def submitted(self, line_id: str, job_id: str) -> None:
        self._write({"id": line_id, "job": job_id})

    def ended(self, job_id: str) -> None:
        self._write({"end": job_id})

    def _write(self, entry: dict) -> None:
        if self.file is None:
            if self.path.exists():
                cut_torn_line(self.path)
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.file.write(json_line(entry))
        self.file.flush()

    def close(self, finished: bool) -> None:
        """`finished`: the run ended with nothing in flight, so the journal names nothing to collect."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if finished:
            self.path.unlink(missing_ok=True)
