"""The long-stream window bound of tests/properties/test_window_properties.py at 10,000 positions."""

import pytest

from tests.properties.test_window_properties import test_long_stream_retained_bounded as long_stream


@pytest.mark.parametrize("policy,n_positions", [("windows", 10_000)])
def test_long_stream_retained_bounded(tmp_path, policy, n_positions):
    """The property of :func:`~tests.properties.test_window_properties.test_long_stream_retained_bounded`
    (retained artifacts never exceed the live windows' sizes) over a ten times longer stream."""
    long_stream(tmp_path, policy, n_positions)
