"""Committed sample files of every codec and format version still load exactly."""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest

import spilld
from spilld.codecs import default_provider
from tests.caches import live, same
from tests.golden_cases import GOLDEN, GOLDEN_TOKENS

DATA = os.path.join(os.path.dirname(__file__), "data")
FILES = sorted(glob.glob(os.path.join(DATA, "v*", "*.spilld")))


def test_every_codec_has_a_golden_file() -> None:
    kinds = {os.path.basename(f).removesuffix(".spilld") for f in FILES}
    assert kinds >= set(default_provider().kinds)


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, DATA))
def test_golden_file_loads_exactly(path: str, tmp_path: Any) -> None:
    kind = os.path.basename(path).removesuffix(".spilld")
    got = spilld.load(path, expect={"model_id": "golden", "namespace": "ns"})
    assert got.tokens == GOLDEN_TOKENS and got.meta == {"case": kind}
    want = GOLDEN[kind]()
    assert len(got.caches) == len(want)
    for a, b in zip(got.caches, want, strict=True):
        assert type(a) is type(b)
        assert same(live(a), live(b))
    # a re-save of what was loaded gives the very same tensor hashes
    again = spilld.save(tmp_path / "again", got.tokens, got.caches).header
    assert [s.hash for s in again.slots()] == [s.hash for s in got.header.slots()]
