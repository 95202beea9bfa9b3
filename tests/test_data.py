"""Training data: every source format, the split by document, and batches as pure functions of an index."""

from __future__ import annotations

import json

import numpy as np
import pytest

from amsp_jax.run import data


def test_stdlib_corpus_is_byte_text_split_by_file():
    files = data.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in f.parts for f in files)
    corpus = data.load_corpus()
    assert corpus.vocab_size == 256 and corpus.documents == len([f for f in files if f.stat().st_size])
    assert corpus.train.dtype == np.uint8
    # Every 20th file is held out whole: the held-out stream is about a twentieth of the bytes.
    assert 0.02 < len(corpus.held_out) / (len(corpus.train) + len(corpus.held_out)) < 0.1
    held_out_file = [f for f in files if f.stat().st_size][19].read_bytes()
    assert corpus.held_out[: len(held_out_file)].tobytes() == held_out_file


def test_text_directory_and_json_lines(tmp_path):
    (tmp_path / "texts").mkdir()
    for i in range(4):
        (tmp_path / "texts" / f"{i}.txt").write_text(f"document {i} " * 20)
    (tmp_path / "texts" / ".hidden").write_text("not data")
    lines = [json.dumps({"text": f"line {i} é"}) for i in range(6)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n\n")
    corpus = data.load_corpus([tmp_path / "texts", tmp_path / "docs.jsonl"], held_out_every=5)
    assert corpus.documents == 10
    assert corpus.vocab_size == 256
    # Documents 4 and 9 (0-based) are held out: the first JSON line and the last.
    assert corpus.held_out.tobytes() == ("line 0 é" + "line 5 é").encode()
    assert b"not data" not in corpus.train.tobytes()


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_memory_mapped_token_file(tmp_path, suffix):
    tokens = np.arange(1000, dtype=np.uint16) % 500
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    corpus = data.load_corpus([path], held_out_every=10)
    assert corpus.vocab_size is None
    assert isinstance(corpus.train, np.memmap)
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.held_out]), tokens)
    assert len(corpus.held_out) == 100


def test_batches_are_pure_functions_of_seed_and_index():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = data.train_batch(tokens, 7, 8, 16, (1, 2))
    b = data.train_batch(tokens, 7, 8, 16, (1, 2))
    c = data.train_batch(tokens, 8, 8, 16, (1, 2))
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert a["inputs"].dtype == np.int32 and a["inputs"].shape == (8, 16)
    held = data.eval_batches(tokens, 3, 4, 16)
    assert len(held) == 3 and held[0]["inputs"][0, 0] == 0 and held[-1]["targets"][-1, -1] == 9999


def test_bad_data_is_a_clear_error(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("text")
    np.save(tmp_path / "mixed" / "b.npy", np.arange(3))
    cases = {
        "missing": "data path does not exist",
        "bad.jsonl": "line 1 has no string 'text' field",
        "odd.bin": "not a whole number of uint16 tokens",
        "empty": "no files found",
        "mixed": "mixes token files",
    }
    for name, message in cases.items():
        with pytest.raises(data.DataError, match=message):
            data.load_corpus([tmp_path / name])


def test_tokens_outside_the_vocabulary_and_too_little_data():
    batch = {"inputs": np.array([[1, 300]]), "targets": np.array([[2, 3]])}
    with pytest.raises(data.DataError, match="token id 300 is outside the model's vocabulary of 256"):
        data.check_vocab(batch, 256)
    with pytest.raises(data.DataError, match="fewer than one sequence of 64"):
        data.train_batch(np.arange(10), 0, 2, 64, (0,))
