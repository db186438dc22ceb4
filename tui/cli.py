"""`minibatch-chat`: the terminal chat's command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("minibatch-chat: the chat app is not part of this build yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
