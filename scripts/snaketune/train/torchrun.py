"""The torchrun agent of one node, as the launcher starts it (``python -m
snaketune.train.torchrun``: torchrun's own main, two of its words changed).

- A stop by a signal (Ctrl-C or SIGTERM passed on by the launcher: a stop the workers saved
  for) is an exit code and one line, not torchrun's traceback.
- At the end of a multi-node run, the agent of the node that holds the rendezvous store
  (the first node's) may end before the others have said they are leaving; torchrun then
  warns on each other node that it "failed to shutdown the rendezvous due to an error of
  type RendezvousConnectionError". Nothing failed: that line is replaced by one that says so.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

RENDEZVOUS_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


class StoreGoneAtShutdown(logging.Filter):
    """torchrun's warning that a node's shutdown notice found no rendezvous store, said as
    what it is (the store's agent ended first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "has failed to shutdown the rendezvous" in text and "RendezvousConnection" in text:
            record.msg = (
                "rendezvous: this node's agent is leaving after the first node's, "
                "whose agent held the rendezvous store and has ended: nothing to "
                "tell it (torchrun's RendezvousConnectionError at shutdown; not a "
                "failure)"
            )
            record.args = ()
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_torchrun() -> int:
    """torchrun's main, a stop by a signal an exit code, its shutdown warning explained."""
    from snaketune.core.imports import loading

    with loading():  # torch's: no collections meanwhile
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.run import main

    logging.getLogger(RENDEZVOUS_LOGGER).addFilter(StoreGoneAtShutdown())
    try:
        main()
    except SignalException as exc:
        print(
            f"torchrun agent (PID {os.getpid()}): stopped by {signal.Signals(exc.sigval).name}",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    from snaketune.core.imports import hold_time_warning

    hold_time_warning(block=False)  # noted until torchrun handles it (passes it on)
    sys.exit(quiet_torchrun())
