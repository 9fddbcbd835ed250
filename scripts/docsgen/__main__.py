"""`python -m scripts.docsgen [--out DOCS_DIR]`: regenerate the generated pages of the documentation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.docsgen.pages import DOCS, write_pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.docsgen", description=__doc__)
    parser.add_argument("--out", type=Path, default=DOCS, help="the docs folder to write into")
    args = parser.parse_args(argv)
    for path in write_pages(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
