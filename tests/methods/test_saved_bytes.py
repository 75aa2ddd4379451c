"""Saved bytes do not change: every method's saved tensors on a tiny random Llama are bit-identical to
the digests recorded before the architecture change (``tests/methods/saved_bytes.py``)."""

import json

import pytest

from tests.methods.saved_bytes import CASES, GOLDEN, saved_digests


@pytest.mark.parametrize("case", sorted(CASES))
def test_saved_tensors_are_bit_identical(case, tmp_path):
    want = json.loads(GOLDEN.read_text())[case]
    got = saved_digests(case, tmp_path)
    assert sorted(got) == sorted(want), "the saved tensor names changed"
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{case}: saved bytes changed in {changed[:5]}"
