"""Print the command lines of the README's Quickstart section, for CI to run verbatim (.ci/run).

Reads the ```bash blocks between "## Quickstart" and the next "## " heading of
README.md (or the file given) and prints their lines, one command a line;
fails if the section or its commands are missing. So the commands CI runs are
the ones a reader copies:

    python scripts/ci/readme_quickstart.py > quickstart.sh && bash -euo pipefail quickstart.sh
"""

import argparse
import os
import re
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
HEADING = "## Quickstart"


def quickstart_lines(text):
    """Return the lines of the ```bash blocks in ``text``'s Quickstart section; ValueError if there are none."""
    start = text.find(f"\n{HEADING}\n")
    if start < 0:
        raise ValueError(f"README has no line {HEADING!r}")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    blocks = re.findall(r"^```bash\n(.*?)^```$", section, flags=re.S | re.M)
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"README's {HEADING!r} section has no ```bash block")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("readme", nargs="?", default=README, help="the README to read (default: this checkout's)")
    args = parser.parse_args(argv)
    with open(args.readme, encoding="utf-8") as file:
        text = file.read()
    try:
        lines = quickstart_lines(text)
    except ValueError as error:
        print(f"readme_quickstart: {args.readme}: {error}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
