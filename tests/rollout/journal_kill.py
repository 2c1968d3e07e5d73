"""`python tests/rollout/journal_kill.py N ARGS...`: the seer-jax CLI with ARGS, SIGKILLed right
after its journal's Nth record is written (a deterministic crash for the resume tests; the
production journal writer knows nothing of it)."""

import os
import signal
import sys

from seer_jax import cli
from seer_jax.rollout.core import journal


def main() -> int:
    kill_after = int(sys.argv[1])
    write = journal.JournalWriter._write

    def write_then_die(self, record):
        write(self, record)
        if self.records >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    journal.JournalWriter._write = write_then_die
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
