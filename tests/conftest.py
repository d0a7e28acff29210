"""Session-wide test setup."""

from __future__ import annotations

import signal


def pytest_configure() -> None:
    # The suite sends SIGINT (Ctrl-C) to the CLI processes it starts. A run launched as a
    # background job of a non-interactive shell starts with SIGINT ignored, an ignored signal
    # stays ignored across exec, and Python then installs no KeyboardInterrupt handler: those
    # tests would see Ctrl-C do nothing. A handler here is reset to the default on exec, so
    # every process the suite starts gets SIGINT as a user's terminal would deliver it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
