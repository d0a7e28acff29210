"""StreamCaps: per-identity and total caps of concurrent streams."""

from __future__ import annotations

import pytest

from coordinator.core.errors import ResourceExhaustedError
from coordinator.core.stream_caps import StreamCaps

pytestmark = pytest.mark.timeout(10)


def test_caps_per_identity_and_in_all() -> None:
    caps = StreamCaps("Watch", per_identity=2, total=3, flag="--max-watch")
    with caps.hold("a"), caps.hold("a"):
        with pytest.raises(ResourceExhaustedError, match="at most 2 per identity .--max-watch"):
            caps.acquire("a")
        with caps.hold("b"):
            assert caps.open_streams() == 3 and caps.open_streams("a") == 2
            with pytest.raises(ResourceExhaustedError, match="at most 3 .* in all"):
                caps.acquire("c")
        caps.acquire("c")
        caps.release("c")
    assert caps.open_streams() == 0 and caps.open_streams("a") == 0
    caps.release("nobody")  # releasing what was never held changes nothing
    assert caps.open_streams() == 0


def test_a_refused_stream_is_not_counted() -> None:
    caps = StreamCaps("Upload", per_identity=1, total=1, flag="--max-upload")
    with caps.hold("a"):
        for who in ("a", "b"):
            with pytest.raises(ResourceExhaustedError):
                with caps.hold(who):
                    pass
        assert caps.open_streams() == 1
    with caps.hold("b"):
        assert caps.open_streams("b") == 1
