"""``python -m ucm.store <command>``: the operator CLI of a Posix store (see :mod:`ucm.store.cli`).

A closed output pipe (``python -m ucm.store stats | head -1``) ends the process quietly by SIGPIPE, as it ends
``ls`` or ``cat`` (status 141 in a shell), instead of Python's ``BrokenPipeError`` traceback: Python ignores SIGPIPE
unless told otherwise. Every change the CLI makes is one file deletion at a time, so no state is left half done.
"""

import signal

from ucm.store.cli import main

signal.signal(signal.SIGPIPE, signal.SIG_DFL)
raise SystemExit(main())
