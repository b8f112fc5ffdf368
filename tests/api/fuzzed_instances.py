"""Prediction instances as fuzzers draw them: the job's own fields and some others, with values
of every JSON type (shared by the REST and gRPC fuzzing of a serving replica)."""

from __future__ import annotations

from hypothesis import strategies as st

from trillium.job import CRITEO_COLUMNS

FIELDS = [*CRITEO_COLUMNS[1:], "nested.field", "label"]
# Values of every JSON type; a float is finite, as JSON has no NaN or Infinity (the client
# refuses to send one: a [inf] instance failed the test on the client's side).
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.lists(st.one_of(st.text(max_size=8), st.integers(), st.none()), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
INSTANCES = st.lists(st.one_of(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=12), VALUES), max_size=20)
