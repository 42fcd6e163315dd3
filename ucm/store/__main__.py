"""``python -m ucm.store <command>``: the operator CLI of a Posix store (see :mod:`ucm.store.cli`)."""

from ucm.store.cli import main

raise SystemExit(main())
