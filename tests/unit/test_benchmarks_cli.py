"""``python -m benchmarks``'s part selection (CPU: no part runs)."""

import argparse

import pytest

from benchmarks.__main__ import PARTS, _parts


def test_only_takes_a_comma_separated_list_of_known_parts():
    assert _parts("models") == {"models"}
    assert _parts("models, graphed,profile") == {"models", "graphed", "profile"}
    assert _parts(",".join(PARTS)) == set(PARTS)


@pytest.mark.parametrize("text", ["modles", "models,nope", ",", ""])
def test_only_rejects_unknown_or_empty_selections(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _parts(text)
