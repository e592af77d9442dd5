"""`python -m extproc` runs the prefix-epp CLI."""

from extproc.commands.main import main

if __name__ == "__main__":
    raise SystemExit(main())
