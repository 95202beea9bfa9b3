"""Training text as token streams, and batches drawn from them by index.

Sources: byte-level text (vocabulary 256; by default the Python standard library's own `*.py` files,
present on every machine), JSON lines with a `text` field, or a memory-mapped token file (`.npy`, or a
raw `.bin` of uint16/int32 tokens). Documents (files, JSON lines) are split into training and held-out
sets by document, so the held-out loss measures text the model never saw. A training batch is a pure
function of (seed, batch index): the data position saved in a checkpoint is just that index, and every
process of a multi-host run builds the same global batch without talking to the others.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from amsp_jax.errors import AmspError, one_line

BYTE_VOCAB = 256
TOKEN_SUFFIXES = (".npy", ".bin")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TOKEN_DTYPES = ("uint16", "int32")


class DataError(AmspError):
    """Training data that cannot be read or does not fit the run."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and held-out token streams (1-D integer arrays, possibly memory-mapped)."""

    train: np.ndarray
    held_out: np.ndarray
    vocab_size: int | None
    """256 for byte-level text; None for token files (the model's vocabulary must cover them)."""
    source: str
    documents: int
    largest_token: int = BYTE_VOCAB - 1
    """The largest token id in the data (the model's vocabulary must exceed it)."""

    def describe(self) -> str:
        """One line: where the tokens come from and how they are split."""
        return (
            f"{self.source}: {self.documents} documents, {len(self.train):,} training and "
            f"{len(self.held_out):,} held-out tokens"
        )


def stdlib_files() -> list[Path]:
    """The standard library's own `*.py` files, sorted (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def _files_under(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    return [path]


def _json_documents(path: Path) -> list[np.ndarray]:
    documents = []
    with path.open(encoding="utf-8") as lines:
        for number, line in _numbered_lines(path, lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path} line {number} is not JSON ({error}); give one object per line"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path} line {number} has no string 'text' field; each line needs one")
            documents.append(np.frombuffer(record["text"].encode("utf-8"), np.uint8))
    return documents


def _numbered_lines(path: Path, lines: Any) -> Iterator[tuple[int, str]]:
    try:
        yield from enumerate(lines, 1)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); JSON lines must be text, "
            "and token files end in .npy or .bin"
        ) from None


def _token_file(path: Path, dtype: str) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros((0,), np.int32)
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as error:
            raise DataError(
                f"{path} is not a NumPy .npy array ({one_line(error)}); write token ids with numpy.save, "
                "or give raw uint16/int32 tokens as a .bin file"
            ) from None
    else:
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"token dtype {dtype!r} is not supported; use one of {TOKEN_DTYPES}")
        itemsize = np.dtype(dtype).itemsize
        if path.stat().st_size % itemsize:
            raise DataError(
                f"{path} has {path.stat().st_size} bytes, not a whole number of {dtype} tokens; "
                "check the token dtype (--data-dtype)"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path} holds {tokens.dtype} of shape {tokens.shape}; a token file is 1-D integers")
    if len(tokens) and tokens.min() < 0:
        raise DataError(f"{path} holds negative token ids (e.g. {tokens.min()}); token ids start at 0")
    return tokens


def _split(documents: list[np.ndarray], held_out_every: int) -> tuple[np.ndarray, np.ndarray]:
    """Every `held_out_every`-th document is held out; a lone document gives up its tail instead."""
    if len(documents) == 1:
        tokens = documents[0]
        cut = len(tokens) - len(tokens) // held_out_every
        return tokens[:cut], tokens[cut:]
    held = [d for i, d in enumerate(documents) if i % held_out_every == held_out_every - 1]
    train = [d for i, d in enumerate(documents) if i % held_out_every != held_out_every - 1]
    if not held:
        held, train = train[-1:], train[:-1]
    return np.concatenate(train), np.concatenate(held)


def load_corpus(
    paths: Sequence[str | Path] = (), held_out_every: int = 20, token_dtype: str = "uint16"
) -> Corpus:
    """Read `paths` (files or directories; none: the standard library's sources) into a split corpus."""
    if held_out_every < 2:
        raise DataError(f"held_out_every must be at least 2, got {held_out_every}")
    if not paths:
        files = stdlib_files()
        source = f"Python {sysconfig.get_python_version()} standard library sources (bytes)"
    else:
        missing = [str(p) for p in paths if not Path(p).exists()]
        if missing:
            raise DataError(f"data path does not exist: {', '.join(missing)}; check --data")
        files = [f for p in paths for f in _files_under(Path(p))]
        source = ", ".join(str(p) for p in paths)
    if not files:
        raise DataError(f"no files found in {source}; give text, JSON lines or token files")
    token_files = [f for f in files if f.suffix in TOKEN_SUFFIXES]
    if token_files and len(token_files) != len(files):
        raise DataError(
            f"{source} mixes token files ({token_files[0].name}) with byte-level text; "
            "give either token files or text"
        )
    documents: list[np.ndarray] = []
    for f in files:
        if f.suffix in TOKEN_SUFFIXES:
            documents.append(_token_file(f, token_dtype))
        elif f.suffix in JSONL_SUFFIXES:
            documents += _json_documents(f)
        else:
            documents.append(np.frombuffer(f.read_bytes(), np.uint8))
    documents = [d for d in documents if len(d)]
    if not documents:
        raise DataError(f"{source} holds no tokens")
    train, held_out = _split(documents, held_out_every)
    # One pass over the tokens (memory-mapped files included), so that ids outside the model's
    # vocabulary fail before the run writes anything instead of at the step that draws them.
    largest = max(int(d.max()) for d in documents) if token_files else BYTE_VOCAB - 1
    return Corpus(train, held_out, None if token_files else BYTE_VOCAB, source, len(documents), largest)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    windows = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts]).astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def check_fits(tokens: np.ndarray, seq_len: int, name: str) -> None:
    """Raise a DataError when `tokens` cannot hold one window of `seq_len` + 1 tokens."""
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the {name} split has {len(tokens)} tokens, fewer than one sequence of {seq_len} + 1; "
            "give more data or a shorter seq_len"
        )


def train_batch(
    tokens: np.ndarray, index: int, batch_size: int, seq_len: int, seed: Sequence[int]
) -> dict[str, np.ndarray]:
    """Training batch number `index`: random windows, a pure function of (`seed`, `index`)."""
    check_fits(tokens, seq_len, "training")
    rng = np.random.default_rng([*(int(s) for s in seed), index])
    starts = rng.integers(0, len(tokens) - seq_len, batch_size)
    return _windows(tokens, starts, seq_len)


def eval_batches(
    tokens: np.ndarray, count: int, batch_size: int, seq_len: int
) -> list[dict[str, np.ndarray]]:
    """`count` fixed batches of windows spread evenly over the held-out stream."""
    check_fits(tokens, seq_len, "held-out")
    starts = np.linspace(0, len(tokens) - seq_len - 1, count * batch_size).astype(np.int64)
    return [_windows(tokens, chunk, seq_len) for chunk in np.split(starts, count)]


def check_vocab(batch: dict[str, np.ndarray], vocab_size: int) -> None:
    """Raise a DataError when a token id is outside the model's vocabulary."""
    largest = int(max(batch["inputs"].max(), batch["targets"].max()))
    if largest >= vocab_size:
        raise DataError(
            f"token id {largest} is outside the model's vocabulary of {vocab_size}; "
            "use a model config with a larger vocab_size or check the token dtype"
        )
